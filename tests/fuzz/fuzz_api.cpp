// libFuzzer target over the public API: LogitsLossPlan, LogitsBaseline,
// LmHeadLossPlan and LmHeadBaseline on tiny random problems (N <= 12 rows,
// V <= 40, H <= 12, so one run takes microseconds).
//
// The input bytes choose the entry point, the shape, dtypes, strides, layout,
// the loss configuration and options, the ids (out of range and on masked rows
// too), the values (NaN, +-inf, huge, banned tokens), aliasing between outputs
// and inputs, and the workspace. The contract checked (abort otherwise):
//   - the call returns, or throws grpo::Error whose argument() is non-empty;
//     any other exception is a finding;
//   - after a grpo::Error, no byte of any output buffer (nor of any input an
//     aliasing output points into) changed: the refusal comes first;
//   - after a return, every output written is finite, masked rows' logp is 0,
//     and the metrics are finite.
// ASan / UBSan (the fuzz build instruments the library too) catch reads or
// writes outside the views.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "grpo/baseline.hpp"
#include "grpo/grpo.hpp"
#include "kernels/f16.hpp"

namespace {

using grpo::DType;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// What the current input built, printed with a finding so that a reproducer
// can be read without a debugger.
struct Context {
  const char* entry = "";
  long long batch = 0, seq_len = 0, vocab = 0, hidden = 0;
  int dtype = 0;
  grpo::LossConfig config;
};
Context g_context;
void print_batch();  // defined with the Problem below

void print_context(const char* what) {
  const Context& c = g_context;
  const grpo::LossConfig& k = c.config;
  std::fprintf(stderr,
               "fuzz_api: %s\n"
               "  entry %s B=%lld T=%lld V=%lld H=%lld dtype=%d\n"
               "  loss_type=%d is_level=%d eps=[%g, %g] delta=%g beta=%g kl*r=%d tau=%g on_logp=%d mcl=%lld "
               "num_items=%g sapo=[%g, %g] kl_est=%d kl_clamp=%g clip_c=%g opsm=%g ent_coef=%g rho=%g softcap=%g "
               "logit_scale=%g\n",
               what, c.entry, c.batch, c.seq_len, c.vocab, c.hidden, c.dtype, static_cast<int>(k.loss_type),
               static_cast<int>(k.importance_sampling_level), k.epsilon_low, k.epsilon_high, k.delta.value_or(-1.0F),
               k.beta, k.kl_bias_correction ? 1 : 0, k.temperature, k.temperature_on_logp ? 1 : 0,
               static_cast<long long>(k.max_completion_length), k.num_items_in_batch, k.sapo_tau_pos, k.sapo_tau_neg,
               static_cast<int>(k.kl_estimator), k.kl_clamp.value_or(-1.0F), k.clip_ratio_c.value_or(-1.0F),
               k.off_policy_mask_threshold.value_or(-1.0F), k.entropy_coef, k.top_entropy_quantile,
               k.logit_softcap.value_or(-1.0F), k.logit_scale);
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_api: contract violated\n");
  print_context(what);
  print_batch();
  std::abort();
}

// GRPO_FUZZ_PRINT=1: print every input's problem before the call (to read a
// reproducer that crashes inside the library).
const bool g_print = std::getenv("GRPO_FUZZ_PRINT") != nullptr;

// Prints the offending element and the row's per-token inputs.
void print_vector(const char* name, std::span<const float> v) {
  std::fprintf(stderr, "  %s:", name);
  for (float x : v) std::fprintf(stderr, " %g", x);
  std::fprintf(stderr, "\n");
}

std::uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const auto u = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);  // round to nearest even
}

float from_bf16(std::uint16_t v) { return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16); }

// A 16-bit element of dtype (bf16 or f16) and back.
std::uint16_t to_16(DType dtype, float f) { return dtype == DType::f16 ? grpo::kernels::float_to_f16(f) : to_bf16(f); }
float from_16(DType dtype, std::uint16_t v) {
  return dtype == DType::f16 ? grpo::kernels::f16_to_float(v) : from_bf16(v);
}

