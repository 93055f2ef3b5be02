// No oversubscription where oneDNN (OpenMP) meets oneTBB: a fused LM-head step
// must not start any OS thread beyond the TBB workers, because every oneDNN
// call inside a TBB task runs with one OpenMP thread. Its own process (a ctest
// test of its own) so no earlier test has already started an OpenMP pool.
// As a control, the unfused baseline's whole-matrix GEMM, which does use an
// OpenMP team, must be seen to add threads: the count can fail.
#include <dirent.h>

#include <cstdio>
#include <vector>

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "grpo/baseline.hpp"
#include "grpo/grpo.hpp"

namespace {

int os_threads() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const dirent* e = readdir(dir)) count += e->d_name[0] != '.';
    closedir(dir);
  }
  return count;
}

}  // namespace

int main() {
  using namespace grpo;
  const int cores = tbb::this_task_arena::max_concurrency();
  const std::int64_t b = 2, t = 64, h = 256, v = 4096, n = b * t;
  std::vector<float> hidden(n * h, 0.01F), weight(v * h, 0.02F), logp(n), dh(n * h), dw(v * h);
  std::vector<std::int32_t> ids(n, 3);
  std::vector<float> mask(n, 1.0F), adv{1.0F, -1.0F};
  LmHeadShape shape{b, t, h, v, DType::f32};
  LmHeadInputs in{{hidden.data(), DType::f32, n, h, h}, {weight.data(), DType::f32, v, h, h}, {}, {ids, mask, adv}};
  LmHeadOutputs out{{logp}, {dh.data(), DType::f32, n, h, h}, {dw.data(), DType::f32, v, h, h}};

  // Start every TBB worker first, so they are not mistaken for new threads.
  tbb::parallel_for(0, 1000 * cores, [](int) {
    volatile double x = 0;
    for (int i = 0; i < 10000; ++i) x = x + i;
  });
  const int before = os_threads();
  LmHeadLossPlan(shape, LossConfig{}).execute(in, out);
  const int after_fused = os_threads();
  LmHeadBaseline(shape, LossConfig{}).execute(in, out);
  const int after_baseline = os_threads();
  std::printf("cores %d, threads: before %d, after fused %d, after baseline %d\n", cores, before, after_fused,
              after_baseline);
  int failures = 0;
  if (after_fused != before) {
    std::printf("FAIL: the fused step started %d extra thread(s)\n", after_fused - before);
    ++failures;
  }
  if (cores > 1 && after_baseline == after_fused) {
    std::printf("FAIL: control: the baseline's OpenMP GEMM was expected to add threads\n");
    ++failures;
  }
  std::printf("%d passed, %d failed\n", 2 - failures, failures);
  return failures == 0 ? 0 : 1;
}
