"""TRL 1.16 integration: a GRPOTrainer whose loss is grpo's fused LM-head loss, its other log-probs grpo's head's.

    from trl import GRPOTrainer
    from grpo.integrations.trl import patch_grpo_trainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_cpu=True), ...)
    patch_grpo_trainer(trainer)
    trainer.train()

Two seams, one per GEMM budget.

1. The log-prob head (four GEMM passes when differentiated). TRL 1.16's
   GRPOTrainer never materializes logits: its constructor calls
   `trl.trainer.utils.add_fused_lm_head` on the policy (outputs "log_probs",
   "entropy") and on the reference model, which replaces `model.forward` by a
   wrapper that, when called with `fused_lm_head=True` (as
   `GRPOTrainer._get_per_token_logps_and_entropies` does), runs the backbone
   and hands the shifted hidden states, lm_head.weight / bias and the labels
   to `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias,
   targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
   outputs)`. That class is swapped (once per process) for `_Dispatch`, which
   calls TRL's own function unless the call comes from a patched model's
   forward (a context variable the wrapped forward sets, so other threads and
   unpatched models keep TRL's path), in which case it calls
   `grpo.torch.fused_log_probs` with the same hidden / weight / bias /
   targets and TRL's temperature, softcap and logit scale. The old and
   reference log-probs (forward only) always take this path.

2. The policy's loss (three GEMM passes: `grpo.torch.lm_head_grpo_loss`
   computes loss, per-token logp / entropy / KL, metrics and the gradients in
   its forward). `patch_grpo_trainer(fused_loss=True)`, the default, replaces
   the trainer instance's `_compute_loss` (the method TRL's `compute_loss` and
   `prediction_step` call). It calls TRL's own
   `_get_per_token_logps_and_entropies` with the arguments TRL's
   `_compute_loss` passes, in capture mode (a second context variable): there
   `_Dispatch` records the head's operands (hidden cast to TRL's compute
   dtype, weight, bias, targets, temperature, softcap, scale) and returns
   zeros instead of computing. So the backbone, autocast, gradient
   checkpointing, multimodal inputs and the MoE aux loss stay TRL's. The
   completion rows of the captured hidden states (TRL passes [B*(L-1), H] on
   CPU, the last `logits_to_keep` of each row being the completion) then go
   to one `lm_head_grpo_loss` call with TRL's loss options. TRL's metrics
   (trainer._metrics) and the adaptive entropy controller's state are
   computed from that call's per-token logp, entropy and KL with TRL's own
   formulas, in TRL's order (grpo/integrations/_trl_metrics.py).

Gradient accumulation: TRL divides grpo / bnpo / dr_grpo / sapo / luspo's
loss and the entropy bonus by current_gradient_accumulation_steps (train mode
only) and dapo / cispo / vespo's policy term by its num_items_in_batch
normalizer instead. Here the call's loss is multiplied by 1 / accumulation
steps in one place (_scaled_loss: lm_head_grpo_loss's loss_scale, folded into
the kernel's gradient scale), whatever the loss type, and dapo / cispo / vespo
get the normalizer times that scale, which gives TRL's value for every term.

Mapped onto lm_head_grpo_loss: every loss type (grpo, bnpo, dr_grpo, dapo,
cispo, sapo, luspo, vespo), token / sequence importance sampling, epsilon /
epsilon_high, delta (the clipped types; TRL ignores it for the others),
beta and use_bias_correction_kl, temperature, the logit softcap / scale,
max_completion_length, num_items_in_batch, sapo / vespo parameters,
off_policy_mask_threshold, entropy_coef (static or adaptive),
top_entropy_quantile, vLLM's importance_sampling_ratio (is_weight; for vespo
folded into phi), tool_mask, per-token advantages, eval mode. TRL's path
(fused_log_probs as the head, TRL's loss code) runs instead, with a warning
once per trainer and reason (_fallback_reason says which and why), for: a
subclass overriding _compute_loss; another TRL than 1.16; DeepSpeed ZeRO-3
or FSDP (TRL gathers the head's weight inside its fused forward only);
top_entropy_quantile < 1 on several processes (TRL's quantile spans them,
grpo's is the micro-batch's); an off-policy mask with
sampling_per_token_logps that differ from the old log-probs (grpo's mask
uses old_logp); luspo at token level and vespo at sequence level (grpo
computes each at the level its paper defines); delta <= 1 + epsilon_high
(grpo requires delta above the clip range); a negative
off_policy_mask_threshold or vespo lambda <= 0 (grpo refuses them, TRL
clamps or keeps them); vespo with importance ratios != 1 on masked
positions (TRL sums their logs over every position, grpo over valid
tokens); a captured head call of another layout than TRL 1.16's on CPU.

Everything around the head stays TRL's: on CPU TRL scores every position
with the -100 labels clamped to 0 and masks after the head, and so does grpo
(no mask is passed to fused_log_probs; the fused loss is masked by the
completion mask). Under autocast (or cast_lm_head_to_fp32) hidden, weight and
bias are cast to TRL's compute dtype first, as TRL does per tile (a weight
cast copies [V, H] once per call). Refused at call time: TRL outputs other
than log_probs / entropy.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import threading
import warnings
from typing import Any, NamedTuple, Optional

import torch

import grpo
import grpo.torch as gt
from grpo import _fields
from grpo._torch_args import refused_keyword
from grpo.integrations._trl_metrics import CLIPPED, ITEMS_NORMALIZED, log_metrics

__all__ = ["patch_grpo_trainer", "is_patched"]

_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("grpo_trl_head", default=None)
# Set (to a list) while the fused loss runs TRL's forward: _Dispatch records the head's operands there.
_CAPTURE: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("grpo_trl_capture", default=None)
_install_lock = threading.Lock()


class _Head(NamedTuple):
    """One fused-head call of TRL's forward, as _Dispatch saw it (hidden / weight / bias in TRL's compute dtype)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor
    temperature: float
    softcap: Optional[float]
    scale: float


