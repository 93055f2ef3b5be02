"""grpo over torch.distributed (issue 46): vocabulary- and data-parallel steps equal the single process's.

Each test spawns 2 or 4 processes (torch.multiprocessing, gloo on
loopback); every rank runs the step on its part (a contiguous shard of W's
rows and the bias, every hidden row: vocab_group; its own sequences and all
of W: data_group; both: a 2 x 2 grid) and saves what it got; the parent
compares them with one process's call on the whole inputs. The C++ step sums
every floating-point value across ranks itself, in rank order; what is
bitwise and what is not is stated per quantity below.
"""

import datetime
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import grpo
import grpo.torch as gt
from reference import make_case

B, T, H, V = 4, 6, 32, 96
TOKEN_BLOCK = 8  # several token blocks: the per-block exchanges run more than once
VOCAB_TILE = 16  # shards on tile boundaries merge the tiles' statistics in the single process's order


def _case(dtype):
    return make_case(seed=71, dtype=dtype, b=B, t=T, h=H, v=V, loss_type="grpo", beta=0.04)


def _call(case, hidden, weight, bias, ids, mask, adv, old, ref, **kw):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    out = gt.lm_head_grpo_loss(x, w, ids, mask, adv, bias=b, old_logp=old, ref_logp=ref, beta=0.04,
                               return_entropy=True, token_block=TOKEN_BLOCK, vocab_tile=VOCAB_TILE, num_threads=1, **kw)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logp": out.per_token_logps, "entropy": out.entropy, "kl": out.kl,
            "metrics": out.metrics_tensor, "dhidden": x.grad, "dweight": w.grad, "dbias": b.grad}


def _exit_now():
    """Ends a worker without the interpreter's finalization: gloo's worker thread may still be releasing the last
    collectives' tensors, whose Python objects it can then no longer decref (std::terminate in torch's
    ProcessGroupGloo::runLoop; seen about once in 20 spawns). Every result is saved by then."""
    os._exit(0)


def _worker(rank, size, run, scenario, dtype, shards, out_dir):
    """One rank: the process group, run(...) (a scenario; each saves its results in out_dir), then exit."""
    import torch.distributed as dist

    # A bounded timeout: a rank left waiting in a collective fails the test instead of hanging it.
    # A FileStore: no store server thread in rank 0 to race the others' teardown at exit.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        run(rank, size, scenario, dtype, shards, out_dir)
    finally:
        dist.barrier()  # no rank tears its connections down while another still receives
        dist.destroy_process_group()
    _exit_now()


