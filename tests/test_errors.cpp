// Every refusal of the public API, for each entry point it applies to (the
// logits-level plan, the logits baseline, the fused LM-head plan and the
// LM-head baseline): the exception is grpo::Error, argument() names the
// argument, and not one byte of any buffer changed -- the outputs (filled with
// a sentinel pattern first), the metrics, and the inputs, which an aliasing
// output may point into. SPEC.md "Inputs that must not be trusted" promises the
// error comes before any output is written.
//
// Beside the refusals: the inputs that must NOT be refused (an out-of-range id
// on a masked row, banned tokens that are not chosen, in-place dlogits) run,
// and give the same bytes as the plain valid call where they should.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "grpo/baseline.hpp"
#include "grpo/grpo.hpp"

namespace grpo {
namespace {

// Small problem: N = 6 rows. kTokenBlock = 4 gives the fused plan two token
// blocks, so a refusal whose cause sits in the second block is also checked
// for writing nothing; kVocabTile = 16 gives three vocab tiles, the last one
// partial.
constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kSeqLen = 3;
constexpr std::int64_t kRows = kBatch * kSeqLen;
constexpr std::int64_t kVocab = 37;
constexpr std::int64_t kHidden = 8;
constexpr std::int64_t kTokenBlock = 4;
constexpr std::int64_t kVocabTile = 16;
constexpr std::int64_t kMaskedRow = 2;  // the one padded position
constexpr std::int64_t kLateRow = 5;    // a valid row in the second token block
constexpr std::uint8_t kSentinel = 0xA5;
// Per-token input buffers are this long (only the first kRows elements are
// viewed), so an output view placed over one stays inside memory the test owns
// even when the library fails to refuse it.
constexpr std::size_t kRoom = 400;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

enum class Entry : std::uint8_t { logits_plan, logits_baseline, lm_head_plan, lm_head_baseline };
constexpr unsigned bit(Entry e) { return 1U << static_cast<unsigned>(e); }
constexpr unsigned kLogits = bit(Entry::logits_plan) | bit(Entry::logits_baseline);
constexpr unsigned kHead = bit(Entry::lm_head_plan) | bit(Entry::lm_head_baseline);
constexpr unsigned kFused = bit(Entry::lm_head_plan);
constexpr unsigned kAll = kLogits | kHead;
constexpr unsigned kBaselines = bit(Entry::logits_baseline) | bit(Entry::lm_head_baseline);

const char* entry_name(Entry e) {
  switch (e) {
    case Entry::logits_plan: return "LogitsPlan";
    case Entry::logits_baseline: return "LogitsBaseline";
    case Entry::lm_head_plan: return "LmHeadPlan";
    case Entry::lm_head_baseline: return "LmHeadBaseline";
  }
  return "?";
}

std::uint16_t to_bf16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);  // round to nearest even
}

// All storage of one call. Every matrix has room for ld = cols + 1 and every
// per-token vector for N + 1 elements, so a view broken by a refusal still
// addresses memory the test owns even if the library failed to refuse it.
struct Buffers {
  std::vector<float> logits, hidden, weight, bias;
  std::vector<std::uint16_t> logits_bf16, hidden_bf16, weight_bf16;
  std::vector<std::int32_t> ids;
  std::vector<float> mask, advantages, old_logp, ref_logp, is_weight;
  std::vector<float> logp, entropy, kl, dlogits, dhidden, dweight, dbias;
  Metrics metrics;
  std::vector<std::byte> workspace;

  Buffers() {
    std::mt19937 rng(12345);  // fixed: the refusals do not depend on the values
    std::normal_distribution<float> normal(0.0F, 1.0F);
    auto fill = [&](std::vector<float>& v, std::size_t n, float scale) {
      v.resize(n);
      for (float& x : v) x = scale * normal(rng);
    };
    fill(logits, kRows * (kVocab + 1), 2.0F);
    fill(hidden, kRows * (kHidden + 1), 1.0F);
    fill(weight, kVocab * (kHidden + 1), 0.35F);  // ~ 1 / sqrt(H): unit-scale logits
    fill(bias, kVocab + 1, 0.1F);
    using Pair = std::pair<std::vector<float>*, std::vector<std::uint16_t>*>;
    for (const auto& [src, dst] :
         {Pair{&logits, &logits_bf16}, Pair{&hidden, &hidden_bf16}, Pair{&weight, &weight_bf16}}) {
      dst->resize(src->size());
      for (std::size_t i = 0; i < src->size(); ++i) (*dst)[i] = to_bf16((*src)[i]);
    }
    std::uniform_int_distribution<std::int32_t> token(0, kVocab - 1);
    ids.resize(kRoom);
    for (auto& id : ids) id = token(rng);
    mask.assign(kRoom, 1.0F);
    mask[kMaskedRow] = 0.0F;
    advantages = {1.0F, -0.7F, 0.5F, 0.25F, -1.0F, 2.0F, 1.5F};  // [B] or [N] views of it
    advantages.resize(kRoom, 1.0F);
    fill(old_logp, kRoom, 0.3F);
    for (float& x : old_logp) x -= std::log(static_cast<float>(kVocab));
    fill(ref_logp, kRoom, 0.3F);
    for (float& x : ref_logp) x -= std::log(static_cast<float>(kVocab));
    is_weight.assign(kRoom, 1.0F);
    is_weight[1] = 0.5F;
    for (auto* v : {&logp, &entropy, &kl, &dbias}) v->assign(std::max(kRows, kVocab) + 1, 0.0F);
    dlogits.assign(kRows * (kVocab + 1), 0.0F);
    dhidden.assign(kRows * (kHidden + 1), 0.0F);
    dweight.assign(kVocab * (kHidden + 1), 0.0F);
    fill_outputs();
  }

  void fill_outputs() {
    for (auto* v : {&logp, &entropy, &kl, &dlogits, &dhidden, &dweight, &dbias}) {
      std::memset(v->data(), kSentinel, v->size() * sizeof(float));
    }
    // Metrics has default member initializers (non-trivial for GCC) but is
    // plain data: fill its bytes through a void pointer.
    std::memset(static_cast<void*>(&metrics), kSentinel, sizeof(metrics));
  }

  // Every byte a call could write to, inputs included.
  std::vector<std::byte> snapshot() const {
    std::vector<std::byte> out;
    auto add = [&](const void* p, std::size_t bytes) {
      const auto* b = static_cast<const std::byte*>(p);
      out.insert(out.end(), b, b + bytes);
    };
    for (const auto* v : {&logits, &hidden, &weight, &bias, &mask, &advantages, &old_logp, &ref_logp, &is_weight, &logp,
                          &entropy, &kl, &dlogits, &dhidden, &dweight, &dbias}) {
      add(v->data(), v->size() * sizeof(float));
    }
    for (const auto* v : {&logits_bf16, &hidden_bf16, &weight_bf16}) add(v->data(), v->size() * 2);
    add(ids.data(), ids.size() * sizeof(std::int32_t));
    add(&metrics, sizeof(metrics));
    return out;
  }
};

