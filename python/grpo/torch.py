"""grpo.torch: the fused GRPO LM-head loss as PyTorch autograd ops (CPU).

- `LmHeadGRPOLoss`: a drop-in for Liger-Kernel 0.8.5's
  `LigerFusedLinearGRPOLoss` (same constructor and forward arguments, same
  return value: `(loss, (kl_mean if beta != 0, clip_ratio))`).
- `lm_head_grpo_loss`: the functional form with grpo's own semantics and
  every output (per-token logp, entropy, KL, all metrics).
- `fused_log_probs`: per-token log-probabilities and entropy of an LM head
  (the generic log-prob head), differentiable for any loss computed on them
  in Python; what TRL's fused LM head computes. Its backward runs the C++
  head's backward from the upstream gradients (the loss ops above compute
  theirs in forward instead).

The loss ops run the C++ fused kernel once in forward: it computes the loss
and the gradients of hidden, weight and bias together (the [N, V] logits
never exist), writes them in each parameter's dtype, scaled by the call's
normalizer, and adds dW straight into an existing weight.grad; backward hands
them to autograd (_Step says how, and what grad_output != 1, retain_graph or
a zero_grad between forward and backward do). Large tensors (hidden, weight,
bias, the gradients) are passed to C++ without copies; the small per-token tensors
(ids, mask, advantages, log-probs) are converted to int32 / float32 when they
are not already. Plans are cached per shape / dtype / stride / config /
options in a `grpo.PlanCache` (the process-wide one unless `plan_cache` is
given), and share its workspace. The GIL is released while the kernel runs.
Threads: `num_threads`, else `torch.get_num_threads()`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
import weakref
from typing import Any, Optional

import torch

import grpo
from grpo import _core, _fields

__all__ = ["LinearCrossEntropyLoss", "LmHeadGRPOLoss", "LmHeadLossResult", "fused_log_probs", "linear_cross_entropy",
           "lm_head_grpo_loss", "release_gradient_memory", "set_gradient_memory_reuse"]

_LOSS_TYPES = _fields.LOSS_TYPES
_IS_LEVELS = _fields.IS_LEVELS
_FLOAT_DTYPES = {torch.float32: _core.DType.f32, torch.bfloat16: _core.DType.bf16}


# --------------------------------------------------------------------------
# Argument checks. Every refusal names the argument (as the caller spelled it)
# and happens before any output exists.
# --------------------------------------------------------------------------


def _refuse(argument: str, message: str, kind: type = grpo.Error) -> Exception:
    error = kind(f"grpo: invalid argument '{argument}': {message}")
    error.argument = argument
    return error


def _refused_keyword(refusal: _fields.Refusal, names: Optional[dict[str, str]] = None) -> Exception:
    """A keyword conversion's refusal (grpo/_fields.py) as grpo.Error, naming the keyword as the caller spelled it."""
    argument = (names or {}).get(refusal.argument, refusal.argument)
    return _refuse(argument, str(refusal).split(": ", 2)[-1])


