"""A float64 torch reference of grpo's LM-head GRPO loss, and error bounds.

It materializes the full logits (z = h W^T + b, [N, V]) in float64 and
follows README "What it computes" / SPEC.md literally with plain torch ops;
autograd gives the gradients. Nothing here shares code with the C++ kernel.

The bounds turn unit roundoffs into per-element tolerances (no tuned
constants):
  u32 = 2^-24 (float32), u16 = 2^-11 (float16, the bf16 path's x - max
  buffer), ubf = 2^-8 (bfloat16: 8 significant bits).
- logits: a depth-H float32 dot product errs by at most H * u32 * sum|h_i w_i|
  <= H * u32 * (max|h| max|W| H) (the classic gamma_H bound, used per row as
  H * u32 * (|h| @ |W|^T)); plus |b| u32 for the bias add; / tau.
- logp = x_y - LSE(x): twice the logit error, plus the LSE's sum of V
  exponentials (gamma_V relative error of S, i.e. V * u32 absolute in log S).
- dlogits dz = c/tau (onehot - p): p_v = exp(x_v - LSE) inherits the logp
  error relatively (|dp_v| <= p_v * dlogp), and c = dLoss/dlogp (through the
  ratio r = exp(logp - old)) inherits it too; in the bf16 path p is formed
  from an f16 copy of x - max (|x - max| * u16 more) and dz is rounded to
  bf16 (ubf relative). So |d dz_tv| <= |c_t|/tau * (p_tv + [v=y_t]) * 2 e_t
  + rel_round * |dz_tv|, where e_t is that row's logp-level error.
- dh = dz W, dW = dz^T h, db = sum dz: the propagated |d dz| through |W| /
  |h| / 1, plus the float32 accumulation gamma_depth * (|dz| @ |W|) etc.,
  plus the final rounding to the output dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

U32 = 2.0**-24
U16 = 2.0**-11
UBF = 2.0**-8
LOG_RATIO_CLAMP = 20.0


@dataclass
class Case:
    """One problem: inputs (hidden / weight / bias in their test dtype) and a grpo configuration."""

    hidden: torch.Tensor  # [B, T, H]
    weight: torch.Tensor  # [V, H]
    bias: Optional[torch.Tensor]
    ids: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] float32 0/1
    advantages: torch.Tensor  # [B] or [B, T]
    old_logp: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]
    is_weight: Optional[torch.Tensor]
    config: dict


def make_case(seed: int, dtype=torch.float32, b=2, t=5, h=16, v=37, bias=True, old=True, ref=True,
              is_weight=None, per_token_adv=False, logit_scale=1.0, **config) -> Case:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    # Logits of a realistic spread: std(z) ~ logit_scale * 1.5.
    weight = (torch.randn(v, h, generator=g) * (1.5 * logit_scale / math.sqrt(h))).to(dtype)
    bias_t = (torch.randn(v, generator=g) * 0.3).to(dtype) if bias else None
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    mask[0, t - 2:] = 0  # padding at the end of a sequence
    if b > 2:
        mask[2, :] = 0  # a sequence with no valid token
    adv = torch.randn((b, t) if per_token_adv else (b,), generator=g)
    # Reference logp of these inputs, to place old / ref near it: both clip
    # branches are reached (|logp - old| ~ 0.3 puts r in and out of [0.8, 1.2]).
    with torch.no_grad():
        lp = reference(Case(hidden, weight, bias_t, ids, mask, adv, None, None, None,
                            {**config, "beta": 0.0}), need_grads=False)["logp"].float()
    old_logp = lp + 0.3 * torch.randn(b, t, generator=g) if old else None
    ref_logp = lp + 0.2 * torch.randn(b, t, generator=g) if ref else None
    isw = None
    if is_weight is not None:
        isw = (0.5 + torch.rand(is_weight, generator=g))
    return Case(hidden, weight, bias_t, ids, mask, adv, old_logp, ref_logp, isw, config)


def reference(case: Case, need_grads: bool = True) -> dict:
    """Loss, per-token outputs, metrics and gradients in float64 (grpo's semantics)."""
    c = case.config
    loss_type = c.get("loss_type", "grpo")
    level = c.get("importance_sampling_level", "token")
    eps_lo, eps_hi = c.get("epsilon_low", 0.2), c.get("epsilon_high", 0.2)
    delta = c.get("delta")
    beta = c.get("beta", 0.0)
    bias_corr = c.get("kl_bias_correction", False)
    tau = c.get("temperature", 1.0)
    on_logp = c.get("temperature_on_logp", False)

    b, t, hdim = case.hidden.shape
    n = b * t
    h = case.hidden.double().reshape(n, hdim).clone().requires_grad_(need_grads)
    w = case.weight.double().clone().requires_grad_(need_grads)
    bias = case.bias.double().clone().requires_grad_(need_grads) if case.bias is not None else None
    z = h @ w.T + (bias if bias is not None else 0.0)
    if need_grads:
        z.retain_grad()
    ids = case.ids.reshape(n)
    m = case.mask.double().reshape(b, t)
    x = z if on_logp else z / tau
    lse = torch.logsumexp(x, dim=1)
    p = torch.softmax(x, dim=1)
    ent = lse - (p * x).sum(1)
    logp_all = x.gather(1, ids[:, None])[:, 0] - lse
    if on_logp:
        logp_all = logp_all / tau
    logp = torch.where(m.reshape(n) > 0, logp_all, torch.zeros_like(logp_all)).reshape(b, t)

    adv = case.advantages.double()
    a = adv[:, None].expand(b, t) if adv.dim() == 1 else adv
    old = case.old_logp.double() if case.old_logp is not None else logp.detach()
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "sequence":
        seq = (log_ratio * m).sum(1) / m.sum(1).clamp(min=1.0)
        log_ratio = torch.clamp(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None].expand(b, t)
    r = torch.exp(log_ratio)

    if loss_type == "cispo":
        per_token = -torch.clamp(r, max=eps_hi).detach() * a * logp
    elif loss_type == "sapo":
        k = torch.where(a > 0, torch.full_like(a, c.get("sapo_temperature_pos", 1.0)),
                        torch.full_like(a, c.get("sapo_temperature_neg", 1.05)))
        per_token = -a * (4.0 / k) * torch.sigmoid(k * (r - 1.0))
    else:
        rt = torch.clamp(r, max=delta) if delta is not None else r
        per_token = -torch.minimum(rt * a, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * a)
    if case.is_weight is not None:
        isw = case.is_weight.double()
        isw = isw.reshape(b, 1) if isw.numel() == b else isw.reshape(b, t)
        per_token = per_token * isw
    if need_grads:
        logp.retain_grad()
    kl = torch.zeros_like(logp)
    kl_sens = torch.zeros_like(logp)
    if beta != 0.0:
        d = case.ref_logp.double() - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + beta * (kl * r if bias_corr else kl)
        # How fast the KL's contribution to dLoss/dlogp moves with logp
        # (d/dlogp (1 - e^d) = e^d), per unit of aggregation weight.
        kl_sens = abs(beta) * (torch.exp(d) + 1.0 + kl) * (r if bias_corr else 1.0)
    if need_grads:
        per_token.retain_grad()

    valid = m.sum()
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1.0)).sum() / b
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / valid.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (b * c["max_completion_length"])
    else:  # dapo, cispo
        loss = (per_token * m).sum() / c["num_items_in_batch"]

    # The metrics as TRL logs them. kl: the term added (k3, times r under bias
    # correction). Clip ratios: cispo counts r > eps_high with A > 0 (TRL's
    # cispo_clip_ratio) in high and region; sequence-level IS with
    # per-sequence advantages counts sequences (fractions of B).
    rd = r.detach()
    if loss_type == "cispo":
        low_b = torch.zeros_like(rd, dtype=torch.bool)
        high_b = (rd > eps_hi) & (a > 0)
    else:
        low_b = (rd < 1 - eps_lo) & (a < 0)
        high_b = (rd > 1 + eps_hi) & (a > 0)
    denom = valid.clamp(min=1.0)
    if level == "sequence" and adv.dim() == 1:
        low, high, region = (f[:, :1].double() for f in (low_b, high_b, low_b | high_b))
        clip_denom = float(b)
    else:
        low, high, region = (f.double() * m for f in (low_b, high_b, low_b | high_b))
        clip_denom = denom
    if beta != 0.0 and bias_corr:
        kl = kl * r
    out = {
        "loss": loss.detach(),
        "logp": logp.detach(),
        "entropy": ent.detach().reshape(b, t),
        "kl": (kl * m).detach(),
        "metrics": {
            "clip_ratio_low": float(low.sum() / clip_denom),
            "clip_ratio_high": float(high.sum() / clip_denom),
            "clip_ratio_region": float(region.sum() / clip_denom),
            "kl_mean": float((kl.detach() * m).sum() / denom),
            "entropy_mean": float((ent.detach().reshape(b, t) * m).sum() / denom),
            "num_valid": int(valid),
        },
        "r": r.detach(),
        "x": x.detach(),
        "p": p.detach(),
        "h": h.detach(),
        "w": w.detach(),
    }
    if need_grads:
        loss.backward()
        out["dhidden"] = h.grad.reshape(b, t, hdim)
        out["dweight"] = w.grad
        out["dbias"] = bias.grad if bias is not None else None
        out["dz"] = z.grad
        out["c"] = logp.grad.reshape(n)
        out["kl_sens"] = (kl_sens.detach() * per_token.grad.abs()).reshape(n)
    return out


