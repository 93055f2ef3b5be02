"""The gradients of grpo.torch's fused loss: written by the kernel, scaled inside it, handed to autograd.

No float32 [V, H] buffer, dW in the weight's dtype (or in float32 for a
weight whose grad_dtype is float32), num_items_in_batch as the call's
gradient scale, gradient accumulation into an existing weight.grad by
AccumulateGrad (its hooks run), grad_output != 1, a second backward, zero_grad
between the forward and the backward, and nothing the caller owns written by
a call that is refused (issue 49 item 4).

Bounds. Both sides of every comparison below are the same kernel on the same
rows, so they differ only in where the results are rounded: each bf16
rounding moves an element by at most half an ulp, ubf / 2 = 2^-9 relative
(ubf = 2^-8, bf16's 8 significant bits), and each float32 one by 2^-25. A
comparison of a sum done as "round(round(a) + b)" against "round(round(a) +
round(b))" therefore differs by at most (|a| + |b|) u for u the unit
roundoff: we allow 2 u (|a| + |b|) plus one ulp of the smallest normal.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import grpo
import grpo.torch as gt
from reference import UBF, U32, make_case

UNIT = {torch.bfloat16: UBF, torch.float32: U32}


def within(got, want, parts, dtype, what):
    """|got - want| <= 2 u sum|parts| elementwise (see the module docstring)."""
    got, want = got.double(), want.double()
    scale = sum(p.double().abs() for p in parts)
    bound = 2 * UNIT[dtype] * scale + 1e-30
    excess = (got - want).abs() - bound
    assert float(excess.max()) <= 0, f"{what}: max excess {float(excess.max()):.3g} over the rounding bound"


def call(case, x, w, **kw):
    kw.setdefault("loss_type", "dapo")
    if kw["loss_type"] in ("dapo", "cispo", "vespo"):
        kw.setdefault("num_items_in_batch", 13)
    return gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, old_logp=case.old_logp,
                                ref_logp=case.ref_logp, beta=0.04, **kw)


def leaves(case):
    return case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()


def single_grads(case, **kw):
    x, w = leaves(case)
    call(case, x, w, **kw).loss.backward()
    return x.grad, w.grad


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


@DTYPES
def test_gradients_are_in_the_parameters_dtype_and_match_the_grpo_plan(dtype):
    """dapo's 1/num_items as the call's grad_scale: the same gradients as a plan built with the normalizer."""
    case = make_case(seed=31, dtype=dtype)
    dx, dw = single_grads(case, loss_type="dapo", num_items_in_batch=13)
    assert dx.dtype == dw.dtype == dtype
    # The plan with the real normalizer (entropy_coef != 0 forces it; a tiny
    # coefficient changes the gradient by far less than the bound, checked by
    # running it with 0 below as well).
    x, w = leaves(case)
    out = call(case, x, w, loss_type="dapo", num_items_in_batch=13, entropy_coef=1e-30)
    out.loss.backward()
    # c / 13 (the plan's normalizer, in double) and c * float(1/13) (the
    # call's scale, in float) differ by a couple of float32 ulps per row; a
    # gradient entry sums N such rows, so it moves by at most 4 u32 N max|g|,
    # plus the two final roundings (2 u |g|).
    n = case.mask.numel()
    for got, want, what in ((w.grad, dw, "dW"), (x.grad, dx, "dhidden")):
        diff = (got.double() - want.double()).abs()
        bound = 2 * UNIT[dtype] * want.double().abs() + 4 * U32 * n * float(want.double().abs().max())
        assert bool((diff <= bound).all()), f"{what} (grad_scale) vs (normalizer in the plan)"


def test_core_grad_scale_scales_every_gradient_and_is_bitwise_at_one():
    shape = grpo.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = 2, 3, 8, 16
    shape.has_bias = True
    plan = grpo.LmHeadLossPlan(shape, grpo.LossConfig(), grpo.LmHeadOptions())
    rng = np.random.default_rng(0)
    h = rng.standard_normal((6, 8), dtype=np.float32)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    bias = rng.standard_normal(16, dtype=np.float32)
    ids = rng.integers(0, 16, 6).astype(np.int32)
    mask = np.ones(6, np.float32)
    adv = np.array([1.0, -0.5], np.float32)

    def run(**kw):
        out = [np.zeros(6, np.float32), np.zeros((6, 8), np.float32), np.zeros((16, 8), np.float32),
               np.zeros(16, np.float32)]
        stats = grpo.StepStats()
        plan.execute(None, hidden=h, weight=w, bias=bias, ids=ids, mask=mask, advantages=adv, logp=out[0],
                     dhidden=out[1], dweight=out[2], dbias=out[3], stats=stats, **kw)
        return out, stats

    base, stats = run()
    same, _ = run(grad_scale=1.0)
    quarter, _ = run(grad_scale=0.25)
    for a, b in zip(base, same):
        assert np.array_equal(a, b)
    assert np.array_equal(quarter[0], base[0])  # logp is not scaled
    for a, b in zip(base[1:], quarter[1:]):
        # 0.25 is a power of two: the scaled coefficients, and so every
        # product and sum downstream, are exactly a quarter.
        assert np.array_equal(b, a * 0.25)
    assert stats.active_rows == 6 and stats.backward_gemm_rows == 32 and stats.kernel_s > 0
    with pytest.raises(grpo.Error) as info:
        run(grad_scale=float("inf"))
    assert info.value.argument == "grad_scale"


@DTYPES
def test_accumulation_into_grad_equals_the_sum_of_two_calls(dtype):
    """Two calls into one .grad (the kernel adds into it) vs two separate calls summed; the hooks still fire."""
    a = make_case(seed=32, dtype=dtype)
    b = make_case(seed=33, dtype=dtype)
    b.hidden, b.weight = b.hidden, a.weight  # one weight, two micro-batches
    dx_a, dw_a = single_grads(a)
    dx_b, dw_b = single_grads(b)

    x, w = leaves(a)
    post, node = [], []
    w.register_post_accumulate_grad_hook(lambda p: post.append(p.grad.clone()))
    accumulator = w.view_as(w).grad_fn.next_functions[0][0]  # w's AccumulateGrad node (DDP hooks it)
    accumulator.register_hook(lambda grad_inputs, grad_outputs: node.append(1))
    call(a, x, w).loss.backward()
    assert torch.equal(w.grad, dw_a)
    storage = w.grad.data_ptr()  # no reference held: AccumulateGrad may steal .grad back
    xb = b.hidden.clone().requires_grad_()
    out = call(b, xb, w)
    assert out.stats["active_rows"] > 0
    out.loss.backward()
    assert w.grad.data_ptr() == storage  # added in place: the same memory, no [V, H] temporary swapped in
    within(w.grad, dw_a.double() + dw_b.double(), [dw_a, dw_b], dtype, "accumulated dW")
    assert torch.equal(xb.grad, dx_b)
    assert len(post) == 2 and len(node) == 2  # AccumulateGrad and its hooks ran for both backwards
    assert torch.equal(post[1], w.grad)


@DTYPES
def test_grad_output_other_than_one(dtype):
    """(0.5 * loss).backward(): first call (fresh dW scaled in place) and an accumulating call (kernel reruns)."""
    case = make_case(seed=34, dtype=dtype)
    dx, dw = single_grads(case)
    x, w = leaves(case)
    (call(case, x, w).loss * 0.5).backward()
    within(w.grad, dw.double() * 0.5, [dw], dtype, "dW at grad_output 0.5")
    within(x.grad, dx.double() * 0.5, [dx], dtype, "dhidden at grad_output 0.5")
    first = w.grad.clone()
    x2 = case.hidden.clone().requires_grad_()
    (call(case, x2, w).loss * 3.0).backward()
    within(w.grad, first.double() + 3.0 * dw.double(), [first, dw, dw, dw], dtype, "accumulated dW at grad_output 3")
    within(x2.grad, 3.0 * dx.double(), [dx, dx, dx], dtype, "dhidden at grad_output 3")


@DTYPES
def test_second_backward_with_retain_graph(dtype):
    case = make_case(seed=35, dtype=dtype)
    dx, dw = single_grads(case)
    x, w = leaves(case)
    loss = call(case, x, w).loss
    loss.backward(retain_graph=True)
    with pytest.warns(RuntimeWarning, match="kernel again"):
        grpo._ops._rerun_warned = False
        loss.backward()
    within(w.grad, 2.0 * dw.double(), [dw, dw], dtype, "dW after two backwards")
    within(x.grad, 2.0 * dx.double(), [dx, dx], dtype, "dhidden after two backwards")


@DTYPES
def test_second_backward_without_retain_graph_raises(dtype):
    """As torch's own ops: the graph is freed after a backward without retain_graph, and a second backward raises
    and adds nothing (it used to run the kernel again and double the gradients)."""
    case = make_case(seed=36, dtype=dtype)
    x, w = leaves(case)
    loss = call(case, x, w).loss
    loss.backward()
    dw, dx = w.grad.clone(), x.grad.clone()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert torch.equal(w.grad, dw) and torch.equal(x.grad, dx)


@DTYPES
@pytest.mark.parametrize("how", ["set_to_none", "zero_"])
def test_zero_grad_between_forward_and_backward(dtype, how):
    """The common loop `loss = f(); opt.zero_grad(); loss.backward()`: the forward wrote nothing into .grad."""
    case = make_case(seed=36, dtype=dtype)
    _, dw = single_grads(case)
    x, w = leaves(case)
    w.grad = torch.full_like(w, 7.0)
    loss = call(case, x, w).loss
    if how == "set_to_none":
        w.grad = None
    else:
        w.grad.zero_()
    loss.backward()
    within(w.grad, dw, [dw], dtype, f"dW after zero_grad ({how}) between forward and backward")


def test_two_pending_calls_one_backward_count_each_call_once():
    """Two losses on one weight summed before one backward: each call's dW counted once."""
    a = make_case(seed=37)
    b = make_case(seed=38)
    b.weight = a.weight
    _, dw_a = single_grads(a)
    _, dw_b = single_grads(b)
    x, w = leaves(a)
    w.grad = torch.zeros_like(w)
    l1 = call(a, x, w).loss
    l2 = call(b, b.hidden.clone().requires_grad_(), w).loss
    (l1 + l2).backward()
    within(w.grad, dw_a.double() + dw_b.double(), [dw_a, dw_b], torch.float32, "dW of two pending calls")


