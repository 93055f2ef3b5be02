"""The Python side of the declared option fields (python/src/grpo_module.cpp's lists).

The C++ module exports the fields it binds, from one declared list per
struct: `grpo.LossConfig.fields` and `grpo.LmHeadOptions.fields` (plus
`LmHeadOptions.unbound_fields`, the two it deliberately leaves out). This
module says, for each of them, which keyword argument of
`grpo.torch.lm_head_grpo_loss` sets it and how its value is converted, or
(for the options grpo.torch derives from the tensors) where it comes from.
The three users of the list:

- `loss_config(kwargs)` builds the grpo.LossConfig from the keywords;
- `plan_key(config, options)` is every field's value, the plan-cache key;
- `caller_name(argument)` turns the library's "config.<field>" /
  "options.<field>" in a refusal into the keyword the caller spelled.

Import fails when the C++ list has a field this table does not cover (or the
other way round), so a field added in C++ cannot silently stay unreachable;
python/tests/test_fields.py also walks the C++ headers themselves.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from grpo import _core

LOSS_TYPES = {
    "grpo": _core.LossType.grpo,
    "bnpo": _core.LossType.bnpo,
    "dr_grpo": _core.LossType.dr_grpo,
    "dapo": _core.LossType.dapo,
    "cispo": _core.LossType.cispo,
    "sapo": _core.LossType.sapo,
    "luspo": _core.LossType.luspo,
    "vespo": _core.LossType.vespo,
}
IS_LEVELS = {"token": _core.IsLevel.token, "sequence": _core.IsLevel.sequence}
# verl's spelling ("k3+") and the enum's ("k3_plus") both name the straight-through estimators.
KL_ESTIMATORS = {
    "k3": _core.KlEstimator.k3,
    "k1": _core.KlEstimator.k1,
    "abs": _core.KlEstimator.abs,
    "k2": _core.KlEstimator.k2,
    "k1+": _core.KlEstimator.k1_plus,
    "abs+": _core.KlEstimator.abs_plus,
    "k3+": _core.KlEstimator.k3_plus,
    "k1_plus": _core.KlEstimator.k1_plus,
    "abs_plus": _core.KlEstimator.abs_plus,
    "k3_plus": _core.KlEstimator.k3_plus,
}


class Refusal(ValueError):
    """A keyword whose value cannot be converted; .argument is the keyword."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"grpo: invalid argument '{argument}': {message}")
        self.argument = argument


def _choice(table: dict) -> Callable[[str, Any], Any]:
    def convert(name, value):
        if value not in table:
            raise Refusal(name, f"unknown value {value!r} (one of {', '.join(map(repr, table))})")
        return table[value]
    return convert