// One of the three dtypes: bf16 or f16 one time in four each.
DType pick_dtype(FuzzedDataProvider& fdp) {
  const int i = fdp.ConsumeIntegralInRange<int>(0, 7);
  return i < 2 ? DType::bf16 : i < 4 ? DType::f16 : DType::f32;
}

// One byte-addressed buffer. Sized with slack so that views with a larger ld
// or an extra row still fall inside memory the harness owns: an out-of-bounds
// report from ASan is then the library's, not the harness's.
struct Buffer {
  std::vector<std::byte> bytes;

  void resize(std::size_t n) { bytes.assign(n + 64, std::byte{0}); }
  std::byte* data() { return bytes.data(); }
  std::size_t size() const { return bytes.size(); }
};

// Values the fuzzer writes: mostly ordinary, sometimes hostile.
float pick_value(FuzzedDataProvider& fdp, float scale, bool allow_hostile) {
  const std::uint8_t kind = fdp.ConsumeIntegral<std::uint8_t>();
  if (allow_hostile) {
    switch (kind) {
      case 0: return kNaN;
      case 1: return kInf;
      case 2: return -kInf;
      case 3: return 1.0e4F;  // SPEC: |z| ~ 1e4 rows must give finite results
      case 4: return -1.0e4F;
      case 5: return 3.0e38F;  // finite, overflows anything it multiplies
      case 6: return std::numeric_limits<float>::denorm_min();
      default: break;
    }
  }
  // kind in [0, 255] -> a value in [-scale, scale], with zero reachable.
  return scale * (static_cast<float>(kind) - 127.0F) / 127.0F;
}

float pick_from(FuzzedDataProvider& fdp, std::initializer_list<float> values) {
  const std::size_t i = fdp.ConsumeIntegralInRange<std::size_t>(0, values.size() - 1);
  return *(values.begin() + i);
}

template <class T>
T pick_enum(FuzzedDataProvider& fdp, int valid_count) {
  // 1 in 32: a value outside the enum, which the library must refuse.
  const int v = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? valid_count + fdp.ConsumeIntegralInRange<int>(0, 3)
                                                            : fdp.ConsumeIntegralInRange<int>(0, valid_count - 1);
  return static_cast<T>(v);
}

// A matrix in its own buffer, filled from the fuzzer.
struct Matrix {
  Buffer storage;
  DType dtype = DType::f32;
  std::int64_t rows = 0, cols = 0, ld = 0;

  void make(FuzzedDataProvider& fdp, DType type, std::int64_t r, std::int64_t c, std::int64_t stride, float scale,
            bool hostile) {
    dtype = type;
    rows = r;
    cols = c;
    ld = stride;
    const std::size_t elem = type == DType::f32 ? 4 : 2;
    storage.resize(static_cast<std::size_t>((r + 1) * (std::max(c, stride) + 4)) * 4);
    const std::size_t count = storage.size() / elem;
    for (std::size_t i = 0; i < count; ++i) {
      // Ordinary values everywhere; hostile ones only when the input asked
      // for them (one hostile element in about 64).
      const bool h = hostile && fdp.ConsumeIntegralInRange<int>(0, 63) == 0;
      const float v = fdp.remaining_bytes() > 0 ? pick_value(fdp, scale, h) : 0.25F;
      if (type != DType::f32) {
        const std::uint16_t b = to_16(type, v);
        std::memcpy(storage.data() + 2 * i, &b, 2);
      } else {
        std::memcpy(storage.data() + 4 * i, &v, 4);
      }
    }
  }
  grpo::MatrixView view() { return {storage.data(), dtype, rows, cols, ld}; }
};

float load(const std::byte* base, DType dtype, std::size_t i) {
  if (dtype == DType::bf16 || dtype == DType::f16) {
    std::uint16_t v;
    std::memcpy(&v, base + 2 * i, 2);
    return from_16(dtype, v);
  }
  float v;
  std::memcpy(&v, base + 4 * i, 4);
  return v;
}

void check_finite_matrix(const grpo::MutMatrixView& m, const char* name) {
  if (m.empty()) return;
  const auto* base = static_cast<const std::byte*>(m.data);
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t c = 0; c < m.cols; ++c) {
      if (!std::isfinite(load(base, m.dtype, static_cast<std::size_t>(r * m.ld + c)))) fail(name);
    }
  }
}

