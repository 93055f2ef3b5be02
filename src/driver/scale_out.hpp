// The fused LM head over several processes (grpo/communicator.hpp): what a
// plan knows about its groups (the vocabulary shards, the workspace the
// exchanges need), the collective agreement that makes every refusal every
// rank's, and the three exchanges of a step:
//   vocab group  per token block, every tile's row statistics and the chosen
//                logit (gather_row_stats); per block, the dhidden partials
//                summed (sum_in_rank_order).
//   data group   per step, the global batch and valid-token counts
//                (agree_on_call), then the metric sums and dW / dbias summed
//                (finish_data_parallel).
// Every floating-point sum runs here, in rank order; the communicators only
// move bytes.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "driver/workspace_registry.hpp"
#include "grpo/communicator.hpp"
#include "grpo/lm_head_loss.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

struct LmHeadPlanData;

// A communicator and this rank's place in it; empty when the group is absent.
struct Group {
  const Communicator* comm = nullptr;
  int rank = 0;
  int size = 1;
  const char* name = "";  // "vocab" / "data", for messages

  explicit operator bool() const { return comm != nullptr; }
};

// The per-step counts of a data-parallel batch (agree_on_call).
struct GlobalCounts {
  std::int64_t batch = 0;      // sequences over the data group
  std::int64_t num_valid = 0;  // valid tokens over the data group
};

// A refusal (or none), as the ranks of a group exchange it: fixed size, so a
// record travels as plain bytes.
struct Status {
  std::int32_t failed = 0;
  std::int32_t kind = 0;          // ErrorKind
  std::int32_t origin_rank = -1;  // the refusing rank within origin_group; -1 = not named yet
  char origin_group[8] = {};
  char argument[64] = {};
  char message[400] = {};
};

// This rank's outcome: a grpo::Error (its argument, kind and message), an
// allocation failure, or none (error null).
Status status_of(const std::exception_ptr& error);
// A refusal every rank of a group finds alike (comparing the records it
// gathered), charged to rank `rank` of the group.
Status refusal(const Group& group, int rank, const char* argument, const std::string& message);
// Throws this rank's own refusal if it has one, else the group's.
[[noreturn]] void throw_agreed(const Status& status, const std::exception_ptr& own);

template <class Facts>
struct Record {
  Status status;
  Facts facts;
};

// Every rank's record, in rank order, into all[0, group.size). A rank without
// a refusal of its own adopts the first one in rank order, so after the
// exchange every rank of the group holds the same status; exchanged again
// over a second group, it reaches every rank of a grid.
template <class Facts>
void gather(const Group& group, Status& status, const Facts& facts, Record<Facts>* all) {
  const Record<Facts> mine{status, facts};
  group.comm->allgather(&mine, all, sizeof(mine));
  if (status.failed != 0) return;
  for (int q = 0; q < group.size; ++q) {
    if (all[q].status.failed == 0) continue;
    status = all[q].status;
    if (status.origin_rank < 0) {
      status.origin_rank = q;
      std::strncpy(status.origin_group, group.name, sizeof(status.origin_group) - 1);
    }
    return;
  }
}

// This rank's place in a communicator; throws Error(argument) when rank() or
// size() is out of range.
Group make_group(const Communicator* comm, const char* name, const char* argument);

// The scale-out exchanges' views of the step's workspace (Region::exchange,
// booked in pieces by ScaleOutPlan::workspace_pieces, in this order); empty
// without a plan over several processes.
struct ExchangeRegions {
  static constexpr std::size_t kReduceSend = 0, kReduceRecv = 1, kRecordsSend = 2, kRecordsRecv = 3, kMerged = 4,
                               kPieces = 5;
  ExchangeRegions(std::byte* ws, const WorkspaceLayout& l)
      : reduce_send(l.piece<float>(ws, Region::exchange, kReduceSend)),
        reduce_recv(l.piece<float>(ws, Region::exchange, kReduceRecv)),
        records_send(l.piece<std::byte>(ws, Region::exchange, kRecordsSend)),
        records_recv(l.piece<std::byte>(ws, Region::exchange, kRecordsRecv)),
        merged(l.piece<kernels::RowStats>(ws, Region::exchange, kMerged)) {}
  std::span<float> reduce_send, reduce_recv;        // the two reduction segments
  std::span<std::byte> records_send, records_recv;  // per block row one outgoing, size() incoming records
  std::span<kernels::RowStats> merged;              // per block row the merged [global_tiles] statistics
};

