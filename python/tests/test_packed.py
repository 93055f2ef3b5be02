"""Packed sequences from Python: cu_seqlens / position_ids equal the padded call on the same tokens.

A padded batch of B sequences of T rows whose tails (past each length L_i)
are padding, and the same tokens packed into one row of N = sum L_i. The
loss, metrics, per-token logp / entropy / kl and dhidden rows are bitwise
the padded call's (the coefficient stage sums the same rows in the same
order; a row's logits and dhidden do not depend on its neighbours); dW and
dbias are bitwise when both calls' rows fit one token block, else within
float32 (bf16: one rounding of the weight's dtype) of the padded ones (the
blocks group rows differently). Every loss type, sequence-level IS,
per-sequence and per-token advantages and is_weight, several sequences per
token block and sequences crossing blocks.
"""

import pytest
import torch

import grpo
import grpo.torch as gt

LOSSES = [
    ("grpo", {}), ("bnpo", {}), ("dr_grpo", {"max_completion_length": 24}),
    ("dapo", {"num_items_in_batch": 50.0, "beta": 0.04}), ("cispo", {"num_items_in_batch": 50.0}),
    ("sapo", {}), ("luspo", {"importance_sampling_level": "sequence"}),
    ("vespo", {"num_items_in_batch": 50.0, "is_weight": "token"}),
    ("grpo", {"importance_sampling_level": "sequence"}),
    ("grpo", {"importance_sampling_level": "sequence", "advantages": "token"}),
    ("grpo", {"is_weight": "sequence", "off_policy_mask_threshold": 0.05}),
    ("bnpo", {"entropy_coef": 0.01, "advantages": "token"}),
]


def batch(dtype, lengths=(24, 5, 17, 1, 24, 9), t=24, h=16, v=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    bias = torch.randn(v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.15).float()
    for i, n in enumerate(lengths):
        mask[i, n:] = 0.0  # padding
    keep = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    rows = keep.reshape(-1).nonzero().flatten()
    old = torch.randn(b, t, generator=g) * 0.3 - 4.0
    ref = torch.randn(b, t, generator=g) * 0.3 - 4.0
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
    return dict(hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, rows=rows, old=old, ref=ref,
                adv_seq=torch.randn(b, generator=g), adv_tok=torch.randn(b, t, generator=g),
                isw_seq=0.5 + torch.rand(b, generator=g), isw_tok=0.5 + torch.rand(b, t, generator=g),
                offsets=offsets, lengths=lengths)


def flat(x, rows):
    return x.reshape(-1)[rows]


def run(case, loss_type, options, packed: bool, token_block=None, via="cu_seqlens"):
    opts = dict(options)
    adv_kind, isw_kind = opts.pop("advantages", "sequence"), opts.pop("is_weight", None)
    rows = case["rows"]
    hidden = case["hidden"].clone()
    weight = case["weight"].clone().requires_grad_()
    bias = case["bias"].clone().requires_grad_()
    adv = case["adv_seq"] if adv_kind == "sequence" else case["adv_tok"]
    isw = None if isw_kind is None else case["isw_seq"] if isw_kind == "sequence" else case["isw_tok"]
    if packed:
        h = hidden.shape[-1]
        hidden = hidden.reshape(-1, h)[rows].clone().unsqueeze(0).requires_grad_()
        tok = lambda x: None if x is None else flat(x, rows).unsqueeze(0)  # noqa: E731
        ids, mask, old, ref = tok(case["ids"]), tok(case["mask"]), tok(case["old"]), tok(case["ref"])
        adv = adv if adv_kind == "sequence" else tok(adv)
        isw = isw if isw_kind != "token" else tok(isw)
        if via == "cu_seqlens":
            opts["cu_seqlens"] = case["offsets"]
        else:
            opts["position_ids"] = torch.cat([torch.arange(n) for n in case["lengths"]]).unsqueeze(0)
    else:
        hidden.requires_grad_()
        ids, mask, old, ref = case["ids"], case["mask"], case["old"], case["ref"]
    out = gt.lm_head_grpo_loss(hidden, weight, ids, mask, adv, bias=bias, old_logp=old,
                               ref_logp=ref if opts.get("beta") else None, is_weight=isw, loss_type=loss_type,
                               return_entropy=True, token_block=token_block, num_threads=1,
                               plan_cache=grpo.PlanCache(), **opts)
    out.loss.backward()
    return out, hidden.grad, weight.grad, bias.grad


def bitwise(a, b):
    bits = lambda t: t.detach().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("token_block", [None, 32], ids=["one_block", "crossing_blocks"])
@pytest.mark.parametrize("loss_type,options", LOSSES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOSSES)])
def test_packed_equals_padded(loss_type, options, token_block, dtype):
    case = batch(dtype)
    rows = case["rows"]
    padded, dh_pad, dw_pad, db_pad = run(case, loss_type, options, packed=False, token_block=token_block)
    packed, dh_pack, dw_pack, db_pack = run(case, loss_type, options, packed=True, token_block=token_block)
    assert packed.per_token_logps.shape == (1, rows.numel())
    assert bitwise(packed.loss, padded.loss)
    assert bitwise(packed.metrics_tensor, padded.metrics_tensor)
    assert bitwise(packed.per_token_logps.reshape(-1), flat(padded.per_token_logps, rows))
    assert bitwise(packed.entropy.reshape(-1), flat(padded.entropy, rows))
    if padded.kl is not None:
        assert bitwise(packed.kl.reshape(-1), flat(padded.kl, rows))
    h = dh_pad.shape[-1]
    assert bitwise(dh_pack.reshape(-1, h), dh_pad.reshape(-1, h)[rows])
    if token_block is None:  # both calls in one block: the same rows in the same GEMMs
        assert bitwise(dw_pack, dw_pad) and bitwise(db_pack, db_pad)
    else:
        # a rounding of the weight's dtype (per token block) / f32 sums
        rel = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 1e-5)
        assert torch.allclose(dw_pack.float(), dw_pad.float(), rtol=rel, atol=rel * float(dw_pad.float().abs().max()))
        assert torch.allclose(db_pack, db_pad, rtol=1e-5, atol=1e-5 * float(db_pad.abs().max()))


