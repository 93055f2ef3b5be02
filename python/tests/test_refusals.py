"""Refused arguments: an exception naming the argument, and nothing written."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import grpo
import grpo.torch as gt
from reference import make_case


def liger_args(case):
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    b = case.bias.clone().requires_grad_()
    return dict(_input=x, lin_weight=w, selected_token_ids=case.ids, attention_mask=case.mask,
                advantages=case.advantages, bias=b, ref_per_token_logps=case.ref_logp,
                old_per_token_logps=case.old_logp)


def mutate(args, name, value):
    out = dict(args)
    out[name] = value
    return out


@pytest.fixture
def case():
    return make_case(seed=11, loss_type="grpo")


def bad_inputs(case):
    a = liger_args(case)
    b, t, h = case.hidden.shape
    v = case.weight.shape[0]
    wide = torch.zeros(b, t, 2 * h)
    return [
        ("_input", mutate(a, "_input", torch.randn(b * t, h)), ValueError),  # not [B, T, H]
        ("_input", mutate(a, "_input", case.hidden.double()), TypeError),
        ("_input", mutate(a, "_input", torch.empty(b, t, h, device="meta")), ValueError),
        ("_input", mutate(a, "_input", wide[..., ::2]), ValueError),  # inner stride 2
        ("lin_weight", mutate(a, "lin_weight", torch.randn(v, h + 1)), ValueError),
        ("lin_weight", mutate(a, "lin_weight", case.weight.to(torch.bfloat16)), TypeError),
        ("lin_weight", mutate(a, "lin_weight", torch.randn(h, v).T), ValueError),  # column-major
        ("bias", mutate(a, "bias", torch.randn(v + 1)), ValueError),
        ("bias", mutate(a, "bias", torch.randn(v).double()), TypeError),  # float16 is taken (fp16 models)
        ("selected_token_ids", mutate(a, "selected_token_ids", case.ids.float()), TypeError),
        ("selected_token_ids", mutate(a, "selected_token_ids", case.ids[:, :-1]), ValueError),
        ("selected_token_ids", mutate(a, "selected_token_ids", torch.full_like(case.ids, v)), ValueError),
        ("selected_token_ids", mutate(a, "selected_token_ids", case.ids + (1 << 32)), ValueError),
        ("attention_mask", mutate(a, "attention_mask", case.mask * 0.5), ValueError),
        ("attention_mask", mutate(a, "attention_mask", torch.ones(b, t + 1)), ValueError),
        ("advantages", mutate(a, "advantages", torch.randn(b + 1)), ValueError),
        ("advantages", mutate(a, "advantages", torch.full((b,), float("nan"))), ValueError),
        ("old_per_token_logps", mutate(a, "old_per_token_logps", torch.randn(b, t, 1)), ValueError),
        ("ref_per_token_logps", mutate(a, "ref_per_token_logps", torch.empty(b, t, device="meta")), ValueError),
        ("ref_per_token_logps", mutate(a, "ref_per_token_logps", None), ValueError),
        ("vllm_is_ratio", mutate(a, "vllm_is_ratio", torch.ones(b, t, 2)), ValueError),
    ]


@pytest.mark.parametrize("index", range(21))
def test_module_refusal_names_argument_and_writes_nothing(case, index):
    name, args, error_type = bad_inputs(case)[index]
    module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo")
    weight = args["lin_weight"]
    sentinel = torch.full(weight.shape, 7.0, dtype=weight.dtype) if weight.requires_grad else None
    if sentinel is not None:
        weight.grad = sentinel.clone()
    with pytest.raises(error_type) as info:
        module(**args)
    assert name in str(info.value), str(info.value)
    assert getattr(info.value, "argument", name) == name
    inp = args["_input"]
    assert inp.grad is None
    if sentinel is not None:
        assert torch.equal(weight.grad, sentinel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device to make a CUDA tensor")
def test_cuda_tensor_refused(case):
    args = mutate(liger_args(case), "_input", case.hidden.cuda())
    with pytest.raises(ValueError, match="_input"):
        gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo")(**args)


@pytest.mark.parametrize("argument,kwargs", [
    ("delta", dict(loss_type="grpo", delta=1.1, epsilon_high=0.2)),
])
def test_unsupported_configuration(argument, kwargs):
    with pytest.raises(NotImplementedError, match=argument):
        gt.LmHeadGRPOLoss(**kwargs)


def test_drop_in_luspo_where_liger_sums_masked_positions_is_refused(case):
    """Liger 0.8.5's luspo with a KL term sums |o_i| l_t over masked positions too: refused, naming beta."""
    module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="luspo", importance_sampling_level="sequence")
    with pytest.raises(NotImplementedError) as info:
        module(**liger_args(case))
    assert info.value.argument == "beta"
    args = liger_args(case)
    args["vllm_is_ratio"] = torch.full(case.mask.shape, 2.0)
    module = gt.LmHeadGRPOLoss(beta=0.0, loss_type="luspo", importance_sampling_level="sequence")
    with pytest.raises(NotImplementedError) as info:
        module(**args)
    assert info.value.argument == "vllm_is_ratio"
    module = gt.LmHeadGRPOLoss(beta=0.0, loss_type="vespo")
    with pytest.raises(NotImplementedError) as info:
        module(**args)  # ratios of 2 on masked positions: Liger adds their log to log w, grpo does not
    assert info.value.argument == "vllm_is_ratio"


def _drop_in_refusal(case, module_kwargs, **call):
    module = gt.LmHeadGRPOLoss(**module_kwargs)
    args = liger_args(case)
    args.update(call)
    with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
        module(**args)
    return info.value


