"""grpo's functional PyTorch entry points: the fused loss and the generic log-prob head.

- `lm_head_grpo_loss`: the GRPO loss of an LM head, fused, with grpo's
  semantics and every output (per-token logp, entropy, KL, metrics).
- `fused_log_probs`: per-token log-probabilities and entropy of an LM head,
  differentiable for any loss computed on them in Python (TRL's fused LM
  head computes the same).

Both check their arguments (shapes, dtypes, devices: nothing that reads a
value), then call grpo's torch ops (grpo/_ops.py: `torch.ops.grpo.*`, with
fake kernels and registered autograd), so torch.compile(fullgraph=True)
traces them. Large tensors (hidden, weight, bias) reach C++ without copies;
the small per-token ones are converted to int32 / float32 by the op. Plans
are cached per shape / dtype / stride / config / options in a
`grpo.PlanCache` (the process-wide one unless `plan_cache` is given), and
share its workspace. The GIL is released while the kernel runs. Threads:
`num_threads`, else torch.get_num_threads().
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Optional

import torch

import grpo
from grpo import _fields, _ops, _plan_cache
from grpo._ops import METRIC_FIELDS, make_spec, step_stats
from grpo._torch_args import (as_rows, check_cpu, check_float, check_head, check_shape, frozen_head, needs_grad,
                              per_token, refuse, refused_keyword)

__all__ = ["LmHeadLossResult", "fused_log_probs", "lm_head_grpo_loss"]

_DAPO_LIKE = ("dapo", "cispo", "vespo")


@dataclasses.dataclass
class LmHeadLossResult:
    """What `lm_head_grpo_loss` returns.

    loss: 0-dim float32, differentiable w.r.t. hidden / weight / bias.
    per_token_logps: [B, T] float32 (0 on masked rows): the next epoch's old_logp.
    entropy: [B, T] float32 when requested. kl: [B, T] float32 when beta != 0, the KL
    term added per token (its forward value, times r under kl_bias_correction; TRL's per_token_kl).
    metrics: clip_ratio_low / high / region, kl_mean, entropy_mean (masked
    means over valid rows), num_valid, as Python floats (read on first use:
    under torch.compile, reading them leaves the graph; `metrics_tensor`
    holds them in METRIC_FIELDS order).
    stats: what the kernel executed: GEMM rows (padding included), active
    rows, the row x vocab columns grad_filter left out of the dhidden / dW
    GEMMs (dhidden_skipped_row_columns / dweight_skipped_row_columns;
    filter_guard_blocks / filter_lowered_blocks: the token blocks
    grad_filter="auto"'s guard ran exact / filtered at a lower threshold;
    f16_saturated: float16 gradient entries written as +-65504 in place of
    an infinity, which also warns),
    executed_flops, and in eager mode kernel_s (the C++ call's wall time)
    and the per-phase thread-seconds.
    """

    loss: torch.Tensor
    per_token_logps: torch.Tensor
    entropy: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    metrics_tensor: torch.Tensor
    stats_tensor: torch.Tensor
    head_shape: tuple[int, int]  # (V, H), for stats' executed_flops
    timings: Optional[dict[str, float]] = None  # the kernel's wall times (eager calls)

    @property
    def metrics(self) -> dict[str, float]:
        return dict(zip(METRIC_FIELDS, self.metrics_tensor.tolist()))

    @property
    def stats(self) -> dict[str, float]:
        return step_stats(self.stats_tensor, *self.head_shape, self.timings)


@torch.compiler.assume_constant_result
def _check_keywords(values: Optional[dict], plan_values: dict, names: dict) -> bool:
    """Converts every loss and schedule keyword as the plan will (a refusal names the keyword), before any tensor
    is looked at. Run once per call site under torch.compile (its arguments are constants there)."""
    try:
        if values is not None:
            _fields.loss_config(values)
        _fields.head_options(plan_values)
    except _fields.Refusal as refusal:
        raise refused_keyword(refusal, names) from None
    return True


def _num_items(value, name: str) -> Optional[torch.Tensor]:
    """num_items_in_batch as a 0-dim float64 tensor (a tensor input of the op: no recompile when it changes)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        check_cpu(value, name)
        if value.numel() != 1:
            raise refuse(name, f"must hold one value, got shape {list(value.shape)}")
        return value.detach().reshape(())
    try:
        normalizer = float(value)
    except (TypeError, ValueError):
        raise refuse(name, f"must be a number or a one-element tensor, got {type(value).__name__}",
                     grpo.ArgumentTypeError) from None
    if not (normalizer > 0.0 and math.isfinite(normalizer)):
        raise refuse(name, f"must be finite and > 0, got {normalizer}")
    return torch.tensor(normalizer, dtype=torch.float64)


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
    cu_seqlens: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
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
    num_items_in_batch: Any = None,
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
    loss_scale: float = 1.0,
    return_entropy: bool = False,
    num_threads: Optional[int] = None,
    workspace_budget: Optional[int] = None,
    token_block: Optional[int] = None,
    vocab_tile: Optional[int] = None,
    grad_filter: Any = None,
    plan_cache: Optional[grpo.PlanCache] = None,
    vocab_group: Any = None,
    data_group: Any = None,
    vocab_start: Optional[int] = None,
    _names: Optional[dict[str, str]] = None,
) -> LmHeadLossResult:
    """The GRPO loss of an LM head, fused (grpo's semantics: README "What it computes").

    hidden [B, T, H] or [B*T, H] and weight [V, H] (lm_head.weight), both
    float32, both bfloat16 or both float16, unit inner stride (any row stride); bias [V];
    ids / mask [B, T]; advantages [B] or [B, T]; old_logp / ref_logp [B, T];
    is_weight [B, T], [B, 1] or [B].

    Packed sequences (no padding, as flash-attention's varlen path and HF's
    packing collators give them): hidden [1, N, H] or [N, H] holding S
    sequences back to back, and either cu_seqlens (int [S + 1]: 0, the running
    sums of the lengths, N) or position_ids ([1, N] or [N], restarting at 0
    where each sequence starts: HF's packed position_ids; its values are read
    eagerly, so under torch.compile pass cu_seqlens). ids / mask / old_logp /
    ref_logp [1, N] or [N]; advantages [S] or per token; is_weight [S], [S, 1]
    or per token. Every per-sequence rule follows the sequences; the result
    equals the padded call on the same tokens (docs/semantics.md).

    dapo / cispo / vespo need num_items_in_batch
    (the global valid-token count: a number or a one-element tensor); dr_grpo
    needs max_completion_length; luspo needs importance_sampling_level=
    "sequence". Every grpo.LossConfig field has a keyword here
    (grpo/_fields.py: sapo_tau_pos is sapo_temperature_pos, ...):
    kl_estimator ("k3", "k1", "abs", "k2", "k1+", "abs+", "k3+"),
    off_policy_mask_threshold, clip_ratio_c (verl's dual-clip), entropy_coef,
    top_entropy_quantile, logit_softcap / logit_scale. token_block /
    vocab_tile / workspace_budget / num_threads: the plan's schedule options.
    grad_filter: the filtered backward (docs/filtered_backward.md): None /
    "off" (default: every gradient exact), "auto" (guarded, threshold
    eps(weight dtype) / 32) or a threshold in (0, 1); loss, logp, entropy,
    KL and metrics are bitwise the unfiltered ones; stats count what was left
    out.

    vocab_group / data_group: torch.distributed process groups (grpo/distributed.py,
    docs/scale_out.md): weight (and bias) is this rank's contiguous shard of
    the vocabulary's rows, starting at vocab_start (derived from the group
    when None), and ids stay global; or this rank's batch of a data-parallel
    group. The call is then collective over the groups (eager only); a
    refusal on any rank raises on every rank.

    loss_scale multiplies the loss and its gradients inside the kernel: a
    trainer's `loss / gradient_accumulation_steps` without a pass over the
    gradients (a grad_output != 1 costs one product per gradient).

    Gradients: the kernel computes them in the forward, in each parameter's
    dtype, scaled by the aggregation's normalizer inside the kernel (no
    float32 [V, H] buffer exists). They are outputs of grpo's op, handed to
    autograd by its backward: AccumulateGrad takes them as `.grad` (no copy)
    or adds them into an existing `.grad`. Nothing the caller owns is written
    by the call: a refusal leaves every tensor, `.grad` included, as it was.
    A second backward without retain_graph raises, as torch's own ops do;
    with retain_graph the second one runs the kernel again (a warning says
    so once).
    """
    values = _fields.loss_values(locals())  # the LossConfig keywords as given, by field name
    names = {k: k for k in ("hidden", "weight", "bias", "ids", "mask", "advantages", "old_logp", "ref_logp",
                            "is_weight", "cu_seqlens", "position_ids", "num_items_in_batch", "loss_scale",
                            "vocab_group", "data_group", "vocab_start")}
    if _names:
        names.update(_names)
    plan_values = dict(num_threads=num_threads, workspace_budget=workspace_budget, token_block=token_block,
                       vocab_tile=vocab_tile, grad_filter=grad_filter)
    args = dict(hidden=hidden, weight=weight, ids=ids, mask=mask, advantages=advantages, bias=bias, old_logp=old_logp,
                ref_logp=ref_logp, is_weight=is_weight, cu_seqlens=cu_seqlens, position_ids=position_ids,
                num_items_in_batch=num_items_in_batch, loss_scale=loss_scale, return_entropy=return_entropy,
                plan_cache=plan_cache, values=values, plan_values=plan_values, names=names)
    op_args, shape = _prepare_over_groups(_prepare_loss, args, weight, vocab_group, data_group, vocab_start,
                                          names["vocab_start"], _ops.loss_plan_cached, _ops.forget_loss_plan)
    loss, logp, entropy, kl, metrics, stats, _dh, _dw, _db = _ops.lm_head_loss(*op_args)
    b, s, v, h = shape
    timings = None if torch.compiler.is_compiling() else _ops.last_timings()
    return LmHeadLossResult(loss, logp.view(b, s), entropy.view(b, s) if return_entropy else None,
                            kl.view(b, s) if float(beta) != 0.0 else None, metrics, stats, (v, h), timings)


def _prepare_over_groups(prepare, args: dict, weight, vocab_group, data_group, vocab_start, vocab_start_name: str,
                         cached, forget):
    """prepare(**args, groups=...): the entry point's checks and the op's arguments (its result's first element).

    Without groups, this process alone. With torch.distributed groups the call
    is collective: a refusal on any rank reaches every rank before the op's
    collectives begin (distributed.agree), and since a plan's construction is
    collective too, a rank whose plans are not cached (a new shape: each
    rank's batch pads to its own length) makes every rank build them again
    (cached / forget: the op's plan-cache entries for its arguments).
    """
    if vocab_group is None and data_group is None:
        if vocab_start is not None:
            raise refuse(vocab_start_name, "needs a vocab_group (the shard's first token in the group's vocabulary)")
        return prepare(**args, groups={})
    from grpo import distributed

    handles = {"vocab": None if vocab_group is None else distributed.communicator(vocab_group)[0],
               "data": None if data_group is None else distributed.communicator(data_group)[0]}
    error, prepared, is_cached = None, None, True
    try:
        groups = dict(handles)
        if handles["vocab"] is not None:
            groups["vocab_offset"], groups["global_vocab"] = distributed.vocab_shard(
                handles["vocab"], weight.shape[0] if isinstance(weight, torch.Tensor) else 0, vocab_start)
        prepared = prepare(**args, groups=groups)
        is_cached = cached(*prepared[0])
    except (grpo.Error, grpo.ArgumentTypeError, NotImplementedError) as refusal:
        error = refusal
    order = [h for h in (handles["vocab"], handles["data"], handles["vocab"]) if h is not None]
    if distributed.agree(order if len(set(order)) > 1 else order[:1], error, flag=not is_cached):
        forget(*prepared[0])
    return prepared


def packed_sequences(cu_seqlens, position_ids, hidden, names: dict) -> Optional[tuple]:
    """Packed sequences' (offsets [S + 1] int64, S, N), from cu_seqlens or position_ids; None when neither is given.

    cu_seqlens' values are checked by the library (0 first, increasing, N
    last: refusals name it); position_ids' are read here (eager)."""
    if cu_seqlens is None and position_ids is None:
        return None
    if cu_seqlens is not None and position_ids is not None:
        raise refuse(names["position_ids"], f"is given with {names['cu_seqlens']}: pass one of them")
    if hidden.dim() == 3 and hidden.shape[0] != 1:
        raise refuse(names["hidden"], f"has shape {list(hidden.shape)}: packed sequences are one row of N tokens, "
                     "[1, N, H] or [N, H]")
    if hidden.dim() not in (2, 3):
        raise refuse(names["hidden"], f"must be [1, N, H] or [N, H] with packed sequences, got {hidden.dim()} "
                     "dimensions")
    n = hidden.shape[-2]
    name = names["cu_seqlens"] if cu_seqlens is not None else names["position_ids"]
    given = cu_seqlens if cu_seqlens is not None else position_ids
    check_cpu(given, name)
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise refuse(name, f"must have an integer dtype, got {given.dtype}", grpo.ArgumentTypeError)
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise refuse(name, f"has shape {list(cu_seqlens.shape)}, expected [S + 1] offsets of S >= 1 sequences")
        return cu_seqlens.detach(), cu_seqlens.shape[0] - 1, n
    check_shape(position_ids, name, (1, n), (n,))
    positions = position_ids.detach().reshape(-1)
    if n and int(positions[0]) != 0:
        raise refuse(name, f"starts at position {int(positions[0])}: the packed row's first sequence starts at 0")
    starts = torch.nonzero(positions == 0).flatten().to(torch.int64)
    return torch.cat([starts, torch.tensor([n], dtype=torch.int64)]), starts.shape[0], n


def check_sequence_offsets(offsets: torch.Tensor, n: int, name: str) -> None:
    """Packed offsets' values, read here (where the library does not see them): 0 first, increasing, N last."""
    o = offsets.to(torch.int64)
    if int(o[0]) != 0 or int(o[-1]) != n or bool((o.diff() <= 0).any()):
        shown = o.tolist() if o.numel() <= 16 else o[:8].tolist() + ["..."] + o[-4:].tolist()
        raise refuse(name, f"must start at 0, increase and end at the N = {n} tokens, got {shown}")


def _prepare_loss(hidden, weight, ids, mask, advantages, bias, old_logp, ref_logp, is_weight, cu_seqlens, position_ids,
                  num_items_in_batch, loss_scale, return_entropy, plan_cache, values, plan_values, names, groups):
    """lm_head_grpo_loss's checks (nothing read from a tensor's values but position_ids') and the op's arguments:
    (args, (B, T, V, H))."""
    loss_type = values["loss_type"]
    _check_keywords(values, plan_values, names)
    if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale)):
        raise refuse(names["loss_scale"], f"must be a finite number, got {loss_scale!r}")

    for t, key in ((hidden, "hidden"), (weight, "weight")):
        check_cpu(t, names[key])
        check_float(t, names[key])
    check_cpu(ids, names["ids"])
    packed = packed_sequences(cu_seqlens, position_ids, hidden, names)
    # B and T: from hidden when it is [B, T, H], else from ids [B, T]; packed: one row of N.
    if packed is not None:
        b, s = 1, packed[2]
    elif hidden.dim() == 3:
        b, s = hidden.shape[:2]
    elif ids.dim() == 2:
        b, s = ids.shape
    else:
        raise refuse(names["ids"], f"must be [B, T], got shape {list(ids.shape)}")
    if b == 0 or s == 0:
        raise refuse(names["hidden"], f"holds an empty batch (B = {b}, T = {s}); grpo needs B, T >= 1")
    if weight.dtype != hidden.dtype:
        raise refuse(names["weight"], f"has dtype {weight.dtype} but {names['hidden']} has {hidden.dtype}; "
                     "grpo needs both in one of float32, bfloat16, float16", grpo.ArgumentTypeError)
    rows = as_rows(hidden, names["hidden"], b * s)
    check_head(rows, weight, bias, names)

    # Per-token shapes, and per-sequence ones: [B] (padded) or [S] (packed).
    tokens = ((b, s),) if packed is None else ((1, s), (s,))
    seqs = b if packed is None else packed[1]
    ids_ = per_token(ids, names["ids"], *tokens, integer=True)
    if groups:
        # The op's int32 conversion refuses int64 ids beyond int32: done here, where the groups agree on it.
        ids_ = _ops.int32_ids(ids_, names["ids"])
    mask_ = per_token(mask, names["mask"], *tokens)
    adv_ = per_token(advantages, names["advantages"], *tokens, (seqs,))
    old_ = per_token(old_logp, names["old_logp"], *tokens)
    ref_ = per_token(ref_logp, names["ref_logp"], *tokens)
    isw_ = per_token(is_weight, names["is_weight"], *tokens, (seqs, 1), (seqs,))
    offsets = None if packed is None else packed[0]
    if packed is not None:
        names = dict(names, sequence_offsets=names["cu_seqlens"] if cu_seqlens is not None else names["position_ids"])
    items = _num_items(num_items_in_batch, names["num_items_in_batch"])
    if loss_type in _DAPO_LIKE and items is None:
        raise refuse(names["num_items_in_batch"], f"is required for loss_type '{loss_type}' "
                     "(the global valid-token count)")

    grads = needs_grad(hidden, weight, bias)
    cache_handle = plan_cache.handle if plan_cache is not None else _plan_cache.DEFAULT_HANDLE
    spec = make_spec(names=names, config=values, plan=plan_values, batch=b, seq_len=s, grads=grads,
                     frozen=frozen_head(weight, bias), dweight=weight.requires_grad,
                     dweight_dtype=_ops.dweight_dtype(weight), entropy=bool(return_entropy),
                     kl=float(values["beta"]) != 0.0, loss_scale=float(loss_scale), cache=cache_handle, **groups)
    return (rows, weight, bias, ids_, mask_, adv_, old_, ref_, isw_, offsets, items, spec), (b, s, weight.shape[0],
                                                                                            rows.shape[1])