class _Dispatch:
    """Stands in for trl.trainer.utils._ChunkedLogProbFunction: grpo's head for patched models, TRL's otherwise."""

    original: Any = None

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        settings = _ACTIVE.get()
        captured = _CAPTURE.get()
        if settings is None and captured is None:
            return cls.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
        # TRL's compute dtype: autocast's when enabled, else hidden's.
        device = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        if bias is not None:
            bias = bias.to(compute_dtype)
        if captured is not None:
            # The fused loss computes from these; TRL's forward goes on with zeros (no gradient, nothing computed).
            captured.append(_Head(hidden, weight, bias, targets, float(temperature), final_logit_softcapping,
                                  float(logit_scale)))
            zeros = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            return zeros, zeros if "entropy" in outputs else None, None, None, None
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


# --------------------------------------------------------------------------- the fused loss in _compute_loss

# The multimodal inputs TRL's _compute_loss hands to _get_per_token_logps_and_entropies, by the same names.
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _fallback_reason(trainer, inputs) -> Optional[str]:
    """Why this call cannot be TRL's loss computed by lm_head_grpo_loss (None: it can)."""
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        return f"{type(trainer).__name__} is not a TRL GRPOTrainer"
    if type(trainer)._compute_loss is not GRPOTrainer._compute_loss:
        return (f"{type(trainer).__name__} overrides _compute_loss (the fused loss reproduces TRL 1.16's own; the "
                "subclass's runs, on grpo's log-prob head)")
    import trl

    if tuple(int(x) for x in trl.__version__.split(".")[:2] if x.isdigit()) != (1, 16):
        return f"TRL {trl.__version__} (the fused loss reproduces TRL 1.16's _compute_loss)"
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled() or getattr(trainer, "is_fsdp_enabled", False):
        return ("DeepSpeed ZeRO-3 / FSDP (TRL gathers the head's weight inside its fused forward only; the fused loss "
                "runs after it)")
    args, loss_type = trainer.args, trainer.loss_type
    if trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1:
        return ("top_entropy_quantile < 1 on several processes (TRL's entropy quantile is over every process's "
                "tokens, grpo's over the micro-batch's)")
    if trainer.off_policy_mask_threshold is not None:
        if trainer.off_policy_mask_threshold < 0:
            return "off_policy_mask_threshold < 0 (grpo requires a threshold >= 0)"
        sampling, old = inputs.get("sampling_per_token_logps"), inputs.get("old_per_token_logps")
        if sampling is not None and (old is None or not torch.equal(sampling, old)):
            return ("off_policy_mask_threshold with sampling_per_token_logps that differ from the old log-probs "
                    "(TRL's off-policy mask uses the sampler's log-probs, grpo's the old ones)")
    if loss_type == "luspo" and trainer.importance_sampling_level != "sequence":
        return "luspo with importance_sampling_level='token' (grpo computes luspo at sequence level, as its paper)"
    if loss_type == "vespo":
        if trainer.importance_sampling_level != "token":
            return "vespo with importance_sampling_level='sequence' (grpo computes vespo from token log-ratios only)"
        if not (args.vespo_lambda_pos > 0 and args.vespo_lambda_neg > 0):
            return "vespo lambda <= 0 (TRL clamps it to 1e-4, grpo refuses it)"
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is not None:
            mask = inputs["completion_mask"] if "tool_mask" not in inputs else \
                inputs["completion_mask"] * inputs["tool_mask"]
            log_ratio = torch.clamp(torch.log(ratio.detach().float()), math.log(1e-8), 20.0)
            if ratio.shape != mask.shape or bool((log_ratio * (1 - mask.float()) != 0).any()):
                return ("vespo with importance_sampling_ratio != 1 on masked positions (TRL adds their logs to log w, "
                        "grpo adds the valid tokens')")
    if loss_type in CLIPPED and args.delta is not None and not args.delta > 1.0 + trainer.epsilon_high:
        return "delta <= 1 + epsilon_high (grpo requires delta above the clip range)"
    return None


