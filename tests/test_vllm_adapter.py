"""The vLLM adapter's own translations, without starting an engine (fast; needs vLLM importable).

What must hold: kvtier's 128-bit hashes survive vLLM's msgpack event encoding; connector stats aggregate by
summing; the settings vLLM fixes (block size, bytes per block over ranks, salt, load mode, role) are derived from
its config exactly; block ids of the single KV cache group are taken as plain ints.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh")
kv = pytest.importorskip("kvtier.vllm", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")


def test_events_keep_128_bit_hashes_through_msgpack():
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventBatch

    h = (1 << 127) + 12345  # does not fit msgpack's 64-bit integers
    events = kv._vllm_events([
        {"kind": "stored", "tier": "host", "hashes": [h, 7]},
        {"kind": "removed", "tier": "disk", "hashes": [h]},
        {"kind": "stored", "tier": "remote", "hashes": []},  # nothing to announce
    ], block_size=32)
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[0].block_hashes == [h.to_bytes(16, "big"), (7).to_bytes(16, "big")]
    assert events[0].medium == "CPU" and events[1].medium == "STORAGE"
    wire = msgspec.msgpack.encode(EventBatch(ts=1.0, events=events))
    back = msgspec.msgpack.decode(wire, type=EventBatch)
    assert int.from_bytes(back.events[0]["block_hashes"][0], "big") == h


def test_stats_aggregate_by_summing():
    a = kv.KvtierConnectorStats(data={"worker_loads": 2, "adapter_errors": 0})
    b = kv.KvtierConnectorStats(data={"worker_loads": 3, "worker_stores": 1})
    merged = a.aggregate(b)
    assert merged.reduce() == {"worker_loads": 5, "adapter_errors": 0, "worker_stores": 1}
    assert not merged.is_empty()
    assert kv.KvtierConnectorStats(data={"adapter_errors": 0}).is_empty()
    assert isinstance(kv.KvtierConnector.build_kv_connector_stats({"x": 1}), kv.KvtierConnectorStats)


def _config(role="kv_both", extra=None, tp=2, pp=1):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra or {}),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        model_config=SimpleNamespace(model="/models/llama", dtype="bfloat16", revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


def _kv_cache_config(num_blocks=100, page=8192, layers=2):
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=page),
                            layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)])
    return SimpleNamespace(kv_cache_groups=[group], num_blocks=num_blocks)


def test_settings_derived_from_vllm_config():
    s = kv._settings(_config(extra={"host.num_blocks": 64}), _kv_cache_config())
    assert s["host.num_blocks"] == 64
    assert s["block_size"] == 32
    assert s["world_size"] == 2
    assert s["bytes_per_block"] == 8192 * 2 * 2  # page * layers * ranks
    assert s["num_device_blocks"] == 100
    assert "async_loads" not in s and s["async_loads_default"] is True  # kvtier's configuration decides
    assert "/models/llama" in s["salt"]
    # Producer and consumer of one model hash alike; another model does not.
    other = _config(role="kv_consumer")
    other.model_config.model = "/models/other"
    assert kv._settings(_config(role="kv_producer"), None)["salt"] == s["salt"]
    assert kv._settings(other, None)["salt"] != s["salt"]
    assert kv._settings(_config(extra={"async_loads": False}), None)["async_loads"] is False


def test_settings_reject_unknown_role():
    with pytest.raises(ValueError, match="kv_role"):
        kv._settings(_config(role="kv_sideways"), None)


def test_block_ids_of_the_single_group():
    assert kv._first_group(([3, 4, 5],)) == [3, 4, 5]
    assert kv._first_group([1, 2]) == [1, 2]
    assert kv._first_group(None) == []
    assert kv._first_group(()) == []
    # vLLM's hybrid KV cache manager: one list per group.
    assert kv._group_ids(([1], [2, 3]), 1) == [2, 3] and kv._group_ids([1, 2], 1) == []


class _RecordingLeader:
    """Stands in for kvtier's Leader: matches 64 tokens until a request is matched again after its allocation (the
    real leader's restart rule, tested in Rust: `restarted_or_refused_requests_are_recomputed`), records the calls."""

    loads_are_async = True

    def __init__(self, settings):
        self.calls = []
        self.allocated = set()
        self.restarts = 0

    def get_num_new_matched_tokens(self, rid, tokens, num_computed):
        self.calls.append(("match", rid))
        if rid in self.allocated:
            self.restarts += 1
            return 0
        return 64

    def load_is_async(self, rid):
        return True

    def allocate(self, rid, block_ids, n):
        self.calls.append(("alloc", rid, n))
        self.allocated.add(rid)
        return [], None

    def request_preempted_if_running(self, rid):
        self.calls.append(("preempted", rid))
        return False

    def request_finished(self, rid, fence_reuse=False):
        self.calls.append(("finished", rid, fence_reuse))
        return False

    def stats(self):
        return {"load_restarts": self.restarts}


