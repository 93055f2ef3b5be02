// grpo-microbench: Google Benchmark runs registered from YAML configs.
//
//   grpo-microbench --config configs/microbench/quick_fused_bf16_tile2048.yaml
//                   [--config FILE ...] [--set key.path=value ...]
//                   [--sweep key.path=v1,v2,...] [--quiet] [Google Benchmark flags]
//   grpo-microbench --compare A.yaml B.yaml [--set ...]
//   grpo-microbench --machine-peak
//   grpo-microbench --analyze-filter FILE [--analyze-segments N] [--set ...]
//
// Our flags are taken out first; everything else goes to benchmark::Initialize
// (--benchmark_out=FILE --benchmark_out_format=json, --benchmark_filter, ...).
#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_config.hpp"
#include "bench_run.hpp"
#include "compare.hpp"
#include "filter_analysis.hpp"
#include "machine_peak.hpp"

namespace {

using grpo::bench::BenchConfig;

constexpr const char* kUsage =
    "usage: grpo-microbench --config FILE [--config FILE ...] [--set key.path=value ...]\n"
    "                       [--sweep key.path=v1,v2,...] [--quiet] [Google Benchmark flags]\n"
    "       grpo-microbench --compare A.yaml B.yaml [--set key.path=value ...]\n"
    "       grpo-microbench --machine-peak\n"
    "       grpo-microbench --analyze-filter FILE [--analyze-segments N] [--set key.path=value ...]\n"
    "Configs: configs/microbench/*.yaml (fields: configs/README.md).\n"
    "--set overrides a field of every config (e.g. --set shape.seq_len=1024 --set steps=2).\n"
    "--sweep registers each config once per value (e.g. --sweep shape.seq_len=512,1024,2048).\n"
    "--compare measures A and B each in a fresh child process and prints a table with B/A ratios.\n"
    "--machine-peak measures the arithmetic peak of each unit (f32 FMA, avx512 bf16, AMX bf16) on\n"
    "  1 thread and on every allowed CPU, as the LM-head runs do for machine_peak_gflops.\n"
    "--analyze-filter prints, for FILE's inputs, the entropy and the fraction of (row block x vocab tile)\n"
    "  blocks a 2^-12 gradient filter could skip, in natural and two sorted vocabulary orders\n"
    "  (filter_analysis.hpp), on N segments of 320 rows (default 2; 0 = every row). Nothing is timed.\n";

struct Args {
  std::vector<std::string> configs;
  std::vector<std::string> sets;
  std::string sweep_key;
  std::vector<std::string> sweep_values;
  std::vector<std::string> compare;
  bool quiet = false;
  bool machine_peak = false;
  std::string analyze_filter;  // a config file
  int analyze_segments = 2;
  std::vector<char*> passthrough;  // argv[0] + Google Benchmark flags
};

// "--flag value" or "--flag=value".
bool take_value(int argc, char** argv, int& i, const char* flag, std::string& out) {
  const std::size_t len = std::strlen(flag);
  if (std::strncmp(argv[i], flag, len) != 0) return false;
  if (argv[i][len] == '=') {
    out = argv[i] + len + 1;
    return true;
  }
  if (argv[i][len] != '\0') return false;
  if (i + 1 >= argc) throw std::runtime_error(std::string(flag) + " needs a value");
  out = argv[++i];
  return true;
}

Args parse_args(int argc, char** argv) {
  Args a;
  a.passthrough.push_back(argv[0]);
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (take_value(argc, argv, i, "--config", v)) {
      a.configs.push_back(v);
    } else if (take_value(argc, argv, i, "--set", v)) {
      a.sets.push_back(v);
    } else if (take_value(argc, argv, i, "--sweep", v)) {
      const std::size_t eq = v.find('=');
      if (eq == std::string::npos || !a.sweep_key.empty())
        throw std::runtime_error("--sweep takes one key.path=v1,v2,...");
      a.sweep_key = v.substr(0, eq);
      for (std::size_t at = eq + 1; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        a.sweep_values.push_back(v.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (std::strcmp(argv[i], "--compare") == 0) {
      if (i + 2 >= argc) throw std::runtime_error("--compare needs two config files");
      a.compare = {argv[i + 1], argv[i + 2]};
      i += 2;
    } else if (take_value(argc, argv, i, "--analyze-filter", v)) {
      a.analyze_filter = v;
    } else if (take_value(argc, argv, i, "--analyze-segments", v)) {
      a.analyze_segments = std::stoi(v);
    } else if (std::strcmp(argv[i], "--quiet") == 0) {
      a.quiet = true;
    } else if (std::strcmp(argv[i], "--machine-peak") == 0) {
      a.machine_peak = true;
    } else {
      a.passthrough.push_back(argv[i]);
    }
  }
  return a;
}

// One line per thread count (1, then every allowed CPU): the peak of each unit.
int print_machine_peak() {
  const int all = grpo::bench::allowed_cpus();
  std::printf("%-8s %18s %22s %19s\n", "threads", "f32 FMA GFLOP/s", "avx512 bf16 GFLOP/s", "AMX bf16 GFLOP/s");
  std::string missing;
  for (int threads : all > 1 ? std::vector<int>{1, all} : std::vector<int>{1}) {
    const grpo::bench::MachinePeak p = grpo::bench::measure_machine_peak({.threads = threads});
    std::printf("%-8d %18.1f %22.1f %19.1f\n", threads, p.f32_fma_gflops, p.avx512_bf16_gflops, p.amx_bf16_gflops);
    missing = p.missing;
  }
  if (!missing.empty()) std::printf("not measured (reported as 0): %s\n", missing.c_str());
  return 0;
}

std::atomic<bool> g_failed{false};

void run_registered(benchmark::State& state, const BenchConfig& config, bool quiet) {
  grpo::bench::BenchResult result;
  try {
    result = grpo::bench::run_bench(config, !quiet);
  } catch (const std::exception& e) {
    g_failed = true;
    state.SkipWithError(e.what());
    std::fprintf(stderr, "grpo-microbench: %s failed: %s\n", config.name.c_str(), e.what());
    return;
  }
  // The steps were timed by run_bench (with the per-step peak resets around
  // them); the loop hands those times to the framework.
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(result.step_s[i++ % result.step_s.size()]);
  for (const auto& [name, value] : result.counters) state.counters[name] = benchmark::Counter(value);
  state.SetLabel(result.label);
}

}  // namespace

int main(int argc, char** argv) {
  // glibc's mmap threshold grows to 32 MiB after the first large free; buffers
  // below it would then come from the heap and stay resident between steps,
  // invisible to the per-step RSS high-water mark. A fixed 1 MiB threshold
  // maps every large buffer afresh and returns it on free.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grpo-microbench: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (args.machine_peak) return print_machine_peak();
  if (!args.analyze_filter.empty()) {
    try {
      const BenchConfig c = grpo::bench::load_bench_config(args.analyze_filter, args.sets);
      const grpo::bench::FilterAnalysis a = grpo::bench::analyze_filter(c, {.segments = args.analyze_segments});
      std::printf("%s: %s", c.name.c_str(), a.table().c_str());
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "grpo-microbench: %s\n", e.what());
      return 1;
    }
  }
  if (!args.compare.empty()) {
    std::vector<std::string> forwarded;
    for (const std::string& s : args.sets) forwarded.push_back("--set=" + s);
    if (args.quiet) forwarded.emplace_back("--quiet");
    for (std::size_t i = 1; i < args.passthrough.size(); ++i) {
      const std::string flag = args.passthrough[i];
      if (flag.rfind("--benchmark_out", 0) != 0) forwarded.push_back(flag);  // the children's JSON is ours
    }
    return grpo::bench::run_compare("/proc/self/exe", args.compare[0], args.compare[1], forwarded);
  }
  if (args.configs.empty()) {
    std::fprintf(stderr, "grpo-microbench: give at least one --config FILE\n%s", kUsage);
    return 2;
  }
  // Parse every config before running any, so a typo fails in a second.
  std::vector<BenchConfig> configs;
  try {
    for (const std::string& path : args.configs) {
      const std::vector<std::string> values = args.sweep_key.empty() ? std::vector<std::string>{""} : args.sweep_values;
      for (const std::string& value : values) {
        std::vector<std::string> overrides = args.sets;
        if (!args.sweep_key.empty()) overrides.push_back(args.sweep_key + "=" + value);
        BenchConfig c = grpo::bench::load_bench_config(path, overrides);
        if (!args.sweep_key.empty()) {
          const std::size_t dot = args.sweep_key.find_last_of('.');
          c.name += "/" + args.sweep_key.substr(dot == std::string::npos ? 0 : dot + 1) + "=" + value;
        }
        configs.push_back(std::move(c));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grpo-microbench: %s\n", e.what());
    return 2;
  }
  for (const BenchConfig& c : configs) {
    benchmark::RegisterBenchmark(c.name.c_str(),
                                 [c, quiet = args.quiet](benchmark::State& s) { run_registered(s, c, quiet); })
        ->UseManualTime()
        ->Iterations(c.steps)
        ->Unit(benchmark::kMillisecond);
  }
  int bench_argc = static_cast<int>(args.passthrough.size());
  // The CPU and its measured peak go into the JSON's context: a results file
  // says which machine it came from.
  for (const auto& [key, value] : grpo::bench::machine_context()) benchmark::AddCustomContext(key, value);
  benchmark::Initialize(&bench_argc, args.passthrough.data());
  if (benchmark::ReportUnrecognizedArguments(bench_argc, args.passthrough.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_failed ? 1 : 0;
}
