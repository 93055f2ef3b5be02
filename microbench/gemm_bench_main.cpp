// grpo-gemm-bench: the fused step's three GEMMs alone, on one thread, per
// GEMM backend, against one thread's measured peak for the model's dtype.
//
//   forward  logits tile [T, tile] = hidden [T, H] x W tile^T   (hidden packed once, as the plan does)
//   dW       dW tile [tile, H] += dlogits^T [tile, T] x hidden [T, H]  (accumulating, f32)
//   dhidden  [T, chunk] = dlogits [T, V] x W [V, chunk]
//
// --dtype bf16: hidden, W and dlogits bf16 (the bf16 step). --dtype f16:
// hidden and W f16, dlogits f32 (the f16 step's: forward f16 x f16, dW and
// dhidden f32 x f16). Shapes, strides and the shared operand are the plan's
// (vocab-major W); inputs are N(0, 1), which no GEMM's speed depends on.
// Each case is timed best of --reps after one untimed run, on a warm C, the
// forward and dW on the next vocab tile of W / dlogits each run (as the step
// reads them: from memory, not from the last run's caches); the fraction is
// of one thread's peak of the fastest unit for the dtype (bf16: vdpbf16ps,
// AMX or f32 FMA; f16: f32 FMA), measure_machine_peak on one thread, in
// this process.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpo/types.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"
#include "machine_peak.hpp"
#include "synth.hpp"

namespace {

using grpo::DType;
using grpo::kernels::Gemm;
using grpo::kernels::GemmBackendKind;
using grpo::kernels::GemmBinding;
using grpo::kernels::GemmSpec;
using grpo::kernels::SharedOperand;

// n N(0, 1) values of dtype.
std::vector<std::byte> random_values(std::size_t n, DType dtype, unsigned seed) {
  std::vector<std::byte> v(n * grpo::size_of(dtype));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = dist(gen);
    if (dtype == DType::f32) {
      std::memcpy(v.data() + i * sizeof(float), &x, sizeof(float));
    } else {
      const std::uint16_t h = dtype == DType::f16 ? grpo::kernels::float_to_f16(x) : grpo::bench::float_to_bf16(x);
      std::memcpy(v.data() + i * sizeof(h), &h, sizeof(h));
    }
  }
  return v;
}

struct Case {
  const char* name;
  GemmSpec spec;
  const void* a;
  const void* b;
  std::size_t c_elems;
  // Run r takes A at a + (r % tiles) * a_step (B likewise), in elements:
  // the forward and dW walk the vocab tiles as the step does, so their W or
  // dlogits tile does not come warm from the last run's caches.
  std::size_t a_step = 0;
  std::size_t b_step = 0;
};

