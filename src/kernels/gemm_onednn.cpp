// The onednn GEMM backend: oneDNN 2.6's matmul behind GemmBackend. The
// primitive is created once, for the spec (user-managed scratchpad, a sum
// post-op when accumulating); run() builds its memory objects and stream per
// call (heap allocations: the baselines and tools), and a GemmBinding's
// caller (make_caller) keeps one set of them, re-pointed per call, so the
// plans' hot paths allocate nothing on our side.
//
// Threads: the Debian oneDNN uses the OpenMP runtime. The backend sets the
// spec's OpenMP thread count (1 for calls made inside TBB tasks, the caller's
// cap for whole-matrix calls) on the calling thread around primitive creation
// and execution, restoring the previous value after; so a call from a TBB
// worker never starts a team of its own beside the TBB threads.
#include <omp.h>

#include <string>
#include <utility>

#include <oneapi/dnnl/dnnl.hpp>

#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {
namespace {

using dnnl::memory;

memory::data_type to_dnnl(DType dtype) {
  switch (dtype) {
    case DType::f32: return memory::data_type::f32;
    case DType::bf16: return memory::data_type::bf16;
    case DType::f16: return memory::data_type::f16;  // never reached: refusal() refused it
  }
  return memory::data_type::undef;
}

// Why this backend does not take spec, or null. oneDNN 2.6's f16 matmul
// needs AVX512-FP16 (and the avx512fma and avx2 backends serve f16 on every
// CPU with AVX-512 or AVX2): refused wherever f16 appears, so no CPU ever
// runs an f16 GEMM whose bits depend on whether it has AVX512-FP16.
const char* refusal(const GemmSpec& spec) {
  const bool f16 = spec.a.dtype == DType::f16 || spec.b.dtype == DType::f16 || spec.c.dtype == DType::f16 ||
                   (spec.has_bias && spec.bias_dtype == DType::f16);
  return f16 ? "the onednn backend takes no f16 operand, C or bias (oneDNN 2.6's f16 matmul needs AVX512-FP16)"
             : nullptr;
}

memory::desc describe(const GemmOperand& op) {
  return memory::desc({op.rows, op.cols}, to_dnnl(op.dtype), memory::dims{op.row_stride, op.col_stride});
}

// Sets the calling thread's OpenMP thread count for one scope.
class OmpThreadsScope {
 public:
  explicit OmpThreadsScope(int threads) : previous_(omp_get_max_threads()) {
    if (threads != previous_) omp_set_num_threads(threads);
  }
  ~OmpThreadsScope() {
    if (omp_get_max_threads() != previous_) omp_set_num_threads(previous_);
  }
  OmpThreadsScope(const OmpThreadsScope&) = delete;
  OmpThreadsScope& operator=(const OmpThreadsScope&) = delete;

 private:
  int previous_;
};

memory::desc bias_desc(const GemmSpec& spec) {
  return {{1, spec.c.cols}, to_dnnl(spec.bias_dtype), memory::dims{spec.c.cols, 1}};
}

// The matmul for spec: user-managed scratchpad, a sum post-op when
// accumulating. Throws dnnl::error when oneDNN cannot create it.
dnnl::matmul::primitive_desc matmul_pd(const dnnl::engine& engine, const GemmSpec& spec) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (spec.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0F);
    attr.set_post_ops(ops);
  }
  const memory::desc a = describe(spec.a), b = describe(spec.b), c = describe(spec.c);
  if (spec.has_bias) return {dnnl::matmul::desc(a, b, bias_desc(spec), c), attr, engine};
  return {dnnl::matmul::desc(a, b, c), attr, engine};
}

class OneDnnGemm final : public GemmBackend {
 public:
  // Throws dnnl::error when oneDNN cannot create the matmul.
  OneDnnGemm(dnnl::engine engine, const GemmSpec& spec) : spec_(spec), engine_(std::move(engine)) {
    OmpThreadsScope scope(spec.threads);
    a_ = describe(spec.a);
    b_ = describe(spec.b);
    c_ = describe(spec.c);
    if (spec.has_bias) bias_ = bias_desc(spec);
    pd_ = matmul_pd(engine_, spec);
    scratch_ = pd_.scratchpad_desc();
    primitive_ = dnnl::matmul(pd_);
  }

  GemmBackendKind kind() const override { return GemmBackendKind::onednn; }
  const char* implementation() const override { return pd_.impl_info_str(); }
  // oneDNN's brgemm picks its K blocking from M.
  GemmTraits traits() const override { return {.m_independent = false}; }
  std::size_t scratchpad_bytes() const override { return scratch_.get_size(); }

