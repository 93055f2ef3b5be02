"""python -m grpo.bench: one named GRPO workload through PyTorch, beside the C++ step of the same workload.

One invocation runs, per shape, each method in its own fresh subprocess (peak
RSS needs one: VmHWM only grows), then the C++ microbench
(build/microbench/grpo-microbench) on the same workload in another, and
prints each method's step time, its ratio to the C++ step, the kernel time
grpo's methods report (step stats) and each one's own peak RSS rise.
grpo_head's ratio is to the C++ generic log-prob head's step (cpp_head:
configs/microbench/generic_head_T512_bf16.yaml, same overrides), every
other method's to the fused C++ step (cpp):

  grpo_loss   grpo.torch.lm_head_grpo_loss (the fused loss, functional form)
  grpo_dropin grpo.torch.LmHeadGRPOLoss (the Liger drop-in; Liger's API)
  grpo_head   grpo.torch.fused_log_probs + the workload's loss in torch
  eager       torch eager, unfused: logits = hidden W^T materialized, TRL's
              selective_log_softmax (+ entropy_from_logits), the loss in torch
  liger       Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss (compiled=False)
  trl_head    TRL 1.16's chunked log-prob head (ChunkedLogProbFunction) + the
              loss in torch
  grpo_trl    TRL 1.16's GRPOTrainer._compute_loss patched by
              grpo.integrations.trl.patch_grpo_trainer (the policy's head and
              TRL's loss in one fused call), on a Qwen2 of the shape with no
              decoder layer (embedding frozen, final norm, lm_head = the
              workload's W): hidden = norm(embedding(ids)), the workload's
              loss options as GRPOConfig fields
  grpo_ce     grpo.torch.linear_cross_entropy, reduction="sum" (cross entropy
              over every token: the workload's loss terms do not apply; its
              ratio is to the fused C++ step, the same three GEMM passes)
  eager_ce    torch 2.15's F.linear_cross_entropy, reduction="sum", no
              options (the logits materialized)
  grpo_packed grpo_loss on packed sequences (needs --lengths): the batch's
              valid tokens back to back in one row, cu_seqlens
  grpo_unpadded  grpo_loss on the same tokens as one sequence (needs
              --lengths): no offsets, the packed call's work without its
              per-sequence rules
  grpo_vocab  grpo_loss vocabulary-parallel over torch.distributed: --ranks
              processes (default 2, gloo on loopback), each --threads /
              --ranks threads and a contiguous 1/ranks of W's rows (Megatron's
              layout), every rank all of hidden; its step is the slowest
              rank's (a barrier before each step), its peak the largest
              rank's own rise, each rank's in the JSON

Workloads (--workload) are the C++ microbench configs' own recipes, so the
C++ run is the same work (same loss type, beta, old / ref log-probs,
advantages, so statistically the same active rows; each side draws its own
values from the same distributions). Inputs: hidden ~ N(0, 1), W ~ N(0,
3 / sqrt(H)) (logits of std ~3), ids uniform, per-token advantages ~ N(0, 1)
(B = 1: both signs), logp from a forward-only run:

  offpolicy  loss_type grpo, beta 0, old_logp = logp + N(0, 0.3): ratios on
             both sides of both clip edges, clipped rows leave the backward
             (configs/microbench/quick_fused_bf16_tile2048.yaml's inputs)
  onpolicy   loss_type grpo, beta 0, no old_logp: every valid row in the
             backward, the fused path's worst case
             (configs/microbench/plain_onpolicy_T512_bf16.yaml)
  dapo_kl    loss_type dapo, beta 0.04 (k3), old = logp + N(0, 0.3), ref =
             logp + N(0, 0.1), num_items_in_batch = the valid tokens: the
             KL keeps every row active

The C++ run is `grpo-microbench --config <that config> --set shape.* --set
dtype --set dweight_dtype / dhidden_dtype (the parameters' dtype, as the
Python path writes them) --set threads --set steps`, and its step is the p50
of its timed steps. One step = forward + backward with gradients of hidden
and lm_head.weight, .grad reset to None before each (a fresh gradient each
step, as Trainer's zero_grad(set_to_none=True)); reported: the median over
--steps steps after one warm-up step. Own peak = VmHWM - VmRSS, with VmHWM
restarted (/proc/self/clear_refs) once the inputs exist.

--lengths L1,L2,... (or A-BxK: K lengths evenly from A to B): completions of
those lengths; each shape's B and T become K and max(L), every method's
batch is padded to T (mask 0 past each length: grpo_loss is the padded
call), grpo_packed / grpo_unpadded take the same tokens unpadded, and no
C++ row runs.

Run it from the repository, set GRPO_REPO, or pass --microbench from a
checkout's build (its configs are found beside it): the C++ configs are read
from there. Shapes: "quick" (B=1 T=512 H=4096 V=151936), "headline" (B=1 T=8192 H=4096
V=151936), or "B,T,H,V". Writes a JSON (--out) and a PNG next to it (needs
matplotlib). The headline shape needs ~20 GB for eager and minutes per
method on 2 cores: run it alone on the machine.

    python -m grpo.bench --shape quick --shape headline          # the acceptance figures
    python -m grpo.bench --shape 1,64,256,4096 --steps 2 --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ("grpo_loss", "grpo_dropin", "grpo_head", "eager", "liger", "trl_head", "grpo_trl", "grpo_ce", "eager_ce",
           "grpo_vocab", "grpo_packed", "grpo_unpadded")
PACKED_METHODS = ("grpo_packed", "grpo_unpadded")
SHAPES = {"quick": (1, 512, 4096, 151936), "headline": (1, 8192, 4096, 151936)}
LOGIT_STD, OLD_NOISE, REF_NOISE = 3.0, 0.3, 0.1
EPS = 0.2
# name -> (loss_type, beta, off-policy, C++ config, --set overrides of the config's loss / inputs)
WORKLOADS = {
    "offpolicy": ("grpo", 0.0, True, "configs/microbench/quick_fused_bf16_tile2048.yaml", []),
    "onpolicy": ("grpo", 0.0, False, "configs/microbench/plain_onpolicy_T512_bf16.yaml", ["inputs.old_logp=none"]),
    "dapo_kl": ("dapo", 0.04, True, "configs/microbench/quick_fused_bf16_tile2048.yaml",
                ["loss.loss_type=dapo", "loss.beta=0.04", "loss.num_items_in_batch=auto"]),
}
# The C++ step grpo_head is compared with: the generic log-prob head driven
# as a trainer drives it (forward, the loss outside, backward), same inputs.
HEAD_CONFIG = "configs/microbench/generic_head_T512_bf16.yaml"


def _checkout_above(start: str) -> str | None:
    """start or the nearest parent holding configs/microbench (a grpo checkout), else None."""
    here = os.path.abspath(start)
    while True:
        if os.path.isdir(os.path.join(here, "configs", "microbench")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _find_repo() -> str:
    """The grpo source tree (its configs/microbench): $GRPO_REPO, else the working directory or a parent of it."""
    if os.environ.get("GRPO_REPO"):
        return os.environ["GRPO_REPO"]
    return _checkout_above(os.getcwd()) or os.getcwd()


REPO = _find_repo()


def configs_root(binary: str | None) -> str | None:
    """Where the C++ rows' configs are: REPO when it holds configs/microbench, else the checkout the
    grpo-microbench binary was built in (build/microbench/ under it), else None (a pip user outside the
    checkout who passed no binary from one)."""
    if os.path.isdir(os.path.join(REPO, "configs", "microbench")):
        return REPO
    if binary is not None:
        return _checkout_above(os.path.dirname(os.path.realpath(binary)))
    return None


def describe_workload(name: str) -> str:
    loss_type, beta, off, config, _ = WORKLOADS[name]
    return (f"{name}: loss_type {loss_type}, beta {beta}, "
            + (f"old_logp = logp + N(0, {OLD_NOISE})" if off else "on-policy (no old_logp)")
            + (f", ref_logp = logp + N(0, {REF_NOISE})" if beta else "")
            + f", per-token advantages N(0, 1), logits std ~{LOGIT_STD:g}; C++: {config}")


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (a VM's name alone, "AMD EPYC", names no generation)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _reset_peak() -> int:
    """Restarts VmHWM from the current RSS (input generation's transients, e.g. a float32 randn of W before its
    bf16 cast, must not count as the step's) and returns the RSS in KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then peak - base also holds the inputs' transients (an overestimate)
    return _rss_kib("VmRSS")


def _torch_loss(logp, old, ref, adv, mask, loss_type: str, beta: float):
    """TRL GRPOTrainer's loss on per-token log-probs: token-level ratio, PPO clip, k3 KL, grpo / dapo aggregation."""
    import torch

    old = logp.detach() if old is None else old
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def make_inputs(b: int, t: int, h: int, v: int, dtype_name: str, workload: str, seed: int = 0):
    """The workload's tensors (see the module docstring); logp from a forward-only grpo run."""
    import torch

    import grpo.torch as gt

    loss_type, beta, off, _config, _ = WORKLOADS[workload]
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (LOGIT_STD / h**0.5)).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    adv = torch.randn(b, t, generator=g)
    import grpo

    with torch.no_grad():
        # Its own plan cache, dropped here: the loss step's workspace must count in the step's peak, not
        # in the inputs' memory.
        logp = gt.lm_head_grpo_loss(hidden, weight, ids, mask, adv, plan_cache=grpo.PlanCache()).per_token_logps
    old = logp + OLD_NOISE * torch.randn(b, t, generator=g) if off else None
    ref = logp + REF_NOISE * torch.randn(b, t, generator=g) if beta else None
    return dict(hidden=hidden.requires_grad_(), weight=weight.requires_grad_(), ids=ids, mask=mask, adv=adv,
                old=old, ref=ref, loss_type=loss_type, beta=beta)


