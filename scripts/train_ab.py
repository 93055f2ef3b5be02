"""A GRPO training A/B with TRL 1.16 on CPU: TRL as it runs out of the box against TRL with grpo patched in.

    python scripts/train_ab.py --out microbench/results/train_ab          # the full run: both arms, 100 steps
    python scripts/train_ab.py --smoke --out /tmp/train_ab_smoke          # 2 steps of both arms at a tiny size

The model is built in code (no downloads): a random Qwen2 with Qwen's
vocabulary size (151936) and a small backbone (hidden 512, 2 layers, tied
embeddings like Qwen2-0.5B), so the LM head is most of the parameters and a
real share of the step. The tokenizer is a WordLevel one with 151936 entries
(every id decodes to a word). The first 16 words after the specials are the
task's "digits" d0..d15.

The task: count up modulo 16. A prompt is one digit "dK"; the reward of a
completion is the fraction of its 128 tokens that are the previous token + 1
(mod 16): "d5" -> "d6 d7 ... d15 d0 d1 ..." scores 1 (verifiable, small
arithmetic; what the completion must say depends on the prompt, and the rule
is the same for every prompt, so one prompt per step gives a consistent
gradient). A random model spreads its mass over 151936 tokens and would never
score, so both arms start from one supervised warm start, run once and cached
on disk: 128-token sequences where each token is the previous + 1 with
probability 0.3 and a uniform digit otherwise (100 steps: the policy starts
near reward 0.2-0.3 with the rule partly wired); GRPO has to raise it. Generation is
forced to the full 128 tokens (min_new_tokens; the warm start never shows
<eos> anyway).

The arms, each in its own subprocess (so its peak RSS is its own), same seed,
same data order (TRL's sampler seeded by GRPOConfig.seed), same GRPOConfig:
  trl        GRPOTrainer as it runs on CPU: TRL's chunked fused LM head
             (add_fused_lm_head) for the policy and the reference model,
             TRL's loss; GRPOConfig's defaults (bf16 autocast, gradient
             checkpointing) except where the task sets something.
  grpo       the same trainer after grpo.integrations.trl.patch_grpo_trainer
             with fused_loss=False: the LM head's log-probs / entropy (policy
             and reference) come from grpo.torch.fused_log_probs; TRL's loss
             code is untouched.
  grpo_loss  (not run by default: --arms trl,grpo,grpo_loss)
             patch_grpo_trainer's default: grpo's head for the old / reference
             log-probs and, in the loss, grpo's fused loss
             (grpo.torch.lm_head_grpo_loss on the policy's hidden states).
  grpo_filtered  (not run by default) grpo_loss with the filtered backward
             (grad_filter="auto": docs/filtered_backward.md).

Each step is split by timers around TRL's own methods:
  generation     GRPOTrainer._generate (tokenize, model.generate, decode)
  logprob_loss   every _get_per_token_logps_and_entropies call outside
                 compute_loss (the reference model's log-probs), compute_loss
                 (the policy's log-probs + the loss) and accelerator.backward
  rest           the step (on_step_begin -> on_step_end) minus the two above:
                 rewards and advantages, the optimizer step, bookkeeping
For logprob_loss the peak RSS is measured per call: glibc's free memory is
returned (malloc_trim), the RSS read, the kernel's peak (VmHWM) reset through
/proc/self/clear_refs, and VmHWM read when the call returns; a step's
logprob_loss_peak is the largest VmHWM over its calls and
logprob_loss_rise the largest VmHWM - RSS at the call's start.

On a CPU without bf16 dot products (AVX512_BF16 or AMX) torch's bf16 matmuls
run in f32 on the bf16 values, rounded to bf16, in every arm and the warm
start (Setup.bf16_matmul, F32Matmul below): torch's own bf16 backward is
~100x slower there and the A/B would not finish.

--checkpoint-every N (for a CPU where an arm outlasts a session: 100 `trl`
steps take 2.4 hours on a Zen 3) saves each arm's trainer state (weights,
optimizer, RNG, data position: TRL's own checkpoints) every N steps in
<out>/<arm>.checkpoints/; the same command run again goes on from the last
one, and the steps logged after it are dropped and run again. A resumed arm
logs the same metrics, bit for bit, as one never stopped
(python/tests/test_train_ab.py). Its time and peak RSS are summed / maxed over
the processes that ran it (each up to its last checkpoint), recorded per
segment with the CPU in <arm>.info.json; another setup or warm start is
refused. bf16_matmul=auto resolves per CPU: to go on on another CPU, pass the
recorded value.

Writes to --out: <arm>.jsonl (one JSON object per step: reward, loss, KL,
entropy, clip ratio, the three times, the memory), summary.json, train_ab.png
(reward and step time of both arms against the step) and prints a markdown
table for the README, and the command's wall time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and tokenizer are built here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARMS = ("trl", "grpo")
ALL_ARMS = ARMS + ("grpo_loss", "grpo_filtered")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything that shapes a run; the warm-start cache is keyed by its model and warm-start fields."""

    vocab: int = 151936  # Qwen2's vocabulary size
    hidden: int = 512
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1536
    digits: int = 16  # the task's alphabet d0..d(digits-1)
    completion: int = 128  # max_completion_length, every completion is this long
    step_prob: float = 0.3  # warm start: P(token = previous + 1 mod digits), else a uniform digit
    sft_steps: int = 100
    sft_batch: int = 8
    sft_lr: float = 1e-3
    seed: int = 0  # the warm start's (model init, SFT data) and, unless rl_seed is set, the GRPO run's
    # GRPO
    rl_seed: int = -1  # GRPOConfig.seed / data_seed (sampling, prompt order); -1 = seed. Not in the warm start's
    #                    key: a second rl_seed reruns GRPO from the same policy, a measure of seed noise.
    steps: int = 100
    prompts_per_step: int = 1
    num_generations: int = 8
    learning_rate: float = 3e-5
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float = 0.28  # DAPO's clip-higher
    # How torch's bf16 matmuls run, in every arm and the warm start alike (grpo's own kernel is not a torch matmul):
    # "native" as torch runs them; "f32" on the bf16 values in f32, the result rounded to bf16 (F32Matmul below);
    # "auto" (resolved before the run and recorded as one of the two): f32 on a CPU without AVX512_BF16 or AMX.
    bf16_matmul: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "bf16_matmul", resolve_bf16_matmul(self.bf16_matmul))  # "auto" -> what it is here

    def grpo_seed(self) -> int:
        return self.seed if self.rl_seed < 0 else self.rl_seed

    def model_key(self) -> str:
        fields = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "digits", "completion",
                  "step_prob", "sft_steps", "sft_batch", "sft_lr", "seed")
        key = {f: getattr(self, f) for f in fields}
        if self.bf16_matmul != "native":  # in the key only when not native, so the native runs' caches stay valid
            key["bf16_matmul"] = self.bf16_matmul
        text = json.dumps(key, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# --smoke: a model small enough for seconds, warm-started far enough that the reward is neither 0 nor 1.
SMOKE = dict(vocab=4096, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, completion=16, sft_steps=40,
             sft_batch=8, sft_lr=1e-2, steps=2, prompts_per_step=1, num_generations=8)

SPECIALS = ["<pad>", "<eos>", "<unk>"]


# --------------------------------------------------------------------------- bf16 matmuls on CPUs without bf16


def cpu_has_bf16_matmul() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512_BF16 or AMX-BF16), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux: leave torch as it is
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_bf16_matmul(value: str) -> str:
    if value not in ("auto", "native", "f32"):
        raise SystemExit(f"--set bf16_matmul={value}: one of auto, native, f32")
    if value != "auto":
        return value
    return "native" if cpu_has_bf16_matmul() else "f32"