def test_a_restart_is_the_leaders_to_recognise(monkeypatch):
    """vLLM frees an async-loading request whose first block failed and matches it again. The leader recognises
    that (matched again after its allocation, before it ran) and offers nothing; the adapter passes the calls through
    unchanged, does not report a preemption for a request vLLM never scheduled, and reports the leader's count."""
    monkeypatch.setattr(kv, "_backend", lambda settings: SimpleNamespace(Leader=_RecordingLeader))
    side = kv._SchedulerSide({}, 32)
    assert side.async_loads is True
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(200)), num_tokens=200)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7],))
    assert side.lookup(req, 0) == 64
    assert side.lookup(req, 0) == 64
    side.on_alloc(req, blocks, 64)
    assert side.lookup(req, 0) == 0
    assert ("preempted", "r") not in side._leader.calls
    stats = side.cumulative_stats()
    assert stats["load_restarts"] == 1 and stats["adapter_errors"] == 0
    side.request_finished(req, [])
    assert side._leader.calls[-1] == ("finished", "r", True)


# ---------------------------------------------------------------- identity (vLLM's extra hash keys)

def _req(rid="r", lora=None, salt=None, mm=(), embeds=None):
    feats = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in mm]
    return SimpleNamespace(request_id=rid, lora_request=lora, cache_salt=salt, mm_features=feats,
                           prompt_embeds=embeds)


def test_identity_separates_what_vllms_block_hash_separates():
    ident = lambda r: kv._identity(r, kv._embeds_digest)  # noqa: E731
    plain = ident(_req())
    assert plain == (None, True, "")
    lora_a = SimpleNamespace(lora_name="a", lora_path="/adapters/a")
    lora_a2 = SimpleNamespace(lora_name="a", lora_path="/adapters/a-v2")  # name re-pointed: vLLM keys the path too
    keys = [
        ident(_req(lora=lora_a))[0],
        ident(_req(lora=lora_a2))[0],
        ident(_req(salt="tenant-1"))[0],
        ident(_req(salt="tenant-2"))[0],
        ident(_req(mm=[("img0", 4, 16)]))[0],
        ident(_req(mm=[("img0", 36, 16)]))[0],  # same image elsewhere in the prompt
        ident(_req(mm=[("img1", 4, 16)]))[0],
        ident(_req(lora=lora_a, salt="tenant-1"))[0],
    ]
    assert None not in keys and len(set(keys)) == len(keys), keys
    # Equal inputs give equal identities (they must share), and a value cannot forge another's separator.
    assert ident(_req(rid="x", salt="tenant-1"))[0] == ident(_req(rid="y", salt="tenant-1"))[0]
    assert ident(_req(salt='a"],["lora","b'))[0] != ident(_req(salt="a", lora=SimpleNamespace(lora_name="b",
                                                                                            lora_path="")))[0]
    # A multimodal input kvtier cannot identify is refused, not keyed by its tokens alone.
    ident_none, cacheable, reason = ident(_req(mm=[(None, 0, 4)]))
    assert ident_none is None and cacheable is False and "multimodal" in reason


def test_identity_digests_prompt_embeddings():
    import torch

    ident = lambda r: kv._identity(r, kv._embeds_digest)  # noqa: E731
    e1 = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    e2 = e1.clone()
    e2[2, 3] += 1
    a, b, c = ident(_req(embeds=e1)), ident(_req(embeds=e1.clone())), ident(_req(embeds=e2))
    assert a[1] and a[0] == b[0] and a[0] != c[0]
    # An embedding that cannot be read is refused.
    assert ident(_req(embeds=object()))[1] is False