struct ScaleOutPlan {
  Group vocab;
  Group data;
  bool global_num_items = false;
  // Vocabulary shards of the vocab group, in rank order: shard q is tokens
  // [shard_begin[q], shard_begin[q + 1]), cut into shard_tiles[q] tiles.
  std::vector<std::int64_t> shard_begin;
  std::vector<std::int64_t> shard_tiles;
  std::int64_t tiles_max = 0;     // the most tiles of any shard: the exchange's record size
  std::int64_t global_tiles = 0;  // sum of shard_tiles
  // Floats in each of the two reduction buffers (0: the plan reduces nothing):
  // P * ceil(n / P) for the largest segment n of any reduction it runs.
  std::int64_t reduce_floats = 0;
  // The agreement records of execute(), allocated once, at plan creation:
  // they must exist before the call's workspace does (a rank whose
  // allocation failed still takes part), so they cannot live in it. Scratch
  // under its mutex, no state of a call: concurrent execute() calls stay safe.
  mutable std::vector<std::byte> exchange;
  mutable std::mutex exchange_mutex;

  // Its pieces of the step's workspace (Region::exchange), in
  // ExchangeRegions' order.
  std::array<WorkspacePiece, ExchangeRegions::kPieces> workspace_pieces() const;
  std::size_t record_bytes() const;  // per row: tiles_max RowStats + the chosen logit

  // Vocabulary parallelism, the forward of `rows` block rows: every rank's
  // tile statistics of these rows (local_tiles each in tile_stats, row-major)
  // gathered in one collective and laid out [row][global tile], tiles in
  // rank order then tile order, which is token order. target[r] becomes the
  // chosen logit as the shard holding id_of(r) computed it (id_of(r) < 0: the
  // row is masked, target untouched). Returns the merged array.
  template <class IdOf>
  const kernels::RowStats* gather_row_stats(const ExchangeRegions& x, std::int64_t rows, std::int64_t local_tiles,
                                            const kernels::RowStats* tile_stats, float* target, IdOf&& id_of) const {
    const std::byte* recv = exchange_row_stats(x, rows, local_tiles, tile_stats, target);
    kernels::RowStats* merged = x.merged.data();
    const std::size_t record = record_bytes();
    const std::size_t block = static_cast<std::size_t>(rows) * record;
    for (std::int64_t r = 0; r < rows; ++r) {
      kernels::RowStats* out = merged + r * global_tiles;
      for (int q = 0; q < vocab.size; ++q) {
        const std::byte* rec = recv + static_cast<std::size_t>(q) * block + static_cast<std::size_t>(r) * record;
        std::memcpy(out, rec, static_cast<std::size_t>(shard_tiles[q]) * sizeof(kernels::RowStats));
        out += shard_tiles[q];
      }
      const std::int64_t id = id_of(r);
      if (id >= 0) {
        const int q = owner_of(id);
        std::memcpy(&target[r],
                    recv + static_cast<std::size_t>(q) * block + static_cast<std::size_t>(r) * record +
                        static_cast<std::size_t>(tiles_max) * sizeof(kernels::RowStats),
                    sizeof(float));
      }
    }
    return merged;
  }

  // For LmHeadLossPlan::describe(): " vocab group 1/4 shard [256, 512) of 1000; data group 0/2".
  std::string describe() const;

  // The rank of the vocab group whose shard holds token id.
  int owner_of(std::int64_t id) const {
    return static_cast<int>(std::upper_bound(shard_begin.begin(), shard_begin.end(), id) - shard_begin.begin()) - 1;
  }

  // Sums count floats over `group` in rank order, in place: afterwards every
  // rank holds the same bits. threads: for the local additions.
  void sum_in_rank_order(const Group& group, float* values, std::int64_t count, const ExchangeRegions& x,
                         int threads) const;
  // The same for a matrix view (f32 or bf16: summed in f32, rounded once).
  // Returns the f16 entries that saturated (kernels/f16.hpp) when m is f16.
  std::int64_t sum_in_rank_order(const Group& group, const MutMatrixView& m, const ExchangeRegions& x,
                                 int threads) const;

 private:
  const std::byte* exchange_row_stats(const ExchangeRegions& x, std::int64_t rows, std::int64_t local_tiles,
                                      const kernels::RowStats* tile_stats, const float* target) const;
};

// Data parallelism, at the end of a step: exchanges the outcome (a refusal
// met inside the schedule on any rank is every rank's), then the metric sums
// (added in rank order) and dW / dbias (summed over the data group; outputs
// without them: nothing summed). acc: null for the generic log-prob head (no
// metrics). error: this rank's refusal, or null. Returns the f16 dW entries
// the sum saturated (kernels/f16.hpp; 0 unless dW is f16).
class LossAccumulator;
std::int64_t finish_data_parallel(const LmHeadPlanData& plan, const LmHeadOutputs& outputs, const LossAccumulator* acc,
                                  std::byte* workspace, const std::exception_ptr& error);

}  // namespace grpo::detail