int run(int argc, char** argv) {
  CLI::App app{"The fused step's three GEMMs alone, one thread, per GEMM backend"};
  std::int64_t tokens = 512, hidden = 4096, vocab = 151936, tile = 2048, chunk = 2048;
  int reps = 5;
  std::string dtype_name = "bf16";
  // Default: every backend of the library's table but the reference loops
  // (hours at these shapes); "all": every one.
  std::vector<std::string> backends{"default"};
  std::string names;
  for (const grpo::kernels::GemmBackendEntry& e : grpo::kernels::gemm_backends()) {
    names += std::string(names.empty() ? "" : ", ") + e.name;
  }
  app.add_option("--tokens", tokens, "T: rows of the token block")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "H")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "V (dhidden's K)")->check(CLI::PositiveNumber);
  app.add_option("--vocab-tile", tile, "vocab columns per forward / dW GEMM")->check(CLI::PositiveNumber);
  app.add_option("--hidden-chunk", chunk, "hidden columns per dhidden GEMM")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed runs per case (best of)")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype_name,
                 "the model's dtype: bf16 (hidden, W, dlogits bf16) or f16 (hidden and W f16, dlogits f32)")
      ->check(CLI::IsMember({"bf16", "f16"}));
  app.add_option("--backends", backends,
                 names + " (each skipped where the CPU lacks it); all: every one; default: all but reference");
  CLI11_PARSE(app, argc, argv);
  if (backends.size() == 1 && (backends[0] == "all" || backends[0] == "default")) {
    const bool all = backends[0] == "all";
    backends.clear();
    for (const grpo::kernels::GemmBackendEntry& e : grpo::kernels::gemm_backends()) {
      if (all || e.kind != GemmBackendKind::reference) backends.emplace_back(e.name);
    }
  }
  if (tile > vocab || chunk > hidden) {
    std::fprintf(stderr, "grpo-gemm-bench: --vocab-tile must be <= --vocab and --hidden-chunk <= --hidden\n");
    return 2;
  }

  grpo::bench::PeakProbeOptions one;
  one.threads = 1;
  const grpo::bench::MachinePeak peak = grpo::bench::measure_machine_peak(one);
  // The model's dtype (hidden, W) and dlogits' (bf16, or f32 for an f16 model).
  const DType model = dtype_name == "f16" ? DType::f16 : DType::bf16;
  const DType grad = model == DType::f16 ? DType::f32 : DType::bf16;
  const double peak_gflops = peak.for_dtype(model);
  std::printf("one thread's %s peak: %.1f GFLOP/s (vdpbf16ps %.1f, AMX %.1f, f32 FMA %.1f)%s%s\n",
              grpo::to_string(model), peak_gflops, peak.avx512_bf16_gflops, peak.amx_bf16_gflops, peak.f32_fma_gflops,
              peak.missing.empty() ? "" : "; ", peak.missing.c_str());

  const auto hid = random_values(static_cast<std::size_t>(tokens * hidden), model, 1);
  const auto w = random_values(static_cast<std::size_t>(vocab * hidden), model, 2);
  const auto dl = random_values(static_cast<std::size_t>(tokens * vocab), grad, 3);
  std::vector<Case> cases;
  const std::int64_t tiles = vocab / tile;  // whole vocab tiles the forward and dW cases walk
  {
    GemmSpec g;
    g.a = {model, tokens, hidden, hidden, 1};
    g.b = {model, hidden, tile, 1, hidden};
    g.c = {DType::f32, tokens, tile, tile, 1};
    g.shared = SharedOperand::a;
    cases.push_back({"forward", g, hid.data(), w.data(), static_cast<std::size_t>(tokens * tile), 0,
                     static_cast<std::size_t>(tile * hidden)});
  }
  {
    GemmSpec g;
    g.a = {grad, tile, tokens, 1, vocab};
    g.b = {model, tokens, hidden, hidden, 1};
    g.c = {DType::f32, tile, hidden, hidden, 1};
    g.accumulate = true;
    g.shared = SharedOperand::b;
    cases.push_back({"dweight", g, dl.data(), hid.data(), static_cast<std::size_t>(tile * hidden),
                     static_cast<std::size_t>(tile), 0});
  }
  {
    GemmSpec g;
    g.a = {grad, tokens, vocab, vocab, 1};
    g.b = {model, vocab, chunk, hidden, 1};
    g.c = {DType::f32, tokens, chunk, hidden, 1};
    cases.push_back({"dhidden", g, dl.data(), w.data(), static_cast<std::size_t>(tokens * hidden)});
  }

  const grpo::kernels::GemmEngine engine;
  std::printf("%-12s %-8s %-22s %-34s %10s %9s %7s\n", "backend", "gemm", "M x K x N", "implementation", "best ms",
              "GFLOP/s", "of peak");
  for (const std::string& name : backends) {
    const grpo::kernels::GemmBackendEntry* entry = grpo::kernels::find_gemm_backend(name.c_str());
    if (entry == nullptr) {
      std::fprintf(stderr, "grpo-gemm-bench: --backends: unknown backend '%s'\n", name.c_str());
      return 2;
    }
    const GemmBackendKind kind = entry->kind;
    for (const Case& c : cases) {
      std::unique_ptr<Gemm> g;
      try {
        g = std::make_unique<Gemm>(engine, c.spec, kind);
      } catch (const grpo::Error& e) {
        std::printf("%-12s %-8s skipped: %s\n", name.c_str(), c.name, e.what());
        continue;
      }
      const grpo::bench::HostBuffer scratch(g->scratchpad_bytes());
      const grpo::bench::HostBuffer packed(g->shared_packed_bytes());
      scratch.fill_zero();
      if (!packed.empty()) g->pack_shared(c.spec.shared == SharedOperand::a ? c.a : c.b, packed.data());
      const GemmBinding binding(*g);
      // 64-byte aligned, as the step's outputs are (a std::vector's data is
      // 16-byte aligned: rows would straddle cache lines).
      const grpo::bench::HostBuffer out(c.c_elems * sizeof(float));
      out.fill_zero();
      const auto run_on_tile = [&](int r) {  // run r's operands (Case::a_step)
        const auto at = static_cast<std::size_t>(r % tiles);
        binding.run(static_cast<const std::byte*>(c.a) + at * c.a_step * grpo::size_of(c.spec.a.dtype),
                    static_cast<const std::byte*>(c.b) + at * c.b_step * grpo::size_of(c.spec.b.dtype), out.data(),
                    nullptr, scratch.data(), packed.data());
      };
      run_on_tile(0);
      double best = 1e30;
      for (int r = 1; r <= reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        run_on_tile(r);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      const double flops = 2.0 * static_cast<double>(c.spec.a.rows) * static_cast<double>(c.spec.a.cols) *
                           static_cast<double>(c.spec.b.cols);
      const std::string shape =
          std::to_string(c.spec.a.rows) + " x " + std::to_string(c.spec.a.cols) + " x " + std::to_string(c.spec.b.cols);
      const double gflops = flops / best * 1e-9;
      std::printf("%-12s %-8s %-22s %-34s %10.2f %9.1f %6.1f%%\n", name.c_str(), c.name, shape.c_str(),
                  g->implementation(), best * 1e3, gflops, peak_gflops > 0.0 ? 100.0 * gflops / peak_gflops : 0.0);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grpo-gemm-bench: %s\n", e.what());
    return 1;
  }
}
