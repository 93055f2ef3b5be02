#include "compare.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace grpo::bench {
namespace {

// The JSON Google Benchmark writes is regular: "key": value pairs, one per
// line, counters as plain numbers. A full JSON parser would be a new
// dependency for reading a dozen numbers, so keys are found by their quoted
// name inside the first benchmark's object.
std::optional<std::string> json_raw(const std::string& text, const std::string& key) {
  const std::string quoted = "\"" + key + "\":";
  const std::size_t at = text.find(quoted);
  if (at == std::string::npos) return std::nullopt;
  std::size_t v = at + quoted.size();
  while (v < text.size() && text[v] == ' ') ++v;
  std::size_t end = v;
  if (end < text.size() && text[end] == '"') {
    end = text.find('"', end + 1);
    if (end == std::string::npos) return std::nullopt;
    return text.substr(v + 1, end - v - 1);
  }
  while (end < text.size() && text[end] != ',' && text[end] != '\n' && text[end] != '}') ++end;
  return text.substr(v, end - v);
}

std::string human_bytes(double b) {
  char buf[64];
  if (b < 0) return "n/a";
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (b >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  } else {
    std::snprintf(buf, sizeof buf, "%.0f KiB", b / 1024.0);
  }
  return buf;
}

std::string human_seconds(double s) {
  char buf[64];
  if (s >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  }
  return buf;
}

std::string plain(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.5g", v);
  return buf;
}

std::string pad(const std::string& s, std::size_t w) {
  return s.size() >= w ? s + "  " : s + std::string(w - s.size(), ' ');
}

}  // namespace

std::optional<double> JsonRun::counter(const std::string& key) const {
  const std::optional<std::string> raw = json_raw(text, key);
  if (!raw) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(raw->c_str(), &end);
  if (end == raw->c_str()) return std::nullopt;
  return v;
}

std::optional<JsonRun> read_benchmark_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::size_t list = text.find("\"benchmarks\":");
  if (list == std::string::npos) return std::nullopt;
  const std::size_t open = text.find('{', list);
  if (open == std::string::npos) return std::nullopt;
  // Counters are flat numbers, so the first '}' closes the benchmark's object.
  const std::size_t close = text.find('}', open);
  JsonRun run;
  run.text = text.substr(open, close == std::string::npos ? std::string::npos : close - open + 1);
  run.name = json_raw(run.text, "name").value_or("?");
  // Google Benchmark appends "/iterations:N/manual_time"; the config's name is the part before.
  run.name = run.name.substr(0, run.name.find("/iterations:"));
  run.error = json_raw(run.text, "error_occurred").value_or("false") == "true";
  run.error_message = json_raw(run.text, "error_message").value_or("");
  return run;
}

std::string format_compare_table(const JsonRun& a, const JsonRun& b) {
  struct Row {
    const char* title;
    const char* key;
    std::string (*format)(double);
    bool ratio;
  };
  const Row rows[] = {
      {"step time (p50)", "step_s_p50", human_seconds, true},
      {"step time (mean)", "step_s_mean", human_seconds, true},
      {"step time (p90)", "step_s_p90", human_seconds, true},
      {"first call (incl. plan)", "first_call_s", human_seconds, true},
      {"peak bytes (tracked)", "peak_bytes", human_bytes, true},
      {"peak RSS delta", "peak_rss_delta_bytes", human_bytes, true},
      {"GFLOP/s (nominal)", "gflops", plain, true},
      {"GFLOP/s (executed)", "executed_gflops", plain, true},
      {"machine peak GFLOP/s", "machine_peak_gflops", plain, true},
      {"fraction of machine peak", "peak_frac", plain, true},
      {"triad bandwidth GB/s", "machine_triad_gbytes_per_s", plain, true},
      {"roofline (schedule)", "roofline_s", human_seconds, true},
      {"fraction of roofline", "roofline_frac", plain, true},
      {"unfused GEMMs alone", "unfused_gemms_s", human_seconds, true},
      {"loss", "loss", plain, false},
      {"clip ratio (region)", "clip_ratio_region", plain, false},
  };
  std::size_t w0 = 26, w1 = 16;
  const std::string a_title = "A: " + a.name, b_title = "B: " + b.name;
  w1 = std::max({w1, a_title.size() + 2, b_title.size() + 2});
  std::ostringstream os;
  os << pad("", w0) << pad(a_title, w1) << pad(b_title, w1) << "B/A\n";
  for (const Row& r : rows) {
    const std::optional<double> va = a.counter(r.key), vb = b.counter(r.key);
    if (!va && !vb) continue;
    // A fraction above 1 the run withheld (withhold_fraction_above_one): said, not printed as a result.
    const std::string withheld = std::string(r.key) + "_withheld";
    const std::optional<double> wa = a.counter(withheld), wb = b.counter(withheld);
    const auto cell = [&](const std::optional<double>& v, const std::optional<double>& w) {
      if (w) return "withheld (" + plain(*w) + " > 1: probe error)";
      return v ? r.format(*v) : std::string("-");
    };
    std::string ratio = "";
    if (r.ratio && va && vb && !wa && !wb && *va > 0.0 && *vb >= 0.0) ratio = plain(*vb / *va) + "x";
    os << pad(r.title, w0) << pad(cell(va, wa), w1) << pad(cell(vb, wb), w1) << ratio << "\n";
  }
  return os.str();
}

int run_compare(const std::string& self, const std::string& a, const std::string& b,
                const std::vector<std::string>& forwarded) {
  char dir_template[] = "/tmp/grpo-compare-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    std::fprintf(stderr, "grpo-microbench: cannot create a temporary directory: %s\n", std::strerror(errno));
    return 2;
  }
  std::vector<JsonRun> runs;
  int index = 0;
  for (const std::string& config : {a, b}) {
    const std::string out = std::string(dir) + "/" + (index++ == 0 ? "a" : "b") + ".json";
    std::vector<std::string> args = {self, "--config", config};
    args.insert(args.end(), forwarded.begin(), forwarded.end());
    args.push_back("--benchmark_out=" + out);
    args.push_back("--benchmark_out_format=json");
    std::fprintf(stderr, "grpo-microbench --compare: running %s in a fresh process\n", config.c_str());
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "grpo-microbench: fork failed: %s\n", std::strerror(errno));
      return 2;
    }
    if (pid == 0) {
      std::vector<char*> argv;
      for (std::string& s : args) argv.push_back(s.data());
      argv.push_back(nullptr);
      execv(self.c_str(), argv.data());
      std::fprintf(stderr, "grpo-microbench: exec %s failed: %s\n", self.c_str(), std::strerror(errno));
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    std::optional<JsonRun> run = read_benchmark_json(out);
    std::remove(out.c_str());
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !run || run->error) {
      std::fprintf(stderr, "grpo-microbench --compare: %s failed (%s)%s%s\n", config.c_str(),
                   WIFEXITED(status) ? ("exit " + std::to_string(WEXITSTATUS(status))).c_str() : "killed by a signal",
                   run && run->error ? ": " : "", run && run->error ? run->error_message.c_str() : "");
      rmdir(dir);
      return 1;
    }
    runs.push_back(*run);
  }
  rmdir(dir);
  std::printf("\ngrpo-microbench --compare (each config measured in its own process)\n%s",
              format_compare_table(runs[0], runs[1]).c_str());
  return 0;
}

}  // namespace grpo::bench
