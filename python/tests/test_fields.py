"""Every C++ LossConfig / LmHeadOptions field is reachable from Python (issue 19, item 5).

The C++ headers are read here directly (not through the binding), so a field
added in C++ and forgotten in python/src/grpo_module.cpp's declared lists, in
grpo/_fields.py's keyword table, or in lm_head_grpo_loss's signature fails
this test. Each field is then set through its keyword with a non-default
value, and the LossConfig / LmHeadOptions the plan is built from must carry
it, and the plan-cache key must change with it.
"""

import inspect
import os
import re

import pytest
import torch

import grpo
import grpo.torch as gt
from grpo import _fields
from reference import make_case

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def struct_fields(header: str, struct: str) -> list[str]:
    """The data members of `struct` in include/grpo/<header>: `type name = init;` or `type name;` lines."""
    with open(os.path.join(REPO, "include", "grpo", header)) as f:
        text = f.read()
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", text, re.S)
    assert body, f"struct {struct} not found in {header}"
    names = []
    for line in body.group(1).splitlines():
        line = line.split("//")[0].strip()
        m = re.match(r"^[A-Za-z_][\w:<>, *]*?\s+\*?([a-z_][a-z0-9_]*)\s*(=[^;]*)?;$", line)
        if m and "(" not in line:
            names.append(m.group(1))
    return names


def test_header_parser_sees_every_member():
    # A guard on the parser itself: members the headers certainly have.
    config = struct_fields("loss_config.hpp", "LossConfig")
    assert {"loss_type", "beta", "kl_estimator", "clip_ratio_c", "logit_scale"} <= set(config)
    options = struct_fields("lm_head_loss.hpp", "LmHeadOptions")
    assert {"token_block", "allocator", "scale_out", "frozen_weight"} <= set(options)


def test_every_loss_config_field_is_bound_and_has_a_keyword():
    header = struct_fields("loss_config.hpp", "LossConfig")
    assert list(grpo.LossConfig.fields) == header  # the binding's declared list, in the header's order
    keywords = inspect.signature(gt.lm_head_grpo_loss).parameters
    for field in header:
        assert field in _fields.LOSS_CONFIG, f"LossConfig.{field} has no keyword in grpo/_fields.py"
        keyword = _fields.LOSS_CONFIG[field][0]
        assert keyword in keywords, f"lm_head_grpo_loss has no keyword {keyword!r} for LossConfig.{field}"


def test_every_options_field_is_bound_or_declared_unbound():
    header = struct_fields("lm_head_loss.hpp", "LmHeadOptions")
    bound = set(grpo.LmHeadOptions.fields)
    unbound = set(grpo.LmHeadOptions.unbound_fields)
    assert bound | unbound == set(header) and not bound & unbound, sorted(set(header) ^ (bound | unbound))
    assert unbound == {"allocator", "scale_out"}  # no Python allocator; grpo::mpi has no binding
    keywords = inspect.signature(gt.lm_head_grpo_loss).parameters
    for field in bound:
        if field in _fields.OPTION_KEYWORDS:
            assert _fields.OPTION_KEYWORDS[field][0] in keywords
        else:
            assert field in _fields.OPTION_DERIVED, f"LmHeadOptions.{field}: neither a keyword nor derived"


