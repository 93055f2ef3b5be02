// Counts heap allocations made while LmHeadLossPlan::execute runs with a
// caller-owned workspace, after two warm-up calls, and attributes each to the
// shared object it came from by walking the call stack: the library (and
// everything it calls outside oneDNN) must allocate nothing; what oneDNN 2.6
// allocates inside its own primitive execute is counted and printed per GEMM
// call, so the README can name it. Its own process: it interposes malloc and
// friends for everything loaded. Exit 0 = pass.
#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "grpo/grpo.hpp"

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);
}

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_ours{0}, g_onednn{0}, g_first_ours_frame{0};
thread_local bool t_inside = false;
char g_first_ours[256];

// Who allocated: a call stack through dnnl_primitive_execute is oneDNN's own
// execute (its argument map, gemm:jit's packing buffers); anything else --
// our code, TBB, oneDNN calls we make outside execute -- counts against us.
void record() {
  if (!g_counting.load(std::memory_order_relaxed) || t_inside) return;
  t_inside = true;
  void* frames[48];
  const int n = backtrace(frames, 48);
  bool onednn = false;
  const char* culprit = nullptr;
  for (int i = 2; i < n && !onednn; ++i) {  // 0: record, 1: the hook
    Dl_info info;
    if (dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr) continue;
    if (info.dli_sname != nullptr && std::strcmp(info.dli_sname, "dnnl_primitive_execute") == 0) onednn = true;
    if (culprit == nullptr && std::strstr(info.dli_fname, "libc.so") == nullptr &&
        std::strstr(info.dli_fname, "libstdc++") == nullptr) {
      culprit = info.dli_sname != nullptr ? info.dli_sname : info.dli_fname;
    }
  }
  if (onednn) {
    g_onednn.fetch_add(1);
  } else if (g_ours.fetch_add(1) == 0 && culprit != nullptr) {
    std::snprintf(g_first_ours, sizeof g_first_ours, "%s", culprit);
  }
  t_inside = false;
}

}  // namespace

extern "C" {
void* malloc(std::size_t n) {
  record();
  return __libc_malloc(n);
}
void* calloc(std::size_t a, std::size_t b) {
  record();
  return __libc_calloc(a, b);
}
void* realloc(void* p, std::size_t n) {
  record();
  return __libc_realloc(p, n);
}
void* memalign(std::size_t a, std::size_t n) {
  record();
  return __libc_memalign(a, n);
}
void* aligned_alloc(std::size_t a, std::size_t n) {
  record();
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, std::size_t a, std::size_t n) {
  record();
  *out = __libc_memalign(a, n);
  return *out != nullptr ? 0 : 12;  // ENOMEM
}
void free(void* p) { __libc_free(p); }
}

namespace {

std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

// One configuration: returns false when the library itself allocated.
// The operands both checks share: hidden [N, H], weight [V, H], bias and ids.
constexpr std::int64_t kB = 2, kT = 200, kH = 256, kV = 5003;
constexpr std::int64_t kN = kB * kT;

struct Operands {
  std::vector<float> hf, wf, b;
  std::vector<std::uint16_t> hb, wb;
  std::vector<std::int32_t> ids;
  const void* h = nullptr;
  const void* w = nullptr;