def _float(name, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Refusal(name, f"must be a number, got {value!r}") from None


def _optional_float(name, value):
    return None if value is None else _float(name, value)


def _bool(name, value):
    return bool(value)


def _int_or_zero(name, value):
    if value is None:
        return 0
    if isinstance(value, float) and not value.is_integer():
        raise Refusal(name, f"must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise Refusal(name, f"must be an integer, got {value!r}") from None


# LossConfig field -> (keyword of lm_head_grpo_loss, its default, converter).
# num_items_in_batch is set by lm_head_grpo_loss itself (a unit normalizer in
# the plan and 1 / num_items_in_batch as the call's gradient scale, see there).
LOSS_CONFIG: dict[str, tuple[str, Any, Callable[[str, Any], Any]]] = {
    "loss_type": ("loss_type", "grpo", _choice(LOSS_TYPES)),
    "importance_sampling_level": ("importance_sampling_level", "token", _choice(IS_LEVELS)),
    "epsilon_low": ("epsilon_low", 0.2, _float),
    "epsilon_high": ("epsilon_high", 0.2, _float),
    "delta": ("delta", None, _optional_float),
    "beta": ("beta", 0.0, _float),
    "kl_bias_correction": ("kl_bias_correction", False, _bool),
    "kl_estimator": ("kl_estimator", "k3", _choice(KL_ESTIMATORS)),
    "kl_clamp": ("kl_clamp", None, _optional_float),
    "temperature": ("temperature", 1.0, _float),
    "temperature_on_logp": ("temperature_on_logp", False, _bool),
    "max_completion_length": ("max_completion_length", None, _int_or_zero),
    "num_items_in_batch": ("num_items_in_batch", None, None),
    "sapo_tau_pos": ("sapo_temperature_pos", 1.0, _float),
    "sapo_tau_neg": ("sapo_temperature_neg", 1.05, _float),
    "vespo_k_pos": ("vespo_k_pos", 2.0, _float),
    "vespo_lambda_pos": ("vespo_lambda_pos", 3.0, _float),
    "vespo_k_neg": ("vespo_k_neg", 3.0, _float),
    "vespo_lambda_neg": ("vespo_lambda_neg", 2.0, _float),
    "off_policy_mask_threshold": ("off_policy_mask_threshold", None, _optional_float),
    "clip_ratio_c": ("clip_ratio_c", None, _optional_float),
    "entropy_coef": ("entropy_coef", 0.0, _float),
    "top_entropy_quantile": ("top_entropy_quantile", 1.0, _float),
    "logit_softcap": ("logit_softcap", None, _optional_float),
    "logit_scale": ("logit_scale", 1.0, _float),
}
# The keywords that set a LossConfig field (num_items_in_batch is the call's own).
LOSS_KEYWORDS = tuple(kw for kw, _default, convert in LOSS_CONFIG.values() if convert is not None)


def loss_values(arguments: dict[str, Any]) -> dict[str, Any]:
    """{keyword: value} of the LossConfig keywords among a call's arguments (its locals())."""
    return {kw: arguments[kw] for kw in LOSS_KEYWORDS}

def _schedule_int(name, value):
    """A schedule option: None = the library's default (None returned), else an integer >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float)
                                                                      and value.is_integer()):
        raise Refusal(name, f"must be an integer, got {value!r}")
    if int(value) < 0:
        raise Refusal(name, f"must be >= 0, got {value}")
    return int(value)


GRAD_FILTER_AUTO = _core.GRAD_FILTER_AUTO


def grad_filter(name, value) -> float:
    """LmHeadOptions.grad_filter from the keyword (docs/filtered_backward.md).

    None / False / "off" / 0: off (0.0, every gradient exact); "auto":
    GRAD_FILTER_AUTO (eps(weight dtype) / 32), spelled "auto" or
    grpo.GRAD_FILTER_AUTO (the library's own value, as C++'s kGradFilterAuto);
    a number in (0, 1): that threshold.
    """
    if value is None or value is False or (isinstance(value, str) and value == "off"):
        return 0.0
    if isinstance(value, str):
        if value == "auto":
            return GRAD_FILTER_AUTO
        raise Refusal(name, f"unknown value {value!r} (None / 'off', 'auto', or a threshold in (0, 1))")
    if isinstance(value, bool):  # True: no threshold says which
        raise Refusal(name, f"must be None / 'off', 'auto' or a threshold in (0, 1), got {value!r}")
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        raise Refusal(name, f"must be None / 'off', 'auto' or a threshold in (0, 1), got {value!r}") from None
    if threshold == 0.0:
        return 0.0
    if threshold == GRAD_FILTER_AUTO:
        return GRAD_FILTER_AUTO
    if not 0.0 < threshold < 1.0:  # NaN fails this too
        raise Refusal(name, f"must be a threshold in (0, 1) (or None / 'off', 'auto'), got {value!r}")
    return threshold


# LmHeadOptions fields a keyword sets: field -> (keyword, converter). A
# converter returning None leaves the library's default.
OPTION_KEYWORDS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "token_block": ("token_block", _schedule_int),
    "vocab_tile": ("vocab_tile", _schedule_int),
    "workspace_budget": ("workspace_budget", _schedule_int),
    "max_threads": ("num_threads", _schedule_int),
    "grad_filter": ("grad_filter", grad_filter),
}
# LmHeadOptions fields grpo.torch derives from the tensors: field -> where from.
OPTION_DERIVED = {
    "forward_only": "no input requires grad, or grad mode is off",
    "dweight_dtype": "the weight's dtype (the dtype the weight gradient is written in)",
    "dhidden_dtype": "hidden's dtype",
    "accumulate_weight_grads": "never from grpo.torch: its ops return fresh gradients, which autograd adds into an "
                               "existing .grad",
    "frozen_weight": "neither weight nor bias requires grad",
}


def _check_coverage() -> None:
    bound = set(_core.LossConfig.fields)
    if bound != set(LOSS_CONFIG):
        raise ImportError(f"grpo: LossConfig fields bound in C++ {sorted(bound ^ set(LOSS_CONFIG))} "
                          "differ from grpo/_fields.py's table")
    options = set(_core.LmHeadOptions.fields)
    covered = set(OPTION_KEYWORDS) | set(OPTION_DERIVED)
    if options != covered:
        raise ImportError(f"grpo: LmHeadOptions fields {sorted(options ^ covered)} differ from grpo/_fields.py's "
                          "tables")


_check_coverage()

# The keyword of each library argument name a refusal can carry.
_CALLER = {f"config.{field}": kw for field, (kw, _d, _c) in LOSS_CONFIG.items()}
_CALLER.update({f"options.{field}": kw for field, (kw, _c) in OPTION_KEYWORDS.items()})


def loss_config(values: dict[str, Any]) -> _core.LossConfig:
    """A LossConfig from {keyword: value}; missing keywords take their defaults (num_items_in_batch excluded)."""
    config = _core.LossConfig()
    for field, (kw, default, convert) in LOSS_CONFIG.items():
        if convert is None:
            continue
        setattr(config, field, convert(kw, values.get(kw, default)))
    return config


def head_options(values: dict[str, Any], **derived) -> _core.LmHeadOptions:
    """LmHeadOptions from {keyword: value} (None = the library's default) and the derived fields."""
    options = _core.LmHeadOptions()
    for field, (kw, convert) in OPTION_KEYWORDS.items():
        value = convert(kw, values.get(kw))
        if value is None:
            continue
        try:
            setattr(options, field, value)
        except (TypeError, OverflowError):
            raise Refusal(kw, f"is out of range: {values.get(kw)}") from None
    for field, value in derived.items():
        if field not in OPTION_DERIVED:
            raise KeyError(field)
        setattr(options, field, value)
    return options


def _value_key(value):
    return value if not isinstance(value, float) or not math.isnan(value) else "nan"


def plan_key(config: Optional[_core.LossConfig], options: _core.LmHeadOptions) -> tuple:
    """Every bound field's value: what a plan depends on beyond the shape."""
    cfg = () if config is None else tuple(_value_key(getattr(config, f)) for f in _core.LossConfig.fields)
    return cfg + tuple(getattr(options, f) for f in _core.LmHeadOptions.fields)


def caller_name(argument: str, names: Optional[dict[str, str]] = None) -> Optional[str]:
    """The caller's keyword for a library argument name ("config.beta" -> "beta"), through `names` when given."""
    kw = _CALLER.get(argument)
    if kw is None:
        return None
    return (names or {}).get(kw, kw)
