"""grad_filter (the filtered backward, docs/filtered_backward.md) through the Python entry points.

The rule the library applies: per token block, a vocab column is left out of
dhidden and dW when every active row t of the block has |g_tv| < eps w_t,
g the stored dlogits entry and w_t = (|a_t| + |b_t|) s its row's weight
(here no entropy bonus, no softcap, temperature 1: w_t = |a_t|, a_t =
dLoss/dlogp_t times the gradient scale). So, with S the left-out pairs,

    |dhidden_tk(filtered) - dhidden_tk| <= sum_{v: (t,v) in S} |g_tv| |W_vk| <  eps w_t sum_v |W_vk|
    |dW_vk(filtered) - dW_vk|           <= sum_{t: (t,v) in S} |g_tv| |h_tk| <  eps sum_t w_t |h_tk|

computed here in float64 from the inputs and the coefficients (the float64
reference's dLoss/dlogp for the losses, the chosen upstream gradient for
fused_log_probs), summing only over the entries that can be left out (|g| <
2 eps w_t in float64, see filter_bounds): the plain right-hand sides above
are ~30x looser here and would pass a column wrongly left out at p ~ 0.1.
On top of it, what differs between the two runs besides the left-out terms:
the kept terms are summed in float32 in another order (each sum errs by at
most (depth + 2) u32 sum |g| |other factor|, the kernel's |g| <= 2 |g| of
float64), and each bf16 output is rounded once (ubf relative). And since
the rank-8 correction gives the left-out sum back projected onto a basis
(each element at most sum |g| times the other factor's row 2-norm) and the
filtered step's kept entries carry their bf16 remainders (the exact step's
each g is rounded once: ubf sum |g| |other factor|), those two terms too.

Inputs: bf16, B=1 T=64 H=64 V=2048, logits of std ~12 (peaked): per row
~9 entries have |p - onehot| >= 2^-12, the 64 rows' union ~490 of 2048
columns, so the block runs filtered (a block keeping more than half of V
runs unfiltered; at std 8 the union is ~950, too close to that edge).
"""

import math

import pytest
import torch

import grpo
import grpo.liger
import grpo.torch as gt
from reference import U32, UBF, Case, reference

EPS_BF16 = 2.0**-12  # "auto" for a bf16 weight: eps(bf16) / 32
# The kernel's coefficient a_t is float32; the float64 one here may be
# smaller by a few u32: the bound's w_t is taken that much larger.
COEF_MARGIN = 1.0 + 64 * U32


def peaked(seed=5, t=64, h=64, v=2048, logit_std=12.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, t, h, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * (logit_std / math.sqrt(h))).to(torch.bfloat16)
    with torch.no_grad():
        p = torch.softmax(hidden[0].double() @ weight.double().T, 1)
    ids = torch.multinomial(p.float(), 1, generator=g).reshape(1, t)  # chosen as a policy samples them
    mask = torch.ones(1, t)
    advantages = torch.tensor([0.8])
    return Case(hidden, weight, None, ids, mask, advantages, None, None, None, {"loss_type": "grpo"})