  void run(const void* a, const void* b, void* c, const void* bias, void* scratch,
           const void* /*packed*/) const override {
    OmpThreadsScope scope(spec_.threads);
    // oneDNN takes non-const handles; it only reads inputs.
    memory ma(a_, engine_, const_cast<void*>(a));
    memory mb(b_, engine_, const_cast<void*>(b));
    memory mc(c_, engine_, c);
    memory ms(scratch_, engine_, scratch);
    dnnl::stream stream(engine_);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}};
    if (spec_.has_bias) args.emplace(DNNL_ARG_BIAS, memory(bias_, engine_, const_cast<void*>(bias)));
    primitive_.execute(stream, args);
    stream.wait();
  }

  std::unique_ptr<GemmCaller> make_caller() const override;

 private:
  friend class OneDnnCaller;
  GemmSpec spec_;
  dnnl::engine engine_;
  dnnl::matmul::primitive_desc pd_;
  dnnl::matmul primitive_;
  memory::desc a_, b_, c_, bias_, scratch_;
};

// One caller's stream and memory objects, whose data handles each run
// re-points: run() calls the C API with a stack array of arguments. What
// oneDNN allocates inside its own execute (the argument map it builds,
// gemm:jit's packing buffers) is its own, and the allocation test names it.
class OneDnnCaller final : public GemmCaller {
 public:
  explicit OneDnnCaller(const OneDnnGemm& g) : g_(g), stream_(g.engine_) {
    // Handles are placeholders until run() re-points them (DNNL_MEMORY_NONE
    // would be allocation-free too, but set_data_handle needs a live object).
    a_ = memory(g.a_, g.engine_, DNNL_MEMORY_NONE);
    b_ = memory(g.b_, g.engine_, DNNL_MEMORY_NONE);
    c_ = memory(g.c_, g.engine_, DNNL_MEMORY_NONE);
    scratch_ = memory(g.scratch_, g.engine_, DNNL_MEMORY_NONE);
    if (g.spec_.has_bias) bias_ = memory(g.bias_, g.engine_, DNNL_MEMORY_NONE);
  }

  void run(const void* a, const void* b, void* c, const void* bias, void* scratch,
           const void* /*packed*/) const override {
    OmpThreadsScope scope(g_.spec_.threads);
    // oneDNN takes non-const handles; it only reads inputs.
    const auto point = [](const memory& m, const void* p) {
      dnnl_memory_set_data_handle(m.get(), const_cast<void*>(p));
    };
    point(a_, a);
    point(b_, b);
    point(c_, c);
    point(scratch_, scratch);
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, a_.get()},
                               {DNNL_ARG_WEIGHTS, b_.get()},
                               {DNNL_ARG_DST, c_.get()},
                               {DNNL_ARG_SCRATCHPAD, scratch_.get()},
                               {DNNL_ARG_BIAS, nullptr}};
    int nargs = 4;
    if (g_.spec_.has_bias) {
      point(bias_, bias);
      args[nargs++].memory = bias_.get();
    }
    const dnnl_status_t status = dnnl_primitive_execute(g_.primitive_.get(), stream_.get(), nargs, args);
    if (status == dnnl_success) dnnl_stream_wait(stream_.get());
    if (status != dnnl_success) throw Error("gemm", "oneDNN matmul execution failed", ErrorKind::unsupported);
  }

 private:
  const OneDnnGemm& g_;
  dnnl::stream stream_;
  memory a_, b_, c_, bias_, scratch_;
};

std::unique_ptr<GemmCaller> OneDnnGemm::make_caller() const { return std::make_unique<OneDnnCaller>(*this); }

}  // namespace

GemmEngine::GemmEngine() : engine_(std::make_unique<dnnl::engine>(dnnl::engine::kind::cpu, 0)) {}
GemmEngine::~GemmEngine() = default;
const dnnl::engine& GemmEngine::get() const { return *engine_; }

std::unique_ptr<GemmBackend> detail::make_onednn_gemm(const GemmEngine& engine, const GemmSpec& spec,
                                                      std::string* why_not) {
  if (const char* refused = refusal(spec); refused != nullptr) {
    if (why_not != nullptr) *why_not = refused;
    return nullptr;
  }
  try {
    return std::make_unique<OneDnnGemm>(engine.get(), spec);
  } catch (const dnnl::error& e) {
    // E.g. bf16 on a CPU without AVX-512 (oneDNN 2.6 has no bf16 matmul there).
    if (why_not != nullptr) *why_not = std::string("oneDNN cannot create this matmul: ") + e.what();
    return nullptr;
  }
}

std::size_t detail::onednn_scratchpad_bytes(const GemmEngine& engine, const GemmSpec& spec) {
  // The primitive descriptor alone (no primitive, no JIT): what a planner
  // needs to size the workspace.
  if (const char* refused = refusal(spec); refused != nullptr) throw Error("gemm", refused, ErrorKind::unsupported);
  OmpThreadsScope scope(spec.threads);
  try {
    return matmul_pd(engine.get(), spec).scratchpad_desc().get_size();
  } catch (const dnnl::error& e) {
    throw Error("gemm", std::string("oneDNN cannot create this matmul: ") + e.what(), ErrorKind::unsupported);
  }
}

}  // namespace grpo::kernels
