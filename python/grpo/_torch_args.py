"""Argument checks shared by grpo's PyTorch entry points (grpo.torch).

Every refusal names the argument as the caller spelled it and happens before
any output exists. The checks here look at shapes, dtypes, devices and
strides only: they read no tensor's values, so they trace under
torch.compile without a graph break. What needs the values (ids in range,
num_items_in_batch > 0, ...) is checked by the ops themselves (grpo/_ops.py),
where the C++ library validates every input before it writes an output.
"""

from __future__ import annotations

from typing import Optional

import torch

import grpo
from grpo import _core, _fields

FLOAT_DTYPES = {torch.float32: _core.DType.f32, torch.bfloat16: _core.DType.bf16, torch.float16: _core.DType.f16}
REFUSALS = (grpo.Error, grpo.ArgumentTypeError, grpo.UnsupportedError)


def refuse(argument: str, message: str, kind: type = grpo.Error) -> Exception:
    error = kind(f"grpo: invalid argument '{argument}': {message}")
    error.argument = argument
    return error


def refused_keyword(refusal: _fields.Refusal, names: Optional[dict[str, str]] = None) -> Exception:
    """A keyword conversion's refusal (grpo/_fields.py) as grpo.Error, naming the keyword as the caller spelled it."""
    argument = (names or {}).get(refusal.argument, refusal.argument)
    return refuse(argument, str(refusal).split(": ", 2)[-1])


# The library's argument names -> the entry point's own (the caller's names
# are applied on top: names[...]). Shape refusals name the tensor the size
# came from; the call's gradient scale is 1 / num_items_in_batch.
_CORE_NAMES = {"hidden": "hidden", "weight": "weight", "bias": "bias", "ids": "ids", "mask": "mask",
               "advantages": "advantages", "old_logp": "old_logp", "ref_logp": "ref_logp", "is_weight": "is_weight",
               "sequence_offsets": "sequence_offsets",
               "shape.batch": "hidden", "shape.seq_len": "hidden", "shape.hidden": "hidden",
               "shape.vocab": "weight", "grad_scale": "num_items_in_batch", "dhidden": "hidden",
               "dweight": "weight", "dlogp": "dlogp", "dentropy": "dentropy"}


def renamed(error: Exception, names: dict[str, str]) -> Exception:
    """The library's refusal, re-raised naming the caller's argument (as the caller spelled it)."""
    argument = getattr(error, "argument", "")
    caller = names.get(_CORE_NAMES.get(argument, ""), None)
    if caller is None:
        caller = _fields.caller_name(argument, names)
    if caller is None or caller == argument:
        return error
    error_type = type(error)
    out = error_type(f"{error} (argument '{caller}')")
    out.argument = caller
    return out


def check_cpu(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise refuse(name, f"must be a torch.Tensor, got {type(t).__name__}", grpo.ArgumentTypeError)
    if t.device.type != "cpu":
        raise refuse(name, f"must be a CPU tensor, got device '{t.device}'")
    if t.layout != torch.strided:
        raise refuse(name, f"must be a strided (dense) tensor, got {t.layout}")


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise refuse(name, f"must be float32, bfloat16 or float16, got {t.dtype}", grpo.ArgumentTypeError)


def check_shape(t: torch.Tensor, name: str, *shapes: tuple[int, ...]) -> None:
    if tuple(t.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise refuse(name, f"has shape {list(t.shape)}, expected {expected}")


def per_token(t: Optional[torch.Tensor], name: str, *shapes: tuple[int, ...], integer: bool = False
              ) -> Optional[torch.Tensor]:
    """A small per-token / per-sequence tensor, checked (device, shape, kind of dtype) and detached.

    The op converts it to a contiguous int32 / float32 one (grpo/_ops.py:
    small_inputs), where the values of int64 ids can be range-checked.
    """
    if t is None:
        return None
    check_cpu(t, name)
    check_shape(t, name, *shapes)
    if integer:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise refuse(name, f"must have an integer dtype, got {t.dtype}", grpo.ArgumentTypeError)
    elif t.dtype.is_complex:
        raise refuse(name, f"must be real, got {t.dtype}", grpo.ArgumentTypeError)
    return t.detach()


def as_rows(hidden: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """hidden [B, T, H] or [N, H] as an [N, H] view with unit inner stride.

    A view when the rows share one stride (contiguous, or a row-strided
    slice); a [B, T, H] slice whose sequences are not evenly spaced (e.g. the
    last T positions of longer sequences) is copied once.
    """
    if hidden.dim() not in (2, 3):
        raise refuse(name, f"must be [B, T, H] or [B*T, H], got {hidden.dim()} dimensions")
    if hidden.shape[-1] > 1 and hidden.stride(-1) != 1:
        raise refuse(name, f"must have unit inner stride, got {hidden.stride(-1)}")
    rows = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() == 3 else hidden
    if rows.shape[0] != n:
        raise refuse(name, f"has {rows.shape[0]} rows, expected B*T = {n}")
    return rows


def check_head(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], names: dict[str, str]) -> None:
    """weight [V, H] in hidden's dtype with unit inner stride; bias [V], contiguous."""
    h = rows.shape[1]
    if weight.dtype != rows.dtype:
        raise refuse(names["weight"], f"has dtype {weight.dtype} but {names['hidden']} has {rows.dtype}; "
                     "grpo needs both in one of float32, bfloat16, float16", grpo.ArgumentTypeError)
    if weight.dim() != 2 or weight.shape[1] != h:
        raise refuse(names["weight"], f"has shape {list(weight.shape)}, expected [V, {h}]")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise refuse(names["weight"], f"must have unit inner stride, got {weight.stride(1)}")
    v = weight.shape[0]
    if v == 0 or h == 0:
        raise refuse(names["weight"], f"is empty (shape {list(weight.shape)})")
    if bias is not None:
        check_cpu(bias, names["bias"])
        check_float(bias, names["bias"])
        check_shape(bias, names["bias"], (v,))
        if v > 1 and bias.stride(0) != 1:
            raise refuse(names["bias"], f"must be contiguous, got stride {bias.stride(0)}")


def needs_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))


def frozen_head(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True when neither the LM-head weight nor its bias wants a gradient (a frozen head, as in LoRA training):
    the plan is built with frozen_weight and the backward skips the dW GEMMs."""
    return not weight.requires_grad and (bias is None or not bias.requires_grad)
