// grpo-mpi-bench: the fused plan over the ranks of mpirun, from YAML configs
// under configs/mpi/ (a grpo-microbench config plus a scale_out map), against
// the single-process plan of the same invocation.
//
//   mpirun -np 2 grpo-mpi-bench --config configs/mpi/vocab_T1024_bf16.yaml
//          [--config FILE ...] [--set key.path=value ...] [--quiet] [Google Benchmark flags]
//
// Every rank measures every config (the runs are collective); rank 0 then
// replays the results through Google Benchmark, so --benchmark_out=FILE
// --benchmark_out_format=json writes one JSON with every counter
// (mpi_bench_run.hpp lists them). The other ranks print nothing.
#include <malloc.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "machine_peak.hpp"
#include "mpi_bench_run.hpp"

namespace {

constexpr const char* kUsage =
    "usage: mpirun -np P grpo-mpi-bench --config FILE [--config FILE ...] [--set key.path=value ...]\n"
    "                                  [--quiet] [Google Benchmark flags, e.g. --benchmark_out=F.json\n"
    "                                  --benchmark_out_format=json]\n"
    "Configs: configs/mpi/*.yaml (a grpo-microbench config of impl fused plus scale_out: {mode: vocab | data};\n"
    "configs/README.md).\n";

// "--flag value" or "--flag=value".
bool take_value(int argc, char** argv, int& i, const char* flag, std::string& out) {
  const std::size_t len = std::strlen(flag);
  if (std::strncmp(argv[i], flag, len) != 0) return false;
  if (argv[i][len] == '=') {
    out = argv[i] + len + 1;
    return true;
  }
  if (argv[i][len] != '\0' || i + 1 >= argc) return false;
  out = argv[++i];
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // as grpo-microbench: large buffers mapped afresh (see bench_main.cpp)
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<std::string> paths, sets;
  std::vector<char*> passthrough{argv[0]};
  bool quiet = false;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (std::strcmp(argv[i], "--help") == 0) {
      if (rank == 0) std::fputs(kUsage, stdout);
      MPI_Finalize();
      return 0;
    } else if (take_value(argc, argv, i, "--config", v)) {
      paths.push_back(v);
    } else if (take_value(argc, argv, i, "--set", v)) {
      sets.push_back(v);
    } else if (std::strcmp(argv[i], "--quiet") == 0) {
      quiet = true;
    } else {
      passthrough.push_back(argv[i]);
    }
  }
  int status = 0;
  std::vector<grpo::bench::MpiBenchConfig> configs;
  try {
    if (paths.empty()) throw std::runtime_error("give at least one --config FILE");
    for (const std::string& p : paths) configs.push_back(grpo::bench::load_mpi_bench_config(p, sets));
  } catch (const std::exception& e) {
    if (rank == 0) std::fprintf(stderr, "grpo-mpi-bench: %s\n%s", e.what(), kUsage);
    MPI_Finalize();
    return 2;
  }
  // Measure every config on every rank (collective), then report on rank 0.
  std::vector<grpo::bench::BenchResult> results(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    try {
      results[i] = grpo::bench::run_mpi_bench(configs[i], MPI_COMM_WORLD, !quiet);
    } catch (const std::exception& e) {
      // A refusal of the library is every rank's (the plan's agreement); other
      // failures end the job.
      std::fprintf(stderr, "grpo-mpi-bench: rank %d: %s failed: %s\n", rank, configs[i].bench.name.c_str(), e.what());
      status = 1;
      results[i].label = std::string("FAILED: ") + e.what();
    }
  }
  if (rank == 0) {
    for (std::size_t i = 0; i < configs.size(); ++i) {
      const grpo::bench::BenchResult& r = results[i];
      benchmark::RegisterBenchmark(configs[i].bench.name.c_str(),
                                   [&r](benchmark::State& state) {
                                     if (r.step_s.empty()) {
                                       state.SkipWithError(r.label.c_str());
                                       for (auto _ : state) {
                                       }
                                       return;
                                     }
                                     std::size_t k = 0;
                                     for (auto _ : state) state.SetIterationTime(r.step_s[k++ % r.step_s.size()]);
                                     for (const auto& [name, value] : r.counters) {
                                       state.counters[name] = benchmark::Counter(value);
                                     }
                                     state.SetLabel(r.label);
                                   })
          ->UseManualTime()
          ->Iterations(std::max(1, configs[i].bench.steps))
          ->Unit(benchmark::kMillisecond);
    }
    int bench_argc = static_cast<int>(passthrough.size());
    // The CPU and its measured peak (CPU time per thread, so the other ranks
    // waiting in MPI do not lower it) go into the JSON's context.
    for (const auto& [key, value] : grpo::bench::machine_context()) benchmark::AddCustomContext(key, value);
    benchmark::Initialize(&bench_argc, passthrough.data());
    if (benchmark::ReportUnrecognizedArguments(bench_argc, passthrough.data())) status = 2;
    if (status != 2) benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
  }
  MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
