"""Type stubs for kvtier._native, the Rust extension (PyO3, abi3). See docs/arch/py.md.

Conventions: request ids are ``str`` (adapters convert engine ids with ``str(id)``); device block
ids are the engine's block indices (``int`` >= 0); CUDA streams are raw handles (``int``, 0 = the
legacy default stream) or ``None`` for engines without streams (CPU). Every error is a
``KvtierError`` subclass; nothing here aborts the process.
"""

from typing import Any, Mapping, Optional, Sequence, Union

__version__: str

class KvtierError(Exception): ...
class ConfigError(KvtierError): ...
class LayoutError(KvtierError, ValueError): ...
class PoolError(KvtierError): ...
class ConnectorError(KvtierError): ...
class TransferError(KvtierError): ...

def init_logging(filter: Optional[str] = None) -> bool:
    """Install a tracing subscriber on stderr (filter like "kvtier=debug", else $KVTIER_LOG, else "warn")."""

def match_groups(leaders: list["Leader"], request_id: str, tokens: list[int], num_computed_tokens: int,
                 identity: str | None = None, cacheable: bool = True, read: bool = True) -> int:
    """Match one request in every KV cache group (one Leader per group, in group order): the external tokens every
    group can supply (its whole prefix for full attention, the window of the hit's end for a sliding window),
    recorded by each group's leader."""
    ...

def metrics_table() -> list[dict[str, Any]]:
    """kvtier's counter table: per series its stats ``key``, Prometheus ``name``, ``help``, ``kind``
    ("counter"/"gauge") and ``labels`` (the keys of ``Leader.stats()``)."""

def configured_tiers(settings: Optional[dict] = None) -> dict:
    """Which tiers and load mode the settings configure, building nothing: keys "host", "disk",
    "remote" (configured at a non-zero size / with a URL), "async_loads" and "sync_host_loads"."""

class TensorDesc:
    """A plain description of an engine tensor; build it with ``kvtier.describe(obj)``, which sets
    ``owner`` to ``obj``: a Worker registered over the descriptor keeps the owner referenced. Without an
    owner the engine must keep the memory allocated for the Worker's life."""

    data_ptr: int
    shape: list[int]
    strides: list[int]  # bytes
    itemsize: int
    dtype: str
    device: str  # "cpu" | "cuda"
    device_index: int
    nbytes: int
    has_owner: bool
    def __init__(
        self,
        data_ptr: int,
        shape: Sequence[int],
        strides: Sequence[int],
        itemsize: int,
        dtype: str,
        device: str = "cpu",
        device_index: int | None = None,
        owner: object | None = None,
    ) -> None: ...
    @staticmethod
    def contiguous_strides(shape: Sequence[int], itemsize: int) -> list[int]: ...

class StepRecord:
    """One scheduled request in one engine step (the engine-neutral step contract). ``Leader.build_step``
    also accepts plain dicts with these keys."""

    request_id: str
    new_tokens: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_draft_tokens: int
    is_new: bool
    resumed_from_preemption: bool
    def __init__(
        self,
        request_id: str,
        new_tokens: Sequence[int],
        new_block_ids: Sequence[int],
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        *,
        num_draft_tokens: int = 0,
        is_new: bool = False,
        resumed_from_preemption: bool = False,
    ) -> None: ...

