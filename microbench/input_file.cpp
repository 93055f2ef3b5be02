#include "input_file.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "synth_internal.hpp"

namespace grpo::bench {
namespace {

struct CloseFile {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, CloseFile>;

File open_input(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) throw std::runtime_error("inputs.path '" + path + "': cannot open (run scripts/export_trained_head.py?)");
  return f;
}

void read_exact(std::FILE* f, void* out, std::size_t bytes, const std::string& path, const char* what) {
  if (std::fread(out, 1, bytes, f) != bytes) {
    throw std::runtime_error("inputs.path '" + path + "': ends inside " + what + " (truncated file?)");
  }
}

InputFileHeader read_header(std::FILE* f, const std::string& path) {
  char magic[8];
  read_exact(f, magic, 8, path, "the header");
  if (std::memcmp(magic, kInputFileMagic, 8) != 0) {
    throw std::runtime_error("inputs.path '" + path + "': not a grpo input file (magic GRPOIN01)");
  }
  std::int64_t fields[6];
  read_exact(f, fields, sizeof fields, path, "the header");
  const InputFileHeader h{fields[0], fields[1], fields[2], fields[3], fields[4], fields[5]};
  const std::int64_t n = h.batch * h.seq_len;
  if (h.batch <= 0 || h.seq_len <= 0 || h.hidden <= 0 || h.vocab <= 0 || h.flags != 0 ||
      (h.advantage_count != h.batch && h.advantage_count != n)) {
    throw std::runtime_error("inputs.path '" + path + "': bad header");
  }
  return h;
}

// count float32 values from f, each stored into buf at index(i) as dtype.
template <class Index>
void read_floats(std::FILE* f, std::size_t count, const HostBuffer& buf, DType dtype, Index index,
                 const std::string& path, const char* what) {
  std::vector<float> chunk(std::size_t{1} << 20);
  for (std::size_t done = 0; done < count;) {
    const std::size_t m = std::min(chunk.size(), count - done);
    read_exact(f, chunk.data(), m * 4, path, what);
    for (std::size_t i = 0; i < m; ++i) detail::store(buf, dtype, index(done + i), chunk[i]);
    done += m;
  }
}

}  // namespace

InputFileHeader read_input_file_header(const std::string& path) {
  const File f = open_input(path);
  return read_header(f.get(), path);
}

void detail::fill_from_file(const ProblemSpec& s, Problem& p) {
  const std::string& path = s.inputs.path;
  const File f = open_input(path);
  const InputFileHeader hd = read_header(f.get(), path);
  const ShapeSpec want{hd.batch, hd.seq_len, hd.hidden, hd.vocab};
  if (!(want == s.shape)) {
    throw std::runtime_error("inputs.path '" + path + "' holds shape {batch: " + std::to_string(hd.batch) +
                             ", seq_len: " + std::to_string(hd.seq_len) + ", hidden: " + std::to_string(hd.hidden) +
                             ", vocab: " + std::to_string(hd.vocab) + "}; the config's shape must say the same");
  }
  const std::int64_t n = s.shape.rows(), h = s.shape.hidden, v = s.shape.vocab;
  const std::size_t in_size = size_of(s.dtype);
  p.hidden = HostBuffer(static_cast<std::size_t>(n * h) * in_size);
  read_floats(
      f.get(), static_cast<std::size_t>(n * h), p.hidden, s.dtype, [](std::size_t i) { return i; }, path, "hidden");
  p.weight = HostBuffer(static_cast<std::size_t>(v * h) * in_size);
  const bool vm = s.layout == WeightLayout::vocab_major;
  read_floats(
      f.get(), static_cast<std::size_t>(v * h), p.weight, s.dtype,
      [&](std::size_t i) { return vm ? i : (i % h) * v + i / h; }, path, "weight");
  p.ids.resize(n);
  read_exact(f.get(), p.ids.data(), n * 4, path, "ids");
  for (const std::int32_t id : p.ids) {
    if (id < 0 || id >= v) throw std::runtime_error("inputs.path '" + path + "': an id is outside [0, vocab)");
  }
  p.mask.resize(n);
  read_exact(f.get(), p.mask.data(), n * 4, path, "mask");
  p.advantages.resize(hd.advantage_count);
  read_exact(f.get(), p.advantages.data(), hd.advantage_count * 4, path, "advantages");
  // The loss's autos were filled from the synthesized mask; redo them.
  if (s.loss.autos.num_items_in_batch)
    p.config.num_items_in_batch = static_cast<double>(std::max<std::int64_t>(p.num_valid(), 1));
}

}  // namespace grpo::bench
