"""TRL 1.16 integration: a GRPOTrainer whose per-token log-probs and entropy come from grpo's log-prob head.

    from trl import GRPOTrainer
    from grpo.integrations.trl import patch_grpo_trainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_cpu=True), ...)
    patch_grpo_trainer(trainer)
    trainer.train()

The seam. TRL 1.16's GRPOTrainer never materializes logits: its constructor
calls `trl.trainer.utils.add_fused_lm_head` on the policy (outputs
"log_probs", "entropy") and on the reference model, which replaces
`model.forward` by a wrapper that, when called with `fused_lm_head=True`
(as `GRPOTrainer._get_per_token_logps_and_entropies` does), runs the
backbone and hands the shifted hidden states, lm_head.weight / bias and the
labels to `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight,
bias, targets, temperature, chunk_size, final_logit_softcapping,
logit_scale, outputs)`. That one call is what this module replaces:

- `trl.trainer.utils._ChunkedLogProbFunction` is swapped (once per process)
  for a dispatcher that calls TRL's own function unless the current call
  comes from a patched model's forward, in which case it calls
  `grpo.torch.fused_log_probs` with the same hidden / weight / bias /
  targets and TRL's temperature. Unpatched models (and other trainers) keep
  TRL's path.
- `patch_grpo_trainer` wraps the policy's (and the reference model's)
  forward so that its calls take grpo's path (a context variable, so other
  threads are unaffected).

Everything around it stays TRL's: the backbone, the shift, the masking of
-100 labels after the head (on CPU TRL scores every position with the
labels clamped to 0, and so does grpo: no mask is passed to the head), the
loss, the KL, the clipping, the metrics. The temperature is TRL's
(`trainer.temperature`, x = z / T), as add_fused_lm_head applied it.

Models with `final_logit_softcapping` or a logit scale (Gemma 2/3, Granite,
...): TRL reads both from the model config and passes them to the call; grpo's
head applies them (z' = c tanh(s z / c) before the temperature, as TRL's
kernel). Refused at call time: TRL outputs other than
log_probs / entropy. Under autocast (or cast_lm_head_to_fp32) hidden,
weight and bias are cast to TRL's compute dtype first, as TRL does per tile
(a weight cast copies [V, H] once per call).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from typing import Any, Optional

import torch

import grpo
import grpo.torch as gt
from grpo import _fields

__all__ = ["patch_grpo_trainer", "is_patched"]

_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("grpo_trl_head", default=None)
_install_lock = threading.Lock()


class _Dispatch:
    """Stands in for trl.trainer.utils._ChunkedLogProbFunction: grpo's head for patched models, TRL's otherwise."""

    original: Any = None

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        settings = _ACTIVE.get()
        if settings is None:
            return cls.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
        # TRL's compute dtype: autocast's when enabled, else hidden's.
        device = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        if bias is not None:
            bias = bias.to(compute_dtype)
        logp, entropy = gt.fused_log_probs(hidden, weight, bias, targets, temperature, outputs,
                                           logit_softcap=final_logit_softcapping, logit_scale=float(logit_scale),
                                           plan_cache=settings["plan_cache"], num_threads=settings["num_threads"],
                                           grad_filter=settings.get("grad_filter"))
        return logp, entropy, None, None, None


def _install_dispatch():
    import trl.trainer.utils as trl_utils

    with _install_lock:
        current = trl_utils._ChunkedLogProbFunction
        if current is not _Dispatch:
            _Dispatch.original = current
            trl_utils._ChunkedLogProbFunction = _Dispatch


def _has_fused_head(forward) -> bool:
    """Whether TRL's fused-head forward is in this forward's wrapper chain (accelerate wraps the reference model's)."""
    seen = 0
    while forward is not None and seen < 16:
        try:
            if "fused_lm_head" in inspect.signature(forward, follow_wrapped=False).parameters:
                return True
        except (TypeError, ValueError):
            pass
        forward = getattr(forward, "__wrapped__", None)
        seen += 1
    return False


def _patch_model(model: torch.nn.Module, settings: dict) -> None:
    if getattr(model, "_grpo_fused_head", None) is not None:
        model._grpo_fused_head.update(settings)
        return
    if "forward" not in vars(model) or not _has_fused_head(model.forward):
        raise ValueError("grpo: the model has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head): "
                         "patch a TRL 1.16 GRPOTrainer after its construction")
    previous = model.forward
    state = dict(settings)

    @functools.wraps(previous)
    def forward(*args, **kwargs):
        token = _ACTIVE.set(state)
        try:
            return previous(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    model.forward = forward
    model._grpo_fused_head = state


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `model`'s fused-head calls go through grpo."""
    return getattr(model, "_grpo_fused_head", None) is not None


def patch_grpo_trainer(trainer, *, num_threads: Optional[int] = None,
                       plan_cache: Optional[grpo.PlanCache] = None, grad_filter: Any = None):
    """Route a TRL 1.16 GRPOTrainer's per-token log-probs and entropy through grpo.torch.fused_log_probs.

    Patches the policy (the PEFT base model under PEFT) and the reference
    model when there is one; idempotent; returns the trainer. TRL's loss code
    is untouched: only the LM-head primitive its fused head calls changes.
    num_threads / plan_cache: as fused_log_probs (default torch's thread
    count and the process-wide plan cache). grad_filter: the filtered
    backward of the head (fused_log_probs' grad_filter; None / "off",
    "auto" or a threshold in (0, 1); docs/filtered_backward.md), checked
    here. Patching again replaces the settings.
    """
    try:
        _fields.grad_filter("grad_filter", grad_filter)
    except _fields.Refusal as refusal:
        raise gt._refused_keyword(refusal) from None
    _install_dispatch()
    settings = {"num_threads": num_threads, "plan_cache": plan_cache, "grad_filter": grad_filter}
    from accelerate.utils import is_peft_model

    model = trainer.model
    if is_peft_model(model):
        model = model.get_base_model()  # where TRL added its fused head
    _patch_model(model, settings)
    if getattr(trainer, "ref_model", None) is not None:
        _patch_model(trainer.ref_model, settings)
    return trainer
