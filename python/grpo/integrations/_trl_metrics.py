"""TRL 1.16 GRPOTrainer._compute_loss's metrics and adaptive entropy control, from grpo's fused call.

grpo.integrations.trl's fused loss computes TRL's loss in one
lm_head_grpo_loss call; what TRL's _compute_loss also does with its per-token
tensors (trainer._metrics: policy_loss, entropy_coef, aux_loss, kl, entropy,
the clip ratios, cispo_clip_ratio, vespo/phi_seq_mean; the adaptive entropy
controller's window statistics and coefficient) is done here, with TRL's
formulas and in TRL's order, from the call's per-token logp, entropy and KL
(detached: nothing here is differentiated).
"""

from __future__ import annotations

import torch

__all__ = ["CLIPPED", "ITEMS_NORMALIZED", "log_metrics"]

ITEMS_NORMALIZED = ("dapo", "cispo", "vespo")  # TRL: normalized by num_items_in_batch, not by accumulation steps
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's PPO-clipped types (delta, clip ratio metrics)


def log_metrics(trainer, mode, inputs, mask, result, loss, scale, coef, aux_loss) -> None:
    """TRL 1.16 _compute_loss's metrics and adaptive entropy update, in its order, from the call's per-token outputs.

    loss: the call's loss, scaled (before the aux loss), detached.
    """
    from trl.trainer.utils import nanmax, nanmin

    args, metrics = trainer.args, trainer._metrics[mode]
    per_token_logps, entropies, per_token_kl = result.per_token_logps, result.entropy, result.kl
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    log_ratio = per_token_logps - (per_token_logps if old is None else old)
    if trainer.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)

    if trainer._entropy_bonus_enabled:
        entropy_mask = None
        if trainer.top_entropy_quantile < 1.0:
            entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_mean = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
        # loss = scale * (policy' - coef * entropy_mean), where policy' is TRL's policy loss, or it over scale for the
        # num_items-normalized types (whose num_items_in_batch was multiplied by scale).
        policy_loss = (loss / scale + coef * entropy_mean) * (scale if trainer.loss_type in ITEMS_NORMALIZED else 1.0)
        metrics["policy_loss"].append(trainer.accelerator.gather(policy_loss).nanmean().item())
        if trainer.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            if trainer._entropy_window_stats is None:
                trainer._entropy_window_stats = stats
            else:
                trainer._entropy_window_stats = trainer._entropy_window_stats + stats
            if trainer.accelerator.sync_gradients:
                window_stats = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= args.entropy_target:
                    trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
                else:
                    trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
                trainer._last_world_entropy = world_entropy
                trainer._entropy_window_stats = None
        if mode == "train" and trainer.accelerator.sync_gradients:
            metrics["entropy_coef"].append(trainer.entropy_coef)

    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = trainer.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        metrics["kl"].append(global_masked_mean(per_token_kl))
    metrics["entropy"].append(global_masked_mean(entropies))
    if trainer.loss_type in CLIPPED:
        if args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=args.delta)
        is_low_clipped = (coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        metrics["clip_ratio/low_mean"].append(global_masked_mean(is_low_clipped.float()))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(is_high_clipped.float()))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(is_region_clipped.float()))
        metrics["clip_ratio/low_min"].append(nanmin(trainer.accelerator.gather(masked_seq_mean(
            is_low_clipped.float()))).item())
        metrics["clip_ratio/high_max"].append(nanmax(trainer.accelerator.gather(masked_seq_mean(
            is_high_clipped.float()))).item())
    elif trainer.loss_type == "cispo":
        metrics["cispo_clip_ratio"].append(global_masked_mean(((coef_1 > trainer.epsilon_high) & (advantages > 0))
                                                              .float()))
    elif trainer.loss_type == "vespo":
        phi_seq = trainer.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"), k_pos=args.vespo_k_pos,
            lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg)
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi_seq))
