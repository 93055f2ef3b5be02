"""grpo.torch.LmHeadGRPOLoss against Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss.

Same inputs through both modules (Liger with compiled=False: torch.compile
changes nothing numerically and costs minutes on CPU); loss, metrics and the
gradients of _input, lin_weight and bias must agree within the sum of the two
implementations' error bounds against the float64 reference (reference.py):
grpo's (f32 logits; bf16 dlogits in the bf16 path) plus Liger's (its bf16
matmul rounds the logits to bf16, and it accumulates bf16 gradients per
chunk). Ratios are kept away from the clip / cap / delta boundaries by more
than that error, so both take the same branch on every token.
"""

import math

import pytest
import torch

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")
LigerFusedLinearGRPOLoss = liger_grpo.LigerFusedLinearGRPOLoss

import grpo.torch as gt  # noqa: E402
from conftest import record_diff  # noqa: E402
from reference import UBF, U32, logp_error, make_case, reference  # noqa: E402

# (name, module kwargs, forward extras, case kwargs)
CASES = [
    ("grpo", dict(loss_type="grpo"), {}, {}),
    ("bnpo", dict(loss_type="bnpo"), {}, {}),
    ("dr_grpo", dict(loss_type="dr_grpo", max_completion_length=9), {}, {}),
    ("dapo", dict(loss_type="dapo"), {}, {}),
    ("dapo_num_items", dict(loss_type="dapo"), dict(num_items_in_batch=23), {}),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.1), dict(num_items_in_batch=torch.tensor(17.0)), {}),
    ("sapo", dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3), {}, {}),
    ("sequence_grpo", dict(loss_type="grpo", importance_sampling_level="sequence"), {}, {}),
    ("sequence_dapo_kl_corrected", dict(loss_type="dapo", importance_sampling_level="sequence",
                                        use_bias_correction_kl=True, beta=0.1), {}, {}),
    ("kl_corrected", dict(loss_type="bnpo", use_bias_correction_kl=True, beta=0.1), {}, {}),
    ("no_kl", dict(loss_type="grpo", beta=0.0), {}, {}),
    ("no_ref_model", dict(loss_type="grpo", use_ref_model=False), {}, {}),
    ("delta", dict(loss_type="grpo", delta=1.4, epsilon_low=0.1, epsilon_high=0.3), {}, {}),
    ("temperature", dict(loss_type="dapo", temperature=0.6), {}, {}),
    ("on_policy", dict(loss_type="grpo"), {}, dict(old=False)),
    ("vllm_is_ratio_tokens", dict(loss_type="dapo"), {}, dict(is_weight=(2, 5))),
    ("vllm_is_ratio_b1", dict(loss_type="grpo"), {}, dict(is_weight=(2, 1))),
    ("vllm_is_ratio_b", dict(loss_type="bnpo"), {}, dict(is_weight=(2,))),
    ("no_bias", dict(loss_type="dapo"), {}, dict(bias=False)),
    # luspo: Liger's (per_token_loss * |o_i|).sum() / (B * T') equals TRL's masked sum while the loss is one
    # per sequence (sequence level, no KL, one ratio per sequence); the drop-in refuses the rest.
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.0), {}, {}),
    ("luspo_vllm_is_ratio_b", dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.0), {},
     dict(is_weight=(2,))),
    ("luspo_no_ref_model", dict(loss_type="luspo", importance_sampling_level="sequence", use_ref_model=False), {},
     {}),
    ("vespo", dict(loss_type="vespo"), {}, {}),
    ("vespo_num_items", dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
     dict(num_items_in_batch=19), {}),
    ("vespo_vllm_is_ratio_b1", dict(loss_type="vespo", beta=0.0), {}, dict(is_weight=(2, 1))),
    ("vespo_on_policy", dict(loss_type="vespo"), {}, dict(old=False)),
]


def boundaries(kw):
    """Log-ratios where the loss changes branch (clip edges, cispo's cap, delta)."""
    lt = kw.get("loss_type", "dapo")
    if lt in ("sapo", "vespo"):  # no branch: a smooth gate / a detached weight
        return []
    if lt == "cispo":
        return [math.log(kw.get("epsilon_high", 0.2))]
    edges = [math.log(1 - kw.get("epsilon_low", 0.2)), math.log(1 + kw.get("epsilon_high", 0.2))]
    if kw.get("delta") is not None:
        edges.append(math.log(kw["delta"]))
    return edges