# A non-default value per keyword, and the field value the config must then hold.
NON_DEFAULT = {
    "loss_type": ("bnpo", grpo.LossType.bnpo),
    "importance_sampling_level": ("sequence", grpo.IsLevel.sequence),
    "epsilon_low": (0.1, pytest.approx(0.1)),
    "epsilon_high": (0.3, pytest.approx(0.3)),
    "delta": (1.6, pytest.approx(1.6)),
    "beta": (0.05, pytest.approx(0.05)),
    "kl_bias_correction": (True, True),
    "kl_estimator": ("k3+", grpo.KlEstimator.k3_plus),
    "kl_clamp": (10.0, pytest.approx(10.0)),
    "temperature": (0.7, pytest.approx(0.7)),
    "temperature_on_logp": (True, True),
    "max_completion_length": (9, 9),
    "sapo_temperature_pos": (0.8, pytest.approx(0.8)),
    "sapo_temperature_neg": (1.3, pytest.approx(1.3)),
    "vespo_k_pos": (1.5, pytest.approx(1.5)),
    "vespo_lambda_pos": (2.5, pytest.approx(2.5)),
    "vespo_k_neg": (2.5, pytest.approx(2.5)),
    "vespo_lambda_neg": (1.5, pytest.approx(1.5)),
    "off_policy_mask_threshold": (0.5, pytest.approx(0.5)),
    "clip_ratio_c": (3.0, pytest.approx(3.0)),
    "entropy_coef": (0.01, pytest.approx(0.01)),
    "top_entropy_quantile": (0.5, pytest.approx(0.5)),
    "logit_softcap": (30.0, pytest.approx(30.0)),
    "logit_scale": (0.5, pytest.approx(0.5)),
    "num_items_in_batch": (None, None),  # set by lm_head_grpo_loss (the gradient scale): checked below
}


class _Captured(Exception):
    pass


@pytest.fixture
def capture(monkeypatch):
    """Replaces the plan class: records (shape, config, options) and stops the call."""
    seen = {}

    def fake(shape, config, options):
        seen.update(shape=shape, config=config, options=options)
        raise _Captured()

    monkeypatch.setattr(grpo._core, "LmHeadLossPlan", fake)
    return seen


def call(case, **kw):
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    try:
        gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, old_logp=case.old_logp,
                             ref_logp=case.ref_logp, plan_cache=grpo.PlanCache(), **kw)
    except _Captured:
        pass


@pytest.mark.parametrize("field", list(_fields.LOSS_CONFIG))
def test_each_keyword_reaches_its_config_field_and_the_plan_key(field, capture):
    keyword = _fields.LOSS_CONFIG[field][0]
    value, expected = NON_DEFAULT[keyword]
    case = make_case(seed=3)
    if field == "num_items_in_batch":
        # dapo: the plan's normalizer is 1 and 1 / num_items_in_batch is the
        # call's gradient scale; with an entropy bonus the plan carries it.
        call(case, loss_type="dapo", num_items_in_batch=40)
        assert capture["config"].num_items_in_batch == 1.0
        call(case, loss_type="dapo", num_items_in_batch=40, entropy_coef=0.01)
        assert capture["config"].num_items_in_batch == 40.0
        return
    call(case)
    default_config, default_options = capture["config"], capture["options"]
    call(case, **{keyword: value})
    assert getattr(capture["config"], field) == expected
    assert _fields.plan_key(capture["config"], capture["options"]) != _fields.plan_key(default_config,
                                                                                         default_options)


@pytest.mark.parametrize("keyword,field,value,expected", [
    ("token_block", "token_block", 64, 64), ("vocab_tile", "vocab_tile", 16, 16),
    ("workspace_budget", "workspace_budget", 1 << 20, 1 << 20), ("num_threads", "max_threads", 3, 3),
    ("grad_filter", "grad_filter", "auto", grpo.GRAD_FILTER_AUTO), ("grad_filter", "grad_filter", 0.25, 0.25)])
def test_each_options_keyword_reaches_its_field_and_the_plan_key(keyword, field, value, expected, capture):
    assert _fields.OPTION_KEYWORDS[field][0] == keyword
    case = make_case(seed=3)
    call(case)
    default_key = _fields.plan_key(capture["config"], capture["options"])
    call(case, **{keyword: value})
    assert getattr(capture["options"], field) == expected
    assert _fields.plan_key(capture["config"], capture["options"]) != default_key


