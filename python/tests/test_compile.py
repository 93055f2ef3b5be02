"""grpo's entry points as real PyTorch ops (issue 49 item 3): torch.compile(fullgraph=True) and opcheck.

The modules below call the public entry points (the Liger drop-in, the
functional loss, the log-prob head with a loss written in torch, linear
cross entropy); compiled with fullgraph=True they must trace without a graph
break (fullgraph raises on one) and give the eager results bitwise: the loss,
the metrics and every gradient. torch.library.opcheck checks each op's
schema, fake kernel, autograd registration and AOT dispatch.
"""

import subprocess
import sys

import pytest
import torch

import grpo
import grpo.torch as gt
from reference import make_case

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])


class DropIn(torch.nn.Module):
    """A policy head whose loss is Liger's module (grpo's drop-in), as a trainer would hold it."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.loss = gt.LmHeadGRPOLoss(beta=0.04, loss_type="dapo", epsilon_high=0.28)

    def forward(self, hidden, ids, mask, adv, ref, old):
        loss, (kl, clip) = self.loss(hidden, self.weight, ids, mask, adv, ref_per_token_logps=ref,
                                     old_per_token_logps=old)
        return loss, kl, clip


class Functional(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, hidden, ids, mask, adv, ref, old):
        out = gt.lm_head_grpo_loss(hidden, self.weight, ids, mask, adv, bias=self.bias, ref_logp=ref, old_logp=old,
                                   beta=0.04, loss_type="grpo", return_entropy=True)
        return out.loss, out.per_token_logps, out.entropy, out.kl, out.metrics_tensor


class HeadAndTorchLoss(torch.nn.Module):
    """The generic head (four passes) with a loss written in torch: what TRL's loss code does on it."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, hidden, ids, mask, adv, ref, old):
        logp, entropy = gt.fused_log_probs(hidden, self.weight, None, ids, 0.7)
        ratio = torch.exp(logp - old)
        loss = -(torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * mask).sum() / mask.sum()
        return loss + 0.01 * (entropy * mask).sum(), entropy


class CrossEntropy(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, hidden, ids, mask, adv, ref, old):
        target = ids.masked_fill(mask == 0, -100)
        return (gt.linear_cross_entropy(hidden, self.weight, target),)


def build(kind, case):
    if kind == "drop_in":
        return DropIn(case.weight)
    if kind == "functional":
        return Functional(case.weight, case.bias)
    if kind == "head":
        return HeadAndTorchLoss(case.weight)
    return CrossEntropy(case.weight)


def run(module, case, hidden):
    x = hidden.clone().requires_grad_()
    outs = module(x, case.ids, case.mask, case.advantages, case.ref_logp, case.old_logp)
    outs[0].backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return [o.detach() for o in outs if o is not None], grads


# "head": the loss around the log-prob head is torch code, which inductor fuses into kernels of its own (their
# sums round differently from eager's, by an ulp): bitwise under aot_eager (the same aten ops, traced and run
# eagerly), and within float32 roundings under inductor.
@DTYPES
@pytest.mark.parametrize("kind,backend", [("drop_in", "inductor"), ("functional", "inductor"),
                                          ("cross_entropy", "inductor"), ("head", "aot_eager"),
                                          ("head", "inductor")])
def test_compiled_fullgraph_equals_eager_bitwise(kind, backend, dtype):
    torch._dynamo.reset()
    case = make_case(seed=61, dtype=dtype, b=2, t=9, h=32, v=75)
    module = build(kind, case)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    bitwise = not (kind == "head" and backend == "inductor")
    for step in range(2):  # the second call runs the compiled graph without tracing again
        hidden = case.hidden + step * 0.125
        want_outs, want_grads = run(module, case, hidden)
        got_outs, got_grads = run(compiled, case, hidden)
        for got, want in zip(got_outs + got_grads, want_outs + want_grads):
            assert got.dtype == want.dtype, f"{kind} step {step}"
            if bitwise:
                assert torch.equal(got, want), f"{kind} step {step}"
            else:
                torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def op_samples(dtype):
    case = make_case(seed=62, dtype=dtype, b=2, t=6, h=16, v=40)
    b, t, h = case.hidden.shape
    rows = case.hidden.reshape(b * t, h).clone().requires_grad_()
    weight = case.weight.clone().requires_grad_()
    bias = case.bias.clone().requires_grad_()
    return case, rows, weight, bias


