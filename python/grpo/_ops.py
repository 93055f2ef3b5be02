"""grpo's PyTorch operators, registered through torch.library.custom_op.

Three ops, each with a fake (meta) kernel and, for the differentiable ones,
autograd registered with `register_autograd`, so torch.compile(fullgraph=True)
traces a module calling them without a graph break and
torch.library.opcheck passes:

- ``grpo::lm_head_loss``: the fused GRPO loss of an LM head. The kernel
  computes the loss, the per-token outputs, the metrics and the gradients of
  hidden, weight and bias in one call (the only moment the logits exist);
  the gradients are outputs of the op, in each parameter's dtype and already
  scaled by the call's normalizer, and its backward hands them to autograd
  (scaled by grad_output unless it is 1).
- ``grpo::log_probs`` / ``grpo::log_probs_backward``: the generic log-prob
  head (per-token logp and entropy) and its backward from any upstream
  gradients, which recomputes the logits.

The ops are functional: they allocate every output and write nothing the
caller owns. A refusal (met before or during the kernel) raises with no
output produced, so nothing a caller holds, an accumulated `.grad` included,
changes: autograd adds the gradients into `.grad` (AccumulateGrad) only once
backward runs. Fresh gradients handed over with grad_output == 1 are stolen by
AccumulateGrad when no `.grad` exists (no copy).

Everything that is not a tensor travels in `spec`, a JSON string made once
per call site (a constant under torch.compile): the loss configuration, the
schedule options, which outputs to make, the caller's argument names for
refusals, and the plan cache (by its handle). Small per-token inputs are
converted to int32 / float32 inside the op, where their values can be
checked. The plan is looked up in the cache per call (a hit after the first):
no nanobind object lives in an autograd graph.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from typing import Optional

import torch
from torch import Tensor

import grpo
from grpo import _core, _fields, _plan_cache
from grpo._torch_args import FLOAT_DTYPES, REFUSALS, refuse, refused_keyword, renamed

# What a StepStats counts, in the order of the op's stats output (float64): what the kernel executed, a
# function of the inputs like every other output.
STAT_FIELDS = ("logits_gemm_rows", "backward_gemm_rows", "dweight_gemm_rows", "active_rows",
               "dhidden_skipped_row_columns", "dweight_skipped_row_columns", "filter_guard_blocks",
               "filter_lowered_blocks", "f16_saturated")
# Its wall times (the C++ call's, and the per-phase thread-seconds) differ from run to run: not an output of an
# op (which must be a function of its inputs), they are kept per thread for the eager caller (last_timings).
TIME_FIELDS = ("kernel_s", "forward_gemm_s", "forward_stage_s", "dlogits_s", "dweight_gemm_s", "dhidden_gemm_s")
# The op's metrics output (float32), grpo::Metrics without the loss.
METRIC_FIELDS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "kl_mean", "entropy_mean", "num_valid")
_DAPO_LIKE = ("dapo", "cispo", "vespo")


@torch.compiler.assume_constant_result
def make_spec(**fields) -> str:
    """The op's non-tensor arguments as one JSON string (a constant for torch.compile)."""
    return json.dumps(fields, sort_keys=True, default=float)  # default: numpy scalars and the like


_timings = threading.local()


def last_timings() -> Optional[dict[str, float]]:
    """The wall times (TIME_FIELDS) of the last grpo op this thread ran eagerly."""
    return getattr(_timings, "last", None)


def step_stats(stats: Tensor, v: int, h: int, timings: Optional[dict[str, float]] = None) -> dict[str, float]:
    """An op's stats output (and its timings) as a dict, with executed_flops = 2 H x (row x vocab columns the
    three GEMMs ran).

    That is 2 V H x (rows through the three GEMMs) less 2 H x the row x
    columns the filtered backward (grad_filter) left out of dhidden / dW.
    """
    out = dict(zip(STAT_FIELDS, stats.tolist()))
    out.update(timings or {})
    rows = out["logits_gemm_rows"] + out["backward_gemm_rows"] + out["dweight_gemm_rows"]
    skipped = out["dhidden_skipped_row_columns"] + out["dweight_skipped_row_columns"]
    out["executed_flops"] = 2.0 * h * (v * rows - skipped)
    return out


