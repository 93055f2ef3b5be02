"""A tiny TRL 1.16 GRPOTrainer on CPU built in code (no downloads): Qwen2 with a 64-token vocabulary.

Also one_pass: a trainer's log-probs, loss and gradients on one batch; logp_bound: the per-token error bound
of a head's log-probs on such a trainer's batch.
"""

from __future__ import annotations

import tempfile

import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model_dir(seed: int = 0, hidden: int = 32, bias: bool = False, moe: bool = False, tied: bool = False,
                   **config_fields) -> str:
    """A saved random tiny Qwen2 (and its tokenizer): TRL loads the policy and the reference from it.

    moe: a tiny Mixtral instead (4 experts, 2 per token: TRL adds its router's load-balancing loss).
    tied: lm_head.weight is the input embedding's (tie_word_embeddings, as Qwen2.5-0.5B to 3B have it).
    config_fields: extra config entries (final_logit_softcapping, logit_scale: read by TRL's fused head only).
    """
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config_class, model_class = (MixtralConfig, MixtralForCausalLM) if moe else (Qwen2Config, Qwen2ForCausalLM)
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if moe else {}
    config = config_class(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                          eos_token_id=1, bos_token_id=1, tie_word_embeddings=tied, **extra, **config_fields)
    model = model_class(config)
    if bias:  # Qwen2's lm_head has no bias; give it one to exercise the bias path
        model.lm_head.bias = torch.nn.Parameter(0.3 * torch.randn(len(WORDS)))
    path = tempfile.mkdtemp(prefix="grpo_tiny_qwen2_")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def length_reward(completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def tiny_trainer(temperature: float = 1.0, beta: float = 0.04, max_steps: int = 2, seed: int = 0, trainer_class=None,
                 model: dict | None = None, peft_config=None, **config):
    """model: tiny_model_dir's keywords (bias, config fields); trainer_class: a GRPOTrainer subclass; peft_config:
    the trainer's (a peft LoraConfig: TRL wraps the policy in a PeftModel)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    path = tiny_model_dir(seed, **(model or {}))
    prompts = [" ".join(f"w{(i * 7 + j) % 61}" for j in range(4)) for i in range(8)]
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo_tiny_run_"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=max_steps, report_to="none",
                      logging_steps=1, save_strategy="no", beta=beta, temperature=temperature, seed=seed,
                      disable_tqdm=True, **config)
    return (trainer_class or GRPOTrainer)(model=path, reward_funcs=length_reward, args=args,
                                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                                          processing_class=tiny_tokenizer(), peft_config=peft_config)


def one_pass(trainer, inputs):
    """Policy and reference logps / entropies, the loss, dLoss/dlogp and every gradient, on `inputs`.

    The reference is trainer.ref_model, or without one (a PEFT policy) the policy with its adapter disabled, as
    TRL computes it."""
    model = trainer.model
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logps, ents, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, keep,
                                                                    compute_entropy=True)
        if trainer.ref_model is not None:
            ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids,
                                                                         attention_mask, keep)
        else:
            with model.disable_adapter():
                ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, keep)
    captured = {}
    original = trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        lp, ent, aux = original(*args, **kwargs)
        if lp.requires_grad:  # TRL's loss on a head's log-probs (grpo's fused loss hands back placeholders)
            lp.retain_grad()
            captured["logps"] = lp
        return lp, ent, aux

    trainer._get_per_token_logps_and_entropies = spy
    try:
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    c = captured["logps"].grad if "logps" in captured else None
    return dict(logps=logps, entropy=ents, ref_logps=ref_logps, loss=loss.detach(), c=c,
                grads=grads, input_ids=input_ids, attention_mask=attention_mask, keep=keep)


def logp_bound(trainer, model, input_ids, attention_mask, logits_to_keep, logits_round=0.0, dtype=None):
    """Per-token bound on a head's |logp - exact| (reference.py's logp_error), [B, logits_to_keep], and max |x|.

    logits_round: a relative rounding of the logits (TRL's bf16 tiles under autocast, its fp16 ones for an fp16
    model); dtype: what both heads multiply (bf16 under autocast, an fp16 model's own). A logit scale s and
    softcap c in the model's config (as TRL reads them): z' = c tanh(s z / c) moves by at most |s| dz.
    """
    from reference import U32

    with torch.no_grad(), trainer.accelerator.autocast():
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    if dtype is None:
        dtype = torch.bfloat16 if logits_round else torch.float32  # what both heads multiply
    hidden = hidden.to(dtype).double()
    with torch.no_grad():
        w = model.lm_head.weight.to(dtype).double()
        absdot = hidden.abs() @ w.abs().T
        if model.lm_head.bias is not None:
            absdot = absdot + model.lm_head.bias.double().abs()
        tau = trainer.temperature
        scale = getattr(model.config, "logit_scale", None) or 1.0
        cap = getattr(model.config, "final_logit_softcapping", None)
        z = hidden @ w.T
        if model.lm_head.bias is not None:
            z = z + model.lm_head.bias.double()
        z = scale * z
        x = (z if cap is None else cap * torch.tanh(z / cap)) / tau
    hdim, v = w.shape[1], w.shape[0]
    dz = ((hdim + 1) * U32 + logits_round) * abs(scale) * absdot.max(-1).values / tau
    xmax = x.abs().max(-1).values
    e = 2.0 * dz + (v + 4) * U32 * (1.0 + xmax)
    return e[:, -logits_to_keep:], xmax[:, -logits_to_keep:]