def bf16_matmul_mode(setup: Setup):
    """The context the torch work of an arm (and the warm start) runs in: F32Matmul when bf16_matmul is "f32"."""
    if setup.bf16_matmul == "f32":
        return F32Matmul()
    return contextlib.nullcontext()


def _f32_matmul_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class F32Matmul(TorchDispatchMode):
        """torch's bf16 matrix products (mm, addmm, bmm, baddbmm: what linear and matmul become below autograd,
        forward and backward, and their out= forms, which TRL's chunked LM head calls) computed in f32 on the bf16
        values and rounded to bf16.

        Why: on a CPU without AVX512_BF16 or AMX, torch 2.15 runs a bf16 matmul's backward in a slow fallback
        (measured on a Zen 3: the LM head's backward at [128 x 512] x [512 x 151936], 115 s in bf16 against
        1.1 s in f32, 106 s of it dhidden), which makes the A/B impossible to run there. The products of two
        bf16 values are exact in f32 and both paths accumulate in f32 and round the result to bf16, so the
        results differ only by summation order (1.4e-4 of the entries of a [64 x 512] x [512 x 2048] product differed by one bf16
        ulp). Every arm and the warm start run under it alike, so the comparison stays fair; the step times
        are those of f32 matmuls plus the conversions, not of bf16 hardware.
        """

        ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
        out_ops = {aten.mm.out: aten.mm.default, aten.addmm.out: aten.addmm.default, aten.bmm.out: aten.bmm.default,
                   aten.baddbmm.out: aten.baddbmm.default}
        twin_min_numel = 1 << 20  # f32 -> bf16 casts this large (autocast's casts of the weights) get an f32 twin

        def __init__(self):
            super().__init__()
            # autocast casts each weight to bf16 on every forward (accelerate enters it per call, so its own cache
            # is gone by the next decode step), and each product would convert it back. Instead the first cast of
            # a weight (its storage, shape, strides and version: the optimizer's in-place update bumps the
            # version) keeps the f32 twin of the bf16 values, and every bf16 tensor that cast produces maps to
            # it. Both maps hold their tensors, so no other tensor can take their memory (and key) while kept,
            # and a produced tensor's own version must be unchanged for its twin to be used.
            self.twins = collections.OrderedDict()  # source key -> (source, f32 twin of its bf16 values)
            self.produced = collections.OrderedDict()  # bf16 data_ptr -> (bf16 tensor, its version, f32 twin)
            self.products = 0  # products computed in f32 (a count for the tests)

        @staticmethod
        def _key(t):
            return (t.data_ptr(), tuple(t.shape), t.stride(), t._version)

        def _from_f32(self, t, out):
            """out = t cast to bf16 (t a large f32 tensor): register out's f32 twin."""
            if not (out.is_contiguous() and t.is_contiguous()):
                return
            key = self._key(t)
            entry = self.twins.get(key)
            if entry is None:
                entry = self.twins[key] = (t, out.float())
                if len(self.twins) > 2:
                    self.twins.popitem(last=False)
            self.twins.move_to_end(key)
            self.produced[out.data_ptr()] = (out, out._version, entry[1])
            if len(self.produced) > 4:
                self.produced.popitem(last=False)

        def _f32(self, t):
            hit = self.produced.get(t.untyped_storage().data_ptr())
            if hit is not None and hit[1] == t._version:  # views share the version counter: no write since the cast
                return hit[2].as_strided(t.shape, t.stride(), t.storage_offset())
            return t.float()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in self.ops and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
                up = [self._f32(a) if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
                self.products += 1
                return func(*up, **kwargs).to(torch.bfloat16)
            # The out= forms (TRL's chunked LM head: torch.mm(hidden, w.t(), out=tile)): the same product, rounded
            # into out.
            if (func in self.out_ops and kwargs.get("out") is not None and kwargs["out"].dtype == torch.bfloat16
                    and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)):
                up = [self._f32(a) if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
                rest = {k: v for k, v in kwargs.items() if k != "out"}
                self.products += 1
                return kwargs["out"].copy_(self.out_ops[func](*up, **rest))  # copy_ rounds to nearest even as .to
            out = func(*args, **kwargs)
            if (func is aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
                    and args[0].dtype == torch.float32 and out.numel() >= self.twin_min_numel):
                self._from_f32(args[0], out)
            return out

    return F32Matmul


def F32Matmul():  # noqa: N802 (a class built on first use: torch is imported lazily in this script)
    return _f32_matmul_class()()


def words(setup: Setup) -> list[str]:
    digits = [f"d{i}" for i in range(setup.digits)]
    rest = setup.vocab - len(SPECIALS) - len(digits)
    return SPECIALS + digits + [f"w{i}" for i in range(rest)]


def make_tokenizer(setup: Setup):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words(setup))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# --------------------------------------------------------------------------- the warm start


