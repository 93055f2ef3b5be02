"""grpo: the fused GRPO policy loss of an LM head on CPUs.

The C++ core (grpo._core) is usable without PyTorch: build a plan for a shape
and a loss configuration, then execute it on DLPack arrays (numpy, torch, ...)
viewed in place. `grpo.torch` holds the PyTorch ops (torch is imported
only there); `grpo.integrations.trl` patches TRL's GRPOTrainer. Plans:
LmHeadLossPlan (the fused GRPO loss) and LmHeadLogProbPlan (the generic
log-prob head: forward, and backward from upstream gradients).

    import grpo
    cache = grpo.PlanCache()
    plan = cache.get("lm_head_loss", key, lambda: grpo.LmHeadLossPlan(shape, config, options))
    metrics = plan.execute(cache.workspace, hidden=hidden, weight=weight, ids=ids, mask=mask,
                           advantages=advantages, logp=logp, dhidden=dhidden, dweight=dweight)

Refusals raise grpo.Error (a ValueError), grpo.ArgumentTypeError (a
TypeError) or grpo.UnsupportedError (a NotImplementedError); each has
.argument, the name of the refused argument. No output is written then.

LmHeadOptions.grad_filter = grpo.GRAD_FILTER_AUTO (or a threshold in (0, 1))
turns on the filtered backward (docs/filtered_backward.md); grpo.torch's
entry points spell it grad_filter="auto".
"""

from grpo._core import (
    GRAD_FILTER_AUTO,
    ArgumentTypeError,
    DType,
    Error,
    IsLevel,
    KlEstimator,
    LmHeadLogProbPlan,
    LmHeadLossPlan,
    LmHeadOptions,
    LmHeadShape,
    LogProbConfig,
    LossConfig,
    LossType,
    Metrics,
    StepStats,
    UnsupportedError,
    WeightLayout,
    Workspace,
    __version__,
    simd_path,
    version,
)
from grpo._plan_cache import PlanCache, default_plan_cache

# The name of the stats the log-prob head returned before they carried kernel_s.
LmHeadStepStats = StepStats

__all__ = [
    "GRAD_FILTER_AUTO",
    "ArgumentTypeError",
    "DType",
    "Error",
    "IsLevel",
    "KlEstimator",
    "LmHeadLogProbPlan",
    "LmHeadLossPlan",
    "LmHeadOptions",
    "LmHeadShape",
    "LmHeadStepStats",
    "LogProbConfig",
    "LossConfig",
    "LossType",
    "Metrics",
    "StepStats",
    "PlanCache",
    "UnsupportedError",
    "WeightLayout",
    "Workspace",
    "__version__",
    "default_plan_cache",
    "simd_path",
    "version",
]
