"""grpo's fused loss in a TRL 1.16 GRPOTrainer (patch_grpo_trainer's default) against plain TRL, option by option.

One batch (a module fixture) made off-policy and uneven: completion lengths
6, 4, 6, 2, advantages of both signs, old log-probs = the policy's +-
|N(0, 0.3)| (alternating signs) and reference log-probs = the policy's +
N(0, 0.2) on the valid tokens, so every sequence has ratios on both sides of
1, some beyond each clip boundary, and the KL is not 0 (the bf16 cases are
on-policy: see below). Each case builds a tiny trainer with
its GRPOConfig and runs compute_loss (and backward) on the batch in `ga`
micro-batches (current_gradient_accumulation_steps = ga, sync_gradients on
the last), three times: unpatched (plain TRL), patched, and TRL's own
_compute_loss replayed on grpo's per-token outputs (its
_get_per_token_logps_and_entropies returning the fused call's logp and
entropy).

Checks:
- the path: lm_head_grpo_loss ran once per micro-batch and nothing warned
  (fused cases); or it never ran and exactly one warning named the reason
  over two passes (fallback cases);
- against plain TRL: per-token log-probs and entropy within the two heads'
  bound (test_trl.py's e2 and e2 (2 + max|x|)), every gradient within
  test_trl.py's budget, the same trainer._metrics keys, the entropy and KL
  metrics within their first-order bounds, the controller's entropy_coef;
- against the replay (fused cases): the same loss up to float32 rounding of
  its terms, every metric equal (the clip ratios, phi, entropy: the same ops
  on the same values; the KL and policy_loss, which grpo computes itself,
  within float32 rounding), the same controller state. So each option is
  TRL's semantics, not only close to it: a token flipping across a clip
  boundary or the entropy quantile because the heads round differently
  cannot hide a difference, nor be mistaken for one.
The bf16 cases (GRPOConfig's default autocast) are on-policy (r = 1 exactly
on both sides): their heads differ by ~1e-3 in logp (TRL's bf16 logits), which
would flip tokens near a clip boundary and move gradients by a whole token's
share; the f32 cases cover the off-policy branches, where the heads agree to
~1e-6.
"""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")

import grpo.torch as gt  # noqa: E402
from grpo.integrations import trl as integration  # noqa: E402
from grpo.integrations.trl import patch_grpo_trainer  # noqa: E402
from reference import U32, UBF  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402
from trl_tiny import logp_bound, tiny_trainer  # noqa: E402

REASON = "grpo: patch_grpo_trainer"


@pytest.fixture(scope="module")
def batch():
    """One generated batch with its reference log-probs (the policy's at init, TRL's head), made as said above."""
    trainer = tiny_trainer(bf16=False)
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    b, t = inputs["completion_ids"].shape
    lengths = torch.tensor([t, max(t - 2, 1), t, min(2, t)])
    mask = (torch.arange(t) < lengths[:, None]).to(inputs["completion_mask"].dtype)
    g = torch.Generator().manual_seed(7)
    logps = inputs["ref_per_token_logps"]
    # |N(0, 0.3)| with alternating signs along each sequence: ratios above and below 1 in every sequence.
    signs = 1.0 - 2.0 * (torch.arange(t) % 2)
    return dict(inputs, completion_ids=inputs["completion_ids"].masked_fill(mask == 0, 0), completion_mask=mask,
                advantages=torch.tensor([0.9, -0.6, 0.4, -1.1]),
                old_per_token_logps=(logps + 0.3 * signs * torch.randn(b, t, generator=g).abs()) * mask,
                ref_per_token_logps=(logps + 0.2 * torch.randn(b, t, generator=g)) * mask,
                num_items_in_batch=mask.sum().to(inputs["num_items_in_batch"].dtype))


# --------------------------------------------------------------------------- input and trainer variants

def on_policy(inputs):
    return {k: v for k, v in inputs.items() if k != "old_per_token_logps"}


