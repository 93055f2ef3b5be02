"""Export the training A/B's trained LM head as a grpo-microbench input (issue 20, item 4b).

    python scripts/export_trained_head.py --out build/trained_head/ab_trl_step100.grpoin   # the A/B's model
    python scripts/export_trained_head.py --smoke --out /tmp/trained_head_smoke.grpoin       # tiny, end to end

It takes the model of scripts/train_ab.py (a Qwen2 with Qwen's vocabulary,
151936 ids, hidden 512) after the A/B's supervised warm start (cached by
train_ab.py) and its GRPO steps (one arm of the A/B, run here through
train_ab's own _run_arm, so the trainer is the A/B's exactly; the trained
policy is cached beside the warm start), samples a batch of its own
completions (one prompt per group, num_generations completions of the
A/B's completion length, temperature 1, no top-k / top-p: the policy's
distribution, as TRL samples them), and writes

  hidden      the final hidden states (after the final norm) that predict each completion token, [B*T, 512]
  weight      the LM head (tied to the embeddings), [151936, 512]
  ids         the completion tokens, mask (all 1: completions are forced to full length)
  advantages  per completion: the group's rewards standardized as TRL does (scale_rewards="group")

in the format grpo-microbench reads with `inputs: {generator: file, path: ...}`
(microbench/input_file.hpp), all float32. The forward runs under bf16 autocast
as the A/B's does. It prints the logits' per-token entropy and the fraction of
softmax entries with |p - onehot| >= 2^-12 over the whole batch (exact, the
logits are small here), the figures grpo-microbench's own sampled statistics
should match.

The file (~0.3 GB at the A/B's size) is generated, not committed:
configs/microbench/trained_head_ab_bf16.yaml points at the default --out.
Needs torch, transformers, TRL and datasets (the A/B's [trl] extras); the
"grpo" arm also needs the grpo package.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ab  # noqa: E402  (the A/B's setup, warm start and trainer)

MAGIC = b"GRPOIN01"  # microbench/input_file.hpp
EPS = 2.0**-12  # eps(bf16) / 32, the filtered backward's `auto`


def policy_dir(setup: train_ab.Setup, arm: str, cache_dir: str) -> str:
    key = f"{setup.model_key()}_{arm}_steps{setup.steps}_rl{setup.grpo_seed()}"
    return os.path.join(cache_dir, f"grpo_policy_{key}")


def trained_policy(setup: train_ab.Setup, arm: str, cache_dir: str, save_every: int) -> tuple[str, bool, float]:
    """The policy after the warm start and setup.steps GRPO steps of `arm`, saved under cache_dir (and every
    save_every steps under checkpoint-<step>/ there, so a cut-off run still leaves a policy to export)."""
    warm_dir, _ = train_ab.ensure_model(setup, cache_dir)
    path = policy_dir(setup, arm, cache_dir)
    if os.path.exists(os.path.join(path, "done.json")):
        return path, True, 0.0
    import trl
    from transformers import TrainerCallback

    base = trl.GRPOTrainer

    class SavingTrainer(base):  # the A/B's trainer, which keeps its policy (periodically and when training ends)
        def train(self, *args, **kwargs):
            model = self.model

            class Checkpoints(TrainerCallback):
                def on_step_end(self, args, state, control, **kw):
                    if save_every > 0 and state.global_step % save_every == 0 and state.global_step < setup.steps:
                        model.save_pretrained(os.path.join(path, f"checkpoint-{state.global_step}"))

            self.add_callback(Checkpoints())
            out = super().train(*args, **kwargs)
            self.model.save_pretrained(path)
            return out

    start = time.perf_counter()
    trl.GRPOTrainer = SavingTrainer  # train_ab._run_arm imports it from trl when it runs
    try:
        with tempfile.TemporaryDirectory(prefix="export_head_") as tmp_out, \
                tempfile.TemporaryDirectory(prefix="export_head_trainer_") as trainer_dir:
            train_ab._run_arm(arm, setup, warm_dir, tmp_out, trainer_dir, 0, None)  # no checkpoints of its own
            rewards = [json.loads(line).get("reward") for line in open(os.path.join(tmp_out, f"{arm}.jsonl"))]
    finally:
        trl.GRPOTrainer = base
    seconds = time.perf_counter() - start
    with open(os.path.join(path, "done.json"), "w") as f:
        json.dump(dict(arm=arm, steps=setup.steps, seconds=seconds, rewards=rewards), f, indent=1)
    return path, False, seconds


def export(setup: train_ab.Setup, policy_dir: str, out: str, groups: int, seed: int) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM.from_pretrained(policy_dir, torch_dtype=torch.float32).eval()
    tok = train_ab.make_tokenizer(setup)
    reward = train_ab.count_reward_for(setup)
    gen = torch.Generator().manual_seed(seed)
    prompts = [f"d{int(d)}" for d in torch.randint(setup.digits, (groups,), generator=gen)]
    n = setup.num_generations
    batch_prompts = [p for p in prompts for _ in range(n)]
    enc = tok(batch_prompts, return_tensors="pt", add_special_tokens=False)
    prompt_len = enc["input_ids"].shape[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        seqs = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              min_new_tokens=setup.completion, max_new_tokens=setup.completion,
                              pad_token_id=tok.pad_token_id)
        completion = seqs[:, prompt_len:]
        # Position prompt_len - 1 + t predicts completion token t.
        hidden = model.model(input_ids=seqs).last_hidden_state[:, prompt_len - 1:-1]
    hidden = hidden.float().reshape(-1, setup.hidden).contiguous()
    weight = model.lm_head.weight.detach().float().contiguous()
    ids = completion.reshape(-1).to(torch.int32)
    texts = tok.batch_decode(completion, skip_special_tokens=True)
    rewards = torch.tensor(reward(batch_prompts, texts), dtype=torch.float64).reshape(groups, n)
    # TRL's scale_rewards="group": (r - group mean) / (group std + 1e-4), std unbiased as torch's default.
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    adv = adv.reshape(-1).float()

    # The logits as the microbench sees them: bf16 hidden and weight, float accumulation; 128 rows at a time.
    w16 = weight.bfloat16().float()
    entropy, chosen, above = [], [], 0
    for r0 in range(0, len(ids), 128):
        z = hidden[r0:r0 + 128].bfloat16().float() @ w16.T
        logp = torch.log_softmax(z.double(), dim=-1)
        p = logp.exp()
        entropy.append(-(p * logp).sum(-1))
        rows = torch.arange(p.shape[0])
        y = ids[r0:r0 + 128].long()
        chosen.append(logp[rows, y])
        p[rows, y] -= 1.0
        above += (p.abs() >= EPS).sum().item()
    entropy, chosen = torch.cat(entropy), torch.cat(chosen)
    q = torch.quantile(entropy, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    stats = dict(tokens=len(ids), entropy_mean=entropy.mean().item(), entropy_p10=q[0], entropy_p50=q[1],
                 entropy_p90=q[2], chosen_logp_mean=chosen.mean().item(),
                 frac_above_eps=above / (len(ids) * setup.vocab), significant_per_row=above / len(ids),
                 reward_mean=rewards.mean().item())

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    batch, seq_len = groups * n, setup.completion
    with open(out, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<6q", batch, seq_len, setup.hidden, setup.vocab, batch, 0))
        for a in (hidden.numpy(), weight.numpy()):
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(ids.numpy(), dtype="<i4").tobytes())
        f.write(np.ones(batch * seq_len, dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(adv.numpy(), dtype="<f4").tobytes())
    stats["shape"] = dict(batch=batch, seq_len=seq_len, hidden=setup.hidden, vocab=setup.vocab)
    return stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/trained_head/ab_trl_step100.grpoin")
    parser.add_argument("--arm", default="trl", choices=train_ab.ALL_ARMS, help="the A/B arm whose policy is taken")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the A/B's 100; 2 with --smoke)")
    parser.add_argument("--groups", type=int, default=1, help="prompts, each with num_generations completions")
    parser.add_argument("--seed", type=int, default=1234, help="the exported batch's prompts and sampling")
    parser.add_argument("--save-every", type=int, default=10, help="also save the policy every N GRPO steps")
    parser.add_argument("--checkpoint", type=int, default=0,
                        help="export the policy saved after this many steps of an unfinished run (no training)")
    parser.add_argument("--warm-start-only", action="store_true", help="export the warm start (no GRPO steps)")
    parser.add_argument("--smoke", action="store_true", help="train_ab's tiny model: the script end to end")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "grpo_train_ab"))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a Setup field")
    opts = parser.parse_args(argv)

    setup = train_ab.Setup(**train_ab.setup_fields(opts.smoke, opts.steps, opts.set))

    start = time.perf_counter()
    if opts.warm_start_only:
        (policy, cached), train_s = train_ab.ensure_model(setup, opts.cache_dir), 0.0
    elif opts.checkpoint:
        policy, cached, train_s = os.path.join(policy_dir(setup, opts.arm, opts.cache_dir),
                                               f"checkpoint-{opts.checkpoint}"), True, 0.0
        if not os.path.exists(os.path.join(policy, "config.json")):
            raise SystemExit(f"no checkpoint at {policy} (a run with --save-every saves them)")
    else:
        policy, cached, train_s = trained_policy(setup, opts.arm, opts.cache_dir, opts.save_every)
    print(f"policy: {policy} ({'cached' if cached else f'trained in {train_s / 60:.1f} min'})", flush=True)
    stats = export(setup, policy, opts.out, opts.groups, opts.seed)
    total = time.perf_counter() - start
    s = stats["shape"]
    print(f"wrote {opts.out} ({os.path.getsize(opts.out) / 2**20:.0f} MiB): shape {{batch: {s['batch']}, "
          f"seq_len: {s['seq_len']}, hidden: {s['hidden']}, vocab: {s['vocab']}}}")
    print(f"entropy mean {stats['entropy_mean']:.3f} nats (p10 {stats['entropy_p10']:.3f} p50 "
          f"{stats['entropy_p50']:.3f} p90 {stats['entropy_p90']:.3f}); chosen-id logp mean "
          f"{stats['chosen_logp_mean']:.3f}; |p - onehot| >= 2^-12: {stats['frac_above_eps']:.3g} of entries "
          f"({stats['significant_per_row']:.1f} per row); reward mean {stats['reward_mean']:.3f}")
    print(f"total {total / 60:.1f} min")
    with open(opts.out + ".json", "w") as f:
        json.dump(dict(stats, policy=policy, arm=opts.arm, steps=0 if opts.warm_start_only else opts.checkpoint or setup.steps, seconds=total,
                       train_seconds=train_s), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
