"""The loss features of lm_head_grpo_loss beyond Liger's module, against torch autograd.

- entropy_coef: the bonus alone is isolated as (loss with it) - (loss without it), which
  must equal -entropy_coef * masked mean entropy, and its gradient must equal torch's
  autograd of that mean through materialized float64 logits.
- top_entropy_quantile: the tokens kept are those of TRL's rule (torch.quantile of the
  valid entropies, then >=), checked through the per-token policy gradient they keep.
- luspo / vespo: accepted and finite (their values are checked against the double oracle
  in the C++ tests).
"""

import pytest
import torch

import grpo.torch as gt
from reference import make_case


def run(case, **kw):
    h = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    res = gt.lm_head_grpo_loss(h, w, case.ids, case.mask, case.advantages, bias=case.bias, old_logp=case.old_logp,
                               return_entropy=True, **kw)
    res.loss.backward()
    return res, h.grad, w.grad


def mean_entropy_f64(case, temperature):
    """Masked mean entropy of softmax(z / T) through float64 logits, and its gradients."""
    h = case.hidden.double().clone().requires_grad_()
    w = case.weight.double().clone().requires_grad_()
    z = h @ w.T + (case.bias.double() if case.bias is not None else 0.0)
    logp = torch.log_softmax(z / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = case.mask.double()
    mean = (ent * m).sum() / m.sum().clamp(min=1.0)
    mean.backward()
    return float(mean.detach()), h.grad, w.grad


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus_is_minus_coef_times_mean_entropy(loss_type):
    case = make_case(seed=5, dtype=torch.float32)
    kw = dict(loss_type=loss_type, temperature=0.9)
    if loss_type == "dapo":
        kw["num_items_in_batch"] = float(case.mask.sum())
    coef = 0.3
    with_bonus, gh1, gw1 = run(case, entropy_coef=coef, **kw)
    without, gh0, gw0 = run(case, **kw)
    mean, gh_ref, gw_ref = mean_entropy_f64(case, 0.9)
    assert float(with_bonus.loss - without.loss) == pytest.approx(-coef * mean, rel=1e-5, abs=1e-6)
    for got_with, got_without, ref, name in ((gh1, gh0, gh_ref, "hidden"), (gw1, gw0, gw_ref, "weight")):
        diff = (got_with.double() - got_without.double()) - (-coef * ref)
        scale = float(ref.abs().max()) * coef
        assert float(diff.abs().max()) <= 1e-4 * scale + 1e-7, name


def test_top_entropy_quantile_keeps_trls_tokens():
    case = make_case(seed=9, dtype=torch.float32, per_token_adv=True)
    rho = 0.4
    full, _, _ = run(case, loss_type="bnpo")
    masked, _, _ = run(case, loss_type="bnpo", top_entropy_quantile=rho)
    ent = full.entropy
    valid = case.mask.bool()
    threshold = torch.quantile(ent[valid].float(), 1.0 - rho)  # TRL's get_high_entropy_mask
    keep = (ent >= threshold) & valid
    assert 0 < int(keep.sum()) < int(valid.sum())
    # bnpo divides by the valid count either way, and the mask multiplies the policy term only:
    # the same loss as zeroing by hand the advantages of the tokens TRL's rule drops.
    adv = case.advantages.clone() * keep.float()
    by_hand = gt.lm_head_grpo_loss(case.hidden, case.weight, case.ids, case.mask, adv, bias=case.bias,
                                   old_logp=case.old_logp, loss_type="bnpo")
    assert float(masked.loss) == pytest.approx(float(by_hand.loss), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("loss_type,level", [("luspo", "sequence"), ("vespo", "token")])
def test_luspo_and_vespo_are_accepted(loss_type, level):
    case = make_case(seed=3, dtype=torch.float32)
    kw = dict(loss_type=loss_type, importance_sampling_level=level)
    if loss_type == "vespo":
        kw["num_items_in_batch"] = float(case.mask.sum())
    res, gh, gw = run(case, **kw)
    assert torch.isfinite(res.loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert float(gw.abs().max()) > 0.0
