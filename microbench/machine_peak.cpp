#include "machine_peak.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_features.hpp"
#include "peak_kernels.hpp"

namespace grpo::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Loop trips per call between two looks at the clock: ~20-100 us of work for
// each unit at a few GHz, so the clock is read rarely and the overshoot past
// the deadline is negligible against a repetition (0.08 s by default).
constexpr std::int64_t kFmaTripsPerCall = 1 << 14;
constexpr std::int64_t kAmxTripsPerCall = 1 << 10;

struct Unit {
  float (*chains)(std::int64_t);
  std::int64_t trips_per_call;
  double flop_per_trip;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// `threads` threads start together and each runs unit.chains until the
// shared deadline. Each thread's rate is its FLOPs over its own CPU time,
// and the peak is the sum of the rates: the machine's throughput with every
// CPU running chains. Wall time would instead measure the share of the
// machine this process got: on a shared 2-CPU box another process on one CPU
// halves a wall-time figure while each chain still runs at full speed
// whenever it runs. (Hyperthreads sharing one core's ports run slower per
// thread while both run, and the CPU-time rate shows that too.)
double run_once(const Unit& unit, int threads, double seconds) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point deadline;
  std::vector<double> rates(static_cast<std::size_t>(threads), 0.0);
  std::vector<float> sinks(static_cast<std::size_t>(threads), 0.0F);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      const double cpu0 = thread_cpu_seconds();
      std::int64_t n = 0;
      float sink = 0.0F;
      do {
        sink += unit.chains(unit.trips_per_call);
        n += unit.trips_per_call;
      } while (Clock::now() < deadline);
      const double cpu = thread_cpu_seconds() - cpu0;
      rates[static_cast<std::size_t>(t)] = cpu > 0.0 ? static_cast<double>(n) * unit.flop_per_trip / cpu * 1e-9 : 0.0;
      sinks[static_cast<std::size_t>(t)] = sink;
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  // A NaN sink would mean the chains computed garbage (wrong encoding, bad
  // tile config): report no peak rather than a number from broken code.
  for (float s : sinks) {
    if (!(s == s)) return 0.0;
  }
  double total = 0.0;
  for (double r : rates) total += r;
  return total;
}

// A warm-up run first (AVX-512 and AMX units power up and the core may change
// frequency when they start), then the best of the repetitions.
double best_rate(const Unit& unit, const PeakProbeOptions& o, int threads) {
  run_once(unit, threads, o.seconds / 2);
  double best = 0.0;
  for (int r = 0; r < std::max(o.repetitions, 1); ++r) best = std::max(best, run_once(unit, threads, o.seconds));
  return best;
}

}  // namespace

double MachinePeak::for_dtype(DType dtype) const {
  if (dtype != DType::bf16) return f32_fma_gflops;
  return std::max({avx512_bf16_gflops, amx_bf16_gflops, f32_fma_gflops});
}

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(CPU_COUNT(&set), 1);
  return std::max(static_cast<int>(std::thread::hardware_concurrency()), 1);
}

namespace {

// 64 Mi floats per array: three arrays are 768 MiB, past any L3 a 2-core VM
// sees (this one reports 480 MiB).
constexpr std::size_t kTriadFloats = std::size_t{64} << 20;

double triad_bandwidth(int threads, int repetitions) {
  const std::size_t n = kTriadFloats;
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  const auto slices = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] { body(n * t / threads, n * (t + 1) / threads); });
    }
    for (std::thread& th : pool) th.join();
  };
  // First touch by the thread that streams the slice later.
  slices([&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      a[i] = 0.0F;
      b[i] = 1.0F;
      c[i] = 2.0F;
    }
  });
  double best = 0.0;
  for (int r = 0; r < std::max(1, repetitions); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    slices([&](std::size_t lo, std::size_t hi) {
      for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0F * c[i];
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 3.0 * static_cast<double>(n * sizeof(float)) / s * 1e-9);
  }
  // Keep the stores observable.
  volatile float sink = a[n / 2];
  (void)sink;
  return best;
}

}  // namespace

