"""The TRL patch under `accelerate launch --num_processes 2` (DDP on gloo, CPU): patched equals plain.

trl_accelerate_run.py trains the tiny GRPOTrainer two optimizer steps on each
of two ranks, plain and then patched (the patched run replays the plain run's
batches). Per rank and step, the patched loss is within test_trl.py's bound of
the plain one (both heads' float32 logp errors through dLoss/dlogp), and every
gradient the optimizer gets, summed over the ranks by DDP, within its relative
budget; each run's gradients are bitwise the same on both ranks (DDP reduced
them: the ranks' batches differ), and the patched run fell back nowhere.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from reference import U32  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(mode: str, out: str) -> None:
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    assert accelerate, "accelerate's CLI is not installed beside this Python"
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    # --multi_gpu is accelerate's torchrun launcher (--cpu would start one process); with no GPU and
    # ACCELERATE_USE_CPU the processes run DistributedType.MULTI_CPU on gloo.
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           os.path.join(HERE, "trl_accelerate_run.py"), "--mode", mode, "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, timeout=600)
    assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_patched_trainer_under_accelerate_two_processes_matches_plain(tmp_path):
    out = str(tmp_path)
    launch("plain", out)
    launch("patched", out)
    runs = {(mode, r): torch.load(os.path.join(out, f"{mode}_rank{r}.pt"), weights_only=False)
            for mode in ("plain", "patched") for r in (0, 1)}
    for (mode, r), run in runs.items():
        assert run["world"] == 2 and run["distributed_type"] == "DistributedType.MULTI_CPU", (mode, r, run["world"])
        assert len(run["steps"]) == 2 and len(run["logged_losses"]) == 2, (mode, r)
    assert runs[("patched", 0)]["grpo_warnings"] == [] and runs[("patched", 1)]["grpo_warnings"] == []
    v = None
    for step in range(2):
        # The ranks trained on different completions, and DDP gave both the same (summed) gradients.
        a, b = runs[("plain", 0)]["steps"][step], runs[("plain", 1)]["steps"][step]
        assert not torch.equal(a["inputs"]["completion_ids"], b["inputs"]["completion_ids"]) or \
            not torch.equal(a["inputs"]["prompt_ids"], b["inputs"]["prompt_ids"])
        for mode in ("plain", "patched"):
            g0, g1 = runs[(mode, 0)]["steps"][step]["grads"], runs[(mode, 1)]["steps"][step]["grads"]
            assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0), (mode, step)
        e2_max = 0.0
        for r in (0, 1):
            plain, patched = runs[("plain", r)]["steps"][step], runs[("patched", r)]["steps"][step]
            e2 = 2.0 * plain["logp_bound"].double()  # both heads err by at most e (float32 logits)
            e2_max = max(e2_max, float(e2.max()))
            c = plain["c"].double().abs()
            loss_tol = 2.0 * float((c * 2.0 * e2).sum()) + 64 * U32 * abs(float(plain["loss"]))
            diff = abs(float(patched["loss"]) - float(plain["loss"]))
            assert diff <= loss_tol, f"rank {r} step {step}: loss {float(patched['loss'])} vs {float(plain['loss'])}"
        grads_plain, grads_patched = runs[("plain", 0)]["steps"][step]["grads"], runs[("patched", 0)]["steps"][step]["grads"]
        assert grads_plain.keys() == grads_patched.keys() and "lm_head.weight" in grads_plain
        v = grads_plain["lm_head.weight"].shape[0]
        budget = 8 * e2_max + 64 * U32 * v
        for name, g in grads_plain.items():
            rel = float((grads_patched[name].double() - g.double()).abs().max()) / max(float(g.abs().max()), 1e-30)
            assert rel <= budget, f"step {step} {name}: {rel:.3g} > {budget:.3g}"