def _run(rank, size, scenario, dtype, shards, out_dir):
    """The fused loss's scenarios (one rank's part)."""
    import torch.distributed as dist

    case = _case(dtype)
    vocab = data = None
    v_rank, d_rank = rank, 0
    if scenario == "grid":  # ranks (d, v) = (rank // 2, rank % 2)
        d_rank, v_rank = divmod(rank, 2)
        vocab_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        vocab, data = vocab_groups[d_rank], data_groups[v_rank]
    elif scenario == "vocab":
        vocab = dist.group.WORLD
    else:
        data, d_rank, v_rank = dist.group.WORLD, rank, 0
    rows = slice(None)
    if data is not None:
        per = B // (2 if scenario == "grid" else size)
        rows = slice(d_rank * per, (d_rank + 1) * per)
    cols = slice(None)
    if vocab is not None:
        cols = slice(shards[v_rank], shards[v_rank + 1])
    kw = {"vocab_group": vocab, "data_group": data}
    if scenario == "refuse":
        # Data-parallel, the last rank's last row has a k3 KL beyond float32: met inside the schedule, after
        # earlier token blocks ran, and exchanged by the C++ step at its end.
        rows = slice(rank * (B // size), (rank + 1) * (B // size))
        ref = case.ref_logp[rows].clone()
        if rank == size - 1:
            ref[-1, -1] = 120.0
        try:
            _call(case, case.hidden[rows], case.weight, case.bias, case.ids[rows], case.mask[rows],
                  case.advantages[rows], case.old_logp[rows], ref, data_group=dist.group.WORLD)
        except grpo.Error as error:
            torch.save({"refused": str(error), "argument": error.argument},
                       os.path.join(out_dir, f"{rank}.pt"))
        return
    if scenario == "refuse_python":
        hidden = case.hidden if rank != 0 else case.hidden.double()  # refused by the Python checks on rank 0
        try:
            _call(case, hidden, case.weight[cols], case.bias[cols], case.ids, case.mask, case.advantages,
                  case.old_logp, case.ref_logp, vocab_group=dist.group.WORLD)
        except (grpo.Error, TypeError) as error:
            torch.save({"refused": str(error), "argument": getattr(error, "argument", None)},
                       os.path.join(out_dir, f"{rank}.pt"))
        return
    if scenario == "new_shape":
        # Data-parallel; the second call: rank 0's batch has the first call's shape (its plan cached), rank 1's
        # a shorter one (a new plan, built collectively): every rank builds again, no rank waits.
        losses = []
        for t in ((T, T), (T, T - 2)):
            tt = t[rank]
            out = _call(case, case.hidden[rows, :tt], case.weight, case.bias, case.ids[rows, :tt],
                        case.mask[rows, :tt], case.advantages[rows], case.old_logp[rows, :tt],
                        case.ref_logp[rows, :tt], data_group=data)
            losses.append(out["loss"])
        torch.save({"losses": torch.stack(losses)}, os.path.join(out_dir, f"{rank}.pt"))
        return
    if scenario == "packed_data":
        # Data-parallel, each rank's sequences packed into one row with cu_seqlens: the global sequence count is
        # the ranks' S summed (grpo's 1 / B and the clip ratios over sequences), not their shapes' batch of 1.
        per = rows.stop - rows.start
        flat = lambda t: t[rows].reshape(1, per * T, *t.shape[2:])  # noqa: E731
        got = _call(case, flat(case.hidden), case.weight, case.bias, flat(case.ids), flat(case.mask),
                    case.advantages[rows], flat(case.old_logp), flat(case.ref_logp), data_group=data,
                    cu_seqlens=torch.arange(0, per * T + 1, T))
        got.update(rows=(rows.start, rows.stop))
        torch.save(got, os.path.join(out_dir, f"{rank}.pt"))
        return
    if scenario == "dropin":  # Liger's module, dapo: the normalizer is the global count
        module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="dapo", num_threads=1, data_group=data)
        x = case.hidden[rows].clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        loss, metrics = module(x, w, case.ids[rows], case.mask[rows], case.advantages[rows],
                               ref_per_token_logps=case.ref_logp[rows], old_per_token_logps=case.old_logp[rows],
                               num_items_in_batch=case.mask.sum())
        loss.backward()
        torch.save({"loss": loss.detach(), "metrics": torch.stack(metrics), "dhidden": x.grad, "dweight": w.grad,
                    "rows": (rows.start, rows.stop)}, os.path.join(out_dir, f"{rank}.pt"))
        return
    got = _call(case, case.hidden[rows], case.weight[cols], case.bias[cols], case.ids[rows], case.mask[rows],
                case.advantages[rows], case.old_logp[rows], case.ref_logp[rows], **kw)
    got.update(rows=(rows.start, rows.stop), cols=(cols.start, cols.stop))
    torch.save(got, os.path.join(out_dir, f"{rank}.pt"))


def _spawn(size, scenario, dtype, shards=None, run=None):
    """size processes running scenario (run: _run, the loss's scenarios, or _lp_run, the log-prob head's); their
    results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(size, run or _run, scenario, dtype, shards, out_dir), nprocs=size, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(size)]


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])


def _single(dtype):
    case = _case(dtype)
    return _call(case, case.hidden, case.weight, case.bias, case.ids, case.mask, case.advantages, case.old_logp,
                 case.ref_logp)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _close(got, want, dtype, what):
    """Within float32 roundings of sums taken in another order (a loss with cancelling terms: 1e-5; bf16 values:
    within a bf16 rounding)."""
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 or got.dtype == torch.float32 else 1e-2), what


@DTYPES
@pytest.mark.parametrize("shards", [(0, 48, 96), (0, 32, 96), (0, 40, 96)], ids=["even", "uneven", "unaligned"])
def test_vocab_parallel_equals_one_process(dtype, shards):
    """Shards on tile boundaries: loss, per-token outputs, metrics and each rank's dW / dbias rows bitwise the
    single process's (the same per-tile GEMMs, statistics merged in the same tile order); dhidden, the shards'
    partials summed in rank order, within float32 roundings of the one-process sum. A shard boundary inside a
    tile (unaligned) changes the tiles, so everything is within roundings there."""
    one = _single(dtype)
    aligned = all(bound % VOCAB_TILE == 0 for bound in shards)
    for rank, got in enumerate(_spawn(2, "vocab", dtype, list(shards))):
        c0, c1 = got["cols"]
        assert got["dweight"].dtype == dtype, rank
        pairs = [(got[k], one[k], k) for k in ("loss", "logp", "entropy", "kl", "metrics")]
        pairs += [(got["dweight"], one["dweight"][c0:c1], "dweight"), (got["dbias"], one["dbias"][c0:c1], "dbias")]
        for a, b, what in pairs:
            if aligned:
                assert torch.equal(a, b), (rank, what)
            else:
                _close(a, b, dtype, (rank, what))
        _close(got["dhidden"], one["dhidden"], dtype, (rank, "dhidden"))


@DTYPES
def test_data_parallel_equals_one_process(dtype):
    """Each rank's rows: per-token outputs bitwise; the loss, metrics, dhidden rows (other GEMM row counts) and
    dW / dbias (per-rank sums, then a rank-order sum) within float32 roundings of the one-process values."""
    one = _single(dtype)
    for rank, got in enumerate(_spawn(2, "data", dtype)):
        r0, r1 = got["rows"]
        for key in ("logp", "entropy", "kl"):
            assert torch.equal(got[key], one[key][r0:r1]), (rank, key)
        _close(got["dhidden"], one["dhidden"][r0:r1], dtype, (rank, "dhidden"))
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["metrics"], one["metrics"], rtol=1e-6, atol=1e-7)
        _close(got["dweight"], one["dweight"], dtype, (rank, "dweight"))
        _close(got["dbias"], one["dbias"], dtype, (rank, "dbias"))


def test_packed_data_parallel_equals_one_padded_process():
    """Each rank's sequences packed (cu_seqlens): the loss and metrics are the one padded process's within
    float32 roundings (the global sequence count is the ranks' S summed), per-token outputs bitwise."""
    one = _single(torch.float32)
    for rank, got in enumerate(_spawn(2, "packed_data", torch.float32)):
        r0, r1 = got["rows"]
        for key in ("logp", "entropy", "kl"):
            assert torch.equal(got[key].reshape(-1), one[key][r0:r1].reshape(-1)), (rank, key)
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["metrics"], one["metrics"], rtol=1e-6, atol=1e-7)
        _close(got["dhidden"].reshape(-1, H), one["dhidden"][r0:r1].reshape(-1, H), torch.float32, (rank, "dhidden"))
        _close(got["dweight"], one["dweight"], torch.float32, (rank, "dweight"))


@DTYPES
def test_grid_two_by_two_equals_one_process(dtype):
    one = _single(dtype)
    shards = [0, 48, 96]
    for rank, got in enumerate(_spawn(4, "grid", dtype, shards)):
        r0, r1 = got["rows"]
        c0, c1 = got["cols"]
        for key in ("logp", "entropy", "kl"):
            assert torch.equal(got[key], one[key][r0:r1]), (rank, key)
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-6, atol=1e-7)
        _close(got["dweight"], one["dweight"][c0:c1], dtype, (rank, "dweight"))
        _close(got["dhidden"], one["dhidden"][r0:r1], dtype, (rank, "dhidden"))