def test_layout_request_and_salt():
    # vLLM's choice by default (measured: no faster replays with BLNHC), a named layout on request.
    assert kv._required_layout({}, on_cuda=True) is None
    assert kv._required_layout({"kv_cache_layout": "BLNHC"}, on_cuda=True) == "BLNHC"
    assert kv._required_layout({"kv_cache_layout": "none"}, on_cuda=True) is None
    assert kv._required_layout({"kv_cache_layout": "lbhnc"}, on_cuda=True) == "LBHNC"
    with pytest.raises(ValueError, match="kv_cache_layout"):
        kv._required_layout({"kv_cache_layout": "XYZ"}, on_cuda=True)
    # Engines whose KV is laid out differently never share blocks: the resolved layout is in the salt.
    a = _kv_cache_config()
    a.kv_cache_layout = "LBNHC"
    b = _kv_cache_config()
    b.kv_cache_layout = "BLNHC"
    sa, sb = kv._settings(_config(), a), kv._settings(_config(), b)
    assert sa["salt"] != sb["salt"] and sa["salt"].endswith("|LBNHC")
    assert sa["layout"] == "vllm"


# ---------------------------------------------------------------- fenced block reuse

class _RecordingWorker:
    def __init__(self):
        self.waited = []

    def wait_for_requests(self, ids):
        self.waited.append(list(ids))


def test_handle_preemptions_waits_for_fenced_and_preempted_requests():
    """vLLM calls handle_preemptions before the step writes any device block (gpu_model_runner.py execute_model, V1;
    gpu/kv_connector.py pre_forward, V2): the workers must wait there for the stores of the finished requests whose
    blocks this step reuses (the metadata's fence), as for the preempted ones."""
    conn = object.__new__(kv.KvtierConnector)
    conn._worker = kv._WorkerSide({}, 16)
    conn._worker._worker = _RecordingWorker()
    conn.handle_preemptions(kv.KvtierConnectorMetadata(preempted=["p"], fence=["f1", "f2"]))
    conn.handle_preemptions(kv.KvtierConnectorMetadata(fence=["f3"]))
    conn.handle_preemptions(kv.KvtierConnectorMetadata())
    assert conn._worker._worker.waited == [["p", "f1", "f2"], ["f3"]]


class _FailingLeader:
    """A leader whose step building or request_finished raises (an adapter error, e.g. invalid engine input)."""

    loads_are_async = True

    def __init__(self, settings):
        self.fail_build = False
        self.fail_finished = False

    def build_step_with_fences(self, records, finished):
        if self.fail_build:
            raise ValueError("planted")
        return b"plan", []

    def request_finished(self, rid, fence_reuse=False):
        if self.fail_finished:
            raise ValueError("planted")
        return False

    def allocate(self, rid, block_ids, n):
        return [], None


def _empty_step(finished=()):
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(preempted_req_ids=set(), scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=cached, finished_req_ids=set(finished), num_scheduled_tokens={})


def test_a_lost_fence_makes_the_next_step_wait_for_every_job(monkeypatch):
    """A step whose build_step failed reaches the workers without its fence, and a request whose request_finished
    failed has its blocks freed by vLLM with no fence at all (vllm/v1/core/sched/scheduler.py ``_free_request``
    frees at once unless the connector asks to delay): vLLM may hand those blocks out while stores still read
    them. The metadata then says fence_all, once, and handle_preemptions waits for every request's jobs."""
    monkeypatch.setattr(kv, "_backend", lambda settings: SimpleNamespace(Leader=_FailingLeader))
    side = kv._SchedulerSide({}, 16)
    assert side.build_meta(_empty_step()).fence_all is False
    side._leader.fail_build = True
    m = side.build_meta(_empty_step())
    assert m.fence_all is True and m.plan == b""
    side._leader.fail_build = False
    assert side.build_meta(_empty_step()).fence_all is False  # once, not forever
    side._requests["r"] = SimpleNamespace(request_id="r")
    side._leader.fail_finished = True
    assert side.request_finished(SimpleNamespace(request_id="r"), [1, 2]) == (False, None)
    assert side.build_meta(_empty_step(["r"])).fence_all is True
    assert side._errors == 2

    class _AllWorker(_RecordingWorker):
        def wait_for_all_requests(self):
            self.waited.append("all")

    conn = object.__new__(kv.KvtierConnector)
    conn._worker = kv._WorkerSide({}, 16)
    conn._worker._worker = _AllWorker()
    conn.handle_preemptions(kv.KvtierConnectorMetadata(preempted=["p"], fence_all=True))
    conn.handle_preemptions(kv.KvtierConnectorMetadata(fence=["f"]))
    assert conn._worker._worker.waited == ["all", ["f"]]