def _check_cpu(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise _refuse(name, f"must be a torch.Tensor, got {type(t).__name__}", grpo.ArgumentTypeError)
    if t.device.type != "cpu":
        raise _refuse(name, f"must be a CPU tensor, got device '{t.device}'")
    if t.layout != torch.strided:
        raise _refuse(name, f"must be a strided (dense) tensor, got {t.layout}")


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise _refuse(name, f"must be float32 or bfloat16, got {t.dtype}", grpo.ArgumentTypeError)


def _check_shape(t: torch.Tensor, name: str, *shapes: tuple[int, ...]) -> None:
    if tuple(t.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise _refuse(name, f"has shape {list(t.shape)}, expected {expected}")


def _per_token(t: Optional[torch.Tensor], name: str, b: int, s: int, *, dtype=torch.float32,
               extra_shapes: tuple[tuple[int, ...], ...] = ()) -> Optional[torch.Tensor]:
    """A small [B, T] (or extra-shaped) tensor as a contiguous float32 / int32 one."""
    if t is None:
        return None
    _check_cpu(t, name)
    _check_shape(t, name, (b, s), *extra_shapes)
    if dtype == torch.int32:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise _refuse(name, f"must have an integer dtype, got {t.dtype}", grpo.ArgumentTypeError)
        converted = t.to(torch.int32)
        if t.dtype != torch.int32 and not torch.equal(converted.to(t.dtype), t):
            raise _refuse(name, "holds values outside the int32 range")
        return converted.contiguous()
    if t.dtype.is_complex:
        raise _refuse(name, f"must be real, got {t.dtype}", grpo.ArgumentTypeError)
    return t.detach().to(torch.float32).contiguous()


def _row_stride(m: torch.Tensor) -> int:
    # As the C++ binding computes it: a single row's stride means nothing.
    return m.stride(0) if m.shape[0] > 1 else m.shape[1]


def _as_rows(hidden: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """hidden [B, T, H] or [N, H] as an [N, H] view with unit inner stride.

    A view when the rows share one stride (contiguous, or a row-strided
    slice); a [B, T, H] slice whose sequences are not evenly spaced (e.g. the
    last T positions of longer sequences) is copied once.
    """
    if hidden.dim() not in (2, 3):
        raise _refuse(name, f"must be [B, T, H] or [B*T, H], got {hidden.dim()} dimensions")
    if hidden.shape[-1] > 1 and hidden.stride(-1) != 1:
        raise _refuse(name, f"must have unit inner stride, got {hidden.stride(-1)}")
    rows = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() == 3 else hidden
    if rows.shape[0] != n:
        raise _refuse(name, f"has {rows.shape[0]} rows, expected B*T = {n}")
    return rows


def _head_shape(b: int, s: int, h: int, v: int, dtype, has_bias: bool, bias_dtype, hidden_ld: int,
                weight_ld: int) -> _core.LmHeadShape:
    shape = _core.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = b, s, h, v
    shape.dtype = dtype
    shape.has_bias = has_bias
    shape.bias_dtype = bias_dtype
    shape.hidden_ld, shape.weight_ld = hidden_ld, weight_ld
    return shape


def _head_options(threads: int, forward_only: bool, frozen: bool, workspace_budget: Optional[int],
                  dtype, grad_filter=None) -> _core.LmHeadOptions:
    """The log-prob head's options: gradients in the inputs' dtype."""
    try:
        return _fields.head_options(dict(num_threads=threads, workspace_budget=workspace_budget,
                                         grad_filter=grad_filter),
                                    forward_only=forward_only, frozen_weight=frozen, dweight_dtype=dtype,
                                    dhidden_dtype=dtype)
    except _fields.Refusal as refusal:
        raise _refused_keyword(refusal) from None


# --------------------------------------------------------------------------
# The autograd op: the kernel computes the gradients in the forward (the only
# moment the logits exist), in each parameter's own dtype and already scaled
# by the call's normalizer (LmHeadInputs::grad_scale); backward hands them to
# autograd.
# --------------------------------------------------------------------------

# id(weight.grad) -> [weakref to it, calls whose forward added into it and whose backward has not run yet].
_PENDING: dict[int, list] = {}
_PENDING_LOCK = threading.Lock()
_RERUN_WARNED = False


# --------------------------------------------------------------------------
# Fresh gradient memory, reused across steps.
# --------------------------------------------------------------------------

_POOL: dict[tuple, torch.Tensor] = {}
_POOL_LOCK = threading.Lock()
_POOL_ENABLED = hasattr(torch._C, "_storage_Use_Count")


def _storage_free(base: torch.Tensor) -> bool:
    """Whether nothing but `base` (and this call's temporary storage handle) refers to base's memory."""
    return torch._C._storage_Use_Count(base.untyped_storage()._cdata) <= 2


def _fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized gradient buffer, like torch.empty, from memory an earlier step's gradient left.

    A step hands its fresh dW (and dhidden) to autograd, which makes it
    weight.grad; a trainer drops it at zero_grad(set_to_none=True) and the
    next step would map 1.2 GB (Qwen's bf16 head) of fresh pages and fault
    every one in (~0.5-1 s per GB here), which the C++ step, writing into
    reused outputs, does not pay. So the last buffer of each (shape, dtype)
    is kept, as a caching allocator would, and reused once nothing refers to
    its memory any more (not .grad, not a view, not a user's reference):
    callers get a view of it, which AccumulateGrad still steals (it counts
    references to the tensor, not to its memory). release_gradient_memory()
    returns it; set_gradient_memory_reuse(False) turns it off.
    """
    if not _POOL_ENABLED:
        return torch.empty(shape, dtype=dtype)
    key = (tuple(shape), dtype)
    with _POOL_LOCK:
        base = _POOL.get(key)
        if base is None or not _storage_free(base):
            base = torch.empty(shape, dtype=dtype)
            _POOL[key] = base
        return base.view(shape)


def release_gradient_memory() -> None:
    """Drops the gradient buffers kept for reuse (their memory is freed once no gradient uses it)."""
    with _POOL_LOCK:
        _POOL.clear()


def set_gradient_memory_reuse(enabled: bool) -> None:
    """Turns the reuse of gradient memory across steps (_fresh) on or off; off also releases it."""
    global _POOL_ENABLED
    _POOL_ENABLED = bool(enabled) and hasattr(torch._C, "_storage_Use_Count")
    if not _POOL_ENABLED:
        release_gradient_memory()


def _grad_target(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight.grad when the kernel can add this call's dW into it in place, else None.

    It must be a plain dense CPU tensor shaped like weight with unit inner
    stride, in weight's dtype or float32; and weight must carry no tensor hook
    (register_hook), since such a hook would see .grad's whole value, not this
    call's gradient alone (post-accumulate hooks and AccumulateGrad hooks, as
    DDP / FSDP use, are fine).
    """
    if not weight.is_leaf or not weight.requires_grad:  # before .grad: a non-leaf's .grad warns
        return None
    g = weight.grad
    if g is None or type(g) is not torch.Tensor:
        return None
    if g.device.type != "cpu" or g.layout != torch.strided or g.requires_grad or g.shape != weight.shape:
        return None
    if g.dtype not in (weight.dtype, torch.float32) or (g.shape[1] > 1 and g.stride(1) != 1):
        return None
    if g.shape[0] > 1 and g.stride(0) < g.shape[1]:
        return None
    if weight.dtype == torch.float32 and g.dtype != torch.float32:
        return None
    if getattr(weight, "_backward_hooks", None):
        return None
    return g


class _Step:
    """One call of the fused loss: how to run its kernel, and the gradients the forward's run left.

    Gradient destinations, chosen in the forward:
      fresh:    dW in a new tensor of weight's dtype; backward returns it and
                AccumulateGrad steals it into weight.grad (no copy: nothing
                else holds it any more) or adds it in place to an existing one.
      into:     weight.grad (E) existed: the kernel added dW into E directly
                (accumulate_weight_grads: no [V, H] temporary). backward makes
                AccumulateGrad fire without adding anything: it sets
                weight.grad = None and returns E, which AccumulateGrad steals
                straight back (no pass, no copy; its hooks and DDP's / FSDP's
                fire and see the accumulated .grad).
    dhidden and dbias are always fresh.

    grad_output g != 1 on the first backward: the fresh gradients are scaled
    in place (one pass in their own dtype); with `into`, the kernel runs
    again adding (g - 1) times this call's dW into E. A second backward
    (retain_graph=True), or a weight.grad that was cleared, replaced or
    modified between the forward and the backward (zero_grad between them),
    runs the kernel again with scale g: correct, at the cost of a second
    step.
    """

    def __init__(self, run, scale, hidden, weight, bias, dhidden, dweight, dbias, into):
        self.run = run  # run(grad_scale, dhidden, dweight, dbias, accumulate) -> None
        self.scale = scale
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.versions = (hidden._version, weight._version, None if bias is None else bias._version)
        self.dhidden, self.dweight, self.dbias = dhidden, dweight, dbias
        self.into = into
        self.into_version = None if into is None else into._version
        self.consumed = False
        if into is not None:
            with _PENDING_LOCK:
                entry = _PENDING.get(id(into))
                if entry is None or entry[0]() is not into:
                    entry = _PENDING[id(into)] = [weakref.ref(into), 0]
                entry[1] += 1

    def __del__(self):
        # A graph dropped before its backward: this call no longer holds
        # .grad's hand-over back, and .grad keeps the dW the forward added:
        # say so (a loss computed for logging only wants grad_into="new" or
        # torch.no_grad()).
        if self.into is not None and not self.consumed:
            try:
                self._release_pending()
                warnings.warn("grpo: a fused loss whose forward added its dW into weight.grad was dropped without "
                              "backward; weight.grad keeps that dW (use torch.no_grad() or grad_into='new' for a "
                              "loss you do not backpropagate)", RuntimeWarning, stacklevel=2)
            except Exception:  # interpreter shutdown
                pass

    def _release_pending(self) -> int:
        """Drops this call from its .grad's pending calls; returns how many remain."""
        with _PENDING_LOCK:
            entry = _PENDING.get(id(self.into))
            if entry is None or entry[0]() is not self.into:
                return 0
            entry[1] -= 1
            if entry[1] <= 0:
                del _PENDING[id(self.into)]
                return 0
            return entry[1]

    def _check_versions(self) -> None:
        now = (self.hidden._version, self.weight._version, None if self.bias is None else self.bias._version)
        if now != self.versions:
            raise RuntimeError("grpo: hidden, weight or bias was modified in place after grpo's fused loss was "
                               "computed; its backward cannot run again on the modified values")

    def _rerun(self, g: float, need_h: bool, need_w: bool, need_b: bool):
        """Runs the kernel again with scale g: fresh dhidden / dbias, dW into weight.grad when possible."""
        global _RERUN_WARNED
        self._check_versions()
        if not _RERUN_WARNED:
            _RERUN_WARNED = True
            warnings.warn("grpo: the fused loss's backward runs the kernel again (a second backward, or "
                          "weight.grad changed between the forward and the backward, e.g. zero_grad() there): "
                          "correct, but it costs a second step", RuntimeWarning, stacklevel=4)
        target = _grad_target(self.weight) if need_w else None
        return self.run(self.scale * g, target, need_w)

    def backward(self, grad_loss: torch.Tensor, need_h: bool, need_w: bool, need_b: bool):
        g = float(grad_loss)
        into = self.into
        first = not self.consumed
        self.consumed = True
        if into is not None:
            remaining = self._release_pending() if first else 0
            intact = self.weight.grad is into and into._version == self.into_version
        if not first or (into is not None and not intact):
            dhidden, dweight, dbias, target = self._rerun(g, need_h, need_w, need_b)
            return self._hand(dhidden, dweight, dbias, target, 0, need_h, need_w, need_b)
        dhidden, dweight, dbias = self.dhidden, self.dweight, self.dbias
        self.dhidden = self.dweight = self.dbias = None  # so AccumulateGrad can steal them
        if g != 1.0:
            for t in (dhidden, dweight, dbias):
                if t is not None:
                    t.mul_(g)
            if into is not None:
                self._check_versions()
                self.run(self.scale * (g - 1.0), into, True, only_weight=True)
                self.into_version = into._version
        return self._hand(dhidden, dweight, dbias, into, remaining if into is not None else 0, need_h, need_w,
                          need_b)

    def _hand(self, dhidden, dweight, dbias, into, remaining, need_h, need_w, need_b):
        gh = dhidden.view(self.hidden.shape) if need_h and dhidden is not None else None
        gb = dbias.to(self.bias.dtype) if need_b and dbias is not None else None
        gw = dweight if need_w else None
        if need_w and into is not None:
            # dW is in weight.grad already. Other calls that added into it and
            # whose backward is still to come hand it over themselves (the
            # last one does, so AccumulateGrad sees it once per pass).
            if remaining > 0:
                gw = None
            else:
                # AccumulateGrad steals a gradient only when nothing else
                # holds it: neither weight.grad nor this step (a user's own
                # reference to the old .grad makes it copy instead: correct,
                # with a [V, H] copy).
                self.weight.grad = None
                self.into = None
                gw = into
        return gh, gw, gb


class _LossGradients(torch.autograd.Function):
    """Attaches the kernel's gradients (a _Step) to the loss; see _Step."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, step):  # noqa: D401
        ctx.step = step
        # A saved tensor (empty: no memory) so that torch frees it after a
        # backward without retain_graph and a second one raises as torch's own
        # ops do, instead of running the kernel again and adding dW twice.
        ctx.save_for_backward(loss.new_empty(0))
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        ctx.saved_tensors  # raises "Trying to backward through the graph a second time" once freed
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        gh, gw, gb = ctx.step.backward(grad_loss, need_h, need_w, need_b)
        return None, gh, gw, gb, None


@dataclasses.dataclass
class LmHeadLossResult:
    """What `lm_head_grpo_loss` returns.

    loss: 0-dim float32, differentiable w.r.t. hidden / weight / bias.
    per_token_logps: [B, T] float32 (0 on masked rows): the next epoch's old_logp.
    entropy: [B, T] float32 when requested. kl: [B, T] float32 when beta != 0, the KL
    term added per token (its forward value, times r under kl_bias_correction; TRL's per_token_kl).
    metrics: clip_ratio_low / high / region, kl_mean, entropy_mean (masked
    means over valid rows), num_valid.
    stats: what the kernel executed (step_stats()): GEMM rows (padding
    included), active rows, the row x vocab columns grad_filter left out of
    the dhidden / dW GEMMs (dhidden_skipped_row_columns /
    dweight_skipped_row_columns; filter_guard_blocks / filter_lowered_blocks:
    the token blocks grad_filter="auto"'s guard ran exact / filtered at a
    lower threshold), executed_flops, kernel_s (the C++ call's
    wall time) and the per-phase thread-seconds.
    """

    loss: torch.Tensor
    per_token_logps: torch.Tensor
    entropy: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    metrics: dict[str, float]
    stats: Optional[dict[str, float]] = None


def step_stats(stats: grpo.StepStats, v: int, h: int) -> dict[str, float]:
    """A StepStats as a dict, with executed_flops = 2 H x (row x vocab columns the three GEMMs ran).

    That is 2 V H x (rows through the three GEMMs) less 2 H x the row x
    columns the filtered backward (grad_filter) left out of dhidden / dW.
    """
    out = {name: getattr(stats, name) for name in (
        "logits_gemm_rows", "backward_gemm_rows", "dweight_gemm_rows", "active_rows",
        "dhidden_skipped_row_columns", "dweight_skipped_row_columns", "filter_guard_blocks",
        "filter_lowered_blocks", "kernel_s",
        "forward_gemm_s", "forward_stage_s", "dlogits_s", "dweight_gemm_s", "dhidden_gemm_s")}
    rows = stats.logits_gemm_rows + stats.backward_gemm_rows + stats.dweight_gemm_rows
    skipped = stats.dhidden_skipped_row_columns + stats.dweight_skipped_row_columns
    out["executed_flops"] = 2.0 * h * (v * rows - skipped)
    return out


def lm_head_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weight: Optional[torch.Tensor] = None,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: Optional[float] = None,
    beta: float = 0.0,
    kl_bias_correction: bool = False,
    kl_estimator: str = "k3",
    kl_clamp: Optional[float] = None,
    temperature: float = 1.0,
    temperature_on_logp: bool = False,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[float] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    logit_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    grad_into: str = "auto",
    num_threads: Optional[int] = None,
    workspace_budget: Optional[int] = None,
    token_block: Optional[int] = None,
    vocab_tile: Optional[int] = None,
    grad_filter: Any = None,
    plan_cache: Optional[grpo.PlanCache] = None,
    _names: Optional[dict[str, str]] = None,
) -> LmHeadLossResult:
    """The GRPO loss of an LM head, fused (grpo's semantics: README "What it computes").

    hidden [B, T, H] or [B*T, H] and weight [V, H] (lm_head.weight), both
    float32 or both bfloat16, unit inner stride (any row stride); bias [V];
    ids / mask [B, T]; advantages [B] or [B, T]; old_logp / ref_logp [B, T];
    is_weight [B, T], [B, 1] or [B]. dapo / cispo / vespo need num_items_in_batch
    (the global valid-token count); dr_grpo needs max_completion_length; luspo
    needs importance_sampling_level="sequence". Every grpo.LossConfig field has
    a keyword here (grpo/_fields.py: sapo_tau_pos is sapo_temperature_pos, ...):
    kl_estimator ("k3", "k1", "abs", "k2", "k1+", "abs+", "k3+"),
    off_policy_mask_threshold, clip_ratio_c (verl's dual-clip), entropy_coef,
    top_entropy_quantile, logit_softcap / logit_scale. token_block /
    vocab_tile / workspace_budget / num_threads: the plan's schedule options.
    grad_filter: the filtered backward (docs/filtered_backward.md): None /
    "off" (default: every gradient exact), "auto" (threshold eps(weight
    dtype) / 32, 2^-12 for bf16) or a threshold in (0, 1); per token block,
    the vocab columns whose dlogits are below it (relative to each row's
    coefficient) are left out of dhidden and dW. Loss, logp, entropy, KL and
    metrics are bitwise the unfiltered ones; stats count what was left out.

    Gradients: the kernel computes them in the forward, in each parameter's
    dtype, scaled by the aggregation's normalizer inside the kernel (no pass
    over [V, H] follows it and no float32 [V, H] buffer exists). grad_into:
    "auto" adds the weight gradient straight into an existing weight.grad
    during the forward (gradient accumulation: no [V, H] temporary; the
    backward still runs AccumulateGrad and its hooks); "new" always makes a
    fresh one (nothing is written before backward). See _Step for the
    backward's rules (grad_output != 1, retain_graph, zero_grad between the
    forward and the backward).
    """
    names = {k: k for k in ("hidden", "weight", "bias", "ids", "mask", "advantages", "old_logp", "ref_logp",
                            "is_weight", "num_items_in_batch", "grad_into")}
    if _names:
        names.update(_names)
    if grad_into not in ("auto", "new"):
        raise _refuse(names["grad_into"], f"must be 'auto' or 'new', got {grad_into!r}")
    values = dict(loss_type=loss_type, importance_sampling_level=importance_sampling_level, epsilon_low=epsilon_low,
                  epsilon_high=epsilon_high, delta=delta, beta=beta, kl_bias_correction=kl_bias_correction,
                  kl_estimator=kl_estimator, kl_clamp=kl_clamp, temperature=temperature,
                  temperature_on_logp=temperature_on_logp, max_completion_length=max_completion_length,
                  sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                  vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                  vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
                  clip_ratio_c=clip_ratio_c, entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile,
                  logit_softcap=logit_softcap, logit_scale=logit_scale)
    try:
        _fields.loss_config(values)  # converts every keyword: a refusal names it
        plan_values = dict(num_threads=num_threads, workspace_budget=workspace_budget, token_block=token_block,
                           vocab_tile=vocab_tile, grad_filter=grad_filter)
        _fields.head_options(plan_values)  # refuses a bad schedule keyword before any tensor is looked at
    except _fields.Refusal as refusal:
        raise _refused_keyword(refusal, names) from None

    for t, key in ((hidden, "hidden"), (weight, "weight")):
        _check_cpu(t, names[key])
        _check_float(t, names[key])
    _check_cpu(ids, names["ids"])
    # B and T: from hidden when it is [B, T, H], else from ids [B, T].
    if hidden.dim() == 3:
        b, s = hidden.shape[:2]
    elif ids.dim() == 2:
        b, s = ids.shape
    else:
        raise _refuse(names["ids"], f"must be [B, T], got shape {list(ids.shape)}")
    if b == 0 or s == 0:
        raise _refuse(names["hidden"], f"holds an empty batch (B = {b}, T = {s}); grpo needs B, T >= 1")
    n = b * s
    if weight.dtype != hidden.dtype:
        raise _refuse(names["weight"], f"has dtype {weight.dtype} but {names['hidden']} has {hidden.dtype}; "
                      "grpo needs both float32 or both bfloat16", grpo.ArgumentTypeError)
    rows = _as_rows(hidden, names["hidden"], n)
    h = rows.shape[1]
    if weight.dim() != 2 or weight.shape[1] != h:
        raise _refuse(names["weight"], f"has shape {list(weight.shape)}, expected [V, {h}]")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise _refuse(names["weight"], f"must have unit inner stride, got {weight.stride(1)}")
    v = weight.shape[0]
    if v == 0 or h == 0:
        raise _refuse(names["weight"], f"is empty (shape {list(weight.shape)})")
    if bias is not None:
        _check_cpu(bias, names["bias"])
        _check_float(bias, names["bias"])
        _check_shape(bias, names["bias"], (v,))
        if v > 1 and bias.stride(0) != 1:
            raise _refuse(names["bias"], f"must be contiguous, got stride {bias.stride(0)}")

    ids32 = _per_token(ids, names["ids"], b, s, dtype=torch.int32)
    mask32 = _per_token(mask, names["mask"], b, s)
    adv32 = _per_token(advantages, names["advantages"], b, s, extra_shapes=((b,),))
    old32 = _per_token(old_logp, names["old_logp"], b, s)
    ref32 = _per_token(ref_logp, names["ref_logp"], b, s)
    isw32 = _per_token(is_weight, names["is_weight"], b, s, extra_shapes=((b, 1), (b,)))

    # dapo / cispo / vespo: the plan gets a unit normalizer and the call's
    # gradient scale is 1 / num_items_in_batch (applied to the coefficients
    # inside the kernel), so one plan serves every step whatever
    # num_items_in_batch is. The entropy bonus has its own normalizer: with it
    # the plan gets the real one.
    scale = 1.0
    items = 0.0
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise _refuse(names["num_items_in_batch"], f"is required for loss_type '{loss_type}' "
                          "(the global valid-token count)")
        normalizer = float(num_items_in_batch)
        if not (normalizer > 0.0 and math.isfinite(normalizer)):
            raise _refuse(names["num_items_in_batch"], f"must be finite and > 0, got {normalizer}")
        scale, items = (1.0 / normalizer, 1.0) if float(entropy_coef) == 0.0 else (1.0, normalizer)

    # The graph keeps the closures below until it is freed (a second backward
    # reruns the kernel): they hold Python values and tensors, no nanobind
    # object, so an interpreter exiting with a graph alive reports no leak.
    def make_config() -> _core.LossConfig:
        config = _fields.loss_config(values)
        config.num_items_in_batch = items
        return config

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    frozen = _frozen_head(weight, bias)
    threads = int(num_threads) if num_threads is not None else torch.get_num_threads()
    plan_values["num_threads"] = threads
    dtype = _FLOAT_DTYPES[hidden.dtype]
    bias_dtype = _FLOAT_DTYPES[bias.dtype] if bias is not None else _core.DType.f32
    hidden_ld, weight_ld = _row_stride(rows), _row_stride(weight)
    cache = plan_cache if plan_cache is not None else grpo.default_plan_cache()

    def plan_for(forward_only: bool, grad_dtype, dweight_ld: int, accumulate: bool):
        options = _fields.head_options(plan_values, forward_only=forward_only, frozen_weight=frozen,
                                       dweight_dtype=grad_dtype, dhidden_dtype=dtype,
                                       accumulate_weight_grads=accumulate)
        config = make_config()
        key = (b, s, h, v, str(dtype), bias is not None, str(bias_dtype), hidden_ld, weight_ld, dweight_ld,
               _fields.plan_key(config, options))

        def build():
            shape = _head_shape(b, s, h, v, dtype, bias is not None, bias_dtype, hidden_ld, weight_ld)
            shape.dweight_ld = dweight_ld
            return _core.LmHeadLossPlan(shape, config, options)
        return cache.get("lm_head_loss", key, build)

    w_, b_ = weight.detach(), None if bias is None else bias.detach()
    rows_ = rows.detach()
    last_stats: list = []

    def execute(plan, grad_scale, logp, entropy, kl, dhidden, dweight, dbias):
        stats = grpo.StepStats()
        m = plan.execute(cache.workspace, rows_, w_, b_, ids32, mask32, adv32, old32, ref32, isw32, logp, entropy,
                         kl, dhidden, dweight, dbias, grad_scale=grad_scale, stats=stats)
        last_stats[:] = [step_stats(stats, v, h)]
        return m

    def gradient_buffers(target, need_w):
        """(dhidden, dweight, dbias, accumulate, dweight dtype, dweight_ld) for one run."""
        dhidden = _fresh((n, h), hidden.dtype)
        dweight = dbias = None
        accumulate = False
        grad_dtype, dweight_ld = dtype, h
        if not frozen:
            if target is not None:
                dweight, accumulate = target, True
                grad_dtype, dweight_ld = _FLOAT_DTYPES[target.dtype], _row_stride(target)
            elif need_w:
                dweight = _fresh((v, h), weight.dtype)
            else:  # the bias alone is trained: the kernel still writes a dW, discarded
                dweight = _scratch(cache, (v, h), weight.dtype)
            if bias is not None:
                dbias = torch.zeros(v, dtype=torch.float32) if accumulate else torch.empty(v, dtype=torch.float32)
        return dhidden, dweight, dbias, accumulate, grad_dtype, dweight_ld

    try:
        # Outputs exist only once the plan accepted the configuration; the
        # kernel validates every input before it writes any of them.
        target = _grad_target(weight) if (needs_grad and grad_into == "auto" and not frozen) else None
        if needs_grad:
            dhidden, dweight, dbias, accumulate, grad_dtype, dweight_ld = gradient_buffers(target,
                                                                                           weight.requires_grad)
            plan = plan_for(False, grad_dtype, dweight_ld, accumulate)
        else:
            dhidden = dweight = dbias = None
            plan = plan_for(True, dtype, h, False)
        logp = torch.empty(n, dtype=torch.float32)
        entropy = torch.empty(n, dtype=torch.float32) if return_entropy else None
        kl = torch.empty(n, dtype=torch.float32) if beta != 0.0 else None
        m = execute(plan, scale, logp, entropy, kl, dhidden, dweight, dbias)
    except (grpo.Error, grpo.ArgumentTypeError, grpo.UnsupportedError) as error:
        raise _renamed(error, names) from None

    loss_value = torch.tensor(m.loss * scale, dtype=torch.float32)
    if needs_grad:
        def rerun(grad_scale, target, need_w, only_weight=False):
            """The kernel again, gradients only (per-token outputs to scratch); returns the gradient buffers."""
            dh, dw, db, acc, gd, ld = gradient_buffers(target, need_w)
            execute(plan_for(False, gd, ld, acc), grad_scale, torch.empty(n, dtype=torch.float32),
                    torch.empty(n, dtype=torch.float32) if return_entropy else None,
                    torch.empty(n, dtype=torch.float32) if beta != 0.0 else None, dh, dw, db)
            return dh, (None if acc else dw), db, (target if acc else None)

        step = _Step(rerun, scale, hidden, weight, bias, dhidden, None if accumulate else dweight, dbias,
                     dweight if accumulate else None)
        loss = _LossGradients.apply(loss_value, hidden, weight, bias, step)
    else:
        loss = loss_value
    metrics = {
        "clip_ratio_low": m.clip_ratio_low,
        "clip_ratio_high": m.clip_ratio_high,
        "clip_ratio_region": m.clip_ratio_region,
        "kl_mean": m.kl_mean,
        "entropy_mean": m.entropy_mean,
        "num_valid": m.num_valid,
    }
    return LmHeadLossResult(loss, logp.view(b, s), None if entropy is None else entropy.view(b, s),
                            None if kl is None else kl.view(b, s), metrics, last_stats[0])


_CORE_NAMES = {"hidden": "hidden", "weight": "weight", "bias": "bias", "ids": "ids", "mask": "mask",
               "advantages": "advantages", "old_logp": "old_logp", "ref_logp": "ref_logp", "is_weight": "is_weight",
               # Shape refusals name the tensor the size came from; the call's
               # gradient scale is 1 / num_items_in_batch.
               "shape.batch": "hidden", "shape.seq_len": "hidden", "shape.hidden": "hidden",
               "shape.vocab": "weight", "grad_scale": "num_items_in_batch", "dhidden": "hidden",
               "dweight": "weight"}


def _renamed(error: Exception, names: dict[str, str]) -> Exception:
    """The library's refusal, re-raised naming the caller's argument (as the caller spelled it)."""
    argument = getattr(error, "argument", "")
    caller = names.get(_CORE_NAMES.get(argument, ""), None)
    if caller is None:
        caller = _fields.caller_name(argument, names)
    if caller is None or caller == argument:
        return error
    renamed = type(error)(f"{error} (argument '{caller}')")
    renamed.argument = caller
    return renamed


# --------------------------------------------------------------------------
# The Liger-compatible module.
# --------------------------------------------------------------------------

_LIGER_NAMES = {
    "hidden": "_input",
    "weight": "lin_weight",
    "bias": "bias",
    "ids": "selected_token_ids",
    "mask": "attention_mask",
    "advantages": "advantages",
    "old_logp": "old_per_token_logps",
    "ref_logp": "ref_per_token_logps",
    "is_weight": "vllm_is_ratio",
    "loss_type": "loss_type",
    "importance_sampling_level": "importance_sampling_level",
    "num_items_in_batch": "num_items_in_batch",
    "kl_bias_correction": "use_bias_correction_kl",
}


class LmHeadGRPOLoss(torch.nn.Module):
    """Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss`, computed by grpo's fused CPU kernel.

    Same constructor, same forward arguments, same return value:
    `(loss, (kl_mean,) + (clip_ratio,))`, the KL metric present when beta != 0.
    `compiled` and `chunk_size` (Liger's torch.compile and chunking knobs) are
    accepted and have no effect. Extra keyword-only arguments: num_threads
    (default torch.get_num_threads()), temperature_on_logp, workspace_budget,
    plan_cache, grad_into, grad_filter (see lm_head_grpo_loss).

    Not supported (NotImplementedError naming the argument): computing
    reference log-probs from ref_input / ref_weight / ref_bias (pass
    ref_per_token_logps); delta <= 1 + epsilon_high for the clipped loss
    types; luspo with a KL term or a per-token vllm_is_ratio, and vespo with
    ratios != 1 on masked positions (where Liger 0.8.5 sums over masked
    positions: _check_luspo, _vespo_is_weight). Differences from Liger are
    listed in docs/python.md.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: Optional[float] = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        num_threads: Optional[int] = None,
        temperature_on_logp: bool = False,
        workspace_budget: Optional[int] = None,
        plan_cache: Optional[grpo.PlanCache] = None,
        grad_into: str = "auto",
        grad_filter: Any = None,
    ):
        super().__init__()
        # Liger's own constructor checks, with its messages.
        if sapo_temperature_pos <= 0:
            raise ValueError(f"sapo_temperature_pos must be positive, got {sapo_temperature_pos}")
        if sapo_temperature_neg <= 0:
            raise ValueError(f"sapo_temperature_neg must be positive, got {sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta must be positive, got {delta}")
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.num_threads = num_threads
        self.temperature_on_logp = temperature_on_logp
        self.workspace_budget = workspace_budget
        self.plan_cache = plan_cache
        self.grad_into = grad_into
        self.grad_filter = grad_filter
        self._check_settings()

    def _check_settings(self) -> None:
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type}")
        if self.importance_sampling_level not in _IS_LEVELS:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}. "
                             "Possible values are 'token' and 'sequence'.")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(f"Sequence-level importance sampling is not supported for loss_type='{self.loss_type}'. "
                             "Use importance_sampling_level='token' instead.")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise _refuse("max_completion_length", "must be provided for loss_type 'dr_grpo'")
        try:
            _fields.grad_filter("grad_filter", self.grad_filter)
        except _fields.Refusal as refusal:
            raise _refused_keyword(refusal) from None
        # Liger ignores delta for cispo and sapo; for the clipped types grpo
        # requires delta > 1 + epsilon_high (below it Liger's min(r, delta) is
        # below the clip range, a regime grpo does not compute).
        if self.delta is not None and self.loss_type not in ("cispo", "sapo") and \
                not self.delta > 1.0 + self.epsilon_high:
            raise _refuse("delta", f"delta = {self.delta} <= 1 + epsilon_high = {1.0 + self.epsilon_high} "
                          "is not supported by grpo", NotImplementedError)

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ):
        self._check_settings()
        # Liger reads ref_per_token_logps only when use_ref_model; otherwise the
        # reference is the policy itself (KL = 0, no KL gradient).
        if self.use_ref_model:
            if ref_per_token_logps is None:
                for name, value in (("ref_input", ref_input), ("ref_weight", ref_weight), ("ref_bias", ref_bias)):
                    if value is not None:
                        raise _refuse(name, "computing reference log-probs from the reference model's hidden "
                                      "states is not implemented by grpo; pass ref_per_token_logps",
                                      NotImplementedError)
                raise _refuse("ref_per_token_logps", "is required when use_ref_model is True "
                              "(Liger: ref_per_token_logps or ref_input must be provided)")
            if ref_input is not None:
                warnings.warn("Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.")
        ref = ref_per_token_logps if self.use_ref_model else None
        beta = float(self.beta) if ref is not None else 0.0
        if _input is None or _input.dim() != 3:
            raise _refuse("_input", "must be [B, T, H]")

        is_weight = vllm_is_ratio
        if self.loss_type == "luspo":
            self._check_luspo(beta, vllm_is_ratio)
        if self.loss_type == "vespo" and vllm_is_ratio is not None:
            is_weight = self._vespo_is_weight(vllm_is_ratio, attention_mask)
        if self.loss_type in ("dapo", "cispo", "vespo"):
            num_items = self._dapo_normalizer(attention_mask, num_items_in_batch)
        else:
            num_items = None
        delta = None if self.loss_type in ("cispo", "sapo") else self.delta

        result = lm_head_grpo_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages,
            bias=bias, old_logp=old_per_token_logps, ref_logp=ref, is_weight=is_weight,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=delta, beta=beta,
            kl_bias_correction=self.use_bias_correction_kl, temperature=self.temperature,
            temperature_on_logp=self.temperature_on_logp, max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items, sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg, vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos, vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg, num_threads=self.num_threads,
            workspace_budget=self.workspace_budget, plan_cache=self.plan_cache, grad_into=self.grad_into,
            grad_filter=self.grad_filter, _names=_LIGER_NAMES)

        metrics = []
        if self.beta != 0.0:
            # grpo's kl_mean is Liger's KL metric: the mean of the term added
            # (times r under use_bias_correction_kl); 0 without a reference.
            metrics.append(torch.tensor(result.metrics["kl_mean"] if result.kl is not None else 0.0,
                                        dtype=torch.float32))
        metrics.append(torch.tensor(self._liger_clip_metric(result, attention_mask, advantages,
                                                            old_per_token_logps), dtype=torch.float32))
        return result.loss, tuple(metrics)

    @staticmethod
    def _check_luspo(beta: float, vllm_is_ratio) -> None:
        """Liger's luspo is (1/(B T)) sum_{i,t} |o_i| l_t over every position, masked ones included, once its
        per-token loss is [B, T] (a KL term, a per-token vllm_is_ratio); grpo computes TRL's (1/B) sum_i sum_t
        m_t l_t, the same value only while the loss is one per sequence."""
        if beta != 0.0:
            raise _refuse("beta", "luspo with a KL term: Liger 0.8.5 then sums |o_i| l_t over masked positions "
                          "too (its per-token loss becomes [B, T]); grpo computes TRL's masked sum. Use "
                          "beta=0 or lm_head_grpo_loss", NotImplementedError)
        if vllm_is_ratio is not None and vllm_is_ratio.dim() == 2 and vllm_is_ratio.shape[1] != 1:
            raise _refuse("vllm_is_ratio", "luspo with a per-token [B, T] ratio: Liger 0.8.5 then sums over masked "
                          "positions too; pass one ratio per sequence ([B] or [B, 1])", NotImplementedError)

    @staticmethod
    def _vespo_is_weight(vllm_is_ratio, attention_mask):
        """Liger's vespo adds sum_t clamp(log r_t) over every position of vllm_is_ratio (masked ones too) to
        log w; grpo adds it over valid tokens. [B] / [B, 1]: the ratio goes on each sequence's first valid
        token (1 elsewhere), which adds its log once, as Liger does. [B, T]: refused unless every masked
        position's ratio adds nothing (is 1)."""
        if not isinstance(vllm_is_ratio, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
            return vllm_is_ratio
        mask = attention_mask.detach().to(torch.float32)
        ratio = vllm_is_ratio.detach().to(torch.float32)
        if ratio.dim() == 2 and ratio.shape == mask.shape and ratio.shape[1] != 1:
            lower = math.log(1e-8)
            masked_log = torch.clamp(torch.log(ratio), lower, 20.0) * (1.0 - mask)
            if bool((masked_log != 0).any()):
                raise _refuse("vllm_is_ratio", "vespo: masked positions carry ratios != 1, which Liger 0.8.5 adds "
                              "to log w and grpo does not", NotImplementedError)
            return vllm_is_ratio
        if ratio.dim() in (1, 2) and ratio.shape[0] == mask.shape[0] and ratio.numel() == mask.shape[0]:
            first = (mask.cumsum(-1) == 1) & (mask != 0)
            return torch.where(first, ratio.reshape(-1, 1), torch.ones_like(mask))
        return vllm_is_ratio  # a wrong shape: lm_head_grpo_loss names it

    @staticmethod
    def _dapo_normalizer(attention_mask, num_items_in_batch) -> float:
        """Liger's `_compute_dapo_normalizer`: the per-process share of the global token count, >= 1."""
        world_size = 1
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            world_size = torch.distributed.get_world_size()
        if num_items_in_batch is not None:
            total = float(num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor)
                          else num_items_in_batch)
        else:
            if not isinstance(attention_mask, torch.Tensor):
                raise _refuse("attention_mask", "must be a torch.Tensor", grpo.ArgumentTypeError)
            count = attention_mask.to(torch.float32).sum()
            if distributed:
                count = count.clone()
                torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM)
            total = float(count)
        return max(total / world_size, 1.0)

    def _ratio(self, result, attention_mask, old) -> torch.Tensor:
        """Liger's coef_1 = exp(log r): per token, or per sequence ([B, 1]) at sequence level."""
        logp = result.per_token_logps.double()
        if old is None:
            return torch.ones_like(logp)
        log_ratio = logp - old.detach().double()
        if self.importance_sampling_level == "sequence":
            m = attention_mask.double()
            log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    def _liger_clip_metric(self, result, attention_mask, advantages, old) -> float:
        # Token level: grpo's clip_ratio_region is Liger's metric (for cispo
        # too: r > epsilon_high with A > 0). sapo: Liger reports 0. Sequence
        # level: grpo reports the fraction of sequences (as TRL logs it),
        # Liger the fraction of tokens whose sequence is clipped.
        if self.loss_type in ("sapo", "vespo"):
            return 0.0
        if self.importance_sampling_level != "sequence":
            return result.metrics["clip_ratio_region"]
        m = attention_mask.double()
        adv = advantages.detach().double()
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        r = self._ratio(result, attention_mask, old)
        clipped = ((r < 1.0 - self.epsilon_low) & (adv < 0)) | ((r > 1.0 + self.epsilon_high) & (adv > 0))
        clipped = clipped.expand_as(m)
        return float((clipped * m).sum() / m.sum().clamp(min=1.0))

    def extra_repr(self) -> str:
        return (f"loss_type={self.loss_type!r}, beta={self.beta}, epsilon_low={self.epsilon_low}, "
                f"epsilon_high={self.epsilon_high}, importance_sampling_level={self.importance_sampling_level!r}, "
                f"temperature={self.temperature}")


# --------------------------------------------------------------------------
# The generic log-prob head: per-token logp / entropy, differentiable for any
# loss computed on them in Python.
# --------------------------------------------------------------------------

_LOG_PROB_OUTPUTS = ("log_probs", "entropy")
# TRL's ChunkedLogProbFunction outputs grpo does not compute.
_UNSUPPORTED_LOG_PROB_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")
_LOG_PROB_NAMES = {"hidden": "hidden", "weight": "weight", "bias": "bias", "ids": "labels", "mask": "mask",
                   "dlogp": "grad of log_probs", "dentropy": "grad of entropy"}


def _frozen_head(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True when neither the LM-head weight nor its bias wants a gradient (a frozen head, as in LoRA training):
    the plan is built with frozen_weight and the backward skips the dW GEMMs."""
    return not weight.requires_grad and (bias is None or not bias.requires_grad)


def _scratch(cache: grpo.PlanCache, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of `shape` kept in the cache, for a gradient the C++ head must write but nobody wants.

    Its contents are garbage; every backward of that cache that needs it
    writes into the same buffer (serialized by the cache's workspace lock).
    """
    return cache.get("scratch", (shape, str(dtype)), lambda: torch.empty(shape, dtype=dtype))


class _FusedLogProbs(torch.autograd.Function):
    """hidden / weight / bias -> (logp, entropy) through grpo.LmHeadLogProbPlan.

    forward saves hidden (as its [N, H] row view), weight, bias, the int32
    labels and the mask: no logits. backward hands grad_output of logp and
    entropy to the C++ head's backward, which recomputes the logits of the
    rows with a nonzero upstream gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, ids32, mask32, get_plan, cache, want_entropy,  # noqa: D401
                grad_into="auto", on_stats=None):
        # An entropy computed for logging only gets no gradient: None, not zeros.
        ctx.set_materialize_grads(False)
        n = rows.shape[0]
        logp = torch.empty(n, dtype=torch.float32)
        entropy = torch.empty(n, dtype=torch.float32) if want_entropy else None
        w, b = weight.detach(), None if bias is None else bias.detach()
        try:
            stats = get_plan().forward(cache.workspace, rows.detach(), w, b, ids32, mask32, logp, entropy)
        except (grpo.Error, grpo.ArgumentTypeError, grpo.UnsupportedError) as error:
            raise _renamed(error, _LOG_PROB_NAMES) from None
        ctx.save_for_backward(rows, weight, bias, ids32, mask32)
        # The plan is looked up again in backward (a cache hit): the graph
        # holds no nanobind object, so exiting with one alive reports no leak.
        ctx.get_plan, ctx.cache = get_plan, cache
        ctx.weight_ref = weakref.ref(weight)
        ctx.grad_into, ctx.on_stats = grad_into, on_stats
        if on_stats is not None:
            on_stats(step_stats(stats, weight.shape[0], rows.shape[1]))
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 11
        if grad_logp is None and grad_entropy is None:
            return none
        rows, weight, bias, ids32, mask32 = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_dtype, bias_dtype = ctx.meta
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b):
            return none
        n, h = rows.shape
        v = weight.shape[0]
        cache = ctx.cache
        dlogp = (grad_logp.detach().to(torch.float32).reshape(-1).contiguous() if grad_logp is not None
                 else torch.zeros(n, dtype=torch.float32))
        dent = grad_entropy.detach().to(torch.float32).reshape(-1).contiguous() if grad_entropy is not None else None
        # The C++ head writes every gradient it has: an unwanted one goes to a
        # cached scratch buffer. A frozen head's plan (neither weight nor bias
        # wants a gradient: _frozen_head) has no dW / dbias at all.
        # dhidden and dW are written in hidden's / weight's dtype (the plan's
        # dhidden_dtype / dweight_dtype): no float32 [V, H] buffer, no cast.
        # An existing weight.grad takes dW in place (accumulate_weight_grads:
        # no [V, H] temporary, as the fused loss; the grad_output is already
        # known here), and is handed back to AccumulateGrad, which steals it
        # (see _Step): its hooks fire, nothing is added twice.
        frozen = not (need_w or need_b)
        param = ctx.weight_ref()
        target = _grad_target(param) if (need_w and param is not None and ctx.grad_into == "auto") else None
        dhidden = _fresh((n, h), rows.dtype) if need_h else _scratch(cache, (n, h), rows.dtype)
        dweight = dbias = None
        if not frozen:
            if target is not None:
                dweight = target
            else:
                dweight = _fresh((v, h), weight.dtype) if need_w else _scratch(cache, (v, h), weight.dtype)
            if bias is not None:
                if target is not None:
                    dbias = torch.zeros(v, dtype=torch.float32)  # the plan adds into dbias too
                else:
                    dbias = torch.empty(v, dtype=torch.float32) if need_b else _scratch(cache, (v,))
        plan = (ctx.get_plan() if target is None else
                ctx.get_plan(accumulate=True, grad_dtype=_FLOAT_DTYPES[target.dtype], dweight_ld=_row_stride(target)))
        try:
            stats = plan.backward(cache.workspace, rows.detach(), weight.detach(),
                                  None if bias is None else bias.detach(), ids32, mask32, dlogp, dent, dhidden, dweight,
                                  dbias)
        except (grpo.Error, grpo.ArgumentTypeError, grpo.UnsupportedError) as error:
            raise _renamed(error, _LOG_PROB_NAMES) from None
        if ctx.on_stats is not None:
            ctx.on_stats(step_stats(stats, v, h))
        gh = dhidden.view(hidden_shape) if need_h else None
        gw = dweight if need_w else None
        if target is not None:
            param.grad = None  # AccumulateGrad steals the same tensor straight back
            gw = target
        gb = dbias.to(bias_dtype) if (need_b and bias is not None) else None
        return (gh, gw, gb) + (None,) * 8


def fused_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = _LOG_PROB_OUTPUTS,
    *,
    mask: Optional[torch.Tensor] = None,
    temperature_on_logp: bool = False,
    logit_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    num_threads: Optional[int] = None,
    workspace_budget: Optional[int] = None,
    grad_filter: Any = None,
    plan_cache: Optional[grpo.PlanCache] = None,
    grad_into: str = "auto",
    on_stats=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probabilities (and entropy) of an LM head, without the [N, V] logits.

    Returns `(log_probs, entropy)`, float32, shaped like `labels`; entropy is
    None unless "entropy" is in `outputs`. Both are differentiable w.r.t.
    hidden, weight and bias for any loss computed on them: backward runs
    grpo's log-prob head backward (grpo.LmHeadLogProbPlan) with their
    grad_output (None = 0), recomputing only the logits of rows with a nonzero
    upstream gradient. It is the primitive TRL 1.16's `add_fused_lm_head`
    computes with its `ChunkedLogProbFunction` (same temperature semantics:
    x = z / temperature, logp = x_y - logsumexp(x), entropy of softmax(x)).

    hidden [B, T, H] or [N, H], weight [V, H] (lm_head.weight): both float32 or
    both bfloat16, unit inner stride (any row stride: viewed, not copied);
    bias [V] or None. labels: integer ids in [0, V), B*T (or N) of them, any
    shape; int64 is converted to int32 (ids outside int32 are refused).
    outputs: "log_probs" (always computed) and optionally "entropy"; TRL's
    other outputs raise NotImplementedError.

    Masks: none by default, every position is computed (as TRL does on CPU:
    it scores every position with the ignored labels clamped to 0 and zeroes
    them afterwards), so labels must be valid everywhere: pass
    `labels.clamp(min=0)` for -100 labels and mask the outputs yourself.
    `mask` (0 / 1, shaped like labels) is the C++ head's row mask: a masked
    row's log_prob is 0, its label is not read, its entropy is still
    computed, and the upstream gradients of both are ignored.

    Gradients: written by the C++ backward in each input's dtype (dbias in
    float32, cast). An existing weight.grad takes dW in place (grad_into=
    "auto": no [V, H] temporary under gradient accumulation; AccumulateGrad
    and its hooks still run, see _Step); "new" always makes a fresh one. The
    head writes dhidden, dweight and dbias in every backward, except for a
    frozen head (neither weight nor bias requires grad, as in LoRA): its plan
    is built with frozen_weight and skips the dW GEMMs, a third of the step.
    Any other unneeded gradient (a hidden that does not require grad, a
    weight whose bias alone is trained) is written into a scratch buffer kept
    in the plan cache and discarded. on_stats: called with the step stats
    (step_stats()) of the forward and of the backward kernel calls. logit_softcap / logit_scale: the model's logit transform
    before the temperature, as TRL applies final_logit_softcapping and its
    logit scale: z' = c tanh(s z / c), or s z without a cap (None).
    temperature_on_logp: grpo's other temperature convention
    (logp = (z_y - LSE(z)) / tau, entropy of softmax(z)). grad_filter: the
    filtered backward, as lm_head_grpo_loss (None / "off", "auto" or a
    threshold in (0, 1); logp and entropy stay bitwise, dhidden / dW leave
    out the columns below it). Plans are cached per
    (N, H, V, dtypes, strides, temperature, options) in `plan_cache` (the
    process-wide one by default) and share its workspace; threads:
    `num_threads`, else torch.get_num_threads(). Refusals raise grpo.Error /
    grpo.ArgumentTypeError / NotImplementedError naming the argument.
    """
    if grad_into not in ("auto", "new"):
        raise _refuse("grad_into", f"must be 'auto' or 'new', got {grad_into!r}")
    try:
        filter_value = _fields.grad_filter("grad_filter", grad_filter)
    except _fields.Refusal as refusal:
        raise _refused_keyword(refusal) from None
    outputs = tuple(outputs)
    for name in outputs:
        if name in _UNSUPPORTED_LOG_PROB_OUTPUTS:
            raise _refuse("outputs", f"'{name}' is not computed by grpo", NotImplementedError)
        if name not in _LOG_PROB_OUTPUTS:
            raise _refuse("outputs", f"unknown output '{name}' (one of {', '.join(_LOG_PROB_OUTPUTS)})")
    for t, name in ((hidden, "hidden"), (weight, "weight")):
        _check_cpu(t, name)
        _check_float(t, name)
    _check_cpu(labels, "labels")
    if hidden.dim() not in (2, 3):
        raise _refuse("hidden", f"must be [B, T, H] or [N, H], got {hidden.dim()} dimensions")
    n = hidden.shape[0] * (hidden.shape[1] if hidden.dim() == 3 else 1)
    if weight.dtype != hidden.dtype:
        raise _refuse("weight", f"has dtype {weight.dtype} but hidden has {hidden.dtype}; "
                      "grpo needs both float32 or both bfloat16", grpo.ArgumentTypeError)
    rows = _as_rows(hidden, "hidden", n)
    h = rows.shape[1]
    if weight.dim() != 2 or weight.shape[1] != h:
        raise _refuse("weight", f"has shape {list(weight.shape)}, expected [V, {h}]")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise _refuse("weight", f"must have unit inner stride, got {weight.stride(1)}")
    v = weight.shape[0]
    if bias is not None:
        _check_cpu(bias, "bias")
        _check_float(bias, "bias")
        _check_shape(bias, "bias", (v,))
        if v > 1 and bias.stride(0) != 1:
            raise _refuse("bias", f"must be contiguous, got stride {bias.stride(0)}")
    if labels.numel() != n:
        raise _refuse("labels", f"has {labels.numel()} elements (shape {list(labels.shape)}), expected {n}")
    out_shape = labels.shape
    ids32 = _per_token(labels.reshape(n), "labels", 1, n, dtype=torch.int32, extra_shapes=((n,),))
    mask32 = None
    if mask is not None:
        _check_cpu(mask, "mask")
        _check_shape(mask, "mask", tuple(out_shape))
        mask32 = _per_token(mask.reshape(n), "mask", 1, n, extra_shapes=((n,),))
    if not (float(temperature) > 0.0 and math.isfinite(float(temperature))):
        raise _refuse("temperature", f"must be finite and > 0, got {temperature}")

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    frozen = _frozen_head(weight, bias)
    threads = int(num_threads) if num_threads is not None else torch.get_num_threads()
    dtype = _FLOAT_DTYPES[hidden.dtype]
    bias_dtype = _FLOAT_DTYPES[bias.dtype] if bias is not None else _core.DType.f32
    hidden_ld, weight_ld = _row_stride(rows), _row_stride(weight)
    key = (n, h, v, str(hidden.dtype), None if bias is None else str(bias.dtype), hidden_ld, weight_ld,
           float(temperature), bool(temperature_on_logp), None if logit_softcap is None else float(logit_softcap),
           float(logit_scale), threads, needs_grad, frozen, workspace_budget, filter_value)

    cache = plan_cache if plan_cache is not None else grpo.default_plan_cache()

    def get_plan(accumulate: bool = False, grad_dtype=None, dweight_ld: int = 0):
        """The head's plan; accumulate: the backward adds dW into an existing weight.grad (its dtype / stride)."""
        def build():
            # One sequence of N rows: the head has no per-sequence term, so the
            # plan depends on N only.
            shape = _head_shape(1, n, h, v, dtype, bias is not None, bias_dtype, hidden_ld, weight_ld)
            shape.dweight_ld = dweight_ld
            config = _core.LogProbConfig()
            config.temperature = float(temperature)
            config.temperature_on_logp = bool(temperature_on_logp)
            config.logit_softcap = None if logit_softcap is None else float(logit_softcap)
            config.logit_scale = float(logit_scale)
            options = _head_options(threads, not needs_grad, frozen, workspace_budget, dtype, grad_filter)
            if accumulate:
                options.accumulate_weight_grads = True
                options.dweight_dtype = grad_dtype
            return _core.LmHeadLogProbPlan(shape, config, options)
        full_key = key if not accumulate else key + ("accumulate", str(grad_dtype), dweight_ld)
        return cache.get("lm_head_log_prob", full_key, build)

    try:
        get_plan()
    except (grpo.Error, grpo.ArgumentTypeError, grpo.UnsupportedError) as error:
        raise _renamed(error, _LOG_PROB_NAMES) from None
    want_entropy = "entropy" in outputs
    if needs_grad:
        logp, entropy = _FusedLogProbs.apply(hidden, weight, bias, rows, ids32, mask32, get_plan, cache,
                                             want_entropy, grad_into, on_stats)
    else:
        with torch.no_grad():
            logp, entropy = _FusedLogProbs.forward(_NoCtx(), hidden, weight, bias, rows, ids32, mask32, get_plan,
                                                   cache, want_entropy)
    return logp.view(out_shape), None if entropy is None else entropy.view(out_shape)


class _NoCtx:
    """Stands in for autograd's ctx when no gradient is needed."""

    def set_materialize_grads(self, value):
        pass

    def save_for_backward(self, *tensors):
        pass



def __getattr__(name: str):
    """The SFT loss with torch's F.linear_cross_entropy signature lives in grpo/cross_entropy.py, which builds on
    this module: resolved on first use, so neither module imports the other while it is being imported."""
    if name in ("LinearCrossEntropyLoss", "linear_cross_entropy"):
        from grpo import cross_entropy

        return getattr(cross_entropy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