def warm_start(setup: Setup, path: str) -> dict:
    """Random Qwen2 + supervised warm start on noisy count-up sequences; saved (with the tokenizer) at path."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(setup.seed)
    config = Qwen2Config(vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=setup.intermediate,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, max_position_embeddings=2 * (setup.completion + 8),
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(setup.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.sft_lr, weight_decay=0.0)
    # Cosine decay to 0: the last steps settle near the noisy count-up distribution instead of in Adam noise.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1.0 + math.cos(math.pi * min(i, setup.sft_steps) / setup.sft_steps)))
    losses = []
    start = time.perf_counter()
    with bf16_matmul_mode(setup):
        for step in range(setup.sft_steps):
            seq = [torch.randint(setup.digits, (setup.sft_batch,), generator=gen)]  # the prompt digit
            for _ in range(setup.completion):
                up = torch.rand(setup.sft_batch, generator=gen) < setup.step_prob
                noise = torch.randint(setup.digits, (setup.sft_batch,), generator=gen)
                seq.append(torch.where(up, (seq[-1] + 1) % setup.digits, noise))
            ids = torch.stack(seq, dim=1) + len(SPECIALS)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # predicts the completion tokens
                logits = model.lm_head(hidden)
            loss = F.cross_entropy(logits.float().reshape(-1, setup.vocab), ids[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if (step + 1) % 25 == 0:
                print(f"warm start step {step + 1}/{setup.sft_steps}: loss {statistics.fmean(losses[-25:]):.3f}",
                      flush=True)
    # The loss floor: the entropy of the noisy count-up distribution.
    p_target = setup.step_prob + (1 - setup.step_prob) / setup.digits
    p_other = (1 - setup.step_prob) / setup.digits
    floor = -(p_target * torch.log(torch.tensor(p_target)) + (setup.digits - 1) * p_other * torch.log(torch.tensor(p_other)))
    model.save_pretrained(path)
    make_tokenizer(setup).save_pretrained(path)
    info = dict(sft_steps=setup.sft_steps, seconds=time.perf_counter() - start, first_loss=losses[0],
                last_loss=statistics.fmean(losses[-10:]), loss_floor=float(floor), bf16_matmul=setup.bf16_matmul)
    with open(os.path.join(path, "warm_start.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def ensure_model(setup: Setup, cache_dir: str) -> tuple[str, bool]:
    path = os.path.join(cache_dir, f"qwen2_{setup.model_key()}")
    cached = os.path.exists(os.path.join(path, "warm_start.json"))
    if not cached:
        os.makedirs(path, exist_ok=True)
        info = warm_start(setup, path)
        print(f"warm start: {info['sft_steps']} steps in {info['seconds']:.0f} s, loss {info['first_loss']:.3f} -> "
              f"{info['last_loss']:.3f} (floor {info['loss_floor']:.3f}); saved at {path}", flush=True)
    else:
        print(f"warm start: cached at {path}", flush=True)
    return path, cached


# --------------------------------------------------------------------------- the reward


def count_reward_for(setup: Setup):
    index = {f"d{i}": i for i in range(setup.digits)}

    def count_reward(prompts, completions, **kwargs):
        """Fraction of the completion's tokens that are the previous token (the prompt's digit first) + 1 mod 16."""
        out = []
        for prompt, completion in zip(prompts, completions):
            seq = [index.get(w, -1) for w in prompt.split()[-1:] + completion.split()]
            hits = sum(1 for a, b in zip(seq, seq[1:]) if a >= 0 and b == (a + 1) % setup.digits)
            out.append(hits / setup.completion)
        return out

    return count_reward


def dataset(setup: Setup):
    from datasets import Dataset

    # A fixed size (100 prompts per digit), so a short run sees the first steps of the full run's order (TRL
    # shuffles the whole dataset with the seed).
    rows = max(setup.steps * setup.prompts_per_step, 100 * setup.digits)
    return Dataset.from_dict({"prompt": [f"d{i % setup.digits}" for i in range(rows)]})


# --------------------------------------------------------------------------- measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Phases:
    """Per-step wall time of named phases; for the memory phases the peak RSS of each call (VmHWM reset at entry)."""

    def __init__(self, memory_phases=("logprob_loss",)):
        self.memory_phases = set(memory_phases)
        self.depth = 0
        self.process_peak_kib = 0
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None
        self.reset()

    def reset(self):
        self.seconds = {}
        self.peak_kib = {}
        self.rise_kib = {}

    def _reset_hwm(self):
        self.process_peak_kib = max(self.process_peak_kib, _status_kib("VmHWM"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def final_peak_kib(self) -> int:
        return max(self.process_peak_kib, _status_kib("VmHWM"))

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.depth:  # nested (compute_loss calls _get_per_token_logps_and_entropies): counted by the outer phase
            yield
            return
        self.depth += 1
        memory = name in self.memory_phases
        if memory:
            if self._trim is not None:
                self._trim(0)
            rss0 = _status_kib("VmRSS")
            self._reset_hwm()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            if memory:
                hwm = _status_kib("VmHWM")
                self.peak_kib[name] = max(self.peak_kib.get(name, 0), hwm)
                self.rise_kib[name] = max(self.rise_kib.get(name, 0), hwm - rss0)
            self.depth -= 1


def instrument(trainer, phases: Phases) -> None:
    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with phases(name):
                return fn(*args, **kwargs)

        return wrapper

    trainer._generate = timed("generation", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed("logprob_loss", trainer._get_per_token_logps_and_entropies)
    trainer.compute_loss = timed("logprob_loss", trainer.compute_loss)
    trainer.accelerator.backward = timed("logprob_loss", trainer.accelerator.backward)


LOG_KEYS = {"reward": "reward", "reward_std": "reward_std", "loss": "loss", "kl": "kl", "entropy": "entropy",
            "clip_ratio": "clip_ratio/region_mean", "grad_norm": "grad_norm",
            "completion_length": "completions/mean_length", "trl_step_time": "step_time"}


def make_callback(phases: Phases, out_path: str, append: bool = False):
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Times each step, then writes it with TRL's logged metrics (logging_steps=1) as one JSON line."""

        def __init__(self):
            self.pending = None
            self.file = open(out_path, "a" if append else "w")

        def on_step_begin(self, args, state, control, **kwargs):
            phases.reset()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.start
            gen = phases.seconds.get("generation", 0.0)
            lpl = phases.seconds.get("logprob_loss", 0.0)
            self.pending = dict(step=state.global_step, step_s=step, generation_s=gen, logprob_loss_s=lpl,
                                rest_s=step - gen - lpl,
                                logprob_loss_peak_mib=phases.peak_kib.get("logprob_loss", 0) / 1024,
                                logprob_loss_rise_mib=phases.rise_kib.get("logprob_loss", 0) / 1024,
                                rss_mib=_status_kib("VmRSS") / 1024)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is None or logs is None or "reward" not in logs:
                return
            record = dict(self.pending)
            for key, name in LOG_KEYS.items():
                if name in logs:
                    record[key] = float(logs[name])
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                  flush=True)
            self.pending = None

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    return StepRecorder()


