#include "gemm_pack_hooks.hpp"

#include "kernels/gemm_pack_avx512.hpp"

namespace grpo::kernels::testing {
namespace {

using blocked::Bf16;
using blocked::F32;
using blocked::kKStep;
using blocked::kPanel;
using blocked::round_up;
using blocked::View;

template <class XLayout>
void pack_x_as(const void* x, View v, std::int64_t rows, std::int64_t kb, std::uint16_t* out) {
  const blocked::Avx512Packer<XLayout, blocked::YVnni<Bf16>> packer(v, View{1, 1});
  packer.pack_x(x, 0, rows, 0, kb, round_up(kb, kKStep), out);
}

template <class YLayout>
void pack_y_as(const void* y, View v, std::int64_t kb, std::int64_t nb, std::uint16_t* out) {
  const blocked::Avx512Packer<blocked::XTiles, YLayout> packer(View{1, 1}, v);
  packer.pack_y(y, 0, kb, round_up(kb, kKStep), 0, nb, round_up(nb, kPanel), out);
}

}  // namespace

void pack_x_panel(PackedX layout, const void* x, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t rows,
                  std::int64_t kb, std::uint16_t* out) {
  const View v{rs, cs, dtype};
  switch (layout) {
    case PackedX::tiles: pack_x_as<blocked::XTiles>(x, v, rows, kb, out); return;
    case PackedX::groups_bf16: pack_x_as<blocked::XRowGroups<8, Bf16, true>>(x, v, rows, kb, out); return;
    case PackedX::groups_f32: pack_x_as<blocked::XRowGroups<8, F32, false>>(x, v, rows, kb, out); return;
  }
}

void pack_y_block(PackedY layout, const void* y, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t kb,
                  std::int64_t nb, std::uint16_t* out) {
  const View v{rs, cs, dtype};
  if (layout == PackedY::vnni_bf16) {
    pack_y_as<blocked::YVnni<Bf16>>(y, v, kb, nb, out);
  } else {
    pack_y_as<blocked::YVnni<F32>>(y, v, kb, nb, out);
  }
}

}  // namespace grpo::kernels::testing