def test_refusals_name_the_callers_argument(case):
    """The four refusals issue 19 lists, each naming the argument as the caller spelled it."""
    error = _drop_in_refusal(case, dict(loss_type="sapo", sapo_temperature_neg=float("nan")))
    assert error.argument == "sapo_temperature_neg" and "sapo_temperature_neg" in str(error)
    b, t, h = case.hidden.shape
    empty = torch.zeros(0, t, h, requires_grad=True)
    error = _drop_in_refusal(case, dict(loss_type="grpo"), _input=empty, selected_token_ids=case.ids[:0],
                             attention_mask=case.mask[:0], advantages=case.advantages[:0],
                             ref_per_token_logps=case.ref_logp[:0], old_per_token_logps=case.old_logp[:0])
    assert error.argument == "_input", str(error)
    error = _drop_in_refusal(case, dict(loss_type="grpo", workspace_budget=-1))
    assert isinstance(error, grpo.Error) and error.argument == "workspace_budget", str(error)
    error = _drop_in_refusal(case, dict(loss_type="grpo", num_threads=-1))
    assert isinstance(error, grpo.Error) and error.argument == "num_threads", str(error)
    # The functional form names its own keywords.
    with pytest.raises(grpo.Error) as info:
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, loss_type="sapo",
                             sapo_temperature_pos=0.0)
    assert info.value.argument == "sapo_temperature_pos"
    with pytest.raises(grpo.Error) as info:
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, clip_ratio_c=0.5)
    assert info.value.argument == "clip_ratio_c"
    with pytest.raises(grpo.Error) as info:
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, kl_estimator="k4")
    assert info.value.argument == "kl_estimator"
    with pytest.raises(grpo.Error) as info:
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, token_block=-3)
    assert info.value.argument == "token_block"


_EXIT_WITH_PLANS = r"""
import torch, grpo, grpo.torch as gt
torch.manual_seed(0)
x = torch.randn(2, 5, 16).requires_grad_()
w = torch.randn(37, 16).requires_grad_()
ids, mask, adv = torch.randint(0, 37, (2, 5)), torch.ones(2, 5), torch.randn(2)
own = grpo.PlanCache()
kept = gt.lm_head_grpo_loss(x, w, ids, mask, adv, beta=0.0)  # its graph is alive at exit
gt.lm_head_grpo_loss(x, w, ids, mask, adv, plan_cache=own).loss.backward()
logp, ent = gt.fused_log_probs(x, w, None, ids)  # a log-prob graph too
print("ok")
"""


def test_interpreter_exit_reports_no_nanobind_leaks():
    run = subprocess.run([sys.executable, "-c", _EXIT_WITH_PLANS], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    assert "leaked" not in run.stderr, run.stderr


@pytest.mark.parametrize("argument", ["ref_input", "ref_weight", "ref_bias"])
def test_reference_model_inputs_not_implemented(case, argument):
    args = mutate(liger_args(case), "ref_per_token_logps", None)
    args[argument] = torch.zeros(1)
    with pytest.raises(NotImplementedError, match=argument):
        gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo")(**args)


def test_liger_value_checks():
    with pytest.raises(ValueError, match="sapo_temperature_pos"):
        gt.LmHeadGRPOLoss(sapo_temperature_pos=0.0)
    with pytest.raises(ValueError, match="max_completion_length"):
        gt.LmHeadGRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="Sequence-level"):
        gt.LmHeadGRPOLoss(loss_type="cispo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="Unknown loss type"):
        gt.LmHeadGRPOLoss(loss_type="ppo")


def test_library_config_refusal_names_liger_argument(case):
    module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo", temperature=-1.0)
    with pytest.raises(ValueError, match="temperature") as info:
        module(**liger_args(case))
    assert info.value.argument == "temperature"


def test_core_refusal_leaves_outputs_untouched():
    """The torch-free API: numpy outputs keep their contents when the library refuses."""
    shape = grpo.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = 2, 3, 8, 16
    plan = grpo.LmHeadLossPlan(shape, grpo.LossConfig(), grpo.LmHeadOptions())
    rng = np.random.default_rng(0)
    h = rng.standard_normal((6, 8), dtype=np.float32)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    ids = np.arange(6, dtype=np.int32)
    ids[4] = 16  # out of range on a valid row
    mask = np.ones(6, np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    logp = np.full(6, 3.0, np.float32)
    dh = np.full((6, 8), 5.0, np.float32)
    dw = np.full((16, 8), 5.0, np.float32)
    with pytest.raises(grpo.Error) as info:
        plan.execute(grpo.Workspace(), hidden=h, weight=w, ids=ids, mask=mask, advantages=adv, logp=logp, dhidden=dh,
                     dweight=dw)
    assert info.value.argument == "ids"
    assert (logp == 3.0).all() and (dh == 5.0).all() and (dw == 5.0).all()
    with pytest.raises(grpo.ArgumentTypeError) as info:
        plan.execute(None, hidden=h, weight=w, ids=ids.astype(np.int64), mask=mask, advantages=adv, logp=logp,
                     dhidden=dh, dweight=dw)
    assert info.value.argument == "ids"
    with pytest.raises(grpo.Error) as info:
        plan.execute(None, hidden=h[:, ::2], weight=w, ids=ids, mask=mask, advantages=adv, logp=logp, dhidden=dh,
                     dweight=dw)
    assert info.value.argument == "hidden"
    assert (logp == 3.0).all() and (dh == 5.0).all() and (dw == 5.0).all()