void check_finite_span(std::span<const float> s, const char* name) {
  for (float v : s) {
    if (!std::isfinite(v)) {
      print_vector(name, s);
      fail(name);
    }
  }
}

void check_metrics(const grpo::Metrics& m) {
  for (double v : {m.loss, m.clip_ratio_low, m.clip_ratio_high, m.clip_ratio_region, m.kl_mean, m.entropy_mean}) {
    if (!std::isfinite(v)) fail("metrics not finite");
  }
}

enum class Entry : std::uint8_t { logits_plan, logits_baseline, lm_head_plan, lm_head_baseline };

struct Problem {
  // Shape.
  Entry entry = Entry::logits_plan;
  std::int64_t batch = 1, seq_len = 1, rows = 1, vocab = 1, hidden = 1;
  // Inputs.
  Matrix logits, hidden_m, weight;
  Buffer bias_storage;
  DType bias_dtype = DType::f32;
  bool has_bias = false;
  std::vector<std::int32_t> ids;
  std::vector<float> mask, advantages, old_logp, ref_logp, is_weight;
  std::vector<std::int64_t> sequence_offsets;  // packed sequences, sometimes (fill_batch)
  // Outputs, each in its own buffer unless aliased.
  std::vector<float> logp, entropy, kl, dbias;
  Buffer dlogits_storage, dhidden_storage, dweight_storage;
  grpo::Metrics metrics;
  Buffer workspace;
};

std::vector<float> make_vector(FuzzedDataProvider& fdp, std::size_t n, float scale, float offset, bool hostile) {
  std::vector<float> v(n);
  for (float& x : v) x = offset + pick_value(fdp, scale, hostile && fdp.ConsumeIntegralInRange<int>(0, 15) == 0);
  return v;
}

// The size of a per-token tensor: usually right, sometimes B, N, or wrong.
std::size_t pick_size(FuzzedDataProvider& fdp, std::size_t right, std::size_t other) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 15)) {
    case 0: return right + 1;
    case 1: return right > 0 ? right - 1 : 0;
    case 2: return other;
    default: return right;
  }
}

grpo::LossConfig make_config(FuzzedDataProvider& fdp, std::int64_t rows, std::int64_t seq_len) {
  grpo::LossConfig c;
  c.loss_type = pick_enum<grpo::LossType>(fdp, 8);
  c.importance_sampling_level = pick_enum<grpo::IsLevel>(fdp, 2);
  c.epsilon_low = pick_from(fdp, {0.2F, 0.0F, 0.1F, 0.28F, 0.9F, -0.1F, kNaN});
  c.epsilon_high = pick_from(fdp, {0.2F, 0.0F, 0.28F, 5.0F, -0.2F, kInf});
  if (fdp.ConsumeBool()) c.delta = pick_from(fdp, {3.0F, 1.5F, 1.2F, 1.0F, 10.0F, kNaN});
  c.beta = pick_from(fdp, {0.0F, 0.0F, 0.04F, 1.0F, -0.5F, kNaN});
  c.kl_bias_correction = fdp.ConsumeBool();
  c.temperature = pick_from(fdp, {1.0F, 1.0F, 0.7F, 2.0F, 0.05F, 20.0F, 0.0F, -1.0F, kNaN, kInf});
  c.temperature_on_logp = fdp.ConsumeBool();
  c.max_completion_length =
      static_cast<std::int64_t>(pick_from(fdp, {static_cast<float>(seq_len), 1.0F, 1000.0F, 0.0F, -3.0F}));
  c.num_items_in_batch = pick_from(fdp, {static_cast<float>(rows), 1.0F, 0.5F, 1000.0F, 0.0F, -1.0F, kNaN});
  c.sapo_tau_pos = pick_from(fdp, {1.0F, 0.5F, 4.0F, 0.0F, kNaN});
  c.sapo_tau_neg = pick_from(fdp, {1.05F, 0.5F, 4.0F, -1.0F});
  // The options of the current trainers, each off most of the time.
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) c.kl_estimator = pick_enum<grpo::KlEstimator>(fdp, 7);
  if (fdp.ConsumeIntegralInRange<int>(0, 5) == 0) c.kl_clamp = pick_from(fdp, {10.0F, 0.1F, 0.0F, kNaN});
  if (fdp.ConsumeIntegralInRange<int>(0, 5) == 0) c.clip_ratio_c = pick_from(fdp, {3.0F, 1.5F, 1.0F, kInf});
  if (fdp.ConsumeIntegralInRange<int>(0, 5) == 0) {
    c.off_policy_mask_threshold = pick_from(fdp, {0.1F, 0.0F, 5.0F, -0.1F, kNaN});
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) c.entropy_coef = pick_from(fdp, {0.01F, -0.5F, 3e37F, kNaN});
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    c.top_entropy_quantile = pick_from(fdp, {0.2F, 0.0F, 0.999F, 1.5F, -0.1F, kNaN});
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 4) == 0) c.logit_softcap = pick_from(fdp, {30.0F, 0.5F, 0.0F, -1.0F, kInf});
  if (fdp.ConsumeIntegralInRange<int>(0, 4) == 0) c.logit_scale = pick_from(fdp, {2.0F, 0.01F, 1e30F, 0.0F, kNaN});
  return c;
}

