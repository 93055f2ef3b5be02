// Software prefetches the optimizer keeps. GCC 12 counts _mm_prefetch
// (__builtin_prefetch) as free of side effects, so a function that does
// nothing else is found pure and its calls are deleted: the blocked GEMM's
// look-ahead prefetch_x (217756b, since removed) and the AVX2 GEMM's
// prefetch_block were dead code so. An asm statement is never deleted.
#pragma once

namespace grpo::kernels {

// The cache line holding p into L1 (and L2).
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
// The cache line holding p into L2.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

}  // namespace grpo::kernels
