#!/usr/bin/env python3
"""Markdown table of grpo-microbench / grpo-mpi-bench JSON results, per machine.

    scripts/results_table.py microbench/results/xeon-amx/headline_*.json
    scripts/results_table.py microbench/results          # every JSON below, recursively

One row per benchmark: step time (p50, mean), first call, tracked peak bytes,
peak RSS delta, nominal and executed GFLOP/s, the machine's measured peak for
the dtype and the executed fraction of it, the unfused GEMMs' time alone, clip
ratio, loss, and the reference ratios when the config measured references.

Rows are grouped by machine. The machine is the JSON's own `cpu_model` context
field (written since the microbench records it, with the SIMD flags and the
measured peak per unit), else the results folder the file sits in
(microbench/results/<machine>/), else "unknown". JSON files that are not
benchmark results (no "benchmarks" list) are skipped with a note on stderr.
"""
import json
import os
import sys


def gib(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def row(bench):
    get = bench.get

    def opt(key, fmt):
        return fmt.format(get(key)) if get(key) else "-"

    cells = [
        bench["name"].split("/")[0],
        f"{get('step_s_p50', 0):.3f} s",
        f"{get('step_s_mean', 0):.3f} s",
        opt("first_call_s", "{:.3f} s"),
        gib(get("peak_bytes", 0)),
        gib(get("peak_rss_delta_bytes", 0)),
        opt("gflops", "{:.0f}"),
        opt("executed_gflops", "{:.0f}"),
        opt("machine_peak_gflops", "{:.0f}"),
        opt("peak_frac", "{:.3f}"),
        opt("unfused_gemms_s", "{:.3f} s"),
        f"{get('clip_ratio_region', 0):.3f}",
        f"{get('loss', 0):.6f}",
    ]
    extras = [f"{k}={get(k):.4g}" for k in sorted(bench)
              if k.startswith(("time_ratio", "speedup", "peak_ratio", "copy_bw", "backward_ratio"))
              and isinstance(get(k), (int, float))]
    cells.append(", ".join(extras))
    return "| " + " | ".join(cells) + " |"


def machine_of(path, context):
    """(machine name, one line describing it) for a results file."""
    model = context.get("cpu_model")
    if model:
        units = context.get("cpu_units", "")
        peaks = ", ".join(f"{k[len('machine_peak_'):-len('_gflops')]} {float(v):.0f}"
                          for k, v in sorted(context.items())
                          if k.startswith("machine_peak_") and k.endswith("_gflops") and float(v) > 0)
        return model, f"{model}; units: {units or '-'}; measured peak GFLOP/s: {peaks or '-'}"
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if "results" in parts[:-1]:
        i = len(parts) - 1 - parts[::-1].index("results")
        if i + 1 < len(parts) - 1:
            folder = parts[i + 1]
            return folder, f"results folder '{folder}' (the file names no CPU; see that folder's README)"
    return "unknown", "unknown: the file names no CPU and lies in no per-machine results folder"


def json_files(args):
    for arg in args:
        if os.path.isdir(arg):
            for root, _, names in sorted(os.walk(arg)):
                for name in sorted(names):
                    if name.endswith(".json"):
                        yield os.path.join(root, name)
        else:
            yield arg


HEADER = ("| run | step p50 | step mean | first call | peak (tracked) | peak RSS delta | GFLOP/s (nominal) "
          "| GFLOP/s (executed) | machine peak GFLOP/s | peak_frac | unfused GEMMs alone | clip region | loss "
          "| ratios |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(args):
    if not args:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    groups = {}  # machine -> (description, [rows])
    for path in json_files(args):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"results_table: {path}: {e}", file=sys.stderr)
            continue
        if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
            print(f"results_table: {path}: not a benchmark results file, skipped", file=sys.stderr)
            continue
        name, description = machine_of(path, data.get("context", {}))
        rows = groups.setdefault(name, (description, []))[1]
        rows.extend(row(b) for b in data["benchmarks"] if "name" in b)
    for name, (description, rows) in groups.items():
        print(f"Machine: {description}\n")
        print(HEADER)
        print("\n".join(rows))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
