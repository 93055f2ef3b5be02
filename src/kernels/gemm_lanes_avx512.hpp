// Lane helpers of the blocked GEMM's AVX-512 code (gemm_pack_avx512.hpp,
// gemm_epilogue_avx512.hpp). Only for translation units compiled with
// AVX-512F/BW/DQ/VL; in an unnamed namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace grpo::kernels::blocked {
namespace {

__mmask32 mask32(std::int64_t n) { return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1; }
__mmask16 mask16(std::int64_t n) { return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1U << n) - 1); }

// Row/column index vectors for 16 x 16 32-bit transposes through gathers
// (the blocks are in L1; a gather of 16 is cheap next to the 128 tdpbf16ps a
// K = 4096 accumulator tile takes).
__m512i column_offsets(std::int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}

}  // namespace
}  // namespace grpo::kernels::blocked
