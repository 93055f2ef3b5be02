"""fp16 models from Python (issue 48): torch.float16 hidden / weight / bias through every entry point.

The float64 comparisons of the loss are test_reference.py's (parametrized over float16, with the bounds of
reference.py: f32 dlogits, one fp16 rounding of each gradient); cross entropy's are test_cross_entropy.py's,
packed == padded test_packed.py's, the TRL trainer on an fp16 model test_trl.py's. Here: the log-prob head
(what the TRL patch and any torch-written loss call) against float64, the Liger drop-in, the mixed-precision
float32 .grad of an fp16 weight, the saturation of gradients past fp16's range (written as +-65504, counted,
warned about), and the refusals.
"""

import math
import warnings

import pytest
import torch

import grpo
import grpo.torch as gt
from reference import U16, U32, make_case, reference


def test_fused_log_probs_float16_matches_float64():
    """logp and entropy of fp16 operands: f32 logits of exact fp16 products, as the float64 reference's; the
    gradient through an upstream dL/dlogp within f32 dlogits plus one fp16 rounding."""
    g = torch.Generator().manual_seed(5)
    n, h, v = 23, 32, 150
    hidden = torch.randn(n, h, generator=g).to(torch.float16).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 2 / math.sqrt(h)).to(torch.float16).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    logp, ent = gt.fused_log_probs(hidden, weight, None, labels, outputs=("log_probs", "entropy"))
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    up = torch.randn(n, generator=g)
    (logp * up).sum().backward()

    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    z = hd @ wd.T
    lp = torch.log_softmax(z, -1)
    want = lp.gather(1, labels[:, None]).squeeze(1)
    want_ent = -(lp.exp() * lp).sum(-1)
    (want * up.double()).sum().backward()
    # Logits of depth h in f32: |dz| <= (h + 1) u32 sum|h_k w_k|; logp moves by twice that plus the LSE's v u32.
    absdot = (hd.abs() @ wd.abs().T).max(1).values.detach()
    e = 2 * (h + 1) * U32 * absdot + (v + 4) * U32 * (1 + z.abs().max(1).values.detach())
    assert torch.all((logp.double() - want.detach()).abs() <= e)
    assert torch.all((ent.double() - want_ent.detach()).abs() <= e * (2 + z.abs().max(1).values.detach()))
    for got, ref, other in ((hidden.grad, hd.grad, wd), (weight.grad, wd.grad, hd)):
        assert got.dtype == torch.float16
        # f32 dlogits and sums (relative to the largest entry), then one fp16 rounding of each entry.
        err = (got.double() - ref).abs()
        bound = 64 * U32 * float(ref.abs().max()) + U16 * ref.abs() + 2.0**-25
        assert torch.all(err <= bound), float((err / bound).max())


def test_liger_drop_in_float16():
    """The Liger-shaped module takes an fp16 head and gives fp16 gradients equal to the functional call's."""
    case = make_case(seed=17, dtype=torch.float16, loss_type="grpo", beta=0.04)
    b, t, h = case.hidden.shape
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo", use_ref_model=True, num_threads=1)
    loss, _ = module(x, w, case.ids, case.mask, case.advantages, bias=case.bias, ref_per_token_logps=case.ref_logp,
                     old_per_token_logps=case.old_logp)
    loss.backward()
    x2 = case.hidden.clone().requires_grad_()
    w2 = case.weight.clone().requires_grad_()
    out = gt.lm_head_grpo_loss(x2, w2, case.ids, case.mask, case.advantages, bias=case.bias,
                               old_logp=case.old_logp, ref_logp=case.ref_logp, beta=0.04, loss_type="grpo",
                               num_threads=1)
    out.loss.backward()
    assert x.grad.dtype == w.grad.dtype == torch.float16
    assert torch.equal(loss, out.loss) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_float32_grad_of_a_float16_weight():
    """Mixed precision: an fp16 weight whose grad_dtype is float32 gets the kernel's float32 dW, which rounds to
    the fp16 dW of the same step."""
    case = make_case(seed=42, dtype=torch.float16, loss_type="grpo")
    w16 = case.weight.clone().requires_grad_()
    gt.lm_head_grpo_loss(case.hidden, w16, case.ids, case.mask, case.advantages, bias=case.bias,
                         old_logp=case.old_logp, loss_type="grpo").loss.backward()
    w32 = case.weight.clone().requires_grad_()
    w32.grad_dtype = torch.float32
    gt.lm_head_grpo_loss(case.hidden, w32, case.ids, case.mask, case.advantages, bias=case.bias,
                         old_logp=case.old_logp, loss_type="grpo").loss.backward()
    assert w16.grad.dtype == torch.float16 and w32.grad.dtype == torch.float32
    assert torch.equal(w32.grad.to(torch.float16), w16.grad)


def test_gradients_past_the_float16_range_saturate_and_warn():
    """Advantages of 1e7 push dW and dhidden past 65504: the fp16 gradients hold +-65504 (never inf) where the
    float32 ones of the same step are beyond it, and the call warns with the count."""
    case = make_case(seed=8, dtype=torch.float16, loss_type="grpo")
    adv = case.advantages * 1e7

    def grads(grad_dtype):
        x = case.hidden.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        if grad_dtype is not None:
            w.grad_dtype = grad_dtype
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = gt.lm_head_grpo_loss(x, w, case.ids, case.mask, adv, bias=case.bias, old_logp=case.old_logp,
                                       loss_type="grpo")
            out.loss.backward()
        return w.grad, out.stats, [str(s.message) for s in seen if "65504" in str(s.message)]

    dw, stats, warned = grads(None)
    dw32, stats32, warned32 = grads(torch.float32)
    assert torch.isfinite(dw).all()
    past = dw32.abs() >= 65520
    assert bool(past.any()), "the advantages did not push dW past fp16's range"
    assert torch.equal(dw[past], torch.sign(dw32[past]).to(torch.float16) * 65504)
    assert stats["f16_saturated"] >= int(past.sum()) and warned and str(int(stats["f16_saturated"])) in warned[0]
    # The float32 dW does not saturate (the fp16 dhidden still may).
    assert torch.isfinite(dw32).all() and float(dw32.abs().max()) > 65504


def test_float16_refusals_name_the_argument():
    case = make_case(seed=1, dtype=torch.float16, loss_type="grpo")
    with pytest.raises(grpo.ArgumentTypeError, match="weight"):
        gt.lm_head_grpo_loss(case.hidden, case.weight.to(torch.bfloat16), case.ids, case.mask, case.advantages)
    with pytest.raises(grpo.UnsupportedError, match="grad_filter"):
        gt.lm_head_grpo_loss(case.hidden, case.weight.clone().requires_grad_(), case.ids, case.mask,
                             case.advantages, grad_filter="auto")
