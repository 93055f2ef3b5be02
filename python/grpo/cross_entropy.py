"""Linear cross entropy (the SFT loss) with torch 2.15's `F.linear_cross_entropy` signature, without the logits.

    from grpo.torch import linear_cross_entropy, LinearCrossEntropyLoss

    loss = linear_cross_entropy(hidden, lm_head.weight, labels)      # was F.linear_cross_entropy(...)
    loss.backward()

loss_t = -log softmax(x_t W^T + b)[y_t] (SPEC "Linear cross entropy"),
reduction "mean" (over the rows whose target is not ignore_index), "sum" or
"none", exactly as torch.nn.functional.cross_entropy defines them.

How. "mean" and "sum" are one call of grpo's fused loss (three GEMM passes:
the gradients are computed in the forward, while the logits tile exists, as
Liger's fused linear cross entropy and torch's chunked path do): with the
advantage 1 on every row, on-policy (r = 1 exactly) and cispo's weight
min(r, epsilon_high) = 1, its per-token term is -logp_t, aggregated over
num_items_in_batch = the non-ignored rows (mean) or 1 (sum). "none" gives
per-row values to a loss the library does not see: it is the generic
log-prob head (grpo.torch.fused_log_probs), whose backward recomputes the
logits of the rows that need it (four GEMM passes).

Refused by name: class weights (`weight`), `label_smoothing` other than 0,
class-probability targets, a weight of more than two dimensions, reductions
other than the three. torch's `options` (its chunking choice) is accepted
and has nothing to choose here: grpo's path is always tiled.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import grpo
from grpo._torch_args import REFUSALS, refuse as _refuse, renamed
from grpo.functional import fused_log_probs, lm_head_grpo_loss

_REDUCTIONS = ("mean", "sum", "none")
# The fused loss's arguments, as linear_cross_entropy's caller spells them.
_NAMES = {"hidden": "input", "weight": "linear_weight", "bias": "linear_bias", "ids": "target", "labels": "target",
          "mask": "target"}


def _check_options(reduction: str, label_smoothing: float) -> None:
    """The options grpo computes: one of the three reductions, no label smoothing."""
    if label_smoothing != 0.0:
        raise _refuse("label_smoothing", f"only 0 is supported by grpo, got {label_smoothing!r}", NotImplementedError)
    if reduction not in _REDUCTIONS:
        raise _refuse("reduction", f"must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")


def linear_cross_entropy(
    input: torch.Tensor,  # noqa: A002 (torch's name)
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    options: Any = None,
    num_threads: Optional[int] = None,
    plan_cache: Optional[grpo.PlanCache] = None,
) -> torch.Tensor:
    """torch.nn.functional.linear_cross_entropy, computed by grpo (see the module's docstring).

    input [*, H] and linear_weight [V, H] (both float32, both bfloat16 or both float16),
    linear_bias [V] or None, target [*] integer class indices; ignore_index
    None means torch's -100. Returns the input's dtype: a 0-dim loss, or [*]
    for reduction="none" (0 on ignored rows).
    """
    if weight is not None:
        raise _refuse("weight", "class weights are not supported by grpo (None only)", NotImplementedError)
    _check_options(reduction, label_smoothing)
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() != 2:
        shape = list(linear_weight.shape) if isinstance(linear_weight, torch.Tensor) else type(linear_weight).__name__
        raise _refuse("linear_weight", f"must be [V, H] (2-D), got {shape}")
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise _refuse("input", "must be a tensor [*, H]")
    if not isinstance(target, torch.Tensor):
        raise _refuse("target", f"must be a tensor of class indices, got {type(target).__name__}")
    if target.is_floating_point():
        raise _refuse("target", "class-probability targets are not supported by grpo (class indices only)",
                      NotImplementedError)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise _refuse("target", f"has shape {list(target.shape)}, expected {list(input.shape[:-1])} "
                                "(input's shape without its last dimension)")
    ignore = -100 if ignore_index is None else int(ignore_index)
    h = input.shape[-1]
    n = target.numel()
    rows = input.reshape(n, h)
    labels = target.reshape(n)
    valid = labels != ignore
    ids = torch.where(valid, labels, torch.zeros((), dtype=labels.dtype))  # ignored rows' ids are never read

    try:
        if reduction == "none":
            logp, _ = fused_log_probs(rows, linear_weight, linear_bias, ids, outputs=("log_probs",),
                                         mask=valid.to(torch.float32), num_threads=num_threads,
                                         plan_cache=plan_cache)
            return (-logp).reshape(target.shape).to(input.dtype)
        # The count stays a tensor (read by the op): nothing leaves a compiled graph.
        count = valid.sum(dtype=torch.float64)
        result = lm_head_grpo_loss(
            rows, linear_weight, ids.reshape(1, n), valid.to(torch.float32).reshape(1, n),
            torch.ones(1, n), bias=linear_bias, loss_type="cispo", epsilon_high=1.0,
            num_items_in_batch=count.clamp(min=1.0) if reduction == "mean" else 1.0,
            num_threads=num_threads, plan_cache=plan_cache, _names=_NAMES)
    except REFUSALS as error:
        raise renamed(error, _NAMES) from None
    loss = result.loss
    if reduction == "mean":
        # torch: the mean over no rows is NaN (its gradients 0).
        loss = loss + torch.where(count == 0, float("nan"), 0.0).to(loss.dtype)
    return loss.to(input.dtype)


class LinearCrossEntropyLoss(torch.nn.Module):
    """A module over linear_cross_entropy: the options in the constructor, (input, linear_weight, target,
    linear_bias=None) in forward."""

    def __init__(self, *, reduction: str = "mean", ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                 num_threads: Optional[int] = None, plan_cache: Optional[grpo.PlanCache] = None):
        super().__init__()
        _check_options(reduction, label_smoothing)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.num_threads, self.plan_cache = num_threads, plan_cache

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,  # noqa: A002
                linear_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, reduction=self.reduction,
                                    ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                                    num_threads=self.num_threads, plan_cache=self.plan_cache)
