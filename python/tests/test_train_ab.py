"""scripts/train_ab.py --smoke: the arms of the TRL training A/B (trl, grpo, grpo_loss), 2 steps each, tiny size.

Marked slow: 13-17 s on a quiet 2-core machine, but 45-50 s measured while
other jobs compiled (an arm subprocess per arm, each importing torch /
transformers / TRL, and the warm start), over the fast tier's 30 s. The two
slow tests share one smoke run (the fixture) and its warm start.

The same seed and data order give both arms the same first batch: the
generation runs before any update and never calls the LM-head patch (it runs
the model's plain forward), so step 1's completions, hence rewards, are
identical, and the step-1 loss / KL / entropy differ only by the two heads'
rounding. Checked here, with the per-step records and the summary the full
run's README table is made from.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "train_ab.py"
ARMS = ("trl", "grpo", "grpo_loss")
FIELDS = ("step", "step_s", "generation_s", "logprob_loss_s", "rest_s", "logprob_loss_peak_mib",
          "logprob_loss_rise_mib", "reward", "loss", "kl", "entropy", "clip_ratio", "grad_norm",
          "completion_length")


def _run(out, cache, *args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of the three arms, shared by the tests below (each arm is a process importing torch,
    transformers and TRL: the run is most of this file's time)."""
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not in this checkout")
    root = tmp_path_factory.mktemp("train_ab")
    proc = _run(root / "out", root / "cache", "--arms", ",".join(ARMS))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return root, proc


