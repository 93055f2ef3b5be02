// An LM head saved to disk as a microbench input (InputSpec::generator =
// file, InputSpec::path): written by scripts/export_trained_head.py from the
// training A/B's model, read here.
//
// The format (little-endian, no padding):
//   char[8]  magic "GRPOIN01"
//   int64    batch, seq_len, hidden, vocab, advantage_count (batch or batch * seq_len), flags (0)
//   float32  hidden      [batch * seq_len, hidden]
//   float32  weight      [vocab, hidden]          (vocab-major)
//   int32    ids         [batch * seq_len]
//   float32  mask        [batch * seq_len]
//   float32  advantages  [advantage_count]
// Stored as float32 whatever the run's dtype: the run rounds to it on load.
#pragma once

#include <cstdint>
#include <string>

namespace grpo::bench {

inline constexpr char kInputFileMagic[8] = {'G', 'R', 'P', 'O', 'I', 'N', '0', '1'};

struct InputFileHeader {
  std::int64_t batch = 0, seq_len = 0, hidden = 0, vocab = 0, advantage_count = 0, flags = 0;
};

// Reads and checks the header (throws std::runtime_error naming the file).
InputFileHeader read_input_file_header(const std::string& path);

}  // namespace grpo::bench
