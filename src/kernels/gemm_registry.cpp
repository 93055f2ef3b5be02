// The GEMM backend table (gemm_backends(): every engine, listed once) and the
// backends' CPU gates (on cpu.hpp's one probe), compiled for any x86-64 (as
// dispatch.cpp is for the stage kernels): a backend's own file is compiled
// for its ISA, and the compiler may use that ISA anywhere in it, before any
// check (an ASan build used AVX-512 in make_amx_gemm's prologue, and a Zen 3
// died of SIGILL there). So nothing of those files runs until a gate here
// said the CPU (and the OS) has what they need.
#include <cstring>
#include <iterator>
#include <string>

#include "kernels/cpu.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {

bool amx_usable() { return amx_state().usable; }
const char* amx_unusable_reason() { return amx_state().reason; }
bool avx512_bf16_usable() { return cpu_features().avx512_bf16; }
bool avx512_fma_usable() { return cpu_features().avx512; }

bool avx512_fma_is_default(const GemmSpec& spec) {
  // Intel's cores run vdpbf16ps zmm at a quarter of their f32 FMA
  // instruction rate, half its FLOP rate: on a Xeon of model 207 (Emerald
  // Rapids) without AMX, one thread measured 92.6-103 GFLOP/s of vdpbf16ps
  // against 191-207 of FMA. AMD's Zen 4 and Zen 5 run it at twice the FMA's
  // FLOPs. Intel's AVX-512 CPUs without AVX512-BF16 (Skylake to Ice Lake)
  // had oneDNN 2.6 here. An f16 A or B: amx and avx512bf16 take bf16 alone
  // and oneDNN no f16 (gemm_onednn.cpp), so here on any AVX-512 CPU; an AMD
  // CPU's bf16 GEMMs keep avx512bf16.
  const bool f16 = spec.a.dtype == DType::f16 || spec.b.dtype == DType::f16;
  return cpu_features().avx512 && (cpu_features().intel || f16);
}

// F16C for the f16 operands' and C's conversions (vcvtph2ps, vcvtps2ph):
// every CPU with AVX2 has it.
bool avx2_gemm_usable() { return cpu_features().avx2 && cpu_features().fma && cpu_features().f16c; }

bool avx2_gemm_is_default() { return avx2_gemm_usable() && !(cpu_features().cpuid_avx512f && cpu_features().os_zmm); }

namespace {

// A maker of ours behind its CPU gate.
template <bool (*kUsable)(), std::unique_ptr<GemmBackend> (*kMake)(const GemmSpec&)>
std::unique_ptr<GemmBackend> gated(const GemmEngine* /*engine*/, const GemmSpec& spec, std::string* /*why_not*/) {
  return kUsable() ? kMake(spec) : nullptr;
}

// A default-list gate of the CPU alone, whatever the spec.
template <bool (*kGate)()>
bool any_spec(const GemmSpec& /*spec*/) {
  return kGate();
}

bool always() { return true; }
const char* no_reason() { return nullptr; }
template <bool (*kUsable)(), const char* kWhy>
const char* unless() {
  return kUsable() ? nullptr : kWhy;
}
const char* amx_reason() { return amx_usable() ? nullptr : amx_unusable_reason(); }

constexpr char kNoAvx512Bf16[] = "the CPU has no AVX512-BF16";
constexpr char kNoAvx512[] = "the CPU has no AVX-512F/BW/DQ/VL";
constexpr char kNoAvx2[] = "the CPU has no AVX2, FMA and F16C";

std::unique_ptr<GemmBackend> onednn(const GemmEngine* engine, const GemmSpec& spec, std::string* why_not) {
  return detail::make_onednn_gemm(*engine, spec, why_not);
}
std::unique_ptr<GemmBackend> reference(const GemmEngine* /*engine*/, const GemmSpec& spec, std::string* /*why_not*/) {
  return detail::make_reference_gemm(spec);
}
// oneDNN's brgemm picks its K blocking from M.
GemmTraits onednn_traits() { return {.m_independent = false}; }

// The table: GRPO_GEMM_BACKENDS's rows (gemm_backend.hpp). Why each is where
// it is: amx first where it runs; avx2 only where there is no AVX-512
// (avx2_gemm_is_default); on Intel CPUs with AVX-512, f32 FMAs on widened
// bf16 (avx512_fma_is_default: Xeon model 207 without AMX, one thread, the
// step's three GEMMs at 151-165 GFLOP/s against vdpbf16ps's 92-100) before
// avx512bf16, and on every AVX-512 CPU for an f16 A or B, which amx,
// avx512bf16 and oneDNN do not take; avx512bf16 for bf16 A and B on an
// AVX512-BF16 CPU without AMX: faster than oneDNN 2.6 on a Zen 4 at the
// headline and at T=512 (gemm_avx512_bf16.cpp's header, docs/benchmarks.md),
// and with bf16 gradients oneDNN's gemm:jit asked a scratchpad the size of
// the dW tile in f32, which left the workspace budget one tile slot: the
// step ran on one thread (9.17 s against 4.36 s); then oneDNN, then the
// reference loops.
#define GRPO_GEMM_ROW(kind, name, in_default_list, unusable, make, fixed_traits) \
  {GemmBackendKind::kind, name, in_default_list, unusable, make, fixed_traits},
constexpr GemmBackendEntry kBackends[] = {GRPO_GEMM_BACKENDS(GRPO_GEMM_ROW)};
#undef GRPO_GEMM_ROW

}  // namespace

std::span<const GemmBackendEntry> gemm_backends() { return kBackends; }

const GemmBackendEntry& gemm_backend(GemmBackendKind kind) {
  for (const GemmBackendEntry& e : kBackends) {
    if (e.kind == kind) return e;
  }
  return kBackends[std::size(kBackends) - 1];  // unreachable: every kind has a row
}

const GemmBackendEntry* find_gemm_backend(const char* name) {
  for (const GemmBackendEntry& e : kBackends) {
    if (std::strcmp(e.name, name) == 0) return &e;
  }
  return nullptr;
}

const char* to_string(GemmBackendKind kind) { return gemm_backend(kind).name; }

}  // namespace grpo::kernels