Settings = Mapping[str, Any]
"""Engine-supplied settings: the adapter's keys below plus any kvtier configuration key (the TOML
keys, dotted or nested, e.g. ``{"host.num_blocks": 64}``), layered over defaults < $KVTIER_CONFIG <
KVTIER_* / DYN_KVBM_* environment. Adapter keys:

- ``block_size`` (int, required): tokens per block (TensorRT-LLM ``tokens_per_block``).
- ``world_size`` (int, default 1, at most 65536), ``rank`` (int, Worker only, default 0). Whole
  numbers are refused (``KvtierError`` naming the key), never truncated, when out of range: e.g.
  ``block_size`` must fit 32 bits.
- ``async_loads`` (bool): loads complete through ``get_finished`` instead of before the forward
  pass. Unset: kvtier's ``connector.async_loads`` (TOML < ``KVTIER_ASYNC_LOADS`` < engine keys), else
  ``async_loads_default`` (bool, the adapter's default: vLLM True, TensorRT-LLM False), else False.
  The resolved value is ``Leader.loads_are_async``.
- ``salt`` (str): separates key spaces (model, dtype, LoRA, tenant); default from ``hashing.*``.
- ``bytes_per_block`` (int): one block summed over all ranks. Without it the Leader waits (up to
  ``connector.leader_worker_timeout_secs``) for an in-process Worker's layout and assumes equal shards.
- ``num_device_blocks`` (int): the engine's G1 block count (checked against block ids).
- ``link`` (Worker: "engine" (default) | "in_process" | "zmq"; Leader: "zmq" or unset; any other
  value is refused):
  "engine" buffers job reports for ``take_reports()`` -> ``Leader.apply_reports(blob)`` through the
  engine's own channel; "in_process" hands them straight to the Leader of this process with the
  same ``channel`` key; "zmq" connects to the Leader over ZeroMQ (every rank says hello, the Leader
  agrees on the ranks' layout; Worker construction waits for that handshake).
- ``zmq_endpoint`` (str): the Leader binds / Workers connect here; default
  ``connector.zmq_endpoint`` (``KVTIER_ZMQ_ENDPOINT``), else the Unix socket
  ``ipc://<private dir>/zmq-<channel>.sock`` in the user's 0700 kvtier directory
  (``$XDG_RUNTIME_DIR/kvtier/`` or ``<tmp>/kvtier-<uid>/``): no fixed TCP port; ranks on other
  hosts need a configured ``tcp://`` endpoint.
- ``channel`` (str, default "default"): pairs an in-process Leader with its Workers.
- ``layout`` (Worker): "trtllm_pool" | "vllm_cuda" (auto K/V-first or block-first) |
  "vllm_cuda_kv_first" | "vllm_cuda_block_first" | "vllm_mla" | "vllm_cpu"; default: "trtllm_pool"
  for one 4-D tensor, else "vllm_cpu" for CPU tensors, "vllm_cuda" for CUDA tensors.
- ``dtype`` (str, Worker): overrides the tensors' dtype name.
- ``finished_ids_are_saving`` (bool, Worker, default False): the engine passes ``get_finished`` only
  requests whose ``request_finished`` returned True (TensorRT-LLM), so they are reported saved as
  soon as their stores are done, without waiting for the next metadata's ``saving`` list.
"""

