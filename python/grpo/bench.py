"""python -m grpo.bench: step time and peak RSS of five ways to get an LM head's GRPO loss and gradients.

One invocation runs, one after another, each method in its own fresh
subprocess (peak RSS needs one: ru_maxrss / VmHWM only grow), at each shape:

  eager       torch eager, unfused: logits = hidden W^T materialized, TRL's
              selective_log_softmax (+ entropy_from_logits), TRL's GRPO loss
              math (below), autograd backward
  liger       Liger-Kernel's chunked LigerFusedLinearGRPOLoss (compiled=False)
  trl_head    TRL 1.16's chunked log-prob head (ChunkedLogProbFunction) +
              the same eager loss
  grpo_loss   grpo's fused loss, grpo.torch.LmHeadGRPOLoss (Liger's API)
  grpo_head   grpo's log-prob head, grpo.torch.fused_log_probs + the same
              eager loss

The loss (for eager, trl_head, grpo_head) is TRL's GRPOTrainer math for
loss_type "dapo", beta 0.04, epsilon 0.2 / 0.2: r = exp(logp - old),
per_token = -min(r A, clip(r, 0.8, 1.2) A) + beta (e^(ref - logp) - (ref -
logp) - 1), summed over valid tokens / their count; liger and grpo_loss
compute the same loss. One step = forward + backward with gradients of
hidden and lm_head.weight; reported: the median step time over --steps steps
after one warm-up step, the worker's peak RSS (VmHWM) and its RSS after the
inputs were built (so peak - base is the method's own memory).

Shapes: "quick" (B=1 T=512 H=4096 V=151936), "headline" (B=1 T=8192 H=4096
V=151936), or "B,T,H,V". Writes a JSON (--out) and a PNG next to it (needs
matplotlib: the [bench] extra). The headline shape needs ~20 GB and minutes
per method on 2 cores.

    python -m grpo.bench                                # quick then headline, bf16
    python -m grpo.bench --shape 1,64,256,4096 --steps 2 --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

METHODS = ("eager", "liger", "trl_head", "grpo_loss", "grpo_head")
SHAPES = {"quick": (1, 512, 4096, 151936), "headline": (1, 8192, 4096, 151936)}
BETA, EPS = 0.04, 0.2


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _eager_loss(logp, old, ref, adv, mask):
    """TRL GRPOTrainer's per-token loss (dapo aggregation, token-level ratio, k3 KL)."""
    import torch

    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    per_token = per_token + BETA * (torch.exp(ref - logp) - (ref - logp) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _worker(method: str, b: int, t: int, h: int, v: int, dtype_name: str, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g) * 5 - 8  # about log(1/V)
    ref = old + 0.1 * torch.randn(b, t, generator=g)

    if method == "eager":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        def step():
            logits = hidden @ weight.T  # [B, T, V] in the model dtype, as an eager trainer has them
            logp = selective_log_softmax(logits, ids)
            with torch.no_grad():
                entropy_from_logits(logits)  # TRL logs it
            return _eager_loss(logp, old, ref, adv, mask)
    elif method == "trl_head":
        from trl.kernels import ChunkedLogProbFunction

        def step():
            logp, _ent, *_ = ChunkedLogProbFunction.apply(hidden.view(-1, h), weight, None, ids.view(-1), 1.0,
                                                          32768, None, 1.0, ("log_probs", "entropy"))
            return _eager_loss(logp.view(b, t), old, ref, adv, mask)
    elif method == "grpo_head":
        import grpo.torch as gt

        def step():
            logp, _ent = gt.fused_log_probs(hidden, weight, None, ids)
            return _eager_loss(logp, old, ref, adv, mask)
    elif method in ("liger", "grpo_loss"):
        if method == "liger":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss as Loss
            module = Loss(beta=BETA, loss_type="dapo", compiled=False)
        else:
            from grpo.torch import LmHeadGRPOLoss as Loss
            module = Loss(beta=BETA, loss_type="dapo")

        def step():
            loss, _metrics = module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
            return loss
    else:
        raise SystemExit(f"unknown method {method}")

    base_kib = _rss_kib("VmRSS")
    times = []
    for i in range(steps + 1):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        loss = step()
        loss.backward()
        elapsed = time.perf_counter() - start
        if i > 0:  # the first step is a warm-up (plans, oneDNN kernels, allocator)
            times.append(elapsed)
    return {"method": method, "B": b, "T": t, "H": h, "V": v, "dtype": dtype_name, "threads": threads,
            "step_s": statistics.median(times), "steps": steps, "loss": float(loss.detach()),
            "peak_rss_mib": _rss_kib("VmHWM") / 1024, "base_rss_mib": base_kib / 1024}


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
    fig, axes = plt.subplots(len(shapes), 2, figsize=(10, 3 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        rs = [r for r in results if (r["B"], r["T"], r["H"], r["V"]) == shape and "step_s" in r]
        names = [r["method"] for r in rs]
        axes[row][0].barh(names, [r["step_s"] for r in rs])
        axes[row][0].set_xlabel("step time (s, forward + backward)")
        axes[row][1].barh(names, [r["peak_rss_mib"] for r in rs], label="peak RSS")
        axes[row][1].barh(names, [r["base_rss_mib"] for r in rs], label="RSS after inputs")
        axes[row][1].set_xlabel("MiB")
        axes[row][1].legend(fontsize=7)
        axes[row][0].set_title("B=%d T=%d H=%d V=%d %s" % (*shape, rs[0]["dtype"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", type=_parse_shape,
                        help="quick, headline or B,T,H,V (repeatable; default: quick then headline)")
    parser.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method (after one warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="grpo_bench.json", help="JSON path; the PNG goes next to it")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        method, b, t, h, v, dtype, steps = args.worker
        result = _worker(method, int(b), int(t), int(h), int(v), dtype, int(steps), args.threads)
        print("GRPO_BENCH_RESULT " + json.dumps(result), flush=True)
        return 0

    shapes = args.shape or [SHAPES["quick"], SHAPES["headline"]]
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}")
    results = []
    for b, t, h, v in shapes:
        for method in methods:
            cmd = [sys.executable, "-m", "grpo.bench", "--threads", str(args.threads), "--worker", method,
                   str(b), str(t), str(h), str(v), args.dtype, str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_BENCH_RESULT ")]
            if proc.returncode == 0 and lines:
                r = json.loads(lines[-1].split(" ", 1)[1])
                print(f"B={b} T={t} H={h} V={v} {args.dtype:4s} {method:10s} step {r['step_s'] * 1e3:10.1f} ms  "
                      f"peak RSS {r['peak_rss_mib']:9.1f} MiB (after inputs {r['base_rss_mib']:.1f})  "
                      f"loss {r['loss']:.6g}", flush=True)
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                r = {"method": method, "B": b, "T": t, "H": h, "V": v, "dtype": args.dtype,
                     "error": f"exit {proc.returncode}: {tail[0]}"}
                print(f"B={b} T={t} H={h} V={v} {args.dtype:4s} {method:10s} FAILED {r['error']}", flush=True)
            results.append(r)
    with open(args.out, "w") as f:
        json.dump({"results": results, "threads": args.threads}, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    print(f"wrote {args.out}" + (f" and {png}" if _plot(results, png) else " (no PNG: matplotlib not installed)"))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
