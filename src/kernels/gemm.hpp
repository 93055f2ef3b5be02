// The GEMMs of a plan. A Gemm is created once, in a plan, for one exact
// problem (shapes, strides, dtypes, accumulate or not) and then only executed,
// by the first backend of gemm_backend.hpp's table that serves it (our AMX,
// AVX-512 or AVX2 microkernels, oneDNN's matmul, the reference loops).
// Scratchpads are user-managed: the caller passes scratchpad_bytes() of its
// own memory, so every byte a backend needs is in the plan's workspace, and
// concurrent executions never share one. gemm_sizes() tells a planner those
// bytes without building the GEMM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "grpo/types.hpp"
#include "kernels/gemm_backend.hpp"

namespace dnnl {
struct engine;
}

namespace grpo::kernels {

// A 2-D operand: element (i, j) at data + (i * row_stride + j * col_stride) elements.
struct GemmOperand {
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  std::int64_t col_stride = 1;
};

// An operand the driver passes unchanged to many calls in a row (the token
// block's hidden rows: the forward's A for every vocab tile, dW's B): a
// backend that rearranges operands may pack it once (Gemm::pack_shared) and
// take the packed copy in every call.
enum class SharedOperand : std::uint8_t { none, a, b };

struct GemmSpec {
  GemmOperand a;            // [M, K]
  GemmOperand b;            // [K, N]
  GemmOperand c;            // [M, N]
  bool accumulate = false;  // c += a * b, else c = a * b
  bool has_bias = false;    // c += bias[j], bias is [1, N] contiguous
  DType bias_dtype = DType::f32;
  int threads = 1;  // OpenMP threads oneDNN may use inside the call (ours run on the calling thread)
  SharedOperand shared = SharedOperand::none;
};

// The CPU engine; plans own one each (no process-wide engine).
class GemmEngine {
 public:
  GemmEngine();
  ~GemmEngine();
  GemmEngine(const GemmEngine&) = delete;
  GemmEngine& operator=(const GemmEngine&) = delete;
  const dnnl::engine& get() const;

 private:
  std::unique_ptr<dnnl::engine> engine_;
};

class Gemm {
 public:
  // The first backend of the list (or GRPO_GEMM's) that serves spec.
  Gemm(const GemmEngine& engine, const GemmSpec& spec);
  // Exactly this backend (the tests compare backends); throws grpo::Error
  // (unsupported) when it cannot serve spec on this CPU.
  Gemm(const GemmEngine& engine, const GemmSpec& spec, GemmBackendKind backend);
  ~Gemm();
  Gemm(Gemm&&) noexcept;
  Gemm& operator=(Gemm&&) noexcept;

  const GemmSpec& spec() const { return spec_; }
  std::size_t scratchpad_bytes() const { return backend_->scratchpad_bytes(); }
  // The backend's implementation name (e.g. "grpo:amx_bf16", or oneDNN's
  // "brg:avx512_core_bf16"), for describe().
  const char* implementation() const { return backend_->implementation(); }
  GemmBackendKind backend() const { return backend_->kind(); }
  GemmTraits traits() const { return backend_->traits(); }
  // scratchpad: scratchpad_bytes() bytes, 64-byte aligned (may be null when 0).
  // oneDNN builds its memory objects and stream per call here (heap
  // allocations): for the baselines and tools; hot paths run through a
  // GemmBinding.
  void run(const void* a, const void* b, void* c, const void* bias, void* scratchpad) const {
    backend_->run(a, b, c, bias, scratchpad, nullptr);
  }

  // Bytes of spec.shared packed by pack_shared(); 0 when the backend takes
  // the operand as it is (oneDNN, reference, or no shared operand).
  std::size_t shared_packed_bytes() const { return backend_->shared_packed_bytes(); }
  // The scratchpad a run given the packed shared operand needs (<=
  // scratchpad_bytes(); the same for a backend that packs nothing).
  std::size_t scratchpad_bytes_with_packed() const { return backend_->scratchpad_bytes_with_packed(); }
  // Packs the shared operand (its data as run() would get it) into packed
  // (shared_packed_bytes(), 64-byte aligned); every run() given that packed
  // copy then reads it instead of the operand.
  void pack_shared(const void* operand, void* packed) const { backend_->pack_shared(operand, packed); }

  // The position of this GEMM in its plan's list (GemmBindings are indexed by it).
  std::size_t index() const { return index_; }
  void set_index(std::size_t index) { index_ = index; }

  const GemmBackend& backend_object() const { return *backend_; }

 private:
  GemmSpec spec_;
  std::unique_ptr<GemmBackend> backend_;
  std::size_t index_ = 0;
};

// What a Gemm of this spec would be and need, without building it: our
// backends compute their blocking, oneDNN its primitive descriptor alone (no
// primitive, no JIT). The same backend the Gemm would take.
struct GemmSizes {
  GemmBackendKind backend = GemmBackendKind::reference;
  std::size_t scratchpad_bytes = 0;
  std::size_t shared_packed_bytes = 0;
  std::size_t scratchpad_bytes_with_packed = 0;
  GemmTraits traits;
};
GemmSizes gemm_sizes(const GemmEngine& engine, const GemmSpec& spec);

// The traits of the backend a Gemm of this spec would get, without building
// it (a plan sizes its schedule by them before creating its GEMMs).
GemmTraits gemm_traits(const GemmSpec& spec);

// The f16 C entries (GemmSpec::c.dtype f16) the GEMMs run on the calling
// thread saturated since the last call: values that would round to an fp16
// infinity, written as +-65504 (f16.hpp's float_to_f16_saturated; a NaN stays
// NaN and is not counted). Reset to 0 by the call. Per thread because our
// backends run on the calling thread (onednn serves no f16); a driver takes
// it right after each run() of a GEMM with an f16 C and adds it to what it
// reports.
std::int64_t take_f16_saturations();

namespace detail {
// Adds n to the calling thread's count (the backends' epilogues, on the rare
// path where a store saturated).
void add_f16_saturations(std::int64_t n);
}  // namespace detail

// The backend GRPO_GEMM names (a name of GRPO_GEMM_BACKENDS,
// gemm_backend.hpp), or null for the default list. Read when a plan builds
// its GEMMs: a plan keeps the backends it was built with.
const char* forced_gemm_backend();

// One caller's objects for one Gemm (oneDNN's stream and memory objects,
// GemmBackend::make_caller; none for ours). Created once (a plan keeps sets of
// them in a pool, one set per concurrent execute), so run() allocates nothing
// on our side. Not thread-safe: one binding serves one thread at a time.
class GemmBinding {
 public:
  explicit GemmBinding(const Gemm& gemm)
      : backend_(&gemm.backend_object()), caller_(gemm.backend_object().make_caller()) {}

  // packed: null, or the shared operand as Gemm::pack_shared() left it.
  void run(const void* a, const void* b, void* c, const void* bias, void* scratchpad,
           const void* packed = nullptr) const {
    if (caller_ != nullptr) {
      caller_->run(a, b, c, bias, scratchpad, packed);
    } else {
      backend_->run(a, b, c, bias, scratchpad, packed);
    }
  }

 private:
  const GemmBackend* backend_;
  std::unique_ptr<GemmCaller> caller_;
};

}  // namespace grpo::kernels