  Operands(grpo::DType dtype, std::mt19937& rng) : hf(kN * kH), wf(kV * kH), b(kV), ids(kN) {
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (float& x : hf) x = normal(rng);
    for (float& x : wf) x = 0.2F * normal(rng);
    for (float& x : b) x = 0.1F * normal(rng);
    hb.resize(hf.size());
    wb.resize(wf.size());
    for (std::size_t i = 0; i < hf.size(); ++i) hb[i] = to_bf16(hf[i]);
    for (std::size_t i = 0; i < wf.size(); ++i) wb[i] = to_bf16(wf[i]);
    h = dtype == grpo::DType::f32 ? static_cast<const void*>(hf.data()) : hb.data();
    w = dtype == grpo::DType::f32 ? static_cast<const void*>(wf.data()) : wb.data();
    std::uniform_int_distribution<std::int32_t> token(0, kV - 1);
    for (auto& id : ids) id = token(rng);
  }
};

bool check(grpo::DType dtype, grpo::IsLevel level, bool bias, const char* name) {
  using namespace grpo;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  Operands op(dtype, rng);
  const void* h = op.h;
  const void* w = op.w;
  std::vector<float>& b = op.b;
  std::vector<std::int32_t>& ids = op.ids;
  std::vector<float> mask(kN, 1.0F), adv(kN), old(kN), ref(kN, -9.0F);
  for (auto& a : adv) a = normal(rng);
  for (auto& o : old) o = -8.5F + 0.5F * normal(rng);  // a mix of clipped and unclipped rows
  mask[3] = 0.0F;
  LossConfig config;
  config.beta = 0.04F;
  config.importance_sampling_level = level;
  LmHeadShape shape{kB, kT, kH, kV, dtype, WeightLayout::vocab_major, bias, DType::f32};
  LmHeadOptions options;
  options.token_block = 128;  // several blocks (and sequences spanning them at sequence level)
  const LmHeadLossPlan plan(shape, config, options);
  std::vector<std::byte> workspace_storage(plan.workspace_size() + 64);
  auto* ws = workspace_storage.data() + (64 - reinterpret_cast<std::uintptr_t>(workspace_storage.data()) % 64) % 64;
  std::vector<float> logp(kN), entropy(kN), kl(kN), dh(kN * kH), dw(kV * kH), db(bias ? kV : 0);
  Metrics metrics;
  LmHeadStepStats stats;
  const LmHeadInputs in{{h, dtype, kN, kH, kH},
                        {w, dtype, kV, kH, kH},
                        bias ? VectorView{b.data(), DType::f32, kV} : VectorView{},
                        {ids, mask, adv, old, ref}};
  const LmHeadOutputs out{{logp, entropy, kl},
                          {dh.data(), DType::f32, kN, kH, kH},
                          {dw.data(), DType::f32, kV, kH, kH},
                          db,
                          &metrics,
                          &stats};
  const std::span<std::byte> workspace(ws, plan.workspace_size());
  for (int i = 0; i < 2; ++i) plan.execute(in, out, workspace);  // warm-up: bindings, thread ICVs, TBB pools
  constexpr int kCalls = 3;
  g_ours = 0;
  g_onednn = 0;
  g_counting = true;
  for (int i = 0; i < kCalls; ++i) plan.execute(in, out, workspace);
  g_counting = false;
  // GEMM calls per step: forward chunks x tiles, plus per block dweight tiles and dhidden chunks.
  const std::string sched = plan.describe();
  std::printf("%-34s library: %ld allocations; inside oneDNN's execute: %ld (%.1f per step)  [%s]\n", name,
              g_ours.load(), g_onednn.load(), static_cast<double>(g_onednn.load()) / kCalls, sched.c_str());
  if (g_ours.load() != 0) std::printf("  first allocation outside oneDNN from: %s\n", g_first_ours);
  return g_ours.load() == 0;
}

// The generic log-prob head: forward and backward (dentropy given, some rows
// with zero upstream, one masked), each counted on its own.
bool check_log_prob(grpo::DType dtype, bool bias, const char* name) {
  using namespace grpo;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  Operands op(dtype, rng);
  const void* h = op.h;
  const void* w = op.w;
  std::vector<float>& b = op.b;
  std::vector<std::int32_t>& ids = op.ids;
  std::vector<float> mask(kN, 1.0F), dlogp(kN), dent(kN);
  mask[3] = 0.0F;
  for (std::int64_t t = 0; t < kN; ++t) {
    dlogp[t] = t % 5 == 0 ? 0.0F : normal(rng);
    dent[t] = t % 5 == 0 ? 0.0F : 0.1F * normal(rng);
  }
  LmHeadShape shape{kB, kT, kH, kV, dtype, WeightLayout::vocab_major, bias, DType::f32};
  LmHeadOptions options;
  options.token_block = 128;
  const LmHeadLogProbPlan plan(shape, {0.9F, false}, options);
  std::vector<std::byte> workspace_storage(plan.workspace_size() + 64);
  auto* ws = workspace_storage.data() + (64 - reinterpret_cast<std::uintptr_t>(workspace_storage.data()) % 64) % 64;
  const std::span<std::byte> workspace(ws, plan.workspace_size());
  std::vector<float> logp(kN), entropy(kN), dh(kN * kH), dw(kV * kH), db(bias ? kV : 0);
  LmHeadStepStats fstats, bstats;
  const LogProbInputs in{{h, dtype, kN, kH, kH},
                         {w, dtype, kV, kH, kH},
                         bias ? VectorView{b.data(), DType::f32, kV} : VectorView{},
                         ids,
                         mask};
  const LogProbOutputs out{logp, entropy, &fstats};
  const LogProbGradients grads{{dh.data(), DType::f32, kN, kH, kH}, {dw.data(), DType::f32, kV, kH, kH}, db, &bstats};
  for (int i = 0; i < 2; ++i) {  // warm-up
    plan.forward(in, out, workspace);
    plan.backward(in, {dlogp, dent}, grads, workspace);
  }
  constexpr int kCalls = 3;
  bool ok = true;
  for (int pass = 0; pass < 2; ++pass) {
    g_ours = 0;
    g_onednn = 0;
    g_counting = true;
    for (int i = 0; i < kCalls; ++i) {
      if (pass == 0) {
        plan.forward(in, out, workspace);
      } else {
        plan.backward(in, {dlogp, dent}, grads, workspace);
      }
    }
    g_counting = false;
    const std::string label = std::string(name) + (pass == 0 ? " forward" : " backward");
    std::printf("%-34s library: %ld allocations; inside oneDNN's execute: %ld (%.1f per call)  [%s]\n", label.c_str(),
                g_ours.load(), g_onednn.load(), static_cast<double>(g_onednn.load()) / kCalls, plan.describe().c_str());
    if (g_ours.load() != 0) std::printf("  first allocation outside oneDNN from: %s\n", g_first_ours);
    ok &= g_ours.load() == 0;
  }
  return ok;
}

}  // namespace

int main() {
  // backtrace() loads libgcc_s on first use (an allocation): do it now.
  void* warm[4];
  backtrace(warm, 4);
  bool ok = true;
  ok &= check(grpo::DType::bf16, grpo::IsLevel::token, true, "bf16 token-level, bias");
  ok &= check(grpo::DType::f32, grpo::IsLevel::token, false, "f32 token-level");
  ok &= check(grpo::DType::bf16, grpo::IsLevel::sequence, false, "bf16 sequence-level (recompute)");
  ok &= check_log_prob(grpo::DType::bf16, true, "log-prob head bf16, bias");
  ok &= check_log_prob(grpo::DType::f32, false, "log-prob head f32");
  std::printf(ok ? "alloc_check: OK\n" : "alloc_check: FAILED (the library allocated during execute)\n");
  return ok ? 0 : 1;
}
