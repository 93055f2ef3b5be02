"""Which of grpo's torch ops a piece of code runs (forward and backward), seen from the dispatcher."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpsSeen(TorchDispatchMode):
    """with OpsSeen() as seen: ...; seen.calls lists the grpo ops run, e.g. ["lm_head_loss"]."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "grpo":
            self.calls.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