def test_leader_stats_are_read_at_most_every_interval_and_none_is_lost(monkeypatch):
    """vLLM asks get_kv_connector_stats every step (Scheduler.update_from_output) and sums the deltas into its
    logging interval: the scheduler side reads the leader at most every _STATS_EVERY, and what changed meanwhile
    comes with the next read."""
    monkeypatch.setattr(kv, "_backend", lambda settings: SimpleNamespace(Leader=_FailingLeader))
    clock = [100.0]
    monkeypatch.setattr(kv.time, "monotonic", lambda: clock[0])
    side = kv._SchedulerSide({}, 16)
    leader = {"preempted_requests": 2}
    side._leader.stats = lambda: dict(leader)
    assert side.take_stats_delta() == {"preempted_requests": 2}
    leader["preempted_requests"] = 5
    clock[0] += kv._STATS_EVERY / 2
    assert side.take_stats_delta() == {}
    leader["preempted_requests"] = 6
    clock[0] += kv._STATS_EVERY
    assert side.take_stats_delta() == {"preempted_requests": 4}


def test_fenced_reuse_unless_vllm_zeroes_new_blocks():
    """The V2 model runner zeroes newly allocated blocks (Mamba layers, mixed-precision KV) before pre_forward calls
    handle_preemptions: then a finished request's blocks must stay held until its stores are done."""
    assert kv._fence_reuse(None) is True
    assert kv._fence_reuse(SimpleNamespace(needs_kv_cache_zeroing=False)) is True
    assert kv._fence_reuse(SimpleNamespace(needs_kv_cache_zeroing=True)) is False


class _EventsLeader:
    loads_are_async = True

    def __init__(self, settings):
        self.taken = 0
        self.discarded = 0

    def take_events(self):
        self.taken += 1
        return [{"kind": "stored", "tier": "host", "hashes": [(1 << 100) + 5]}]

    def discard_events(self):
        self.discarded += 1
        return 1


def test_events_are_built_only_when_vllm_publishes_them(monkeypatch):
    """vLLM asks for connector events every step and drops them unless kv_events_config enables a publisher
    (EventPublisherFactory.create): only then are they built; otherwise the leader's queue is drained unbuilt."""
    assert kv._publishes_kv_events(SimpleNamespace(kv_events_config=None)) is False
    off = SimpleNamespace(enable_kv_cache_events=False, publisher="zmq")
    null = SimpleNamespace(enable_kv_cache_events=True, publisher="null")
    on = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq")
    assert [kv._publishes_kv_events(SimpleNamespace(kv_events_config=c)) for c in (off, null, on)] == [
        False, False, True]
    monkeypatch.setattr(kv, "_backend", lambda settings: SimpleNamespace(Leader=_EventsLeader))
    quiet = kv._SchedulerSide({}, 16, publish_events=False)
    assert quiet.take_events() == [] and (quiet._leader.taken, quiet._leader.discarded) == (0, 1)
    loud = kv._SchedulerSide({}, 16, publish_events=True)
    events = loud.take_events()
    assert len(events) == 1 and events[0].block_hashes and loud._leader.taken == 1


def _spec(kind: str, **fields):
    """A stand-in for one of vLLM's layer specs (vllm/v1/kv_cache_interface.py): kvtier goes by the class name."""
    return type(kind, (), dict({"block_size": 32, "page_size_bytes": 4096}, **fields))()


def _groups_config(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"])
                                            for i, s in enumerate(specs)])