def logp_error(ref: dict, case: Case, logits_round: float = 0.0) -> torch.Tensor:
    """Per-row bound on |logp - logp_ref| of a float32-accumulating kernel.

    logits_round: an extra relative rounding of the logits (Liger's bf16
    matmul output), 0 for grpo (it accumulates and keeps logits in f32).
    """
    c = case.config
    tau = 1.0 if c.get("temperature_on_logp") else c.get("temperature", 1.0)
    tau_out = c.get("temperature", 1.0) if c.get("temperature_on_logp") else 1.0
    hdim = ref["h"].shape[1]
    v = ref["w"].shape[0]
    absdot = ref["h"].abs() @ ref["w"].abs().T  # [N, V]
    if case.bias is not None:
        absdot = absdot + case.bias.double().abs()
    zmax = absdot.max(1).values
    dz = ((hdim + 1) * U32 + logits_round) * zmax / tau  # per-row logit error bound
    xmax = ref["x"].abs().max(1).values
    return (2.0 * dz + (v + 4) * U32 * (1.0 + xmax)) / tau_out


def coefficient_bound(ref: dict, case: Case) -> torch.Tensor:
    """Per row: |c_t| = |dLoss/dlogp_t| plus how much the KL part of c_t moves per unit of logp error.

    The KL term's derivative 1 - exp(ref - logp) can nearly cancel the policy
    term's, so c's error is bounded from the sizes of its parts, not from |c|.
    """
    return ref["c"].abs() + ref["kl_sens"]