# --------------------------------------------------------------------------- one arm (its own process)


def cpu_name() -> str:
    """The CPU the arm ran on, as /proc/cpuinfo names it (model name, family and model): step times hold on it."""
    from grpo.bench import cpu_model  # the package every arm's venv has (run_train_ab.sh installs it)

    return cpu_model()


def setup_fields(smoke: bool, steps: int | None, sets: list[str]) -> dict:
    """The Setup fields of --smoke, --steps and --set FIELD=VALUE (each value parsed as its field's type)."""
    fields = dict(SMOKE) if smoke else {}
    if steps is not None:
        fields["steps"] = steps
    types = {f.name: f.type for f in dataclasses.fields(Setup)}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"--set {item}: FIELD=VALUE with FIELD one of {', '.join(types)}")
        fields[key] = {"int": int, "float": float, "str": str}[types[key]](value)
    return fields


def warm_start_fingerprint(model_dir: str) -> str:
    """sha256 of the warm start's weights: a resumed arm must continue from the policy (and reference) it began with."""
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def checkpoint_dir(out_dir: str, arm: str) -> str:
    return os.path.join(out_dir, f"{arm}.checkpoints")


def latest_checkpoint(trainer_dir: str) -> tuple[str | None, int]:
    """The newest complete checkpoint TRL saved in trainer_dir (Trainer's checkpoint-<step>) and its step."""
    best, step = None, 0
    if os.path.isdir(trainer_dir):
        for name in os.listdir(trainer_dir):
            prefix, _, number = name.partition("-")
            path = os.path.join(trainer_dir, name)
            if (prefix == "checkpoint" and number.isdigit() and int(number) > step
                    and os.path.exists(os.path.join(path, "trainer_state.json"))):
                best, step = path, int(number)
    return best, step