def test_liger_drop_in_data_parallel_equals_one_process():
    case = _case(torch.float32)
    module = gt.LmHeadGRPOLoss(beta=0.04, loss_type="dapo", num_threads=1)
    x = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    loss, metrics = module(x, w, case.ids, case.mask, case.advantages, ref_per_token_logps=case.ref_logp,
                           old_per_token_logps=case.old_logp, num_items_in_batch=case.mask.sum())
    loss.backward()
    for rank, got in enumerate(_spawn(2, "dropin", torch.float32)):
        r0, r1 = got["rows"]
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["metrics"], torch.stack(metrics), rtol=1e-5, atol=1e-7)
        _close(got["dhidden"], x.grad[r0:r1], torch.float32, (rank, "dhidden"))
        _close(got["dweight"], w.grad, torch.float32, (rank, "dweight"))


def test_a_shape_new_to_one_rank_builds_the_plan_on_every_rank():
    """A plan's construction is collective: a call where one rank's plan is cached and another's is not must not
    leave the ranks in different collectives (every rank rebuilds); the loss is the same bits on both ranks."""
    results = _spawn(2, "new_shape", torch.float32)
    assert torch.equal(results[0]["losses"], results[1]["losses"])


def test_a_refusal_on_one_rank_reaches_every_rank():
    """A k3 KL beyond float32 on the last rank's last row (met inside the schedule) and a hidden of the wrong dtype on
    rank 0 only (grpo.torch's own check, before any collective): every rank raises, none waits."""
    results = _spawn(2, "refuse", torch.float32)
    assert all("refused" in r for r in results)
    assert all(r["argument"] == "ref_logp" for r in results), results
    results = _spawn(2, "refuse_python", torch.float32)
    assert all("refused" in r for r in results)
    assert results[0]["argument"] == "hidden" and "rank 0" in results[1]["refused"]


