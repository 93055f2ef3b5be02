// Scale-out: the collectives a fused LM-head step needs when the vocabulary or
// the batch is spread over several processes, behind an interface the core
// library owns. The core never links MPI; grpo::mpi (grpo/mpi_communicator.hpp)
// implements this interface on an MPI communicator, and other engines
// (torch.distributed / gloo, a test harness) can implement it too.
//
//   // Every rank of MPI_COMM_WORLD holds a vocabulary shard of W and every hidden row:
//   grpo::MpiCommunicator world(MPI_COMM_WORLD);
//   grpo::LmHeadShape shape{.batch = B, .seq_len = T, .hidden = H,
//                           .vocab = shard_size, .dtype = grpo::DType::bf16,
//                           .vocab_offset = shard_begin, .global_vocab = V};
//   grpo::LmHeadOptions options;
//   options.scale_out.vocab_group = &world;
//   grpo::LmHeadLossPlan plan(shape, config, options);  // collective over the group
//   plan.execute(...);                                  // collective: logp, loss, metrics equal on every rank
//
// Two groups, each optional:
//   vocab_group  vocabulary parallelism (Megatron's vocab-parallel cross
//                entropy): rank q holds rows [vocab_offset, vocab_offset + vocab)
//                of W (and of the bias) and every row of hidden and of the
//                batch, identical on every rank. Shards tile [0, global_vocab)
//                in rank order. One allgather per token block carries every
//                tile's row statistics (max, sum of exp, entropy accumulator)
//                and the chosen logit; each rank merges them in global tile
//                order, so LSE, logp, entropy, the loss and its coefficients
//                are the same bits on every rank. dW / dbias stay per shard;
//                dhidden partials are summed over the group.
//   data_group   data parallelism: rank q holds its own sequences and all of
//                W. The step equals the single-process step over the batches
//                concatenated in rank order: normalizers (grpo's 1/B,
//                bnpo's valid-token count, dr_grpo's B) and metrics are
//                global; dW and dbias are summed over the group.
// Both: a grid, e.g. 8 vocab shards x 8 batch replicas; a rank's vocab group
// is the ranks with its batch, its data group the ranks with its shard.
//
// Determinism: the library sums every floating-point value in rank order
// (((x_0 + x_1) + x_2) ...) itself; a Communicator only moves bytes, so
// results are bitwise identical run to run for a given group size.
// Reductions of large arrays (dW, dhidden) go in segments of at most
// kReduceSegmentBytes: an alltoall hands each rank every rank's copy of its
// chunk, the rank sums them in rank order, an allgather returns the sums (the
// bytes a ring allreduce moves, 2 (P - 1) / P of the array per rank).
//
// Refusals: plan creation and execute() are collective. Each rank validates
// its own arguments, then the group exchanges one small status record; when
// any rank refused, every rank throws grpo::Error (argument() is that rank's
// argument, what() names the rank), so no rank is left waiting in a
// collective. Under data parallelism the one refusal met inside the schedule
// (a k3 KL beyond f32, see LossConfig::beta) is exchanged the same way at the
// end of the step, after this rank's own outputs were written.
//
// Ownership and threads: the plan borrows the communicators; they must
// outlive it. The library calls them only from the thread that called the
// plan's constructor or execute(), never from its worker tasks. A plan with a
// communicator runs one execute() at a time, entered by every rank of its
// groups in the same order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace grpo {

// Moves bytes between the ranks of a group; never adds anything (sums are the
// library's, in rank order). Every call is collective: each rank of the group
// makes it, in the same order, with the same `bytes`.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // in [0, size())
  virtual int size() const = 0;  // >= 1

  // send: `bytes` bytes of this rank. recv: size() * bytes; block q holds
  // rank q's bytes, the same on every rank. send may be recv + rank() * bytes
  // (in place); otherwise the two do not overlap.
  virtual void allgather(const void* send, void* recv, std::size_t bytes) const = 0;

  // send: size() blocks of `bytes`, block q for rank q. recv: size() blocks,
  // block q from rank q. send and recv do not overlap.
  virtual void alltoall(const void* send, void* recv, std::size_t bytes) const = 0;
};

// The reduction segment (see above): 8 MiB keeps the per-rank messages of a
// segment at 8 MiB / P (128 KiB at P = 64), far above the ~10 us a collective
// step costs on a 100 Gb/s link, and bounds the workspace the reduction needs
// (two segments).
inline constexpr std::size_t kReduceSegmentBytes = std::size_t{8} << 20;

// How a plan spreads over processes (LmHeadOptions::scale_out). Both groups
// null: this process alone.
struct ScaleOut {
  const Communicator* vocab_group = nullptr;  // ranks sharing this rank's batch, one vocab shard each
  const Communicator* data_group = nullptr;   // ranks sharing this rank's shard, one batch each
  // dapo / cispo / vespo: num_items_in_batch := the valid tokens of every
  // rank's batch (the data group's sum), computed by the library each step;
  // config.num_items_in_batch must then be 0. Without a data group: this
  // batch's valid tokens.
  bool global_num_items = false;
};

}  // namespace grpo