enum class WorkspaceMode : std::uint8_t { none, exact, short_by_one, misaligned };

// The arguments of one call, built valid and then broken by one refusal.
struct Call {
  LossConfig config;
  LogitsShape logits_shape{kBatch, kSeqLen, kVocab, DType::f32};
  ExecOptions exec_options;
  LmHeadShape head_shape;
  LmHeadOptions head_options;
  LmHeadBaselineOptions baseline_options;
  MatrixView logits;
  LmHeadInputs head;  // hidden, weight, bias; head.batch is taken from `batch`
  BatchInputs batch;
  TokenOutputs tokens;
  MutMatrixView dlogits;
  MutMatrixView dhidden;
  MutMatrixView dweight;
  std::span<float> dbias;
  Metrics* metrics = nullptr;
  WorkspaceMode workspace = WorkspaceMode::exact;

  explicit Call(Buffers& b) {
    config.beta = 0.04F;  // KL on: ref_logp is read and kl written
    head_shape = {.batch = kBatch,
                  .seq_len = kSeqLen,
                  .hidden = kHidden,
                  .vocab = kVocab,
                  .dtype = DType::f32,
                  .layout = WeightLayout::vocab_major,
                  .has_bias = true,
                  .bias_dtype = DType::f32};
    head_options.token_block = kTokenBlock;
    head_options.vocab_tile = kVocabTile;
    logits = {b.logits.data(), DType::f32, kRows, kVocab, kVocab};
    head.hidden = {b.hidden.data(), DType::f32, kRows, kHidden, kHidden};
    head.weight = {b.weight.data(), DType::f32, kVocab, kHidden, kHidden};
    head.bias = {b.bias.data(), DType::f32, kVocab};
    batch = {.ids = std::span(b.ids).first(kRows),
             .mask = std::span(b.mask).first(kRows),
             .advantages = std::span(b.advantages).first(kBatch),
             .old_logp = std::span(b.old_logp).first(kRows),
             .ref_logp = std::span(b.ref_logp).first(kRows),
             .is_weight = std::span(b.is_weight).first(kRows)};
    tokens = {std::span(b.logp).first(kRows), std::span(b.entropy).first(kRows), std::span(b.kl).first(kRows)};
    dlogits = {b.dlogits.data(), DType::f32, kRows, kVocab, kVocab};
    dhidden = {b.dhidden.data(), DType::f32, kRows, kHidden, kHidden};
    dweight = {b.dweight.data(), DType::f32, kVocab, kHidden, kHidden};
    dbias = std::span(b.dbias).first(kVocab);
    metrics = &b.metrics;
  }

  // Switches the LM-head operands to bf16 (and the logits to bf16).
  void use_bf16(Buffers& b) {
    logits_shape.logits_dtype = DType::bf16;
    logits.data = b.logits_bf16.data();
    logits.dtype = DType::bf16;
    head_shape.dtype = DType::bf16;
    head.hidden.data = b.hidden_bf16.data();
    head.hidden.dtype = DType::bf16;
    head.weight.data = b.weight_bf16.data();
    head.weight.dtype = DType::bf16;
  }
};

// Runs one entry point on the call; throws whatever the library throws.
void execute(Entry entry, const Call& c, Buffers& b) {
  switch (entry) {
    case Entry::logits_plan: {
      const LogitsLossPlan plan(c.logits_shape, c.config, c.exec_options);
      plan.execute(c.logits, c.batch, {.tokens = c.tokens, .dlogits = c.dlogits, .metrics = c.metrics});
      return;
    }
    case Entry::logits_baseline: {
      const LogitsBaseline baseline(c.logits_shape, c.config, c.exec_options);
      baseline.execute(c.logits, c.batch, {.tokens = c.tokens, .dlogits = c.dlogits, .metrics = c.metrics});
      return;
    }
    case Entry::lm_head_plan: {
      const LmHeadLossPlan plan(c.head_shape, c.config, c.head_options);
      LmHeadInputs in = c.head;
      in.batch = c.batch;
      const LmHeadOutputs out{c.tokens, c.dhidden, c.dweight, c.dbias, c.metrics};
      std::span<std::byte> ws;
      if (c.workspace != WorkspaceMode::none) {
        const std::size_t need = plan.workspace_size();
        b.workspace.assign(need + 128, std::byte{0});
        auto* base = b.workspace.data();
        base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
        if (c.workspace == WorkspaceMode::short_by_one) ws = {base, need - 1};
        if (c.workspace == WorkspaceMode::exact) ws = {base, need};
        if (c.workspace == WorkspaceMode::misaligned) ws = {base + 8, need};
      }
      plan.execute(in, out, ws);
      return;
    }
    case Entry::lm_head_baseline: {
      const LmHeadBaseline baseline(c.head_shape, c.config, c.baseline_options);
      LmHeadInputs in = c.head;
      in.batch = c.batch;
      baseline.execute(in, {c.tokens, c.dhidden, c.dweight, c.dbias, c.metrics});
      return;
    }
  }
}

struct Refusal {
  std::string name;
  // Error::argument() must be one of these (an overlap of two outputs may be
  // reported under either name).
  std::vector<std::string> arguments;
  unsigned entries;
  std::function<void(Call&, Buffers&)> apply;
  // what() must also name this (the other argument of an overlap), if set.
  std::string mentions;
};