def is_ratio(inputs, masked=1.0):
    """vLLM's importance_sampling_ratio [B, T]: exp(N(0, 0.1)) on valid tokens, `masked` elsewhere."""
    mask = inputs["completion_mask"]
    g = torch.Generator().manual_seed(8)
    ratio = torch.exp(0.1 * torch.randn(mask.shape, generator=g))
    return dict(inputs, importance_sampling_ratio=torch.where(mask == 1, ratio, torch.full_like(ratio, masked)))


def per_token_advantages_and_tool_mask(inputs):
    mask = inputs["completion_mask"]
    g = torch.Generator().manual_seed(9)
    tool = torch.ones_like(mask)
    tool[0, 2] = tool[2, 1] = 0  # tool-output tokens: in the sequence, out of the loss
    adv = inputs["advantages"][:, None] * (1.0 + 0.5 * torch.randn(mask.shape, generator=g))
    return dict(inputs, advantages=adv, tool_mask=tool)


def sampling_logps(noise):
    def tweak(inputs):
        g = torch.Generator().manual_seed(10)
        old = inputs["old_per_token_logps"]
        return dict(inputs, sampling_per_token_logps=old + noise * torch.randn(old.shape, generator=g) * (old != 0))
    return tweak


def off_policy_sequence(inputs):
    """Sequence 1 (advantage < 0) 1 nat per token more likely under the old policy: the off-policy mask drops it
    (its mean old - logp, ~1 - N(0, 0.15), far above the threshold)."""
    old = inputs["old_per_token_logps"].clone()
    old[1] += inputs["completion_mask"][1]
    return dict(inputs, old_per_token_logps=old)


def vllm_correction(trainer, monkeypatch):
    # TRL's vLLM importance-sampling correction without vLLM: the flags _compute_loss reads.
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True


def head_bias(trainer, monkeypatch):
    head = trainer.model.lm_head
    g = torch.Generator().manual_seed(11)
    head.bias = torch.nn.Parameter(0.3 * torch.randn(head.weight.shape[0], generator=g))


def last_window_entropy(value):
    def setup(trainer, monkeypatch):
        trainer._last_world_entropy = value  # as after a step whose entropy was `value`: the bonus applies
    return setup


class OwnLoss(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs)


def other_trl_version(trainer, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")


def fsdp(trainer, monkeypatch):
    trainer.is_fsdp_enabled = True


def two_processes(trainer, monkeypatch):
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))


def unknown_layout(trainer, monkeypatch):
    monkeypatch.setattr(integration, "_completion_rows", lambda *args: None)


# (id, GRPOConfig / tiny_trainer keywords, micro-batches, inputs tweak, trainer setup, mode)
FUSED = [
    ("grpo_kl_delta", dict(loss_type="grpo", delta=1.25), 1, None, None, "train"),  # caps r of A < 0 tokens
    ("bnpo_kl_bias_correction", dict(loss_type="bnpo", use_bias_correction_kl=True), 1, None, None, "train"),
    ("dr_grpo", dict(loss_type="dr_grpo", beta=0.0), 1, None, None, "train"),
    ("dapo_clip_higher_kl_ga2", dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.28), 2, None, None, "train"),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.2, beta=0.0), 1, None, None, "train"),
    ("sapo_ga2", dict(loss_type="sapo"), 2, None, None, "train"),
    ("vespo_is_ratio", dict(loss_type="vespo", beta=0.0), 1, is_ratio, None, "train"),
    ("luspo_kl_bias_correction", dict(loss_type="luspo", importance_sampling_level="sequence",
                                      use_bias_correction_kl=True), 1, None, None, "train"),
    ("gspo_kl", dict(loss_type="grpo", importance_sampling_level="sequence"), 1, None, None, "train"),
    ("top_entropy_bonus", dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01), 1, None, None,
     "train"),
    ("entropy_bonus_ga2", dict(loss_type="grpo", entropy_coef=0.02), 2, None, None, "train"),
    ("adaptive_top_entropy_ga2", dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.05,
                                      entropy_target=10.0, top_entropy_quantile=0.5), 2, None,
     last_window_entropy(0.0), "train"),
    ("adaptive_entropy_above_target", dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05,
                                           entropy_target=0.1), 1, None, None, "train"),
    ("opsm_vllm_is_weight", dict(loss_type="grpo", off_policy_mask_threshold=0.05), 1,
     lambda x: sampling_logps(0.0)(is_ratio(off_policy_sequence(x))), vllm_correction, "train"),
    ("per_token_advantages_tool_mask", dict(loss_type="dapo"), 1, per_token_advantages_and_tool_mask, None,
     "train"),
    ("temperature_bias_softcap_scale", dict(loss_type="grpo", temperature=0.7,
                                            model=dict(final_logit_softcapping=3.0, logit_scale=1.3)), 1, None,
     head_bias, "train"),
    ("moe_aux_loss_ga2", dict(loss_type="grpo", model=dict(moe=True)), 2, None, None, "train"),
    ("eval_dapo_entropy_bonus", dict(loss_type="dapo", entropy_coef=0.01), 1, None, None, "eval"),
    ("bf16_dapo_entropy_ga2", dict(loss_type="dapo", entropy_coef=0.01, bf16=True), 2, on_policy, None, "train"),
    ("bf16_gspo_kl_bias_correction", dict(loss_type="grpo", importance_sampling_level="sequence",
                                          use_bias_correction_kl=True, bf16=True), 1, on_policy, None, "train"),
]