def _stats_tensor(stats: grpo.StepStats) -> Tensor:
    _timings.last = {f: float(getattr(stats, f)) for f in TIME_FIELDS}
    if stats.f16_saturated > 0:
        warnings.warn(f"grpo: {stats.f16_saturated} float16 gradient entries exceeded 65504 and were written as "
                      "+-65504 (the largest finite float16; docs/semantics.md, 'fp16'): scale the loss down",
                      RuntimeWarning, stacklevel=2)
    return torch.tensor([float(getattr(stats, f)) for f in STAT_FIELDS], dtype=torch.float64)


def _empty(dtype=torch.float32) -> Tensor:
    return torch.empty(0, dtype=dtype)


def _row_stride(m: Tensor) -> int:
    # As the C++ binding computes it: a single row's stride means nothing.
    return m.stride(0) if m.shape[0] > 1 else m.shape[1]


def _head_shape(b: int, s: int, h: int, v: int, dtype, bias: Optional[Tensor], hidden_ld: int,
                weight_ld: int) -> _core.LmHeadShape:
    shape = _core.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = b, s, h, v
    shape.dtype = dtype
    shape.has_bias = bias is not None
    shape.bias_dtype = FLOAT_DTYPES[bias.dtype] if bias is not None else _core.DType.f32
    shape.hidden_ld, shape.weight_ld = hidden_ld, weight_ld
    shape.dweight_ld = h  # the ops' dW is a contiguous [V, H]
    return shape


def dweight_dtype(weight: Tensor) -> str:
    """The dtype dW is written in: the weight's, or float32 for a bf16 / fp16 weight whose grad_dtype is float32
    (mixed precision: the float32 .grad then gets the kernel's float32 dW, not a 16-bit rounding of it). Under
    torch.compile, whose tracer cannot read grad_dtype, the weight's (autograd converts it to grad_dtype)."""
    if torch.compiler.is_compiling():
        return str(weight.dtype).removeprefix("torch.")
    if weight.dtype in (torch.bfloat16, torch.float16) and getattr(weight, "grad_dtype", None) == torch.float32:
        return "float32"
    return str(weight.dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _plan_values(s: dict) -> dict:
    """The spec's schedule keywords, num_threads None read as torch's thread count at the time of the call."""
    values = dict(s["plan"])
    if values.get("num_threads") is None:
        values["num_threads"] = torch.get_num_threads()
    return values


def int32_ids(t: Tensor, name: str) -> Tensor:
    """Integer ids as a contiguous int32 tensor; values outside int32 refused (naming `name`)."""
    converted = t.to(torch.int32)
    if t.dtype != torch.int32 and not torch.equal(converted.to(t.dtype), t):
        raise refuse(name, "holds values outside the int32 range")
    return converted.contiguous()


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.float32).contiguous()