def _trl_step(weight, ids, mask, adv, off_policy: bool, loss_type: str, beta: float):
    """grpo_trl: a patched GRPOTrainer's _compute_loss on a layerless Qwen2 whose lm_head is `weight`.

    The trainer's backbone is its embedding (frozen: no [V, H] gradient of its
    own) and final norm, so the step is TRL's head and loss, what the patch
    replaces. old / ref log-probs keep the workload's noise around the
    model's own log-probs."""
    import tempfile

    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import grpo.torch as gt
    from grpo.integrations.trl import patch_grpo_trainer

    b, t = ids.shape
    v, h = weight.shape
    config = Qwen2Config(vocab_size=v, hidden_size=h, intermediate_size=h, num_hidden_layers=0, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=t + 1, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(weight.dtype)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers, made on meta above
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        model.model.embed_tokens.weight.copy_(torch.randn(v, h, generator=g))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(weight)
    model.model.embed_tokens.weight.requires_grad_(False)
    words = ["<pad>", "<eos>", "<unk>", "w"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo_bench_trl_"), use_cpu=True, report_to="none",
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=t, beta=beta,
                      loss_type=loss_type, epsilon=EPS, disable_tqdm=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["w"] * b}), processing_class=tokenizer)
    patch_grpo_trainer(trainer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch per step here
    model = trainer.model
    model.train()
    prompt = torch.ones(b, 1, dtype=ids.dtype)
    with torch.no_grad():  # the model's own log-probs: the workload's old / ref noise goes around them
        hid = model.model(input_ids=torch.cat([prompt, ids], 1)).last_hidden_state[:, :-1]
        logp, _ = gt.fused_log_probs(hid, model.lm_head.weight, None, ids)
    g = torch.Generator().manual_seed(2)
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones(b, 1, dtype=torch.long), "completion_ids": ids,
              "completion_mask": mask.long(), "advantages": adv,
              "num_items_in_batch": mask.sum()}
    if off_policy:
        inputs["old_per_token_logps"] = logp + OLD_NOISE * torch.randn(b, t, generator=g)
    if beta:
        inputs["ref_per_token_logps"] = logp + REF_NOISE * torch.randn(b, t, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        return trainer._compute_loss(model, inputs)

    return step


def parse_lengths(text: str) -> list[int]:
    """--lengths: "L1,L2,..." or "A-BxK" (K lengths evenly spaced from A to B)."""
    if "x" in text and "-" in text:
        span, count = text.split("x")
        lo, hi = (int(a) for a in span.split("-"))
        k = int(count)
        if k < 1 or not 1 <= lo <= hi:
            raise ValueError(text)
        return [lo + round(i * (hi - lo) / max(k - 1, 1)) for i in range(k)]
    lengths = [int(a) for a in text.split(",")]
    if not lengths or min(lengths) < 1:
        raise ValueError(text)
    return lengths


def _pack_inputs(x: dict, lengths: list[int], method: str) -> dict:
    """The padded batch's valid tokens back to back ([1, N] rows); grpo_packed adds their cu_seqlens."""
    import torch

    b, t = x["ids"].shape
    keep = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    rows = keep.reshape(-1).nonzero().flatten()
    h = x["hidden"].shape[-1]
    packed = {k: None if x[k] is None else x[k].reshape(-1)[rows].unsqueeze(0)
              for k in ("ids", "mask", "old", "ref")}
    packed["hidden"] = x["hidden"].detach().reshape(-1, h)[rows].unsqueeze(0).requires_grad_()
    if method == "grpo_packed":
        packed["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)
        packed["adv"] = x["adv"].reshape(b, t)[:, 0].clone()  # per sequence, as packed trainers hand them
    else:
        packed["adv"] = x["adv"].reshape(-1)[rows].unsqueeze(0)
    return packed


def _worker(method: str, b: int, t: int, h: int, v: int, dtype_name: str, steps: int, threads: int,
            workload: str, lengths: list[int] | None = None) -> dict:
    import torch

    torch.set_num_threads(threads)
    x = make_inputs(b, t, h, v, dtype_name, workload)
    if lengths:
        for i, n in enumerate(lengths):
            x["mask"][i, n:] = 0.0  # padding
        x["adv"] = x["adv"][:, :1].expand(b, t).clone()  # one advantage per completion, as GRPO has them
    cu_seqlens = None
    if method in PACKED_METHODS:
        x.update(_pack_inputs(x, lengths, method))
        cu_seqlens = x.get("cu_seqlens")
    hidden, weight, ids, mask, adv, old, ref = (x[k] for k in ("hidden", "weight", "ids", "mask", "adv", "old",
                                                               "ref"))
    loss_type, beta = x["loss_type"], x["beta"]
    num_items = float(mask.sum())
    kernel = []  # per step: the grpo step stats of the call(s)
    before_step = None

    if method == "eager":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        def step():
            logits = hidden @ weight.T  # [B, T, V] in the model dtype, as an eager trainer has them
            logp = selective_log_softmax(logits, ids)
            with torch.no_grad():
                entropy_from_logits(logits)  # TRL logs it
            return _torch_loss(logp, old, ref, adv, mask, loss_type, beta)
    elif method == "trl_head":
        from trl.kernels import ChunkedLogProbFunction

        def step():
            logp, _ent, *_ = ChunkedLogProbFunction.apply(hidden.view(-1, h), weight, None, ids.view(-1), 1.0,
                                                          32768, None, 1.0, ("log_probs", "entropy"))
            return _torch_loss(logp.view(b, t), old, ref, adv, mask, loss_type, beta)
    elif method == "grpo_head":
        import grpo.torch as gt

        def step():
            logp, _ent = gt.fused_log_probs(hidden, weight, None, ids, on_stats=kernel.append)
            return _torch_loss(logp, old, ref, adv, mask, loss_type, beta)
    elif method in ("grpo_loss",) + PACKED_METHODS:
        import grpo.torch as gt

        def step():
            out = gt.lm_head_grpo_loss(hidden, weight, ids, mask, adv, old_logp=old, ref_logp=ref,
                                       loss_type=loss_type, beta=beta, epsilon_low=EPS, epsilon_high=EPS,
                                       num_items_in_batch=num_items if loss_type == "dapo" else None,
                                       cu_seqlens=cu_seqlens)
            kernel.append(out.stats)
            return out.loss
    elif method == "grpo_vocab":
        import torch.distributed as dist

        import grpo.torch as gt

        # This rank's rows of W (the parent set rank, world size and the rendezvous in the environment);
        # the whole W made for the inputs is released before the peak restarts.
        rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        lo, hi = rank * v // ranks, (rank + 1) * v // ranks
        weight = weight.detach()[lo:hi].clone().requires_grad_()
        x.clear()
        before_step = dist.barrier  # the ranks start each step together: a step is the slowest rank's

        def step():
            out = gt.lm_head_grpo_loss(hidden, weight, ids, mask, adv, old_logp=old, ref_logp=ref,
                                       loss_type=loss_type, beta=beta, epsilon_low=EPS, epsilon_high=EPS,
                                       num_items_in_batch=num_items if loss_type == "dapo" else None,
                                       vocab_group=dist.group.WORLD, vocab_start=lo)
            kernel.append(out.stats)
            return out.loss
    elif method == "grpo_trl":
        step = _trl_step(weight.detach(), ids, mask, adv, old is not None, loss_type, beta)
        del hidden, weight  # the trainer's model holds its own copy of W
        hidden = weight = None
    elif method in ("grpo_ce", "eager_ce"):
        # Cross entropy, the sum of -logp over every token (the workload's loss terms do not apply):
        # grpo's fused call against torch's F.linear_cross_entropy without options (logits materialized).
        import torch.nn.functional as F

        import grpo.torch as gt

        ce = gt.linear_cross_entropy if method == "grpo_ce" else F.linear_cross_entropy

        def step():
            return ce(hidden.view(-1, h), weight, ids.view(-1), reduction="sum")
    elif method in ("liger", "grpo_dropin"):
        if method == "liger":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss as Loss
            module = Loss(beta=beta, loss_type=loss_type, compiled=False, use_ref_model=bool(beta))
        else:
            from grpo.torch import LmHeadGRPOLoss as Loss
            module = Loss(beta=beta, loss_type=loss_type, use_ref_model=bool(beta))

        def step():
            loss, _metrics = module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
            return loss
    else:
        raise SystemExit(f"unknown method {method}")

    base_kib = _reset_peak()
    times, kernel_s, stats = [], [], None
    import warnings

    # grpo_trl: a fallback to TRL's own path would say so in a warning; the result lists grpo's warnings.
    with warnings.catch_warnings(record=True) as seen_warnings:
        warnings.simplefilter("always")
        for i in range(steps + 1):
            if hidden is not None:
                hidden.grad = weight.grad = None
            kernel.clear()
            if before_step is not None:
                before_step()
            start = time.perf_counter()
            loss = step()
            loss.backward()
            elapsed = time.perf_counter() - start
            if i > 0:  # the first step is a warm-up (plans, oneDNN kernels, allocator)
                times.append(elapsed)
                if kernel:  # grpo_loss: one call; grpo_head: its forward and its backward
                    kernel_s.append(sum(s["kernel_s"] for s in kernel))
                    stats = dict(kernel[-1], executed_flops=sum(s["executed_flops"] for s in kernel))
    grpo_warnings = sorted({str(w.message) for w in seen_warnings if str(w.message).startswith("grpo")})
    result = {"method": method, "B": b, "T": t, "H": h, "V": v, "dtype": dtype_name, "threads": threads,
              "workload": workload, "step_s": statistics.median(times), "steps": steps,
              "loss": float(loss.detach()), "peak_rss_mib": _rss_kib("VmHWM") / 1024, "base_rss_mib": base_kib / 1024}
    if grpo_warnings:
        result["warnings"] = grpo_warnings
    if kernel_s:
        result["kernel_s"] = statistics.median(kernel_s)
        result["active_rows"] = stats["active_rows"]
        result["executed_gflop"] = stats["executed_flops"] / 1e9
    return result


def _microbench_path(given: str | None) -> str | None:
    if given == "none":
        return None
    path = given or os.environ.get("GRPO_MICROBENCH") or os.path.join(REPO, "build", "microbench", "grpo-microbench")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def run_cpp(binary: str, b: int, t: int, h: int, v: int, dtype: str, steps: int, threads: int,
            workload: str, head: bool = False, root: str | None = None) -> dict:
    """The C++ microbench on the workload's config at this shape (head: the generic head's); its p50 step and
    own peak. root: the checkout holding the configs (configs_root)."""
    root = root or REPO
    _lt, _beta, _off, config, loss_sets = WORKLOADS[workload]
    if head:
        config = HEAD_CONFIG
    sets = [f"shape.batch={b}", f"shape.seq_len={t}", f"shape.hidden={h}", f"shape.vocab={v}", f"dtype={dtype}",
            f"dweight_dtype={dtype}", f"dhidden_dtype={dtype}", f"threads={threads}", f"steps={steps}",
            "warmup=1", "measure_unfused_gemms=false"] + loss_sets
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cpp.json")
        cmd = [binary, "--config", os.path.join(root, config), "--quiet"]
        for s in sets:
            cmd += ["--set", s]
        cmd += [f"--benchmark_out={out}", "--benchmark_out_format=json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"method": "cpp_head" if head else "cpp", "B": b, "T": t, "H": h, "V": v, "dtype": dtype, "workload": workload,
                    "error": f"exit {proc.returncode}: {tail[0]}", "command": " ".join(cmd)}
        with open(out) as f:
            data = json.load(f)
    bench = data["benchmarks"][0]
    return {"method": "cpp_head" if head else "cpp", "B": b, "T": t, "H": h, "V": v, "dtype": dtype,
            "workload": workload, "threads": threads, "step_s": bench["step_s_p50"], "steps": steps, "loss": bench["loss"],
            "peak_rise_mib": bench["peak_rss_delta_bytes"] / 2**20, "library_peak_mib": bench["peak_bytes"] / 2**20,
            "executed_gflop": bench["executed_gflops"] * bench["step_s_p50"],
            "cpu_model": data["context"].get("cpu_model", ""), "config": config, "sets": sets}


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    if text in SHAPES:
        return SHAPES[text]
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape must be quick, headline or B,T,H,V; got {text!r}")
    return parts


def _plot(results: list, png: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({(r["B"], r["T"], r["H"], r["V"]) for r in results if "step_s" in r}, key=lambda s: s[1])
    if not shapes:
        return False
    fig, axes = plt.subplots(len(shapes), 2, figsize=(10, 3 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        rs = [r for r in results if (r["B"], r["T"], r["H"], r["V"]) == shape and "step_s" in r]
        names = [r["method"] for r in rs]
        axes[row][0].barh(names, [r["step_s"] for r in rs])
        axes[row][0].set_xlabel("step time (s, forward + backward)")
        axes[row][1].barh(names, [r.get("peak_rise_mib", 0.0) for r in rs])
        axes[row][1].set_xlabel("own peak RSS rise (MiB)")
        axes[row][0].set_title("B=%d T=%d H=%d V=%d %s %s" % (*shape, rs[0]["dtype"], rs[0]["workload"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True


def _line(r: dict, cpp: dict | None) -> str:
    if "error" in r:
        return f"  {r['method']:12s} FAILED {r['error']}"
    ratio = f"{r['step_s'] / cpp['step_s']:6.3f}" if cpp and "step_s" in cpp else "     -"
    kernel = f"{r['kernel_s']:9.3f}" if "kernel_s" in r else "        -"
    active = str(r.get("active_rows", "-"))
    gflop = f"{r['executed_gflop']:9.1f}" if "executed_gflop" in r else "        -"
    warned = f"  warned: {'; '.join(r['warnings'])}" if r.get("warnings") else ""
    return (f"  {r['method']:12s} {r['step_s']:9.3f} {ratio} {kernel} {r['peak_rise_mib']:10.1f} "
            f"{active:>7s} {gflop} {r['loss']:12.6g}{warned}")


def markdown_table(results: list, cpu: str, threads: int, workload: str, dtype: str) -> str:
    """The run as a README table: one row per shape and method, the ratio to the C++ step it is compared with."""
    lines = [f"CPU: {cpu}, {threads} threads; workload {describe_workload(workload)}; {dtype}", "",
             "| B, T, H, V | method | step (s) | / C++ step | kernel (s) | own peak rise (MiB) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        shape = f"{r['B']}, {r['T']}, {r['H']}, {r['V']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['method']} | failed: {r['error']} | | | |")
            continue
        ratio = f"{r['ratio_vs_cpp']:.3f}" if "ratio_vs_cpp" in r else "-"
        kernel = f"{r['kernel_s']:.3f}" if "kernel_s" in r else "-"
        lines.append(f"| {shape} | {r['method']} | {r['step_s']:.3f} | {ratio} | {kernel} | "
                     f"{r['peak_rise_mib']:.0f} |")
    return "\n".join(lines)


def _worker_command(worker: list, threads: int, lengths: str | None = None) -> list:
    return ([sys.executable, "-m", "grpo.bench", "--threads", str(threads)] +
            (["--lengths", lengths] if lengths else []) + ["--worker", *worker])


def _worker_result(worker: list, returncode: int, stdout: str, stderr: str) -> dict:
    """A worker's result line, its own peak rise added; or its failure, with its last line of output."""
    lines = [x for x in stdout.splitlines() if x.startswith("GRPO_BENCH_RESULT ")]
    if returncode == 0 and lines:
        r = json.loads(lines[-1].split(" ", 1)[1])
        r["peak_rise_mib"] = r["peak_rss_mib"] - r["base_rss_mib"]
        return r
    method, b, t, h, v, dtype, _steps, workload = worker
    tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
    return {"method": method, "B": int(b), "T": int(t), "H": int(h), "V": int(v), "dtype": dtype, "workload": workload,
            "error": f"exit {returncode}: {tail[0]}"}


def _run_worker(worker: list, threads: int, lengths: str | None = None) -> dict:
    """One method in its own process (its own peak RSS)."""
    proc = subprocess.run(_worker_command(worker, threads, lengths), capture_output=True, text=True)
    return _worker_result(worker, proc.returncode, proc.stdout, proc.stderr)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(worker: list, threads: int, ranks: int) -> dict:
    """grpo_vocab: `ranks` processes at once, threads / ranks threads each; the slowest rank's step, the largest
    rank's own peak, and every rank's result."""
    each = max(1, threads // ranks)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen(_worker_command(worker, each), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(env, RANK=str(q))) for q in range(ranks)]
    outputs = [p.communicate() for p in procs]
    per_rank = [_worker_result(worker, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    failed = [(q, r) for q, r in enumerate(per_rank) if "error" in r]
    if failed:
        q, r = failed[0]
        return dict(r, error=f"rank {q}: {r['error']}")
    slowest = max(per_rank, key=lambda r: r["step_s"])
    largest = max(per_rank, key=lambda r: r["peak_rise_mib"])
    return dict(slowest, ranks=ranks, threads=each, peak_rise_mib=largest["peak_rise_mib"],
                peak_rss_mib=largest["peak_rss_mib"], base_rss_mib=largest["base_rss_mib"],
                per_rank=[{k: r[k] for k in ("step_s", "peak_rise_mib", "base_rss_mib", "loss", "kernel_s")
                           if k in r} for r in per_rank])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", type=_parse_shape,
                        help="quick, headline or B,T,H,V (repeatable; default: quick then headline)")
    parser.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="offpolicy")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method (after one warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--microbench", default=None,
                        help="grpo-microbench binary (default $GRPO_MICROBENCH or build/microbench/grpo-microbench); "
                             "'none' skips the C++ run")
    parser.add_argument("--ranks", type=int, default=2,
                        help="grpo_vocab's processes (each --threads / --ranks threads, at least 1)")
    parser.add_argument("--out", default="grpo_bench.json", help="JSON path; the PNG goes next to it")
    parser.add_argument("--lengths", default=None,
                        help="completion lengths L1,L2,... or A-BxK: a padded batch of them; grpo_packed / "
                             "grpo_unpadded take its tokens unpadded (see the module docstring)")
    parser.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = None
    if args.lengths is not None:
        try:
            lengths = parse_lengths(args.lengths)
        except ValueError:
            parser.error(f"--lengths must be L1,L2,... or A-BxK with lengths >= 1, got {args.lengths!r}")

    if args.worker:
        method, b, t, h, v, dtype, steps, workload = args.worker
        result = _worker(method, int(b), int(t), int(h), int(v), dtype, int(steps), args.threads, workload,
                         lengths)
        if lengths:
            result["lengths"] = lengths
        print("GRPO_BENCH_RESULT " + json.dumps(result), flush=True)
        if method == "grpo_vocab":
            os._exit(0)  # torch 2.15's gloo process group can abort in its teardown at exit; the result is out
        return 0
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")

    shapes = args.shape or [SHAPES["quick"], SHAPES["headline"]]
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}")
        if m in PACKED_METHODS and lengths is None:
            parser.error(f"method {m} needs --lengths")
    if lengths is not None:
        # A padded batch of the completions: B = K, T = max(L); the C++ microbench has no such workload.
        shapes = [(len(lengths), max(lengths), h, v) for _b, _t, h, v in shapes]
        args.microbench = "none"
        print(f"lengths {lengths}: {sum(lengths)} tokens, padded to {len(lengths)} x {max(lengths)} = "
              f"{len(lengths) * max(lengths)} rows; one advantage per completion", flush=True)
    binary = _microbench_path(args.microbench)
    if args.microbench not in (None, "none") and binary is None:
        parser.error(f"--microbench {args.microbench!r} is not an executable")
    cpu = cpu_model()
    print(f"CPU: {cpu}, {args.threads} threads; workload {describe_workload(args.workload)}; dtype {args.dtype}",
          flush=True)
    if binary is None:
        print("C++ microbench: not found (build/microbench/grpo-microbench or --microbench PATH): no ratios",
              flush=True)
    root = configs_root(binary)
    if binary is not None and root is None:
        print(f"C++ microbench: {binary} found, but not its configs (configs/microbench/*.yaml of the grpo "
              "checkout): run from the checkout or set GRPO_REPO=<checkout>: no C++ rows, no ratios", flush=True)
        binary = None
    results = []
    for b, t, h, v in shapes:
        print(f"B={b} T={t} H={h} V={v} {args.dtype}", flush=True)
        # peak MiB: the method's own peak RSS rise over its inputs; active: rows
        # in the backward GEMMs; exec GF: the GFLOP the step's GEMMs executed.
        print(f"  {'method':12s} {'step s':>9s} {'/C++':>6s} {'kernel s':>9s} {'peak MiB':>10s} {'active':>7s} "
              f"{'exec GF':>9s} {'loss':>12s}", flush=True)
        cpp = cpp_head = None
        if binary is not None:
            cpp = run_cpp(binary, b, t, h, v, args.dtype, args.steps, args.threads, args.workload, root=root)
            print(_line(cpp, None), flush=True)
            results.append(cpp)
            if "grpo_head" in methods:
                cpp_head = run_cpp(binary, b, t, h, v, args.dtype, args.steps, args.threads, args.workload,
                                   head=True, root=root)
                print(_line(cpp_head, None), flush=True)
                results.append(cpp_head)
        one_process = None
        for method in methods:
            worker = [method, str(b), str(t), str(h), str(v), args.dtype, str(args.steps), args.workload]
            if method == "grpo_vocab":
                r = _run_ranks(worker, args.threads, args.ranks)
                if one_process is not None and "error" not in r:
                    r["peak_ratio_vs_grpo_loss"] = r["peak_rise_mib"] / one_process["peak_rise_mib"]
            else:
                r = _run_worker(worker, args.threads, args.lengths)
            if "error" not in r:
                # grpo_head against the C++ generic head; every other method against the fused C++ step.
                ref = cpp_head if method == "grpo_head" else cpp
                if ref is not None and "step_s" in ref:
                    r["ratio_vs_cpp"] = r["step_s"] / ref["step_s"]
            if method == "grpo_loss" and "error" not in r:
                one_process = r
            print(_line(r, cpp_head if method == "grpo_head" else cpp), flush=True)
            results.append(r)
        unpadded = [r for r in results[-len(methods):] if r["method"] == "grpo_unpadded" and "error" not in r]
        if unpadded:
            # The packed claim: packed within 1.05x of one sequence of the same tokens, below the padded call.
            for r in results[-len(methods):]:
                if "step_s" in r:
                    r["ratio_vs_unpadded"] = r["step_s"] / unpadded[0]["step_s"]
                    print(f"  {r['method']:12s} / grpo_unpadded {r['ratio_vs_unpadded']:.3f}", flush=True)
    print(markdown_table(results, cpu, args.threads, args.workload, args.dtype), flush=True)
    with open(args.out, "w") as f:
        json.dump({"results": results, "threads": args.threads, "cpu_model": cpu, "workload": args.workload,
                   "workload_description": describe_workload(args.workload), "dtype": args.dtype}, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    print(f"wrote {args.out}" + (f" and {png}" if _plot(results, png) else " (no PNG: matplotlib not installed)"))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