@pytest.mark.parametrize("value", [None, False, "off", 0, 0.0])
def test_grad_filter_off_spellings_are_the_default_option(value, capture):
    case = make_case(seed=3)
    call(case)
    default_key = _fields.plan_key(capture["config"], capture["options"])
    call(case, grad_filter=value)
    assert capture["options"].grad_filter == 0.0
    assert _fields.plan_key(capture["config"], capture["options"]) == default_key


def test_derived_options_follow_the_tensors(capture):
    case = make_case(seed=3, dtype=torch.bfloat16)
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    w.grad = torch.zeros_like(w)
    try:
        gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, plan_cache=grpo.PlanCache())
    except _Captured:
        pass
    o = capture["options"]
    # grpo's ops are functional: never into an existing .grad (autograd adds their fresh gradients into it).
    assert (o.forward_only, o.frozen_weight, o.accumulate_weight_grads) == (False, False, False)
    assert o.dweight_dtype == o.dhidden_dtype == grpo.DType.bf16
    with torch.no_grad():
        try:
            gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, plan_cache=grpo.PlanCache())
        except _Captured:
            pass
    assert capture["options"].forward_only


def test_bound_kl_estimator_off_policy_mask_and_dual_clip_act():
    """The three fields issue 19 found unbound now change what the kernel computes, as the spec says."""
    case = make_case(seed=9)
    b, t = case.mask.shape
    m = case.mask.double()

    def run(**kw):
        x = case.hidden.clone().requires_grad_()
        out = gt.lm_head_grpo_loss(x, case.weight, case.ids, case.mask, case.advantages, old_logp=case.old_logp,
                                   ref_logp=case.ref_logp, **kw)
        out.loss.backward()
        return out, x.grad.reshape(b * t, -1)

    # kl_estimator k1: the per-token KL is d = logp - ref, and the grpo loss
    # moves by beta times the aggregated difference of the two KL terms.
    k3, _ = run(beta=0.1)
    k1, _ = run(beta=0.1, kl_estimator="k1")
    d = (k1.per_token_logps.double() - case.ref_logp.double()) * m
    assert torch.allclose(k1.kl.double() * m, d, atol=1e-6)
    per_seq = (((k1.kl - k3.kl).double() * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    assert float((k1.loss - k3.loss).detach()) == pytest.approx(0.1 * float(per_seq), abs=1e-6)

    # Off-policy sequence mask (threshold 0): a sequence with A < 0 whose
    # mean(old - logp) > 0 loses its policy term: with beta = 0, zero dhidden rows.
    plain, dh_plain = run()
    masked, dh_masked = run(off_policy_mask_threshold=0.0)
    lp = plain.per_token_logps.double()
    mean_gap = ((case.old_logp.double() - lp) * m).sum(-1) / m.sum(-1).clamp(min=1)
    dropped = (case.advantages < 0) & (mean_gap > 0)
    assert bool(dropped.any()) and bool((~dropped).any()), "seed 9 must drop one sequence and keep another"
    rows = dropped.repeat_interleave(t) & (case.mask.reshape(-1) != 0)
    assert bool((dh_masked[rows] == 0).all()) and bool((dh_plain[rows] != 0).any())
    assert torch.equal(dh_masked[~dropped.repeat_interleave(t)], dh_plain[~dropped.repeat_interleave(t)])

    # Dual-clip c = 1.01: a token with A < 0 and max(r, clip(r)) > c takes the
    # constant -A c branch: zero gradient there, where plain grpo has one.
    dual, dh_dual = run(clip_ratio_c=1.01)
    r = torch.exp(lp - case.old_logp.double())
    a = case.advantages.double().unsqueeze(1).expand(b, t)
    capped = ((a < 0) & (torch.maximum(r, r.clamp(0.8, 1.2)) > 1.01) & (m != 0)).reshape(-1)
    assert bool(capped.any())
    assert bool((dh_dual[capped] == 0).all()) and bool((dh_plain[capped] != 0).all())
