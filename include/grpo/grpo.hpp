// grpo: the GRPO policy loss of a language model's output layer, fused.
//
// Usage (fused LM head, one training step):
//
//   #include <grpo/grpo.hpp>
//
//   grpo::LossConfig config;                       // loss_type grpo, eps 0.2, beta 0
//   grpo::LmHeadShape shape{.batch = B, .seq_len = T, .hidden = H, .vocab = V,
//                           .dtype = grpo::DType::bf16};
//   grpo::LmHeadLossPlan plan(shape, config);      // validate, choose schedule, create primitives
//   std::span<std::byte> workspace = ...;          // >= plan.workspace_size() bytes, 64-byte aligned
//   grpo::Metrics metrics;
//   plan.execute({.hidden = {h, grpo::DType::bf16, N, H, H},
//                 .weight = {w, grpo::DType::bf16, V, H, H},
//                 .batch = {.ids = ids, .mask = mask, .advantages = adv, .old_logp = old}},
//                {.tokens = {.logp = logp},
//                 .dhidden = {dh, grpo::DType::f32, N, H, H},
//                 .dweight = {dw, grpo::DType::f32, V, H, H},
//                 .metrics = &metrics},
//                workspace);
//
// Ownership: every view is borrowed for the duration of one call; plans own
// their oneDNN primitives and nothing else that outlives a call.
// Thread safety: plans are immutable after construction; execute() may run
// concurrently on distinct outputs and workspaces.
// Errors: invalid arguments throw grpo::Error (argument() names the argument)
// before any output is written.
//
// The unfused comparison paths (grpo/baseline.hpp) are not part of this
// header or of grpo::grpo: they are the grpo::baseline library.
#pragma once

#include "grpo/lm_head_loss.hpp"
#include "grpo/log_prob_head.hpp"
#include "grpo/logits_loss.hpp"
#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"
#include "grpo/version.hpp"
