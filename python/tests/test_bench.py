"""python -m grpo.bench runs end to end (a tiny shape, two methods, one step each)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def test_bench_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "grpo.bench", "--shape", "1,8,16,64", "--steps", "1",
                           "--methods", "eager,grpo_head", "--out", str(out)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["method"] for r in results] == ["eager", "grpo_head"]
    assert all(r["peak_rss_mib"] >= r["base_rss_mib"] > 0 and r["step_s"] > 0 for r in results)
    # Same loss from the materialized logits and from grpo's head (bf16 inputs: TRL's eager logits are bf16).
    assert abs(results[0]["loss"] - results[1]["loss"]) < 0.05