# (id, keywords, micro-batches, inputs tweak, trainer setup, words the warning names)
FALLBACK = [
    ("subclass", dict(trainer_class=OwnLoss), 1, None, None, "overrides _compute_loss"),
    ("trl_version", dict(), 1, None, other_trl_version, "TRL 1.17.0"),
    ("fsdp", dict(), 1, None, fsdp, "FSDP"),
    ("entropy_quantile_two_processes", dict(top_entropy_quantile=0.5), 1, None, two_processes, "several processes"),
    ("opsm_sampling_logps", dict(loss_type="grpo", off_policy_mask_threshold=0.05), 1, sampling_logps(0.2), None,
     "sampling_per_token_logps"),
    ("opsm_negative", dict(loss_type="grpo", off_policy_mask_threshold=-0.01), 1, None, None,
     "off_policy_mask_threshold < 0"),
    ("luspo_token", dict(loss_type="luspo"), 1, None, None, "luspo with importance_sampling_level='token'"),
    ("vespo_sequence", dict(loss_type="vespo", importance_sampling_level="sequence", beta=0.0), 1, None, None,
     "vespo with importance_sampling_level='sequence'"),
    ("vespo_lambda_0", dict(loss_type="vespo", vespo_lambda_pos=0.0, beta=0.0), 1, None, None, "lambda <= 0"),
    ("vespo_ratio_on_masked", dict(loss_type="vespo", beta=0.0), 1, lambda x: is_ratio(x, masked=0.5), None,
     "masked positions"),
    ("delta_in_clip_range", dict(loss_type="grpo", delta=1.1), 1, None, None, "delta <= 1 + epsilon_high"),
    ("capture_layout", dict(), 1, None, unknown_layout, "another layout"),
]


# --------------------------------------------------------------------------- one pass of compute_loss

def _save_state(trainer):
    trainer._test_state = (trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats)