def test_forward_writes_nothing_the_caller_owns():
    case = make_case(seed=39)
    x, w = leaves(case)
    w.grad = torch.ones_like(w)
    loss = call(case, x, w).loss
    assert torch.equal(w.grad, torch.ones_like(w)) and x.grad is None
    del loss  # dropped without backward: nothing to undo
    assert torch.equal(w.grad, torch.ones_like(w))
    loss = call(case, x, w).loss
    loss.backward()
    _, dw = single_grads(case)
    within(w.grad, 1.0 + dw.double(), [dw, torch.ones_like(dw)], torch.float32, "dW added into .grad")


@DTYPES
def test_a_refusal_met_late_in_the_step_leaves_every_gradient_as_it_was(dtype):
    """A k3 KL beyond float32 on the last row, met after earlier token blocks ran their backward: the call raises
    naming ref_logp, and an accumulated weight.grad / hidden.grad (earlier micro-batches) is untouched."""
    case = make_case(seed=47, dtype=dtype, t=48)
    case.ref_logp[-1, -1] = 120.0  # d = ref_logp - logp > 88.7 on the last row only
    case.mask[-1, -1] = 1.0
    x, w = leaves(case)
    w.grad = torch.full_like(w, 0.25)
    x.grad = torch.full_like(x, -0.5)
    before = (w.grad.clone(), x.grad.clone())
    with pytest.raises(grpo.Error) as info:
        call(case, x, w, token_block=16).loss.backward()
    assert info.value.argument == "ref_logp"
    assert torch.equal(w.grad, before[0]) and torch.equal(x.grad, before[1])


