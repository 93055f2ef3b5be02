"""grpo.integrations.trl.patch_grpo_trainer on a tiny TRL 1.16 GRPOTrainer (CPU, built in code).

The same batch through the unpatched trainer (TRL's ChunkedLogProbFunction
and TRL's loss) and the patched one, both ways: grpo's fused loss (the
default: lm_head_grpo_loss computes the policy's loss) and fused_loss=False
(TRL's loss on grpo's log-prob head). Per-token log-probs and entropy of the
policy and the reference model, the loss, and every parameter's gradient.
The backbone is the same computation on both sides, so the differences are
the two heads' float32 errors: per row, each is within the logp bound of
reference.py (f32 logits of depth H, an LSE over V terms), so |dlogp| <=
e_grpo + e_trl = 2 e; entropy within e (2 + max|x|); the loss within
2 sum_t |c_t| 2e (c_t = dLoss/dlogp_t, through the ratio and the KL); each
gradient, relative to its largest entry, within 8 max e plus float32
accumulation, as in test_liger.py. Every loss option of the fused path, and
each case that falls back, is in test_trl_loss.py.
"""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")

import grpo  # noqa: E402
from grpo.integrations.trl import is_patched, patch_grpo_trainer  # noqa: E402
from reference import U16, U32, UBF  # noqa: E402
from trl_tiny import logp_bound, one_pass, tiny_trainer  # noqa: E402


@pytest.mark.parametrize("path,precision,temperature", [
    ("fused", "bf16", 1.0), ("fused", "bf16", 0.7), ("fused", "f32", 1.0), ("fused", "f32", 0.7),
    ("head", "bf16", 0.7), ("head", "f32", 1.0), ("fused", "f16", 1.0), ("head", "f16", 0.7),
    ("fused", "f16amp", 0.7), ("fused", "bf16+tied", 1.0), ("fused", "f32+tied", 0.7), ("head", "f32+tied", 1.0),
    ("fused", "bf16+fp32head", 0.7), ("head", "bf16+fp32head", 1.0)])
def test_patched_trainer_matches_trl(path, temperature, precision, record):
    """precision bf16: GRPOConfig's default (bf16=True: CPU autocast to bfloat16, the head's operands cast to
    bf16, TRL's logit tiles rounded to bf16); f32: bf16=False; f16: an fp16 model (model_init_kwargs dtype
    float16, no autocast: the backbone, hidden states, lm_head and its gradients in float16, TRL's logit tiles
    float16); f16amp: fp16=True (CPU autocast to float16: the head's operands cast to float16, TRL's logit tiles
    float16, float32 parameters and gradients). path fused: patch_grpo_trainer's default (the policy's loss from lm_head_grpo_loss); head:
    fused_loss=False (TRL's loss on fused_log_probs). "+tied": lm_head.weight is the input embedding's
    (tie_word_embeddings, as Qwen2.5-0.5B to 3B): the head's dW and the embedding's gradient add up in one .grad.
    "+fp32head": cast_lm_head_to_fp32=True (ScaleRL's recipe: under bf16 autocast the head runs in float32, its
    weight float32, outside autocast), so both heads' logits are float32: the float32 bound, not bf16's."""
    tied = precision.endswith("+tied")
    fp32head = precision.endswith("+fp32head")
    precision = precision.removesuffix("+tied").removesuffix("+fp32head")
    bf16 = precision == "bf16"
    f16 = precision in ("f16", "f16amp")
    extra = {"model_init_kwargs": {"dtype": "float16"}} if precision == "f16" else {"fp16": True} if f16 else {}
    if fp32head:
        extra["cast_lm_head_to_fp32"] = True
    trainer = tiny_trainer(temperature=temperature, bf16=bf16, model={"tied": tied}, **extra)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"  # named_parameters names a tied one once
    assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) == tied
    if precision == "f16":
        assert trainer.model.lm_head.weight.dtype == torch.float16
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    theirs = one_pass(trainer, inputs)

    cache = grpo.PlanCache()
    assert patch_grpo_trainer(trainer, plan_cache=cache, fused_loss=path == "fused") is trainer
    assert is_patched(trainer.model) and is_patched(trainer.ref_model)
    ours = one_pass(trainer, inputs)
    kinds = {kind for kind, _ in cache._plans}
    # The fused loss's plan, or (head) the log-prob head's alone: which path computed the loss.
    assert ("lm_head_loss" in kinds) == (path == "fused") and "lm_head_log_prob" in kinds, kinds

    args = (trainer, trainer.model, theirs["input_ids"], theirs["attention_mask"], theirs["keep"])
    operands = torch.float16 if f16 else torch.float32 if fp32head else None
    e, xmax = logp_bound(*args, dtype=operands)
    # Both heads err: grpo's f32 logits, TRL's (rounded to bf16 under autocast, to fp16 for an fp16 model).
    head_round = 0.0 if fp32head else UBF if bf16 else U16 if f16 else 0.0
    e2 = e + logp_bound(*args, logits_round=head_round, dtype=operands)[0]
    tag = f"trainer {path} {precision}{'+tied' if tied else ''}{'+fp32head' if fp32head else ''} T={temperature:g}"
    for name, tol in (("logps", e2), ("ref_logps", e2), ("entropy", e2 * (2.0 + xmax))):
        diff = (ours[name].double() - theirs[name].double()).abs()
        record(tag, name, ours[name], theirs[name])
        assert torch.all(diff <= tol), f"{name}: max diff {float(diff.max()):.3g}, worst diff/bound {float((diff / tol).max()):.3g}"
    c = theirs["c"].double().abs()
    loss_tol = 2.0 * float((c * 2.0 * e2).sum()) + 64 * U32 * abs(float(theirs["loss"]))
    record(tag, "loss", ours["loss"], theirs["loss"])
    assert abs(float(ours["loss"]) - float(theirs["loss"])) <= loss_tol
    assert ours["grads"].keys() == theirs["grads"].keys() and head in ours["grads"]
    v = trainer.model.lm_head.weight.shape[0]
    # bf16: grpo rounds dlogits to bf16 and so does TRL (its tile); the backbone's
    # backward runs in bf16 under autocast: a few bf16 roundings more.
    # fp16: both backbones' backward in fp16, every gradient rounded to fp16 (2^-11) a few times.
    budget = 8 * float(e2.max()) + (8 * UBF if bf16 else 8 * U16 if f16 else 64 * U32 * v)
    for name, g in theirs["grads"].items():
        rel = float((ours["grads"][name].double() - g.double()).abs().max()) / max(float(g.abs().max()), 1e-30)
        record(tag, "grad " + (name if name == head else "backbone (worst)"),
               abs_diff=rel * float(g.abs().max()), rel=rel)
        assert rel <= budget, f"{name}: {rel:.3g} > {budget:.3g}"

    # And it trains: two steps of the patched trainer.
    builds = cache.builds
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(float(x)) for x in losses)
    assert cache.builds >= builds
    kinds = {kind for kind, _ in cache._plans}
    assert ("lm_head_loss" in kinds) == (path == "fused"), kinds


