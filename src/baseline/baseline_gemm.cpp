#include "baseline/baseline_gemm.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include <algorithm>

#include "grpo/types.hpp"

namespace grpo::detail {

namespace {

using kernels::Gemm;
using kernels::GemmSpec;

// Columns of a run: whole 32-column blocks (the blocked GEMM's), so only
// the last run has a ragged edge.
constexpr std::int64_t kColumnQuantum = 32;

std::size_t align64(std::size_t v) { return (v + 63) / 64 * 64; }

// Element `elems` of an operand of dtype.
const std::byte* at(const void* p, std::int64_t elems, DType dtype) {
  return static_cast<const std::byte*>(p) + static_cast<std::size_t>(elems) * size_of(dtype);
}
std::byte* at(void* p, std::int64_t elems, DType dtype) {
  return static_cast<std::byte*>(p) + static_cast<std::size_t>(elems) * size_of(dtype);
}

}  // namespace

BaselineGemm::BaselineGemm(const kernels::GemmEngine& engine, const GemmSpec& spec) : spec_(spec) {
  try {
    runs_.push_back({std::make_unique<Gemm>(engine, spec, kernels::GemmBackendKind::onednn), 0, 0});
    scratch_bytes_ = runs_.back().gemm->scratchpad_bytes();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::unsupported) throw;
    split(engine, nullptr);
  }
}

BaselineGemm::BaselineGemm(const kernels::GemmEngine& engine, const GemmSpec& spec, kernels::GemmBackendKind backend)
    : spec_(spec) {
  if (backend == kernels::GemmBackendKind::onednn) {
    runs_.push_back({std::make_unique<Gemm>(engine, spec, backend), 0, 0});
    scratch_bytes_ = runs_.back().gemm->scratchpad_bytes();
  } else {
    split(engine, &backend);
  }
}

void BaselineGemm::split(const kernels::GemmEngine& engine, const kernels::GemmBackendKind* backend) {
  const std::int64_t n = spec_.b.cols;
  const std::int64_t blocks = (n + kColumnQuantum - 1) / kColumnQuantum;
  const std::int64_t threads = std::clamp<std::int64_t>(spec_.threads, 1, blocks);
  const std::int64_t per_run = (blocks + threads - 1) / threads * kColumnQuantum;
  for (std::int64_t col0 = 0; col0 < n; col0 += per_run) {
    GemmSpec part = spec_;
    part.threads = 1;
    part.b.cols = std::min(per_run, n - col0);
    part.c.cols = part.b.cols;
    auto gemm =
        backend != nullptr ? std::make_unique<Gemm>(engine, part, *backend) : std::make_unique<Gemm>(engine, part);
    const std::size_t bytes = align64(gemm->scratchpad_bytes());
    runs_.push_back({std::move(gemm), col0, scratch_bytes_});
    scratch_bytes_ += bytes;
  }
}

BaselineGemm::~BaselineGemm() = default;

void BaselineGemm::run(const void* a, const void* b, void* c, const void* bias, void* scratch) const {
  const auto one = [&](const Columns& r) {
    const std::int64_t j = r.col0;
    void* s = scratch == nullptr ? nullptr : static_cast<std::byte*>(scratch) + r.scratch_at;
    r.gemm->run(a, at(b, j * spec_.b.col_stride, spec_.b.dtype), at(c, j * spec_.c.col_stride, spec_.c.dtype),
                spec_.has_bias ? at(bias, j, spec_.bias_dtype) : nullptr, s);
  };
  if (runs_.size() == 1) {
    one(runs_.front());
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<std::size_t>(0, runs_.size(), 1),
      [&](const tbb::blocked_range<std::size_t>& range) {
        for (std::size_t i = range.begin(); i < range.end(); ++i) one(runs_[i]);
      },
      tbb::static_partitioner());
}

}  // namespace grpo::detail