def spec_of(**fields):
    return grpo._ops.make_spec(**fields)


@DTYPES
def test_opcheck_lm_head_loss(dtype):
    case, rows, weight, bias = op_samples(dtype)
    b, t = case.ids.shape
    config = {kw: None for kw in grpo._fields.LOSS_KEYWORDS}
    config.update(loss_type="dapo", importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2, beta=0.04,
                  kl_bias_correction=False, kl_estimator="k3", temperature=1.0, temperature_on_logp=False,
                  sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                  vespo_k_neg=3.0, vespo_lambda_neg=2.0, entropy_coef=0.0, top_entropy_quantile=1.0,
                  logit_scale=1.0)
    names = {k: k for k in ("hidden", "weight", "bias", "ids", "mask", "advantages", "old_logp", "ref_logp",
                            "is_weight", "num_items_in_batch", "loss_scale")}
    spec = spec_of(names=names, config=config, plan=dict(num_threads=1), batch=b, seq_len=t, grads=True,
                   frozen=False, dweight=True, dweight_dtype=str(dtype).removeprefix("torch."), entropy=True, kl=True,
                   loss_scale=0.5, cache=grpo.default_plan_cache().handle)
    args = (rows, weight, bias, case.ids, case.mask, case.advantages, case.old_logp, case.ref_logp, None, None,
            torch.tensor(11.0, dtype=torch.float64), spec)
    torch.library.opcheck(torch.ops.grpo.lm_head_loss.default, args)
    # Packed: the same rows as one row of b * t tokens in b sequences at their offsets.
    packed_spec = spec_of(names=names, config=config, plan=dict(num_threads=1), batch=1, seq_len=b * t, grads=True,
                          frozen=False, dweight=True, dweight_dtype=str(dtype).removeprefix("torch."), entropy=True,
                          kl=True, loss_scale=0.5, cache=grpo.default_plan_cache().handle)
    offsets = torch.arange(0, b * t + 1, t, dtype=torch.int64)
    torch.library.opcheck(torch.ops.grpo.lm_head_loss.default, args[:9] + (offsets,) + args[10:11] + (packed_spec,))


@DTYPES
def test_opcheck_log_probs_and_its_backward(dtype):
    case, rows, weight, bias = op_samples(dtype)
    n = rows.shape[0]
    names = {"hidden": "hidden", "weight": "weight", "bias": "bias", "ids": "labels", "mask": "mask"}
    spec = spec_of(names=names, temperature=0.7, temperature_on_logp=False, logit_softcap=None, logit_scale=1.0,
                   plan=dict(num_threads=1), forward_only=False, frozen=False,
                   dweight_dtype=str(dtype).removeprefix("torch."), entropy=True,
                   cache=grpo.default_plan_cache().handle)
    labels = case.ids.reshape(n)
    torch.library.opcheck(torch.ops.grpo.log_probs.default, (rows, weight, bias, labels, None, spec))
    dlogp, dent = torch.randn(n), torch.randn(n)
    torch.library.opcheck(torch.ops.grpo.log_probs_backward.default,
                          (rows.detach(), weight.detach(), bias.detach(), labels, None, dlogp, dent, spec, True, True,
                           True))


_EXIT = r"""
import torch
import grpo.torch as gt
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(40, 16))
loss = torch.nn.Module()
f = torch.compile(lambda x, ids, m, a: gt.LmHeadGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")(
    x, w, ids, m, a)[0], fullgraph=True)
x = torch.randn(2, 5, 16, requires_grad=True)
f(x, torch.randint(0, 40, (2, 5)), torch.ones(2, 5), torch.randn(2)).backward()
print("ok")
"""


def test_no_leaked_instances_at_exit_after_a_compiled_call():
    run = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("ok")
    assert "leaked" not in run.stderr, run.stderr