def test_patch_is_scoped_to_the_trainer():
    """An unpatched model keeps TRL's own head after another trainer was patched; patching twice is harmless."""
    import trl.trainer.utils as trl_utils
    from grpo.integrations import trl as integration

    patched = tiny_trainer(max_steps=1)
    patch_grpo_trainer(patched)
    patch_grpo_trainer(patched)
    other = tiny_trainer(max_steps=1, beta=0.0)
    assert not is_patched(other.model)
    calls = []
    original = integration._Dispatch.original

    class Spy:
        @staticmethod
        def apply(*args):
            calls.append(1)
            return original.apply(*args)

    integration._Dispatch.original = Spy
    try:
        ids = torch.randint(3, 64, (2, 6))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            other._get_per_token_logps_and_entropies(other.model, ids, mask, 3)
            assert len(calls) == 1
            patched._get_per_token_logps_and_entropies(patched.model, ids, mask, 3)
            assert len(calls) == 1  # grpo's head, not TRL's
    finally:
        integration._Dispatch.original = original
    assert trl_utils._ChunkedLogProbFunction is integration._Dispatch


def test_refuses_a_model_without_the_fused_head():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    class Fake:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        ref_model = None

    with pytest.raises(ValueError, match="fused LM head"):
        patch_grpo_trainer(Fake())


def test_patch_forwards_grad_filter(monkeypatch):
    """patch_grpo_trainer(grad_filter=...) reaches fused_log_probs, and the head's plans carry the filter."""
    import grpo.torch as gt
    from grpo.integrations import trl as integration

    trainer = tiny_trainer(max_steps=1)
    with pytest.raises(grpo.Error) as info:
        patch_grpo_trainer(trainer, grad_filter="fast")
    assert info.value.argument == "grad_filter" and not is_patched(trainer.model)
    cache = grpo.PlanCache()
    patch_grpo_trainer(trainer, plan_cache=cache, grad_filter="auto")
    seen = []
    original = gt.fused_log_probs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("grad_filter"))
        return original(*args, **kwargs)

    monkeypatch.setattr(integration.gt, "fused_log_probs", spy)
    ids = torch.randint(3, 64, (2, 6))
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3)
    logps.sum().backward()
    assert seen and all(value == "auto" for value in seen), seen
    described = [plan.describe() for (kind, _key), plan in cache._plans.items() if kind == "lm_head_log_prob"]
    assert any("grad_filter=" in d for d in described), described
