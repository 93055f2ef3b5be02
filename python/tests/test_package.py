"""The package itself: version, torch independence, plan cache, threads."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import grpo
import grpo.torch as gt
from reference import make_case

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_is_the_cmake_project_version():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(grpo\s+VERSION\s+([0-9.]+)", f.read()).group(1)
    assert grpo.__version__ == cmake_version
    assert grpo.version() == cmake_version  # the linked C++ library
    assert importlib.metadata.version("grpo") == cmake_version  # the installed distribution


def test_core_package_does_not_import_torch():
    code = "import sys, grpo; assert 'torch' not in sys.modules, 'grpo imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_api_on_numpy():
    shape = grpo.LmHeadShape()
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = 1, 4, 8, 12
    config = grpo.LossConfig()
    config.loss_type = grpo.LossType.bnpo
    options = grpo.LmHeadOptions()
    options.forward_only = True
    plan = grpo.LmHeadLossPlan(shape, config, options)
    h = np.zeros((4, 8), np.float32)  # all-equal logits: logp = -log V
    w = np.ones((12, 8), np.float32)
    logp = np.zeros(4, np.float32)
    m = plan.execute(None, hidden=h, weight=w, ids=np.arange(4, dtype=np.int32), mask=np.ones(4, np.float32),
                     advantages=np.ones(1, np.float32), logp=logp)
    np.testing.assert_allclose(logp, -np.log(12), rtol=1e-6)
    assert m.num_valid == 4
    assert abs(m.entropy_mean - np.log(12)) < 1e-5


def test_training_loop_reuses_plans_and_workspace():
    """dapo with a num_items_in_batch that changes every step and gradients accumulating in .grad: one plan, one
    workspace allocation (num_items_in_batch is the call's gradient scale, not part of the plan)."""
    cache = grpo.PlanCache()
    module = gt.LmHeadGRPOLoss(loss_type="dapo", beta=0.04, plan_cache=cache)
    case = make_case(seed=5)
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    for step in range(4):
        loss, _ = module(x, w, case.ids, case.mask, case.advantages, None, case.ref_logp, case.old_logp,
                         num_items_in_batch=10 + step)
        loss.backward()
        if step == 0:
            allocations = cache.workspace.allocations
    assert cache.builds == 1 and len(cache) == 1
    assert cache.workspace.allocations == allocations == 1


def test_threads_follow_torch():
    cache = grpo.PlanCache()
    case = make_case(seed=6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, plan_cache=cache)
        assert "threads=1" in next(iter(cache._plans.values())).describe()
    finally:
        torch.set_num_threads(before)
    cache.clear()
    gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, plan_cache=cache,
                         num_threads=1)
    assert "threads=1" in next(iter(cache._plans.values())).describe()


def test_zero_copy_inputs_and_gradient_dtypes():
    case = make_case(seed=8, dtype=torch.bfloat16)
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    b = case.bias.clone().requires_grad_()
    loss, metrics = gt.LmHeadGRPOLoss(loss_type="grpo")(x, w, case.ids, case.mask, case.advantages, b,
                                                         case.ref_logp, case.old_logp)
    loss.backward()
    assert loss.dtype == torch.float32 and len(metrics) == 2
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_frozen_lm_head_skips_dweight_and_keeps_dhidden_bitwise():
    """A head whose weight and bias want no gradient (LoRA) gets a frozen_weight plan: no dW, the same dhidden."""
    case = make_case(seed=21, dtype=torch.bfloat16, b=2, t=40, h=32, v=300)
    cache = grpo.PlanCache()

    def grpo_loss(trainable):
        x = case.hidden.clone().requires_grad_()
        w = case.weight.clone().requires_grad_(trainable)
        b = case.bias.clone().requires_grad_(trainable)
        out = gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, bias=b,
                                   old_logp=case.old_logp, ref_logp=case.ref_logp, beta=0.04, plan_cache=cache)
        out.loss.backward()
        return out.loss.detach(), x.grad, w.grad, b.grad

    def log_probs(trainable):
        x = case.hidden.clone().requires_grad_()
        w = case.weight.clone().requires_grad_(trainable)
        b = case.bias.clone().requires_grad_(trainable)
        logp, entropy = gt.fused_log_probs(x, w, b, case.ids, plan_cache=cache)
        (logp * case.mask).sum().add(0.01 * entropy.sum()).backward()
        return logp.detach(), x.grad, w.grad, b.grad

    for run in (grpo_loss, log_probs):
        out, dx, dw, db = run(True)
        out_f, dx_f, dw_f, db_f = run(False)
        assert dw is not None and db is not None and dw_f is None and db_f is None
        assert torch.equal(out_f, out), run.__name__
        assert torch.equal(dx_f, dx) and dx.abs().sum() > 0, run.__name__
    assert len(cache) == 4  # the frozen calls built their own (frozen_weight) plans


def test_plan_cache_bounds_what_its_plans_hold():
    """Each plan reports its GEMM count and held bytes (as describe() does); the cache evicts the least recently
    used plans beyond max_plan_bytes, never the newest, and keeps the sum of what it holds."""
    case = make_case(seed=9)
    cache = grpo.PlanCache()
    gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, plan_cache=cache)
    plan = next(iter(cache._plans.values()))
    # plan_bytes is measured (heap and RSS growth while the GEMMs are made): 0 when freed memory was reused.
    assert plan.gemm_count > 0 and plan.plan_bytes >= 0
    assert f" plan={plan.plan_bytes}B ({plan.gemm_count} gemms" in plan.describe()
    assert cache.plan_bytes == plan.plan_bytes
    # The byte bound, on stand-in plans of known size: 3 + 4 fit in 8, a third evicts the oldest, one alone
    # larger than the bound stays (the newest always does); a scratch entry (no plan_bytes) counts 0 and is
    # never evicted for bytes.
    small = grpo.PlanCache(max_plan_bytes=8)
    small.get("scratch", "s", lambda: torch.zeros(16))
    for name, held in (("a", 3), ("b", 4), ("c", 2), ("d", 20)):
        small.get("lm_head_loss", name, lambda held=held: types.SimpleNamespace(plan_bytes=held))
        if name == "c":
            assert [k for _, k in small._plans] == ["s", "b", "c"] and small.plan_bytes == 6
    assert [k for _, k in small._plans] == ["s", "d"] and small.plan_bytes == 20
    small.clear()
    assert small.plan_bytes == 0 and len(small) == 0
    with pytest.raises(ValueError, match="max_plan_bytes"):
        grpo.PlanCache(max_plan_bytes=-1)
