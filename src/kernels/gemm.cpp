#include "kernels/gemm.hpp"

#include <omp.h>

#include <string>

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

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec) {
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
    throw Error("gemm", std::string("oneDNN cannot create this matmul: ") + e.what(), ErrorKind::unsupported);
  }
  impl->scratch = impl->pd.scratchpad_desc();
  impl->primitive = dnnl::matmul(impl->pd);
  impl_ = std::move(impl);
}

Gemm::~Gemm() = default;
Gemm::Gemm(Gemm&&) noexcept = default;
Gemm& Gemm::operator=(Gemm&&) noexcept = default;

const GemmSpec& Gemm::spec() const { return impl_->spec; }
std::size_t Gemm::scratchpad_bytes() const { return impl_->scratch.get_size(); }
const char* Gemm::implementation() const { return impl_->pd.impl_info_str(); }

void Gemm::run(const void* a, const void* b, void* c, const void* bias, void* scratchpad) const {
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

}  // namespace grpo::kernels
