"""grpo over torch.distributed: the C++ step's scale-out (docs/scale_out.md) on a torch process group.

The C++ library spreads a step over processes through `grpo::Communicator`
(an allgather and an alltoall of bytes, in rank order; every sum across
ranks is the library's own, so results are bitwise repeatable).
`TorchCommunicator` implements those two calls with the collectives of a
`torch.distributed` process group, on whatever backend the group has (gloo
on CPU): no second transport. The entry points of grpo.torch take the groups
(`vocab_group=`, `data_group=`, `vocab_start=`) and do the rest:

- vocab_group: vocabulary parallelism (Megatron's vocab-parallel layout):
  each rank holds a contiguous shard of W's rows (and of the bias), the
  shards tile the vocabulary in rank order, every rank holds every hidden
  row and the same ids (global); dW / dbias stay in each rank's shard,
  dhidden is summed over the group.
- data_group: data parallelism: each rank holds its own sequences and all of
  W; normalizers, counts and metrics are global, dW / dbias are summed over
  the group: every rank's gradients are the single process's over the
  batches concatenated in rank order.

A shard's start is `vocab_start=` when given, else derived from the group
(one allgather of the shard sizes, once per group and shard size).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import torch

import grpo
from grpo import _core

__all__ = ["TorchCommunicator", "communicator", "vocab_shard"]


class TorchCommunicator:
    """grpo::Communicator's two collectives on a torch.distributed process group (None: the default group)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise grpo.Error("grpo: torch.distributed is not initialized (init_process_group first)")
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        if self._rank < 0:
            raise grpo.Error("grpo: this process is not a member of the group it was given")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allgather(self, send, recv) -> None:
        """send: this rank's bytes; recv: size() blocks of them, in rank order (send may lie inside recv)."""
        import torch.distributed as dist

        s, r = torch.from_numpy(send), torch.from_numpy(recv)
        if s.numel() and r.numel():
            lo, hi = r.data_ptr(), r.data_ptr() + r.numel()
            if lo <= s.data_ptr() < hi:
                s = s.clone()  # an in-place allgather: the backend gets separate buffers
        dist.all_gather_into_tensor(r, s, group=self.group)

    def alltoall(self, send, recv) -> None:
        """send: size() blocks, block q for rank q; recv: size() blocks, block q from rank q."""
        import torch.distributed as dist

        dist.all_to_all_single(torch.from_numpy(recv), torch.from_numpy(send), group=self.group)


_lock = threading.Lock()
_by_group: dict[Any, tuple[int, _core.Communicator]] = {}
_by_handle: dict[int, _core.Communicator] = {}
_handles = itertools.count(1)
_shards: dict[tuple[int, int], tuple[int, int]] = {}


def communicator(group: Any) -> tuple[int, _core.Communicator]:
    """(handle, the C++ communicator) of a process group, made once per group (grpo's ops name it by handle)."""
    with _lock:
        entry = _by_group.get(group)
        if entry is None:
            comm = _core.Communicator(TorchCommunicator(group))
            entry = _by_group[group] = (next(_handles), comm)
            _by_handle[entry[0]] = comm
        return entry


def by_handle(handle: Optional[int]) -> Optional[_core.Communicator]:
    return None if handle is None else _by_handle[handle]


def vocab_shard(handle: int, rows: int, start: Optional[int]) -> tuple[int, int]:
    """(this shard's first token, the global vocabulary) for a shard of `rows` tokens in the vocab group.

    start given: the global size is still the sum of the shards (one allgather
    of the sizes and starts, so a wrong start is refused by the C++ plan on
    every rank: the shards must tile the vocabulary in rank order)."""
    key = (handle, rows, -1 if start is None else int(start))
    with _lock:
        if key in _shards:
            return _shards[key]
    import torch.distributed as dist

    group = by_handle(handle).impl.group
    size = dist.get_world_size(group)
    mine = torch.tensor([rows], dtype=torch.int64)
    sizes = torch.empty(size, dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, mine, group=group)
    rank = dist.get_rank(group)
    derived = int(sizes[:rank].sum())
    result = (derived if start is None else int(start), int(sizes.sum()))
    with _lock:
        _shards[key] = result
    return result


# agree's record per rank: status, flag, then "argument\0message" (truncated).
_RECORD = 512


def agree(handles: list[int], error: Optional[BaseException], flag: bool = False) -> bool:
    """Every rank of the groups learns whether any rank refused its arguments: raises on every rank if one did.
    Returns whether any rank raised `flag` (e.g. "my plan is not cached": then every rank builds it, as the
    plan's construction is collective).

    One small allgather per group, in the order vocab, data, vocab (a refusal
    on any rank of a grid reaches every rank in three rounds), so no rank
    waits in a collective another rank never enters.
    """
    import torch.distributed as dist

    status = 0 if error is None else 1
    any_flag = bool(flag)
    message = "" if error is None else str(error)
    argument = getattr(error, "argument", "") if error is not None else ""
    for handle in handles:
        group = by_handle(handle).impl.group
        size = dist.get_world_size(group)
        record = torch.zeros(_RECORD, dtype=torch.uint8)
        payload = f"{argument}\0{message}".encode()[:_RECORD - 2]
        record[0] = status
        record[1] = int(any_flag)
        record[2:2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        records = torch.empty(size * _RECORD, dtype=torch.uint8)
        dist.all_gather_into_tensor(records, record, group=group)
        for q in range(size):
            block = records[q * _RECORD:(q + 1) * _RECORD]
            any_flag = any_flag or bool(int(block[1]))
            if int(block[0]) and status == 0:
                status = 1
                text = bytes(block[2:].tolist()).rstrip(b"\0").decode(errors="replace")
                arg, _, msg = text.partition("\0")
                argument, message = arg, f"rank {q} of the group refused: {msg.removeprefix('grpo: ')}"
    if error is not None:
        raise error
    if status:
        refusal = grpo.Error(f"grpo: {message}")
        refusal.argument = argument
        raise refusal
    return any_flag