def _check_signature() -> None:
    missing = set(_fields.LOSS_KEYWORDS) - set(inspect.signature(lm_head_grpo_loss).parameters)
    if missing:
        raise ImportError(f"grpo: lm_head_grpo_loss has no keyword for LossConfig fields {sorted(missing)} "
                          "(grpo/_fields.py LOSS_CONFIG)")


_check_signature()

_LOG_PROB_OUTPUTS = ("log_probs", "entropy")
# TRL's ChunkedLogProbFunction outputs grpo does not compute.
_UNSUPPORTED_LOG_PROB_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")
_LOG_PROB_NAMES = {"hidden": "hidden", "weight": "weight", "bias": "bias", "ids": "labels", "mask": "mask",
                   "dlogp": "grad of log_probs", "dentropy": "grad of entropy"}


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
    on_stats=None,
    token_block: Optional[int] = None,
    vocab_tile: Optional[int] = None,
    vocab_group: Any = None,
    data_group: Any = None,
    vocab_start: Optional[int] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probabilities (and entropy) of an LM head, without the [N, V] logits.

    Returns `(log_probs, entropy)`, float32, shaped like `labels`; entropy is
    None unless "entropy" is in `outputs`. Both are differentiable w.r.t.
    hidden, weight and bias for any loss computed on them: backward runs
    grpo's log-prob head backward (`torch.ops.grpo.log_probs_backward`) with
    their grad_output (None = 0), recomputing the logits. It is the primitive
    TRL 1.16's `add_fused_lm_head` computes with its `ChunkedLogProbFunction`
    (same temperature semantics: x = z / temperature, logp = x_y -
    logsumexp(x), entropy of softmax(x)).

    hidden [B, T, H] or [N, H], weight [V, H] (lm_head.weight): both float32 or
    both bfloat16 or both float16, unit inner stride (any row stride: viewed, not copied);
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
    float32, cast), fresh tensors that AccumulateGrad takes as `.grad` or adds
    into it. A frozen head (neither weight nor bias requires grad, as in
    LoRA) gets a frozen_weight plan whose backward skips the dW GEMMs, a
    third of the step. Any other unneeded gradient (a hidden that does not
    require grad, a weight whose bias alone is trained) is written into a
    scratch buffer kept in the plan cache and discarded. on_stats (eager
    only): called with the step stats (grpo.torch.step_stats) of the forward
    and of the backward kernel calls. logit_softcap / logit_scale: the
    model's logit transform before the temperature, as TRL applies
    final_logit_softcapping and its logit scale: z' = c tanh(s z / c), or
    s z without a cap (None). temperature_on_logp: grpo's other temperature
    convention (logp = (z_y - LSE(z)) / tau, entropy of softmax(z)).
    grad_filter: the filtered backward, as lm_head_grpo_loss. token_block /
    vocab_tile: the plan's schedule options, as lm_head_grpo_loss (a vocab
    group's shards on tile boundaries give the single process's bits).
    Refusals raise grpo.Error / grpo.ArgumentTypeError / NotImplementedError
    naming the argument.

    vocab_group / data_group / vocab_start: torch.distributed process groups,
    as lm_head_grpo_loss (docs/scale_out.md). vocab_group: weight (and bias)
    is this rank's contiguous shard of the vocabulary's rows, starting at
    vocab_start (derived from the group when None); labels stay global and
    every rank of the group passes the same rows, labels, mask and (in the
    backward) the same upstream gradients; log_probs and entropy are the
    whole vocabulary's, the same on every rank; dW / dbias are the shard's,
    dhidden is summed over the group. data_group: each rank its own rows and
    all of W; dW / dbias are summed over the group (the gradient of a loss
    summed over every rank's rows). The forward and the backward are then
    collective (eager only: every rank runs both, in the same order); a
    refusal on any rank raises on every rank.

    Packed sequences: the head is per token, so a packed row (hidden [1, N,
    H] or [N, H]) needs nothing more. cu_seqlens / position_ids are accepted,
    so that one call site serves both layouts, and checked as
    lm_head_grpo_loss checks them (values read eagerly); they change no
    output.
    """
    if cu_seqlens is not None or position_ids is not None:
        names = dict(_LOG_PROB_NAMES, cu_seqlens="cu_seqlens", position_ids="position_ids")
        offsets, _count, n = packed_sequences(cu_seqlens, position_ids, hidden, names)
        if cu_seqlens is not None:
            check_sequence_offsets(offsets, n, "cu_seqlens")
    args = dict(hidden=hidden, weight=weight, bias=bias, labels=labels, temperature=temperature, outputs=outputs,
                mask=mask, temperature_on_logp=temperature_on_logp, logit_softcap=logit_softcap,
                logit_scale=logit_scale, num_threads=num_threads, workspace_budget=workspace_budget,
                grad_filter=grad_filter, plan_cache=plan_cache, on_stats=on_stats, token_block=token_block,
                vocab_tile=vocab_tile)
    op_args, out_shape, outputs = _prepare_over_groups(_prepare_log_probs, args, weight, vocab_group, data_group,
                                                       vocab_start, "vocab_start", _ops.log_probs_plans_cached,
                                                       _ops.forget_log_probs_plans)
    rows, weight, bias, labels_, mask_, spec = op_args
    logp, entropy, stats = _ops.log_probs(rows, weight, bias, labels_, mask_, spec)
    if on_stats is not None:
        on_stats(step_stats(stats, weight.shape[0], rows.shape[1], _ops.last_timings()))
        if logp.grad_fn is not None:
            logp.grad_fn.on_stats = on_stats  # read by the op's backward (grpo/_ops.py)
    return logp.view(out_shape), entropy.view(out_shape) if "entropy" in outputs else None


def _prepare_log_probs(hidden, weight, bias, labels, temperature, outputs, mask, temperature_on_logp, logit_softcap,
                       logit_scale, num_threads, workspace_budget, grad_filter, plan_cache, on_stats, token_block,
                       vocab_tile, groups):
    """fused_log_probs's checks and the op's arguments: ((rows, weight, bias, labels, mask, spec), shape, outputs)."""
    plan = dict(num_threads=num_threads, workspace_budget=workspace_budget, grad_filter=grad_filter)
    # The schedule options only when given: the specs (and plan keys) of calls without them stay as they were.
    plan.update({k: v for k, v in (("token_block", token_block), ("vocab_tile", vocab_tile)) if v is not None})
    _check_keywords(None, plan, {})
    outputs = tuple(outputs)
    for name in outputs:
        if name in _UNSUPPORTED_LOG_PROB_OUTPUTS:
            raise refuse("outputs", f"'{name}' is not computed by grpo", NotImplementedError)
        if name not in _LOG_PROB_OUTPUTS:
            raise refuse("outputs", f"unknown output '{name}' (one of {', '.join(_LOG_PROB_OUTPUTS)})")
    for t, name in ((hidden, "hidden"), (weight, "weight")):
        check_cpu(t, name)
        check_float(t, name)
    check_cpu(labels, "labels")
    if hidden.dim() not in (2, 3):
        raise refuse("hidden", f"must be [B, T, H] or [N, H], got {hidden.dim()} dimensions")
    n = hidden.shape[0] * (hidden.shape[1] if hidden.dim() == 3 else 1)
    if weight.dtype != hidden.dtype:
        raise refuse("weight", f"has dtype {weight.dtype} but hidden has {hidden.dtype}; "
                     "grpo needs both in one of float32, bfloat16, float16", grpo.ArgumentTypeError)
    rows = as_rows(hidden, "hidden", n)
    check_head(rows, weight, bias, _LOG_PROB_NAMES)
    if labels.numel() != n:
        raise refuse("labels", f"has {labels.numel()} elements (shape {list(labels.shape)}), expected {n}")
    out_shape = labels.shape
    labels_ = per_token(labels.reshape(n), "labels", (n,), integer=True)
    mask_ = None
    if mask is not None:
        check_cpu(mask, "mask")
        check_shape(mask, "mask", tuple(out_shape))
        mask_ = per_token(mask.reshape(n), "mask", (n,))
    if not (float(temperature) > 0.0 and math.isfinite(float(temperature))):
        raise refuse("temperature", f"must be finite and > 0, got {temperature}")
    if on_stats is not None and torch.compiler.is_compiling():
        raise refuse("on_stats", "is for eager mode; under torch.compile read the stats in eager runs")

    if groups:
        # The op's int32 conversion refuses int64 labels beyond int32: done here, where the groups agree on it.
        labels_ = _ops.int32_ids(labels_, "labels")
    cache_handle = plan_cache.handle if plan_cache is not None else _plan_cache.DEFAULT_HANDLE
    spec = make_spec(names=_LOG_PROB_NAMES, temperature=float(temperature),
                     temperature_on_logp=bool(temperature_on_logp),
                     logit_softcap=None if logit_softcap is None else float(logit_softcap),
                     logit_scale=float(logit_scale),
                     plan=plan,
                     forward_only=not needs_grad(hidden, weight, bias), frozen=frozen_head(weight, bias),
                     dweight_dtype=_ops.dweight_dtype(weight),
                     entropy="entropy" in outputs, cache=cache_handle, **groups)
    return (rows, weight, bias, labels_, mask_, spec), out_shape, outputs