// Every output placed over every per-token input (issue: kl written over
// ref_logp turned a loss of 4.22 into 1394): refused, naming both. logp over
// old_logp as the very same array is the one supported case (see
// LogpOverOldLogpIsSupportedExactly); logp overlapping old_logp otherwise is refused.
std::vector<Refusal> output_over_input_refusals() {
  using B = Buffers;
  struct Input {
    const char* name;
    std::function<float*(B&)> data;
  };
  const Input inputs[] = {
      {"ids", [](B& b) { return reinterpret_cast<float*>(b.ids.data()); }},
      {"mask", [](B& b) { return b.mask.data(); }},
      {"advantages", [](B& b) { return b.advantages.data(); }},
      {"old_logp", [](B& b) { return b.old_logp.data(); }},
      {"ref_logp", [](B& b) { return b.ref_logp.data(); }},
      {"is_weight", [](B& b) { return b.is_weight.data(); }},
  };
  struct Output {
    const char* name;
    unsigned entries;
    std::function<void(Call&, float*)> place;
  };
  const Output outputs[] = {
      {"logp", kAll,
       [](Call& c, float* at) {
         c.tokens.logp = {at, kRows};
       }},
      {"entropy", kAll,
       [](Call& c, float* at) {
         c.tokens.entropy = {at, kRows};
       }},
      {"kl", kAll,
       [](Call& c, float* at) {
         c.tokens.kl = {at, kRows};
       }},
      {"dlogits", kLogits, [](Call& c, float* at) { c.dlogits.data = at; }},
      {"dhidden", kHead, [](Call& c, float* at) { c.dhidden.data = at; }},
      {"dweight", kHead, [](Call& c, float* at) { c.dweight.data = at; }},
      {"dbias", kHead,
       [](Call& c, float* at) {
         c.dbias = {at, kVocab};
       }},
  };
  std::vector<Refusal> out;
  for (const Output& o : outputs) {
    for (const Input& in : inputs) {
      const bool logp_over_old = std::string(o.name) == "logp" && std::string(in.name) == "old_logp";
      // logp exactly over old_logp is supported: refuse the shifted overlap instead.
      const std::ptrdiff_t shift = logp_over_old ? 1 : 0;
      auto data = in.data;
      auto place = o.place;
      out.push_back({std::string(o.name) + "Over" + in.name + (shift ? "Shifted" : ""),
                     {o.name},
                     o.entries,
                     [data, place, shift](Call& c, B& b) { place(c, data(b) + shift); },
                     in.name});
    }
  }
  return out;
}

// Row-major index of (row, col) in a matrix of the default ld.
std::size_t at(std::int64_t row, std::int64_t col, std::int64_t ld) { return static_cast<std::size_t>(row * ld + col); }