def _scratch(cache: grpo.PlanCache, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """A buffer of `shape` kept in the cache, for a gradient the C++ head must write but nobody wants.

    Its contents are garbage; every call of that cache that needs it writes
    into the same buffer (serialized by the cache's workspace lock).
    """
    return cache.get("scratch", (shape, str(dtype)), lambda: torch.empty(shape, dtype=dtype))


_rerun_warned = False


def _warn_rerun() -> None:
    global _rerun_warned
    if not _rerun_warned:
        _rerun_warned = True
        warnings.warn("grpo: a second backward through the fused loss (retain_graph=True) runs its kernel again: "
                      "correct, but it costs a second step", RuntimeWarning, stacklevel=3)


def _loss_plan(s: dict, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], num_items_in_batch: Optional[Tensor]):
    """(cache, key, build, the call's gradient scale) of a grpo::lm_head_loss call: its plan's cache entry."""
    names = s["names"]
    h = hidden.shape[1]
    v = weight.shape[0]
    cache = _plan_cache.by_handle(s["cache"])
    # dapo / cispo / vespo: the plan gets a unit normalizer and the call's
    # gradient scale is 1 / num_items_in_batch (applied to the coefficients
    # inside the kernel), so one plan serves every step. The entropy bonus
    # has its own normalizer: with it the plan gets the real one.
    scale, items = float(s["loss_scale"]), 0.0
    if s["config"]["loss_type"] in _DAPO_LIKE:
        if num_items_in_batch is None:
            raise refuse(names["num_items_in_batch"], f"is required for loss_type '{s['config']['loss_type']}' "
                         "(the global valid-token count)")
        normalizer = float(num_items_in_batch)
        if not (normalizer > 0.0 and math.isfinite(normalizer)):
            raise refuse(names["num_items_in_batch"], f"must be finite and > 0, got {normalizer}")
        if float(s["config"]["entropy_coef"]) == 0.0:
            scale, items = scale / normalizer, 1.0
        else:
            items = normalizer
    config = _fields.loss_config(s["config"])
    config.num_items_in_batch = items
    dtype = FLOAT_DTYPES[hidden.dtype]
    options = _fields.head_options(_plan_values(s), forward_only=not s["grads"], frozen_weight=s["frozen"],
                                   dweight_dtype=FLOAT_DTYPES[_dtype(s["dweight_dtype"])], dhidden_dtype=dtype)
    hidden_ld, weight_ld = _row_stride(hidden), _row_stride(weight)
    # Scale-out (grpo/distributed.py): the groups by handle, this rank's shard of the vocabulary.
    groups = (s.get("vocab"), s.get("data"), s.get("vocab_offset", 0), s.get("global_vocab", 0))
    key = (s["batch"], s["seq_len"], h, v, str(hidden.dtype), None if bias is None else str(bias.dtype),
           hidden_ld, weight_ld, _fields.plan_key(config, options), groups)

    def build():
        shape = _head_shape(s["batch"], s["seq_len"], h, v, dtype, bias, hidden_ld, weight_ld)
        if groups[0] is None and groups[1] is None:
            return _core.LmHeadLossPlan(shape, config, options)
        from grpo import distributed

        shape.vocab_offset, shape.global_vocab = groups[2], groups[3]
        return _core.LmHeadLossPlan(shape, config, options, vocab_group=distributed.by_handle(groups[0]),
                                    data_group=distributed.by_handle(groups[1]))

    return cache, key, build, scale


def loss_plan_cached(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], *args) -> bool:
    """Whether a grpo::lm_head_loss call with these arguments finds its plan in the cache (args: the op's rest)."""
    spec, num_items_in_batch = args[-1], args[-2]
    cache, key, _build, _scale = _loss_plan(json.loads(spec), hidden, weight, bias, num_items_in_batch)
    return cache.contains("lm_head_loss", key)


def forget_loss_plan(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], *args) -> None:
    """Drops that call's plan from the cache, so the call builds it again (with its groups: collectively)."""
    spec, num_items_in_batch = args[-1], args[-2]
    cache, key, _build, _scale = _loss_plan(json.loads(spec), hidden, weight, bias, num_items_in_batch)
    cache.discard("lm_head_loss", key)


# --------------------------------------------------------------------------
# grpo::lm_head_loss
# --------------------------------------------------------------------------


