"""The messages of :mod:`kvtier.vllm` that vLLM carries between its processes each step: the scheduler side's
metadata to the workers, the workers' metadata back, and the counter deltas vLLM aggregates (pickled by vLLM when
the scheduler and the workers live in different processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side sends every worker each step: kvtier's encoded step plan, the requests vLLM
    preempted (their device blocks are about to be reused), and loads the adapter itself must fail (requests whose
    load kvtier refused after vLLM had been promised it)."""

    plan: bytes = b""
    # Some request of this step loads synchronously: the loads must be complete before the forward pass.
    sync_loads: bool = False
    preempted: list[str] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until the workers report them saved (request_finished said True).
    # kvtier's workers report every finished request once its stores are done; vLLM must only hear of these.
    delayed_frees: list[str] = field(default_factory=list)
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    failed_loads_async: set[str] = field(default_factory=set)
    # Finished requests whose device blocks vLLM freed at once (request_finished said False) while kvtier's stores
    # still read them, and which this step hands to other requests: the workers wait for their jobs in
    # handle_preemptions, before vLLM writes any block of the step.
    fence: list[str] = field(default_factory=list)
    # The scheduler side lost track of which freed blocks stores still read (build_step or request_finished
    # failed): the workers wait for every request's jobs in handle_preemptions instead.
    fence_all: bool = False
    # Several KV cache groups (vLLM's hybrid KV cache manager): the plans of groups 1.. (``plan`` is group 0's), the
    # groups whose leader planned each asynchronous load (vLLM hears of the request once all of them reported) and
    # the groups whose stores each delayed free waits for.
    group_plans: list[bytes] = field(default_factory=list)
    recv_groups: dict[str, list[int]] = field(default_factory=dict)
    delayed_groups: dict[str, list[int]] = field(default_factory=dict)
    # The scheduler side's number of this step (1, 2, ...): a worker in the scheduler's own thread that started the
    # step's loads as the scheduler built it (``early_sync_loads``) knows the step by it when vLLM hands it over.
    step: int = 0


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers send back to the scheduler side each step: kvtier's encoded job reports, one blob per rank."""

    reports: list[bytes] = field(default_factory=list)
    # The KV cache group of each blob (missing: group 0).
    groups: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvtierWorkerMetadata):
            self.groups.extend([0] * (len(self.reports) - len(self.groups)))
            self.reports.extend(other.reports)
            self.groups.extend(other.groups)
            self.groups.extend([0] * (len(self.reports) - len(self.groups)))
        return self


class KvtierConnectorStats(KVConnectorStats):
    """Counter deltas since the last collection (flat ``name -> number``); aggregation sums them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())
