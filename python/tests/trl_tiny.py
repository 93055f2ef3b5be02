"""A tiny TRL 1.16 GRPOTrainer on CPU built in code (no downloads): Qwen2 with a 64-token vocabulary."""

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


def tiny_model_dir(seed: int = 0, hidden: int = 32, bias: bool = False) -> str:
    """A saved random tiny Qwen2 (and its tokenizer): TRL loads the policy and the reference from it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    if bias:  # Qwen2's lm_head has no bias; give it one to exercise the bias path
        model.lm_head.bias = torch.nn.Parameter(0.3 * torch.randn(len(WORDS)))
    path = tempfile.mkdtemp(prefix="grpo_tiny_qwen2_")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def length_reward(completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def tiny_trainer(temperature: float = 1.0, beta: float = 0.04, max_steps: int = 2, seed: int = 0, **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    path = tiny_model_dir(seed)
    prompts = [" ".join(f"w{(i * 7 + j) % 61}" for j in range(4)) for i in range(8)]
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo_tiny_run_"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=max_steps, report_to="none",
                      logging_steps=1, save_strategy="no", beta=beta, temperature=temperature, seed=seed,
                      disable_tqdm=True, **config)
    return GRPOTrainer(model=path, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=tiny_tokenizer())