def filter_bounds(hidden, weight, ids, coef, eps, dh_exact, dw_exact, dh_filtered, dw_filtered):
    """Element-wise bounds on |filtered - exact| for dhidden [N, H] and dW [V, H] (module docstring).

    The left-out terms: an entry (t, v) can be left out only if its stored
    |g_tv| < eps w_t; the stored g is the float64 g = a_t (onehot - p) up to a
    relative error far below 1 (bf16 rounding, the f16 x - max: at most
    U16 |x - max| ~ 5% here), so only entries with |g| < 2 eps w_t can be, and
    each moves the result by at most min(eps w_t, 2 |g|) times the other factor.
    """
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    w = weight.double()
    n, v = h.shape[0], w.shape[0]
    wt = coef.double().abs().reshape(n, 1) * COEF_MARGIN
    absh, absw = h.abs(), w.abs()
    p = torch.softmax(h @ w.T, 1)
    onehot = torch.zeros_like(p).scatter_(1, ids.reshape(n, 1), 1.0)
    g = wt * (onehot - p).abs()
    left_out = torch.where(g < 2.0 * eps * wt, torch.minimum(eps * wt.expand_as(g), 2.0 * g), torch.zeros_like(g))
    # The left-out terms, the rank-8 correction of them (a projection: each
    # element at most the terms' |g| times the other factor's row 2-norm), the
    # exact step's bf16 rounding of every g (the filtered step's kept entries
    # carry their remainders) and f32 accumulation.
    norm_w = w.norm(dim=1)
    norm_h = h.norm(dim=1)
    dh = (left_out @ absw + (left_out @ norm_w).reshape(n, 1) + UBF * (2.0 * g @ absw)
          + 2 * (v + 2) * U32 * (2.0 * g @ absw) + UBF * (dh_exact.double().abs() + dh_filtered.double().abs()))
    dw = (left_out.T @ absh + (left_out.T @ norm_h).reshape(v, 1) + UBF * (2.0 * g.T @ absh)
          + 2 * (n + 2) * U32 * (2.0 * g.T @ absh) + UBF * (dw_exact.double().abs() + dw_filtered.double().abs()))
    return dh, dw


def check_filtered_grads(case, coef, exact, filtered, stats):
    """exact / filtered: (dhidden [N, H], dW [V, H]) of the unfiltered and the "auto" run."""
    (dh_e, dw_e), (dh_f, dw_f) = exact, filtered
    assert stats["dhidden_skipped_row_columns"] > 0 and stats["dweight_skipped_row_columns"] > 0, stats
    v, h = dw_e.shape
    assert stats["dweight_skipped_row_columns"] <= stats["dweight_gemm_rows"] * v
    assert stats["executed_flops"] == 2.0 * h * (v * (stats["logits_gemm_rows"] + stats["backward_gemm_rows"]
                                                     + stats["dweight_gemm_rows"])
                                                - stats["dhidden_skipped_row_columns"]
                                                - stats["dweight_skipped_row_columns"])
    tol_h, tol_w = filter_bounds(case.hidden, case.weight, case.ids, coef, EPS_BF16, dh_e, dw_e, dh_f, dw_f)
    diff_h = (dh_f.double() - dh_e.double()).abs()
    diff_w = (dw_f.double() - dw_e.double()).abs()
    assert torch.all(diff_h <= tol_h), f"dhidden: worst diff / bound {float((diff_h / tol_h).max()):.3g}"
    assert torch.all(diff_w <= tol_w), f"dW: worst diff / bound {float((diff_w / tol_w).max()):.3g}"
    # Something was left out (and given back only in rank 8): the results differ.
    assert not (torch.equal(dh_f, dh_e) and torch.equal(dw_f, dw_e))


# --------------------------------------------------------------------------
# lm_head_grpo_loss
# --------------------------------------------------------------------------


def run_loss(case, **kw):
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    out = gt.lm_head_grpo_loss(x, w, case.ids, case.mask, case.advantages, return_entropy=True, **kw)
    out.loss.backward()
    return out, x.grad.reshape(-1, x.shape[-1]), w.grad


@pytest.mark.parametrize("off", [None, "off", 0, 0.0, False])
def test_off_values_are_bitwise_the_call_without_the_keyword(off):
    case = peaked()
    plain, dh, dw = run_loss(case)
    other, dh2, dw2 = run_loss(case, grad_filter=off)
    assert torch.equal(plain.loss, other.loss) and torch.equal(plain.per_token_logps, other.per_token_logps)
    assert torch.equal(dh, dh2) and torch.equal(dw, dw2)
    assert other.stats["dhidden_skipped_row_columns"] == other.stats["dweight_skipped_row_columns"] == 0