// Packed sequences' offsets over the N rows: usually valid (0, increasing, N),
// sometimes not (a repeat, a wrong end), sometimes with a batch of several rows.
void fill_offsets(FuzzedDataProvider& fdp, Problem& p) {
  p.sequence_offsets = {0};
  for (std::int64_t r = 1; r < p.rows; ++r) {
    if (fdp.ConsumeBool()) p.sequence_offsets.push_back(r);
  }
  p.sequence_offsets.push_back(p.rows);
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: p.sequence_offsets.back() += 1; break;
    case 1: p.sequence_offsets.insert(p.sequence_offsets.begin() + 1, 0); break;
    case 2: p.sequence_offsets.front() = 1; break;
    default: break;
  }
}

void fill_batch(FuzzedDataProvider& fdp, Problem& p) {
  const bool packed = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  if (packed) fill_offsets(fdp, p);
  const auto n = static_cast<std::size_t>(p.rows);
  // Per-sequence inputs: B sequences, or S packed ones.
  const auto b = packed ? p.sequence_offsets.size() - 1 : static_cast<std::size_t>(p.batch);
  p.ids.resize(pick_size(fdp, n, b));
  for (auto& id : p.ids) {
    switch (fdp.ConsumeIntegralInRange<int>(0, 15)) {
      case 0: id = static_cast<std::int32_t>(p.vocab); break;
      case 1: id = -1; break;
      case 2: id = std::numeric_limits<std::int32_t>::min(); break;
      default: id = fdp.ConsumeIntegralInRange<std::int32_t>(0, static_cast<std::int32_t>(p.vocab - 1));
    }
  }
  p.mask.resize(pick_size(fdp, n, b));
  for (float& m : p.mask) {
    const int k = fdp.ConsumeIntegralInRange<int>(0, 31);
    m = k == 0 ? 0.5F : k == 1 ? kNaN : k < 8 ? 0.0F : 1.0F;
  }
  // Advantages per sequence or per token; values a trainer produces (z-scored
  // rewards), with the odd hostile one.
  p.advantages = make_vector(fdp, pick_size(fdp, fdp.ConsumeBool() ? b : n, n + b), 3.0F, 0.0F, true);
  // Log-probs: around -log V, up to 0 and down to -100; absent sometimes.
  const float typical = -std::log(static_cast<float>(p.vocab)) - 1.0F;
  if (fdp.ConsumeIntegralInRange<int>(0, 3) != 0)
    p.old_logp = make_vector(fdp, pick_size(fdp, n, b), 3.0F, typical, true);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) != 0)
    p.ref_logp = make_vector(fdp, pick_size(fdp, n, b), 3.0F, typical, true);
  if (fdp.ConsumeIntegralInRange<int>(0, 2) == 0) {
    p.is_weight = make_vector(fdp, pick_size(fdp, fdp.ConsumeBool() ? n : b, n + 1), 1.0F, 1.0F, true);
  }
}

// Set once a call returned: fail() then also prints the per-token inputs.
const Problem* g_batch = nullptr;

