// Fixtures of the scale-out tests (run under mpirun, label mpi): how a
// global problem is cut into vocabulary shards and batch partitions, the
// distributed run of one rank's part, and the gathering of every rank's part
// into global outputs for the single-process and oracle comparisons. Test
// code may call MPI directly; the library never does outside grpo::mpi.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "grpo/mpi_communicator.hpp"
#include "lm_head_support.hpp"
#include "log_prob_head_support.hpp"

namespace grpo::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// Every rank's bytes, in rank order (sizes may differ).
inline std::vector<std::vector<std::byte>> allgather_bytes(const void* data, std::size_t bytes) {
  const int size = world_size();
  const auto mine = static_cast<long long>(bytes);
  std::vector<long long> sizes(static_cast<std::size_t>(size));
  MPI_Allgather(&mine, 1, MPI_LONG_LONG, sizes.data(), 1, MPI_LONG_LONG, MPI_COMM_WORLD);
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  int total = 0;
  for (int q = 0; q < size; ++q) {
    counts[q] = static_cast<int>(sizes[q]);
    displs[q] = total;
    total += counts[q];
  }
  std::vector<std::byte> all(static_cast<std::size_t>(total));
  MPI_Allgatherv(data, static_cast<int>(bytes), MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE,
                 MPI_COMM_WORLD);
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(size));
  for (int q = 0; q < size; ++q) out[q].assign(all.begin() + displs[q], all.begin() + displs[q] + counts[q]);
  return out;
}

