import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Max |grpo - Liger| per (dtype, output), filled by test_liger.py and printed
# at the end of the run (the numbers quoted in README "Python").
LIGER_DIFFS: dict = {}


def record_diff(dtype: str, name: str, ours, theirs) -> None:
    import torch

    ours = torch.as_tensor(ours, dtype=torch.float64)
    theirs = torch.as_tensor(theirs, dtype=torch.float64)
    abs_diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
    scale = float(theirs.abs().max()) if theirs.numel() else 0.0
    rel = abs_diff / scale if scale > 0 else 0.0
    old = LIGER_DIFFS.get((dtype, name), (0.0, 0.0))
    LIGER_DIFFS[(dtype, name)] = (max(old[0], abs_diff), max(old[1], rel))


# Max |grpo - TRL| per (case, output), filled by test_trl_parity.py and
# test_trl.py through the `record` fixture, printed at the end of the run.
TRL_DIFFS: dict = {}


def record_trl(group: str, name: str, ours=None, theirs=None, *, abs_diff=None, rel=None) -> None:
    """Keeps the largest abs diff and rel = abs diff / max |TRL| seen for (group, name)."""
    import torch

    if abs_diff is None:
        ours = torch.as_tensor(ours, dtype=torch.float64)
        theirs = torch.as_tensor(theirs, dtype=torch.float64)
        abs_diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        rel = abs_diff / scale if scale > 0 else 0.0
    old = TRL_DIFFS.get((group, name), (0.0, 0.0))
    TRL_DIFFS[(group, name)] = (max(old[0], abs_diff), max(old[1], rel))


@pytest.fixture
def record():
    return record_trl


def pytest_terminal_summary(terminalreporter):
    if LIGER_DIFFS:
        terminalreporter.section("grpo vs Liger 0.8.5: max abs diff / max abs diff relative to max |Liger|")
        for (dtype, name), (a, r) in sorted(LIGER_DIFFS.items()):
            terminalreporter.write_line(f"{dtype:9s} {name:22s} abs {a:.3e}  rel {r:.3e}")
    if TRL_DIFFS:
        terminalreporter.section("grpo vs TRL 1.16: max abs diff / max abs diff relative to max |TRL|")
        for (group, name), (a, r) in sorted(TRL_DIFFS.items()):
            terminalreporter.write_line(f"{group:16s} {name:26s} abs {a:.3e}  rel {r:.3e}")
