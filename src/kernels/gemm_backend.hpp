// The GEMM backend seam. A GemmSpec (gemm.hpp) is fixed at plan time; a
// backend built for it runs C (+)= A B (+ bias) on the caller's thread with
// the caller's scratch, and allocates nothing per call. Every engine is one,
// listed once, in priority order, in GRPO_GEMM_BACKENDS (below), whose rows
// gemm_registry.cpp's table (gemm_backends()) holds. kernels::Gemm takes the
// first of the default list that serves the spec. GRPO_GEMM=<a name of the
// list> forces one (as GRPO_SIMD does for the stage kernels; amx heads the
// default list anyway); a forced backend that cannot serve a spec falls back
// to onednn, then reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace grpo::kernels {

struct GemmSpec;
class GemmEngine;

// The one list of GEMM backends, in the default list's priority order:
//   amx        our AMX-BF16 microkernels (gemm_amx.cpp): bf16 A and B, when the
//              CPU has AMX-BF16 + AVX512-BF16 and Linux grants the tile state
//   avx2       our f32 FMA microkernels over the same blocked GEMM, bf16 and
//              f16 widened as they are packed (gemm_avx2.cpp): A and B each
//              f32, bf16 or f16 on CPUs with AVX2, FMA and F16C and no
//              AVX-512, where oneDNN 2.6 has no bf16 or f16 matmul and its
//              f32 one is not batch-invariant; elsewhere only when forced
//   avx512fma  the blocked GEMM in f32 FMAs on bf16 or f16 widened as it is
//              packed (gemm_avx512_fma.cpp): bf16 A and B on Intel CPUs with
//              AVX-512 where amx does not serve, and A and B each f32, bf16
//              or f16 with at least one f16 on every AVX-512 CPU (no other
//              backend of ours takes f16, and oneDNN 2.6 needs AVX512-FP16
//              for it) (avx512_fma_is_default); elsewhere only when forced
//   avx512bf16 our vdpbf16ps microkernels (gemm_avx512_bf16.cpp): bf16 A
//              and B on CPUs with AVX512-BF16 where amx does not serve
//   onednn     oneDNN's matmul (gemm_onednn.cpp): no f16 anywhere (A, B, C
//              or bias)
//   reference  plain loops in f32, k ascending (gemm_reference.cpp): any spec,
//              slow; the last resort (a spec oneDNN cannot create on this CPU
//              lands here) and a comparison point for the tests
// Every backend of ours writes C in f32, bf16 or f16 (an f16 C saturating at
// +-65504, counted: gemm.hpp's take_f16_saturations) and takes a bias in
// any of them.
// A row is X(kind, name, in_default_list, unusable, make, fixed_traits): the
// GemmBackendKind enumerator, then GemmBackendEntry's columns (below). Here
// the kinds alone are expanded (the enum); gemm_registry.cpp, where the
// gates and makers the other columns name are defined, expands whole rows
// into the table (gemm_backends()) and says why each row is where it is.
// Adding a backend is adding its row.
#define GRPO_GEMM_BACKENDS(X)                                                                                 \
  X(amx, "amx", any_spec<amx_usable>, amx_reason, (gated<amx_usable, detail::make_amx_gemm_on_cpu>), nullptr) \
  X(avx2, "avx2", any_spec<avx2_gemm_is_default>, (unless<avx2_gemm_usable, kNoAvx2>),                        \
    (gated<avx2_gemm_usable, detail::make_avx2_gemm_on_cpu>), nullptr)                                        \
  X(avx512_fma, "avx512fma", avx512_fma_is_default, (unless<avx512_fma_usable, kNoAvx512>),                   \
    (gated<avx512_fma_usable, detail::make_avx512_fma_gemm_on_cpu>), nullptr)                                 \
  X(avx512_bf16, "avx512bf16", any_spec<avx512_bf16_usable>, (unless<avx512_bf16_usable, kNoAvx512Bf16>),     \
    (gated<avx512_bf16_usable, detail::make_avx512_bf16_gemm_on_cpu>), nullptr)                               \
  X(onednn, "onednn", any_spec<always>, no_reason, onednn, onednn_traits)                                     \
  X(reference, "reference", any_spec<always>, no_reason, reference, nullptr)

#define GRPO_GEMM_KIND(kind, ...) kind,
enum class GemmBackendKind : std::uint8_t { GRPO_GEMM_BACKENDS(GRPO_GEMM_KIND) };
#undef GRPO_GEMM_KIND

const char* to_string(GemmBackendKind kind);

// What a driver may rely on from a backend.
struct GemmTraits {
  // Each element of C is reduced over K in an order that depends on K and
  // the data alone, never on M, N or the element's position: a row's result
  // does not depend on the batch it came in (batch invariance by
  // construction). oneDNN's brgemm picks its K blocking from M: false.
  bool m_independent = false;
  // For a spec with a shared operand (GemmSpec::shared): the most of its
  // rows (A's M, or B's N) one call takes at full speed; a call with more
  // packs them in smaller blocks and runs slower, so a driver free to split
  // the rows (m_independent) makes calls of at most this many. 0: no limit.
  std::int64_t max_shared_rows = 0;
};

// One caller's objects for a backend that needs some to run without
// allocating (oneDNN's stream and memory objects; gemm.hpp's GemmBinding
// keeps one). Not thread-safe: one caller serves one thread at a time.
class GemmCaller {
 public:
  virtual ~GemmCaller() = default;
  virtual void run(const void* a, const void* b, void* c, const void* bias, void* scratch,
                   const void* packed) const = 0;
};

