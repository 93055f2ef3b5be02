"""grpo.torch.fused_log_probs against TRL 1.16's own ChunkedLogProbFunction (the primitive of add_fused_lm_head).

Random inputs (reference.py's make_case: hidden [2, 7, 16], weight [37, 16],
bias), a random upstream for both outputs (any loss of logp and entropy),
f32 and bf16, temperature 1 and 0.7. Tolerances, from reference.py's
bounds: per row e = grpo's logp error bound (f32 logits of depth H, an LSE
of V terms) + TRL's (the same, plus its logits rounded to bf16 in the bf16
path: logits_round = u_bf16); |dlogp| <= e, |dentropy| <= e (2 + max|x|).
Gradients, relative to their largest entry (as test_liger.py): dz = g
(onehot - p) / tau - h p (x - E_p x) / tau moves by p's relative error e
times |g| + |h| (|x - E x| + e): 8 e (1 + max|x|) covers both sides; plus
the roundings: bf16 dlogits on both sides and the bf16 gradient outputs (4
u_bf16), or the f32 accumulation over V terms (64 V u32).
"""

import pytest
import torch

trl_kernels = pytest.importorskip("trl.kernels")
ChunkedLogProbFunction = trl_kernels.ChunkedLogProbFunction

import grpo  # noqa: E402
import grpo.torch as gt  # noqa: E402
from reference import U32, UBF, logp_error, make_case, reference  # noqa: E402


def inputs(dtype, temperature, seed=11, bias=True):
    case = make_case(seed=seed, dtype=dtype, b=2, t=7, bias=bias, temperature=temperature)
    g = torch.Generator().manual_seed(seed + 1)
    n = case.ids.numel()
    up_logp = torch.randn(n, generator=g)
    up_ent = 0.5 * torch.randn(n, generator=g)
    return case, up_logp, up_ent


def run_grpo(case, temperature, up_logp, up_ent, outputs=("log_probs", "entropy")):
    h = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    b = case.bias.clone().requires_grad_() if case.bias is not None else None
    logp, ent = gt.fused_log_probs(h, w, b, case.ids, temperature, outputs)
    loss = (logp.reshape(-1) * up_logp).sum() + ((ent.reshape(-1) * up_ent).sum() if ent is not None else 0.0)
    loss.backward()
    return logp.reshape(-1).detach(), None if ent is None else ent.reshape(-1).detach(), h.grad.reshape(
        -1, h.shape[-1]), w.grad, None if b is None else b.grad