def test_position_ids_give_the_cu_seqlens_call():
    case = batch(torch.float32)
    a = run(case, "grpo", {"importance_sampling_level": "sequence"}, packed=True, via="cu_seqlens")
    b = run(case, "grpo", {"importance_sampling_level": "sequence"}, packed=True, via="position_ids")
    assert bitwise(a[0].loss, b[0].loss) and all(bitwise(x, y) for x, y in zip(a[1:], b[1:]))


def test_liger_drop_in_packed_equals_padded():
    case = batch(torch.float32)
    rows = case["rows"]
    results = []
    for packed in (False, True):
        module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="grpo", importance_sampling_level="sequence",
                                   use_ref_model=True, num_threads=1)
        x = case["hidden"].clone()
        w = case["weight"].clone().requires_grad_()
        args = dict(ids=case["ids"], mask=case["mask"], old=case["old"], ref=case["ref"])
        extra = {}
        if packed:
            x = x.reshape(-1, x.shape[-1])[rows].unsqueeze(0)
            args = {k: flat(t, rows).unsqueeze(0) for k, t in args.items()}
            extra["cu_seqlens"] = case["offsets"]
        x.requires_grad_()
        loss, metrics = module(x, w, args["ids"], args["mask"], case["adv_seq"], ref_per_token_logps=args["ref"],
                               old_per_token_logps=args["old"], **extra)
        loss.backward()
        results.append((loss, metrics, x.grad.reshape(-1, x.shape[-1]), w.grad))
    (l0, m0, dx0, dw0), (l1, m1, dx1, dw1) = results
    assert bitwise(l0, l1)
    assert len(m0) == len(m1) == 2 and all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert bitwise(dx1, dx0[rows]) and bitwise(dw0, dw1)
    assert float(m0[1]) > 0  # the sequence-level clip metric is exercised (some sequences clipped)


