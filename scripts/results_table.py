#!/usr/bin/env python3
"""Markdown table of grpo-microbench JSON results (the README's tables).

    scripts/results_table.py microbench/results/headline_*.json

One row per benchmark: step time (p50, mean), first call, tracked peak bytes,
peak RSS delta, nominal and executed GFLOP/s, the machine's measured peak for
the dtype and the executed fraction of it, the unfused GEMMs' time alone, clip
ratio, loss, and the reference ratios when the config measured references.
"""
import json
import sys


def gib(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def row(bench):
    get = bench.get
    cells = [
        bench["name"].split("/")[0],
        f"{get('step_s_p50', 0):.3f} s",
        f"{get('step_s_mean', 0):.3f} s",
        f"{get('first_call_s', 0):.3f} s",
        gib(get("peak_bytes", 0)),
        gib(get("peak_rss_delta_bytes", 0)),
        f"{get('gflops', 0):.0f}" if get("gflops") else "-",
        f"{get('executed_gflops', 0):.0f}" if get("executed_gflops") else "-",
        f"{get('machine_peak_gflops', 0):.0f}" if get("machine_peak_gflops") else "-",
        f"{get('peak_frac', 0):.3f}" if get("peak_frac") else "-",
        f"{get('unfused_gemms_s', 0):.3f} s" if get("unfused_gemms_s") else "-",
        f"{get('clip_ratio_region', 0):.3f}",
        f"{get('loss', 0):.6f}",
    ]
    extras = [f"{k}={get(k):.4g}" for k in sorted(bench) if k.startswith(("time_ratio", "speedup", "peak_ratio",
                                                                              "copy_bw", "backward_ratio"))]
    cells.append(", ".join(extras) if extras else "")
    return "| " + " | ".join(cells) + " |"


def main(paths):
    print("| run | step p50 | step mean | first call | peak (tracked) | peak RSS delta | GFLOP/s (nominal) "
          "| GFLOP/s (executed) | machine peak GFLOP/s | peak_frac | unfused GEMMs alone | clip region | loss "
          "| ratios |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            for bench in json.load(f)["benchmarks"]:
                print(row(bench))


if __name__ == "__main__":
    main(sys.argv[1:])
