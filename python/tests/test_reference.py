"""grpo.torch.lm_head_grpo_loss against the float64 reference (tests/reference.py).

Tiny shapes, every option; tolerances are the bounds derived in reference.py.
"""

import math
import zlib

import pytest
import torch

import grpo
import grpo.torch as gt
from reference import grad_bounds, logp_error, make_case, reference, coefficient_bound, U32

WORST = {}  # largest error / bound seen, per gradient and dtype

CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=7),
    "dapo": dict(loss_type="dapo", num_items_in_batch=11.0),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1, num_items_in_batch=11.0),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2),
    "sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "sequence_kl_corrected": dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04,
                                  kl_bias_correction=True, num_items_in_batch=9.0),
    "delta": dict(loss_type="grpo", delta=1.3, epsilon_high=0.25, epsilon_low=0.15),
    "kl": dict(loss_type="bnpo", beta=0.04),
    "kl_corrected": dict(loss_type="grpo", beta=0.1, kl_bias_correction=True),
    "temperature": dict(loss_type="grpo", temperature=0.7),
    "temperature_on_logp": dict(loss_type="grpo", temperature=0.7, temperature_on_logp=True),
    "on_policy": dict(loss_type="grpo", _case=dict(old=False)),
    "is_weight_tokens": dict(loss_type="dapo", num_items_in_batch=8.0, _case=dict(is_weight=(2, 5))),
    "is_weight_sequences": dict(loss_type="grpo", _case=dict(is_weight=(2,))),
    "per_token_advantages": dict(loss_type="bnpo", _case=dict(per_token_adv=True)),
    "no_bias": dict(loss_type="grpo", beta=0.04, _case=dict(bias=False)),
    "empty_sequence": dict(loss_type="grpo", _case=dict(b=3)),
}


def run(case, dtype, requires_grad=True, **kw):
    hidden = case.hidden.clone().requires_grad_(requires_grad)
    weight = case.weight.clone().requires_grad_(requires_grad)
    bias = case.bias.clone().requires_grad_(requires_grad) if case.bias is not None else None
    result = gt.lm_head_grpo_loss(hidden, weight, case.ids, case.mask, case.advantages, bias=bias,
                                  old_logp=case.old_logp, ref_logp=case.ref_logp, is_weight=case.is_weight,
                                  return_entropy=True, **{**case.config, **kw})
    if result.loss.requires_grad:
        result.loss.backward()
    return result, hidden, weight, bias