# --------------------------------------------------------------------------
# grpo.torch.fused_log_probs over the groups: the generic log-prob head
# --------------------------------------------------------------------------

def _upstream(case):
    """Fixed per-token weights of the loss on log_probs and entropy (seeded, 1/4 of them exactly 0)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) > 0.25)
    e = torch.randn(B, T, generator=g) * 0.1
    return a, e


def _lp_call(hidden, weight, bias, ids, mask, a, e, **kw):
    """log_probs and entropy of the rows given, then the gradients of sum(a * logp + e * entropy)."""
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    logp, ent = gt.fused_log_probs(x, w, b, ids, 0.9, ("log_probs", "entropy"), mask=mask, num_threads=1,
                                   token_block=TOKEN_BLOCK, vocab_tile=VOCAB_TILE, **kw)
    ((logp * a).sum() + (ent * e).sum()).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "dhidden": x.grad, "dweight": w.grad, "dbias": b.grad}


def _lp_run(rank, size, scenario, dtype, shards, out_dir):
    """The log-prob head's scenarios (one rank's part)."""
    import torch.distributed as dist

    case = _case(dtype)
    a, e = _upstream(case)
    mask = case.mask.float()
    if scenario == "refuse":
        # Python's own check on rank 0 (a label beyond int32), before any collective; then the C++ backward's
        # agreement: the last rank of the vocab group holds another upstream gradient.
        cols = slice(shards[rank], shards[rank + 1])
        ids = case.ids.long().clone()
        if rank == 0:
            ids[0, 0] = 2 ** 40
        out = {}
        try:
            _lp_call(case.hidden, case.weight[cols], case.bias[cols], ids, mask, a, e,
                     vocab_group=dist.group.WORLD)
        except grpo.Error as error:
            out["python"] = (str(error), error.argument)
        other = a.clone()
        if rank == size - 1:
            other[mask.bool()] += 1.0
        try:
            _lp_call(case.hidden, case.weight[cols], case.bias[cols], case.ids, mask, other, e,
                     vocab_group=dist.group.WORLD)
        except grpo.Error as error:
            out["backward"] = (str(error), error.argument)
        # The group is still in step: a valid call.
        out["valid"] = _lp_call(case.hidden, case.weight[cols], case.bias[cols], case.ids, mask, a, e,
                                vocab_group=dist.group.WORLD)["logp"]
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
        return
    if scenario == "new_shape":
        # Data-parallel, as the loss's test: the second call's rows are new to rank 1 only.
        rows = slice(rank * (B // size), (rank + 1) * (B // size))
        logps = []
        for t in ((T, T), (T, T - 2)):
            tt = t[rank]
            got = _lp_call(case.hidden[rows, :tt], case.weight, case.bias, case.ids[rows, :tt],
                           mask[rows, :tt], a[rows, :tt], e[rows, :tt], data_group=dist.group.WORLD)
            logps.append(got["logp"].sum())
        torch.save({"dweight": got["dweight"], "logps": torch.stack(logps)}, os.path.join(out_dir, f"{rank}.pt"))
        return
    vocab = data = None
    v_rank, d_rank, d_size = 0, 0, 1
    if scenario == "grid":  # ranks (d, v) = (rank // 2, rank % 2)
        d_rank, v_rank = divmod(rank, 2)
        d_size = 2
        vocab_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        vocab, data = vocab_groups[d_rank], data_groups[v_rank]
    elif scenario == "vocab":
        vocab, v_rank = dist.group.WORLD, rank
    else:
        data, d_rank, d_size = dist.group.WORLD, rank, size
    rows = slice(d_rank * (B // d_size), (d_rank + 1) * (B // d_size))
    cols = slice(shards[v_rank], shards[v_rank + 1]) if vocab is not None else slice(None)
    got = _lp_call(case.hidden[rows], case.weight[cols], case.bias[cols], case.ids[rows], mask[rows], a[rows],
                   e[rows], vocab_group=vocab, data_group=data)
    got.update(rows=(rows.start, rows.stop), cols=(cols.start, cols.stop))
    torch.save(got, os.path.join(out_dir, f"{rank}.pt"))


def _lp_spawn(size, scenario, dtype, shards=None):
    return _spawn(size, scenario, dtype, shards, run=_lp_run)


def _lp_single(dtype):
    case = _case(dtype)
    a, e = _upstream(case)
    return _lp_call(case.hidden, case.weight, case.bias, case.ids, case.mask.float(), a, e)


@DTYPES
@pytest.mark.parametrize("shards", [(0, 48, 96), (0, 40, 96)], ids=["aligned", "unaligned"])
def test_log_probs_vocab_parallel_equals_one_process(dtype, shards):
    """Shards on tile boundaries: log_probs, entropy and each rank's dW / dbias rows bitwise the single process's
    (the same tile GEMMs and token block, the tiles' statistics merged in the single process's order); dhidden, the
    shards' partials summed in rank order, within float32 roundings. A boundary inside a tile: all within
    roundings."""
    one = _lp_single(dtype)
    aligned = all(bound % VOCAB_TILE == 0 for bound in shards)
    for rank, got in enumerate(_lp_spawn(2, "vocab", dtype, list(shards))):
        c0, c1 = got["cols"]
        assert got["dweight"].dtype == dtype and got["dweight"].shape[0] == c1 - c0, rank
        pairs = [(got["logp"], one["logp"], "logp"), (got["entropy"], one["entropy"], "entropy"),
                 (got["dweight"], one["dweight"][c0:c1], "dweight"), (got["dbias"], one["dbias"][c0:c1], "dbias")]
        for x, y, what in pairs:
            if aligned:
                assert torch.equal(x, y), (rank, what)
            else:
                _close(x, y, dtype, (rank, what))
        _close(got["dhidden"], one["dhidden"], dtype, (rank, "dhidden"))


@DTYPES
def test_log_probs_data_parallel_equals_one_process(dtype):
    """Each rank's rows: log_probs and entropy bitwise; dhidden rows within float32 roundings (other GEMM calls);
    dW / dbias, summed over the group (the gradient of the loss over every rank's rows), within roundings."""
    one = _lp_single(dtype)
    for rank, got in enumerate(_lp_spawn(2, "data", dtype, [0, V])):
        r0, r1 = got["rows"]
        assert torch.equal(got["logp"], one["logp"][r0:r1]), rank
        assert torch.equal(got["entropy"], one["entropy"][r0:r1]), rank
        _close(got["dhidden"], one["dhidden"][r0:r1], dtype, (rank, "dhidden"))
        _close(got["dweight"], one["dweight"], dtype, (rank, "dweight"))
        _close(got["dbias"], one["dbias"], dtype, (rank, "dbias"))


@DTYPES
def test_log_probs_grid_two_by_two_equals_one_process(dtype):
    one = _lp_single(dtype)
    for rank, got in enumerate(_lp_spawn(4, "grid", dtype, [0, 48, 96])):
        r0, r1 = got["rows"]
        c0, c1 = got["cols"]
        assert torch.equal(got["logp"], one["logp"][r0:r1]), rank
        assert torch.equal(got["entropy"], one["entropy"][r0:r1]), rank
        _close(got["dweight"], one["dweight"][c0:c1], dtype, (rank, "dweight"))
        _close(got["dbias"], one["dbias"][c0:c1], dtype, (rank, "dbias"))
        _close(got["dhidden"], one["dhidden"][r0:r1], dtype, (rank, "dhidden"))


def test_log_probs_a_refusal_on_one_rank_reaches_every_rank():
    """A label beyond int32 on rank 0 (grpo.torch's check, before any collective) and, in the backward, another
    upstream gradient on the last rank of a vocab group (the C++ agreement): every rank raises, none waits, and the
    next call runs."""
    one = _lp_single(torch.float32)
    results = _lp_spawn(2, "refuse", torch.float32, [0, 48, 96])
    assert results[0]["python"][1] == "labels" and "rank 0" in results[1]["python"][0], results
    assert all(r["backward"][1] == "grad of log_probs" for r in results), results
    assert "rank 1" in results[0]["backward"][0], results
    for r in results:
        assert torch.equal(r["valid"], one["logp"])


def test_log_probs_a_shape_new_to_one_rank_builds_the_plans_on_every_rank():
    """As the loss's: one rank's plans cached, another's not; every rank rebuilds, none waits; the data group's dW
    (summed over the group) is the same bits on both ranks."""
    results = _lp_spawn(2, "new_shape", torch.float32)
    assert torch.equal(results[0]["dweight"], results[1]["dweight"])
