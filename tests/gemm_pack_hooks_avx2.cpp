#include "gemm_pack_hooks.hpp"
#include "kernels/gemm_avx2_micro.hpp"

namespace grpo::kernels::testing {
namespace {

using Micro = blocked::Avx2Micro;
using blocked::kKStep;
using blocked::kPanel;
using blocked::round_up;
using blocked::View;

}  // namespace

void pack_x_panel_avx2(const void* x, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t rows, std::int64_t kb,
                       float* out) {
  const Micro::Packer packer(View{rs, cs, dtype}, View{1, 1});
  packer.pack_x(x, 0, rows, 0, kb, round_up(kb, kKStep), reinterpret_cast<std::uint16_t*>(out));
}

void pack_y_block_avx2(const void* y, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t kb, std::int64_t nb,
                       float* out) {
  const Micro::Packer packer(View{1, 1}, View{rs, cs, dtype});
  packer.pack_y(y, 0, kb, round_up(kb, kKStep), 0, nb, round_up(nb, kPanel), reinterpret_cast<std::uint16_t*>(out));
}

}  // namespace grpo::kernels::testing
