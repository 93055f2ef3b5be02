#include "mpi_bench_run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "caching_allocator.hpp"
#include "grpo/mpi_communicator.hpp"
#include "measure.hpp"
#include "runners.hpp"
#include "synth.hpp"

namespace grpo::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Counts what this rank's collectives move, then forwards them.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(const Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void allgather(const void* send, void* recv, std::size_t bytes) const override {
    count(bytes);
    inner_.allgather(send, recv, bytes);
  }
  void alltoall(const void* send, void* recv, std::size_t bytes) const override {
    count(bytes);
    inner_.alltoall(send, recv, bytes);
  }
  void reset() const { sent_ = calls_ = 0; }
  double sent() const { return static_cast<double>(sent_); }
  double calls() const { return static_cast<double>(calls_); }

 private:
  // Both collectives send one block of `bytes` to each other rank and receive one from each.
  void count(std::size_t bytes) const {
    sent_ += bytes * static_cast<std::size_t>(inner_.size() - 1);
    ++calls_;
  }
  const Communicator& inner_;
  mutable std::size_t sent_ = 0;
  mutable std::size_t calls_ = 0;
};

// Every rank's value, on every rank.
std::vector<double> gather_all(double v, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::vector<double> all(static_cast<std::size_t>(size));
  MPI_Allgather(&v, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, comm);
  return all;
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// Rank 0 works alone while the others sleep in short naps (a rank waiting in
// MPI_Barrier would spin on a core and slow rank 0 down).
template <class F>
void rank0_alone(MPI_Comm world, int rank, F&& f) {
  int done = 0;
  if (rank == 0) {
    f();
    int size = 1;
    MPI_Comm_size(world, &size);
    for (int q = 1; q < size; ++q) MPI_Send(&done, 1, MPI_INT, q, 7, world);
  } else {
    MPI_Request request;
    MPI_Irecv(&done, 1, MPI_INT, 0, 7, world, &request);
    for (int finished = 0; finished == 0;) {
      MPI_Test(&request, &finished, MPI_STATUS_IGNORE);
      if (finished == 0) usleep(20000);
    }
  }
}

}  // namespace

