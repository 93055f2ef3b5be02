"""One rank of a 2-process TRL run under `accelerate launch` (test_trl_accelerate.py starts it).

Trains the tiny GRPOTrainer of trl_tiny.py (float32, bf16=False) for two
optimizer steps, plain (`--mode plain`) or patched by patch_grpo_trainer
(`--mode patched`), under accelerate's DistributedDataParallel on gloo, and
saves, per step: the batch the loss saw, this rank's loss, dLoss/dlogp of
TRL's own path (plain), the logp error bound of reference.py on the batch, and
every parameter's gradient as the optimizer gets it (summed over the ranks by
DDP, before clipping). The patched run replays the plain run's batches
(`_prepare_inputs`), so both train on the same completions whatever their
weights: the differences are the heads'.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_tiny import logp_bound, tiny_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("plain", "patched"), required=True)
    parser.add_argument("--out", required=True, help="directory of the runs' files")
    args = parser.parse_args()

    trainer = tiny_trainer(bf16=False, max_steps=2, beta=0.04)
    rank = trainer.accelerator.process_index
    steps: list[dict] = []
    if args.mode == "patched":
        from grpo.integrations.trl import patch_grpo_trainer

        patch_grpo_trainer(trainer)
        replay = torch.load(os.path.join(args.out, f"plain_rank{rank}.pt"))["steps"]
        batches = iter([s["inputs"] for s in replay])
        trainer._prepare_inputs = lambda generation_batch: next(batches)
    else:
        prepare = trainer._prepare_inputs

        def recorded(generation_batch):
            inputs = prepare(generation_batch)
            steps.append({"inputs": {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}})
            return inputs

        trainer._prepare_inputs = recorded

    compute_loss = trainer.compute_loss
    original_logps = trainer._get_per_token_logps_and_entropies

    def spy(*a, **kw):
        lp, ent, aux = original_logps(*a, **kw)
        if lp.requires_grad:  # TRL's loss on its head's log-probs (the fused loss hands back placeholders)
            lp.retain_grad()
            spy.logps = lp
        return lp, ent, aux

    spy.logps = None
    trainer._get_per_token_logps_and_entropies = spy

    def loss_of_step(model, inputs, *a, **kw):
        if args.mode == "patched":
            steps.append({})
        step = steps[-1]
        model_ = trainer.accelerator.unwrap_model(model)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        step["logp_bound"], _ = logp_bound(trainer, model_, input_ids, attention_mask, inputs["completion_ids"].size(1))
        spy.logps = None
        loss = compute_loss(model, inputs, *a, **kw)
        step["loss"] = loss.detach().clone()
        step["logps"] = spy.logps
        return loss

    trainer.compute_loss = loss_of_step
    clip = trainer._clip_grad_norm

    def gradients_then_clip(model):
        step = steps[-1]
        step["grads"] = {n: p.grad.detach().clone() for n, p in trainer.accelerator.unwrap_model(model)
                         .named_parameters() if p.grad is not None}
        logps = step.pop("logps", None)
        step["c"] = logps.grad.detach().clone() if logps is not None and logps.grad is not None else None
        return clip(model)

    trainer._clip_grad_norm = gradients_then_clip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    torch.save({"steps": steps, "logged_losses": logged, "world": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "grpo_warnings": sorted({str(w.message) for w in seen if str(w.message).startswith("grpo")})},
               os.path.join(args.out, f"{args.mode}_rank{rank}.pt"))


if __name__ == "__main__":
    main()
