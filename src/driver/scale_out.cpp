// The exchanges of a fused LM-head step over several processes, and the
// agreement records they share with plan creation (api/scale_out_plan.cpp).
// See scale_out.hpp; the user's view is grpo/communicator.hpp.
#include "driver/scale_out.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <string>

#include "driver/lm_head_plan.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"

namespace grpo::detail {
namespace {

constexpr std::int64_t kSegmentFloats = static_cast<std::int64_t>(kReduceSegmentBytes / sizeof(float));
// The local additions of a reduction run in tasks of this many floats (64 KiB
// of each rank's copy): enough to amortize a task, small enough to spread a
// 8 MiB segment over the threads.
constexpr std::int64_t kSumTask = 16384;

void copy_text(char* dst, std::size_t size, const std::string& text) {
  const std::size_t n = std::min(size - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

// An Error's message without the "grpo: <kind> '<argument>': " that what() adds.
std::string message_of(const Error& e) {
  const std::string prefix = std::string("grpo: ") + to_string(e.kind()) + " '" + e.argument() + "': ";
  const std::string what = e.what();
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

// Segments of `count` floats summed over `group` in rank order: pack(at, n,
// dst) copies values [at, at + n) to dst as f32, unpack(at, n, src) stores
// the sums back. Per segment of n floats and chunk = ceil(n / P): an alltoall
// gives this rank every rank's copy of chunk `rank`, the rank adds them in
// rank order, and an allgather hands every rank every chunk's sum. direct:
// the values themselves when they are contiguous f32 (else null); segments
// whose length P divides then go from and to them with no copy (the sum
// overwrites this rank's chunk once the alltoall has sent it).
template <class Pack, class Unpack>
void reduce_segments(const Group& group, std::int64_t count, float* direct, float* send, float* recv, int threads,
                     Pack&& pack, Unpack&& unpack) {
  const int ranks = group.size;
  const std::int64_t segment = kSegmentFloats / ranks * ranks;
  for (std::int64_t at = 0; at < count; at += segment) {
    const std::int64_t n = std::min(segment, count - at);
    const std::int64_t chunk = (n + ranks - 1) / ranks;
    const bool in_place = direct != nullptr && n % ranks == 0;
    float* buffer = in_place ? direct + at : send;
    if (!in_place) {
      pack(at, n, send);
      std::fill(send + n, send + chunk * ranks, 0.0F);  // the last chunk's tail: zeros add nothing
    }
    const auto bytes = static_cast<std::size_t>(chunk) * sizeof(float);
    group.comm->alltoall(buffer, recv, bytes);
    float* mine = buffer + group.rank * chunk;
    for_each_item((chunk + kSumTask - 1) / kSumTask, threads, [&](std::int64_t task, int) {
      const std::int64_t end = std::min(chunk, (task + 1) * kSumTask);
      for (std::int64_t i = task * kSumTask; i < end; ++i) {
        float sum = recv[i];
        for (int q = 1; q < ranks; ++q) sum += recv[q * chunk + i];
        mine[i] = sum;
      }
    });
    group.comm->allgather(mine, buffer, bytes);
    if (!in_place) unpack(at, n, send);
  }
}

}  // namespace

Status status_of(const std::exception_ptr& error) {
  Status s;
  if (!error) return s;
  s.failed = 1;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    s.kind = static_cast<std::int32_t>(e.kind());
    copy_text(s.argument, sizeof(s.argument), e.argument());
    copy_text(s.message, sizeof(s.message), message_of(e));
  } catch (const std::bad_alloc&) {
    s.kind = static_cast<std::int32_t>(ErrorKind::out_of_memory);
    copy_text(s.argument, sizeof(s.argument), "workspace");
    copy_text(s.message, sizeof(s.message), "an allocation failed");
  } catch (const std::exception& e) {
    s.kind = static_cast<std::int32_t>(ErrorKind::unsupported);
    copy_text(s.argument, sizeof(s.argument), "execute");
    copy_text(s.message, sizeof(s.message), e.what());
  } catch (...) {
    s.kind = static_cast<std::int32_t>(ErrorKind::unsupported);
    copy_text(s.argument, sizeof(s.argument), "execute");
    copy_text(s.message, sizeof(s.message), "an unknown exception");
  }
  return s;
}

Status refusal(const Group& group, int rank, const char* argument, const std::string& message) {
  Status s;
  s.failed = 1;
  s.kind = static_cast<std::int32_t>(ErrorKind::invalid_argument);
  s.origin_rank = rank;
  copy_text(s.origin_group, sizeof(s.origin_group), group.name);
  copy_text(s.argument, sizeof(s.argument), argument);
  copy_text(s.message, sizeof(s.message), message);
  return s;
}

void throw_agreed(const Status& s, const std::exception_ptr& own) {
  if (own) std::rethrow_exception(own);
  throw Error(s.argument,
              "rank " + std::to_string(s.origin_rank) + " of the " + s.origin_group + " group refused: " + s.message,
              static_cast<ErrorKind>(s.kind));
}

Group make_group(const Communicator* comm, const char* name, const char* argument) {
  Group g;
  g.name = name;
  if (comm == nullptr) return g;
  g.comm = comm;
  g.size = comm->size();
  g.rank = comm->rank();
  if (g.size < 1 || g.rank < 0 || g.rank >= g.size) {
    throw Error(argument, "rank() " + std::to_string(g.rank) + " / size() " + std::to_string(g.size) +
                              ": size must be >= 1 and rank within [0, size)");
  }
  return g;
}

std::string ScaleOutPlan::describe() const {
  std::string s;
  if (vocab) {
    s += " vocab_group=" + std::to_string(vocab.rank) + "/" + std::to_string(vocab.size) + " shard=[";
    s += std::to_string(shard_begin[vocab.rank]) + ", " + std::to_string(shard_begin[vocab.rank + 1]);
    s += ") of " + std::to_string(shard_begin.back()) + " (" + std::to_string(global_tiles) + " tiles merged)";
  }
  if (data) s += " data_group=" + std::to_string(data.rank) + "/" + std::to_string(data.size);
  if (global_num_items) s += " num_items=global";
  return s;
}

std::size_t ScaleOutPlan::record_bytes() const {
  return static_cast<std::size_t>(tiles_max) * sizeof(kernels::RowStats) + sizeof(float);
}

std::array<WorkspacePiece, ExchangeRegions::kPieces> ScaleOutPlan::workspace_pieces() const {
  const std::size_t reduce = static_cast<std::size_t>(reduce_floats) * sizeof(float);
  const std::size_t record = vocab ? record_bytes() : 0;
  const std::size_t ranks = vocab ? static_cast<std::size_t>(vocab.size) : 0;
  const std::size_t merged = vocab ? static_cast<std::size_t>(global_tiles) * sizeof(kernels::RowStats) : 0;
  return {{{0, reduce}, {0, reduce}, {record, 0}, {record * ranks, 0}, {merged, 0}}};
}

const std::byte* ScaleOutPlan::exchange_row_stats(const ExchangeRegions& x, std::int64_t rows, std::int64_t local_tiles,
                                                  const kernels::RowStats* tile_stats, const float* target) const {
  const std::size_t record = record_bytes();
  std::byte* send = x.records_send.data();
  std::byte* recv = x.records_recv.data();
  const kernels::RowStats none;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::byte* rec = send + static_cast<std::size_t>(r) * record;
    std::memcpy(rec, tile_stats + r * local_tiles, static_cast<std::size_t>(local_tiles) * sizeof(kernels::RowStats));
    for (std::int64_t j = local_tiles; j < tiles_max; ++j) {
      std::memcpy(rec + static_cast<std::size_t>(j) * sizeof(kernels::RowStats), &none, sizeof(none));
    }
    // The chosen logit, read by every rank from the shard that holds the id
    // (only meaningful there; the others' copies are never read).
    std::memcpy(rec + static_cast<std::size_t>(tiles_max) * sizeof(kernels::RowStats), &target[r], sizeof(float));
  }
  vocab.comm->allgather(send, recv, static_cast<std::size_t>(rows) * record);
  return recv;
}

void ScaleOutPlan::sum_in_rank_order(const Group& group, float* values, std::int64_t count, const ExchangeRegions& x,
                                     int threads) const {
  if (group.size == 1 || count == 0) return;
  float* send = x.reduce_send.data();
  float* recv = x.reduce_recv.data();
  const auto bytes = [](std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); };
  reduce_segments(
      group, count, values, send, recv, threads,
      [&](std::int64_t at, std::int64_t n, float* dst) { std::memcpy(dst, values + at, bytes(n)); },
      [&](std::int64_t at, std::int64_t n, const float* src) { std::memcpy(values + at, src, bytes(n)); });
}

std::int64_t ScaleOutPlan::sum_in_rank_order(const Group& group, const MutMatrixView& m, const ExchangeRegions& x,
                                             int threads) const {
  if (group.size == 1 || m.rows == 0 || m.cols == 0) return 0;
  std::atomic<std::int64_t> saturated{0};
  float* send = x.reduce_send.data();
  float* recv = x.reduce_recv.data();
  const kernels::StageKernels& k = kernels::kernels();
  const std::size_t elem = size_of(m.dtype);
  // Element e of the flattened [rows, cols] view, then runs within one row.
  const auto address = [&](std::int64_t e) {
    return static_cast<std::byte*>(m.data) + static_cast<std::size_t>((e / m.cols) * m.ld + e % m.cols) * elem;
  };
  const auto for_runs = [&](std::int64_t at, std::int64_t n, auto&& f) {
    for (std::int64_t e = at; e < at + n;) {
      const std::int64_t run = std::min(at + n - e, m.cols - e % m.cols);
      f(address(e), e - at, run);
      e += run;
    }
  };
  float* direct = m.dtype == DType::f32 && m.ld == m.cols ? static_cast<float*>(m.data) : nullptr;
  reduce_segments(
      group, m.rows * m.cols, direct, send, recv, threads,
      [&](std::int64_t at, std::int64_t n, float* dst) {
        for_runs(at, n, [&](std::byte* src, std::int64_t off, std::int64_t run) {
          load_as_f32(k, src, m.dtype, dst + off, run);
        });
      },
      [&](std::int64_t at, std::int64_t n, const float* src) {
        for_runs(at, n, [&](std::byte* dst, std::int64_t off, std::int64_t run) {
          saturated += store_f32_as(k, src + off, dst, m.dtype, run);
        });
      });
  return saturated.load();
}

std::int64_t finish_data_parallel(const LmHeadPlanData& plan, const LmHeadOutputs& outputs, const LossAccumulator* acc,
                                  std::byte* workspace, const std::exception_ptr& error) {
  const ScaleOutPlan& so = *plan.scale_out;
  Status status = status_of(error);
  LossAccumulator::Sums total;
  {
    const std::lock_guard<std::mutex> lock(so.exchange_mutex);
    using SumsRecord = Record<LossAccumulator::Sums>;
    auto* all = reinterpret_cast<SumsRecord*>(so.exchange.data());
    gather(so.data, status, acc != nullptr ? acc->sums() : LossAccumulator::Sums{}, all);
    if (status.failed != 0) throw_agreed(status, error);
    total = all[0].facts;
    for (int q = 1; q < so.data.size; ++q) {  // rank order
      const LossAccumulator::Sums& s = all[q].facts;
      total.loss += s.loss;
      total.clip_low += s.clip_low;
      total.clip_high += s.clip_high;
      total.clip_region += s.clip_region;
      total.kl += s.kl;
      total.entropy += s.entropy;
    }
  }
  if (outputs.metrics != nullptr && acc != nullptr) *outputs.metrics = acc->metrics(total);
  if (plan.options.forward_only || plan.options.frozen_weight) return 0;  // no dW, no dbias
  const ExchangeRegions x(workspace, plan.layout);
  const std::int64_t saturated = so.sum_in_rank_order(so.data, outputs.dweight, x, plan.schedule.slots);
  if (!outputs.dbias.empty()) {
    so.sum_in_rank_order(so.data, outputs.dbias.data(), static_cast<std::int64_t>(outputs.dbias.size()), x,
                         plan.schedule.slots);
  }
  return saturated;
}

}  // namespace grpo::detail
