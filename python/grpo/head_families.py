"""python -m grpo.head_families: the filtered backward's gradient error over a matrix of LM heads.

Issue 44. The filter's accuracy is a property to hold on any head, not on
the generator it was built against (microbench/synth_trained.cpp). This
module builds heads the way published measurements describe trained output
embeddings, each family from its own construction, and measures, per head,
the exact fused step's and the filtered step's dhidden / dW error against a
float64 reference with the logits materialized.

The families (W [V, H] rows; the frequency rank of an id sorts log(1 + id)
plus N(0, 1) noise, as a BPE vocabulary's merge order roughly follows
frequency):

  isotropic     W_v ~ N(0, I / H): the control, no shared direction
  mean          W_v = c mu + N(0, I / H): every row shares a mean direction mu
                (anisotropy: the mean pairwise cosine of trained embeddings
                is 0.2-0.6); c sets that cosine (`cos`)
  spectrum      W_v = g_v diag(i^-alpha) Q + c mu: a power-law singular
                spectrum of random directions Q (`alpha`), plus a mean
  freq_norms    spectrum rows scaled by 1 / (1 + gamma log(1 + rank)): rare
                ids have smaller norms (`gamma`)
  rare_cluster  ids past the top `frequent` fraction by rank share a cluster
                direction (rare-token degeneration), the frequent ones spread

Every head adds a Zipf unigram prior along one hidden direction (W[v, 0] =
-s log(1 + rank_v), h[0] = 1 before the row's scale). A hidden row is pulled
toward its target's W row (h0 = `pull` unit(W_y* - mean W) + (1 - pull)
noise, y* drawn from the prior), then scaled so its entropy lands on a
per-token target (an exponential of mean `entropy` nats, clamped to 0.01-4.5:
most tokens near 0, a few far above, median ~0.7 x the mean); the chosen id
is drawn from the row's own distribution, as a policy's completion is. The
loss: grpo, beta 0.04 (k3), per-token advantages N(0, 1), old_logp and
ref_logp the row's logp plus N(0, 0.3) kept off the clip edges.

    python -m grpo.head_families                      # the matrix at T=512 H=1024 V=151936 bf16
    python -m grpo.head_families --shape 64,256,16384 # a check in seconds
    python -m grpo.head_families --head-file build/trained_head/ab_trl_step20.grpoin  # an exported head
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Optional

import torch

EPS_LOW = 0.2
EPS_HIGH = 0.2
BETA = 0.04
KINK_MARGIN = 2e-3  # ratios off the clip edges: float32 and float64 agree on every token's branch


@dataclasses.dataclass
class Head:
    name: str
    hidden: torch.Tensor  # [N, H] bf16
    weight: torch.Tensor  # [V, H] bf16
    ids: torch.Tensor     # [N] int32
    mask: torch.Tensor    # [N] float32
    advantages: torch.Tensor  # [N] float32
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None


def _frequency_rank(v: int, g: torch.Generator) -> torch.Tensor:
    key = torch.log1p(torch.arange(v, dtype=torch.float64)) + torch.randn(v, generator=g, dtype=torch.float64)
    rank = torch.empty(v, dtype=torch.float64)
    rank[torch.argsort(key)] = torch.arange(v, dtype=torch.float64)
    return rank


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def _spectrum_rows(v: int, h: int, alpha: float, g: torch.Generator) -> torch.Tensor:
    """Rows g_v diag(s) Q with s_i = i^-alpha (normalized to mean square 1 / h per entry), Q orthogonal."""
    q, _ = torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64))
    s = torch.arange(1, h + 1, dtype=torch.float64) ** -alpha
    s = s / s.square().mean().sqrt() / math.sqrt(h)
    rows = torch.empty(v, h, dtype=torch.float32)
    for r0 in range(0, v, 16384):  # in chunks: [V, H] float64 temporaries would take gigabytes
        r1 = min(v, r0 + 16384)
        rows[r0:r1] = ((torch.randn(r1 - r0, h, generator=g, dtype=torch.float64) * s) @ q).float()
    return rows


def _weight(family: str, params: dict, v: int, h: int, rank: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    mu = _unit(torch.randn(h, generator=g))
    cos = params.get("cos", 0.0)
    c = math.sqrt(cos / (1.0 - cos) / h) if cos > 0 else 0.0  # |c mu|^2 / (|c mu|^2 + 1) = cos, rows of norm ~1
    if family == "isotropic":
        w = torch.randn(v, h, generator=g) / math.sqrt(h)
    elif family == "mean":
        w = torch.randn(v, h, generator=g) / math.sqrt(h) + c * math.sqrt(h) * mu
    elif family in ("spectrum", "freq_norms"):
        w = _spectrum_rows(v, h, params["alpha"], g) + c * math.sqrt(h) * mu
        if family == "freq_norms":
            w *= (1.0 / (1.0 + params["gamma"] * torch.log1p(rank))).float()[:, None]
    elif family == "rare_cluster":
        w = torch.randn(v, h, generator=g) / math.sqrt(h) + c * math.sqrt(h) * mu
        rare = rank >= params["frequent"] * v
        cluster = _unit(torch.randn(h, generator=g))
        n_rare = int(rare.sum())
        w[rare] = (0.35 * torch.randn(n_rare, h, generator=g) / math.sqrt(h) + params["spread"] * cluster
                   + c * math.sqrt(h) * mu)
    else:
        raise ValueError(f"unknown head family {family!r}")
    return w


def _row_scales(z0: torch.Tensor, target: torch.Tensor, iters: int = 40) -> torch.Tensor:
    """Per row s > 0 with entropy(softmax(s z0_row)) = target (bisection on log s; entropy falls as s grows)."""
    lo = torch.full((z0.shape[0],), -8.0, dtype=torch.float64)
    hi = torch.full((z0.shape[0],), 8.0, dtype=torch.float64)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        logp = torch.log_softmax(z0 * torch.exp(mid).float()[:, None], dim=1)
        ent = -(logp.exp() * logp).sum(dim=1).double()
        above = ent > target  # too flat: a larger scale
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return torch.exp(0.5 * (lo + hi))


def make_head(family: str, params: dict, t: int, h: int, v: int, seed: int) -> Head:
    """One head of the matrix (see the module's docstring); inputs rounded to bf16, the rest float32."""
    g = torch.Generator().manual_seed(seed)
    rank = _frequency_rank(v, g)
    w = _weight(family, params, v, h, rank, g)
    w[:, 0] = (-params.get("zipf", 1.0) * torch.log1p(rank)).float()
    w = w.to(torch.bfloat16)
    wf = w.float()
    # Targets drawn from the prior p ~ (1 + rank)^-1.1, hidden rows pulled toward them.
    prior = (1.0 + rank) ** -1.1
    target = torch.multinomial(prior / prior.sum(), t, replacement=True, generator=g)
    mean_w = wf[:, 1:].mean(dim=0)
    pull = params.get("pull", 0.7)
    h0 = torch.zeros(t, h)
    h0[:, 1:] = (pull * _unit(wf[target, 1:] - mean_w) + (1.0 - pull) * _unit(torch.randn(t, h - 1, generator=g)))
    h0[:, 1:] *= math.sqrt(h)  # logits of O(1) before the row's scale
    h0[:, 0] = 1.0
    entropy = (torch.empty(t, dtype=torch.float64).exponential_(1.0 / params.get("entropy", 0.7), generator=g)
               .clamp(0.01, 4.5))
    z0 = h0 @ wf.T
    scale = _row_scales(z0, entropy)
    del z0
    hidden = (h0 * scale.float()[:, None]).to(torch.bfloat16)
    z = hidden.float() @ wf.T
    ids = torch.multinomial(torch.softmax(z, dim=1), 1, generator=g).reshape(-1).to(torch.int32)
    del z
    return _finish(f"{family}" + "".join(f" {k}={p}" for k, p in params.items()), hidden, w, ids, g)


def _finish(name: str, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, g: torch.Generator) -> Head:
    n = hidden.shape[0]
    return Head(name, hidden.contiguous(), weight.contiguous(), ids.contiguous(), torch.ones(n),
                torch.randn(n, generator=g))


def read_head_file(path: str) -> Head:
    """A head written by scripts/export_trained_head.py (microbench/input_file.hpp's format), rounded to bf16."""
    import numpy as np

    with open(path, "rb") as f:
        if f.read(8) != b"GRPOIN01":
            raise ValueError(f"{path}: not a GRPOIN01 file")
        b, s, h, v, adv_count, _ = np.frombuffer(f.read(48), dtype="<i8")
        n = int(b * s)
        hidden = torch.from_numpy(np.fromfile(f, dtype="<f4", count=n * int(h)).reshape(n, int(h)).copy())
        weight = torch.from_numpy(np.fromfile(f, dtype="<f4", count=int(v) * int(h)).reshape(int(v), int(h)).copy())
        ids = torch.from_numpy(np.fromfile(f, dtype="<i4", count=n).copy())
        mask = torch.from_numpy(np.fromfile(f, dtype="<f4", count=n).copy())
        adv = torch.from_numpy(np.fromfile(f, dtype="<f4", count=int(adv_count)).copy())
    if adv.numel() != n:
        adv = adv.repeat_interleave(n // adv.numel())
    return Head(path.rsplit("/", 1)[-1], hidden.to(torch.bfloat16).contiguous(), weight.to(torch.bfloat16).contiguous(),
                ids.to(torch.int32).contiguous(), mask.contiguous(), adv.contiguous())


# The matrix: (family, params). Entropy means 0.5 / 1 nat, the range the user measured (medians 0.4-1.0).
MATRIX = [
    ("isotropic", {"entropy": 0.7}),
    ("mean", {"cos": 0.3, "entropy": 0.7}),
    ("mean", {"cos": 0.6, "entropy": 1.0}),
    ("spectrum", {"alpha": 0.5, "cos": 0.3, "entropy": 0.7}),
    ("spectrum", {"alpha": 1.0, "cos": 0.3, "entropy": 1.0}),
    ("spectrum", {"alpha": 1.0, "cos": 0.0, "entropy": 0.5, "pull": 0.9}),
    ("freq_norms", {"alpha": 0.5, "gamma": 0.1, "cos": 0.4, "entropy": 0.7}),
    ("rare_cluster", {"frequent": 0.05, "spread": 1.0, "cos": 0.2, "entropy": 0.7}),
    ("rare_cluster", {"frequent": 0.2, "spread": 2.0, "cos": 0.0, "entropy": 1.0, "pull": 0.9}),
]


# --------------------------------------------------------------------------
# The loss inputs, the float64 reference, the library's two steps
# --------------------------------------------------------------------------

def _off_the_kinks(logp: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """old_logp = logp + noise, with r = exp(-noise) moved KINK_MARGIN off 1 - eps_low and 1 + eps_high."""
    r = torch.exp(-noise.double())
    for edge in (1.0 - EPS_LOW, 1.0 + EPS_HIGH):
        near = (r - edge).abs() < KINK_MARGIN
        r = torch.where(near, edge + torch.sign(r - edge + 1e-12) * KINK_MARGIN * 2, r)
    return (logp.double() - torch.log(r)).float()


def reference(head: Head) -> dict:
    """float64: logits materialized, the grpo loss by autograd to c_t = dLoss/dlogp_t, then dz, dhidden, dW (and
    each row's entropy)."""
    h = head.hidden.double()
    w = head.weight.double()
    z = h @ w.T
    lse = torch.logsumexp(z, dim=1)
    rows = torch.arange(z.shape[0])
    logp = (z[rows, head.ids.long()] - lse).detach().requires_grad_()
    m = head.mask.double()
    a = head.advantages.double()
    log_r = (logp - head.old_logp.double()).clamp(-20.0, 20.0)
    r = torch.exp(log_r)
    policy = -torch.minimum(r * a, r.clamp(1.0 - EPS_LOW, 1.0 + EPS_HIGH) * a)
    d = head.ref_logp.double() - logp
    per_token = policy + BETA * (torch.exp(d) - d - 1.0)
    loss = (per_token * m).sum() / m.sum().clamp_min(1.0)  # grpo, one sequence: its masked mean
    (coef,) = torch.autograd.grad(loss, logp)
    p = torch.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(dim=1)
    del z
    dz = -coef[:, None] * p
    dz[rows, head.ids.long()] += coef
    del p
    return {"loss": float(loss.detach()), "logp": logp.detach(), "entropy": entropy, "dhidden": dz @ w,
            "dweight": dz.T @ h}


def _shape(head: Head):
    """The core API's shape of a head: one sequence of its rows, bf16, dense rows."""
    import grpo

    n, hd = head.hidden.shape
    shape = grpo.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = 1, n, hd, head.weight.shape[0]
    shape.dtype = grpo.DType.bf16
    shape.hidden_ld = shape.weight_ld = hd
    return shape


def run_step(head: Head, grad_filter: float, threads: Optional[int] = None, token_block: Optional[int] = None) -> dict:
    """The fused step through the core API: bf16 inputs, f32 gradients (what grpo-gradcheck measures)."""
    import grpo

    n, hd = head.hidden.shape
    v = head.weight.shape[0]
    config = grpo.LossConfig()
    config.loss_type = grpo.LossType.grpo
    config.epsilon_low, config.epsilon_high, config.beta = EPS_LOW, EPS_HIGH, BETA
    options = grpo.LmHeadOptions()
    options.dhidden_dtype = options.dweight_dtype = grpo.DType.f32
    options.grad_filter = grad_filter
    if threads:
        options.max_threads = threads
    if token_block:
        options.token_block = token_block
    plan = grpo.LmHeadLossPlan(_shape(head), config, options)
    logp = torch.empty(n)
    dhidden = torch.empty(n, hd)
    dweight = torch.empty(v, hd)
    stats = grpo.StepStats()
    metrics = plan.execute(None, hidden=head.hidden, weight=head.weight, ids=head.ids, mask=head.mask,
                           advantages=head.advantages, old_logp=head.old_logp, ref_logp=head.ref_logp, logp=logp,
                           dhidden=dhidden, dweight=dweight, stats=stats)
    return {"loss": metrics.loss, "entropy_mean": metrics.entropy_mean, "logp": logp, "dhidden": dhidden,
            "dweight": dweight, "stats": stats, "describe": plan.describe()}


def prepare_loss_inputs(head: Head, seed: int) -> Head:
    """old_logp / ref_logp from the step's own forward logp plus N(0, 0.3) (old kept off the clip edges)."""
    import grpo

    n = head.hidden.shape[0]
    options = grpo.LmHeadOptions()
    options.forward_only = True
    logp = torch.empty(n)
    grpo.LmHeadLossPlan(_shape(head), grpo.LossConfig(), options).execute(
        None, hidden=head.hidden, weight=head.weight, ids=head.ids, mask=head.mask, advantages=head.advantages,
        logp=logp)
    g = torch.Generator().manual_seed(seed + 7)
    head.old_logp = _off_the_kinks(logp, 0.3 * torch.randn(n, generator=g))
    head.ref_logp = (logp + 0.3 * torch.randn(n, generator=g)).float()
    return head


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def measure(head: Head, threads: Optional[int] = None, grad_filter: Optional[float] = None,
            token_block: Optional[int] = None) -> dict:
    """Exact and filtered error of dhidden and dW against the float64 reference, and what the filter left out."""
    import grpo

    ref = reference(head)
    exact = run_step(head, 0.0, threads, token_block)
    filtered = run_step(head, grpo.GRAD_FILTER_AUTO if grad_filter is None else grad_filter, threads, token_block)
    valid = head.mask > 0
    entropy = ref["entropy"]
    n, v = head.hidden.shape[0], head.weight.shape[0]
    st = filtered["stats"]
    return {
        "head": head.name, "tokens": n, "hidden": head.hidden.shape[1], "vocab": v,
        "entropy_mean": float(entropy[valid].mean()), "entropy_median": float(entropy[valid].median()),
        "loss_rel": abs(exact["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
        "loss_bitwise": exact["loss"] == filtered["loss"],
        "logp_max_abs": float((exact["logp"].double() - ref["logp"])[valid].abs().max()),
        "dhidden_exact": rel_l2(exact["dhidden"], ref["dhidden"]),
        "dhidden_filtered": rel_l2(filtered["dhidden"], ref["dhidden"]),
        "dweight_exact": rel_l2(exact["dweight"], ref["dweight"]),
        "dweight_filtered": rel_l2(filtered["dweight"], ref["dweight"]),
        "skipped_frac": st.dhidden_skipped_row_columns / max(1, st.dhidden_gemm_rows * v),
        "guard_blocks": st.filter_guard_blocks,
    }


def main(argv=None) -> int:
    from grpo.bench import cpu_model

    ap = argparse.ArgumentParser(prog="python -m grpo.head_families", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="512,1024,151936", help="T,H,V (default 512,1024,151936)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", default="", help="comma-separated indices into MATRIX (default: all; none: only "
                                                   "--head-file heads)")
    ap.add_argument("--head-file", action="append", default=[], help="also an exported head (GRPOIN01 file)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    t, h, v = (int(x) for x in args.shape.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.families == "none":
        picks = []
    else:
        picks = [int(i) for i in args.families.split(",")] if args.families else range(len(MATRIX))
    print(f"# CPU: {cpu_model()}; T={t} H={h} V={v} bf16, grpo beta {BETA}, f32 gradients; relative L2 vs float64")
    print(f"{'head':60s} {'ent mean/med':>12s} {'dh exact':>9s} {'dh filt':>9s} {'x':>5s} "
          f"{'dW exact':>9s} {'dW filt':>9s} {'x':>5s} {'skipped':>7s}")
    rows = []
    jobs = [(lambda i=i: make_head(MATRIX[i][0], MATRIX[i][1], t, h, v, args.seed + i)) for i in picks]
    jobs += [(lambda p=p: read_head_file(p)) for p in args.head_file]
    for job in jobs:
        t0 = time.time()
        head = prepare_loss_inputs(job(), args.seed)
        row = measure(head, args.threads)
        row["seconds"] = time.time() - t0
        rows.append(row)
        print(f"{row['head'][:60]:60s} {row['entropy_mean']:5.2f}/{row['entropy_median']:5.2f} "
              f"{row['dhidden_exact']:9.2e} {row['dhidden_filtered']:9.2e} "
              f"{row['dhidden_filtered'] / row['dhidden_exact']:5.2f} {row['dweight_exact']:9.2e} "
              f"{row['dweight_filtered']:9.2e} {row['dweight_filtered'] / row['dweight_exact']:5.2f} "
              f"{row['skipped_frac']:7.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "shape": [t, h, v], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
