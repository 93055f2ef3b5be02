// Collective plan creation and the per-call agreement of the fused LM head
// over several processes. See scale_out_plan.hpp.
#include "api/scale_out_plan.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "api/lm_head_validate.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/row_math.hpp"

namespace grpo::detail {
namespace {

// Each exchange record of execute() fits in this many bytes; the plan keeps
// one buffer of max(group sizes) records.
constexpr std::size_t kExchangeRecordBytes = 1024;

// What a rank was given at plan creation; the groups compare them.
struct PlanFacts {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;
  std::int64_t vocab_offset = 0;
  std::int64_t global_vocab = 0;
  std::int64_t tiles = 0;
  std::int64_t max_completion_length = 0;
  double num_items_in_batch = 0.0;
  double temperature = 0.0;
  double beta = 0.0;
  double entropy_coef = 0.0;
  double top_entropy_quantile = 0.0;
  double logit_softcap = 0.0;  // 0 = none
  double logit_scale = 0.0;
  std::int32_t dtype = 0;
  std::int32_t layout = 0;
  std::int32_t has_bias = 0;
  std::int32_t bias_dtype = 0;
  std::int32_t dweight_dtype = 0;
  std::int32_t forward_only = 0;
  std::int32_t frozen_weight = 0;
  std::int32_t global_num_items = 0;
  std::int32_t loss_type = 0;
  std::int32_t level = 0;
  std::int32_t temperature_on_logp = 0;
};

// What a rank was given at execute().
struct CallFacts {
  std::int64_t batch = 0;
  std::int64_t num_valid = 0;
  std::uint64_t batch_hash = 0;     // the per-token inputs (vocab group: equal on every rank)
  std::uint64_t upstream_hash = 0;  // the generic head's upstream gradients (vocab group: equal too)
  std::int32_t bias_allows_token = 1;
};

static_assert(sizeof(Record<CallFacts>) <= kExchangeRecordBytes);
static_assert(sizeof(Record<LossAccumulator::Sums>) <= kExchangeRecordBytes);

PlanFacts facts_of(const LmHeadShape& s, const LossConfig& c, const LmHeadOptions& o, std::int64_t tiles) {
  PlanFacts f;
  f.batch = s.batch;
  f.seq_len = s.seq_len;
  f.hidden = s.hidden;
  f.vocab = s.vocab;
  f.vocab_offset = s.vocab_offset;
  f.global_vocab = global_vocab_of(s);
  f.tiles = tiles;
  f.max_completion_length = c.max_completion_length;
  f.num_items_in_batch = c.num_items_in_batch;
  f.temperature = c.temperature;
  f.beta = c.beta;
  f.entropy_coef = c.entropy_coef;
  f.top_entropy_quantile = c.top_entropy_quantile;
  f.logit_softcap = c.logit_softcap.value_or(0.0F);
  f.logit_scale = c.logit_scale;
  f.dtype = static_cast<std::int32_t>(s.dtype);
  f.layout = static_cast<std::int32_t>(s.layout);
  f.has_bias = s.has_bias ? 1 : 0;
  f.bias_dtype = static_cast<std::int32_t>(s.bias_dtype);
  f.dweight_dtype = static_cast<std::int32_t>(o.dweight_dtype);
  f.forward_only = o.forward_only ? 1 : 0;
  f.frozen_weight = o.frozen_weight ? 1 : 0;
  f.global_num_items = o.scale_out.global_num_items ? 1 : 0;
  f.loss_type = static_cast<std::int32_t>(c.loss_type);
  f.level = static_cast<std::int32_t>(c.importance_sampling_level);
  f.temperature_on_logp = c.temperature_on_logp ? 1 : 0;
  return f;
}

bool same_loss(const PlanFacts& a, const PlanFacts& b) {
  return a.loss_type == b.loss_type && a.level == b.level && a.temperature == b.temperature &&
         a.temperature_on_logp == b.temperature_on_logp && a.beta == b.beta &&
         a.num_items_in_batch == b.num_items_in_batch && a.max_completion_length == b.max_completion_length &&
         a.entropy_coef == b.entropy_coef && a.top_entropy_quantile == b.top_entropy_quantile &&
         a.logit_softcap == b.logit_softcap && a.logit_scale == b.logit_scale;
}

std::string shard_text(std::int64_t begin, std::int64_t size) {
  std::string s = "[";  // appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "[" + std::string
  s += std::to_string(begin);
  s += ", ";
  s += std::to_string(begin + size);
  s += ")";
  return s;
}

// A field every rank of the group must share: the first rank that differs
// from rank 0 is named.
template <class Get>
Status check_same(const Group& g, const std::vector<Record<PlanFacts>>& all, Get&& get, const char* argument,
                  const char* why) {
  for (int q = 1; q < g.size; ++q) {
    if (!(get(all[q].facts) == get(all[0].facts))) {
      return refusal(g, q, argument, std::string("differs from rank 0's: ") + why);
    }
  }
  return {};
}

// The loss configuration (same_loss's fields), shared by every rank of a
// vocab group and of a data group alike.
Status check_same_loss(const Group& g, const std::vector<Record<PlanFacts>>& all) {
  for (int q = 1; q < g.size; ++q) {
    if (!same_loss(all[q].facts, all[0].facts)) {
      return refusal(g, q, "config",
                     "differs from rank 0's (loss_type, importance_sampling_level, temperature, temperature_on_logp, "
                     "beta, num_items_in_batch, max_completion_length, entropy_coef, top_entropy_quantile, "
                     "logit_softcap or logit_scale)");
    }
  }
  return {};
}

Status check_vocab_group(const Group& g, const std::vector<Record<PlanFacts>>& all) {
  constexpr const char* kRows = "under vocabulary parallelism every rank of the vocab group holds every row";
  constexpr const char* kHead = "the ranks of a vocab group hold shards of one LM head";
  const struct {
    std::int64_t (*get)(const PlanFacts&);
    const char* argument;
    const char* why;
  } fields[] = {
      {[](const PlanFacts& f) { return f.batch; }, "shape.batch", kRows},
      {[](const PlanFacts& f) { return f.seq_len; }, "shape.seq_len", kRows},
      {[](const PlanFacts& f) { return f.hidden; }, "shape.hidden", kHead},
      {[](const PlanFacts& f) { return f.global_vocab; }, "shape.global_vocab", kHead},
      {[](const PlanFacts& f) { return std::int64_t{f.dtype}; }, "shape.dtype", kHead},
      {[](const PlanFacts& f) { return std::int64_t{f.layout}; }, "shape.layout", kHead},
      {[](const PlanFacts& f) { return std::int64_t{f.has_bias}; }, "shape.has_bias", kHead},
      {[](const PlanFacts& f) { return std::int64_t{f.forward_only}; }, "options.forward_only", kHead},
      {[](const PlanFacts& f) { return std::int64_t{f.global_num_items}; }, "options.scale_out.global_num_items",
       kHead},
  };
  for (const auto& field : fields) {
    const Status s = check_same(g, all, field.get, field.argument, field.why);
    if (s.failed != 0) return s;
  }
  if (const Status s = check_same_loss(g, all); s.failed != 0) return s;
  // The shards tile [0, global_vocab) in rank order.
  std::int64_t next = 0;
  for (int q = 0; q < g.size; ++q) {
    const PlanFacts& f = all[q].facts;
    if (f.vocab_offset != next) {
      return refusal(g, q, "shape.vocab_offset",
                     "shard " + shard_text(f.vocab_offset, f.vocab) + " does not start where " +
                         (q == 0 ? std::string("the vocabulary does (0)")
                                 : "rank " + std::to_string(q - 1) + "'s ends (" + std::to_string(next) + ")") +
                         ": the shards must tile [0, global_vocab) in rank order");
    }
    next += f.vocab;
  }
  if (next != all[0].facts.global_vocab) {
    return refusal(g, g.size - 1, "shape.global_vocab",
                   "the shards end at " + std::to_string(next) + ", not at global_vocab " +
                       std::to_string(all[0].facts.global_vocab) + ": they must tile [0, global_vocab)");
  }
  return {};
}

Status check_data_group(const Group& g, const std::vector<Record<PlanFacts>>& all) {
  constexpr const char* kW = "the ranks of a data group hold the same W and loss";
  const struct {
    std::int64_t (*get)(const PlanFacts&);
    const char* argument;
  } fields[] = {
      {[](const PlanFacts& f) { return f.hidden; }, "shape.hidden"},
      {[](const PlanFacts& f) { return f.vocab; }, "shape.vocab"},
      {[](const PlanFacts& f) { return f.vocab_offset; }, "shape.vocab_offset"},
      {[](const PlanFacts& f) { return f.global_vocab; }, "shape.global_vocab"},
      {[](const PlanFacts& f) { return std::int64_t{f.dtype}; }, "shape.dtype"},
      {[](const PlanFacts& f) { return std::int64_t{f.layout}; }, "shape.layout"},
      {[](const PlanFacts& f) { return std::int64_t{f.has_bias}; }, "shape.has_bias"},
      {[](const PlanFacts& f) { return std::int64_t{f.bias_dtype}; }, "shape.bias_dtype"},
      {[](const PlanFacts& f) { return std::int64_t{f.dweight_dtype}; }, "options.dweight_dtype"},
      {[](const PlanFacts& f) { return std::int64_t{f.forward_only}; }, "options.forward_only"},
      {[](const PlanFacts& f) { return std::int64_t{f.frozen_weight}; }, "options.frozen_weight"},
      {[](const PlanFacts& f) { return std::int64_t{f.global_num_items}; }, "options.scale_out.global_num_items"},
  };
  for (const auto& field : fields) {
    const Status s = check_same(g, all, field.get, field.argument, kW);
    if (s.failed != 0) return s;
  }
  if (const Status s = check_same_loss(g, all); s.failed != 0) return s;
  return {};
}

// FNV-1a over the bytes of the per-token inputs: equal inputs, equal hashes.
struct Fnv {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  template <class T>
  void add_span(std::span<const T> s) {
    const std::uint64_t n = s.size();
    add(&n, sizeof(n));
    add(s.data(), s.size_bytes());
  }
};

CallFacts call_facts(const LmHeadPlanData& p, const LmHeadInputs& in, std::span<const std::span<const float>> shared) {
  const BatchInputs& b = in.batch;
  // The generic head's mask is optional: without one every row is valid.
  const auto valid = [&](std::size_t r) { return b.mask.empty() || b.mask[r] != 0.0F; };
  CallFacts f;
  f.batch = b.sequence_offsets.empty() ? p.shape.batch : static_cast<std::int64_t>(b.sequence_offsets.size()) - 1;
  for (std::size_t r = 0; r < b.ids.size(); ++r) f.num_valid += valid(r) ? 1 : 0;
  if (p.scale_out->vocab) {
    Fnv fnv;
    // ids of masked rows are never read: they may differ between ranks.
    for (std::size_t r = 0; r < b.ids.size(); ++r) {
      const std::int32_t id = valid(r) ? b.ids[r] : -1;
      fnv.add(&id, sizeof(id));
    }
    fnv.add_span(b.mask);
    fnv.add_span(b.advantages);
    fnv.add_span(b.old_logp);
    fnv.add_span(b.ref_logp);
    fnv.add_span(b.is_weight);
    fnv.add_span(b.sequence_offsets);
    f.batch_hash = fnv.h;
    // Masked rows' upstream gradients are ignored: they may differ too.
    Fnv up;
    for (const std::span<const float> values : shared) {
      const std::uint64_t n = values.size();
      up.add(&n, sizeof(n));
      for (std::size_t r = 0; r < values.size(); ++r) {
        const float x = valid(r) ? values[r] : 0.0F;
        up.add(&x, sizeof(x));
      }
    }
    f.upstream_hash = up.h;
    if (p.shape.has_bias) {
      // Validation refused NaN / +inf; a shard may ban all its tokens as long
      // as another shard allows one.
      f.bias_allows_token = 0;
      for (std::int64_t v = 0; v < in.bias.size && f.bias_allows_token == 0; ++v) {
        const float x = element_at(in.bias.data, in.bias.dtype, v);
        f.bias_allows_token = x != -std::numeric_limits<float>::infinity() ? 1 : 0;
      }
    }
  }
  return f;
}

}  // namespace

bool has_groups(const ScaleOut& s) { return s.vocab_group != nullptr || s.data_group != nullptr; }

std::int64_t global_vocab_of(const LmHeadShape& s) { return s.global_vocab != 0 ? s.global_vocab : s.vocab; }

LossConfig config_for_checks(const LossConfig& config, const ScaleOut& s) {
  LossConfig c = config;
  if (s.global_num_items && c.num_items_in_batch == 0.0) c.num_items_in_batch = 1.0;
  return c;
}

void check_scale_out_arguments(const LmHeadShape& s, const LossConfig& config, const LmHeadOptions& options) {
  const ScaleOut& so = options.scale_out;
  if (s.vocab_offset < 0) throw Error("shape.vocab_offset", "must be >= 0, got " + std::to_string(s.vocab_offset));
  if (s.global_vocab < 0) throw Error("shape.global_vocab", "must be >= 0, got " + std::to_string(s.global_vocab));
  if (s.global_vocab != 0 || s.vocab_offset != 0) {
    if (so.vocab_group == nullptr) {
      throw Error("shape.global_vocab",
                  "a vocabulary shard (vocab_offset / global_vocab set) needs options.scale_out.vocab_group");
    }
    if (s.global_vocab == 0) throw Error("shape.global_vocab", "must be set (> 0) with a vocab_offset");
    if (s.global_vocab > (std::int64_t{1} << 31) - 1) throw Error("shape.global_vocab", "exceeds the int32 id range");
    if (s.vocab_offset > s.global_vocab - s.vocab) {
      throw Error("shape.vocab_offset", "shard " + shard_text(s.vocab_offset, s.vocab) +
                                            " lies outside the global vocabulary [0, " +
                                            std::to_string(s.global_vocab) + ")");
    }
  }
  if (so.data_group != nullptr && options.accumulate_weight_grads) {
    throw Error("options.accumulate_weight_grads",
                "is not offered with a data group: the group sum would add every rank's earlier dweight again "
                "(accumulate with a plan without groups, then sum once)",
                ErrorKind::unsupported);
  }
  if (so.data_group != nullptr && config.top_entropy_quantile < 1.0F) {
    // TRL takes the quantile over one process's micro-batch; the data group's
    // step equals the single process over every rank's batch, whose quantile
    // would need every rank's entropies. Not offered yet.
    throw Error("config.top_entropy_quantile",
                "is not offered with a data group yet (its quantile would be per rank, not over the batch the "
                "group's step stands for)",
                ErrorKind::unsupported);
  }
  if (so.global_num_items) {
    if (config.loss_type != LossType::dapo && config.loss_type != LossType::cispo &&
        config.loss_type != LossType::vespo) {
      throw Error("options.scale_out.global_num_items",
                  "applies to dapo, cispo and vespo (the losses normalized by num_items_in_batch)");
    }
    if (config.num_items_in_batch != 0.0) {
      throw Error("config.num_items_in_batch",
                  "must be 0 with options.scale_out.global_num_items (the library counts the valid tokens)");
    }
  }
}

void refuse_scale_out(const LmHeadShape& shape, const ScaleOut* scale_out, const char* what) {
  if (shape.vocab_offset != 0 || shape.global_vocab != 0) {
    throw Error("shape.global_vocab", std::string(what) + " takes no vocabulary shard (it runs in one process)",
                ErrorKind::unsupported);
  }
  if (scale_out != nullptr && has_groups(*scale_out)) {
    throw Error("options.scale_out", std::string(what) + " runs in one process (no groups yet)",
                ErrorKind::unsupported);
  }
}

std::unique_ptr<LmHeadPlanData> build_plan(const LmHeadShape& shape, const LossConfig& config,
                                           const LmHeadOptions& options, const std::function<void()>& validate) {
  if (!has_groups(options.scale_out)) {
    validate();
    return build_lm_head_plan(resolve_lds(shape), config, options);
  }
  auto so = std::make_shared<ScaleOutPlan>();
  so->vocab = make_group(options.scale_out.vocab_group, "vocab", "options.scale_out.vocab_group");
  so->data = make_group(options.scale_out.data_group, "data", "options.scale_out.data_group");
  so->global_num_items = options.scale_out.global_num_items;

  // 1. What every rank was given, checked alike by every rank of each group.
  std::exception_ptr own;
  PlanFacts mine;
  try {
    validate();
    mine = facts_of(shape, config, options,
                    (shape.vocab + plan_vocab_tile(shape, options) - 1) / plan_vocab_tile(shape, options));
  } catch (...) {
    own = std::current_exception();
  }
  Status status = status_of(own);
  std::vector<Record<PlanFacts>> vocab_facts(static_cast<std::size_t>(so->vocab.size));
  if (so->vocab) {
    gather(so->vocab, status, mine, vocab_facts.data());
    if (status.failed == 0) status = check_vocab_group(so->vocab, vocab_facts);
  }
  if (so->data) {
    std::vector<Record<PlanFacts>> data_facts(static_cast<std::size_t>(so->data.size));
    gather(so->data, status, mine, data_facts.data());
    if (status.failed == 0) status = check_data_group(so->data, data_facts);
  }
  if (status.failed != 0) throw_agreed(status, own);

  // The shard table; the reduction buffers; execute()'s exchange records.
  if (so->vocab) {
    for (const auto& r : vocab_facts) {
      so->shard_begin.push_back(r.facts.vocab_offset);
      so->shard_tiles.push_back(r.facts.tiles);
    }
    so->shard_begin.push_back(mine.global_vocab);
  } else {
    so->shard_begin = {0, shape.vocab};
    so->shard_tiles = {mine.tiles};
  }
  so->tiles_max = *std::max_element(so->shard_tiles.begin(), so->shard_tiles.end());
  for (const std::int64_t t : so->shard_tiles) so->global_tiles += t;
  constexpr auto kSegment = static_cast<std::int64_t>(kReduceSegmentBytes / sizeof(float));
  const auto capacity = [&](const Group& g, std::int64_t count) {
    const std::int64_t n = std::min(count, kSegment);
    return (n + g.size - 1) / g.size * g.size;
  };
  if (!options.forward_only) {
    if (so->data && so->data.size > 1) {
      so->reduce_floats = std::max(so->reduce_floats, capacity(so->data, shape.vocab * shape.hidden));
    }
    if (so->vocab && so->vocab.size > 1) {  // a block's active dhidden rows: at most N
      so->reduce_floats = std::max(so->reduce_floats, capacity(so->vocab, shape.batch * shape.seq_len * shape.hidden));
    }
  }
  so->exchange.resize(static_cast<std::size_t>(std::max(so->vocab.size, so->data.size)) * kExchangeRecordBytes);

  // 2. The schedule: each rank's own, then the vocab group's smallest block
  // (the rank with the largest shard has it), adopted exactly by the others.
  const LmHeadShape resolved = resolve_lds(shape);
  std::unique_ptr<LmHeadPlanData> plan;
  BlockChoice block;
  const auto build = [&](const BlockChoice* forced) {
    try {
      plan = build_lm_head_plan(resolved, config, options, so, forced);
      block = {plan->schedule.token_block, plan->forward_rows};
    } catch (...) {
      own = std::current_exception();
    }
  };
  const auto exchange_blocks = [&](std::vector<Record<BlockChoice>>& blocks) {
    status = status_of(own);
    if (so->vocab) gather(so->vocab, status, block, blocks.data());
    if (so->data) {
      std::vector<Record<BlockChoice>> data_blocks(static_cast<std::size_t>(so->data.size));
      gather(so->data, status, block, data_blocks.data());
    }
    if (status.failed != 0) throw_agreed(status, own);
  };
  build(nullptr);
  std::vector<Record<BlockChoice>> blocks(static_cast<std::size_t>(so->vocab.size));
  exchange_blocks(blocks);
  if (so->vocab) {
    BlockChoice smallest = blocks[0].facts;
    for (const auto& r : blocks) {
      if (r.facts.token_block < smallest.token_block) smallest = r.facts;
    }
    if (block.token_block != smallest.token_block || block.forward_rows != smallest.forward_rows) build(&smallest);
  }
  exchange_blocks(blocks);  // every rank's rebuild, if any, went through
  for (int q = 1; q < so->vocab.size; ++q) {
    const BlockChoice& b = blocks[static_cast<std::size_t>(q)].facts;
    if (b.token_block != blocks[0].facts.token_block || b.forward_rows != blocks[0].facts.forward_rows) {
      // Every rank sees the same records: all of them throw this.
      throw Error("options.token_block", "the ranks of the vocab group could not agree on a token block (rank " +
                                             std::to_string(q) + ": " + std::to_string(b.token_block) +
                                             " rows, rank 0: " + std::to_string(blocks[0].facts.token_block) +
                                             "); set options.token_block alike on every rank");
    }
  }
  return plan;
}

GlobalCounts agree_on_call(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const std::exception_ptr& refused,
                           std::span<const std::span<const float>> shared) {
  if (!plan.scale_out) {
    if (refused) std::rethrow_exception(refused);
    return {};
  }
  const ScaleOutPlan& so = *plan.scale_out;
  const std::exception_ptr& own = refused;
  CallFacts mine;
  if (!own) mine = call_facts(plan, inputs, shared);  // the arguments passed every check
  Status status = status_of(own);
  GlobalCounts counts{mine.batch, mine.num_valid};
  const std::lock_guard<std::mutex> lock(so.exchange_mutex);
  auto* all = reinterpret_cast<Record<CallFacts>*>(so.exchange.data());
  if (so.vocab) {
    gather(so.vocab, status, mine, all);
    if (status.failed == 0) {
      for (int q = 1; q < so.vocab.size && status.failed == 0; ++q) {
        if (all[q].facts.batch_hash != all[0].facts.batch_hash) {
          // The generic log-prob head has no advantages (the loss requires them).
          const bool generic = inputs.batch.advantages.empty();
          status = refusal(
              so.vocab, q, generic ? "ids" : "batch",
              generic ? "its ids of valid rows or mask differ from rank 0's: every rank of a vocab group "
                        "holds the same rows"
                      : "its per-token inputs (ids of valid rows, mask, advantages, old_logp, ref_logp, "
                        "is_weight, sequence_offsets) differ from rank 0's: every rank of a vocab group holds the same "
                        "rows");
        } else if (all[q].facts.upstream_hash != all[0].facts.upstream_hash) {
          status = refusal(so.vocab, q, "dlogp",
                           "its upstream gradients (dlogp, dentropy) of valid rows differ from rank 0's: every rank of "
                           "a vocab group holds the same rows and runs the backward of the same loss");
        }
      }
      bool allowed = false;
      for (int q = 0; q < so.vocab.size; ++q) allowed = allowed || all[q].facts.bias_allows_token != 0;
      if (status.failed == 0 && !allowed) {
        status =
            refusal(so.vocab, 0, "bias", "is -inf for every token of every shard: every row's logits would be -inf");
      }
    }
  }
  if (so.data) {
    gather(so.data, status, mine, all);
    if (status.failed == 0) {
      counts = {};
      for (int q = 0; q < so.data.size; ++q) {
        counts.batch += all[q].facts.batch;
        counts.num_valid += all[q].facts.num_valid;
      }
    }
  }
  if (status.failed != 0) throw_agreed(status, own);
  return counts;
}

}  // namespace grpo::detail
