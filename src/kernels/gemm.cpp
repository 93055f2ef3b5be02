#include "kernels/gemm.hpp"

#include <omp.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include <oneapi/dnnl/dnnl.hpp>

namespace grpo::kernels {
namespace {

using dnnl::memory;

memory::data_type to_dnnl(DType dtype) {
  return dtype == DType::f32 ? memory::data_type::f32 : memory::data_type::bf16;
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

}  // namespace

GemmEngine::GemmEngine() : engine_(std::make_unique<dnnl::engine>(dnnl::engine::kind::cpu, 0)) {}
GemmEngine::~GemmEngine() = default;
const dnnl::engine& GemmEngine::get() const { return *engine_; }

struct Gemm::Impl {
  GemmSpec spec;
  dnnl::engine engine;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  memory::desc a, b, c, bias, scratch;
};

const char* forced_gemm_backend() {
  const char* v = std::getenv("GRPO_GEMM");
  return v != nullptr && *v != '\0' ? v : nullptr;
}

namespace {

// Our backends in priority order, from the forced one down: null = oneDNN's turn.
std::unique_ptr<GemmBackend> pick_own_backend(const GemmSpec& spec) {
  const char* forced = forced_gemm_backend();
  const std::string_view f = forced != nullptr ? forced : "";
  if (f == "reference") return make_reference_gemm(spec);
  if (f == "avx512bf16") return make_avx512_bf16_gemm(spec);
  if (f == "avx512fma") return make_avx512_fma_gemm(spec);
  if (f == "avx2") return make_avx2_gemm(spec);
  if (f == "onednn") return nullptr;
  if (!f.empty() && f != "amx") {
    throw Error("GRPO_GEMM", "unknown GEMM backend '" + std::string(f) +
                                 "' (amx, avx512bf16, avx512fma, avx2, onednn or reference)");
  }
  std::unique_ptr<GemmBackend> own = make_amx_gemm(spec);
  if (own == nullptr && avx2_gemm_is_default()) own = make_avx2_gemm(spec);
  // On Intel CPUs with AVX-512, f32 FMAs on widened bf16 (gemm_dispatch.cpp's
  // avx512_fma_is_default): Xeon model 207 without AMX, one thread, the
  // step's three GEMMs at 151-165 GFLOP/s against vdpbf16ps's 92-100.
  if (own == nullptr && avx512_fma_is_default()) own = make_avx512_fma_gemm(spec);
  // bf16 A and B on an AVX512-BF16 CPU without AMX: faster than oneDNN 2.6
  // on a Zen 4 at the headline and at T=512 (gemm_avx512_bf16.cpp's header,
  // docs/benchmarks.md), and with bf16 gradients oneDNN's gemm:jit asked a
  // scratchpad the size of the dW tile in f32, which left the workspace
  // budget one tile slot: the step ran on one thread (9.17 s against 4.36 s).
  if (own == nullptr) own = make_avx512_bf16_gemm(spec);
  return own;
}

}  // namespace

GemmTraits gemm_traits(const GemmSpec& spec) {
  const std::unique_ptr<GemmBackend> own = pick_own_backend(spec);  // ours are cheap to build
  return own != nullptr ? own->traits() : GemmTraits{.m_independent = false};
}

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec)
    : Gemm(engine, spec, pick_own_backend(spec), /*reference_if_onednn_cannot=*/true) {}

namespace {

std::unique_ptr<GemmBackend> make_backend(GemmBackendKind backend, const GemmSpec& spec) {
  switch (backend) {
    case GemmBackendKind::amx: return make_amx_gemm(spec);
    case GemmBackendKind::avx512_bf16: return make_avx512_bf16_gemm(spec);
    case GemmBackendKind::avx512_fma: return make_avx512_fma_gemm(spec);
    case GemmBackendKind::avx2: return make_avx2_gemm(spec);
    case GemmBackendKind::reference: return make_reference_gemm(spec);
    case GemmBackendKind::onednn: return nullptr;
  }
  return nullptr;
}

}  // namespace

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec, GemmBackendKind backend)
    : Gemm(engine, spec, make_backend(backend, spec), /*reference_if_onednn_cannot=*/false) {
  if (backend != GemmBackendKind::onednn && own_ == nullptr) {
    const bool cpu = backend == GemmBackendKind::amx           ? amx_usable()
                     : backend == GemmBackendKind::avx512_bf16 ? avx512_bf16_usable()
                     : backend == GemmBackendKind::avx512_fma  ? avx512_fma_usable()
                                                               : avx2_gemm_usable();
    throw Error("gemm",
                std::string("the ") + to_string(backend) + " backend cannot serve this GEMM: " +
                    (cpu                               ? "it takes bf16 A and B with one contiguous dimension each"
                     : backend == GemmBackendKind::amx ? amx_unusable_reason()
                     : backend == GemmBackendKind::avx512_bf16 ? "the CPU has no AVX512-BF16"
                     : backend == GemmBackendKind::avx512_fma  ? "the CPU has no AVX-512F/BW/DQ/VL"
                                                               : "the CPU has no AVX2 and FMA"),
                ErrorKind::unsupported);
  }
}

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec, std::unique_ptr<GemmBackend> own,
           bool reference_if_onednn_cannot)
    : own_(std::move(own)), own_spec_(spec) {
  if (own_ != nullptr) return;
  OmpThreadsScope scope(spec.threads);
  auto impl = std::make_unique<Impl>();
  impl->spec = spec;
  impl->engine = engine.get();
  impl->a = describe(spec.a);
  impl->b = describe(spec.b);
  impl->c = describe(spec.c);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (spec.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0F);
    attr.set_post_ops(ops);
  }
  try {
    if (spec.has_bias) {
      impl->bias = memory::desc({1, spec.c.cols}, to_dnnl(spec.bias_dtype), memory::dims{spec.c.cols, 1});
      impl->pd =
          dnnl::matmul::primitive_desc(dnnl::matmul::desc(impl->a, impl->b, impl->bias, impl->c), attr, impl->engine);
    } else {
      impl->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(impl->a, impl->b, impl->c), attr, impl->engine);
    }
  } catch (const dnnl::error& e) {
    // E.g. bf16 on a CPU without AVX-512 (oneDNN 2.6 has no bf16 matmul
    // there): the default list goes on to the reference loops.
    if (reference_if_onednn_cannot) {
      own_ = make_reference_gemm(spec);
      return;
    }
    throw Error("gemm", std::string("oneDNN cannot create this matmul: ") + e.what(), ErrorKind::unsupported);
  }
  impl->scratch = impl->pd.scratchpad_desc();
  impl->primitive = dnnl::matmul(impl->pd);
  impl_ = std::move(impl);
}

