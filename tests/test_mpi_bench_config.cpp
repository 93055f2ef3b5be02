// grpo-mpi-bench's configs (configs/mpi/): every shipped file parses, and a
// config the tool cannot run is refused naming the field. No MPI needed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "mpi_bench_config.hpp"

namespace grpo::bench {
namespace {

TEST(MpiBenchConfig, EveryShippedConfigParses) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(GRPO_CONFIG_DIR "/mpi")) {
    EXPECT_NO_THROW(load_mpi_bench_config(entry.path().string())) << entry.path();
    ++count;
  }
  EXPECT_GE(count, 3);
  const MpiBenchConfig v = load_mpi_bench_config(GRPO_CONFIG_DIR "/mpi/vocab_T1024_bf16.yaml");
  EXPECT_EQ(v.mode, ScaleOutMode::vocab);
  EXPECT_TRUE(v.aligned_shards);
  EXPECT_EQ(v.bench.shape.seq_len, 1024);
  EXPECT_EQ(v.bench.threads, 1);
  EXPECT_FALSE(v.bench.measure_unfused_gemms);
  const MpiBenchConfig d = load_mpi_bench_config(GRPO_CONFIG_DIR "/mpi/data_T1024_bf16.yaml", {"shape.batch=4"});
  EXPECT_EQ(d.mode, ScaleOutMode::data);
  EXPECT_EQ(d.bench.shape.batch, 4);
}

std::string refused_field(const std::string& yaml) {
  const std::string path = ::testing::TempDir() + "/mpi_bench_config_test.yaml";
  std::ofstream(path) << yaml;
  try {
    load_mpi_bench_config(path);
  } catch (const ConfigError& e) {
    return e.field();
  }
  return "";
}

TEST(MpiBenchConfig, ErrorsAreNamed) {
  const std::string run = "impl: fused\nshape: {batch: 2, seq_len: 8, hidden: 16, vocab: 100}\n";
  EXPECT_EQ(refused_field(run + "scale_out: {mode: vocab}\n"), "");
  EXPECT_EQ(refused_field(run), "scale_out");
  EXPECT_EQ(refused_field(run + "scale_out: {aligned_shards: true}\n"), "scale_out.mode");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: tensor}\n"), "scale_out.mode");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: vocab, shards: 2}\n"), "scale_out.shards");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: vocab, global_num_items: true}\n"), "scale_out.global_num_items");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: data}\nreferences: [{name: b, impl: baseline}]\n"), "references");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: data}\nmeasure_unfused_gemms: true\n"), "measure_unfused_gemms");
  EXPECT_EQ(refused_field("impl: baseline\nshape: {batch: 2, seq_len: 8, hidden: 16, vocab: 100}\n"
                          "scale_out: {mode: data}\n"),
            "impl");
  EXPECT_EQ(refused_field(run + "scale_out: {mode: data}\nstepz: 3\n"), "stepz");
}

}  // namespace
}  // namespace grpo::bench