MachinePeak measure_machine_peak(const PeakProbeOptions& options) {
  const CpuFeatures f = detect_cpu_features();
  MachinePeak p;
  p.threads = options.threads > 0 ? options.threads : allowed_cpus();
  p.missing = f.missing;
  // Both widths where both exist: a zmm FMA is not always the faster one (one
  // 512-bit port, or a lower AVX-512 clock, on some Xeons).
  if (f.avx512f)
    p.f32_fma_gflops = best_rate({f32_fma_chains, kFmaTripsPerCall, kF32FmaFlopPerIteration}, options, p.threads);
  if (f.avx2_fma) {
    p.f32_fma_gflops =
        std::max(p.f32_fma_gflops,
                 best_rate({f32_fma_ymm_chains, kFmaTripsPerCall, kF32FmaYmmFlopPerIteration}, options, p.threads));
  }
  if (f.avx512_bf16) {
    p.avx512_bf16_gflops =
        best_rate({avx512_bf16_chains, kFmaTripsPerCall, kBf16DotFlopPerIteration}, options, p.threads);
  }
  if (f.amx_bf16) {
    p.amx_bf16_gflops = best_rate({amx_bf16_chains, kAmxTripsPerCall, kAmxBf16FlopPerIteration}, options, p.threads);
  }
  p.triad_gbytes_per_s = triad_bandwidth(p.threads, options.repetitions);
  return p;
}

const MachinePeak& machine_peak() {
  // A function-local static: the microbench is one process per measurement,
  // and every config it runs is compared with the same machine.
  static const MachinePeak peak = measure_machine_peak({});
  return peak;
}

namespace {

// The first "<key>\t: value" line of /proc/cpuinfo, or "" (not Linux, no such key).
std::string cpuinfo_field(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) != 0) continue;
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::size_t start = line.find_first_not_of(' ', colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

// The SIMD and matrix flags among the CPU's flags (avx*, amx*, fma, f16c):
// the rest (sse, page tables, mitigations) says nothing about the kernels.
std::string simd_flags(const std::string& flags) {
  std::istringstream words(flags);
  std::string out;
  for (std::string w; words >> w;) {
    if (w.rfind("avx", 0) == 0 || w.rfind("amx", 0) == 0 || w == "fma" || w == "f16c") {
      if (!out.empty()) out += ' ';  // piece by piece: GCC 12 warns falsely (-Wrestrict) on "" + w
      out += w;
    }
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> machine_context() {
  const CpuFeatures f = detect_cpu_features();
  std::string units;
  for (const auto& [has, name] : {std::pair{f.avx2_fma, "avx2_fma"}, std::pair{f.avx512f, "avx512f"},
                                  std::pair{f.avx512_bf16, "avx512_bf16"}, std::pair{f.amx_bf16, "amx_bf16"}}) {
    if (!has) continue;
    if (!units.empty()) units += ' ';
    units += name;
  }
  const MachinePeak& peak = machine_peak();
  const auto gflops = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  return {{"cpu_model", cpuinfo_field("model name")},
          {"cpu_simd_flags", simd_flags(cpuinfo_field("flags"))},
          {"cpu_units", units},
          {"cpu_units_missing", f.missing},
          {"machine_peak_threads", std::to_string(peak.threads)},
          {"machine_peak_f32_fma_gflops", gflops(peak.f32_fma_gflops)},
          {"machine_peak_avx512_bf16_gflops", gflops(peak.avx512_bf16_gflops)},
          {"machine_peak_amx_bf16_gflops", gflops(peak.amx_bf16_gflops)},
          {"machine_triad_gbytes_per_s", gflops(peak.triad_gbytes_per_s)}};
}

}  // namespace grpo::bench
