"""python -m grpo.bench runs end to end: a tiny shape, the C++ microbench of the same workload beside it."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICROBENCH = os.environ.get("GRPO_MICROBENCH", os.path.join(REPO, "build", "microbench", "grpo-microbench"))


def run_bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--shape", "1,8,16,64", "--steps", "1",
                           "--out", str(out), *args], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_bench_runs(tmp_path):
    data, stdout = run_bench(tmp_path, "--methods", "eager,grpo_head,grpo_loss", "--microbench", "none")
    results = data["results"]
    assert [r["method"] for r in results] == ["eager", "grpo_head", "grpo_loss"]
    assert all(r["peak_rss_mib"] >= r["base_rss_mib"] > 0 and r["step_s"] > 0 for r in results)
    # Same loss from the materialized logits and from grpo's head (bf16 inputs: TRL's eager logits are bf16).
    assert abs(results[0]["loss"] - results[1]["loss"]) < 0.05
    # The fused loss and the head + torch loss compute the same workload.
    assert abs(results[2]["loss"] - results[1]["loss"]) < 1e-3
    grpo_loss = results[2]
    assert grpo_loss["active_rows"] > 0 and 0 < grpo_loss["kernel_s"] <= grpo_loss["step_s"]
    assert data["cpu_model"] and "workload offpolicy: loss_type grpo" in stdout


@pytest.mark.skipif(not os.access(MICROBENCH, os.X_OK), reason="build/microbench/grpo-microbench not built")
def test_bench_runs_the_cpp_step_of_the_same_workload(tmp_path):
    data, stdout = run_bench(tmp_path, "--methods", "grpo_loss", "--workload", "dapo_kl", "--microbench", MICROBENCH)
    cpp, ours = data["results"]
    assert cpp["method"] == "cpp" and ours["method"] == "grpo_loss"
    assert "loss.loss_type=dapo" in cpp["sets"] and "dweight_dtype=bf16" in cpp["sets"]
    assert cpp["step_s"] > 0 and ours["ratio_vs_cpp"] == pytest.approx(ours["step_s"] / cpp["step_s"])
    # dapo with a KL term keeps every row active on both sides: the same executed GEMM work.
    assert ours["active_rows"] == 8
    assert cpp["executed_gflop"] == pytest.approx(ours["executed_gflop"], rel=0.05)


@pytest.mark.skipif(not os.access(MICROBENCH, os.X_OK), reason="build/microbench/grpo-microbench not built")
def test_bench_outside_the_checkout_finds_the_configs_beside_the_binary(tmp_path):
    """A pip user runs python -m grpo.bench from anywhere: with a checkout's binary its configs are found."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "GRPO_REPO"}
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--shape", "1,8,16,64", "--steps", "1", "--out",
                           str(out), "--methods", "grpo_loss", "--microbench", MICROBENCH],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cpp, ours = json.loads(out.read_text())["results"]
    assert cpp["method"] == "cpp" and "error" not in cpp, cpp
    assert ours["ratio_vs_cpp"] > 0


@pytest.mark.skipif(not os.access(MICROBENCH, os.X_OK), reason="build/microbench/grpo-microbench not built")
def test_bench_says_how_to_point_at_the_configs(tmp_path):
    """A binary outside any checkout, run outside it: no C++ rows, and a line saying what to set."""
    import shutil

    binary = tmp_path / "grpo-microbench"
    shutil.copy(MICROBENCH, binary)
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "GRPO_REPO"}
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--shape", "1,8,16,64", "--steps", "1", "--out",
                           str(out), "--methods", "grpo_loss", "--microbench", str(binary)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "set GRPO_REPO=<checkout>" in proc.stdout
    assert [r["method"] for r in json.loads(out.read_text())["results"]] == ["grpo_loss"]


def test_bench_cross_entropy_rows(tmp_path):
    """grpo_ce beside eager_ce: the same cross entropy (sum of -logp over every token) two ways."""
    data, _stdout = run_bench(tmp_path, "--methods", "grpo_ce,eager_ce", "--microbench", "none")
    ours, eager = data["results"]
    assert ours["method"] == "grpo_ce" and eager["method"] == "eager_ce"
    assert ours["step_s"] > 0 and eager["step_s"] > 0
    assert abs(ours["loss"] - eager["loss"]) < 1e-2 * abs(eager["loss"])  # bf16 logits on torch's side



def test_bench_trl_row_takes_the_fused_path(tmp_path):
    """grpo_trl: a patched GRPOTrainer's loss; no grpo warning (a fallback to TRL's path would warn), the loss
    of the workload's options on the model's own log-probs (finite: old = logp + noise, grpo loss)."""
    data, stdout = run_bench(tmp_path, "--methods", "grpo_trl", "--microbench", "none")
    (row,) = data["results"]
    assert row["method"] == "grpo_trl" and "warnings" not in row, row
    assert row["step_s"] > 0 and row["peak_rss_mib"] >= row["base_rss_mib"] > 0
    assert abs(row["loss"]) < 10


def test_bench_vocab_parallel_ranks_compute_the_one_process_loss(tmp_path):
    """grpo_vocab: two gloo processes, a half of W each; the global loss is the one-process call's, each rank
    reports, and the peak ratio is to grpo_loss in the same run."""
    data, stdout = run_bench(tmp_path, "--methods", "grpo_loss,grpo_vocab", "--ranks", "2", "--threads", "2",
                             "--microbench", "none")
    one, vocab = data["results"]
    assert vocab["method"] == "grpo_vocab" and "error" not in vocab, vocab
    assert vocab["ranks"] == 2 and vocab["threads"] == 1 and len(vocab["per_rank"]) == 2
    assert all(r["loss"] == vocab["loss"] for r in vocab["per_rank"])  # every rank holds the global loss
    assert vocab["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
    assert vocab["step_s"] == max(r["step_s"] for r in vocab["per_rank"])
    assert vocab["peak_ratio_vs_grpo_loss"] == pytest.approx(vocab["peak_rise_mib"] / one["peak_rise_mib"])


def test_bench_refuses_zero_ranks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--ranks", "0", "--methods", "grpo_vocab"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "--ranks must be >= 1, got 0" in proc.stderr


def test_bench_lengths_packed_padded_unpadded(tmp_path):
    """--lengths: a padded batch of those completions (grpo_loss), its tokens packed (grpo_packed: the padded
    call's loss) and as one sequence (grpo_unpadded); ratios to the unpadded call."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--shape", "1,8,16,64", "--lengths", "3-9x3",
                           "--steps", "1", "--out", str(out), "--methods", "grpo_loss,grpo_packed,grpo_unpadded"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    padded, packed, unpadded = json.loads(out.read_text())["results"]
    assert (padded["B"], padded["T"]) == (3, 9) and padded["lengths"] == [3, 6, 9]
    assert packed["loss"] == padded["loss"]  # the same tokens, the same per-sequence rules
    assert packed["active_rows"] == padded["active_rows"] == unpadded["active_rows"]
    assert unpadded["ratio_vs_unpadded"] == 1.0
    assert packed["ratio_vs_unpadded"] == pytest.approx(packed["step_s"] / unpadded["step_s"])
    bad = subprocess.run([sys.executable, "-m", "grpo.bench", "--methods", "grpo_packed"], capture_output=True,
                         text=True, cwd=REPO)
    assert bad.returncode != 0 and "method grpo_packed needs --lengths" in bad.stderr
