// One vocabulary-parallel fused GRPO step over MPI through the installed
// grpo package (grpo::mpi): every rank holds every hidden row and one shard
// of W. Run with mpirun -np P (P <= 4 here); every rank prints the same loss,
// which equals the single-process loss of the same problem (the example
// computes that too and exits non-zero when they differ in any bit).
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <grpo/grpo.hpp>
#include <grpo/mpi_communicator.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  constexpr std::int64_t kBatch = 2, kSeqLen = 16, kHidden = 64, kVocab = 1024, kRows = kBatch * kSeqLen;
  constexpr std::int64_t kTile = 128;  // shards of whole tiles: logp and loss are the single process's bits

  // The same problem on every rank (fixed seed).
  std::mt19937 rng(20240601);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_int_distribution<std::int32_t> token(0, kVocab - 1);
  std::vector<float> hidden(kRows * kHidden), weight(kVocab * kHidden);
  for (float& v : hidden) v = normal(rng);
  for (float& v : weight) v = normal(rng) / std::sqrt(static_cast<float>(kHidden));
  std::vector<std::int32_t> ids(kRows);
  for (auto& id : ids) id = token(rng);
  std::vector<float> mask(kRows, 1.0F);
  const std::vector<float> advantages = {1.0F, -0.5F};
  std::vector<float> old_logp(kRows);
  for (float& v : old_logp) v = -std::log(static_cast<float>(kVocab)) + 0.3F * normal(rng);

  // This rank's shard: whole tiles, in rank order.
  const std::int64_t tiles = kVocab / kTile;
  const std::int64_t begin = tiles * rank / ranks * kTile, end = tiles * (rank + 1) / ranks * kTile;
  grpo::MpiCommunicator world(MPI_COMM_WORLD);
  grpo::LmHeadOptions options;
  options.vocab_tile = kTile;
  options.scale_out.vocab_group = &world;
  const grpo::LossConfig config;
  int status = 0;
  try {
    const grpo::LmHeadLossPlan plan({.batch = kBatch,
                                     .seq_len = kSeqLen,
                                     .hidden = kHidden,
                                     .vocab = end - begin,
                                     .dtype = grpo::DType::f32,
                                     .vocab_offset = begin,
                                     .global_vocab = kVocab},
                                    config, options);
    std::vector<float> logp(kRows), dhidden(kRows * kHidden), dweight((end - begin) * kHidden);
    grpo::Metrics metrics;
    plan.execute({.hidden = {hidden.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                  .weight = {weight.data() + begin * kHidden, grpo::DType::f32, end - begin, kHidden, kHidden},
                  .batch = {.ids = ids, .mask = mask, .advantages = advantages, .old_logp = old_logp}},
                 {.tokens = {.logp = logp},
                  .dhidden = {dhidden.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                  .dweight = {dweight.data(), grpo::DType::f32, end - begin, kHidden, kHidden},
                  .metrics = &metrics});
    // The single-process plan on the whole vocabulary, for comparison.
    grpo::LmHeadOptions alone;
    alone.vocab_tile = kTile;
    const grpo::LmHeadLossPlan single(
        {.batch = kBatch, .seq_len = kSeqLen, .hidden = kHidden, .vocab = kVocab, .dtype = grpo::DType::f32}, config,
        alone);
    std::vector<float> logp1(kRows), dhidden1(kRows * kHidden), dweight1(kVocab * kHidden);
    grpo::Metrics metrics1;
    single.execute({.hidden = {hidden.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                    .weight = {weight.data(), grpo::DType::f32, kVocab, kHidden, kHidden},
                    .batch = {.ids = ids, .mask = mask, .advantages = advantages, .old_logp = old_logp}},
                   {.tokens = {.logp = logp1},
                    .dhidden = {dhidden1.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                    .dweight = {dweight1.data(), grpo::DType::f32, kVocab, kHidden, kHidden},
                    .metrics = &metrics1});
    const bool same = std::memcmp(&metrics.loss, &metrics1.loss, sizeof(double)) == 0 && logp == logp1;
    std::printf("rank %d/%d: %s\n", rank, ranks, plan.describe().c_str());
    std::printf("rank %d/%d: loss %.9g (single process %.9g, %s)\n", rank, ranks, metrics.loss, metrics1.loss,
                same ? "bitwise equal, logp too" : "DIFFERENT");
    status = same && std::isfinite(metrics.loss) ? 0 : 1;
  } catch (const grpo::Error& e) {
    std::fprintf(stderr, "rank %d: grpo refused the step: %s\n", rank, e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