@torch.library.custom_op("grpo::lm_head_loss", mutates_args=())
def lm_head_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, mask: Tensor,
                 advantages: Tensor, old_logp: Optional[Tensor], ref_logp: Optional[Tensor],
                 is_weight: Optional[Tensor], sequence_offsets: Optional[Tensor], num_items_in_batch: Optional[Tensor],
                 spec: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused loss: (loss, logp, entropy, kl, metrics, stats, dhidden, dweight, dbias).

    hidden [N, H] rows; sequence_offsets: packed sequences' [S + 1] offsets
    (cu_seqlens) or None; entropy / kl / the gradients are empty when the spec
    does not ask for them. See grpo.torch.lm_head_grpo_loss.
    """
    s = json.loads(spec)
    names = s["names"]
    n, h = hidden.shape
    v = weight.shape[0]
    try:
        ids32 = int32_ids(ids, names["ids"])
        cache, key, build, scale = _loss_plan(s, hidden, weight, bias, num_items_in_batch)
        grads, frozen = s["grads"], s["frozen"]
        grad_dtype = _dtype(s["dweight_dtype"])
        plan = cache.get("lm_head_loss", key, build)
        logp = torch.empty(n, dtype=torch.float32)
        entropy = torch.empty(n, dtype=torch.float32) if s["entropy"] else None
        kl = torch.empty(n, dtype=torch.float32) if s["kl"] else None
        dhidden = dweight = dbias = None
        if grads:
            dhidden = torch.empty(n, h, dtype=hidden.dtype)
            if not frozen:
                dweight = (torch.empty(v, h, dtype=grad_dtype) if s["dweight"] else
                           _scratch(cache, (v, h), grad_dtype))  # the bias alone is trained
                dbias = torch.empty(v, dtype=torch.float32) if bias is not None else None
        stats = grpo.StepStats()
        m = plan.execute(cache.workspace, hidden=hidden.detach(), weight=weight.detach(), ids=ids32, mask=_f32(mask),
                         advantages=_f32(advantages), logp=logp, bias=None if bias is None else bias.detach(),
                         old_logp=_f32(old_logp), ref_logp=_f32(ref_logp), is_weight=_f32(is_weight),
                         sequence_offsets=None if sequence_offsets is None else
                         sequence_offsets.to(torch.int64).contiguous(), entropy=entropy,
                         kl=kl, dhidden=dhidden, dweight=dweight, dbias=dbias, grad_scale=scale, stats=stats)
    except _fields.Refusal as refusal:
        raise refused_keyword(refusal, names) from None
    except REFUSALS as error:
        raise renamed(error, names) from None
    metrics = torch.tensor([float(getattr(m, f)) for f in METRIC_FIELDS], dtype=torch.float32)
    return (torch.tensor(m.loss * scale, dtype=torch.float32), logp,
            _empty() if entropy is None else entropy, _empty() if kl is None else kl, metrics,
            _stats_tensor(stats), _empty(hidden.dtype) if dhidden is None else dhidden,
            _empty(grad_dtype) if dweight is None or not s["dweight"] else dweight,
            _empty() if dbias is None else dbias)


@lm_head_loss.register_fake
def _(hidden, weight, bias, ids, mask, advantages, old_logp, ref_logp, is_weight, sequence_offsets, num_items_in_batch,
      spec):
    s = json.loads(spec)
    n, h = hidden.shape
    v = weight.shape[0]

    def f32(*shape):
        return hidden.new_empty(shape, dtype=torch.float32)

    grads, frozen = s["grads"], s["frozen"]
    return (f32(), f32(n), f32(n if s["entropy"] else 0), f32(n if s["kl"] else 0), f32(len(METRIC_FIELDS)),
            hidden.new_empty(len(STAT_FIELDS), dtype=torch.float64),
            hidden.new_empty((n, h) if grads else (0,)),
            weight.new_empty((v, h) if grads and not frozen and s["dweight"] else (0,), dtype=_dtype(s["dweight_dtype"])),
            f32(v if grads and not frozen and bias is not None else 0))


def _loss_setup(ctx, inputs, output):
    # No zeros materialized for the outputs without a gradient (dweight's
    # would be a [V, H] of them).
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    # The gradients the forward computed, handed over once (so AccumulateGrad
    # can steal them: nothing else holds them); the inputs saved for a second
    # backward (retain_graph), which runs the kernel again, and so that
    # torch refuses a second backward without retain_graph and an input
    # modified in place since the forward.
    ctx.grads = list(output[6:9])
    ctx.save_for_backward(*inputs[:11])
    ctx.spec = inputs[11]


def _scaled(grads: list, g: Tensor) -> list:
    """The gradients times grad_output g: as they are when g is exactly 1 (eager), else new tensors."""
    if type(g) is torch.Tensor and not torch.compiler.is_compiling() and float(g) == 1.0:
        return grads
    return [t * g.to(t.dtype) if t.numel() else t for t in grads]


def _loss_backward(ctx, g, *_unused):
    saved = ctx.saved_tensors
    grads = ctx.grads
    ctx.grads = None
    if g is None:
        return (None,) * 12
    if grads is None:  # a second backward (retain_graph=True)
        _warn_rerun()
        grads = list(torch.ops.grpo.lm_head_loss.default(*saved, ctx.spec)[6:9])
    dhidden, dweight, dbias = _scaled(grads, g)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    bias = saved[2]
    return (dhidden if need_h and dhidden.numel() else None,
            dweight if need_w and dweight.numel() else None,
            dbias.to(bias.dtype) if need_b and dbias.numel() else None) + (None,) * 9


lm_head_loss.register_autograd(_loss_backward, setup_context=_loss_setup)


# --------------------------------------------------------------------------
# grpo::log_probs and grpo::log_probs_backward
# --------------------------------------------------------------------------


def _log_prob_entry(s: dict, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], forward_only: bool,
                    frozen: bool):
    """(cache, key, build) of the log-prob head's plan for a call."""
    grad_dtype = FLOAT_DTYPES[_dtype(s["dweight_dtype"])]
    plan_values = _plan_values(s)
    n, h = hidden.shape
    v = weight.shape[0]
    cache = _plan_cache.by_handle(s["cache"])
    dtype = FLOAT_DTYPES[hidden.dtype]
    hidden_ld, weight_ld = _row_stride(hidden), _row_stride(weight)
    # Scale-out (grpo/distributed.py): the groups by handle, this rank's shard of the vocabulary.
    groups = (s.get("vocab"), s.get("data"), s.get("vocab_offset", 0), s.get("global_vocab", 0))
    key = (n, h, v, str(hidden.dtype), None if bias is None else str(bias.dtype), hidden_ld, weight_ld,
           s["temperature"], s["temperature_on_logp"], s["logit_softcap"], s["logit_scale"],
           json.dumps(plan_values, sort_keys=True), forward_only, frozen, s["dweight_dtype"], groups)

    def build():
        # One sequence of N rows: the head has no per-sequence term, so the
        # plan depends on N only.
        shape = _head_shape(1, n, h, v, dtype, bias, hidden_ld, weight_ld)
        config = _core.LogProbConfig()
        config.temperature = float(s["temperature"])
        config.temperature_on_logp = bool(s["temperature_on_logp"])
        config.logit_softcap = s["logit_softcap"]
        config.logit_scale = float(s["logit_scale"])
        options = _fields.head_options(plan_values, forward_only=forward_only, frozen_weight=frozen,
                                       dweight_dtype=grad_dtype, dhidden_dtype=dtype)
        if groups[0] is None and groups[1] is None:
            return _core.LmHeadLogProbPlan(shape, config, options)
        from grpo import distributed

        shape.vocab_offset, shape.global_vocab = groups[2], groups[3]
        return _core.LmHeadLogProbPlan(shape, config, options, vocab_group=distributed.by_handle(groups[0]),
                                       data_group=distributed.by_handle(groups[1]))

    return cache, key, build


