// The machine's physical arithmetic peak, measured in the benchmark's own
// process: one thread per CPU the process may run on executes independent
// register chains of one instruction (no memory traffic, no dependencies
// between chains) for a fixed time; each thread's FLOPs over its own CPU
// time, summed over the threads, are the most that unit can deliver with
// every CPU busy (CPU time, not wall time: another process sharing a CPU
// must not lower the machine's peak). It is the yardstick for executed
// GFLOP/s (peak_frac): an upper bound no GEMM library can beat, unlike a
// library's own GEMM time.
//
//   f32 FMA      vfmadd231ps zmm   32 FLOP per instruction (ymm: 16; the faster counts)
//   avx512 bf16  vdpbf16ps zmm     64 FLOP per instruction
//   AMX bf16     tdpbf16ps         16384 FLOP per instruction (16x16 += 16x32 * 32x16)
//
// A unit the CPU (or the OS) lacks is reported as 0 with the reason.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "grpo/types.hpp"

namespace grpo::bench {

struct MachinePeak {
  int threads = 0;  // threads that ran chains at the same time (one per allowed CPU)
  double f32_fma_gflops = 0.0;
  double avx512_bf16_gflops = 0.0;
  double amx_bf16_gflops = 0.0;
  // Memory bandwidth in the same process: a STREAM triad a = b + s c over
  // three arrays of kTriadFloats floats (768 MiB, past every cache), one
  // slice per thread, bytes counted as STREAM does (two reads, one write;
  // the write-allocate read not counted), best of the repetitions.
  double triad_gbytes_per_s = 0.0;
  std::string missing;  // units not measured and why; empty when all were

  // The peak of the units that could execute GEMMs of this dtype: f32 ->
  // FMA; bf16 -> the fastest of vdpbf16ps, AMX and FMA (a bf16 GEMM can
  // always run as f32 FMAs after widening, as oneDNN does on AVX-512 cores
  // without bf16 instructions; and vdpbf16ps can be slower than FMA).
  double for_dtype(DType dtype) const;
};

// The defaults take ~1.1 s per unit: a probe of 3 x 0.08 s once read 307
// GFLOP/s of vdpbf16ps in one process where the next read 459 (2-core Zen
// 4, run_main.sh's compare), and the slower process printed a fraction of
// the peak of 1.05. Five repetitions of 0.2 s, the best taken, ride out a
// busy moment of that length.
struct PeakProbeOptions {
  int threads = 0;       // 0 = one per CPU in the process's affinity mask
  double seconds = 0.2;  // per repetition and unit, after a warm-up of half that
  int repetitions = 5;   // best of
};

// Measures every available unit with these options (about
// units x (repetitions + 0.5) x seconds of wall time).
MachinePeak measure_machine_peak(const PeakProbeOptions& options);

// measure_machine_peak({}) once per process, on first use: every config of an
// invocation is measured against the same numbers.
const MachinePeak& machine_peak();

// CPUs in this process's affinity mask (what TBB's default arena uses too).
int allowed_cpus();

// The machine a results JSON was measured on, for its "context" block: the
// CPU model and its SIMD flags (/proc/cpuinfo), the units this process may
// execute (cpu_features.hpp) and machine_peak()'s measured GFLOP/s per unit.
// Results from different CPUs then say so in the file itself
// (scripts/results_table.py prints them).
std::vector<std::pair<std::string, std::string>> machine_context();

}  // namespace grpo::bench