def test_kv_cache_groups_kvtier_serves_and_the_kinds_it_refuses_by_name():
    # vLLM's hybrid KV cache manager: a full-attention group and a sliding-window group (its reach includes the
    # tokens vLLM retains beyond the window, extra_retained_tokens).
    groups = kv._kv_groups(_groups_config(_spec("FullAttentionSpec"),
                                   _spec("SlidingWindowSpec", sliding_window=64, extra_retained_tokens=2)), 32)
    assert [(g["kind"], g["window"], g["layers"]) for g in groups] == [
        ("FullAttentionSpec", None, ["l0"]), ("SlidingWindowSpec", 66, ["l1"])]
    settings = kv._group_settings({"world_size": 2, "salt": "s"}, groups)
    assert [s["bytes_per_block"] for s in settings] == [8192, 8192]
    assert settings[1]["sliding_window"] == 66 and settings[1]["null_block"] == 0 and "sliding_window" not in settings[0]
    # The load mode is joined per request by match_groups (in the step only when every group's part lies in the host
    # tier); asynchronous unless connector.sync_host_loads is set (the adapter's default for one group is in-step).
    assert [s["kv_cache_group"] for s in settings] == [0, 1] and "sync_host_loads" not in settings[0]
    assert all(s["sync_host_loads_default"] is False for s in settings)
    # What stays refused, at engine start, naming the layer kind and what to do.
    for kind, words in [("MambaSpec", ["MambaSpec", "without kvtier"]),
                        ("ChunkedLocalAttentionSpec", ["ChunkedLocalAttentionSpec",
                                                       "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"]),
                        ("RSWASpec", ["RSWASpec", "--disable-hybrid-kv-cache-manager"])]:
        with pytest.raises(ValueError) as err:
            kv._kv_groups(_groups_config(_spec("FullAttentionSpec"), _spec(kind, sliding_window=64)), 32)
        for w in words:
            assert w in str(err.value), (kind, str(err.value))
    with pytest.raises(ValueError, match="16 tokens per block"):
        kv._kv_groups(_groups_config(_spec("FullAttentionSpec"), _spec("SlidingWindowSpec", sliding_window=8, block_size=16)), 32)


class _GroupWorker:
    """One KV cache group's kvtier worker: reports what the test queues for its next get_finished."""

    def __init__(self):
        self.next: tuple[list, list, list] = ([], [], [])
        self.waited: list[list[str]] = []

    def get_finished(self, finished):
        out, self.next = self.next, ([], [], [])
        return out

    def wait_for_requests(self, rids):
        self.waited.append(list(rids))


def test_several_groups_report_a_request_once_every_group_has():
    """vLLM's hybrid manager, one kvtier worker per KV cache group: vLLM hears of an asynchronous load in
    finished_recving (and of a delayed free in finished_sending) only once every group that loads (stores) it
    reported it, and a fence waits in every group's worker (a block one group gave back may be reused in another)."""
    side = kv._WorkerSide([{}, {}], 16, [["a"], ["b"]])
    side._workers = [_GroupWorker(), _GroupWorker()]
    side._worker = side._workers[0]
    side.start_step(kv.KvtierConnectorMetadata(recv_groups={"r": [0, 1]}, delayed_frees=["s"],
                                               delayed_groups={"s": [0, 1]}))
    side._workers[0].next = (["s"], ["r"], [])
    assert side.get_finished(set()) == (None, None)
    side._workers[1].next = (["s"], [], ["r"])  # a failed load is reported finished too
    assert side.get_finished(set()) == ({"s"}, {"r"})
    assert side.get_finished(set()) == (None, None)
    side.drain(["f"])
    assert [w.waited for w in side._workers] == [[["f"]], [["f"]]]


class _LoadingGroupWorker:
    """One KV cache group's kvtier worker in a step with a sync load: records how the adapter starts and waits for
    it (layered the way kvtier's worker is when it is started layered: ``has_layered_loads``)."""

    def __init__(self, layered_groups: bool):
        self.started: list[bool] = []
        self.waits: list[int | None] = []
        self._layered_groups = layered_groups

    def layered_group_loads(self):
        return self._layered_groups

    def bind(self, plan):
        pass

    def start_load(self, stream, layered):
        self.started.append(layered)

    def has_layered_loads(self):
        return bool(self.started and self.started[-1])

    def wait_for_layer_load(self, index, stream):
        self.waits.append(index)