def test_tensor_hook_sees_this_calls_gradient_alone():
    """A weight with a register_hook hook gets a fresh dW (the hook must see this call's gradient, not .grad)."""
    case = make_case(seed=40)
    _, dw = single_grads(case)
    x, w = leaves(case)
    w.grad = torch.ones_like(w)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    call(case, x, w).loss.backward()
    assert torch.equal(seen[0], dw)
    within(w.grad, 1.0 + dw.double(), [dw, torch.ones_like(dw)], torch.float32, "dW with a tensor hook")


_PEAK = r"""
import ctypes, json, sys
import torch
import grpo.torch as gt

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def reset():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    return kib("VmRSS")

torch.manual_seed(0)
v, h, n = int(sys.argv[1]), int(sys.argv[2]), 64
x = torch.randn(1, n, h).bfloat16().requires_grad_()
w = (torch.randn(v, h) * 0.02).bfloat16().requires_grad_()
ids, mask, adv = torch.randint(0, v, (1, n)), torch.ones(1, n), torch.randn(1)
rises = []
for step in range(3):  # step 0: no .grad yet; steps 1, 2: gradient accumulation into it
    x.grad = None
    base = reset()
    out = gt.lm_head_grpo_loss(x, w, ids, mask, adv, loss_type="dapo", num_items_in_batch=3 * n)
    out.loss.backward()
    del out
    rises.append(kib("VmHWM") - base)
print(json.dumps({"rises_kib": rises, "grad_dtype": str(w.grad.dtype)}))
"""