Gemm::~Gemm() = default;
Gemm::Gemm(Gemm&&) noexcept = default;
Gemm& Gemm::operator=(Gemm&&) noexcept = default;

// Our backends keep their spec; oneDNN's Impl keeps it for oneDNN.
const GemmSpec& Gemm::spec() const { return impl_ != nullptr ? impl_->spec : own_spec_; }
const Gemm::Impl* Gemm::impl_for_binding() const { return impl_.get(); }
std::size_t Gemm::scratchpad_bytes() const {
  return own_ != nullptr ? own_->scratchpad_bytes() : impl_->scratch.get_size();
}
const char* Gemm::implementation() const {
  return own_ != nullptr ? own_->implementation() : impl_->pd.impl_info_str();
}
std::size_t Gemm::shared_packed_bytes() const { return own_ != nullptr ? own_->shared_packed_bytes() : 0; }
std::size_t Gemm::scratchpad_bytes_with_packed() const {
  return own_ != nullptr ? own_->scratchpad_bytes_with_packed() : scratchpad_bytes();
}
void Gemm::pack_shared(const void* operand, void* packed) const {
  if (own_ != nullptr) own_->pack_shared(operand, packed);
}
GemmBackendKind Gemm::backend() const { return own_ != nullptr ? own_->kind() : GemmBackendKind::onednn; }
GemmTraits Gemm::traits() const { return own_ != nullptr ? own_->traits() : GemmTraits{.m_independent = false}; }