std::vector<Refusal> refusals() {
  using B = Buffers;
  const float big = 1e20F;  // finite, but 1e20 * 1e20 * H overflows f32 in the logits GEMM
  return {
      // --- ids: outside [0, V) on a valid row (masked rows: see MaskedRowIdsAreNotRead) ---
      {"IdEqualToVocab", {"ids"}, kAll, [](Call&, B& b) { b.ids[0] = kVocab; }},
      {"IdNegative", {"ids"}, kAll, [](Call&, B& b) { b.ids[kLateRow] = -1; }},
      {"IdInt32Max", {"ids"}, kAll, [](Call&, B& b) { b.ids[1] = std::numeric_limits<std::int32_t>::max(); }},
      {"IdInt32Min", {"ids"}, kAll, [](Call&, B& b) { b.ids[3] = std::numeric_limits<std::int32_t>::min(); }},

      // --- mismatched sizes of each tensor ---
      {"IdsTooShort", {"ids"}, kAll, [](Call& c, B&) { c.batch.ids = c.batch.ids.first(kRows - 1); }},
      {"IdsTooLong", {"ids"}, kAll, [](Call& c, B& b) { c.batch.ids = std::span(b.ids).first(kRows + 1); }},
      {"IdsMissing", {"ids"}, kAll, [](Call& c, B&) { c.batch.ids = {}; }},
      {"MaskTooShort", {"mask"}, kAll, [](Call& c, B&) { c.batch.mask = c.batch.mask.first(kRows - 1); }},
      {"AdvantagesNeitherBNorN",
       {"advantages"},
       kAll,
       [](Call& c, B& b) { c.batch.advantages = std::span(b.advantages).first(kBatch + 1); }},
      {"AdvantagesMissing", {"advantages"}, kAll, [](Call& c, B&) { c.batch.advantages = {}; }},
      {"OldLogpTooShort",
       {"old_logp"},
       kAll,
       [](Call& c, B&) { c.batch.old_logp = c.batch.old_logp.first(kRows - 1); }},
      {"RefLogpTooLong",
       {"ref_logp"},
       kAll,
       [](Call& c, B& b) { c.batch.ref_logp = std::span(b.ref_logp).first(kRows + 1); }},
      {"IsWeightNeitherBNorN",
       {"is_weight"},
       kAll,
       [](Call& c, B&) { c.batch.is_weight = c.batch.is_weight.first(kBatch + 1); }},
      {"LogpTooShort", {"logp"}, kAll, [](Call& c, B&) { c.tokens.logp = c.tokens.logp.first(kRows - 1); }},
      {"LogpMissing", {"logp"}, kAll, [](Call& c, B&) { c.tokens.logp = {}; }},
      {"EntropyTooLong",
       {"entropy"},
       kAll,
       [](Call& c, B& b) { c.tokens.entropy = std::span(b.entropy).first(kRows + 1); }},
      {"KlTooShort", {"kl"}, kAll, [](Call& c, B&) { c.tokens.kl = c.tokens.kl.first(kRows - 1); }},
      {"LogitsTooFewRows", {"logits"}, kLogits, [](Call& c, B&) { c.logits.rows = kRows - 1; }},
      {"LogitsTooManyCols", {"logits"}, kLogits, [](Call& c, B&) { c.logits.cols = c.logits.ld = kVocab + 1; }},
      {"LogitsNull", {"logits"}, kLogits, [](Call& c, B&) { c.logits.data = nullptr; }},
      {"DlogitsTooFewCols", {"dlogits"}, kLogits, [](Call& c, B&) { c.dlogits.cols = kVocab - 1; }},
      {"DlogitsTooManyRows", {"dlogits"}, kLogits, [](Call& c, B&) { c.dlogits.rows = kRows + 1; }},
      {"HiddenTooFewRows", {"hidden"}, kHead, [](Call& c, B&) { c.head.hidden.rows = kRows - 1; }},
      {"HiddenTooManyCols",
       {"hidden"},
       kHead,
       [](Call& c, B&) { c.head.hidden.cols = c.head.hidden.ld = kHidden + 1; }},
      {"HiddenNull", {"hidden"}, kHead, [](Call& c, B&) { c.head.hidden.data = nullptr; }},
      {"WeightTooFewRows", {"weight"}, kHead, [](Call& c, B&) { c.head.weight.rows = kVocab - 1; }},
      {"WeightTransposed",
       {"weight"},
       kHead,
       [](Call& c, B&) {
         c.head.weight = {c.head.weight.data, DType::f32, kHidden, kVocab, kVocab};
       }},
      {"BiasTooShort", {"bias"}, kHead, [](Call& c, B&) { c.head.bias.size = kVocab - 1; }},
      {"BiasMissing", {"bias"}, kHead, [](Call& c, B&) { c.head.bias = {}; }},
      {"BiasWithoutHasBias",
       {"bias"},
       kHead,
       [](Call& c, B&) {
         c.head_shape.has_bias = false;
         c.dbias = {};
       }},
      {"DhiddenTooFewRows", {"dhidden"}, kHead, [](Call& c, B&) { c.dhidden.rows = kRows - 1; }},
      {"DhiddenMissing", {"dhidden"}, kHead, [](Call& c, B&) { c.dhidden = {}; }},
      {"DweightTooFewCols", {"dweight"}, kHead, [](Call& c, B&) { c.dweight.cols = kHidden - 1; }},
      {"DweightMissing", {"dweight"}, kHead, [](Call& c, B&) { c.dweight = {}; }},
      {"DbiasTooShort", {"dbias"}, kHead, [](Call& c, B&) { c.dbias = c.dbias.first(kVocab - 1); }},
      {"DbiasWithoutHasBias",
       {"dbias"},
       kHead,
       [](Call& c, B&) {
         c.head_shape.has_bias = false;
         c.head.bias = {};
       }},

      // --- dtypes and alignment ---
      {"LogitsDtypeDiffersFromShape", {"logits"}, kLogits, [](Call& c, B&) { c.logits.dtype = DType::bf16; }},
      {"HiddenDtypeDiffersFromShape", {"hidden"}, kHead, [](Call& c, B&) { c.head.hidden.dtype = DType::bf16; }},
      {"DhiddenDtypeDiffersFromOptions", {"dhidden"}, kHead, [](Call& c, B&) { c.dhidden.dtype = DType::bf16; }},
      {"DweightDtypeDiffersFromOptions", {"dweight"}, kHead, [](Call& c, B&) { c.dweight.dtype = DType::bf16; }},
      {"LogitsMisaligned",
       {"logits"},
       kLogits,
       [](Call& c, B& b) { c.logits.data = reinterpret_cast<const std::byte*>(b.logits.data()) + 1; }},
      {"HiddenMisaligned",
       {"hidden"},
       kHead,
       [](Call& c, B& b) { c.head.hidden.data = reinterpret_cast<const std::byte*>(b.hidden.data()) + 2; }},

      // --- non-finite values ---
      {"LogitsNaN", {"logits"}, kLogits, [](Call&, B& b) { b.logits[at(kLateRow, 7, kVocab)] = kNaN; }},
      {"LogitsPosInf", {"logits"}, kLogits, [](Call&, B& b) { b.logits[at(1, kVocab - 1, kVocab)] = kInf; }},
      {"LogitsNaNOnMaskedRow", {"logits"}, kLogits, [](Call&, B& b) { b.logits[at(kMaskedRow, 3, kVocab)] = kNaN; }},
      {"LogitsRowAllNegInf",
       {"logits"},
       kLogits,
       [](Call&, B& b) {
         for (std::int64_t v = 0; v < kVocab; ++v) b.logits[at(4, v, kVocab)] = -kInf;
       }},
      {"LogitsChosenTokenNegInf",
       {"ids"},
       kLogits,
       [](Call&, B& b) { b.logits[at(kLateRow, b.ids[kLateRow], kVocab)] = -kInf; }},
      {"LogitsBf16NaN",
       {"logits"},
       kLogits,
       [](Call& c, B& b) {
         c.use_bf16(b);
         b.logits_bf16[at(3, 20, kVocab)] = 0x7FC0;
       }},
      {"LogitsBf16SignallingNaN",
       {"logits"},
       kLogits,
       [](Call& c, B& b) {
         c.use_bf16(b);
         b.logits_bf16[at(3, 36, kVocab)] = 0x7F81;
       }},
      {"HiddenNaN", {"hidden"}, kHead, [](Call&, B& b) { b.hidden[at(kLateRow, 3, kHidden)] = kNaN; }},
      {"HiddenPosInf", {"hidden"}, kHead, [](Call&, B& b) { b.hidden[at(0, 0, kHidden)] = kInf; }},
      {"HiddenNegInf", {"hidden"}, kHead, [](Call&, B& b) { b.hidden[at(1, kHidden - 1, kHidden)] = -kInf; }},
      {"HiddenNaNOnMaskedRow", {"hidden"}, kHead, [](Call&, B& b) { b.hidden[at(kMaskedRow, 1, kHidden)] = kNaN; }},
      {"HiddenBf16Inf",
       {"hidden"},
       kHead,
       [](Call& c, B& b) {
         c.use_bf16(b);
         b.hidden_bf16[at(4, 5, kHidden)] = 0xFF80;  // -inf
       }},
      {"WeightNaN", {"weight"}, kHead, [](Call&, B& b) { b.weight[at(kVocab - 1, 2, kHidden)] = kNaN; }},
      {"WeightNegInf", {"weight"}, kHead, [](Call&, B& b) { b.weight[at(17, 0, kHidden)] = -kInf; }},
      {"WeightBf16NaN",
       {"weight"},
       kHead,
       [](Call& c, B& b) {
         c.use_bf16(b);
         b.weight_bf16[at(33, 7, kHidden)] = 0x7FC1;
       }},
      {"BiasNaN", {"bias"}, kHead, [](Call&, B& b) { b.bias[11] = kNaN; }},
      {"BiasPosInf", {"bias"}, kHead, [](Call&, B& b) { b.bias[kVocab - 1] = kInf; }},
      {"BiasNegInfOnChosenToken", {"ids"}, kHead, [](Call&, B& b) { b.bias[b.ids[kLateRow]] = -kInf; }},
      // Every token banned: every row (masked ones too) has all logits -inf.
      {"BiasNegInfEverywhere",
       {"bias"},
       kHead,
       [](Call&, B& b) {
         for (std::int64_t v = 0; v < kVocab; ++v) b.bias[v] = -kInf;
       }},
      {"AdvantagesNaN", {"advantages"}, kAll, [](Call&, B& b) { b.advantages[1] = kNaN; }},
      {"OldLogpInf", {"old_logp"}, kAll, [](Call&, B& b) { b.old_logp[4] = -kInf; }},
      {"RefLogpNaN", {"ref_logp"}, kAll, [](Call&, B& b) { b.ref_logp[0] = kNaN; }},
      {"IsWeightInf", {"is_weight"}, kAll, [](Call&, B& b) { b.is_weight[kLateRow] = kInf; }},
      // Finite inputs whose gradient chain overflows f32 (issue: with tau = 0.05,
      // is_weight = 3e38 or advantages = 3e37 made every gradient NaN and
      // execute returned normally): refused up front naming the input.
      {"IsWeightHugeAtLowTemperature",
       {"is_weight"},
       kAll,
       [](Call& c, B& b) {
         c.config.temperature = 0.05F;
         b.is_weight[kLateRow] = 3e38F;
       }},
      {"AdvantagesHugeAtLowTemperature",
       {"advantages"},
       kAll,
       [](Call& c, B& b) {
         c.config.temperature = 0.05F;
         b.advantages[1] = 3e37F;
       }},
      // temperature_on_logp divides logp by tau: at tau = 2e-38 it overflows
      // (issue: the fused step threw 'ids' at block 1 after writing half of
      // logp and dhidden). Refused before any write; the LM head names the cause.
      {"TemperatureOnLogpTiny",
       {"config.temperature"},
       kHead,
       [](Call& c, B&) {
         c.config.temperature_on_logp = true;
         c.config.temperature = 2e-38F;
       }},
      {"TemperatureOnLogpTinyLogitsLevel",
       {"config.temperature", "ids"},
       kLogits,
       [](Call& c, B&) {
         c.config.temperature_on_logp = true;
         c.config.temperature = 2e-38F;
       }},
      // The k3 KL of TRL at ref - logp beyond f32's exp range (~88.7).
      {"RefLogpFarAboveLogp", {"ref_logp"}, kAll, [](Call&, B& b) { b.ref_logp[1] = 120.0F; }},
      {"KlClampZero", {"config.kl_clamp"}, kAll, [](Call& c, B&) { c.config.kl_clamp = 0.0F; }},
      // Finite operands whose product overflows f32 in the second token block:
      // refused up front from the magnitude bound, before any block runs.
      {"LogitsOverflowInLaterBlock",
       {"hidden", "weight", "logits"},
       kHead,
       [big](Call&, B& b) {
         for (std::int64_t k = 0; k < kHidden; ++k) b.hidden[at(kLateRow, k, kHidden)] = big;
         for (std::int64_t k = 0; k < kHidden; ++k) b.weight[at(b.ids[kLateRow], k, kHidden)] = big;
       }},

      // --- mask not 0/1 ---
      {"MaskHalf", {"mask"}, kAll, [](Call&, B& b) { b.mask[1] = 0.5F; }},
      {"MaskTwo", {"mask"}, kAll, [](Call&, B& b) { b.mask[kLateRow] = 2.0F; }},
      {"MaskNegativeOne", {"mask"}, kAll, [](Call&, B& b) { b.mask[0] = -1.0F; }},
      {"MaskNaN", {"mask"}, kAll, [](Call&, B& b) { b.mask[3] = kNaN; }},

      // --- configuration ---
      {"TemperatureZero", {"config.temperature"}, kAll, [](Call& c, B&) { c.config.temperature = 0.0F; }},
      {"TemperatureNegative", {"config.temperature"}, kAll, [](Call& c, B&) { c.config.temperature = -1.0F; }},
      {"TemperatureNaN", {"config.temperature"}, kAll, [](Call& c, B&) { c.config.temperature = kNaN; }},
      {"TemperatureInf", {"config.temperature"}, kAll, [](Call& c, B&) { c.config.temperature = kInf; }},
      {"EpsilonLowNegative", {"config.epsilon_low"}, kAll, [](Call& c, B&) { c.config.epsilon_low = -0.01F; }},
      {"EpsilonHighNegative", {"config.epsilon_high"}, kAll, [](Call& c, B&) { c.config.epsilon_high = -0.2F; }},
      {"EpsilonLowNaN", {"config.epsilon_low"}, kAll, [](Call& c, B&) { c.config.epsilon_low = kNaN; }},
      {"DeltaEqualToOnePlusEpsHigh",
       {"config.delta"},
       kAll,
       [](Call& c, B&) { c.config.delta = 1.0F + c.config.epsilon_high; }},
      {"DeltaBelowOne", {"config.delta"}, kAll, [](Call& c, B&) { c.config.delta = 0.5F; }},
      {"BetaNaN", {"config.beta"}, kAll, [](Call& c, B&) { c.config.beta = kNaN; }},
      {"RefLogpMissingWithBeta", {"ref_logp"}, kAll, [](Call& c, B&) { c.batch.ref_logp = {}; }},
      {"DapoNumItemsZero",
       {"config.num_items_in_batch"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::dapo;
         c.config.num_items_in_batch = 0.0;
       }},
      {"DapoNumItemsNegative",
       {"config.num_items_in_batch"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::dapo;
         c.config.num_items_in_batch = -5.0;
       }},
      {"CispoNumItemsZero",
       {"config.num_items_in_batch"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::cispo;
         c.config.num_items_in_batch = 0.0;
       }},
      {"DrGrpoMaxCompletionLengthZero",
       {"config.max_completion_length"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::dr_grpo;
         c.config.max_completion_length = 0;
       }},
      {"DrGrpoMaxCompletionLengthNegative",
       {"config.max_completion_length"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::dr_grpo;
         c.config.max_completion_length = -3;
       }},
      {"SapoTauZero",
       {"config.sapo_tau_pos", "config.sapo_tau_neg"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::sapo;
         c.config.sapo_tau_neg = 0.0F;
       }},
      // --- luspo, vespo, the off-policy mask, dual-clip, the KL estimator ---
      {"LuspoAtTokenLevel",
       {"config.importance_sampling_level"},
       kAll,
       [](Call& c, B&) { c.config.loss_type = LossType::luspo; }},
      {"VespoAtSequenceLevel",
       {"config.importance_sampling_level"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::vespo;
         c.config.num_items_in_batch = 6.0;
         c.config.importance_sampling_level = IsLevel::sequence;
       }},
      {"VespoWithoutNumItems",
       {"config.num_items_in_batch"},
       kAll,
       [](Call& c, B&) { c.config.loss_type = LossType::vespo; }},
      {"VespoLambdaZero",
       {"config.vespo_lambda_neg"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::vespo;
         c.config.num_items_in_batch = 6.0;
         c.config.vespo_lambda_neg = 0.0F;
       }},
      {"VespoKNaN",
       {"config.vespo_k_pos"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::vespo;
         c.config.num_items_in_batch = 6.0;
         c.config.vespo_k_pos = kNaN;
       }},
      {"VespoPerSequenceIsWeight",
       {"is_weight"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::vespo;
         c.config.num_items_in_batch = 6.0;
         c.batch.is_weight = c.batch.is_weight.first(kBatch);
       }},
      {"VespoNegativeIsWeight",
       {"is_weight"},
       kAll,
       [](Call& c, B& b) {
         c.config.loss_type = LossType::vespo;
         c.config.num_items_in_batch = 6.0;
         b.is_weight[kLateRow] = -0.5F;
       }},
      {"OffPolicyMaskNegative",
       {"config.off_policy_mask_threshold"},
       kAll,
       [](Call& c, B&) { c.config.off_policy_mask_threshold = -0.1F; }},
      {"OffPolicyMaskInf",
       {"config.off_policy_mask_threshold"},
       kAll,
       [](Call& c, B&) { c.config.off_policy_mask_threshold = kInf; }},
      {"ClipRatioCOne", {"config.clip_ratio_c"}, kAll, [](Call& c, B&) { c.config.clip_ratio_c = 1.0F; }},
      {"ClipRatioCNaN", {"config.clip_ratio_c"}, kAll, [](Call& c, B&) { c.config.clip_ratio_c = kNaN; }},
      {"ClipRatioCWithSapo",
       {"config.clip_ratio_c"},
       kAll,
       [](Call& c, B&) {
         c.config.loss_type = LossType::sapo;
         c.config.clip_ratio_c = 3.0F;
       }},
      {"EntropyCoefNaN", {"config.entropy_coef"}, kAll, [](Call& c, B&) { c.config.entropy_coef = kNaN; }},
      {"EntropyCoefInf", {"config.entropy_coef"}, kAll, [](Call& c, B&) { c.config.entropy_coef = -kInf; }},
      {"TopEntropyQuantileAboveOne",
       {"config.top_entropy_quantile"},
       kAll,
       [](Call& c, B&) { c.config.top_entropy_quantile = 1.5F; }},
      {"TopEntropyQuantileNegative",
       {"config.top_entropy_quantile"},
       kAll,
       [](Call& c, B&) { c.config.top_entropy_quantile = -0.1F; }},
      {"TopEntropyQuantileNaN",
       {"config.top_entropy_quantile"},
       kAll,
       [](Call& c, B&) { c.config.top_entropy_quantile = kNaN; }},
      {"LogitSoftcapZero", {"config.logit_softcap"}, kAll, [](Call& c, B&) { c.config.logit_softcap = 0.0F; }},
      {"LogitSoftcapNegative", {"config.logit_softcap"}, kAll, [](Call& c, B&) { c.config.logit_softcap = -30.0F; }},
      {"LogitSoftcapInf", {"config.logit_softcap"}, kAll, [](Call& c, B&) { c.config.logit_softcap = kInf; }},
      {"LogitScaleZero", {"config.logit_scale"}, kAll, [](Call& c, B&) { c.config.logit_scale = 0.0F; }},
      {"LogitScaleNegative", {"config.logit_scale"}, kAll, [](Call& c, B&) { c.config.logit_scale = -1.0F; }},
      {"LogitScaleNaN", {"config.logit_scale"}, kAll, [](Call& c, B&) { c.config.logit_scale = kNaN; }},
      // The unfused baselines do not implement these (ErrorKind::unsupported).
      {"BaselineEntropyBonus", {"config.entropy_coef"}, kBaselines, [](Call& c, B&) { c.config.entropy_coef = 0.01F; }},
      {"BaselineTopEntropyMask",
       {"config.top_entropy_quantile"},
       kBaselines,
       [](Call& c, B&) { c.config.top_entropy_quantile = 0.2F; }},
      {"BaselineSoftcap", {"config.logit_softcap"}, kBaselines, [](Call& c, B&) { c.config.logit_softcap = 30.0F; }},
      {"BaselineLogitScale", {"config.logit_scale"}, kBaselines, [](Call& c, B&) { c.config.logit_scale = 2.0F; }},
      {"KlEstimatorUnknown",
       {"config.kl_estimator"},
       kAll,
       [](Call& c, B&) { c.config.kl_estimator = static_cast<KlEstimator>(200); }},
      // k2 of a finite d beyond sqrt(2 FLT_MAX) overflows f32 like k3 does.
      {"RefLogpFarFromLogpK2",
       {"ref_logp"},
       kAll,
       [](Call& c, B& b) {
         c.config.kl_estimator = KlEstimator::k2;
         b.ref_logp[1] = 3e19F;
       }},

      // --- shapes and options at plan creation ---
      {"ShapeBatchZero", {"shape.batch"}, kAll, [](Call& c, B&) { c.logits_shape.batch = c.head_shape.batch = 0; }},
      {"ShapeSeqLenNegative",
       {"shape.seq_len"},
       kAll,
       [](Call& c, B&) { c.logits_shape.seq_len = c.head_shape.seq_len = -1; }},
      {"ShapeVocabZero", {"shape.vocab"}, kAll, [](Call& c, B&) { c.logits_shape.vocab = c.head_shape.vocab = 0; }},
      {"ShapeVocabBeyondInt32",
       {"shape.vocab"},
       kAll,
       [](Call& c, B&) { c.logits_shape.vocab = c.head_shape.vocab = std::int64_t{1} << 31; }},
      {"ShapeHiddenZero", {"shape.hidden"}, kHead, [](Call& c, B&) { c.head_shape.hidden = 0; }},
      // Absurd shapes (issue: batch * seq_len overflowing int64 died of SIGFPE
      // in the schedule; hidden >= 2^32 crashed inside oneDNN).
      {"ShapeRowsOverflowInt64",
       {"shape.seq_len"},
       kAll,
       [](Call& c, B&) {
         c.logits_shape.batch = c.head_shape.batch = std::int64_t{1} << 40;
         c.logits_shape.seq_len = c.head_shape.seq_len = std::int64_t{1} << 40;
       }},
      {"ShapeRowsTimesColumnsOverflowInt64",
       {"shape.vocab", "shape.hidden"},
       kAll,
       [](Call& c, B&) {
         c.logits_shape.batch = c.head_shape.batch = std::int64_t{1} << 30;
         c.logits_shape.seq_len = c.head_shape.seq_len = std::int64_t{1} << 30;
       }},
      {"ShapeHiddenBeyondOneDnn",
       {"shape.hidden"},
       kHead,
       [](Call& c, B&) { c.head_shape.hidden = std::int64_t{1} << 32; }},
      {"ShapeHiddenLdTooSmall", {"shape.hidden_ld"}, kHead, [](Call& c, B&) { c.head_shape.hidden_ld = kHidden - 1; }},
      {"MaxThreadsNegative",
       {"options.max_threads"},
       kAll,
       [](Call& c, B&) {
         c.exec_options.max_threads = c.head_options.max_threads = c.baseline_options.max_threads = -1;
       }},
      {"TokenBlockNegative", {"options.token_block"}, kFused, [](Call& c, B&) { c.head_options.token_block = -4; }},
      {"Bf16DweightFromF32Inputs",
       {"options.dweight_dtype"},
       kHead,
       [](Call& c, B&) {
         c.head_options.dweight_dtype = c.baseline_options.dweight_dtype = DType::bf16;
         c.dweight.dtype = DType::bf16;
       }},
      {"BaselineBf16LogitsFromF32Inputs",
       {"options.logits_dtype"},
       bit(Entry::lm_head_baseline),
       [](Call& c, B&) { c.baseline_options.logits_dtype = DType::bf16; }},
      {"WorkspaceBudgetTooSmall",
       {"options.workspace_budget"},
       kFused,
       [](Call& c, B&) {
         c.head_options.token_block = 0;
         c.head_options.workspace_budget = 1024;
       }},
      {"GradientsToForwardOnlyPlan",
       {"dhidden", "dweight", "dbias"},
       kHead,
       [](Call& c, B&) { c.head_options.forward_only = c.baseline_options.forward_only = true; }},
      {"DweightToFrozenWeightPlan",
       {"dweight"},
       kFused,
       [](Call& c, B&) {
         c.head_options.frozen_weight = true;
         c.dbias = {};
       }},
      {"DbiasToFrozenWeightPlan",
       {"dbias"},
       kFused,
       [](Call& c, B&) {
         c.head_options.frozen_weight = true;
         c.dweight = {};
       }},
      {"FrozenWeightWithAccumulate",
       {"options.accumulate_weight_grads"},
       kFused,
       [](Call& c, B&) {
         c.head_options.frozen_weight = c.head_options.accumulate_weight_grads = true;
         c.dweight = {};
         c.dbias = {};
       }},

      // --- aliasing outputs ---
      {"LogpInsideLogits",
       {"logp"},
       kLogits,
       [](Call& c, B& b) { c.tokens.logp = std::span(b.logits).subspan(10, kRows); }},
      {"EntropyOverlapsLogp",
       {"entropy", "logp"},
       kAll,
       [](Call& c, B& b) { c.tokens.entropy = std::span(b.logp).subspan(3, kRows); }},
      {"KlOverlapsLogp", {"kl", "logp"}, kAll, [](Call& c, B&) { c.tokens.kl = c.tokens.logp; }},
      {"KlOverlapsEntropy",
       {"kl", "entropy"},
       kAll,
       [](Call& c, B& b) { c.tokens.kl = std::span(b.entropy).subspan(1, kRows); }},
      {"DlogitsShiftedOverLogits", {"dlogits"}, kLogits, [](Call& c, B& b) { c.dlogits.data = b.logits.data() + 1; }},
      {"DlogitsOverLogitsWithOtherLd",
       {"dlogits"},
       kLogits,
       [](Call& c, B& b) {
         c.logits.ld = kVocab + 1;
         c.dlogits.data = b.logits.data();
       }},
      {"LogpInsideDlogits",
       {"logp", "dlogits"},
       kLogits,
       [](Call& c, B& b) { c.tokens.logp = std::span(b.dlogits).subspan(kVocab, kRows); }},
      {"DhiddenOverHidden", {"dhidden"}, kHead, [](Call& c, B& b) { c.dhidden.data = b.hidden.data(); }},
      {"DweightOverWeight", {"dweight"}, kHead, [](Call& c, B& b) { c.dweight.data = b.weight.data() + 3; }},
      {"DbiasOverBias", {"dbias"}, kHead, [](Call& c, B& b) { c.dbias = std::span(b.bias).first(kVocab); }},
      {"LogpInsideHidden",
       {"logp"},
       kHead,
       [](Call& c, B& b) { c.tokens.logp = std::span(b.hidden).subspan(5, kRows); }},
      {"KlInsideWeight", {"kl"}, kHead, [](Call& c, B& b) { c.tokens.kl = std::span(b.weight).subspan(40, kRows); }},
      {"DhiddenInsideDweight",
       {"dweight", "dhidden"},
       kHead,
       [](Call& c, B& b) { c.dhidden.data = b.dweight.data() + 5; }},
      {"LogpInsideDhidden",
       {"logp", "dhidden"},
       kHead,
       [](Call& c, B& b) { c.tokens.logp = std::span(b.dhidden).subspan(2, kRows); }},

      // --- workspace and strides ---
      {"WorkspaceShortByOne", {"workspace"}, kFused, [](Call& c, B&) { c.workspace = WorkspaceMode::short_by_one; }},
      {"WorkspaceMisaligned", {"workspace"}, kFused, [](Call& c, B&) { c.workspace = WorkspaceMode::misaligned; }},
      {"LogitsLdBelowCols", {"logits"}, kLogits, [](Call& c, B&) { c.logits.ld = kVocab - 1; }},
      {"DlogitsLdBelowCols", {"dlogits"}, kLogits, [](Call& c, B&) { c.dlogits.ld = kVocab - 1; }},
      {"HiddenLdOtherThanPlanned", {"hidden"}, kHead, [](Call& c, B&) { c.head.hidden.ld = kHidden + 1; }},
      {"WeightLdOtherThanPlanned", {"weight"}, kHead, [](Call& c, B&) { c.head.weight.ld = kHidden + 1; }},
      {"DweightLdOtherThanPlanned", {"dweight"}, kHead, [](Call& c, B&) { c.dweight.ld = kHidden + 1; }},
      {"DhiddenLdBelowCols", {"dhidden"}, kHead, [](Call& c, B&) { c.dhidden.ld = kHidden - 1; }},
      {"BaselineDhiddenNotDense",
       {"dhidden"},
       bit(Entry::lm_head_baseline),
       [](Call& c, B&) { c.dhidden.ld = kHidden + 1; }},
  };
}

