"""grpo.torch.linear_cross_entropy against torch 2.15's F.linear_cross_entropy and a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

import grpo
import grpo.torch as gt
from ops_seen import OpsSeen


def make(dtype, b=2, t=9, h=24, v=300, bias=True, ignore=-100, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, t, h, generator=g) * 1.5).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    bb = torch.randn(v, generator=g).to(dtype) if bias else None
    y = torch.randint(0, v, (b, t), generator=g)
    y[0, 2] = ignore
    y[1, 5] = ignore
    return x.reshape(b * t, h), w, bb, y.reshape(b * t)  # torch's op takes [N, H] inputs (grpo's also [*, H])


def grads(fn, x, w, bb, upstream=None):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    bb = None if bb is None else bb.detach().clone().requires_grad_()
    loss = fn(x, w, bb)
    (loss if upstream is None else (loss * upstream).sum()).backward()
    return loss.detach(), x.grad, w.grad, None if bb is None else bb.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_and_float64(dtype, reduction, bias):
    x, w, bb, y = make(dtype, bias=bias)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)) if reduction == "none" else None
    got = grads(lambda a, b, c: gt.linear_cross_entropy(a, b, y, linear_bias=c, reduction=reduction), x, w, bb,
                upstream)
    ref = grads(lambda a, b, c: F.linear_cross_entropy(a, b, y, linear_bias=c, reduction=reduction),
                x.double(), w.double(), None if bb is None else bb.double(), None if upstream is None else
                upstream.double())
    eager = F.linear_cross_entropy(x, w, y, linear_bias=bb, reduction=reduction)
    assert got[0].dtype == eager.dtype and got[0].shape == eager.shape
    # f32: the f32 tiled computation; bf16: f32 accumulation of bf16 inputs, gradients written in bf16 (2^-8);
    # f16: f32 dlogits, the loss and gradients written in fp16 (2^-11).
    loss_tol, grad_tol = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3)}.get(dtype, (1e-2, 2e-2))
    assert torch.allclose(got[0].double(), ref[0], rtol=loss_tol, atol=loss_tol), (got[0], ref[0])
    for name, a, r in zip(("input", "linear_weight", "linear_bias"), got[1:], ref[1:]):
        if r is None:
            continue
        err = (a.double() - r).norm() / r.norm()
        assert err < grad_tol, (name, float(err))
    if reduction == "none":
        assert bool((got[0][y == -100] == 0).all())


def test_ignore_index_and_module():
    x, w, bb, y = make(torch.float32, ignore=7)
    assert int((y == 7).sum()) >= 2  # make() set two rows to 7, the index this call ignores
    got = gt.LinearCrossEntropyLoss(ignore_index=7)(x, w, y, bb)
    want = F.linear_cross_entropy(x, w, y, linear_bias=bb, ignore_index=7)
    assert torch.allclose(got, want, rtol=1e-5)


def test_batched_input_as_hf_hidden_states():
    """[B, T, H] hidden states and [B, T] labels (what an HF model gives): the flattened call's result."""
    x, w, bb, y = make(torch.float32)
    got = gt.linear_cross_entropy(x.reshape(2, 9, 24), w, y.reshape(2, 9), linear_bias=bb, reduction="none")
    want = gt.linear_cross_entropy(x, w, y, linear_bias=bb, reduction="none")
    assert got.shape == (2, 9) and torch.equal(got.reshape(-1), want)


def test_three_gemm_passes_for_scalar_reductions():
    """mean / sum: the fused loss (gradients in the forward), no backward kernel call; none: the generic head."""
    x, w, bb, y = make(torch.float32)
    for reduction, expected in (("mean", ["lm_head_loss"]), ("sum", ["lm_head_loss"]),
                                ("none", ["log_probs", "log_probs_backward"])):
        a, b, c = (t.clone().requires_grad_() for t in (x, w, bb))
        with OpsSeen() as seen:
            gt.linear_cross_entropy(a, b, y, linear_bias=c, reduction=reduction).sum().backward()
        assert seen.calls == expected, reduction


def test_all_ignored_mean_is_nan_with_zero_gradients_as_torch():
    x, w, bb, y = make(torch.float32)
    y[:] = -100
    got = grads(lambda a, b, c: gt.linear_cross_entropy(a, b, y, linear_bias=c), x, w, bb)
    want = grads(lambda a, b, c: F.linear_cross_entropy(a, b, y, linear_bias=c), x, w, bb)
    assert torch.isnan(got[0]) and torch.isnan(want[0])
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b))


@pytest.mark.parametrize("kwargs,argument", [
    ({"weight": torch.ones(300)}, "weight"),
    ({"label_smoothing": 0.1}, "label_smoothing"),
    ({"reduction": "avg"}, "reduction"),
])
def test_unsupported_options_are_refused_by_name(kwargs, argument):
    x, w, bb, y = make(torch.float32)
    with pytest.raises((grpo.Error, NotImplementedError)) as info:
        gt.linear_cross_entropy(x, w, y, **kwargs)
    assert info.value.argument == argument and argument in str(info.value)


def test_bad_inputs_name_the_callers_argument():
    x, w, bb, y = make(torch.float32)
    bad = y.clone()
    bad[0] = 300  # out of [0, V) on a row that is not ignored
    with pytest.raises(grpo.Error) as info:
        gt.linear_cross_entropy(x, w, bad)
    assert info.value.argument == "target", info.value
    with pytest.raises(NotImplementedError) as info:
        gt.linear_cross_entropy(x, w, torch.softmax(torch.randn(18, 300), -1))
    assert info.value.argument == "target"
    with pytest.raises(grpo.Error) as info:
        gt.linear_cross_entropy(x, w.reshape(10, 30, 24), y)
    assert info.value.argument == "linear_weight"
    with pytest.raises((grpo.Error, TypeError)) as info:
        gt.linear_cross_entropy(x, w.to(torch.bfloat16), y)
    assert info.value.argument == "linear_weight", info.value
    with pytest.raises(grpo.Error) as info:
        gt.linear_cross_entropy(x, w, y[:4])
    assert info.value.argument == "target"