def _log_prob_plan(s: dict, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], forward_only: bool,
                   frozen: bool):
    cache, key, build = _log_prob_entry(s, hidden, weight, bias, forward_only, frozen)
    return cache, cache.get("lm_head_log_prob", key, build)


def log_probs_plans_cached(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                           mask: Optional[Tensor], spec: str) -> bool:
    """Whether a grpo::log_probs call (and its backward's plan) finds its plans in the cache."""
    s = json.loads(spec)
    keys = {(s["forward_only"], s["frozen"]), (False, s["frozen"])}
    for forward_only, frozen in keys:
        cache, key, _build = _log_prob_entry(s, hidden, weight, bias, forward_only, frozen)
        if not cache.contains("lm_head_log_prob", key):
            return False
    return True


def forget_log_probs_plans(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                           mask: Optional[Tensor], spec: str) -> None:
    """Drops that call's plans (forward and backward) from the cache: with groups, every rank builds them again."""
    s = json.loads(spec)
    for forward_only, frozen in {(s["forward_only"], s["frozen"]), (False, s["frozen"])}:
        cache, key, _build = _log_prob_entry(s, hidden, weight, bias, forward_only, frozen)
        cache.discard("lm_head_log_prob", key)


@torch.library.custom_op("grpo::log_probs", mutates_args=())
def log_probs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, mask: Optional[Tensor],
              spec: str) -> tuple[Tensor, Tensor, Tensor]:
    """The log-prob head's forward: (logp [N], entropy [N] or empty, stats)."""
    s = json.loads(spec)
    names = s["names"]
    n = hidden.shape[0]
    try:
        ids32 = int32_ids(labels, names["ids"])
        cache, plan = _log_prob_plan(s, hidden, weight, bias, s["forward_only"], s["frozen"])
        logp = torch.empty(n, dtype=torch.float32)
        entropy = torch.empty(n, dtype=torch.float32) if s["entropy"] else None
        stats = plan.forward(cache.workspace, hidden=hidden.detach(), weight=weight.detach(), ids=ids32, logp=logp,
                             bias=None if bias is None else bias.detach(), mask=_f32(mask), entropy=entropy)
    except _fields.Refusal as refusal:
        raise refused_keyword(refusal, names) from None
    except REFUSALS as error:
        raise renamed(error, names) from None
    return logp, _empty() if entropy is None else entropy, _stats_tensor(stats)