def run_trl(case, temperature, up_logp, up_ent, outputs=("log_probs", "entropy")):
    h = case.hidden.reshape(-1, case.hidden.shape[-1]).clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    b = case.bias.clone().requires_grad_() if case.bias is not None else None
    # chunk_size 16 < V = 37: TRL's vocabulary tiling is exercised.
    logp, ent, *_ = ChunkedLogProbFunction.apply(h, w, b, case.ids.reshape(-1), temperature, 16, None, 1.0, outputs)
    loss = (logp * up_logp).sum() + ((ent * up_ent).sum() if ent is not None else 0.0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_matches_trl_chunked_log_prob_function(dtype, temperature, record):
    bf16 = dtype == torch.bfloat16
    case, up_logp, up_ent = inputs(dtype, temperature)
    ours = run_grpo(case, temperature, up_logp, up_ent)
    theirs = run_trl(case, temperature, up_logp, up_ent)

    ref = reference(case, need_grads=False)
    e = logp_error(ref, case) + logp_error(ref, case, logits_round=UBF if bf16 else 0.0)
    xmax = ref["x"].abs().max(1).values
    tag = f"head {'bf16' if bf16 else 'f32'} T={temperature:g}"
    for idx, name, tol in ((0, "log_probs", e), (1, "entropy", e * (2.0 + xmax))):
        record(tag, name, ours[idx], theirs[idx])
        diff = (ours[idx].double() - theirs[idx].double()).abs()
        assert torch.all(diff <= tol), f"{name}: worst diff / bound {float((diff / tol).max()):.3g}"
    v = case.weight.shape[0]
    budget = 8 * float(e.max()) * (1.0 + float(xmax.max())) + (4 * UBF if bf16 else 64 * U32 * v)
    for idx, name in ((2, "grad hidden"), (3, "grad weight"), (4, "grad bias")):
        assert ours[idx].dtype == theirs[idx].dtype == dtype and ours[idx].shape == theirs[idx].shape
        record(tag, name, ours[idx], theirs[idx])
        diff = float((ours[idx].double() - theirs[idx].double()).abs().max())
        rel = diff / float(theirs[idx].double().abs().max())
        assert rel <= budget, f"{name}: {rel:.3g} > {budget:.3g}"


def test_entropy_without_upstream_and_log_probs_only():
    """An entropy used for logging only (no gradient), and outputs=("log_probs",): same gradients as TRL."""
    case, up_logp, _ = inputs(torch.float32, 1.0, seed=12)
    zero = torch.zeros_like(up_logp)
    a = run_grpo(case, 1.0, up_logp, zero, outputs=("log_probs",))
    b = run_trl(case, 1.0, up_logp, zero, outputs=("log_probs",))
    assert a[1] is None and b[1] is None
    for x, y in zip(a[2:], b[2:]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    h = case.hidden.clone().requires_grad_()
    logp, ent = gt.fused_log_probs(h, case.weight, case.bias, case.ids)
    (logp.reshape(-1) * up_logp).sum().backward()  # entropy's grad_output is None
    torch.testing.assert_close(h.grad.reshape(-1, h.shape[-1]), a[2], rtol=1e-6, atol=1e-7)


def test_frozen_weight_computes_no_dweight():
    case, up_logp, up_ent = inputs(torch.float32, 0.7, seed=13)
    full = run_grpo(case, 0.7, up_logp, up_ent)
    cache = grpo.PlanCache()
    h = case.hidden.clone().requires_grad_()
    logp, ent = gt.fused_log_probs(h, case.weight, case.bias, case.ids, 0.7, plan_cache=cache)
    ((logp.reshape(-1) * up_logp).sum() + (ent.reshape(-1) * up_ent).sum()).backward()
    assert torch.equal(h.grad.reshape(-1, h.shape[-1]), full[2])
    # A frozen head's plan has no dW / dbias (frozen_weight): no scratch buffer stands in for them.
    assert [k for k in cache._plans if k[0] == "scratch"] == []
    assert "frozen_weight" in next(p for k, p in cache._plans.items() if k[0] == "lm_head_log_prob").describe()


def test_mask_and_shapes():
    case, up_logp, up_ent = inputs(torch.float32, 1.0, seed=14)
    rows = case.hidden.reshape(-1, 16)
    a, ea = gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids)
    b, eb = gt.fused_log_probs(rows, case.weight, case.bias, case.ids.reshape(-1).to(torch.int32))
    assert a.shape == (2, 7) and b.shape == (14,) and a.dtype == torch.float32
    assert torch.equal(a.reshape(-1), b) and torch.equal(ea.reshape(-1), eb)
    mask = case.mask
    ids = case.ids.masked_fill(mask == 0, -100)
    c, ec = gt.fused_log_probs(case.hidden, case.weight, case.bias, ids, mask=mask)
    assert torch.all(c[mask == 0] == 0) and torch.equal(c[mask == 1], a[mask == 1])
    assert torch.equal(ec, ea)  # entropy is computed on masked rows too


def test_refusals():
    case, *_ = inputs(torch.float32, 1.0)
    with pytest.raises(grpo.Error) as info:
        gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids.masked_fill(case.mask == 0, -100))
    assert info.value.argument == "labels"
    with pytest.raises(grpo.Error, match="int32"):
        gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids + 2**31)
    with pytest.raises(NotImplementedError, match="is_top1"):
        gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids, outputs=("log_probs", "is_top1"))
    with pytest.raises(grpo.ArgumentTypeError):
        gt.fused_log_probs(case.hidden, case.weight.to(torch.bfloat16), case.bias, case.ids)
    with pytest.raises(grpo.Error) as info:
        gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids[:, :3])
    assert info.value.argument == "labels"
    with pytest.raises(grpo.Error) as info:
        gt.fused_log_probs(case.hidden, case.weight, case.bias, case.ids, temperature=0.0)
    assert info.value.argument == "temperature"


@pytest.mark.parametrize("softcap,scale", [(2.0, 1.3), (None, 0.7)], ids=["softcap", "scale"])
def test_logit_softcap_and_scale_match_trl(softcap, scale):
    """TRL's final_logit_softcapping / logit_scale arguments, f32: the same transform, the same gradients."""
    case, up_logp, up_ent = inputs(torch.float32, 0.8)
    h = case.hidden.reshape(-1, case.hidden.shape[-1])
    res = []
    for side in ("grpo", "trl"):
        hh = h.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        b = case.bias.clone().requires_grad_() if case.bias is not None else None
        if side == "grpo":
            logp, ent = gt.fused_log_probs(hh, w, b, case.ids.reshape(-1), 0.8, ("log_probs", "entropy"),
                                           logit_softcap=softcap, logit_scale=scale)
        else:
            logp, ent, *_ = ChunkedLogProbFunction.apply(hh, w, b, case.ids.reshape(-1), 0.8, 16, softcap, scale,
                                                         ("log_probs", "entropy"))
        ((logp.reshape(-1) * up_logp).sum() + (ent.reshape(-1) * up_ent).sum()).backward()
        res.append((logp.reshape(-1).detach(), ent.reshape(-1).detach(), hh.grad, w.grad))
    plain, _ = gt.fused_log_probs(h, case.weight, case.bias, case.ids.reshape(-1), 0.8)
    # The transform changes the values (so the comparison below could fail) ...
    assert float((plain.reshape(-1) - res[1][0]).abs().max()) > 1e-3
    # ... and both sides agree to f32 accuracy at V = 37 (|logp| and |entropy| <= ~5: 1e-5 is ~100 ulp).
    for i, name in enumerate(("log_probs", "entropy")):
        assert float((res[0][i] - res[1][i]).abs().max()) <= 1e-5, name
    for i, name in ((2, "grad hidden"), (3, "grad weight")):
        rel = float((res[0][i] - res[1][i]).abs().max()) / float(res[1][i].abs().max())
        assert rel <= 1e-5, f"{name}: {rel:.3g}"