void print_batch() {
  if (g_batch == nullptr) return;
  const Problem& p = *g_batch;
  std::fprintf(stderr, "  ids:");  // "contract violated" failures print these
  for (auto id : p.ids) std::fprintf(stderr, " %d", id);
  std::fprintf(stderr, "\n");
  print_vector("mask", p.mask);
  print_vector("advantages", p.advantages);
  print_vector("old_logp", p.old_logp);
  print_vector("ref_logp", p.ref_logp);
  print_vector("is_weight", p.is_weight);
  std::fprintf(stderr, "  sequence_offsets:");
  for (auto o : p.sequence_offsets) std::fprintf(stderr, " %lld", static_cast<long long>(o));
  std::fprintf(stderr, "\n");
  print_vector("logp", p.logp);
}

grpo::BatchInputs batch_view(const Problem& p) {
  return {p.ids, p.mask, p.advantages, p.old_logp, p.ref_logp, p.is_weight, p.sequence_offsets};
}

// Every byte the call may write, for the refusal check.
std::vector<std::byte> snapshot(Problem& p) {
  std::vector<std::byte> out;
  auto add = [&](const void* d, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(d);
    out.insert(out.end(), b, b + n);
  };
  for (auto* v : {&p.logp, &p.entropy, &p.kl, &p.dbias, &p.mask, &p.advantages, &p.old_logp, &p.ref_logp}) {
    add(v->data(), v->size() * sizeof(float));
  }
  for (auto* b : {&p.dlogits_storage, &p.dhidden_storage, &p.dweight_storage, &p.logits.storage, &p.hidden_m.storage,
                  &p.weight.storage, &p.bias_storage}) {
    add(b->data(), b->size());
  }
  add(p.ids.data(), p.ids.size() * sizeof(std::int32_t));
  add(&p.metrics, sizeof(p.metrics));
  return out;
}

std::int64_t pick_ld(FuzzedDataProvider& fdp, std::int64_t cols) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 15)) {
    case 0: return cols - 1;  // refused
    case 1: return cols + 1;
    case 2: return cols + 3;
    default: return cols;
  }
}