def build_case(name, kw, case_kw, dtype):
    # The reference only supplies logp (and the error bounds): its loss config is irrelevant here.
    config = dict(temperature=kw.get("temperature", 1.0))
    case = make_case(seed=sum(map(ord, name)), dtype=dtype, logit_scale=0.7, **case_kw, **config)
    ref = reference(case, need_grads=False)
    lp = ref["logp"].float()
    # Both implementations' logp error bounds, and a margin of twice their sum.
    margin = 2.0 * float((logp_error(ref, case) + logp_error(ref, case, logits_round=UBF)).max())
    g = torch.Generator().manual_seed(1)
    sequence = kw.get("importance_sampling_level") == "sequence"
    b, t = lp.shape
    d = 0.3 * torch.randn(b, 1 if sequence else t, generator=g)
    for edge in boundaries(kw):
        near = (d - edge).abs() < margin
        d = torch.where(near, edge + torch.sign(d - edge + 1e-9) * 2 * margin, d)
    if case.old_logp is not None:
        case.old_logp = lp - d.expand(b, t)
    return case


def run_module(module, case, dtype, forward_kw):
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    bias = case.bias.clone().requires_grad_() if case.bias is not None else None
    loss, metrics = module(x, w, case.ids, case.mask, case.advantages, bias, case.ref_logp, case.old_logp,
                           None, None, None, case.is_weight, **forward_kw)
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], x.grad, w.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,kw,forward_kw,case_kw", CASES, ids=[c[0] for c in CASES])
def test_matches_liger(name, kw, forward_kw, case_kw, dtype):
    case = build_case(name, kw, case_kw, dtype)
    ours = run_module(gt.LmHeadGRPOLoss(**kw), case, dtype, forward_kw)
    theirs = run_module(LigerFusedLinearGRPOLoss(compiled=False, **kw), case, dtype, forward_kw)
    tag = "f32" if dtype == torch.float32 else "bf16"

    # Tolerances. e: per-row bound on |logp - logp_ref| of grpo plus that of
    # Liger (bf16-rounded logits in the bf16 path); every other output moves
    # by at most a few e relative to its scale: p_v and the ratio r carry e
    # relatively, the coefficient c = dLoss/dlogp 2e (r and the KL's
    # exp(ref - logp)), dlogits = c (onehot - p) so 3e, and both sides err:
    # 8e covers it. Plus the output roundings: bf16 gradients are rounded once
    # by grpo and 2B + 1 times by Liger (per chunk, then accumulated in bf16).
    bf16 = dtype == torch.bfloat16
    ref = reference(case, need_grads=False)
    e = logp_error(ref, case) + logp_error(ref, case, logits_round=UBF if bf16 else 0.0)
    scale_c = float(max(theirs[0].abs(), 1e-3))

    record_diff(tag, "loss", ours[0], theirs[0])
    assert len(ours[1]) == len(theirs[1])
    names = (["kl_metric"] if len(theirs[1]) == 2 else []) + ["clip_ratio"]
    for metric_name, a, b in zip(names, ours[1], theirs[1]):
        record_diff(tag, metric_name, a, b)

    # Gradients: grpo's bound (f32 logits, bf16 dlogits in the bf16 path, one
    # final rounding) + Liger's (bf16 logits, f32 dlogits, bf16 gradients
    # accumulated over its B chunks: (2B + 1) roundings).
    b = case.hidden.shape[0]
    for idx, gname in ((2, "dhidden"), (3, "dweight"), (4, "dbias")):
        if theirs[idx] is None:
            assert ours[idx] is None
            continue
        record_diff(tag, gname, ours[idx], theirs[idx])
        diff = (ours[idx].double() - theirs[idx].double()).abs()
        # Relative to the largest gradient entry; f32 accumulation over V = 37
        # terms adds 64 * 37 u32 at most.
        rel = float(diff.max()) / max(float(theirs[idx].double().abs().max()), 1e-30)
        budget = 8 * float(e.max()) + (UBF * (2 * b + 2) if bf16 else 64 * U32 * 37)
        assert rel <= budget, f"{gname}: {rel:.3g} > {budget:.3g}"

    loss_tol = 8 * float(e.max()) * scale_c + (UBF if bf16 else 64 * U32) * scale_c + 1e-7
    assert abs(float(ours[0]) - float(theirs[0])) <= loss_tol, (float(ours[0]), float(theirs[0]), loss_tol)
    # Every token takes the same branch on both sides: the clip ratio is exact.
    assert float(ours[1][-1]) == pytest.approx(float(theirs[1][-1]), abs=1e-7)
    if len(theirs[1]) == 2:  # the KL metric: moves by |dKL/dlogp| e ~ (1 + KL) e per token
        assert abs(float(ours[1][0]) - float(theirs[1][0])) <= 8 * float(e.max()) * (1 + float(theirs[1][0])) + 1e-7
