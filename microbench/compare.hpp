// grpo-microbench --compare A.yaml B.yaml: each config measured in a fresh
// child process (so one run's high-water mark cannot hide the other's), then
// one table with B/A ratios.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace grpo::bench {

// The counters of the first benchmark in a Google Benchmark JSON file.
struct JsonRun {
  std::string name;
  bool error = false;
  std::string error_message;
  std::optional<double> counter(const std::string& key) const;
  std::string text;  // the benchmark's JSON object
};

// Reads `path`; nullopt when it has no benchmark entry.
std::optional<JsonRun> read_benchmark_json(const std::string& path);

// self: this executable; forwarded: extra arguments for each child
// (--set, --sweep-free Google Benchmark flags). Returns the exit code.
int run_compare(const std::string& self, const std::string& a, const std::string& b,
                const std::vector<std::string>& forwarded);

// The table alone (testable): rows of metrics, columns A, B, B/A.
std::string format_compare_table(const JsonRun& a, const JsonRun& b);

}  // namespace grpo::bench
