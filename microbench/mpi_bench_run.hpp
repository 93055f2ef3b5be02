// One grpo-mpi-bench run over the ranks of MPI_COMM_WORLD: every rank
// synthesizes the same global problem, takes its part (a vocabulary shard of
// W and bias, or its sequences), and times the fused plan with a group over
// the world; then rank 0 alone times the single-process plan on the whole
// problem (the others idle, not spinning). Counters, on rank 0:
//   step_s_p50 / _mean / _p90 / _min  per step the slowest rank's time (a barrier before each step)
//   first_call_s                     plan creation (collective) + first step, slowest rank
//   peak_bytes, peak_bytes_rank<q>   the step's tracked peak (library allocations), max / per rank
//   peak_rss_delta_bytes[_rank<q>]   VmHWM over a call minus VmRSS before it, max over the first
//                                    call and the steps (as grpo-microbench)
//   comm_bytes_sent_per_step[_rank<q>], comm_bytes_recv_per_step, comm_collectives_per_step
//                                    bytes this rank's collectives sent to / received from the
//                                    others per step ((P - 1) x the block of an allgather or an
//                                    alltoall: what a direct exchange moves, and a ring too)
//   single_step_s, single_peak_bytes, single_peak_rss_delta_bytes, single_loss
//   speedup_vs_single (single / ours), time_ratio_vs_single, peak_ratio_vs_single (max rank / single)
//   loss (equal on every rank), loss_diff_vs_single, gflops (3 x 2 N V H of the global problem per step)
#pragma once

#include <mpi.h>

#include "bench_run.hpp"
#include "mpi_bench_config.hpp"

namespace grpo::bench {

// Collective over `world`; every rank returns, rank 0's result is the report.
BenchResult run_mpi_bench(const MpiBenchConfig& config, MPI_Comm world, bool show_progress);

}  // namespace grpo::bench