def _fallback(trainer, model, inputs, reason: str):
    """TRL's (or the subclass's) _compute_loss on grpo's log-prob head, with a warning once per trainer and reason."""
    state = trainer._grpo_fused_loss
    if reason not in state["warned"]:
        state["warned"].add(reason)
        warnings.warn(f"grpo: patch_grpo_trainer: TRL's loss runs on grpo's log-prob head instead of grpo's fused loss "
                      f"for this trainer: {reason}", RuntimeWarning, stacklevel=3)
    return type(trainer)._compute_loss(trainer, model, inputs)


def _completion_rows(heads: list, batch: int, length: int, keep: int) -> Optional[tuple]:
    """The captured call's hidden [B, keep, H] and targets [B, keep] at the completion positions, or None.

    TRL 1.16 on CPU passes hidden_states[:, :-1] as [B*(L-1), H] and the labels (clamped to 0) as [B*(L-1)];
    the completion is the last `keep` positions of each row.
    """
    if len(heads) != 1:
        return None
    head = heads[0]
    rows = batch * (length - 1)
    if head.hidden.dim() != 2 or head.hidden.shape[0] != rows or tuple(head.targets.shape) != (rows,):
        return None
    hidden = head.hidden.reshape(batch, length - 1, -1)[:, -keep:]
    targets = head.targets.reshape(batch, length - 1)[:, -keep:]
    return head, hidden, targets


def _scaled_loss(kwargs: dict, scale: float):
    """lm_head_grpo_loss(**kwargs) with its loss times `scale` (TRL's 1 / gradient-accumulation steps): the result.

    The one place the scale enters: loss_scale folds it into the kernel's gradient scale (no pass over the
    gradients, as a grad_output != 1 would make).
    """
    return gt.lm_head_grpo_loss(**kwargs, loss_scale=scale)


