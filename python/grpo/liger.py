"""Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss`, computed by grpo's fused CPU kernel (grpo.torch.LmHeadGRPOLoss)."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Optional

import torch

import grpo
from grpo import _fields
from grpo._ops import METRIC_FIELDS
from grpo._torch_args import refuse as _refuse, refused_keyword as _refused_keyword
from grpo.functional import check_sequence_offsets, lm_head_grpo_loss, packed_sequences

__all__ = ["LmHeadGRPOLoss"]

_LOSS_TYPES = _fields.LOSS_TYPES
_IS_LEVELS = _fields.IS_LEVELS
_KL_MEAN = METRIC_FIELDS.index("kl_mean")
_CLIP_RATIO_REGION = METRIC_FIELDS.index("clip_ratio_region")

_LIGER_NAMES = {
    "hidden": "_input",
    "weight": "lin_weight",
    "bias": "bias",
    "ids": "selected_token_ids",
    "mask": "attention_mask",
    "advantages": "advantages",
    "old_logp": "old_per_token_logps",
    "ref_logp": "ref_per_token_logps",
    "is_weight": "vllm_is_ratio",
    "loss_type": "loss_type",
    "importance_sampling_level": "importance_sampling_level",
    "num_items_in_batch": "num_items_in_batch",
    "kl_bias_correction": "use_bias_correction_kl",
    "cu_seqlens": "cu_seqlens",
    "position_ids": "position_ids",
}


class _Packed:
    """A packed row's sequences ([1, N] tensors holding S sequences at offsets [S + 1]), for the drop-in's
    per-sequence metrics and vllm_is_ratio rule: each token's sequence, and per-sequence sums."""

    def __init__(self, offsets: torch.Tensor, count: int, n: int, name: str):
        # Read here: the library checks them too, but after the metrics would have used them.
        check_sequence_offsets(offsets, n, name)
        o = offsets.to(torch.int64)
        self.offsets, self.count = o, count
        self.index = torch.repeat_interleave(torch.arange(count), o.diff())  # [N]: each token's sequence

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N] -> [S]: the sum over each sequence's tokens."""
        return torch.zeros(self.count, dtype=x.dtype).index_add_(0, self.index, x.reshape(-1))

    def spread(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[S] -> [1, N]: each token takes its sequence's value."""
        return per_sequence.reshape(-1)[self.index].reshape(1, -1)


class LmHeadGRPOLoss(torch.nn.Module):
    """Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss`, computed by grpo's fused CPU kernel.

    Same constructor, same forward arguments, same return value:
    `(loss, (kl_mean,) + (clip_ratio,))`, the KL metric present when beta != 0.
    `compiled` and `chunk_size` (Liger's torch.compile and chunking knobs) are
    accepted and have no effect. Extra keyword-only arguments: num_threads
    (default torch.get_num_threads()), temperature_on_logp, workspace_budget,
    plan_cache, grad_filter, and vocab_group / data_group / vocab_start
    (torch.distributed groups, see lm_head_grpo_loss; with a data_group the
    dapo normalizer is the global token count, since each rank's gradients
    are the group's sum). The metrics are 0-dim
    float32 tensors computed without leaving the graph, so a module calling
    it compiles with torch.compile(fullgraph=True) (vespo with a per-token
    vllm_is_ratio excepted: its check reads values).

    Not supported (NotImplementedError naming the argument): computing
    reference log-probs from ref_input / ref_weight / ref_bias (pass
    ref_per_token_logps); delta <= 1 + epsilon_high for the clipped loss
    types; luspo with a KL term or a per-token vllm_is_ratio, and vespo with
    ratios != 1 on masked positions (where Liger 0.8.5 sums over masked
    positions: _check_luspo, _vespo_is_weight). Differences from Liger are
    listed in docs/python.md.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: Optional[float] = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        num_threads: Optional[int] = None,
        temperature_on_logp: bool = False,
        workspace_budget: Optional[int] = None,
        plan_cache: Optional[grpo.PlanCache] = None,
        grad_filter: Any = None,
        vocab_group: Any = None,
        data_group: Any = None,
        vocab_start: Optional[int] = None,
    ):
        super().__init__()
        # Liger's own constructor checks, with its messages.
        if sapo_temperature_pos <= 0:
            raise ValueError(f"sapo_temperature_pos must be positive, got {sapo_temperature_pos}")
        if sapo_temperature_neg <= 0:
            raise ValueError(f"sapo_temperature_neg must be positive, got {sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta must be positive, got {delta}")
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.num_threads = num_threads
        self.temperature_on_logp = temperature_on_logp
        self.workspace_budget = workspace_budget
        self.plan_cache = plan_cache
        self.grad_filter = grad_filter
        self.vocab_group, self.data_group, self.vocab_start = vocab_group, data_group, vocab_start
        self._check_settings()

    def _check_settings(self) -> None:
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type}")
        if self.importance_sampling_level not in _IS_LEVELS:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}. "
                             "Possible values are 'token' and 'sequence'.")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(f"Sequence-level importance sampling is not supported for loss_type='{self.loss_type}'. "
                             "Use importance_sampling_level='token' instead.")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise _refuse("max_completion_length", "must be provided for loss_type 'dr_grpo'")
        try:
            _fields.grad_filter("grad_filter", self.grad_filter)
        except _fields.Refusal as refusal:
            raise _refused_keyword(refusal) from None
        # Liger ignores delta for cispo and sapo; for the clipped types grpo
        # requires delta > 1 + epsilon_high (below it Liger's min(r, delta) is
        # below the clip range, a regime grpo does not compute).
        if self.delta is not None and self.loss_type not in ("cispo", "sapo") and \
                not self.delta > 1.0 + self.epsilon_high:
            raise _refuse("delta", f"delta = {self.delta} <= 1 + epsilon_high = {1.0 + self.epsilon_high} "
                          "is not supported by grpo", NotImplementedError)

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
        *,
        cu_seqlens=None,
        position_ids=None,
    ):
        """Liger's forward; cu_seqlens / position_ids (keyword-only, grpo's): packed sequences, _input [1, N, H]
        and per-sequence advantages / vllm_is_ratio [S] (see lm_head_grpo_loss)."""
        self._check_settings()
        # Liger reads ref_per_token_logps only when use_ref_model; otherwise the
        # reference is the policy itself (KL = 0, no KL gradient).
        if self.use_ref_model:
            if ref_per_token_logps is None:
                for name, value in (("ref_input", ref_input), ("ref_weight", ref_weight), ("ref_bias", ref_bias)):
                    if value is not None:
                        raise _refuse(name, "computing reference log-probs from the reference model's hidden "
                                      "states is not implemented by grpo; pass ref_per_token_logps",
                                      NotImplementedError)
                raise _refuse("ref_per_token_logps", "is required when use_ref_model is True "
                              "(Liger: ref_per_token_logps or ref_input must be provided)")
            if ref_input is not None:
                warnings.warn("Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.")
        ref = ref_per_token_logps if self.use_ref_model else None
        beta = float(self.beta) if ref is not None else 0.0
        if _input is None or _input.dim() != 3:
            raise _refuse("_input", "must be [B, T, H]")
        packed = None
        if cu_seqlens is not None or position_ids is not None:
            offsets, count, n = packed_sequences(cu_seqlens, position_ids, _input, _LIGER_NAMES)
            packed = functools.partial(_Packed, offsets, count, n,
                                       "cu_seqlens" if cu_seqlens is not None else "position_ids")
            cu_seqlens, position_ids = offsets, None  # position_ids read once

        is_weight = vllm_is_ratio
        if self.loss_type == "luspo":
            self._check_luspo(beta, vllm_is_ratio)
        if self.loss_type == "vespo" and vllm_is_ratio is not None:
            is_weight = self._vespo_is_weight(vllm_is_ratio, attention_mask, packed)
        if self.loss_type in ("dapo", "cispo", "vespo"):
            num_items = self._dapo_normalizer(attention_mask, num_items_in_batch, self.data_group)
        else:
            num_items = None
        delta = None if self.loss_type in ("cispo", "sapo") else self.delta

        result = lm_head_grpo_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages,
            bias=bias, old_logp=old_per_token_logps, ref_logp=ref, is_weight=is_weight,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=delta, beta=beta,
            kl_bias_correction=self.use_bias_correction_kl, temperature=self.temperature,
            temperature_on_logp=self.temperature_on_logp, max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items, sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg, vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos, vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg, num_threads=self.num_threads,
            workspace_budget=self.workspace_budget, plan_cache=self.plan_cache, grad_filter=self.grad_filter,
            vocab_group=self.vocab_group, data_group=self.data_group, vocab_start=self.vocab_start,
            cu_seqlens=cu_seqlens, _names=_LIGER_NAMES)

        metrics = []
        if self.beta != 0.0:
            # grpo's kl_mean is Liger's KL metric: the mean of the term added
            # (times r under use_bias_correction_kl); 0 without a reference.
            metrics.append(result.metrics_tensor[_KL_MEAN] if result.kl is not None else torch.zeros(()))
        metrics.append(self._liger_clip_metric(result, attention_mask, advantages, old_per_token_logps, packed))
        return result.loss, tuple(metrics)

    @staticmethod
    def _check_luspo(beta: float, vllm_is_ratio) -> None:
        """Liger's luspo is (1/(B T)) sum_{i,t} |o_i| l_t over every position, masked ones included, once its
        per-token loss is [B, T] (a KL term, a per-token vllm_is_ratio); grpo computes TRL's (1/B) sum_i sum_t
        m_t l_t, the same value only while the loss is one per sequence."""
        if beta != 0.0:
            raise _refuse("beta", "luspo with a KL term: Liger 0.8.5 then sums |o_i| l_t over masked positions "
                          "too (its per-token loss becomes [B, T]); grpo computes TRL's masked sum. Use "
                          "beta=0 or lm_head_grpo_loss", NotImplementedError)
        if vllm_is_ratio is not None and vllm_is_ratio.dim() == 2 and vllm_is_ratio.shape[1] != 1:
            raise _refuse("vllm_is_ratio", "luspo with a per-token [B, T] ratio: Liger 0.8.5 then sums over masked "
                          "positions too; pass one ratio per sequence ([B] or [B, 1])", NotImplementedError)

    @staticmethod
    def _vespo_is_weight(vllm_is_ratio, attention_mask, packed=None):
        """Liger's vespo adds sum_t clamp(log r_t) over every position of vllm_is_ratio (masked ones too) to
        log w; grpo adds it over valid tokens. [B] / [B, 1]: the ratio goes on each sequence's first valid
        token (1 elsewhere), which adds its log once, as Liger does. [B, T]: refused unless every masked
        position's ratio adds nothing (is 1). packed: [S] / [S, 1] per sequence, [1, N] per token."""
        if not isinstance(vllm_is_ratio, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
            return vllm_is_ratio
        mask = attention_mask.detach().to(torch.float32)
        ratio = vllm_is_ratio.detach().to(torch.float32)
        if ratio.dim() == 2 and ratio.shape == mask.shape and ratio.shape[1] != 1:
            lower = math.log(1e-8)
            masked_log = torch.clamp(torch.log(ratio), lower, 20.0) * (1.0 - mask)
            if bool((masked_log != 0).any()):
                raise _refuse("vllm_is_ratio", "vespo: masked positions carry ratios != 1, which Liger 0.8.5 adds "
                              "to log w and grpo does not", NotImplementedError)
            return vllm_is_ratio
        if packed is not None:
            if ratio.dim() in (1, 2) and ratio.shape[0] == ratio.numel() and ratio.numel() != mask.numel():
                seqs = packed()
                m = mask.reshape(1, -1)
                if ratio.numel() != seqs.count:
                    return vllm_is_ratio  # a wrong shape: lm_head_grpo_loss names it
                before = (m.cumsum(-1) - m).reshape(-1)[seqs.offsets[:-1]]  # valid tokens before each sequence
                first = (m.cumsum(-1) - seqs.spread(before) == 1) & (m != 0)
                return torch.where(first, seqs.spread(ratio), torch.ones_like(m))
            return vllm_is_ratio
        if ratio.dim() in (1, 2) and ratio.shape[0] == mask.shape[0] and ratio.numel() == mask.shape[0]:
            first = (mask.cumsum(-1) == 1) & (mask != 0)
            return torch.where(first, ratio.reshape(-1, 1), torch.ones_like(mask))
        return vllm_is_ratio  # a wrong shape: lm_head_grpo_loss names it

    @staticmethod
    def _dapo_normalizer(attention_mask, num_items_in_batch, data_group=None):
        """Liger's `_compute_dapo_normalizer`: the per-process share of the global token count, >= 1.

        A 0-dim tensor when the count is one (read by the op, so no value
        leaves a compiled graph), else a float.
        """
        world_size = 1
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and data_group is None:
            world_size = torch.distributed.get_world_size()
        # With grpo's data_group the step is the single process's over every rank's batch: the normalizer is the
        # global count itself (each rank's dW is the group's sum), not Liger's per-process share.
        if num_items_in_batch is not None:
            total = num_items_in_batch
        else:
            if not isinstance(attention_mask, torch.Tensor):
                raise _refuse("attention_mask", "must be a torch.Tensor", grpo.ArgumentTypeError)
            total = attention_mask.detach().to(torch.float64).sum()
            if distributed:
                torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=data_group)
        if isinstance(total, torch.Tensor):
            return torch.clamp(total.detach().to(torch.float64).reshape(()) / world_size, min=1.0)
        return max(float(total) / world_size, 1.0)

    def _ratio(self, result, attention_mask, old, seqs: Optional[_Packed] = None) -> torch.Tensor:
        """Liger's coef_1 = exp(log r): per token, or per sequence ([B, 1]) at sequence level (packed: each
        token its sequence's, [1, N])."""
        logp = result.per_token_logps.double()
        if old is None:
            return torch.ones_like(logp)
        log_ratio = logp - old.detach().double().reshape(logp.shape)
        if self.importance_sampling_level == "sequence":
            m = attention_mask.double().reshape(logp.shape)
            if seqs is not None:
                return torch.exp(seqs.spread(seqs.sums(log_ratio * m) / seqs.sums(m).clamp(min=1.0)))
            log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    def _liger_clip_metric(self, result, attention_mask, advantages, old, packed=None) -> torch.Tensor:
        # Token level: grpo's clip_ratio_region is Liger's metric (for cispo
        # too: r > epsilon_high with A > 0). sapo: Liger reports 0. Sequence
        # level: grpo reports the fraction of sequences (as TRL logs it),
        # Liger the fraction of tokens whose sequence is clipped.
        if self.loss_type in ("sapo", "vespo"):
            return torch.zeros(())
        if self.importance_sampling_level != "sequence":
            return result.metrics_tensor[_CLIP_RATIO_REGION]
        seqs = None if packed is None else packed()
        m = attention_mask.double().reshape(result.per_token_logps.shape)
        adv = advantages.detach().double()
        if seqs is not None:
            adv = seqs.spread(adv) if adv.numel() == seqs.count and adv.numel() != m.numel() else adv.reshape(m.shape)
        else:
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        r = self._ratio(result, attention_mask, old, seqs)
        clipped = ((r < 1.0 - self.epsilon_low) & (adv < 0)) | ((r > 1.0 + self.epsilon_high) & (adv > 0))
        clipped = clipped.expand_as(m)
        return ((clipped * m).sum() / m.sum().clamp(min=1.0)).to(torch.float32)

    def extra_repr(self) -> str:
        return (f"loss_type={self.loss_type!r}, beta={self.beta}, epsilon_low={self.epsilon_low}, "
                f"epsilon_high={self.epsilon_high}, importance_sampling_level={self.importance_sampling_level!r}, "
                f"temperature={self.temperature}")