// A register block's edges, XNNPACK's mr, nr, kr: the rows and columns of C
// one micro call computes and the k it takes per step. The GEMM tester
// builds each backend's shapes around its own.
struct GemmTile {
  std::int64_t mr = 1;
  std::int64_t nr = 1;
  std::int64_t kr = 1;
};

class GemmBackend {
 public:
  virtual ~GemmBackend() = default;
  virtual GemmBackendKind kind() const = 0;
  // For describe(): e.g. "amx_bf16" or oneDNN's "brg:avx512_core_amx_bf16".
  virtual const char* implementation() const = 0;
  virtual GemmTraits traits() const = 0;
  virtual std::size_t scratchpad_bytes() const = 0;
  // scratch: scratchpad_bytes() bytes, 64-byte aligned. On the calling
  // thread alone, except oneDNN's for a spec with threads > 1 (the unfused
  // baselines' whole-matrix calls), which may use that many OpenMP threads;
  // ours always run on the calling thread (the baselines split C's columns
  // over their threads for them).
  // packed: null, or the spec's shared operand as pack_shared() left it.
  virtual void run(const void* a, const void* b, void* c, const void* bias, void* scratch,
                   const void* packed) const = 0;
  // The shared operand (GemmSpec::shared) packed once for many calls; 0
  // bytes: the backend reads it as it is.
  virtual std::size_t shared_packed_bytes() const { return 0; }
  // The scratch run() needs when it is given `packed` (<= scratchpad_bytes():
  // the room a backend packs the shared operand into itself goes unused).
  virtual std::size_t scratchpad_bytes_with_packed() const { return scratchpad_bytes(); }
  virtual void pack_shared(const void* /*operand*/, void* /*packed*/) const {}
  // {1, 1, 1}: no register block of ours (oneDNN, the reference loops).
  virtual GemmTile tile() const { return {}; }
  // Null: run() needs no per-caller objects (ours).
  virtual std::unique_ptr<GemmCaller> make_caller() const { return nullptr; }
};

// One row of the backend table.
struct GemmBackendEntry {
  GemmBackendKind kind;
  const char* name;  // GRPO_GEMM's, to_string's, the tools'
  // In the default list on this CPU (and usable) for spec (a backend may
  // lead the list for some dtypes alone: avx512fma).
  bool (*in_default_list)(const GemmSpec& spec);
  // Null when the CPU (and the OS) has what the backend needs, else why not.
  const char* (*unusable)();
  // Null when the backend does not serve spec on this CPU; why_not (may be
  // null) then says why, when the backend knows better than unusable().
  // engine: oneDNN's (null only where fixed_traits is null: ours need none).
  std::unique_ptr<GemmBackend> (*make)(const GemmEngine* engine, const GemmSpec& spec, std::string* why_not);
  // Its traits without building it (oneDNN's: building is a JIT), else null.
  GemmTraits (*fixed_traits)();
};

// Every backend, in the default list's priority order.
std::span<const GemmBackendEntry> gemm_backends();
const GemmBackendEntry& gemm_backend(GemmBackendKind kind);
// Null for an unknown name.
const GemmBackendEntry* find_gemm_backend(const char* name);

namespace detail {
// The backends' makers, called through the table (gemm_registry.cpp): the
// *_on_cpu ones are in their own translation units (compiled for their ISA)
// and called only once the CPU was found to have it. Null when the spec is
// outside what they serve.
std::unique_ptr<GemmBackend> make_amx_gemm_on_cpu(const GemmSpec& spec);
std::unique_ptr<GemmBackend> make_avx512_bf16_gemm_on_cpu(const GemmSpec& spec);
std::unique_ptr<GemmBackend> make_avx512_fma_gemm_on_cpu(const GemmSpec& spec);
std::unique_ptr<GemmBackend> make_avx2_gemm_on_cpu(const GemmSpec& spec);
std::unique_ptr<GemmBackend> make_reference_gemm(const GemmSpec& spec);
// Null when oneDNN cannot create the matmul (why_not says why).
std::unique_ptr<GemmBackend> make_onednn_gemm(const GemmEngine& engine, const GemmSpec& spec, std::string* why_not);
// oneDNN's scratchpad for spec from its primitive descriptor alone (no JIT);
// throws grpo::Error (unsupported) when oneDNN cannot create the matmul.
std::size_t onednn_scratchpad_bytes(const GemmEngine& engine, const GemmSpec& spec);
}  // namespace detail

// The gates, on cpu.hpp's one probe (gemm_registry.cpp).
// The CPU has AMX-BF16 and AVX512-BF16, and this process may use the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). Why not, when false.
bool amx_usable();
const char* amx_unusable_reason();
// The CPU has AVX-512F/BW/DQ/VL and AVX512-BF16.
bool avx512_bf16_usable();
// The CPU has AVX-512F/BW/DQ/VL (the avx512fma backend's needs: its f16
// conversions are AVX-512F's).
bool avx512_fma_usable();
// ... and is an Intel CPU: its vdpbf16ps runs at half its FMA's FLOP rate,
// or it has none, so the avx512fma backend comes before avx512bf16 (and
// oneDNN) in the default list; or spec has an f16 A or B, which no other
// backend but the reference loops takes on an AVX-512 CPU.
bool avx512_fma_is_default(const GemmSpec& spec);
// The CPU (and the OS) has AVX2, FMA and F16C.
bool avx2_gemm_usable();
// ... and no AVX-512: oneDNN 2.6 has no bf16 matmul there, so the avx2
// backend is in the default list.
bool avx2_gemm_is_default();

}  // namespace grpo::kernels