def grad_bounds(ref: dict, case: Case, *, bf16_path: bool, logits_round: float = 0.0,
                out_round: float = 0.0, out_abs: float = 0.0) -> dict:
    """Element-wise bounds on |grad - grad_ref| for dhidden, dweight, dbias."""
    tau = case.config.get("temperature", 1.0)
    e = logp_error(ref, case, logits_round)  # [N]
    if bf16_path:
        # p from the f16 copy of x - max: relative error u16 * |x - max|.
        e = e + U16 * (ref["x"].max(1).values - ref["x"].min(1).values)
    ids = case.ids.reshape(-1)
    onehot = torch.zeros_like(ref["p"]).scatter_(1, ids[:, None], 1.0)
    cabs = coefficient_bound(ref, case)
    # The coefficient moves with logp through r = exp(logp - old) (and the KL's
    # exp(ref - logp)): relative error <= e * (1 + beta * exp|ref - logp| / |c|) ~ 2e
    # for these inputs; counted as a factor 2 on e.
    # Sequence-level ratios mix every token's logp error into each c_t: use the
    # largest row error for the coefficient's part.
    ddz = (cabs / tau)[:, None] * (ref["p"] + onehot) * (2.0 * e + 2.0 * e.max())[:, None]
    dz = ref["dz"].abs()
    round_rel = (UBF if bf16_path else U32)
    ddz = ddz + round_rel * dz
    n, v = dz.shape
    absw, absh = ref["w"].abs(), ref["h"].abs()
    bounds = {
        "dhidden": (ddz @ absw + (v + 2) * U32 * (dz @ absw)),
        "dweight": (ddz.T @ absh + (n + 2) * U32 * (dz.T @ absh)),
        "dbias": (ddz.sum(0) + (n + 2) * U32 * dz.sum(0)),
    }
    b, t, hdim = case.hidden.shape
    bounds["dhidden"] = bounds["dhidden"].reshape(b, t, hdim)
    refs = {"dhidden": ref["dhidden"], "dweight": ref["dweight"], "dbias": ref["dbias"]}
    for k in bounds:
        if refs[k] is not None:
            # The output's own rounding (to bf16 / fp16 when the parameter is), and
            # fp16's absolute step near 0 (out_abs: half its subnormal spacing).
            bounds[k] = bounds[k] + out_round * refs[k].abs() + out_abs + 1e-30
    return bounds