def run_record_path(trainer_dir: str) -> str:
    """A checkpointed arm's run record: what it is a run of, and its segments (one per process that ran it)."""
    return os.path.join(trainer_dir, "run.json")


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous file


def arm_complete(out_dir: str, arm: str, setup: Setup) -> bool:
    """Whether --out holds a finished checkpointed run of this arm and setup (its info.json has the segments)."""
    path = os.path.join(out_dir, f"{arm}.info.json")
    if not os.path.exists(path) or os.path.isdir(checkpoint_dir(out_dir, arm)):
        return False
    with open(path) as f:
        info = json.load(f)
    return "segments" in info and info.get("setup") == dataclasses.asdict(setup)


def run_arm(arm: str, setup: Setup, model_dir: str, out_dir: str, checkpoint_every: int = 0,
            warm_start: str | None = None) -> dict:
    """One arm in this process. warm_start: the warm start's fingerprint when the caller has it (the driver's
    --warm-start), else computed here when checkpoints need it."""
    import tempfile

    if checkpoint_every > 0:
        ident = run_ident(setup, model_dir, warm_start)
        return _run_arm(arm, setup, model_dir, out_dir, checkpoint_dir(out_dir, arm), checkpoint_every, ident)
    with tempfile.TemporaryDirectory(prefix=f"train_ab_{arm}_") as trainer_dir:  # TRL's output_dir (saves nothing)
        return _run_arm(arm, setup, model_dir, out_dir, trainer_dir, 0, None)


def run_ident(setup: Setup, model_dir: str, fingerprint: str | None = None) -> dict:
    """What a checkpointed run is a run of: the setup and the warm start's fingerprint (sha256 of 335 MB at the
    full size: computed once, by the driver, and handed to the arm process as fingerprint)."""
    return dict(setup=dataclasses.asdict(setup), warm_start=fingerprint or warm_start_fingerprint(model_dir))


def recorded_run(trainer_dir: str, ident: dict) -> dict | None:
    """The record of the checkpointed run in trainer_dir, if there is one; refuses a record of another run than
    ident (another setup or warm start)."""
    path = run_record_path(trainer_dir)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        run = json.load(f)
    if run["ident"] != ident:
        diff = sorted(k for k in ident["setup"] if ident["setup"][k] != run["ident"]["setup"].get(k))
        what = f"setup ({', '.join(diff)} differ)" if diff else "warm start (another model.safetensors)"
        raise SystemExit(f"--checkpoint-every: {trainer_dir} holds a run of another {what}; resume it with the "
                         f"same --set values (bf16_matmul=auto resolves per CPU: pass the recorded "
                         f"bf16_matmul={run['ident']['setup']['bf16_matmul']}), or remove the directory to start over")
    return run


def _resume_state(arm: str, ident: dict, out_dir: str, trainer_dir: str) -> tuple[dict, str | None]:
    """--checkpoint-every: the arm's run record (<arm>.checkpoints/run.json: what it is a run of, and its segments,
    one per process that ran it) and the checkpoint to resume from, if any. Refuses to resume another setup or
    another warm start. The per-step records past the checkpoint (steps a killed process ran after its last save)
    are dropped: the resumed run computes them again."""
    run = recorded_run(trainer_dir, ident)
    resume, step = latest_checkpoint(trainer_dir)
    if resume is None or run is None:
        os.makedirs(trainer_dir, exist_ok=True)
        run, resume, step = dict(ident=ident, segments=[]), None, 0
    else:
        run["segments"] = [s for s in run["segments"] if s["to_step"] <= step and s["to_step"] > s["from_step"]]
    records = os.path.join(out_dir, f"{arm}.jsonl")
    if resume is not None:
        with open(records) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        if len(rows) != step:
            raise SystemExit(f"--checkpoint-every: {records} has {len(rows)} of the {step} steps {resume} holds")
        with open(records, "w") as f:
            f.writelines(rows)
    run["segments"].append(dict(from_step=step, to_step=step, wall_s=0.0, peak_rss_mib=0.0, cpu=cpu_name()))
    _write_json(run_record_path(trainer_dir), run)
    return run, resume