void Gemm::run(const void* a, const void* b, void* c, const void* bias, void* scratchpad) const {
  if (own_ != nullptr) {
    own_->run(a, b, c, bias, scratchpad, nullptr);
    return;
  }
  OmpThreadsScope scope(impl_->spec.threads);
  const dnnl::engine& eng = impl_->engine;
  // oneDNN takes non-const handles; it only reads inputs.
  memory ma(impl_->a, eng, const_cast<void*>(a));
  memory mb(impl_->b, eng, const_cast<void*>(b));
  memory mc(impl_->c, eng, c);
  memory ms(impl_->scratch, eng, scratchpad);
  dnnl::stream stream(eng);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}};
  if (impl_->spec.has_bias) args.emplace(DNNL_ARG_BIAS, memory(impl_->bias, eng, const_cast<void*>(bias)));
  impl_->primitive.execute(stream, args);
  stream.wait();
}

struct GemmBinding::Impl {
  const GemmBackend* own = nullptr;  // our backends need no per-caller objects
  const Gemm::Impl* gemm = nullptr;
  dnnl::stream stream;
  memory a, b, c, bias, scratch;
};

GemmBinding::GemmBinding(const Gemm& gemm) : impl_(std::make_unique<Impl>()) {
  impl_->own = gemm.own_backend();
  if (impl_->own != nullptr) return;
  const Gemm::Impl& g = *gemm.impl_for_binding();
  impl_->gemm = &g;
  impl_->stream = dnnl::stream(g.engine);
  // Handles are placeholders until run() re-points them (DNNL_MEMORY_NONE
  // would be allocation-free too, but set_data_handle needs a live object).
  impl_->a = memory(g.a, g.engine, DNNL_MEMORY_NONE);
  impl_->b = memory(g.b, g.engine, DNNL_MEMORY_NONE);
  impl_->c = memory(g.c, g.engine, DNNL_MEMORY_NONE);
  impl_->scratch = memory(g.scratch, g.engine, DNNL_MEMORY_NONE);
  if (g.spec.has_bias) impl_->bias = memory(g.bias, g.engine, DNNL_MEMORY_NONE);
}

GemmBinding::~GemmBinding() = default;
GemmBinding::GemmBinding(GemmBinding&&) noexcept = default;
GemmBinding& GemmBinding::operator=(GemmBinding&&) noexcept = default;

void GemmBinding::run(const void* a, const void* b, void* c, const void* bias, void* scratchpad,
                      const void* packed) const {
  if (impl_->own != nullptr) {
    impl_->own->run(a, b, c, bias, scratchpad, packed);
    return;
  }
  const Gemm::Impl& g = *impl_->gemm;
  OmpThreadsScope scope(g.spec.threads);
  // oneDNN takes non-const handles; it only reads inputs.
  const auto point = [](const memory& m, const void* p) { dnnl_memory_set_data_handle(m.get(), const_cast<void*>(p)); };
  point(impl_->a, a);
  point(impl_->b, b);
  point(impl_->c, c);
  point(impl_->scratch, scratchpad);
  dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, impl_->a.get()},
                             {DNNL_ARG_WEIGHTS, impl_->b.get()},
                             {DNNL_ARG_DST, impl_->c.get()},
                             {DNNL_ARG_SCRATCHPAD, impl_->scratch.get()},
                             {DNNL_ARG_BIAS, nullptr}};
  int nargs = 4;
  if (g.spec.has_bias) {
    point(impl_->bias, bias);
    args[nargs++].memory = impl_->bias.get();
  }
  const dnnl_status_t status = dnnl_primitive_execute(g.primitive.get(), impl_->stream.get(), nargs, args);
  if (status == dnnl_success) dnnl_stream_wait(impl_->stream.get());
  if (status != dnnl_success) throw Error("gemm", "oneDNN matmul execution failed", ErrorKind::unsupported);
}

}  // namespace grpo::kernels
