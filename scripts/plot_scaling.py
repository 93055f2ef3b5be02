#!/usr/bin/env python3
"""Step time and peak bytes versus T, fused against baseline, from grpo-microbench JSON.

Produce the JSON with a sequence-length sweep (the headline configs, T = 512..8192):

    build/microbench/grpo-microbench \\
        --config configs/microbench/headline_fused_bf16_tile2048.yaml \\
        --config configs/microbench/headline_baseline_bf16_logits.yaml \\
        --sweep shape.seq_len=512,1024,2048,4096,8192 \\
        --benchmark_out=out/scaling.json --benchmark_out_format=json
    scripts/plot_scaling.py out/scaling.json -o out/scaling.png

Several JSON files may be given (e.g. one per config, run separately); runs
are grouped by config name (the benchmark name without "/seq_len=..."), one
line per config, x = the run's seq_len counter.

Needs matplotlib: Debian's python3-matplotlib (GRPO_WITH_PLOT=1
scripts/install_deps.sh). Debian installs it for /usr/bin/python3; when this
script is started by another interpreter (pyenv, a venv) without matplotlib,
it re-runs itself under /usr/bin/python3.
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

DEBIAN_PYTHON = "/usr/bin/python3"


def import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        if os.path.realpath(sys.executable) != os.path.realpath(DEBIAN_PYTHON) and os.path.exists(DEBIAN_PYTHON):
            os.execv(DEBIAN_PYTHON, [DEBIAN_PYTHON] + sys.argv)
        sys.exit("plot_scaling: matplotlib is missing; install it with: GRPO_WITH_PLOT=1 scripts/install_deps.sh")


def config_name(benchmark_name):
    """'headline_fused_bf16_tile2048/seq_len=512/iterations:3/manual_time' -> 'headline_fused_bf16_tile2048'."""
    name = benchmark_name.split("/iterations:")[0]
    return re.sub(r"/seq_len=\d+$", "", name)


def load_runs(paths):
    """{config: [(seq_len, step_s, peak_bytes, peak_rss_delta_bytes)]}, sorted by seq_len."""
    runs = defaultdict(list)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            if "seq_len" not in b or "step_s_p50" not in b:
                continue
            runs[config_name(b["name"])].append(
                (int(b["seq_len"]), b["step_s_p50"], b.get("peak_bytes", 0.0), b.get("peak_rss_delta_bytes", -1.0))
            )
    if not runs:
        sys.exit("plot_scaling: no grpo-microbench runs with seq_len and step_s_p50 counters in " + ", ".join(paths))
    return {k: sorted(v) for k, v in runs.items()}


def style(name):
    # Fused solid, baselines dashed, anything else dotted: the comparison reads at a glance.
    if "baseline" in name:
        return "--", "s"
    if "fused" in name:
        return "-", "o"
    return ":", "^"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="grpo-microbench --benchmark_out files (JSON)")
    parser.add_argument("-o", "--output", default="scaling.png", help="PNG to write (default scaling.png)")
    parser.add_argument("--title", default="GRPO LM-head step: fused vs unfused baseline")
    args = parser.parse_args()
    plt = import_pyplot()
    runs = load_runs(args.json)

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 5))
    for name, points in sorted(runs.items()):
        ls, marker = style(name)
        t = [p[0] for p in points]
        (line,) = ax_time.plot(t, [p[1] for p in points], ls, marker=marker, label=name)
        color = line.get_color()  # one colour per config in both panels
        ax_mem.plot(t, [p[2] / 2**30 for p in points], ls, marker=marker, color=color, label=name + " (tracked)")
        rss = [(p[0], p[3] / 2**30) for p in points if p[3] >= 0]
        if rss:
            ax_mem.plot([r[0] for r in rss], [r[1] for r in rss], ls, marker=marker, color=color, alpha=0.35,
                        label=name + " (RSS delta)")
    for ax, ylabel in ((ax_time, "step time, p50 (s)"), (ax_mem, "peak bytes of the step (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (seq_len)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    all_t = sorted({p[0] for points in runs.values() for p in points})
    for ax in (ax_time, ax_mem):
        ax.set_xticks(all_t)
        ax.set_xticklabels([str(t) for t in all_t])
    fig.suptitle(args.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print("plot_scaling: wrote " + args.output)


if __name__ == "__main__":
    main()