def _run_arm(arm: str, setup: Setup, model_dir: str, out_dir: str, trainer_dir: str, checkpoint_every: int,
             ident: dict | None) -> dict:
    import torch
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    run, resume = _resume_state(arm, ident, out_dir, trainer_dir) if checkpoint_every else (None, None)
    phases = Phases()
    args = GRPOConfig(
        output_dir=trainer_dir, use_cpu=True, seed=setup.grpo_seed(), data_seed=setup.grpo_seed(),
        per_device_train_batch_size=setup.prompts_per_step * setup.num_generations,
        num_generations=setup.num_generations, max_completion_length=setup.completion,
        generation_kwargs={"min_new_tokens": setup.completion}, max_steps=setup.steps, loss_type="dapo",
        beta=setup.beta, epsilon=setup.epsilon, epsilon_high=setup.epsilon_high,
        learning_rate=setup.learning_rate, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        save_strategy="steps" if checkpoint_every else "no", save_steps=max(checkpoint_every, 1), save_total_limit=1,
        disable_tqdm=True)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=count_reward_for(setup), args=args,
                          train_dataset=dataset(setup), processing_class=make_tokenizer(setup))
    if arm in ("grpo", "grpo_loss", "grpo_filtered"):
        from grpo.integrations.trl import patch_grpo_trainer

        patch_grpo_trainer(trainer, fused_loss=arm != "grpo", grad_filter="auto" if arm == "grpo_filtered" else None)
    elif arm != "trl":
        raise ValueError(f"unknown arm {arm!r} (one of {', '.join(ALL_ARMS)})")
    instrument(trainer, phases)
    start = time.perf_counter()
    trainer.add_callback(make_callback(phases, os.path.join(out_dir, f"{arm}.jsonl"), append=resume is not None))
    if run is not None:
        trainer.add_callback(make_segment_recorder(phases, run_record_path(trainer_dir), run, start))
    with bf16_matmul_mode(setup):
        trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    info = dict(arm=arm, seconds=seconds, peak_rss_mib=phases.final_peak_kib() / 1024,
                threads=torch.get_num_threads(), torch=torch.__version__, trl=trl.__version__,
                transformers=transformers.__version__, bf16_matmul=setup.bf16_matmul, cpu=cpu_name())
    if run is not None:
        # The arm's time and peak over the processes that ran it: each earlier one up to its last checkpoint (what
        # it ran past that was run again here), this one to the end.
        run["segments"][-1].update(to_step=setup.steps, wall_s=seconds, peak_rss_mib=info["peak_rss_mib"])
        segments = run["segments"]
        info.update(seconds=sum(s["wall_s"] for s in segments), peak_rss_mib=max(s["peak_rss_mib"] for s in segments),
                    checkpoint_every=checkpoint_every, segments=segments, setup=dataclasses.asdict(setup))
        cpus = sorted({s["cpu"] for s in segments})
        info["cpu"] = cpus[0] if len(cpus) == 1 else "mixed: " + "; ".join(cpus)
    with open(os.path.join(out_dir, f"{arm}.info.json"), "w") as f:
        json.dump(info, f, indent=1)
    if run is not None:
        import shutil

        shutil.rmtree(trainer_dir)  # the checkpoints (model, optimizer: ~1 GB at the full size) are spent
    return info


def make_segment_recorder(phases: Phases, path: str, run: dict, start: float):
    from transformers import TrainerCallback

    class SegmentRecorder(TrainerCallback):
        """After each checkpoint: this process's wall time and peak RSS up to it, in run.json."""

        def on_save(self, args, state, control, **kwargs):
            run["segments"][-1].update(to_step=state.global_step, wall_s=time.perf_counter() - start,
                                       peak_rss_mib=phases.final_peak_kib() / 1024)
            _write_json(path, run)
            if state.global_step == int(os.environ.get("GRPO_TRAIN_AB_KILL_AFTER_SAVE", "0")):
                os._exit(9)  # python/tests/test_train_ab.py: a process killed right after a checkpoint

    return SegmentRecorder()


# --------------------------------------------------------------------------- summary, table, plot