def test_lm_head_grpo_loss_auto_on_peaked_inputs():
    case = peaked()
    exact, dh_e, dw_e = run_loss(case)
    filtered, dh_f, dw_f = run_loss(case, grad_filter="auto")
    assert torch.equal(filtered.loss, exact.loss)
    assert torch.equal(filtered.per_token_logps, exact.per_token_logps)
    assert torch.equal(filtered.entropy, exact.entropy)
    assert filtered.metrics == exact.metrics
    coef = reference(case, need_grads=True)["c"]  # dLoss/dlogp_t, float64
    check_filtered_grads(case, coef, (dh_e, dw_e), (dh_f, dw_f), filtered.stats)


def test_explicit_threshold_and_plan_key():
    """A threshold is its own plan (the cache key has every bound option); describe() names it."""
    case = peaked()
    cache = grpo.PlanCache()
    run_loss(case, plan_cache=cache)
    run_loss(case, plan_cache=cache, grad_filter="auto")
    assert cache.builds == 2
    run_loss(case, plan_cache=cache, grad_filter=2.0**-12)
    assert cache.builds == 3  # another plan than "auto"'s, though the same threshold for bf16
    run_loss(case, plan_cache=cache, grad_filter="auto")
    assert cache.builds == 3
    described = [plan.describe() for plan in cache._plans.values()]
    assert sum("grad_filter=" in d for d in described) == 2, described
    # A threshold below every entry leaves nothing out: bitwise the exact step.
    # Logits of std 1 here: every |g| >= |a| p_min ~ 1e-2 * e^-8 / V, far above
    # 1e-30 |a| (the peaked inputs' smallest p underflow in float32).
    case = peaked(logit_std=1.0)
    exact, dh_e, dw_e = run_loss(case)
    tiny, dh_t, dw_t = run_loss(case, grad_filter=1e-30)
    assert tiny.stats["dhidden_skipped_row_columns"] == 0
    assert torch.equal(dh_t, dh_e) and torch.equal(dw_t, dw_e)


# --------------------------------------------------------------------------
# LmHeadGRPOLoss (the Liger drop-in)
# --------------------------------------------------------------------------


def run_module(case, monkeypatch, **kw):
    """The drop-in's loss, metrics, gradients and (through a spy on the functional form) its step stats."""
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    seen = []
    module = gt.LmHeadGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo", **kw)
    original = gt.lm_head_grpo_loss

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(result.stats)
        return result

    with monkeypatch.context() as m:
        m.setattr(grpo.liger, "lm_head_grpo_loss", spy)
        loss, metrics = module(x, w, case.ids, case.mask, case.advantages)
    loss.backward()
    return loss, metrics, x.grad.reshape(-1, x.shape[-1]), w.grad, seen[0]


def test_drop_in_none_and_auto(monkeypatch):
    case = peaked()
    loss_e, metrics_e, dh_e, dw_e, _ = run_module(case, monkeypatch)
    loss_n, metrics_n, dh_n, dw_n, _ = run_module(case, monkeypatch, grad_filter=None)
    assert torch.equal(loss_n, loss_e) and torch.equal(dh_n, dh_e) and torch.equal(dw_n, dw_e)
    loss_f, metrics_f, dh_f, dw_f, stats = run_module(case, monkeypatch, grad_filter="auto")
    assert torch.equal(loss_f, loss_e)
    assert all(torch.equal(a, b) for a, b in zip(metrics_f, metrics_e))
    coef = reference(case, need_grads=True)["c"]  # Liger's grpo is grpo's (test_liger.py)
    check_filtered_grads(case, coef, (dh_e, dw_e), (dh_f, dw_f), stats)


# --------------------------------------------------------------------------
# fused_log_probs (the generic head; TRL's path)
# --------------------------------------------------------------------------


def run_log_probs(case, upstream, **kw):
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    stats = []
    logp, entropy = gt.fused_log_probs(x, w, None, case.ids, outputs=("log_probs", "entropy"),
                                       on_stats=stats.append, **kw)
    (logp * upstream).sum().backward()  # dLoss/dlogp = upstream; no gradient through entropy
    return logp, entropy, x.grad.reshape(-1, x.shape[-1]), w.grad, stats[-1]