@pytest.mark.parametrize("layered_groups", [False, True])
def test_several_groups_load_layer_by_layer_only_when_asked(layered_groups):
    """A hybrid model's in-step loads go whole (every layer at once, before the forward pass) unless
    ``layered_group_loads``: then each group's worker is started layered and each attention layer waits on its own
    group's worker at its index among that group's layers (_vllm_worker.start_step, wait_for_layer). vLLM calls
    ``wait_for_layer_load(layer_name)`` on entry to every attention layer of a step with connector metadata
    (vllm/model_executor/layers/attention/kv_transfer_utils.py, ``maybe_transfer_kv_layer``), by the layer's name
    whatever its KV cache group; the test calls it so, in the model's layer order."""
    side = kv._WorkerSide([{}, {}], 16, [["l0", "l2"], ["l1", "l3"]])
    side._adopt([_LoadingGroupWorker(layered_groups), _LoadingGroupWorker(layered_groups)])
    side._layer_index = {"l0": (0, 0), "l2": (0, 1), "l1": (1, 0), "l3": (1, 1)}
    side.start_step(kv.KvtierConnectorMetadata(plan=b"p0", group_plans=[b"p1"], sync_loads=True), layer_hooks=True)
    assert [w.started for w in side._workers] == [[layered_groups], [layered_groups]]
    assert side.layered_step is layered_groups
    if layered_groups:
        assert [w.waits for w in side._workers] == [[], []]  # nothing waited before the forward pass
        for name in ("l0", "l1", "l2", "l3"):
            side.wait_for_layer(name)
        assert [w.waits for w in side._workers] == [[0, 1], [0, 1]]
    else:
        assert [w.waits for w in side._workers] == [[0], [0]]  # whole: completed in start_step


class _GroupLeader:
    """One KV cache group's leader: records what it is given, delays the free of requests named in ``delay``."""

    loads_are_async = True

    def __init__(self, settings):
        self.group = int(settings.get("kv_cache_group", 0))
        self.allocated: list = []
        self.records: list = []
        self.delay: set[str] = set()

    def allocate(self, rid, block_ids, n):
        self.allocated.append((rid, list(block_ids), n))
        return [], None

    def take_hit_sources(self, rid, n):
        return [("host", n)]

    def load_is_async(self, rid):
        return True

    def build_step_with_fences(self, records, finished):
        self.records.extend(records)
        return f"plan{self.group}".encode(), [f"fence{self.group}"]

    def request_finished(self, rid, fence_reuse=False):
        return rid in self.delay

    def stats(self):
        return {"matched_tokens": 64, "onboard_host_blocks": 2 + self.group, "onboard_host_bytes": 100}


def test_several_groups_get_their_own_block_ids_and_answer_as_one(monkeypatch):
    """vLLM's hybrid manager hands the connector one block-id list per KV cache group (``KVCacheBlocks
    .get_block_ids()``, ``NewRequestData.block_ids``, ``CachedRequestData.new_block_ids``): each group's leader gets
    its own; the workers get every group's plan; a finished request's free waits for the groups that delay it; and
    the request counters count once."""
    monkeypatch.setattr(kv, "_backend", lambda settings: SimpleNamespace(Leader=_GroupLeader))
    settings = kv._group_settings({"world_size": 1}, [
        {"kind": "FullAttentionSpec", "window": None, "layers": ["a"], "page_bytes": 8},
        {"kind": "SlidingWindowSpec", "window": 64, "layers": ["b"], "page_bytes": 8}])
    side = kv._SchedulerSide(settings, 16, fence_reuse=False)
    full, window = side._leaders
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(80)))
    side.on_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8])), 64)
    assert [x.allocated for x in side._leaders] == [[("r", [1, 2, 3, 4, 5], 64)], [("r", [0, 0, 6, 7, 8], 64)]]
    step = _empty_step()
    step.scheduled_new_reqs = [SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5], [0, 0, 6, 7, 8]),
                                               num_computed_tokens=64, prompt_token_ids=None)]
    step.num_scheduled_tokens = {"r": 16}
    meta = side.build_meta(step)
    assert (meta.plan, meta.group_plans, sorted(meta.fence)) == (b"plan0", [b"plan1"], ["fence0", "fence1"])
    assert meta.recv_groups == {"r": [0, 1]}
    assert [rec[2] for rec in full.records] == [[1, 2, 3, 4, 5]]
    assert [rec[2] for rec in window.records] == [[0, 0, 6, 7, 8]]
    side.update_output(SimpleNamespace(finished_recving={"r"}, kv_connector_worker_meta=None))  # loaded
    window.delay.add("r")
    assert side.request_finished(req) == (True, None)
    assert side.build_meta(_empty_step()).delayed_groups == {"r": [1]}
    s = side.cumulative_stats()
    assert (s["matched_tokens"], s["onboard_host_blocks"], s["g1.onboard_host_blocks"], s["g1.window"]) == (64, 5, 3, 64)