def run(trainer, inputs, ga, mode, *, replay=None, grad=None):
    """compute_loss over `ga` micro-batches (backward in train mode), from the saved controller state.

    replay: per micro-batch (logp, entropy, aux) that TRL's _compute_loss gets instead of its head's (it runs
    GRPOTrainer._compute_loss itself, past any patch). Returns the losses, gradients, metrics, controller state,
    the per-token outputs the loss saw (the fused call's, else the head's) and their gradients.
    """
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = trainer._test_state
    model = trainer.model
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    trainer._metrics[mode].clear()
    trainer.current_gradient_accumulation_steps = ga
    grad = mode == "train" if grad is None else grad
    parts = split_tensor_dict(inputs, ga) if ga > 1 else [inputs]
    if replay is not None:  # dL/dA: A dL/dA sums each sequence's policy terms (of one sign), for the tolerance
        parts = [dict(part, advantages=part["advantages"].clone().requires_grad_()) for part in parts]
    heads, captures, results = [], [], []
    original, fused = trainer._get_per_token_logps_and_entropies, gt.lm_head_grpo_loss

    def head_spy(*args, **kwargs):
        if integration._CAPTURE.get() is not None:  # the fused loss's forward: placeholders (and the aux loss)
            captures.append(original(*args, **kwargs))
            return captures[-1]
        out = original(*args, **kwargs) if replay is None else replay[len(heads)]
        for x in out[:2]:
            if x is not None and x.requires_grad:
                x.retain_grad()
        heads.append(out)
        return out

    def loss_spy(*args, **kwargs):
        results.append(fused(*args, **kwargs))
        return results[-1]

    trainer._get_per_token_logps_and_entropies = head_spy
    gt.lm_head_grpo_loss = loss_spy
    losses = []
    try:
        for i, part in enumerate(parts):
            trainer.accelerator.sync_gradients = i == len(parts) - 1
            with torch.set_grad_enabled(grad):
                loss = GRPOTrainer._compute_loss(trainer, model, part) if replay else trainer.compute_loss(model, part)
            if grad:
                loss.backward()
            losses.append(loss.detach())
    finally:
        trainer.accelerator.sync_gradients = True
        gt.lm_head_grpo_loss = fused
        del trainer._get_per_token_logps_and_entropies
    if results:
        per_token = [(r.per_token_logps, r.entropy, h[2]) for r, h in zip(results, captures)]
    else:
        per_token = [(h[0].detach(), h[1].detach(), h[2]) for h in heads]
    return dict(losses=losses, parts=parts, fused=len(results), per_token=per_token,
                kl=[r.kl for r in results], c=[(h[0].grad, h[1].grad) for h in heads],
                grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                metrics={k: list(v) for k, v in trainer._metrics[mode].items()},
                state=(trainer.entropy_coef, trainer._last_world_entropy))


def make_trainer(config, ga, setup, monkeypatch):
    config = dict(config)
    bf16 = config.pop("bf16", False)
    trainer = tiny_trainer(bf16=bf16, gradient_accumulation_steps=ga, **config)
    if setup is not None:
        setup(trainer, monkeypatch)
    _save_state(trainer)
    return trainer, bf16


# --------------------------------------------------------------------------- checks

def check_against_trl(trainer, bf16, ga, mode, ours, theirs, record, tag):
    """Per-token outputs within the heads' bound, gradients within test_trl.py's budget; metrics (keys, entropy,
    KL) and the controller's coefficient."""
    inputs = {k: torch.cat([p[k] for p in theirs["parts"]]) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                       "completion_mask")}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)
    args = (trainer, trainer.model, ids, attention, keep)
    e, xmax = logp_bound(*args)
    e2 = e + logp_bound(*args, logits_round=UBF if bf16 else 0.0)[0]
    rows = len(ids) // ga
    for k, (part, (lp, ent, _), (lp_t, ent_t, _)) in enumerate(zip(theirs["parts"], ours["per_token"],
                                                                     theirs["per_token"])):
        m = part["completion_mask"].bool() if "tool_mask" not in part else (part["completion_mask"]
                                                                           * part["tool_mask"]).bool()
        e_k, x_k = e2[k * rows:(k + 1) * rows], xmax[k * rows:(k + 1) * rows]
        for name, a, b, tol in (("logps", lp, lp_t, e_k), ("entropy", ent, ent_t, e_k * (2.0 + x_k))):
            diff = (a.double() - b.double()).abs()[m]
            record(tag, name, a[m], b[m])
            assert torch.all(diff <= tol[m]), f"{name}: worst diff / bound {float((diff / tol[m]).max()):.3g}"

    assert ours["metrics"].keys() == theirs["metrics"].keys(), (ours["metrics"].keys(), theirs["metrics"].keys())
    ent_tol = float((e2 * (2.0 + xmax)).max())
    for name in ("entropy", "kl"):
        for k, (a, b) in enumerate(zip(ours["metrics"].get(name, []), theirs["metrics"].get(name, []))):
            if name == "entropy":  # a mean of entropies, each within ent_tol
                tol = ent_tol
            else:  # dKL/dlogp = 1 - exp(ref - logp); times the ratio r (itself within e2 of log r) when corrected
                part, lp_t = theirs["parts"][k], theirs["per_token"][k][0].double()
                d = part["ref_per_token_logps"].double() - lp_t
                kl = torch.exp(d) - d - 1
                old = part.get("old_per_token_logps")
                r = torch.exp(lp_t - (lp_t if old is None else old.double())).clamp(min=1.0)
                tol = 2.0 * float(((1 - torch.exp(d)).abs() + kl).mul(r).max()) * float(e2.max())
            record(tag, "metric " + name, a, b)
            assert abs(a - b) <= tol + 64 * U32 * abs(b), f"metric {name}: {a} vs {b}"
    # The controller's coefficient moves by fixed steps: equal unless the window entropy is within ent_tol of the
    # target, which no case here puts it near.
    assert ours["state"][0] == theirs["state"][0]
    if mode != "train":
        return
    assert ours["grads"].keys() == theirs["grads"].keys() and "lm_head.weight" in ours["grads"]
    v = trainer.model.lm_head.weight.shape[0]
    budget = 8 * float(e2.max()) + (8 * UBF if bf16 else 64 * U32 * v)  # as test_trl.py
    for name, g in theirs["grads"].items():
        rel = float((ours["grads"][name].double() - g.double()).abs().max()) / max(float(g.abs().max()), 1e-30)
        record(tag, "grad " + (name if name.startswith("lm_head") else "backbone (worst)"),
               abs_diff=rel * float(g.abs().max()), rel=rel)
        assert rel <= budget, f"{name}: {rel:.3g} > {budget:.3g}"