def check_against_reference(case, dtype, result, hidden, weight, bias):
    ref = reference(case)
    bf16 = dtype == torch.bfloat16
    e = logp_error(ref, case)
    m = case.mask.bool()
    tol_logp = e.reshape(case.mask.shape)
    assert torch.all((result.per_token_logps.double() - ref["logp"]).abs() <= tol_logp), "logp"
    assert torch.all(result.per_token_logps[~m] == 0), "masked logp"
    # Entropy = LSE - sum p x: the LSE's error plus p's relative error times |x|.
    xmax = ref["x"].abs().max(1).values.reshape(case.mask.shape)
    tol_ent = tol_logp * (2.0 + xmax)
    assert torch.all((result.entropy.double() - ref["entropy"]).abs() <= tol_ent), "entropy"
    # The loss moves by sum_t |c_t| e_t (c_t = dLoss/dlogp_t), twice for the
    # ratio's dependence on logp; plus its own f32/f64 accumulation.
    cabs = coefficient_bound(ref, case)
    tol_loss = 2.0 * float((cabs * e).sum()) + 64 * U32 * abs(float(ref["loss"])) + 1e-12
    assert abs(float(result.loss.detach()) - float(ref["loss"])) <= tol_loss, (float(result.loss.detach()), float(ref["loss"]), tol_loss)
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "num_valid"):
        assert result.metrics[name] == pytest.approx(ref["metrics"][name], abs=1e-12), name
    valid = max(ref["metrics"]["num_valid"], 1)
    if case.config.get("beta", 0.0) != 0.0:
        # d kl / d logp: |1 - e^d| for k3 (d = ref - logp); under bias correction
        # (kl r)' = (k3' + k3) r. Both bounded by (e^d + 1 + k3) r, times e.
        d = case.ref_logp.double() - ref["logp"]
        k3 = torch.exp(d) - d - 1.0
        r = ref["r"] if case.config.get("kl_bias_correction") else torch.ones_like(d)
        dkl = ((torch.exp(d) + 1.0 + k3) * r).reshape(-1)
        tol_kl = float((dkl * e * 2.0).max()) + 1e-12
        assert torch.all((result.kl.double() - ref["kl"]).abs() <= tol_kl + 8 * U32 * ref["kl"].abs()), "kl"
        assert abs(result.metrics["kl_mean"] - ref["metrics"]["kl_mean"]) <= tol_kl, "kl_mean"
    assert abs(result.metrics["entropy_mean"] - ref["metrics"]["entropy_mean"]) <= float(tol_ent.max()), "entropy_mean"

    # The bf16 path rounds dlogits to bf16; the gradients of bf16 parameters
    # are rounded to bf16 at the end. The fp16 path keeps f32 dlogits and
    # rounds the fp16 gradients once (2^-11 relative, 2^-25 near 0).
    f16 = dtype == torch.float16
    out_round = 2.0**-8 if bf16 else 2.0**-11 if f16 else 0.0
    bounds = grad_bounds(ref, case, bf16_path=bf16, out_round=out_round, out_abs=2.0**-25 if f16 else 0.0)
    grads = {"dhidden": hidden.grad, "dweight": weight.grad, "dbias": None if bias is None else bias.grad}
    for name, got in grads.items():
        if ref[name] is None:
            continue
        assert got is not None, name
        assert got.dtype == dtype, name
        err = (got.double() - ref[name]).abs()
        worst = float((err / bounds[name]).max())
        WORST[(name, str(dtype))] = max(WORST.get((name, str(dtype)), 0.0), worst)
        assert worst <= 1.0, f"{name}: error / bound = {worst:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_reference(name, dtype):
    config = dict(CASES[name])
    case_kw = config.pop("_case", {})
    case = make_case(seed=zlib.crc32(name.encode()) % 1000, dtype=dtype, **case_kw, **config)
    result, hidden, weight, bias = run(case, dtype)
    check_against_reference(case, dtype, result, hidden, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_row_strides_are_viewed_in_place(dtype):
    """hidden and weight as column slices of wider tensors (a row stride > H): no copy, same answer."""
    case = make_case(seed=7, dtype=dtype, loss_type="grpo", beta=0.04)
    b, t, h = case.hidden.shape
    wide_hidden = torch.zeros(b, t, h + 7, dtype=dtype)
    wide_hidden[..., :h] = case.hidden
    wide_weight = torch.zeros(case.weight.shape[0], h + 5, dtype=dtype)
    wide_weight[:, :h] = case.weight
    hidden = wide_hidden[..., :h].requires_grad_(False)
    weight = wide_weight[:, :h]
    assert hidden.reshape(-1, h).data_ptr() == wide_hidden.data_ptr()  # a view, not a copy
    hidden_leaf = hidden.detach().requires_grad_(True)
    weight_leaf = weight.detach().requires_grad_(True)
    bias = case.bias.clone().requires_grad_(True)
    result = gt.lm_head_grpo_loss(hidden_leaf, weight_leaf, case.ids, case.mask, case.advantages, bias=bias,
                                  old_logp=case.old_logp, ref_logp=case.ref_logp, return_entropy=True,
                                  **case.config)
    result.loss.backward()
    check_against_reference(case, dtype, result, hidden_leaf, weight_leaf, bias)
    # The plan was built for these strides.
    plans = [k for k in grpo.default_plan_cache()._plans if k[1][6:8] == (h + 7, h + 5)]
    assert plans


def test_grad_output_scales_gradients():
    case = make_case(seed=3, loss_type="dapo", num_items_in_batch=5.0)
    result, hidden, weight, bias = run(case, torch.float32)
    g1 = (hidden.grad.clone(), weight.grad.clone(), bias.grad.clone())
    hidden2 = case.hidden.clone().requires_grad_()
    weight2 = case.weight.clone().requires_grad_()
    bias2 = case.bias.clone().requires_grad_()
    r2 = gt.lm_head_grpo_loss(hidden2, weight2, case.ids, case.mask, case.advantages, bias=bias2,
                              old_logp=case.old_logp, **case.config)
    (r2.loss * -2.5).backward()
    for a, b in zip(g1, (hidden2.grad, weight2.grad, bias2.grad)):
        torch.testing.assert_close(b, a * -2.5, rtol=2 * U32, atol=0)


def test_forward_only_under_no_grad():
    case = make_case(seed=4, loss_type="bnpo")
    with torch.no_grad():
        result, *_ = run(case, torch.float32, requires_grad=True)
    assert result.loss.grad_fn is None
    ref = reference(case, need_grads=False)
    assert abs(float(result.loss.detach()) - float(ref["loss"])) < 1e-5
