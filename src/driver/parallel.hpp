// How the drivers use threads. Work is always split by the shape (rows,
// vocab tiles, hidden chunks), never by the thread count, and every
// reduction runs in index order, so results do not depend on how many
// threads ran or which one took which item.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

namespace grpo::detail {

// Threads a call may use: the caller's arena concurrency, capped by max_threads (> 0).
inline int resolve_threads(int max_threads) {
  const int arena = tbb::this_task_arena::max_concurrency();
  return max_threads > 0 ? std::min(max_threads, arena) : arena;
}

// Runs f() in the caller's arena, or in a nested arena of `threads` when the
// cap is below the caller's concurrency.
template <class F>
void run_with_threads(int threads, F&& f) {
  if (threads >= tbb::this_task_arena::max_concurrency()) {
    f();
  } else {
    tbb::task_arena arena(threads);
    arena.execute(f);
  }
}

// Calls f(row) for every row in [0, rows), one row per task (a row is a whole
// vocabulary: enough work to amortize the task), with at most `threads` threads.
template <class F>
void for_rows(int threads, std::int64_t rows, F&& f) {
  run_with_threads(threads, [&] {
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, rows, 1), [&](const tbb::blocked_range<std::int64_t>& range) {
      for (std::int64_t r = range.begin(); r != range.end(); ++r) f(r);
    });
  });
}

// Calls f(item, slot) for every item in [0, count) with at most `slots`
// concurrent callers; slot in [0, slots) is exclusive to one caller at a time,
// so it can index per-slot scratch (a GEMM tile, a oneDNN scratchpad). Items
// are taken in increasing order; which slot takes which item varies, so f's
// results must not depend on the slot.
template <class F>
void for_each_item(std::int64_t count, int slots, F&& f) {
  if (count <= 0) return;
  const int workers = static_cast<int>(std::min<std::int64_t>(slots, count));
  std::atomic<std::int64_t> next{0};
  auto drain = [&](int slot) {
    for (std::int64_t item = next.fetch_add(1); item < count; item = next.fetch_add(1)) f(item, slot);
  };
  if (workers == 1) {
    drain(0);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int>(0, workers, 1),
      [&](const tbb::blocked_range<int>& range) {
        for (int slot = range.begin(); slot != range.end(); ++slot) drain(slot);
      },
      tbb::simple_partitioner());
}

}  // namespace grpo::detail
