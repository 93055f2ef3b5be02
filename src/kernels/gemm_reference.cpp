// The reference GEMM backend: plain loops, f32 products summed in f32 with k
// ascending, then bias, then the accumulated C; a bf16 C rounded to nearest
// even, an f16 C too, saturating at +-65504 (counted: take_f16_saturations).
// Serves every spec; slow (no blocking): the last entry of the backend list,
// and what the GEMM tester runs beside the fast backends.
#include <cstdint>

#include "kernels/bf16.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {
namespace {

float load(const void* p, DType dtype, std::int64_t at) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(p)[at];
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(p)[at]);
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(p)[at]);
  }
  return 0.0F;
}

std::uint16_t to_bf16(float v) { return float_to_bf16<Bf16Nan::canonical>(v); }

class ReferenceGemm final : public GemmBackend {
 public:
  explicit ReferenceGemm(const GemmSpec& spec) : spec_(spec) {}
  GemmBackendKind kind() const override { return GemmBackendKind::reference; }
  const char* implementation() const override { return "grpo:reference"; }
  GemmTraits traits() const override { return {.m_independent = true}; }
  std::size_t scratchpad_bytes() const override { return 0; }

  void run(const void* a, const void* b, void* c, const void* bias, void* /*scratch*/,
           const void* /*packed*/) const override {
    const GemmOperand& ao = spec_.a;
    const GemmOperand& bo = spec_.b;
    const GemmOperand& co = spec_.c;
    std::int64_t saturated = 0;  // f16 C entries written as +-65504
    for (std::int64_t i = 0; i < co.rows; ++i) {
      for (std::int64_t j = 0; j < co.cols; ++j) {
        float sum = 0.0F;
        for (std::int64_t k = 0; k < ao.cols; ++k) {
          sum += load(a, ao.dtype, i * ao.row_stride + k * ao.col_stride) *
                 load(b, bo.dtype, k * bo.row_stride + j * bo.col_stride);
        }
        if (spec_.has_bias) sum += load(bias, spec_.bias_dtype, j);
        const std::int64_t at = i * co.row_stride + j * co.col_stride;
        if (spec_.accumulate) sum += load(c, co.dtype, at);
        if (co.dtype == DType::f32) {
          static_cast<float*>(c)[at] = sum;
        } else if (co.dtype == DType::f16) {
          static_cast<std::uint16_t*>(c)[at] = float_to_f16_saturated(sum, &saturated);
        } else {
          static_cast<std::uint16_t*>(c)[at] = to_bf16(sum);
        }
      }
    }
    if (saturated != 0) detail::add_f16_saturations(saturated);
  }

 private:
  GemmSpec spec_;
};

}  // namespace

std::unique_ptr<GemmBackend> detail::make_reference_gemm(const GemmSpec& spec) {
  return std::make_unique<ReferenceGemm>(spec);
}

}  // namespace grpo::kernels