def check_against_replay(trainer, ga, mode, ours, replayed, record, tag):
    """The fused call against TRL's _compute_loss on the same per-token values: loss, metrics, controller state."""
    scale = 1.0 / ga if mode == "train" else 1.0
    loss_tols = []
    for k, part in enumerate(replayed["parts"]):
        lp, ent, _ = replayed["per_token"][k]
        c_lp, c_ent = replayed["c"][k]
        m = part["completion_mask"].double() * (part["tool_mask"].double() if "tool_mask" in part else 1.0)
        # The loss's terms in absolute value: each policy term is linear in its advantage with the sign of -A (or
        # of A for cispo / vespo, times logp < 0), so |A dL/dA| summed per advantage is the sum of |terms|; the KL
        # term is <= |c_t| |ref - logp| (k3 <= |d| |1 - e^d|); the entropy bonus's |c_ent| ent.
        adv = part["advantages"]
        terms = float((adv.detach().double() * adv.grad.double()).abs().sum())
        if trainer.beta != 0.0:
            d = part["ref_per_token_logps"].double() - lp.double()
            terms += float((m * c_lp.double().abs() * d.abs()).sum())
        if c_ent is not None:
            terms += float((m * c_ent.double().abs() * ent.double()).sum())
        a, b = float(ours["losses"][k]), float(replayed["losses"][k])
        # float32 on TRL's side: each term rounded a few times (vespo's phi = exp(up to ~20) by ~20 u), then <= 24
        # of them summed; grpo accumulates in double.
        tol = 64 * U32 * (abs(b) + terms)
        loss_tols.append(tol)
        record(tag, "loss (replay)", a, b)
        assert abs(a - b) <= tol, f"loss of micro-batch {k}: {a} vs TRL's on grpo's values {b} (tol {tol:.3g})"
    assert ours["metrics"].keys() == replayed["metrics"].keys()
    for name, values in replayed["metrics"].items():
        for k, (a, b) in enumerate(zip(ours["metrics"][name], values)):
            if name == "kl":
                # grpo's own KL: TRL's f32 exp(d) - d - 1 errs by a few u (e^d + |d| + 1), and with the bias
                # correction its ratio exp(logp - old) by a few u (|logp| + |old|) relative.
                part, lp = replayed["parts"][k], replayed["per_token"][k][0].double()
                old = part.get("old_per_token_logps")
                old = lp if old is None else old.double()
                d = part["ref_per_token_logps"].double() - lp
                size = (torch.exp(d) + d.abs() + 1) * torch.exp(lp - old).clamp(min=1.0) * (1 + lp.abs() + old.abs())
                tol = 32 * U32 * float(size.max())
            elif name == "policy_loss":  # from grpo's loss: its rounding, unscaled
                tol = loss_tols[min(k, len(loss_tols) - 1)] / scale + 64 * U32 * abs(b)
            else:  # the same ops on the same values
                tol = 0.0
            record(tag, "metric (replay) " + name, a, b)
            assert abs(a - b) <= tol or (math.isnan(a) and math.isnan(b)), f"metric {name}: {a} vs {b}"
    assert ours["state"][0] == replayed["state"][0]
    assert ours["state"][1] == replayed["state"][1] or \
        abs(ours["state"][1] - replayed["state"][1]) <= 64 * U32 * abs(replayed["state"][1])