def test_step_peak_rise_is_the_gradients_in_the_weights_dtype():
    """The whole step's own peak RSS rise (forward + backward), measured in a subprocess.

    Every step: the bf16 dW (V*H*2 bytes; the first step's becomes .grad, an
    accumulation step's is added into it by AccumulateGrad and freed) and the
    plan's workspace, never a float32 dW (V*H*4 bytes more)."""
    v, h = 32768, 2048
    run = subprocess.run([sys.executable, "-c", _PEAK, str(v), str(h)], check=True, capture_output=True, text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["grad_dtype"] == "torch.bfloat16"
    bf16_bytes, f32_bytes = v * h * 2, v * h * 4
    for step, rise in enumerate(r * 1024 for r in result["rises_kib"]):
        assert rise < f32_bytes, f"step {step}: rise {rise / 2**20:.0f} MiB holds a float32 [V, H]"
        if step == 0:
            assert 0.9 * bf16_bytes <= rise, f"first step rise {rise / 2**20:.0f} MiB"


def test_float32_grad_of_a_bf16_weight_is_accumulated_in_float32():
    """Mixed precision: a bf16 weight whose grad_dtype is float32 gets the kernel's float32 dW (no bf16 rounding),
    added into its float32 .grad in place."""
    case = make_case(seed=42, dtype=torch.bfloat16)
    _, dw = single_grads(case)
    x, w = leaves(case)
    w.grad_dtype = torch.float32  # torch 2.15 refuses a .grad of another dtype without it
    x2, w2 = leaves(case)
    w2.grad_dtype = torch.float32
    call(case, x2, w2).loss.backward()
    fresh = w2.grad
    assert fresh.dtype == torch.float32 and not torch.equal(fresh.to(torch.bfloat16).float(), fresh)
    w.grad = torch.zeros(w.shape, dtype=torch.float32)
    storage = w.grad.data_ptr()
    call(case, x, w).loss.backward()
    assert w.grad.dtype == torch.float32 and w.grad.data_ptr() == storage and torch.equal(w.grad, fresh)
    # The float32 dW rounds to the bf16 one (the same kernel, one rounding apart).
    within(w.grad.to(torch.bfloat16), dw, [dw], torch.bfloat16, "float32 .grad rounded vs bf16 dW")


def test_only_the_bias_trains():
    """weight.requires_grad False, bias True: the dW the kernel must write goes to scratch, dbias is returned."""
    case = make_case(seed=43)
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone()
    b = case.bias.clone().requires_grad_()
    out = gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, bias=b, old_logp=case.old_logp)
    out.loss.backward()
    assert w.grad is None and b.grad is not None and b.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


@DTYPES
def test_fused_log_probs_accumulates_into_grad(dtype):
    """The generic head's dW is added into an existing weight.grad (in place, by AccumulateGrad), hooks firing, equal
    to the sum of two separate calls within the rounding bound; on_stats sees the forward and the backward."""
    a = make_case(seed=44, dtype=dtype)
    b = make_case(seed=45, dtype=dtype)
    b.weight = a.weight

    def head_grads(case, w, x):
        logp, entropy = gt.fused_log_probs(x, w, None, case.ids)
        ((logp * case.mask * case.advantages.unsqueeze(-1)).sum() + 0.01 * entropy.sum()).backward()

    singles = []
    for case in (a, b):
        x, w = leaves(case)
        head_grads(case, w, x)
        singles.append(w.grad)
    x, w = leaves(a)
    fired, stats = [], []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    head_grads(a, w, x)
    storage = w.grad.data_ptr()
    logp, entropy = gt.fused_log_probs(b.hidden.clone().requires_grad_(), w, None, b.ids, on_stats=stats.append)
    ((logp * b.mask * b.advantages.unsqueeze(-1)).sum() + 0.01 * entropy.sum()).backward()
    assert w.grad.data_ptr() == storage and len(fired) == 2
    assert len(stats) == 2 and stats[1]["active_rows"] > 0 and stats[1]["kernel_s"] > 0  # forward, backward
    within(w.grad, singles[0].double() + singles[1].double(), singles, dtype, "head dW accumulated")
