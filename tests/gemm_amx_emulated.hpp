// The amx GEMM backend's code (gemm_amx_micro.hpp over gemm_blocked.hpp) on a
// scalar emulation of the AMX tile instructions (gemm_amx_emulated.cpp), so
// the GEMM tester holds it to the reference on CPUs without AMX.
#pragma once

#include <memory>

#include "kernels/gemm_backend.hpp"

namespace grpo::kernels::testing {

// Whether this CPU runs the emulated backend: the blocked GEMM around the
// tiles is AVX-512F/BW/DQ/VL code. (Inline: asked from code compiled for any
// x86-64, never from the AVX-512 translation unit.)
inline bool amx_emulation_runs() { return avx512_fma_usable(); }

// nullptr when the backend does not serve spec (as make_amx_gemm); call only
// where amx_emulation_runs(). Its implementation() is
// "grpo:amx_bf16 (emulated)" (or "(emulated, swapped)").
std::unique_ptr<GemmBackend> make_emulated_amx_gemm(const GemmSpec& spec);

}  // namespace grpo::kernels::testing