# --------------------------------------------------------------------------- the cases

@pytest.mark.parametrize("case", FUSED, ids=[c[0] for c in FUSED])
def test_fused_loss_matches_trl(case, batch, record, monkeypatch, recwarn):
    name, config, ga, tweak, setup, mode = case
    inputs = batch if tweak is None else tweak(batch)
    trainer, bf16 = make_trainer(config, ga, setup, monkeypatch)
    theirs = run(trainer, inputs, ga, mode)
    assert theirs["fused"] == 0
    patch_grpo_trainer(trainer)
    ours = run(trainer, inputs, ga, mode)
    assert ours["fused"] == ga, f"{name}: the fused loss ran {ours['fused']} times for {ga} micro-batches"
    assert not [w for w in recwarn if REASON in str(w.message)], [str(w.message) for w in recwarn]
    if mode == "eval":
        assert all(not loss.requires_grad for loss in ours["losses"]) and not ours["grads"]
    tag = f"fused {name}"
    check_against_trl(trainer, bf16, ga, mode, ours, theirs, record, tag)
    injected = [(lp.clone().requires_grad_(), ent.clone().requires_grad_(), None if aux is None else aux.detach())
                for lp, ent, aux in ours["per_token"]]
    replayed = run(trainer, inputs, ga, mode, replay=injected, grad=True)
    check_against_replay(trainer, ga, mode, ours, replayed, record, tag)


@pytest.mark.parametrize("case", FALLBACK, ids=[c[0] for c in FALLBACK])
def test_fallback_warns_once_and_matches_trl(case, batch, record, monkeypatch):
    name, config, ga, tweak, setup, words = case
    inputs = batch if tweak is None else tweak(batch)
    trainer, bf16 = make_trainer(config, ga, setup, monkeypatch)
    theirs = run(trainer, inputs, ga, "train")
    patch_grpo_trainer(trainer)
    with pytest.warns(RuntimeWarning) as caught:
        ours = run(trainer, inputs, ga, "train")
        again = run(trainer, inputs, ga, "train")
    mine = [str(w.message) for w in caught if REASON in str(w.message)]
    assert len(mine) == 1 and words in mine[0], mine
    assert ours["fused"] == again["fused"] == 0
    check_against_trl(trainer, bf16, ga, "train", ours, theirs, record, f"fallback {name}")
    patch_grpo_trainer(trainer, fused_loss=False)  # back to TRL's _compute_loss: no warning, no fused call
    assert "_compute_loss" not in vars(trainer)


def test_prediction_step_runs_the_fused_loss(monkeypatch):
    """Eval: prediction_step (no_grad) goes through the fused loss, forward only (no gradient anywhere)."""
    trainer = tiny_trainer(bf16=False, loss_type="dapo", entropy_coef=0.01)
    patch_grpo_trainer(trainer)
    calls = []
    fused = gt.lm_head_grpo_loss
    monkeypatch.setattr(gt, "lm_head_grpo_loss", lambda *a, **k: calls.append(1) or fused(*a, **k))
    trainer.model.eval()
    raw = next(iter(trainer.get_train_dataloader()))
    loss, logits, labels = trainer.prediction_step(trainer.model, raw, prediction_loss_only=True)
    assert calls == [1] and logits is None and labels is None
    assert math.isfinite(float(loss)) and not loss.requires_grad
    assert all(p.grad is None for p in trainer.model.parameters())
    assert {"entropy", "policy_loss", "clip_ratio/region_mean"} <= trainer._metrics["eval"].keys()