def test_fused_log_probs_none_and_auto():
    case = peaked()
    upstream = torch.randn(case.ids.shape, generator=torch.Generator().manual_seed(2))
    lp_e, ent_e, dh_e, dw_e, _ = run_log_probs(case, upstream)
    lp_n, ent_n, dh_n, dw_n, _ = run_log_probs(case, upstream, grad_filter=None)
    assert torch.equal(lp_n, lp_e) and torch.equal(dh_n, dh_e) and torch.equal(dw_n, dw_e)
    lp_f, ent_f, dh_f, dw_f, stats = run_log_probs(case, upstream, grad_filter="auto")
    assert torch.equal(lp_f, lp_e) and torch.equal(ent_f, ent_e)
    check_filtered_grads(case, upstream.reshape(-1), (dh_e, dw_e), (dh_f, dw_f), stats)


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------

BAD = [-0.5, -2.0, 1.5, 1.0, "fast", float("nan"), True, "AUTO", object()]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_refusals_name_grad_filter(value):
    case = peaked(t=4, v=64)
    with pytest.raises(grpo.Error) as info:
        gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, case.advantages, grad_filter=value)
    assert info.value.argument == "grad_filter" and "grad_filter" in str(info.value)
    with pytest.raises(grpo.Error) as info:
        gt.LmHeadGRPOLoss(grad_filter=value)
    assert info.value.argument == "grad_filter" and "grad_filter" in str(info.value)
    with pytest.raises(grpo.Error) as info:
        gt.fused_log_probs(case.hidden, case.weight, None, case.ids, grad_filter=value)
    assert info.value.argument == "grad_filter" and "grad_filter" in str(info.value)


@pytest.mark.parametrize("spelling", ["auto", grpo.GRAD_FILTER_AUTO], ids=repr)
def test_every_spelling_of_auto_at_every_entry_point(spelling):
    """grpo.GRAD_FILTER_AUTO (the value docs/filtered_backward.md and grpo's docstring name) is "auto"
    wherever a grad_filter keyword is taken: the same threshold, the same gradients bitwise."""
    case = peaked()
    want, dh_want, dw_want = run_loss(case, grad_filter="auto")
    got, dh, dw = run_loss(case, grad_filter=spelling)
    assert got.stats["dhidden_skipped_row_columns"] > 0
    assert torch.equal(dh, dh_want) and torch.equal(dw, dw_want)
    assert gt.LmHeadGRPOLoss(grad_filter=spelling).grad_filter == spelling
    upstream = torch.ones(case.ids.numel())
    lp, _, dh_l, dw_l, stats = run_log_probs(case, upstream, grad_filter=spelling)
    lp_a, _, dh_a, dw_a, _ = run_log_probs(case, upstream, grad_filter="auto")
    assert stats["dhidden_skipped_row_columns"] > 0
    assert torch.equal(lp, lp_a) and torch.equal(dh_l, dh_a) and torch.equal(dw_l, dw_a)


def test_the_library_refuses_a_bad_threshold_in_the_core_api():
    """The core API's LmHeadOptions takes the library's values (-1.0 = auto) and refuses others itself."""
    shape = grpo.LmHeadShape()
    # V = 512: a vocabulary narrower than the GEMM row quantum is never filtered (no grad_filter in describe()).
    shape.batch, shape.seq_len, shape.hidden, shape.vocab = 1, 4, 8, 512
    options = grpo.LmHeadOptions()
    options.grad_filter = grpo.GRAD_FILTER_AUTO
    assert "grad_filter=" in grpo.LmHeadLossPlan(shape, grpo.LossConfig(), options).describe()
    assert "grad_filter=" in grpo.LmHeadLogProbPlan(shape, grpo.LogProbConfig(), options).describe()
    options.grad_filter = 1.5
    with pytest.raises(grpo.Error) as info:
        grpo.LmHeadLossPlan(shape, grpo.LossConfig(), options)
    assert info.value.argument == "options.grad_filter"
