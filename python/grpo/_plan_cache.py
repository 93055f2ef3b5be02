"""A cache of built plans, generic over plan kinds, sharing one workspace.

Building a plan validates the configuration and creates its GEMM objects (a
few ms); a training loop calls the loss with the same shapes every step, so
plans are kept per key, up to `max_plans` of them and `max_plan_bytes` of what
their GEMMs hold (each plan's `plan_bytes`, bounded by the C++ side to a small
part of its workspace budget whatever T is). Every plan of a cache executes in the cache's one
Workspace, which grows to the largest plan's size and is then reused: steady
state allocates neither plans nor workspace.

The key is whatever determines a plan: for the LM-head loss, (B, T, H, V,
dtypes, layout, bias, row strides, loss config, options). `kind` keeps the
kinds of plan apart: "lm_head_loss", "lm_head_log_prob", and "scratch" (the
float32 buffers grpo.torch.fused_log_probs hands the C++ backward for
gradients nobody needs).
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

from grpo._core import Workspace


def _plan_bytes(plan: Any) -> int:
    """What a cached plan holds beside the workspace: its measured
    `plan_bytes` (its GEMM objects: C++ LmHeadSchedule::plan_bytes). Scratch
    tensors count 0: they are gradient-sized, like the outputs, and evicting
    them would reallocate them every step."""
    return int(getattr(plan, "plan_bytes", 0))


class PlanCache:
    """Plans by (kind, key), least recently used evicted beyond `max_plans`
    entries or `max_plan_bytes` held (the newest entry always stays)."""

    def __init__(self, max_plans: int = 64, max_plan_bytes: int = 256 << 20) -> None:
        if max_plans < 1:
            raise ValueError("max_plans must be >= 1")
        if max_plan_bytes < 0:
            raise ValueError("max_plan_bytes must be >= 0")
        self.max_plans = max_plans
        self.max_plan_bytes = max_plan_bytes
        self.plan_bytes = 0  # what the cached plans hold beside the workspace (_plan_bytes of each)
        self.workspace = Workspace()
        self.builds = 0  # plans built so far (a training loop's count stops growing)
        self._plans: OrderedDict[tuple[str, Hashable], Any] = OrderedDict()
        self._lock = threading.Lock()
        # How grpo's torch ops name this cache (their spec is a string).
        self.handle = next(_handles)
        _caches.add(self)
        _by_handle[self.handle] = self

    def get(self, kind: str, key: Hashable, build: Callable[[], Any]) -> Any:
        """The plan for (kind, key); `build()` makes it on a miss."""
        full_key = (kind, key)
        with self._lock:
            plan = self._plans.get(full_key)
            if plan is not None:
                self._plans.move_to_end(full_key)
                return plan
        # Built outside the lock (it releases the GIL); a concurrent miss on the
        # same key builds twice and keeps one, which is harmless.
        plan = build()
        with self._lock:
            if full_key not in self._plans:
                self._plans[full_key] = plan
                self.plan_bytes += _plan_bytes(plan)
            plan = self._plans[full_key]
            self._plans.move_to_end(full_key)
            self.builds += 1
            while len(self._plans) > self.max_plans:
                _, evicted = self._plans.popitem(last=False)
                self.plan_bytes -= _plan_bytes(evicted)
            # Past the byte bound: the least recently used entries that hold
            # bytes, never the newest (entries holding none free nothing).
            while self.plan_bytes > self.max_plan_bytes:
                holding = [k for k, v in self._plans.items() if k != full_key and _plan_bytes(v) > 0]
                if not holding:
                    break
                self.plan_bytes -= _plan_bytes(self._plans.pop(holding[0]))
        return plan

    def contains(self, kind: str, key: Hashable) -> bool:
        with self._lock:
            return (kind, key) in self._plans

    def discard(self, kind: str, key: Hashable) -> None:
        """Drops the plan for (kind, key) if cached."""
        with self._lock:
            plan = self._plans.pop((kind, key), None)
            if plan is not None:
                self.plan_bytes -= _plan_bytes(plan)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drops every plan; the workspace stays allocated."""
        with self._lock:
            self._plans.clear()
            self.plan_bytes = 0


# Every live cache, emptied at interpreter exit: nanobind reports the C++
# objects (plans, workspaces) still alive when its module is torn down as
# leaks, and the process-wide cache would otherwise hold its plans until then.
_caches: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()
_by_handle: "weakref.WeakValueDictionary[int, PlanCache]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


DEFAULT_HANDLE = 0  # the process-wide cache (default_plan_cache()), made on first use


def by_handle(handle: int) -> PlanCache:
    """The live cache with this handle (PlanCache.handle), or the process-wide one for DEFAULT_HANDLE."""
    if handle == DEFAULT_HANDLE:
        return default_plan_cache()
    cache = _by_handle.get(handle)
    if cache is None:
        raise ValueError(f"grpo: plan cache {handle} no longer exists (keep the PlanCache you pass as plan_cache "
                         "alive while its losses are in use)")
    return cache


@atexit.register
def _clear_at_exit() -> None:
    for cache in list(_caches):
        cache.clear()
        cache.workspace = None


_default: PlanCache | None = None
_default_lock = threading.Lock()


def default_plan_cache() -> PlanCache:
    """The process-wide cache the torch module uses unless given its own."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PlanCache()
        return _default