@log_probs.register_fake
def _(hidden, weight, bias, labels, mask, spec):
    s = json.loads(spec)
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n if s["entropy"] else 0, dtype=torch.float32),
            hidden.new_empty(len(STAT_FIELDS), dtype=torch.float64))


@torch.library.custom_op("grpo::log_probs_backward", mutates_args=())
def log_probs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                       mask: Optional[Tensor], dlogp: Tensor, dentropy: Optional[Tensor], spec: str,
                       need_hidden: bool, need_weight: bool, need_bias: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The log-prob head's backward: (dhidden, dweight, dbias, stats); a gradient not needed is empty."""
    s = json.loads(spec)
    names = s["names"]
    n, h = hidden.shape
    v = weight.shape[0]
    frozen = not (need_weight or need_bias)
    try:
        ids32 = int32_ids(labels, names["ids"])
        cache, plan = _log_prob_plan(s, hidden, weight, bias, False, frozen)
        # The C++ head writes every gradient its plan has: an unwanted one
        # goes to a cached scratch buffer. A frozen head's plan has no dW /
        # dbias at all.
        dhidden = torch.empty(n, h, dtype=hidden.dtype) if need_hidden else _scratch(cache, (n, h), hidden.dtype)
        dweight = dbias = None
        if not frozen:
            grad_dtype = _dtype(s["dweight_dtype"])
            dweight = torch.empty(v, h, dtype=grad_dtype) if need_weight else _scratch(cache, (v, h), grad_dtype)
            if bias is not None:
                dbias = torch.empty(v, dtype=torch.float32) if need_bias else _scratch(cache, (v,))
        stats = plan.backward(cache.workspace, hidden=hidden.detach(), weight=weight.detach(), ids=ids32,
                              dlogp=_f32(dlogp), dhidden=dhidden, bias=None if bias is None else bias.detach(),
                              mask=_f32(mask), dentropy=_f32(dentropy), dweight=dweight, dbias=dbias)
    except _fields.Refusal as refusal:
        raise refused_keyword(refusal, names) from None
    except REFUSALS as error:
        raise renamed(error, names) from None
    return (dhidden if need_hidden else _empty(hidden.dtype),
            dweight if need_weight else _empty(_dtype(s["dweight_dtype"])),
            dbias if need_bias and dbias is not None else _empty(), _stats_tensor(stats))


@log_probs_backward.register_fake
def _(hidden, weight, bias, labels, mask, dlogp, dentropy, spec, need_hidden, need_weight, need_bias):
    n, h = hidden.shape
    v = weight.shape[0]
    grad_dtype = _dtype(json.loads(spec)["dweight_dtype"])
    return (hidden.new_empty((n, h) if need_hidden else (0,)),
            weight.new_empty((v, h) if need_weight else (0,), dtype=grad_dtype),
            hidden.new_empty(v if need_bias and bias is not None else 0, dtype=torch.float32),
            hidden.new_empty(len(STAT_FIELDS), dtype=torch.float64))


def _log_probs_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(*inputs[:5])
    ctx.spec = inputs[5]


def _log_probs_grad(ctx, grad_logp, grad_entropy, _grad_stats):
    hidden, weight, bias, labels, mask = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    s = json.loads(ctx.spec)
    # With groups the backward is collective: a rank whose upstream is None
    # still takes part (with zeros), as its group's other ranks expect.
    grouped = s.get("vocab") is not None or s.get("data") is not None
    if (grad_logp is None and grad_entropy is None and not grouped) or not (need_h or need_w or need_b):
        return (None,) * 6
    dlogp = grad_logp if grad_logp is not None else hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
    dhidden, dweight, dbias, stats = torch.ops.grpo.log_probs_backward.default(
        hidden, weight, bias, labels, mask, dlogp, grad_entropy, ctx.spec, need_h, need_w, need_b)
    on_stats = getattr(ctx, "on_stats", None)  # set on the node by fused_log_probs (eager only)
    if on_stats is not None:
        on_stats(step_stats(stats, weight.shape[0], hidden.shape[1], last_timings()))
    return (dhidden if need_h else None, dweight if need_w else None,
            dbias.to(bias.dtype) if need_b else None, None, None, None)


log_probs.register_autograd(_log_probs_grad, setup_context=_log_probs_setup)
