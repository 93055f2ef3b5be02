// One of the unfused baselines' whole-batch GEMMs, multi-threaded as an
// eager framework's matmul is: oneDNN's matmul with its own OpenMP team of
// spec.threads; or, where oneDNN has none for the spec on this CPU (bf16
// without AVX-512), the default list's backend, which runs on the calling
// thread (GemmBackend::run), over runs of C's columns, one per thread, in
// the caller's arena. Each element of C is computed by one call whatever
// the split, so the bits do not depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/gemm.hpp"

namespace grpo::detail {

class BaselineGemm {
 public:
  BaselineGemm(const kernels::GemmEngine& engine, const kernels::GemmSpec& spec);
  // Exactly this backend, over runs of C's columns unless it is oneDNN
  // (the tests); throws grpo::Error (unsupported) where it cannot serve spec.
  BaselineGemm(const kernels::GemmEngine& engine, const kernels::GemmSpec& spec, kernels::GemmBackendKind backend);
  ~BaselineGemm();

  std::size_t scratchpad_bytes() const { return scratch_bytes_; }
  // As Gemm::run; scratch: scratchpad_bytes(), 64-byte aligned.
  void run(const void* a, const void* b, void* c, const void* bias, void* scratch) const;

 private:
  // spec over runs of C's columns, by `backend` or (null) the default list's.
  void split(const kernels::GemmEngine& engine, const kernels::GemmBackendKind* backend);

  struct Columns {  // one run of C's columns and its GEMM
    std::unique_ptr<kernels::Gemm> gemm;
    std::int64_t col0 = 0;
    std::size_t scratch_at = 0;
  };
  kernels::GemmSpec spec_;
  std::vector<Columns> runs_;
  std::size_t scratch_bytes_ = 0;
};

}  // namespace grpo::detail