BenchResult run_mpi_bench(const MpiBenchConfig& mc, MPI_Comm world, bool show_progress) {
  const BenchConfig& c = mc.bench;
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  Progress progress(c.name + " (rank " + std::to_string(rank) + ")", show_progress && rank == 0);
  progress.update("synthesizing inputs (every rank: the same global problem)");
  const Problem problem = synthesize(problem_spec(c));
  const std::int64_t t_len = c.shape.seq_len, h = c.shape.hidden, v_all = c.shape.vocab;
  const bool vm = c.layout == WeightLayout::vocab_major;
  const std::size_t in_size = size_of(c.dtype);

  // This rank's part.
  std::int64_t s0 = 0, s1 = c.shape.batch, v0 = 0, v1 = v_all;
  if (mc.mode == ScaleOutMode::data) {
    if (c.shape.batch < size) {
      throw std::runtime_error("mode data needs shape.batch >= the number of ranks (" + std::to_string(size) + ")");
    }
    s0 = c.shape.batch * rank / size;
    s1 = c.shape.batch * (rank + 1) / size;
  } else {
    const std::int64_t tile = std::min(c.vocab_tile > 0 ? c.vocab_tile : std::int64_t{2048}, v_all);
    const std::int64_t tiles = (v_all + tile - 1) / tile;
    v0 = mc.aligned_shards ? std::min(v_all, tiles * rank / size * tile) : v_all * rank / size;
    v1 = mc.aligned_shards ? std::min(v_all, tiles * (rank + 1) / size * tile) : v_all * (rank + 1) / size;
  }
  const std::int64_t b = s1 - s0, n = b * t_len, r0 = s0 * t_len, v = v1 - v0;
  const bool sharded = v != v_all;
  LmHeadShape shape = problem.lm_head_shape();
  shape.batch = b;
  shape.vocab = v;
  if (!vm) shape.weight_ld = v_all;
  if (sharded) {
    shape.vocab_offset = v0;
    shape.global_vocab = v_all;
  }
  const LmHeadInputs global = problem.lm_head_inputs();
  const auto rows = [&](auto s) {
    return s.empty() ? s : s.subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(n));
  };
  LmHeadInputs in;
  in.hidden = {problem.hidden.data() + static_cast<std::size_t>(r0 * h) * in_size, c.dtype, n, h, h};
  const std::byte* w = problem.weight.data() + static_cast<std::size_t>(vm ? v0 * h : v0) * in_size;
  in.weight = vm ? MatrixView{w, c.dtype, v, h, h} : MatrixView{w, c.dtype, h, v, v_all};
  if (!global.bias.empty())
    in.bias = {problem.bias.data() + static_cast<std::size_t>(v0) * sizeof(float), DType::f32, v};
  const BatchInputs& g = global.batch;
  const bool per_token_adv = g.advantages.size() == static_cast<std::size_t>(c.shape.rows());
  in.batch = {rows(g.ids),
              rows(g.mask),
              per_token_adv ? rows(g.advantages)
                            : g.advantages.subspan(static_cast<std::size_t>(s0), static_cast<std::size_t>(b)),
              rows(g.old_logp),
              rows(g.ref_logp),
              {}};
  if (!g.is_weight.empty()) {
    in.batch.is_weight = g.is_weight.size() == static_cast<std::size_t>(c.shape.rows())
                             ? rows(g.is_weight)
                             : g.is_weight.subspan(static_cast<std::size_t>(s0), static_cast<std::size_t>(b));
  }

  // Outputs: this rank's rows and shard, touched before anything is timed.
  HeadOutputs outputs(c, c.forward_only, n, v);
  Metrics metrics;
  const LmHeadOutputs out = outputs.view(c, &metrics);
  if (!vm && !c.forward_only) shape.dweight_ld = v;

  const MpiCommunicator mpi(world);
  const CountingCommunicator counted(mpi);
  LossConfig config = problem.config;
  LmHeadOptions o = plan_options(c, default_allocator());  // the tracker below replaces the allocator
  if (mc.mode == ScaleOutMode::vocab) {
    o.scale_out.vocab_group = &counted;
  } else {
    o.scale_out.data_group = &counted;
    if (mc.global_num_items) {
      o.scale_out.global_num_items = true;
      config.num_items_in_batch = 0.0;
    }
  }

  RunStats stats;
  std::vector<double> peak_rank, rss_rank, sent_rank;
  double calls = 0.0;
  std::string describe;
  std::size_t workspace = 0;
  {
    CachingAllocator cache;
    TrackingAllocator tracker(c.allocator == AllocatorKind::caching ? static_cast<Allocator&>(cache)
                                                                    : default_allocator());
    o.allocator = &tracker;
    progress.update("first call (collective plan creation + step)");
    // As grpo-microbench: the first call's RSS delta counts (with a caching
    // allocator it is the only call that maps fresh memory), its tracked peak not.
    const bool first_rss_ok = RssProbe::reset_high_water_mark();
    const std::int64_t first_rss_before = RssProbe::rss_bytes();
    MPI_Barrier(world);
    const auto t0 = Clock::now();
    const LmHeadLossPlan plan(shape, config, o);
    plan.execute(in, out);
    stats.first_call_s = max_of(gather_all(std::chrono::duration<double>(Clock::now() - t0).count(), world));
    const std::int64_t first_hwm = RssProbe::high_water_mark_bytes();
    describe = plan.describe();
    workspace = plan.workspace_size();
    for (int i = 0; i < c.warmup; ++i) {
      progress.update("warm-up", i + 1, c.warmup);
      plan.execute(in, out);
    }
    std::size_t peak = 0;
    std::int64_t rss_peak = first_rss_ok && first_rss_before >= 0 && first_hwm >= 0 ? first_hwm - first_rss_before : -1;
    for (int i = 0; i < c.steps; ++i) {
      progress.update("step", i + 1, c.steps);
      counted.reset();
      const std::size_t live = tracker.live_bytes();
      tracker.reset_peak();
      const bool rss_ok = RssProbe::reset_high_water_mark();
      const std::int64_t rss_before = RssProbe::rss_bytes();
      MPI_Barrier(world);
      const auto s = Clock::now();
      plan.execute(in, out);
      const double dt = std::chrono::duration<double>(Clock::now() - s).count();
      const std::int64_t hwm = RssProbe::high_water_mark_bytes();
      peak = std::max(peak, tracker.peak_bytes() - live);
      if (rss_ok && rss_before >= 0 && hwm >= 0) rss_peak = std::max(rss_peak, hwm - rss_before);
      stats.step_s.push_back(max_of(gather_all(dt, world)));  // the step ends when the slowest rank's does
    }
    peak_rank = gather_all(static_cast<double>(peak), world);
    rss_rank = gather_all(static_cast<double>(rss_peak), world);
    sent_rank = gather_all(counted.sent(), world);
    calls = counted.calls();
  }

  BenchResult result;
  Counters& k = result.counters;
  k["ranks"] = size;
  k["step_s_mean"] = stats.mean();
  k["step_s_p50"] = stats.p50();
  k["step_s_p90"] = stats.percentile(0.9);
  k["step_s_min"] = stats.percentile(0.0);
  k["first_call_s"] = stats.first_call_s;
  k["peak_bytes"] = max_of(peak_rank);
  k["peak_rss_delta_bytes"] = max_of(rss_rank);
  k["comm_bytes_sent_per_step"] = max_of(sent_rank);
  k["comm_bytes_recv_per_step"] = max_of(sent_rank);  // every block sent is a block received (equal per rank)
  k["comm_collectives_per_step"] = calls;
  k["workspace_bytes"] = static_cast<double>(workspace);
  for (int q = 0; q < size; ++q) {
    const std::string r = "_rank" + std::to_string(q);
    k["peak_bytes" + r] = peak_rank[q];
    k["peak_rss_delta_bytes" + r] = rss_rank[q];
    k["comm_bytes_sent_per_step" + r] = sent_rank[q];
  }
  k["loss"] = metrics.loss;
  k["clip_ratio_region"] = metrics.clip_ratio_region;
  k["entropy_mean"] = metrics.entropy_mean;
  k["num_valid"] = static_cast<double>(metrics.num_valid);
  k["batch"] = static_cast<double>(c.shape.batch);
  k["seq_len"] = static_cast<double>(t_len);
  k["hidden"] = static_cast<double>(h);
  k["vocab"] = static_cast<double>(v_all);
  k["threads_per_rank"] = c.threads;
  const double flops = 2.0 * static_cast<double>(c.shape.rows()) * static_cast<double>(v_all) * static_cast<double>(h) *
                       (c.forward_only ? 1.0 : 3.0);
  k["gflops"] = stats.p50() > 0.0 ? flops / stats.p50() * 1e-9 : 0.0;

  if (mc.single_reference) {
    // The same config and problem through grpo-microbench's own measurement.
    RunStats single;
    rank0_alone(world, rank, [&] {
      Progress p(c.name + " single process (rank 0 alone)", show_progress);
      single = measure_run(c, problem, p, false);
    });
    if (rank == 0) {
      k["single_step_s"] = single.p50();
      k["single_peak_bytes"] = static_cast<double>(single.peak_bytes);
      k["single_peak_rss_delta_bytes"] = static_cast<double>(single.peak_rss_delta_bytes);
      k["single_loss"] = single.metrics.loss;
      k["loss_diff_vs_single"] = metrics.loss - single.metrics.loss;
      if (stats.p50() > 0.0) k["speedup_vs_single"] = single.p50() / stats.p50();
      if (single.p50() > 0.0) k["time_ratio_vs_single"] = stats.p50() / single.p50();
      if (single.peak_bytes > 0) k["peak_ratio_vs_single"] = max_of(peak_rank) / static_cast<double>(single.peak_bytes);
    }
  }
  result.step_s = stats.step_s;
  result.label = std::string("mpi ") + to_string(mc.mode) + " x" + std::to_string(size) + ": " + describe;
  return result;
}

}  // namespace grpo::bench
