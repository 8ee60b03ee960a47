"""The state one TensorRT-LLM engine's scheduler and rank 0's worker share in their process (one
per channel, ``trtllm-<pid>``): the request objects of asynchronous loads (to rewind a failed one
to its verdict's token), the ZeroMQ endpoints the leaders bound, kvtier's order of the engine's layer
groups, rank 0's leaders, and,
when every rank lives in this one process (tests without TensorRT-LLM), the in-process stand-in for
broadcasting the leader's load verdicts. Used by :mod:`kvtier.trtllm`.

Invariant: ``lock`` guards ``loads`` and the verdict log (``verdict_log``, ``verdict_base``,
``verdict_cursor``); the other fields are set once, before the ranks read them.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["Engine"]


class Engine:
    """The scheduler and rank 0's worker of one engine run in one process; they share the request
    objects of async loads (for recompute) and the ZeroMQ endpoints the leaders bound."""

    _all: "dict[str, Engine]" = {}
    _all_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loads: dict[str, Any] = {}  # rid -> the parked LlmRequest
        #: The leaders' ZeroMQ endpoints (one per layer group, kvtier's order) when ranks live in
        #: other processes.
        self.endpoints: Optional[list] = None
        #: kvtier's group index of each of TensorRT-LLM's layer groups (rank 0's KvCacheLayout).
        self.group_order: Optional[list] = None
        self.endpoint_set = threading.Event()
        #: Rank 0's leader (the source of the load verdicts every rank acts on), and with layer
        #: groups every group's leader, in kvtier's order.
        self.leader: Any = None
        self.leaders: list = []
        #: All ranks in this process (tests without TensorRT-LLM): rank 0's verdicts in order (a
        #: tuple of blobs, one per layer group, per round), and how many each rank has applied (the
        #: in-process stand-in for the broadcast).
        self.verdict_log: list = []
        self.verdict_base = 0
        self.verdict_cursor: dict[int, int] = {}

    @classmethod
    def of(cls, channel: str) -> "Engine":
        with cls._all_lock:
            return cls._all.setdefault(channel, cls())

    def verdicts_in_process(self, rank: int, mine: Optional[tuple], world_size: int) -> list:
        """All ranks in this process: rank 0's verdicts (``mine`` on rank 0) that ``rank`` has not
        applied yet, in order, once each; those every rank applied are dropped."""
        with self.lock:
            if mine:
                self.verdict_log.append(mine)
            start = self.verdict_cursor.get(rank, self.verdict_base)
            end = self.verdict_base + len(self.verdict_log)
            out = self.verdict_log[start - self.verdict_base:]
            self.verdict_cursor[rank] = end
            done = min(self.verdict_cursor.get(r, self.verdict_base) for r in range(world_size))
            if done > self.verdict_base:
                del self.verdict_log[: done - self.verdict_base]
                self.verdict_base = done
        return out