def _entropy_coef(trainer) -> float:
    """The coefficient TRL applies this micro-batch: adaptive control's from the previous optimizer step."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy:
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return trainer.entropy_coef


def _fused_compute_loss(trainer, model, inputs):
    """The patched trainer's _compute_loss: TRL 1.16's, as one lm_head_grpo_loss call, or TRL's with a warning."""
    reason = _fallback_reason(trainer, inputs)
    if reason is not None:
        return _fallback(trainer, model, inputs, reason)
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

    heads: list = []
    token = _CAPTURE.set(heads)
    try:
        _, _, aux_loss = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, keep, compute_entropy=True, compute_aux_loss=trainer.aux_loss_enabled,
            **{name: inputs.get(name) for name in _MODEL_INPUTS})
    finally:
        _CAPTURE.reset(token)
    captured = _completion_rows(heads, input_ids.size(0), input_ids.size(1), keep)
    if captured is None:
        return _fallback(trainer, model, inputs, "TRL's fused forward called its head in another layout than "
                                                 "TRL 1.16's on CPU ([B*(L-1), H] rows, once)")
    head, hidden, targets = captured

    args, loss_type = trainer.args, trainer.loss_type
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accumulation in eval
    scale = 1.0 / accumulation
    num_items = None
    if loss_type in ITEMS_NORMALIZED:
        # TRL's normalizer: num_items_in_batch spans the generation batch, rescaled to one accumulation window.
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * trainer.current_gradient_accumulation_steps / args.steps_per_generation
        num_items = float(normalizer) * scale  # the call's loss is multiplied by scale: the policy term is TRL's
    ratio = inputs.get("importance_sampling_ratio")
    if loss_type == "vespo":
        is_weight = ratio  # folded into phi (log w), never multiplying the loss again
    elif trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        is_weight = inputs["importance_sampling_ratio"]
    else:
        is_weight = None
    coef = _entropy_coef(trainer)
    settings = trainer._grpo_fused_loss["settings"]
    result = _scaled_loss(dict(
        hidden=hidden, weight=head.weight, ids=targets, mask=mask, advantages=inputs["advantages"], bias=head.bias,
        old_logp=inputs.get("old_per_token_logps"),
        ref_logp=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None, is_weight=is_weight,
        loss_type=loss_type, importance_sampling_level=trainer.importance_sampling_level,
        epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
        delta=args.delta if loss_type in CLIPPED else None, beta=trainer.beta,
        kl_bias_correction=args.use_bias_correction_kl, temperature=head.temperature, logit_softcap=head.softcap,
        logit_scale=head.scale, max_completion_length=trainer.max_completion_length, num_items_in_batch=num_items,
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        entropy_coef=coef, top_entropy_quantile=trainer.top_entropy_quantile, return_entropy=True,
        num_threads=settings["num_threads"], plan_cache=settings["plan_cache"], grad_filter=settings["grad_filter"]),
        scale)
    loss = result.loss
    log_metrics(trainer, mode, inputs, mask, result, loss.detach(), scale, coef, aux_loss)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
    return loss


def _patch_loss(trainer, settings: dict, fused_loss: bool) -> None:
    if not fused_loss:
        if getattr(trainer, "_grpo_fused_loss", None) is not None:
            del trainer._compute_loss  # the instance attribute: TRL's (or the subclass's) method again
            trainer._grpo_fused_loss = None
        return
    state = getattr(trainer, "_grpo_fused_loss", None)
    if state is None:
        trainer._grpo_fused_loss = {"settings": dict(settings), "warned": set()}
        trainer._compute_loss = functools.partial(_fused_compute_loss, trainer)
    else:
        state["settings"] = dict(settings)


def patch_grpo_trainer(trainer, *, fused_loss: bool = True, num_threads: Optional[int] = None,
                       plan_cache: Optional[grpo.PlanCache] = None, grad_filter: Any = None):
    """Route a TRL 1.16 GRPOTrainer's loss through grpo.torch.lm_head_grpo_loss and its log-probs through grpo's head.

    fused_loss=True (default): the policy's head and TRL's loss run as one
    lm_head_grpo_loss call (three GEMM passes) wherever TRL's options map onto
    it, else TRL's loss on grpo's log-prob head with a warning once per reason
    (module docstring). fused_loss=False: TRL's loss code, untouched, on grpo's
    log-prob head (grpo.torch.fused_log_probs; four GEMM passes). Either way the
    old and reference log-probs come from fused_log_probs. Patches the policy
    (the PEFT base model under PEFT) and the reference model when there is
    one; idempotent; returns the trainer. num_threads / plan_cache: as
    lm_head_grpo_loss / fused_log_probs (default torch's thread count and the
    process-wide plan cache). grad_filter: the filtered backward of both (None
    / "off", "auto" or a threshold in (0, 1); docs/filtered_backward.md),
    checked here. Patching again replaces the settings.
    """
    try:
        _fields.grad_filter("grad_filter", grad_filter)
    except _fields.Refusal as refusal:
        raise refused_keyword(refusal) from None
    _install_dispatch()
    settings = {"num_threads": num_threads, "plan_cache": plan_cache, "grad_filter": grad_filter}
    from accelerate.utils import is_peft_model

    model = trainer.model
    if is_peft_model(model):
        model = model.get_base_model()  # where TRL added its fused head
    _patch_model(model, settings)
    if getattr(trainer, "ref_model", None) is not None:
        _patch_model(trainer.ref_model, settings)
    _patch_loss(trainer, settings, fused_loss)
    return trainer