struct RefusalCase {
  Entry entry;
  Refusal refusal;
};

// gtest prints the parameter of a failing test: name it instead of dumping bytes.
void PrintTo(const RefusalCase& c, std::ostream* os) { *os << entry_name(c.entry) << " " << c.refusal.name; }
void PrintTo(Entry e, std::ostream* os) { *os << entry_name(e); }

std::vector<RefusalCase> refusal_cases() {
  std::vector<RefusalCase> out;
  std::vector<Refusal> all = refusals();
  for (Refusal& r : output_over_input_refusals()) all.push_back(std::move(r));
  for (const Refusal& r : all) {
    for (Entry e : {Entry::logits_plan, Entry::logits_baseline, Entry::lm_head_plan, Entry::lm_head_baseline}) {
      if ((r.entries & bit(e)) != 0) out.push_back({e, r});
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " | ") + x;
  return s;
}

class RefusalTest : public ::testing::TestWithParam<RefusalCase> {};

TEST_P(RefusalTest, ThrowsNamingTheArgumentAndWritesNothing) {
  const RefusalCase& rc = GetParam();
  Buffers b;
  Call call(b);
  rc.refusal.apply(call, b);
  b.fill_outputs();
  const std::vector<std::byte> before = b.snapshot();
  try {
    execute(rc.entry, call, b);
    ADD_FAILURE() << entry_name(rc.entry) << ": " << rc.refusal.name << " was not refused";
  } catch (const Error& e) {
    const auto& want = rc.refusal.arguments;
    EXPECT_NE(std::find(want.begin(), want.end(), e.argument()), want.end())
        << "argument() is '" << e.argument() << "', expected " << join(want) << "; what(): " << e.what();
    EXPECT_NE(std::string(e.what()).find(e.argument()), std::string::npos) << "what() should name the argument";
    if (!rc.refusal.mentions.empty()) {
      EXPECT_NE(std::string(e.what()).find(rc.refusal.mentions), std::string::npos)
          << "what() should name " << rc.refusal.mentions << ": " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-grpo exception: " << e.what();
  }
  const std::vector<std::byte> after = b.snapshot();
  ASSERT_EQ(before.size(), after.size());
  std::size_t changed = 0;
  std::size_t first = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    if (before[i] != after[i] && changed++ == 0) first = i;
  }
  EXPECT_EQ(changed, 0U) << changed << " bytes changed, the first at snapshot offset " << first;
}

INSTANTIATE_TEST_SUITE_P(Errors, RefusalTest, ::testing::ValuesIn(refusal_cases()),
                         [](const ::testing::TestParamInfo<RefusalCase>& info) {
                           return std::string(entry_name(info.param.entry)) + "_" + info.param.refusal.name;
                         });

// --- inputs that must NOT be refused ---

class AcceptedTest : public ::testing::TestWithParam<Entry> {
 protected:
  // Runs a valid call and returns the bytes of every output.
  static std::vector<std::byte> run(Entry entry, const std::function<void(Call&, Buffers&)>& change = {}) {
    Buffers b;
    Call call(b);
    if (change) change(call, b);
    b.fill_outputs();
    execute(entry, call, b);
    EXPECT_TRUE(std::isfinite(b.metrics.loss));
    for (std::int64_t r = 0; r < kRows; ++r) EXPECT_TRUE(std::isfinite(b.logp[r])) << "row " << r;
    std::vector<std::byte> out;
    auto add = [&](const std::vector<float>& v, std::size_t n) {
      const auto* p = reinterpret_cast<const std::byte*>(v.data());
      out.insert(out.end(), p, p + n * sizeof(float));
    };
    add(b.logp, kRows);
    add(b.entropy, kRows);
    add(b.kl, kRows);
    if (entry == Entry::logits_plan || entry == Entry::logits_baseline) {
      add(b.dlogits, kRows * kVocab);
    } else {
      add(b.dhidden, kRows * kHidden);
      add(b.dweight, kVocab * kHidden);
      add(b.dbias, kVocab);
    }
    const auto* m = reinterpret_cast<const std::byte*>(&b.metrics);
    out.insert(out.end(), m, m + sizeof(Metrics));
    return out;
  }
};

// SPEC.md: masked rows' ids are never read as indices. An id outside [0, V)
// there is not refused, and the outputs are those of any valid id.
TEST_P(AcceptedTest, MaskedRowIdsAreNotRead) {
  const std::vector<std::byte> reference = run(GetParam());
  for (const std::int32_t id : {static_cast<std::int32_t>(kVocab), -1, std::numeric_limits<std::int32_t>::max(),
                                std::numeric_limits<std::int32_t>::min()}) {
    const std::vector<std::byte> got = run(GetParam(), [id](Call&, Buffers& b) { b.ids[kMaskedRow] = id; });
    EXPECT_EQ(got, reference) << "masked row id " << id << " changed the outputs";
  }
}

// Banned tokens (-inf logits or bias) are fine as long as no valid row chose one.
TEST_P(AcceptedTest, BannedTokensThatAreNotChosen) {
  run(GetParam(), [](Call&, Buffers& b) {
    for (std::int64_t r = 0; r < kRows; ++r) {
      if (r != kMaskedRow && b.ids[r] == 0) b.ids[r] = 1;
    }
    for (std::int64_t v = 0; v < kVocab; v += 3) {
      bool chosen = false;
      for (std::int64_t r = 0; r < kRows; ++r) chosen |= r != kMaskedRow && b.ids[r] == v;
      if (chosen) continue;
      b.bias[v] = -kInf;
      for (std::int64_t r = 0; r < kRows; ++r) b.logits[at(r, v, kVocab)] = -kInf;
    }
    // The masked row may choose a banned token: its id is never read. Token 0
    // is banned above and chosen by no valid row.
    b.ids[kMaskedRow] = 0;
  });
}

INSTANTIATE_TEST_SUITE_P(Errors, AcceptedTest,
                         ::testing::Values(Entry::logits_plan, Entry::logits_baseline, Entry::lm_head_plan,
                                           Entry::lm_head_baseline),
                         [](const ::testing::TestParamInfo<Entry>& info) { return entry_name(info.param); });

// logp may be the very array old_logp is ("this epoch's logp is the next
// one's old_logp"): every entry point reads a row's old_logp before it writes
// that row's logp, so the results equal those of separate arrays, bit for bit.
// Also at sequence level with sequences spanning token blocks (the schedule
// that computes every logp before any coefficient).
TEST(ErrorsInPlace, LogpOverOldLogpIsSupportedExactly) {
  for (const Entry entry : {Entry::logits_plan, Entry::logits_baseline, Entry::lm_head_plan, Entry::lm_head_baseline}) {
    for (const IsLevel level : {IsLevel::token, IsLevel::sequence}) {
      SCOPED_TRACE(std::string(entry_name(entry)) + (level == IsLevel::sequence ? " sequence" : " token"));
      Buffers separate_buffers;
      Call separate(separate_buffers);
      separate.config.importance_sampling_level = level;
      separate.head_options.token_block = 2;  // sequences of 3 span blocks of 2
      execute(entry, separate, separate_buffers);
      Buffers b;
      Call call(b);
      call.config.importance_sampling_level = level;
      call.head_options.token_block = 2;
      call.tokens.logp = std::span(b.old_logp).first(kRows);
      execute(entry, call, b);
      // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
      EXPECT_EQ(0, std::memcmp(b.old_logp.data(), separate_buffers.logp.data(), kRows * sizeof(float)));
      EXPECT_EQ(b.metrics.loss, separate_buffers.metrics.loss);
      for (std::vector<float> Buffers::*v : {&Buffers::dhidden, &Buffers::dweight, &Buffers::dlogits}) {
        // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
        EXPECT_EQ(0, std::memcmp((b.*v).data(), (separate_buffers.*v).data(), (b.*v).size() * sizeof(float)));
      }
    }
  }
}

// dlogits may be the very view of the logits (in place); that is not aliasing.
TEST(ErrorsInPlace, DlogitsSameViewAsLogitsIsAccepted) {
  for (const Entry entry : {Entry::logits_plan, Entry::logits_baseline}) {
    Buffers separate_buffers;
    Call separate(separate_buffers);
    execute(entry, separate, separate_buffers);
    Buffers b;
    Call call(b);
    call.dlogits = {b.logits.data(), DType::f32, kRows, kVocab, kVocab};
    execute(entry, call, b);
    // Bitwise identity is the point: compare bytes, NaN payloads and -0 included.
    // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
    EXPECT_EQ(0, std::memcmp(b.logits.data(), separate_buffers.dlogits.data(), kRows * kVocab * sizeof(float)))
        << entry_name(entry);
  }
}

}  // namespace
}  // namespace grpo