class Leader:
    """Scheduler side, one per engine: per-request slots, pools, matching, the books of every job."""

    def __init__(self, settings: Settings) -> None:
        """Raises ConfigError naming the setting on invalid input."""
    @property
    def loads_are_async(self) -> bool: ...
    @property
    def sync_host_loads(self) -> bool:
        """With asynchronous loads, whether a hit held wholly by the host tier loads in the step instead."""
    @property
    def block_size(self) -> int: ...
    def load_is_async(self, request_id: str) -> bool:
        """Whether the load of this request's last match is asynchronous (per request with ``sync_host_loads``)."""
    def get_num_new_matched_tokens(
        self,
        request_id: str,
        tokens: Sequence[int],
        num_computed_tokens: int,
        identity: Optional[str] = None,
        cacheable: bool = True,
        read: bool = True,
    ) -> int:
        """Tokens kvtier can load beyond the device prefix (block aligned, 0 if none); side-effect free
        on the pools. Whether the load is async: ``load_is_async(request_id)``.

        ``identity``: everything besides the token ids that changes the request's KV (LoRA adapter,
        tenant cache salt, multimodal inputs, prompt embeddings) as one canonical string; the request's
        blocks are hashed with the engine salt combined with it, so requests share blocks only with
        equal identities. ``cacheable=False``: kvtier cannot key this request; it is never matched
        nor stored (stats ``uncacheable_requests``). Both are fixed by the request's first match; a
        different value later raises ConnectorError. ``read=False``: the request must compute its whole
        prompt (vLLM's ``skip_reading_prefix_cache``): it is matched 0 tokens and still stored."""
    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: Optional[int] = None
    ) -> None:
        """The engine allocated ``block_ids`` (the request's whole table; known ids are recognised).
        ``num_external_tokens`` None = the count of the last match (TensorRT-LLM)."""
    def build_step(
        self,
        records: Sequence[Union[StepRecord, tuple, Mapping[str, Any]]],
        finished: Sequence[str] = (),
    ) -> bytes:
        """Consume one engine step; returns the metadata (picklable bytes) every worker's ``bind`` takes.
        A record is a StepRecord, a dict with its field names, or (cheapest) a tuple
        ``(request_id, new_tokens, new_block_ids, num_computed_tokens, num_scheduled_tokens
        [, num_draft_tokens, is_new, resumed_from_preemption])``.
        A record for a request the leader has never seen counts as new (TensorRT-LLM reports
        generation-only requests in cached_requests). Invalid input raises ConnectorError; the
        planned work stays queued for the next call."""
    def build_step_with_fences(
        self,
        records: Sequence[Union[StepRecord, tuple, Mapping[str, Any]]],
        finished: Sequence[str] = (),
    ) -> tuple[bytes, list[str]]:
        """``build_step``, plus the step's reuse fences: requests finished with
        ``request_finished(..., fence_reuse=True)`` whose device blocks this step hands out while
        their stores may still read them. Every worker must ``wait_for_requests`` them before
        anything of the step writes device blocks (``bind`` also waits for them)."""
    def request_finished(self, request_id: str, fence_reuse: bool = False) -> bool:
        """True while any copy of the request is unconfirmed by some rank: keep its blocks until
        the workers report it saved. ``fence_reuse=True`` (engines that report every block they
        hand out and call the workers before writing one, like vLLM): False while only stores
        read them; the steps that reuse one carry the request as a fence
        (``build_step_with_fences``)."""
    def request_preempted(self, request_id: str) -> None: ...
    def request_preempted_if_running(self, request_id: str) -> bool:
        """The engine named the request among a step's preempted ones: preempted if it ran since it was last
        matched (unknown or already preempted: left alone). Returns whether it was preempted now."""
    def allocate(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> tuple[list[int], Optional[str]]:
        """``update_state_after_alloc`` that never raises for a refusal: ``(failed_block_ids, refusal)``, the
        promised device blocks the engine must treat as failed loads and the refusal as text (both empty when
        accepted)."""
    def cancel_load(self, request_id: str, start: int, end: int) -> None:
        """The engine will not consume tokens ``[start, end)`` of the request's last offer (TensorRT-LLM's
        KVCacheManagerV2); applied by the next ``allocate_offer``."""
    def allocate_offer(self, request_id: str, block_ids: Sequence[int]) -> Optional[int]:
        """``update_state_after_alloc`` with the last offer less the engine's cut (a head cut is matched again
        from its end): the first token of the request's asynchronous load, or None when none was offered.
        ``block_ids`` may carry ``-1`` (no page) as ``enable_unpaged_exclusion`` says."""
    def take_hit_sources(self, request_id: str, num_external_tokens: int) -> list[tuple[str, int]]:
        """The tokens of the last allocation per source tier (``"host"``, ``"disk"``, ``"remote"``, in that order),
        clipped to ``num_external_tokens``; asked once per allocation."""
    def clear_tiers(self) -> int:
        """Forget every host and disk block (the engine's prefix-cache reset); returns how many."""
    def apply_reports(self, blob: bytes) -> None:
        """Job reports from ``Worker.take_reports()`` (link "engine")."""
    def enable_load_verdicts(self) -> None:
        """Issue one verdict per asynchronous load once every rank reported it (TensorRT-LLM, any TP size)."""
    def load_remote_hits_async(self) -> None:
        """Hits touching the remote tier load asynchronously even when it is the node tier (an engine that cannot
        recompute a failed synchronous load: TensorRT-LLM)."""
    def enable_match_holds(self) -> None:
        """A match holds the host and disk blocks it offers until the request's allocation, a new match, its
        preemption or finish, or 1,024 engine steps (TensorRT-LLM's KVCacheManagerV2 allocates passes later, and the
        stores planned in between would evict what was offered)."""
    def held_blocks(self) -> int:
        """Blocks held by matches not yet allocated (0 with holds off)."""
    def enable_unpaged_exclusion(self) -> None:
        """Page ids (``allocate_offer``, step records) may carry ``-1`` (TensorRT-LLM's ``BAD_PAGE_INDEX``):
        trailing ones are pages not allocated yet; a window group's leader takes the others as holes; any other
        leader stops caching the request (its records are dropped until it finishes; logged, rate-limited)."""
    def is_excluded(self, request_id: str) -> bool:
        """Whether the request stopped being cached because its page ids had a ``-1``."""
    def take_load_verdicts(self) -> bytes:
        """The verdicts issued since the last call, for ``Worker.apply_load_verdicts`` on every rank (empty: none)."""
    def take_events(self) -> list[dict[str, Any]]:
        """Tier changes since the last call: ``{"kind": "stored"|"removed", "tier": "host"|"disk"|"remote",
        "hashes": [int]}`` (128-bit sequence hashes)."""
    def discard_events(self) -> int:
        """Drop the tier changes since the last call without building them (the engine publishes no KV
        events); returns how many."""
    def stats(self) -> dict[str, int]:
        """Counters: steps, match_queries, matched_tokens, offload_blocks, offload_confirmed,
        offload_failed, offload_deduplicated, offload_dropped, onboard_{host,disk,remote}_blocks,
        onboard_failed, spill_disk_blocks, spill_disk_failed, remote_put_blocks, remote_put_failed,
        host_capacity, host_free, host_registered, disk_capacity, disk_free, disk_registered,
        active_requests, jobs_in_flight."""
    def shutdown(self) -> None: ...

class Worker:
    """Worker side, one per rank: owns the tier memory (host, disk), executes the leader's jobs on
    kvtier threads. Constructing it registers the engine's KV tensors."""

    def __init__(
        self,
        settings: Settings,
        tensors: Union[TensorDesc, Sequence[TensorDesc], Sequence[tuple[str, TensorDesc]]],
    ) -> None:
        """LayoutError (a ValueError) naming the tensor and the mismatch; TransferError if host
        memory or disk files cannot be set up."""
    @property
    def rank(self) -> int: ...
    @property
    def bytes_per_block(self) -> int: ...
    @property
    def num_device_blocks(self) -> int: ...
    def layered_group_loads(self) -> bool: ...
    def early_sync_loads(self) -> bool: ...
    def bind(self, metadata: bytes) -> None:
        """Take one step's metadata (from ``Leader.build_step``); background copies start now."""
    def start_load(self, stream: Optional[int] = None) -> None: ...
    def wait_for_layer_load(self, layer: int, stream: Optional[int] = None) -> None:
        """Returns when the step's sync loads are done; raises TransferError if any of them failed
        (the forward pass would read wrong KV)."""
    def forward_done(self, stream: Optional[int] = None) -> None:
        """End of the forward pass on ``stream``: this step's stores may now read device blocks."""
    def get_finished(
        self, finished: Sequence[str], started_loading: Optional[Sequence[str]] = None
    ) -> tuple[list[str], list[str], list[str]]:
        """(saved, loaded, load_failed) request ids. ``started_loading`` (TensorRT-LLM): only ids
        passed in here (accumulated) are reported loaded; None reports every finished load."""
    def enable_load_verdicts(self) -> None:
        """Report asynchronous loads only by the leader's verdicts (``get_finished_by_verdict``)."""
    def report_sync_load_errors_only(self) -> None:
        """``take_load_errors`` hands out only the blocks of failed loads inside the step (one KV cache group of
        several: vLLM takes an asynchronous failure by request)."""
    def apply_load_verdicts(self, blob: bytes) -> None:
        """Verdicts from ``Leader.take_load_verdicts()`` (every rank gets the same bytes)."""
    def get_finished_by_verdict(
        self, finished: Sequence[str], started_loading: Optional[Sequence[str]] = None,
        rewindable: Optional[set[str]] = None,
    ) -> tuple[list[str], list[str], list[tuple[str, int]]]:
        """(saved, loaded, [(request, recompute_from)]): a load is reported once its verdict arrived,
        loaded if every rank loaded every block, else with the token every rank recomputes from. With
        ``rewindable`` (the requests whose engine object the adapter can rewind), a failed load of any other
        request is withheld (never reported, logged) and every failed load is counted (``load_recovery``)."""
    def load_recovery(self) -> tuple[int, int]:
        """``(recomputed, unrecoverable)``: failed asynchronous loads handed back with a recompute token, and
        those withheld because their request could not be rewound."""
    def take_load_errors(self) -> list[int]:
        """Device block ids whose load failed since the last call (never reported as loaded)."""
    def take_reports(self) -> bytes:
        """Job reports for ``Leader.apply_reports`` (link "engine"); empty when there are none."""
    def wait_idle(self) -> None:
        """Block until every job handed out has finished."""
    def wait_for_requests(self, request_ids: list[str]) -> None:
        """Wait for the submitted jobs of these requests only (their device blocks are about to be reused)."""
    def wait_for_all_requests(self) -> None:
        """Wait for every request's submitted jobs (the engine may reuse any device block); never gives up while
        the executors run."""
    def stats(self) -> dict[str, int]: ...
    def shutdown(self, timeout: float = 60.0) -> bool:
        """Wait for in-flight jobs and stop the executor threads, ``timeout`` seconds at most in all; False
        when time ran out (threads still running end on their own). A negative or NaN timeout is a
        ``ConnectorError``."""

class Completions:
    """The books of an engine worker process over its workers (one per KV cache group): which requests the
    engine hears of as saved and as received, which device blocks failed to load (kvtier::connector::Completions).
    Pure bookkeeping: no worker, no I/O."""

    def __init__(self) -> None: ...
    def set_groups(self, n: int) -> None:
        """The engine runs ``n`` KV cache groups (one worker each; 1 until told)."""
    def begin_step(self, delayed_frees: Sequence[str], delayed_groups: dict[str, list[int]],
                   recv_groups: dict[str, list[int]], failed_loads: dict[str, list[int]],
                   failed_async: set[str]) -> None:
        """One step's metadata: delayed frees (reported once saved; with several groups once every group named
        in ``delayed_groups`` saved them), the groups each asynchronous load waits for, and loads the scheduler
        side failed (their blocks; an asynchronous one's request is reported received once)."""
    def finish(self, reports: Sequence[Optional[tuple[Sequence[str], Sequence[str], Sequence[str]]]]
               ) -> tuple[Optional[set[str]], Optional[set[str]], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)``, the first two None when empty, from each
        group's ``Worker.get_finished`` answer (None where that worker could not answer); ``failed_recving`` (several
        groups only) names the loads of ``finished_recving`` that failed: vLLM recomputes them whole."""
    def take_load_errors(self, from_workers: Sequence[int]) -> set[int]:
        """Device blocks whose loads failed since the last call: the scheduler side's and ``from_workers``; none with
        several groups (block ids are per group: their requests are in ``failed_recving``)."""

class Promises:
    """The books of an engine's scheduler side over its leaders (one per KV cache group): which asynchronous
    loads the engine is owed one report of, and what the next step's metadata carries to the workers
    (kvtier::connector::Promises). Pure bookkeeping: no leader, no I/O."""

    def __init__(self) -> None: ...
    def allocated(self, request_id: str, external_tokens: int, is_async: bool, groups: int, complete: bool,
                  loading: Sequence[int], failed: Sequence[int],
                  hit_sources: Optional[list[tuple[str, int]]] = None) -> None:
        """The engine allocated the request's blocks: an asynchronous load is owed a report once a built step
        carries it; ``loading`` the groups that load it (several groups), ``failed`` the promised device blocks
        it must recompute, ``hit_sources`` group 0's split (several groups); ``complete`` False: a leader failed
        before every group was asked, only the promise counts."""
    def take_hit_sources(self, request_id: str) -> Optional[list[tuple[str, int]]]:
        """Group 0's hit sources kept at allocation, once; None: ask the leader."""
    def take_step(self, built: bool) -> tuple[bool, list[str], dict[str, list[int]], set[str],
                                              dict[str, list[int]], dict[str, list[int]]]:
        """``(sync_loads, delayed_frees, failed_loads, failed_async, recv_groups, delayed_groups)`` of the step's
        metadata; ``built``: the leaders' plans were built (they carry the planned loads)."""
    def received(self, request_ids: Sequence[str]) -> None:
        """The engine is told these requests were received (finished_recving)."""
    def request_finished(self, request_id: str) -> bool:
        """Withdraw what was not sent; True while the engine still waits for the request's finished_recving."""
    def delay_free(self, request_id: str, groups: Sequence[int], several: bool) -> None:
        """The finished request's blocks stay until its stores are done (with several groups, ``groups``')."""