def test_fused_log_probs_takes_and_checks_the_packing():
    case = batch(torch.float32)
    rows = case["rows"]
    x = case["hidden"].reshape(-1, case["hidden"].shape[-1])[rows].unsqueeze(0)
    labels = flat(case["ids"], rows).unsqueeze(0)
    plain = gt.fused_log_probs(x, case["weight"], None, labels)
    packed = gt.fused_log_probs(x, case["weight"], None, labels, cu_seqlens=case["offsets"])
    assert torch.equal(plain[0], packed[0])
    bad = case["offsets"].clone()
    bad[-1] -= 1
    with pytest.raises(grpo.Error, match="cu_seqlens") as err:
        gt.fused_log_probs(x, case["weight"], None, labels, cu_seqlens=bad)
    assert err.value.argument == "cu_seqlens"


@pytest.mark.parametrize("what", ["not_increasing", "not_from_zero", "not_to_n", "both", "batch_of_two",
                                  "padded_advantages", "positions_not_from_zero", "float_offsets"])
def test_refusals_name_the_argument_and_leave_grads(what):
    case = batch(torch.float32)
    rows = case["rows"]
    n = rows.numel()
    x = case["hidden"].reshape(-1, case["hidden"].shape[-1])[rows].unsqueeze(0).clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    w.grad = torch.full_like(w, 3.0)
    ids, mask = flat(case["ids"], rows).unsqueeze(0), flat(case["mask"], rows).unsqueeze(0)
    adv, offsets = case["adv_seq"], case["offsets"].clone()
    kw = {"cu_seqlens": offsets}
    argument = "cu_seqlens"
    if what == "not_increasing":
        offsets[2] = offsets[1]
    elif what == "not_from_zero":
        offsets[0] = 1
    elif what == "not_to_n":
        offsets[-1] = n + 3
    elif what == "both":
        kw["position_ids"] = torch.zeros(1, n, dtype=torch.int64)
        argument = "position_ids"
    elif what == "batch_of_two":
        x = torch.cat([x, x]).detach().requires_grad_()
        argument = "hidden"
    elif what == "padded_advantages":
        adv = torch.randn(len(case["lengths"]) + 1)
        argument = "advantages"
    elif what == "positions_not_from_zero":
        kw = {"position_ids": torch.arange(1, n + 1).unsqueeze(0)}
        argument = "position_ids"
    elif what == "float_offsets":
        kw = {"cu_seqlens": offsets.float()}
    with pytest.raises((grpo.Error, grpo.ArgumentTypeError)) as err:
        gt.lm_head_grpo_loss(x, w, ids, mask, adv, **kw).loss.backward()
    assert err.value.argument == argument, str(err.value)
    assert x.grad is None and torch.equal(w.grad, torch.full_like(w, 3.0))


def test_compiled_packed_call_equals_eager():
    case = batch(torch.float32)
    rows = case["rows"]
    x = case["hidden"].reshape(-1, case["hidden"].shape[-1])[rows].unsqueeze(0)
    ids, mask = flat(case["ids"], rows).unsqueeze(0), flat(case["mask"], rows).unsqueeze(0)

    def step(x, w):
        return gt.lm_head_grpo_loss(x, w, ids, mask, case["adv_seq"], cu_seqlens=case["offsets"],
                                    importance_sampling_level="sequence", old_logp=flat(case["old"], rows)[None]).loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for f in (step, compiled):
        xx, ww = x.clone().requires_grad_(), case["weight"].clone().requires_grad_()
        loss = f(xx, ww)
        loss.backward()
        grads.append((loss.detach(), xx.grad, ww.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_whole_sequence_rules_take_one_pass_when_every_packed_sequence_fits_a_block():
    """GSPO on packed sequences: blocks end on sequence boundaries, so with every sequence within a token
    block the logits are computed once (fewer than 2N GEMM rows); with a block shorter than a sequence the
    two-pass schedule computes them twice (at least 2N)."""
    case = batch(torch.float32)
    n = case["rows"].numel()
    rows = {}
    for token_block in (32, 16):  # the longest sequence has 24 tokens
        out = run(case, "grpo", {"importance_sampling_level": "sequence"}, packed=True, token_block=token_block)[0]
        rows[token_block] = out.stats["logits_gemm_rows"]
    assert rows[32] < 2 * n <= rows[16], rows