def load_steps(out_dir: str, arm: str) -> list[dict]:
    with open(os.path.join(out_dir, f"{arm}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def summarize(out_dir: str, arms: list[str], setup: Setup) -> dict:
    """Per arm: the phase times (median over steps 2..N: step 1 builds plans and warms caches), the memory, the
    reward's start and end; across arms: the step-1 agreement, the end-of-run reward gap against its noise, and
    grpo / trl ratios of the log-prob + loss part."""
    summary = {"setup": dataclasses.asdict(setup), "arms": {}}
    steps = {arm: load_steps(out_dir, arm) for arm in arms}
    for arm in arms:
        rows = steps[arm]
        timed = rows[1:] if len(rows) > 1 else rows
        with open(os.path.join(out_dir, f"{arm}.info.json")) as f:
            info = json.load(f)
        info.pop("setup", None)  # a checkpointed run's own copy (arm_complete): the summary has it once
        window = max(1, min(10, len(rows) // 4)) if len(rows) >= 4 else 1
        summary["arms"][arm] = dict(
            info,
            steps=len(rows),
            median_s={k: statistics.median(r[k + "_s"] for r in timed)
                      for k in ("step", "generation", "logprob_loss", "rest")},
            logprob_loss_peak_mib=max(r["logprob_loss_peak_mib"] for r in rows),
            logprob_loss_rise_mib=max(r["logprob_loss_rise_mib"] for r in rows),
            logprob_loss_rise_median_mib=statistics.median(r["logprob_loss_rise_mib"] for r in timed),
            reward_window=window,
            reward_first=_mean([r["reward"] for r in rows[:window]]),
            reward_last=_mean([r["reward"] for r in rows[-window:]]),
        )
    if "trl" in arms:
        a = summary["arms"]["trl"]
        summary["ratios_over_trl"], summary["agreement"] = {}, {}
        for arm in arms:
            if arm == "trl":
                continue
            b = summary["arms"][arm]
            summary["ratios_over_trl"][arm] = {
                "logprob_loss_time": b["median_s"]["logprob_loss"] / a["median_s"]["logprob_loss"],
                "logprob_loss_peak_rss": b["logprob_loss_peak_mib"] / a["logprob_loss_peak_mib"],
                "logprob_loss_rise": b["logprob_loss_rise_mib"] / max(a["logprob_loss_rise_mib"], 1e-9),
                "step_time": b["median_s"]["step"] / a["median_s"]["step"],
                "process_peak_rss": b["peak_rss_mib"] / a["peak_rss_mib"],
            }
            first = {k: dict(trl=steps["trl"][0].get(k), other=steps[arm][0].get(k))
                     for k in ("reward", "loss", "kl", "entropy", "grad_norm")}
            # The end of the run: the last quarter (at most 20 steps) of each arm. Its noise: the standard error
            # of the two means from the per-step spread (steps taken as independent draws: the arms' samples
            # diverge within a few steps, and one step's reward is a mean over fresh completions).
            n = max(1, min(20, min(len(steps["trl"]), len(steps[arm])) // 4))
            tails = [[r["reward"] for r in steps[x][-n:]] for x in ("trl", arm)]
            se = (sum(statistics.pvariance(t) / len(t) for t in tails)) ** 0.5 if n > 1 else float("nan")
            summary["agreement"][arm] = dict(
                step1=first, step1_reward_identical=first["reward"]["trl"] == first["reward"]["other"],
                tail_steps=n, tail_reward=dict(trl=_mean(tails[0]), other=_mean(tails[1])),
                tail_gap=_mean(tails[1]) - _mean(tails[0]), tail_gap_se=se)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def markdown(summary: dict) -> str:
    lines = ["| arm | step (s) | generation (s) | log-prob + loss (s) | rest (s) | log-prob + loss peak RSS (MiB) "
             "| its rise (MiB) | process peak RSS (MiB) | reward, first -> last steps | wall (min) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for arm, s in summary["arms"].items():
        m = s["median_s"]
        lines.append(f"| {arm} | {m['step']:.2f} | {m['generation']:.2f} | {m['logprob_loss']:.2f} | {m['rest']:.2f} "
                     f"| {s['logprob_loss_peak_mib']:.0f} | {s['logprob_loss_rise_mib']:.0f} | {s['peak_rss_mib']:.0f} "
                     f"| {s['reward_first']:.3f} -> {s['reward_last']:.3f} (means of {s['reward_window']}) "
                     f"| {s['seconds'] / 60:.1f} |")
    for arm, r in summary.get("ratios_over_trl", {}).items():
        lines.append(f"| {arm} / trl | {r['step_time']:.2f}x | | {r['logprob_loss_time']:.2f}x | "
                     f"| {r['logprob_loss_peak_rss']:.2f}x | {r['logprob_loss_rise']:.2f}x "
                     f"| {r['process_peak_rss']:.2f}x | | |")
    lines.append("")
    for arm, g in summary.get("agreement", {}).items():
        s1 = g["step1"]
        lines.append(f"{arm} against trl. Step 1: reward {s1['reward']['trl']:.6f} / {s1['reward']['other']:.6f} "
                     f"({'identical' if g['step1_reward_identical'] else 'DIFFERENT'}), entropy "
                     f"{s1['entropy']['trl']:.6g} / {s1['entropy']['other']:.6g}, grad norm "
                     f"{s1['grad_norm']['trl']:.6g} / {s1['grad_norm']['other']:.6g}. Last {g['tail_steps']} steps: "
                     f"mean reward {g['tail_reward']['trl']:.3f} / {g['tail_reward']['other']:.3f}, gap "
                     f"{g['tail_gap']:+.3f} (standard error {g['tail_gap_se']:.3f}).")
    return "\n".join(lines)


def plot(out_dir: str, arms: list[str]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the [bench] extra): no PNG", flush=True)
        return None
    colors = {"trl": "tab:blue", "grpo": "tab:red", "grpo_loss": "tab:green", "grpo_filtered": "tab:orange"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in arms:
        rows = load_steps(out_dir, arm)
        x = [r["step"] for r in rows]
        reward = [r["reward"] for r in rows]
        k = 10
        smooth = [_mean(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
        c = colors.get(arm, f"C{len(colors) + arms.index(arm)}")  # one color for an arm's lines
        ax1.plot(x, reward, color=c, alpha=0.3, lw=1)
        ax1.plot(x, smooth, color=c, lw=2, label=f"{arm} ({k}-step mean)")
        ax2.plot(x, [r["step_s"] for r in rows], color=c, lw=2, label=f"{arm}: step")
        ax2.plot(x, [r["logprob_loss_s"] for r in rows], color=c, lw=1.5, ls="--", label=f"{arm}: log-prob + loss")
        ax2.plot(x, [r["generation_s"] for r in rows], color=c, lw=1, ls=":", label=f"{arm}: generation")
    ax1.set(xlabel="step", ylabel="reward (fraction of tokens = previous + 1)", title="Reward")
    ax2.set(xlabel="step", ylabel="seconds", title="Step time", ylim=(0, None))
    ax1.legend()
    ax2.legend(fontsize=8)
    names = {"trl": "TRL as is (trl)", "grpo": "grpo's head patched in (grpo)",
             "grpo_loss": "grpo's head and fused loss (grpo_loss)",
             "grpo_filtered": "grpo's fused loss, filtered backward (grpo_filtered)"}
    fig.suptitle("GRPO on CPU with TRL 1.16: " + " vs ".join(names.get(a, a) for a in arms))
    fig.tight_layout()
    path = os.path.join(out_dir, "train_ab.png")
    fig.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------- the driver


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="microbench/results/train_ab")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--reuse", default="", metavar="ARM,...",
                        help="arms of --arms not run again: their <arm>.jsonl / .info.json already in --out (from an "
                             "earlier run of the same setup) go into the summary as they are")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default 100; 2 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps: checks the script end to end")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "grpo_train_ab"))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a Setup field")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save each arm's trainer state every N steps in <out>/<arm>.checkpoints/ and, when the "
                             "same command is run again, go on from the last one (arms complete in --out are kept): "
                             "for a CPU where an arm outlasts a session. 0 (default): no checkpoints")
    parser.add_argument("--run-arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--warm-start", help=argparse.SUPPRESS)  # internal: the warm start's fingerprint
    opts = parser.parse_args(argv)

    fields = setup_fields(opts.smoke, opts.steps, opts.set)
    setup = Setup(**fields)

    if opts.checkpoint_every < 0:
        raise SystemExit(f"--checkpoint-every {opts.checkpoint_every}: a number of steps >= 0")
    if opts.run_arm:
        run_arm(opts.run_arm, setup, opts.model_dir, opts.out, opts.checkpoint_every, opts.warm_start)
        return 0

    os.makedirs(opts.out, exist_ok=True)
    start = time.perf_counter()
    model_dir, cached = ensure_model(setup, opts.cache_dir)
    warm_start_s = time.perf_counter() - start
    arms = opts.arms.split(",")
    reused = [a for a in opts.reuse.split(",") if a]
    for arm in reused:
        if arm not in arms or not os.path.exists(os.path.join(opts.out, f"{arm}.jsonl")):
            raise SystemExit(f"--reuse {arm}: not in --arms, or no {arm}.jsonl in {opts.out}")
    ident = None  # run_ident(): computed once, when an arm is checkpointed
    for arm in arms:
        if arm in reused:
            print(f"== arm {arm}: reused from {opts.out}/{arm}.jsonl", flush=True)
            continue
        resuming, fingerprint = False, []
        if opts.checkpoint_every:
            if arm_complete(opts.out, arm, setup):
                print(f"== arm {arm}: complete in {opts.out} (a checkpointed run of this setup)", flush=True)
                continue
            ident = ident or run_ident(setup, model_dir)
            recorded_run(checkpoint_dir(opts.out, arm), ident)  # refuses another setup before the arm runs
            resuming = latest_checkpoint(checkpoint_dir(opts.out, arm))[0] is not None
            fingerprint = [f"--warm-start={ident['warm_start']}"]
        cmd = [sys.executable, os.path.abspath(__file__), "--run-arm", arm, "--model-dir", model_dir, "--out", opts.out,
               f"--checkpoint-every={opts.checkpoint_every}", *fingerprint]
        cmd += ["--smoke"] if opts.smoke else []
        cmd += [f"--set={k}={v}" for k, v in fields.items()]
        print(f"== arm {arm} (full output: {arm}.log){' resumed' if resuming else ''}", flush=True)
        with open(os.path.join(opts.out, f"{arm}.log"), "a" if resuming else "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail = []
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-40:]
                if line.startswith(("step=", "warm start")):
                    print(line, end="", flush=True)
            if proc.wait() != 0:
                print("".join(tail), end="", file=sys.stderr)
                raise SystemExit(f"arm {arm} failed (exit {proc.returncode}); see {log.name}")
    summary = summarize(opts.out, arms, setup)
    png = plot(opts.out, arms)
    total_s = time.perf_counter() - start
    # The command's wall time, with the warm start (0 when it came from the cache) and the arms' subprocesses.
    summary["command"] = dict(wall_s=total_s, warm_start_s=warm_start_s, warm_start_cached=cached)
    with open(os.path.join(opts.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(markdown(summary))
    print(f"command wall time {total_s / 60:.1f} min (warm start {warm_start_s / 60:.1f} min)")
    print(f"wrote {opts.out}/{{{','.join(arms)}}}.jsonl, summary.json" + (f", {os.path.basename(png)}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