void run_one(FuzzedDataProvider& fdp) {
  g_batch = nullptr;
  Problem p;
  p.entry = static_cast<Entry>(fdp.ConsumeIntegralInRange<int>(0, 3));
  p.batch = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  p.seq_len = fdp.ConsumeIntegralInRange<std::int64_t>(1, 4);
  p.rows = p.batch * p.seq_len;
  p.vocab = fdp.ConsumeIntegralInRange<std::int64_t>(1, 40);
  p.hidden = fdp.ConsumeIntegralInRange<std::int64_t>(1, 12);
  const grpo::LossConfig config = make_config(fdp, p.rows, p.seq_len);
  const DType dtype = pick_enum<DType>(fdp, 3);
  const bool known = dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32;
  const DType data_dtype = known ? dtype : DType::f32;  // storage of an invalid tag
  const bool hostile = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  const int max_threads = fdp.ConsumeIntegralInRange<int>(-1, 3);
  const bool is_logits = p.entry == Entry::logits_plan || p.entry == Entry::logits_baseline;
  static const char* const kEntryNames[] = {"LogitsLossPlan", "LogitsBaseline", "LmHeadLossPlan", "LmHeadBaseline"};
  g_context = {
      kEntryNames[static_cast<int>(p.entry)], p.batch, p.seq_len, p.vocab, p.hidden, static_cast<int>(dtype), config};

  // Outputs: logp always (sometimes the wrong size), entropy / kl optional.
  const auto n = static_cast<std::size_t>(p.rows);
  p.logp.assign(pick_size(fdp, n, n + 1), -3.0F);
  if (fdp.ConsumeBool()) p.entropy.assign(pick_size(fdp, n, n + 1), -3.0F);
  if (fdp.ConsumeBool()) p.kl.assign(pick_size(fdp, n, n + 1), -3.0F);
  std::fill(reinterpret_cast<std::byte*>(&p.metrics), reinterpret_cast<std::byte*>(&p.metrics + 1), std::byte{0x5A});

  grpo::TokenOutputs tokens{p.logp, p.entropy, p.kl};
  const bool with_logp = fdp.ConsumeIntegralInRange<int>(0, 31) != 0;
  if (!with_logp) tokens.logp = {};

  if (is_logits) {
    const std::int64_t ld = pick_ld(fdp, p.vocab);
    p.logits.make(fdp, data_dtype, p.rows, p.vocab, ld, 8.0F, hostile);
    p.logits.dtype = dtype;
    // Banned tokens: whole -inf columns sometimes (finite results required).
    if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
      const std::int64_t banned = fdp.ConsumeIntegralInRange<std::int64_t>(0, p.vocab - 1);
      for (std::int64_t r = 0; r < p.rows; ++r) {
        const std::size_t at = static_cast<std::size_t>(r * ld + banned);
        if (data_dtype != DType::f32) {
          const std::uint16_t v = to_16(data_dtype, -kInf);
          std::memcpy(p.logits.storage.data() + 2 * at, &v, 2);
        } else {
          const float v = -kInf;
          std::memcpy(p.logits.storage.data() + 4 * at, &v, 4);
        }
      }
    }
    fill_batch(fdp, p);
    const grpo::MatrixView logits = p.logits.view();
    grpo::LogitsOutputs out{tokens, {}, &p.metrics};
    if (fdp.ConsumeIntegralInRange<int>(0, 3) != 0) {
      const int alias = fdp.ConsumeIntegralInRange<int>(0, 15);
      const DType dl_dtype = fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? DType::bf16 : DType::f32;
      const std::int64_t dl_ld = pick_ld(fdp, p.vocab);
      p.dlogits_storage.resize(static_cast<std::size_t>((p.rows + 1) * (std::max(dl_ld, p.vocab) + 4)) * 4);
      std::memset(p.dlogits_storage.data(), 0x3C, p.dlogits_storage.size());
      out.dlogits = {p.dlogits_storage.data(), dl_dtype, p.rows, p.vocab, dl_ld};
      if (alias == 0) out.dlogits = {p.logits.storage.data(), logits.dtype, p.rows, p.vocab, logits.ld};  // in place
      if (alias == 1) out.dlogits.data = p.logits.storage.data() + 4;  // overlapping, not in place: refused
      if (alias == 2 && p.dlogits_storage.size() >= (n + 2) * 4) {     // logp inside dlogits: refused
        out.tokens.logp = {reinterpret_cast<float*>(p.dlogits_storage.data()) + 1, n};
      }
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && p.logits.storage.size() >= (n + 1) * 4) {
      out.tokens.entropy = {reinterpret_cast<float*>(p.logits.storage.data()), n};  // inside logits: refused
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && !p.logp.empty()) out.tokens.kl = out.tokens.logp;  // refused

    const grpo::LogitsShape shape{p.batch, p.seq_len, p.vocab, dtype};
    const grpo::ExecOptions options{max_threads, nullptr};
    const std::vector<std::byte> before = snapshot(p);
    if (g_print) {
      g_batch = &p;
      print_context("calling");
      print_batch();
    }
    try {
      if (p.entry == Entry::logits_plan) {
        grpo::LogitsLossPlan(shape, config, options).execute(logits, batch_view(p), out);
      } else {
        grpo::LogitsBaseline(shape, config, options).execute(logits, batch_view(p), out);
      }
    } catch (const grpo::Error& e) {
      if (e.argument().empty()) fail("grpo::Error without an argument name");
      if (snapshot(p) != before) {
        std::fprintf(stderr, "  refusal: %s\n", e.what());
        fail("an output was written before a refusal");
      }
      return;
    }
    g_batch = &p;
    check_finite_span(out.tokens.logp, "logp not finite");
    check_finite_span(out.tokens.entropy, "entropy not finite");
    check_finite_span(out.tokens.kl, "kl not finite");
    check_finite_matrix(out.dlogits, "dlogits not finite");
    for (std::int64_t r = 0; r < p.rows; ++r) {
      if (p.mask[r] == 0.0F && out.tokens.logp[r] != 0.0F) fail("masked row logp is not 0");
    }
    check_metrics(p.metrics);
    return;
  }

  // LM head.
  grpo::LmHeadShape shape;
  shape.batch = p.batch;
  shape.seq_len = p.seq_len;
  shape.hidden = p.hidden;
  shape.vocab = p.vocab;
  shape.dtype = dtype;
  shape.layout = pick_enum<grpo::WeightLayout>(fdp, 2);
  shape.has_bias = fdp.ConsumeBool();
  shape.bias_dtype = pick_dtype(fdp);
  const bool vocab_major = shape.layout != grpo::WeightLayout::hidden_major;
  const std::int64_t w_rows = vocab_major ? p.vocab : p.hidden;
  const std::int64_t w_cols = vocab_major ? p.hidden : p.vocab;
  const std::int64_t hidden_ld = pick_ld(fdp, p.hidden);
  const std::int64_t weight_ld = pick_ld(fdp, w_cols);
  const std::int64_t dweight_ld = pick_ld(fdp, w_cols);
  // The plan is built for these strides; sometimes the call disagrees.
  if (fdp.ConsumeBool()) shape.hidden_ld = hidden_ld;
  if (fdp.ConsumeBool()) shape.weight_ld = weight_ld;
  if (fdp.ConsumeBool()) shape.dweight_ld = dweight_ld;
  // Values: unit-scale hidden, ~1/sqrt(H) weights (logits of a trained head).
  p.hidden_m.make(fdp, data_dtype, p.rows, p.hidden, hidden_ld, 3.0F, hostile);
  p.hidden_m.dtype = dtype;
  p.weight.make(fdp, data_dtype, w_rows, w_cols, weight_ld, 1.0F, hostile);
  p.weight.dtype = dtype;
  grpo::VectorView bias;
  if (shape.has_bias || fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    p.bias_storage.resize(static_cast<std::size_t>(p.vocab + 1) * 4);
    for (std::int64_t v = 0; v <= p.vocab; ++v) {
      // Banned tokens (-inf) are legal in a bias.
      const float x = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? -kInf : pick_value(fdp, 1.0F, hostile);
      if (shape.bias_dtype != DType::f32) {
        const std::uint16_t b = to_16(shape.bias_dtype, x);
        std::memcpy(p.bias_storage.data() + 2 * v, &b, 2);
      } else {
        std::memcpy(p.bias_storage.data() + 4 * v, &x, 4);
      }
    }
    bias = {p.bias_storage.data(), shape.bias_dtype, static_cast<std::int64_t>(pick_size(fdp, p.vocab, 1))};
  }
  fill_batch(fdp, p);

  const bool forward_only = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  const DType dweight_dtype = pick_dtype(fdp);
  const DType dhidden_dtype = pick_dtype(fdp);
  const bool accumulate = fdp.ConsumeBool();
  grpo::LmHeadOutputs out{tokens, {}, {}, {}, &p.metrics};
  if (!forward_only || fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    const std::int64_t dh_ld = fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? pick_ld(fdp, p.hidden) : p.hidden;
    p.dhidden_storage.resize(static_cast<std::size_t>((p.rows + 1) * (std::max(dh_ld, p.hidden) + 4)) * 4);
    p.dweight_storage.resize(static_cast<std::size_t>((w_rows + 1) * (std::max(dweight_ld, w_cols) + 4)) * 4);
    // Accumulate mode adds into dweight / dbias: start them finite (0.125).
    std::memset(p.dhidden_storage.data(), 0x3E, p.dhidden_storage.size());
    std::memset(p.dweight_storage.data(), 0x3E, p.dweight_storage.size());
    out.dhidden = {p.dhidden_storage.data(), dhidden_dtype, p.rows, p.hidden, dh_ld};
    out.dweight = {p.dweight_storage.data(), dweight_dtype, w_rows, w_cols, dweight_ld};
    if (shape.has_bias) {
      p.dbias.assign(pick_size(fdp, p.vocab, p.vocab + 1), 0.125F);
      out.dbias = p.dbias;
    }
    switch (fdp.ConsumeIntegralInRange<int>(0, 15)) {  // aliasing, all refused
      case 0: out.dhidden.data = p.hidden_m.storage.data(); break;
      case 1: out.dweight.data = p.weight.storage.data() + 4; break;
      case 2:
        if (p.dweight_storage.size() >= p.dhidden_storage.size()) out.dhidden.data = p.dweight_storage.data();
        break;
      case 3:
        if (p.dhidden_storage.size() >= (n + 1) * 4) {
          out.tokens.logp = {reinterpret_cast<float*>(p.dhidden_storage.data()) + 1, n};
        }
        break;
      case 4:
        if (!p.bias_storage.bytes.empty() && !out.dbias.empty()) {
          out.dbias = {reinterpret_cast<float*>(p.bias_storage.data()),
                       std::min(out.dbias.size(), static_cast<std::size_t>(p.vocab))};
        }
        break;
      default: break;
    }
  }

  const grpo::LmHeadInputs in{p.hidden_m.view(), p.weight.view(), bias, batch_view(p)};
  const std::vector<std::byte> before = snapshot(p);
  if (g_print) {
    g_batch = &p;
    print_context("calling");
    print_batch();
  }
  try {
    if (p.entry == Entry::lm_head_plan) {
      grpo::LmHeadOptions options;
      options.token_block = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 5);
      options.vocab_tile = pick_from(fdp, {0.0F, 1.0F, 7.0F, 16.0F, 64.0F, -1.0F});
      if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) options.workspace_budget = 4096;
      options.max_threads = max_threads;
      options.forward_only = forward_only;
      options.dweight_dtype = dweight_dtype;
      options.dhidden_dtype = dhidden_dtype;
      options.accumulate_weight_grads = accumulate;
      // A frozen head: usually without dweight / dbias (as it must be), sometimes with them (refused).
      options.frozen_weight = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
      if (options.frozen_weight && fdp.ConsumeIntegralInRange<int>(0, 7) != 0) {
        out.dweight = {};
        out.dbias = {};
      }
      const grpo::LmHeadLossPlan plan(shape, config, options);
      std::span<std::byte> ws;
      const int ws_kind = fdp.ConsumeIntegralInRange<int>(0, 7);
      if (ws_kind != 0) {
        const std::size_t need = plan.workspace_size();
        p.workspace.resize(need + 128);
        std::byte* base = p.workspace.data();
        base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
        ws = {base, need};
        if (ws_kind == 1 && need > 0) ws = {base, need - 1};  // refused
        if (ws_kind == 2) ws = {base + 16, need};             // misaligned: refused
      }
      plan.execute(in, out, ws);
    } else {
      grpo::LmHeadBaselineOptions options;
      options.logits_dtype = fdp.ConsumeBool() ? DType::bf16 : DType::f32;
      options.max_threads = max_threads;
      options.forward_only = forward_only;
      options.dweight_dtype = dweight_dtype;
      options.dhidden_dtype = dhidden_dtype;
      options.accumulate_weight_grads = accumulate;
      grpo::LmHeadBaseline(shape, config, options).execute(in, out);
    }
  } catch (const grpo::Error& e) {
    if (e.argument().empty()) fail("grpo::Error without an argument name");
    // The documented exception: a k3 KL beyond f32 needs the policy's own
    // logp, which the fused LM head meets block by block; the refusal says so.
    const bool documented =
        e.argument() == "ref_logp" &&
        std::string(e.what()).find("outputs of earlier token blocks were already written") != std::string::npos;
    if (!documented && snapshot(p) != before) {
      std::fprintf(stderr, "  refusal: %s\n", e.what());
      fail("an output was written before a refusal");
    }
    return;
  }
  g_batch = &p;
  check_finite_span(out.tokens.logp, "logp not finite");
  check_finite_span(out.tokens.entropy, "entropy not finite");
  check_finite_span(out.tokens.kl, "kl not finite");
  check_finite_matrix(out.dhidden, "dhidden not finite");
  check_finite_matrix(out.dweight, "dweight not finite");
  check_finite_span(out.dbias, "dbias not finite");
  for (std::int64_t r = 0; r < p.rows; ++r) {
    if (p.mask[r] == 0.0F && out.tokens.logp[r] != 0.0F) fail("masked row logp is not 0");
  }
  check_metrics(p.metrics);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  try {
    run_one(fdp);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_api: unexpected exception: %s\n", e.what());
    std::abort();
  } catch (...) {
    fail("unexpected non-std exception");
  }
  return 0;
}
