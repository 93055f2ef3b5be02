"""grpo.torch: the fused GRPO LM-head loss and its relatives as PyTorch operators (CPU).

- `LmHeadGRPOLoss` (grpo/liger.py): a drop-in for Liger-Kernel 0.8.5's
  `LigerFusedLinearGRPOLoss` (same constructor and forward arguments, same
  return value: `(loss, (kl_mean if beta != 0, clip_ratio))`).
- `lm_head_grpo_loss` (grpo/functional.py): the functional form with grpo's
  own semantics and every output (per-token logp, entropy, KL, all metrics).
- `fused_log_probs` (grpo/functional.py): per-token log-probabilities and
  entropy of an LM head (the generic log-prob head), differentiable for any
  loss computed on them in Python; what TRL's fused LM head computes.
- `linear_cross_entropy` / `LinearCrossEntropyLoss` (grpo/cross_entropy.py):
  torch 2.15's `F.linear_cross_entropy` signature, the SFT loss.

Under them, grpo's torch ops (grpo/_ops.py): `torch.ops.grpo.lm_head_loss`,
`torch.ops.grpo.log_probs` and `torch.ops.grpo.log_probs_backward`,
registered with torch.library.custom_op, with fake kernels and autograd, so
torch.compile(fullgraph=True) traces the entry points above and
torch.library.opcheck passes on the ops.
"""

from __future__ import annotations

from grpo._ops import step_stats
from grpo.cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from grpo.functional import LmHeadLossResult, fused_log_probs, lm_head_grpo_loss
from grpo.liger import LmHeadGRPOLoss

__all__ = ["LinearCrossEntropyLoss", "LmHeadGRPOLoss", "LmHeadLossResult", "fused_log_probs", "linear_cross_entropy",
           "lm_head_grpo_loss", "step_stats"]