class AllGroups:
    """TensorRT-LLM's window groups' ``Worker.get_finished`` answers joined (kvtier::connector::AllGroups): a request
    is reported once every group reported it; a load any group failed is reported failed."""

    def __init__(self, groups: int) -> None: ...
    def finish(self, reports: Sequence[Optional[tuple[Sequence[str], Sequence[str], Sequence[str]]]]
               ) -> tuple[list[str], list[str], list[str]]:
        """``(saved, loaded, load_failed)`` every group has now reported."""
    def finish_by_verdict(self, reports: Sequence[Optional[tuple[Sequence[str], Sequence[str],
                                                                 Sequence[tuple[str, int]]]]],
                          rewindable: set[str]) -> tuple[list[str], list[str], list[tuple[str, int]]]:
        """``(saved, loaded, [(request, recompute_from)])`` every group has now reported, from each group's
        ``Worker.get_finished_by_verdict`` answer: a load any group failed recomputes from the lowest token any
        group named; one whose request is not in ``rewindable`` is withheld (never reported, counted)."""
    def load_recovery(self) -> tuple[int, int]:
        """``(recomputed, unrecoverable)`` of ``finish_by_verdict``."""

def default_node_socket() -> str:
    """The per-user node socket used when none is named."""
    ...

class NodeServer:
    """The node tier (``kvtier node``): one host cache in shared memory for every engine process of this
    machine, served on a Unix socket (mode 0600, peers checked with SO_PEERCRED). Engines attach with
    ``remote.url = "node://" + socket``. Runs on its own threads until ``shutdown`` (or garbage collection)."""

    def __init__(
        self,
        socket: str,
        capacity_bytes: int,
        shm_dir: Optional[str] = None,
        allowed_uids: Sequence[int] = (),
        share: str = "equal",
        disk_dir: Optional[str] = None,
        disk_bytes: int = 0,
        huge_pages: str = "advise",
    ) -> None:
        """ConfigError if the socket is served by another node already or the shared memory cannot be
        reserved, or ``huge_pages`` is not ``advise`` or ``collapse`` (``kvtier node --huge-pages``)."""
    @property
    def socket(self) -> str: ...
    def stats(self) -> dict[str, int]:
        """clients, blocks, bytes_used, capacity, puts, puts_full, gets, get_misses, evictions,
        abandoned_puts, disk_blocks, disk_spills, disk_hits, requests (round trips after Hello),
        verified (commits the node hashed: those of clients that verify, i.e. of another uid or with
        ``verify=1``). With ``allowed_uids`` each uid gets an arena of its own, the capacity split evenly."""
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop within ``timeout`` seconds; removes the socket and the arena. Idempotent."""
