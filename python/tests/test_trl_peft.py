"""grpo.integrations.trl on a TRL 1.16 GRPOTrainer whose policy is a PEFT LoRA model (peft 0.21.2).

TRL wraps the policy in a PeftModel and has no reference model: the reference
log-probs are the same model's with the adapter disabled. patch_grpo_trainer
patches the PEFT base model, so the policy's loss (the frozen lm_head: no
weight gradient), its old log-probs and its reference log-probs all go
through grpo. The same batch through the unpatched and the patched trainer:
log-probs of the policy and of the reference, the loss and every LoRA
gradient, within the two heads' error bounds as in test_trl.py. The LoRA B
matrices start non-zero (PEFT's are zero) and move between generation and
the loss, so the ratio is not 1 (num_iterations=2: TRL keeps the old
log-probs), the KL is not 0, and both LoRA matrices get gradients.
"""

import math

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")

import grpo  # noqa: E402
from grpo.integrations.trl import is_patched, patch_grpo_trainer  # noqa: E402
from peft import LoraConfig  # noqa: E402
from reference import U32, UBF  # noqa: E402
from trl_tiny import logp_bound, one_pass, tiny_trainer  # noqa: E402


def nudge_adapters(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.mark.parametrize("path", ["fused", "head"])
@pytest.mark.parametrize("precision", ["bf16", "f32"])
@pytest.mark.parametrize("train_head", [False, True], ids=["lora", "lora+head"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_lora_trainer_matches_trl(path, precision, train_head, checkpointing, record):
    bf16 = precision == "bf16"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM", modules_to_save=["lm_head"] if train_head else None)
    trainer = tiny_trainer(bf16=bf16, beta=0.04, num_iterations=2, peft_config=lora,
                           gradient_checkpointing=checkpointing)
    model = trainer.model
    assert trainer.ref_model is None and hasattr(model, "disable_adapter")
    assert model.get_base_model().lm_head.weight.requires_grad == train_head
    if checkpointing:  # as Trainer.train() does before its first step
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    assert model.get_base_model().is_gradient_checkpointing == checkpointing
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch here
    model.train()
    nudge_adapters(model, seed=1)
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    assert inputs.get("old_per_token_logps") is not None
    nudge_adapters(model, seed=2)  # the policy moves on: ratios off 1
    theirs = one_pass(trainer, inputs)

    cache = grpo.PlanCache()
    assert patch_grpo_trainer(trainer, plan_cache=cache, fused_loss=path == "fused") is trainer
    assert is_patched(model.get_base_model())
    ours = one_pass(trainer, inputs)
    kinds = {kind for kind, _ in cache._plans}
    assert ("lm_head_loss" in kinds) == (path == "fused") and "lm_head_log_prob" in kinds, kinds

    base = model.get_base_model()
    args = (trainer, base, theirs["input_ids"], theirs["attention_mask"], theirs["keep"])
    round_ = UBF if bf16 else 0.0
    e, _ = logp_bound(*args)
    e2 = e + logp_bound(*args, logits_round=round_)[0]
    with model.disable_adapter():
        e_ref, _ = logp_bound(*args)
        e2_ref = e_ref + logp_bound(*args, logits_round=round_)[0]
    tag = f"trainer {'lora+head' if train_head else 'lora'}{' ckpt' if checkpointing else ''} {path} {precision}"
    for name, tol in (("logps", e2), ("ref_logps", e2_ref)):
        diff = (ours[name].double() - theirs[name].double()).abs()
        record(tag, name, ours[name], theirs[name])
        assert torch.all(diff <= tol), f"{name}: worst diff/bound {float((diff / tol).max()):.3g}"
    assert not torch.equal(theirs["logps"], theirs["ref_logps"])  # the adapter is live
    # |dLoss/dlogp_t| <= (|A| r + beta (e^|d| + 1)) / n, its policy and KL parts without cancellation (the KL
    # term's slope and its own change with logp); the loss moves by that times both heads' logp error, 2x margin.
    mask = inputs["completion_mask"].double()
    d = (theirs["ref_logps"] - theirs["logps"]).double().abs()
    adv = inputs["advantages"].double().abs().reshape(-1, 1)
    ratio = torch.exp((theirs["logps"] - inputs["old_per_token_logps"]).double())
    assert float((ratio - 1.0).abs().max()) > 1e-3  # off-policy: the old log-probs are not the policy's
    c = (adv * ratio + abs(trainer.beta) * (torch.exp(d) + 1.0)) * mask / mask.sum().clamp(min=1.0)
    loss_tol = 2.0 * float((c * e2).sum()) + 64 * U32 * abs(float(theirs["loss"]))
    record(tag, "loss", ours["loss"], theirs["loss"])
    assert abs(float(ours["loss"]) - float(theirs["loss"])) <= loss_tol
    lora_grads = sorted(n for n in theirs["grads"] if "lora_" in n)
    head_grads = sorted(n for n in theirs["grads"] if "lm_head" in n)
    assert ours["grads"].keys() == theirs["grads"].keys() and len(lora_grads) == 6, theirs["grads"].keys()
    # The trained copy's weight alone (modules_to_save), never the original head.
    assert head_grads == (["base_model.model.lm_head.modules_to_save.default.weight"] if train_head else []), head_grads
    v = base.lm_head.weight.shape[0]
    budget = 8 * float(e2.max()) + (8 * UBF if bf16 else 64 * U32 * v)
    for name, g in theirs["grads"].items():
        assert float(g.abs().max()) > 0.0, name  # B non-zero: A's gradient too
        rel = float((ours["grads"][name].double() - g.double()).abs().max()) / float(g.abs().max())
        record(tag, "grad " + ("lm_head copy" if "lm_head" in name else "lora (worst)"), abs_diff=rel * float(g.abs().max()), rel=rel)
        assert rel <= budget, f"{name}: {rel:.3g} > {budget:.3g}"

    # And it trains: two steps of the patched LoRA trainer, the adapter moving, the original head not.
    original_head = base.lm_head.original_module if train_head else base.lm_head
    head = original_head.weight.detach().clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(float(x)) for x in losses)
    assert torch.equal(original_head.weight, head)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