// True on every rank when `ok` holds on every rank.
inline bool all_ranks(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// A barrier over the world whose waiting ranks sleep (1 ms at a time) instead
// of spinning. Open MPI polls while a rank waits in a collective: when one
// rank works alone (rank 0 checking the assembled outputs) and the machine has
// fewer cores than ranks, the spinning ranks take its CPU.
inline void sleepy_barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  for (int done = 0;;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done != 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Calls sleepy_barrier() when the scope ends, however it ends (an ASSERT
// returns early).
struct SleepyBarrierAtExit {
  SleepyBarrierAtExit() = default;
  SleepyBarrierAtExit(const SleepyBarrierAtExit&) = delete;
  SleepyBarrierAtExit& operator=(const SleepyBarrierAtExit&) = delete;
  ~SleepyBarrierAtExit() { sleepy_barrier(); }
};

// What one rank holds: sequences [seq_begin, seq_end) of the batch and tokens
// [vocab_begin, vocab_end) of the vocabulary.
struct Part {
  std::int64_t seq_begin = 0;
  std::int64_t seq_end = 0;
  std::int64_t vocab_begin = 0;
  std::int64_t vocab_end = 0;
};

// Shards of `vocab` over `ranks`: tile-aligned (whole tiles of `tile` per
// rank, split as evenly as whole tiles allow; the last rank's last tile is
// the partial one) or an even split ignoring tiles.
inline std::vector<std::int64_t> shard_bounds(std::int64_t vocab, std::int64_t tile, int ranks, bool aligned) {
  std::vector<std::int64_t> b(static_cast<std::size_t>(ranks) + 1);
  const std::int64_t tiles = (vocab + tile - 1) / tile;
  for (int q = 0; q <= ranks; ++q) {
    b[q] = aligned ? std::min(vocab, tiles * q / ranks * tile) : vocab * q / ranks;
  }
  return b;
}

// Sequences of `batch` over `ranks`, as evenly as possible, in rank order.
inline std::int64_t seq_bound(std::int64_t batch, int ranks, int q) { return batch * q / ranks; }

// The modes the scale-out tests run in, and their groups: Pv vocab shards x Pd
// batch parts over the world's ranks.
enum class Mode { vocab, vocab_unaligned, data, grid };

struct Layout {
  int vocab_ranks = 1;  // Pv
  int data_ranks = 1;   // Pd
  bool aligned = true;
};

inline Layout layout_of(Mode m, int size) {
  switch (m) {
    case Mode::vocab: return {size, 1, true};
    case Mode::vocab_unaligned: return {size, 1, false};
    case Mode::data: return {1, size, true};
    case Mode::grid: return {2, size / 2, true};
  }
  return {};
}

// This rank's part of a global problem of `batch` sequences and `vocab` tokens
// in tiles of `vocab_tile`. Rank r = d * Pv + v: its vocab group is the ranks
// of batch part d.
inline Part part_of(std::int64_t batch, std::int64_t vocab, std::int64_t vocab_tile, const Layout& l, int rank) {
  const int v = rank % l.vocab_ranks, d = rank / l.vocab_ranks;
  const std::vector<std::int64_t> shards = shard_bounds(vocab, vocab_tile, l.vocab_ranks, l.aligned);
  return {seq_bound(batch, l.data_ranks, d), seq_bound(batch, l.data_ranks, d + 1), shards[v], shards[v + 1]};
}

// gamma_n for unit roundoff u: the bound n u / (1 - n u) of a sum of n terms.
inline double gamma(double n, double u) { return n * u / (1.0 - n * u); }

// Bit equality of float arrays (NaN-safe, -0 != +0).
inline bool same_bits(const void* a, const void* b, std::size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

// One rank's run of its part of a global case (c, p). The hidden rows, the
// per-token inputs and W's shard are views into the global problem's
// buffers (no copies); the outputs are the rank's own.
inline HeadOutputs run_part(const HeadCase& c, const HeadProblem& p, const Part& part, const ScaleOut& scale_out,
                            const LossConfig& config, int max_threads = 1) {
  const BatchSpec& s = c.spec;
  const std::int64_t t_len = s.seq_len, h = c.hidden, v_all = s.vocab;
  const std::int64_t b = part.seq_end - part.seq_begin, n = b * t_len, r0 = part.seq_begin * t_len;
  const std::int64_t v = part.vocab_end - part.vocab_begin;
  const bool vm = c.layout == WeightLayout::vocab_major;
  const bool sharded = v != v_all;
  const std::size_t in_size = size_of(c.dtype);
  HeadOutputs o;
  o.logp.assign(static_cast<std::size_t>(n), -1.0F);
  o.entropy.assign(static_cast<std::size_t>(n), -1.0F);
  o.kl.assign(static_cast<std::size_t>(n), -1.0F);
  o.dhidden.assign(static_cast<std::size_t>(n * h) * size_of(c.dhidden_dtype), std::byte{0x3f});
  o.dweight.assign(static_cast<std::size_t>(v * h) * size_of(c.dweight_dtype), std::byte{0x3f});
  o.dbias.assign(c.bias ? static_cast<std::size_t>(v) : 0, 7.0F);
  LmHeadShape shape{.batch = b,
                    .seq_len = t_len,
                    .hidden = h,
                    .vocab = v,
                    .dtype = c.dtype,
                    .layout = c.layout,
                    .has_bias = c.bias,
                    .bias_dtype = DType::f32,
                    // hidden-major shards are column slices of [H, V]: their rows keep V's stride
                    .weight_ld = vm ? 0 : v_all,
                    .vocab_offset = sharded ? part.vocab_begin : 0,
                    .global_vocab = sharded ? v_all : 0};
  const std::byte* w =
      p.weight.data() + static_cast<std::size_t>(vm ? part.vocab_begin * h : part.vocab_begin) * in_size;
  const BatchInputs global = p.batch.view();
  const auto rows = [&](auto span) {
    return span.empty() ? span : span.subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(n));
  };
  BatchInputs batch{rows(global.ids), rows(global.mask), {}, rows(global.old_logp), rows(global.ref_logp), {}};
  const bool adv_per_token = global.advantages.size() == static_cast<std::size_t>(s.batch * t_len);
  batch.advantages =
      adv_per_token ? rows(global.advantages)
                    : global.advantages.subspan(static_cast<std::size_t>(part.seq_begin), static_cast<std::size_t>(b));
  if (!global.is_weight.empty()) {
    const bool isw_per_token = global.is_weight.size() == static_cast<std::size_t>(s.batch * t_len);
    batch.is_weight =
        isw_per_token ? rows(global.is_weight)
                      : global.is_weight.subspan(static_cast<std::size_t>(part.seq_begin), static_cast<std::size_t>(b));
  }
  LmHeadInputs in{
      {p.hidden.data() + static_cast<std::size_t>(r0 * h) * in_size, c.dtype, n, h, h},
      vm ? MatrixView{w, c.dtype, v, h, h} : MatrixView{w, c.dtype, h, v, v_all},
      c.bias ? VectorView{p.bias.data() + static_cast<std::size_t>(part.vocab_begin) * sizeof(float), DType::f32, v}
             : VectorView{},
      batch};
  LmHeadOutputs out{{o.logp, o.entropy, o.kl},
                    {o.dhidden.data(), c.dhidden_dtype, n, h, h},
                    vm ? MutMatrixView{o.dweight.data(), c.dweight_dtype, v, h, h}
                       : MutMatrixView{o.dweight.data(), c.dweight_dtype, h, v, v},
                    o.dbias,
                    &o.metrics};
  if (!vm) shape.dweight_ld = v;
  LmHeadOptions opt;
  opt.token_block = c.token_block;
  opt.vocab_tile = c.vocab_tile;
  opt.dweight_dtype = c.dweight_dtype;
  opt.dhidden_dtype = c.dhidden_dtype;
  opt.max_threads = max_threads;
  opt.scale_out = scale_out;
  LmHeadLossPlan plan(shape, config, opt);
  o.schedule = plan.describe();
  plan.execute(in, out);
  return o;
}

// One rank's part of a generic log-prob head case (forward, then backward)
// through a plan with groups: views into the global problem, the rank's own
// outputs (dW [V_q] in the weight's layout, f32; dhidden f32).
inline LogProbRun run_log_prob_part(const LogProbCase& c, const LogProbHostProblem& p, const Part& part,
                                    const ScaleOut& scale_out) {
  const BatchSpec& s = c.head.spec;
  const std::int64_t h = c.head.hidden, v_all = s.vocab;
  const std::int64_t n = (part.seq_end - part.seq_begin) * s.seq_len, r0 = part.seq_begin * s.seq_len;
  const std::int64_t v = part.vocab_end - part.vocab_begin;
  const bool vm = c.head.layout == WeightLayout::vocab_major;
  const bool sharded = v != v_all;
  const std::size_t in_size = size_of(c.head.dtype);
  LmHeadShape shape = log_prob_shape(c);
  shape.batch = part.seq_end - part.seq_begin;
  shape.vocab = v;
  shape.weight_ld = vm ? 0 : v_all;  // hidden-major shards are column slices of [H, V]
  shape.dweight_ld = vm ? 0 : v;
  shape.vocab_offset = sharded ? part.vocab_begin : 0;
  shape.global_vocab = sharded ? v_all : 0;
  LmHeadOptions opt = log_prob_options(c, 1);
  opt.scale_out = scale_out;
  const LossConfig& cfg = s.config;
  const LmHeadLogProbPlan plan(shape, {cfg.temperature, cfg.temperature_on_logp, cfg.logit_softcap, cfg.logit_scale},
                               opt);
  const auto rows = [&](const auto& all) {
    using T = typename std::decay_t<decltype(all)>::value_type;
    return all.empty() ? std::span<const T>{}
                       : std::span<const T>(all).subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(n));
  };
  const std::byte* w =
      p.head.weight.data() + static_cast<std::size_t>(vm ? part.vocab_begin * h : part.vocab_begin) * in_size;
  const LogProbInputs in{
      {p.head.hidden.data() + static_cast<std::size_t>(r0 * h) * in_size, c.head.dtype, n, h, h},
      vm ? MatrixView{w, c.head.dtype, v, h, h} : MatrixView{w, c.head.dtype, h, v, v_all},
      c.head.bias
          ? VectorView{p.head.bias.data() + static_cast<std::size_t>(part.vocab_begin) * sizeof(float), DType::f32, v}
          : VectorView{},
      rows(p.head.batch.ids),
      rows(p.head.batch.mask)};
  LogProbRun o;
  o.schedule = plan.describe();
  o.logp.assign(static_cast<std::size_t>(n), -1.0F);
  o.entropy.assign(static_cast<std::size_t>(n), -1.0F);
  o.dhidden.assign(static_cast<std::size_t>(n * h) * sizeof(float), std::byte{0x3f});
  o.dweight.assign(static_cast<std::size_t>(v * h) * sizeof(float), std::byte{0x3f});
  o.dbias.assign(c.head.bias ? static_cast<std::size_t>(v) : 0, 7.0F);
  plan.forward(in, {o.logp, o.entropy, nullptr});
  plan.backward(
      in, {rows(p.dlogp), rows(p.dentropy)},
      {{o.dhidden.data(), DType::f32, n, h, h},
       vm ? MutMatrixView{o.dweight.data(), DType::f32, v, h, h} : MutMatrixView{o.dweight.data(), DType::f32, h, v, v},
       o.dbias,
       nullptr});
  return o;
}

}  // namespace grpo::test