def _rows(out, arm):
    return [json.loads(line) for line in (out / f"{arm}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_ab_smoke(smoke):
    root, proc = smoke
    out = root / "out"
    summary = json.loads((out / "summary.json").read_text())
    length = summary["setup"]["completion"]
    steps = {}
    for arm in ARMS:
        rows = _rows(out, arm)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert set(FIELDS) <= r.keys(), set(FIELDS) - r.keys()
            assert all(math.isfinite(r[k]) for k in FIELDS)
            assert r["completion_length"] == length  # min_new_tokens: every completion is full length
            assert r["generation_s"] > 0 and r["logprob_loss_s"] > 0 and r["rest_s"] >= 0
            assert r["generation_s"] + r["logprob_loss_s"] <= r["step_s"]
            assert r["logprob_loss_peak_mib"] >= r["logprob_loss_rise_mib"] > 0
        steps[arm] = rows
    a = steps["trl"][0]
    # The smoke's warm start leaves the policy with reward > 0 and < 1, so equality is not 0 == 0.
    assert 0.0 < a["reward"] < 1.0
    for arm in ARMS[1:]:
        b = steps[arm][0]
        assert a["reward"] == b["reward"], arm
        # Same completions, another head (and for grpo_loss another loss): the entropy (a mean over ~100
        # tokens of bf16-rounded logits, TRL's tiles) within a few bf16 ulps of its size; step 1's KL is 0
        # (policy == reference) and the gradient norm agrees to the bf16 rounding of the logits.
        assert abs(a["entropy"] - b["entropy"]) <= 8 * 2.0**-8 * abs(a["entropy"]), arm
        assert a["kl"] == 0.0 and b["kl"] == 0.0, arm
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 8 * 2.0**-8 * a["grad_norm"], arm
        assert summary["agreement"][arm]["step1_reward_identical"] is True
        assert set(summary["ratios_over_trl"][arm]) >= {"logprob_loss_time", "logprob_loss_peak_rss"}
        assert f"| {arm} / trl |" in proc.stdout
    assert summary["setup"]["bf16_matmul"] in ("native", "f32")  # "auto" is resolved before the run


@pytest.mark.slow
def test_train_ab_resumes_a_killed_arm_bit_for_bit(smoke):
    """--checkpoint-every (an arm longer than a session): an arm killed right after its step-1 checkpoint and run
    again goes on from it and logs the same reward, loss, KL, entropy and gradient norm at every step as the smoke's
    arm, which never stopped and saved nothing; a run of another setup is refused; a complete arm is kept, not run
    again."""
    import os

    root, _ = smoke
    out, arm = root / "resumed", "grpo_loss"

    def run(*extra, kill_after=None):
        env = dict(os.environ)
        env.pop("GRPO_TRAIN_AB_KILL_AFTER_SAVE", None)
        if kill_after is not None:
            env["GRPO_TRAIN_AB_KILL_AFTER_SAVE"] = str(kill_after)
        return _run(out, root / "cache", "--arms", arm, "--checkpoint-every", "1", *extra, env=env)

    killed = run(kill_after=1)
    assert killed.returncode != 0
    assert [r["step"] for r in _rows(out, arm)] == [1]
    assert (out / f"{arm}.checkpoints" / "checkpoint-1").is_dir()
    other = run("--set", "learning_rate=1e-4")
    assert other.returncode != 0 and "learning_rate differ" in other.stdout + other.stderr
    resumed = run()
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "resumed" in resumed.stdout
    a, b = _rows(root / "out", arm), _rows(out, arm)
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        for key in ("reward", "loss", "kl", "entropy", "grad_norm"):
            assert x[key] == y[key], (x["step"], key)
    assert 0.0 < a[-1]["kl"]  # the policy moved: step 2 depends on the resumed weights and optimizer state
    info = json.loads((out / f"{arm}.info.json").read_text())
    assert [(s["from_step"], s["to_step"]) for s in info["segments"]] == [(0, 1), (1, 2)]
    assert info["seconds"] == pytest.approx(sum(s["wall_s"] for s in info["segments"]))
    assert not (out / f"{arm}.checkpoints").exists()  # spent checkpoints are removed
    again = run()
    assert again.returncode == 0 and f"{arm}: complete" in again.stdout
    assert _rows(out, arm) == b


def _train_ab_module():
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not in this checkout")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_ab
    finally:
        sys.path.pop(0)
    return train_ab


def test_f32_matmul_mode_is_f32_products_rounded_to_bf16():
    """bf16_matmul="f32" (CPUs without bf16 dot products): linear's forward and both backward products come out
    as the f32 products of the bf16 values rounded to bf16, bit for bit; f32 matmuls are left alone."""
    import torch

    train_ab = _train_ab_module()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(130, 96, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(130, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(37, 130, generator=gen).bfloat16()
    mode = train_ab.F32Matmul()
    with mode:
        y = torch.nn.functional.linear(x, w, b)
        y.backward(g)
        y3 = torch.matmul(x.detach().view(1, 37, 96).expand(2, 37, 96), w.detach().t())  # bmm
        f = torch.randn(5, 7) @ torch.randn(7, 3)
        tile = torch.empty(37, 130, dtype=torch.bfloat16)
        before = mode.products
        torch.mm(x.detach(), w.detach().t(), out=tile)  # the out= form (TRL's chunked LM head)
        assert mode.products == before + 1  # computed by the mode (torch's own bf16 product can be equal)
    xf, wf, gf = x.detach().float(), w.detach().float(), g.float()
    assert torch.equal(tile, (xf @ wf.t()).bfloat16())
    assert torch.equal(y, (torch.addmm(b.detach().float(), xf, wf.t())).bfloat16())
    assert torch.equal(x.grad, (gf @ wf).bfloat16())
    assert torch.equal(w.grad, (gf.t() @ xf).bfloat16())
    assert torch.equal(y3[1], (xf @ wf.t()).bfloat16())
    assert f.dtype == torch.float32


def test_bf16_matmul_setting():
    train_ab = _train_ab_module()
    assert train_ab.Setup(bf16_matmul="native").bf16_matmul == "native"
    expect = "native" if train_ab.cpu_has_bf16_matmul() else "f32"
    assert train_ab.Setup().bf16_matmul == expect
    # Only a non-native setting changes the warm start's cache key (the native runs' caches stay valid).
    assert train_ab.Setup(bf16_matmul="native").model_key() != train_ab.Setup(bf16_matmul="f32").model_key()
    with pytest.raises(SystemExit, match="bf16_matmul=fp8"):
        train_ab.Setup(bf16_matmul="fp8")


def test_f32_matmul_mode_twins_follow_the_weight():
    """Under autocast a large f32 weight is cast to bf16 on every call and the products use the f32 twin of the
    bf16 values kept from the first cast: still bitwise the f32 products rounded, and after an in-place update of
    the weight (the optimizer step) the new values, not the kept ones."""
    import torch

    train_ab = _train_ab_module()
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(1024, 1024, generator=gen)  # 1M elements: the size the twins are kept for
    x = torch.randn(9, 1024, generator=gen)

    def expect():
        return (x.bfloat16().float() @ w.bfloat16().float().t()).bfloat16()

    mode = train_ab.F32Matmul()
    with mode:
        for update in range(3):
            for _ in range(2):  # the second call uses the twin of the first call's cast
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = torch.nn.functional.linear(x, w)
                assert torch.equal(y, expect()), update
            w.mul_(-0.5)
    assert len(mode.twins) > 0  # the twin path ran


@pytest.mark.slow
def test_export_trained_head_smoke(smoke):
    """scripts/export_trained_head.py (issue 20's real trained head) end to end on the smoke's warm start: trains
    the policy through train_ab's own arm (2 GRPO steps), runs it on a batch of its completions and writes the
    microbench input and its stats."""
    root, _ = smoke
    script = SCRIPT.parent / "export_trained_head.py"
    out = root / "head.grpoin"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out), "--cache-dir",
                           str(root / "cache")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "trained in" in proc.stdout  # not a cached policy: the fixture's cache holds only the warm start
    stats = json.loads(out.with_name(out.name + ".json").read_text())
    assert stats["steps"] == 2 and stats["train_seconds"] > 0
    assert out.stat().st_size > 0 and 0.0 < stats["frac_above_eps"] < 1.0
