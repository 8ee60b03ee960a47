"""Python API misuse (#13, unclear errors): misspelled keywords, negative integers, the default
ZeroMQ endpoint. Every failure is a kvtier error or a TypeError naming what was wrong; nothing
raises a bare OverflowError."""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest

import kvtier
from kvtier import _native, describe

BS = 16


def leader(**extra):
    s = {"block_size": BS, "bytes_per_block": 4096, "num_device_blocks": 64, "host.num_blocks": 8}
    s.update(extra)
    return _native.Leader(s)


def worker(**extra):
    pool = np.zeros((8, 2, 2, BS * 2 * 8), np.float16)
    s = {"block_size": BS, "host.num_blocks": 4, "link": "engine"}
    s.update(extra)
    return pool, _native.Worker(s, describe(pool))


@pytest.mark.parametrize(
    "call, bad",
    [
        (lambda: _native.StepRecord("r", [1], [0], 0, 1, num_draft_token=1), "num_draft_token"),
        (lambda: leader().get_num_new_matched_tokens("r", [1, 2], num_computed_token=0), "num_computed_token"),
        (lambda: leader().update_state_after_alloc("r", block_id=[0]), "block_id"),
        (lambda: leader().build_step([], finishd=["r"]), "finishd"),
        (lambda: _native.Leader(setting={}), "setting"),
    ],
)
def test_misspelled_keywords_are_type_errors_naming_the_keyword(kvtier_env, call, bad):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{bad}'"):
        call()


def test_misspelled_worker_keywords(kvtier_env):
    _, w = worker()
    for call, bad in [
        (lambda: w.wait_for_layer_load(0, strem=None), "strem"),
        (lambda: w.get_finished([], started=None), "started"),
        (lambda: w.forward_done(steam=0), "steam"),
    ]:
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{bad}'"):
            call()
    w.shutdown()


def test_misspelled_setting_keys_are_config_errors(kvtier_env):
    with pytest.raises(kvtier.ConfigError, match="host.num_blokcs"):
        leader(**{"host.num_blokcs": 4})


def test_negative_ints_are_kvtier_errors_naming_the_argument(kvtier_env):
    ld = leader()
    cases = [
        (lambda: ld.get_num_new_matched_tokens("r", [1, -2], 0), "tokens"),
        (lambda: ld.get_num_new_matched_tokens("r", [1, 2], -1), "num_computed_tokens"),
        (lambda: ld.update_state_after_alloc("r", [-1]), "block_ids"),
        (lambda: ld.update_state_after_alloc("r", [0], -3), "num_external_tokens"),
        (lambda: ld.get_num_new_matched_tokens("r", [1], 2**70), "num_computed_tokens"),
        (lambda: _native.StepRecord("r", [1], [0], 0, -1), "num_scheduled_tokens"),
    ]
    for call, name in cases:
        with pytest.raises(kvtier.ConnectorError, match=rf"{name}: .* is out of range") as e:
            call()
        assert not isinstance(e.value, OverflowError)
    # A wrong type stays a TypeError naming the argument.
    with pytest.raises(TypeError, match="num_computed_tokens"):
        ld.get_num_new_matched_tokens("r", [1], "zero")
    # Valid calls still work after the errors.
    assert ld.get_num_new_matched_tokens("r", [1] * BS, 0) == 0


def test_negative_ints_to_the_worker_are_kvtier_errors(kvtier_env):
    _, w = worker()
    for call, name in [
        (lambda: w.wait_for_layer_load(-1), "layer"),
        (lambda: w.start_load(-1), "stream"),
        (lambda: w.forward_done(-5), "stream"),
    ]:
        with pytest.raises(kvtier.ConnectorError, match=rf"{name}: -\d+ is out of range"):
            call()
    w.forward_done(None)
    w.shutdown()


def test_shutdown_timeouts_are_checked_and_an_idle_worker_stops_cleanly(kvtier_env, tmp_path):
    """A negative or NaN timeout is a kvtier error naming it (Duration::from_secs_f64 would panic on it);
    an idle worker's bounded shutdown reports a clean stop, and a second one has nothing left to stop."""
    _, w = worker()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(kvtier.ConnectorError, match="timeout: .* is not a number of seconds"):
            w.shutdown(bad)
    assert w.shutdown(5.0) is True
    assert w.shutdown() is True
    node = _native.NodeServer(str(tmp_path / "n.sock"), 1 << 22)
    with pytest.raises(kvtier.KvtierError, match="timeout: NaN is not a number of seconds"):
        node.shutdown(float("nan"))
    node.shutdown(1.0)


def test_node_server_negative_capacity_is_a_config_error(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="capacity_bytes: -1 is out of range"):
        _native.NodeServer(str(tmp_path / "s"), -1)
    with pytest.raises(kvtier.ConfigError, match="allowed_uids"):
        _native.NodeServer(str(tmp_path / "s"), 1 << 20, allowed_uids=[-1])
    with pytest.raises(kvtier.ConfigError, match="huge_pages must be 'advise' or 'collapse'"):
        _native.NodeServer(str(tmp_path / "s"), 1 << 20, huge_pages="always")


def test_node_server_collapsing_its_arena_serves_blocks(tmp_path):
    """``huge_pages="collapse"`` (``kvtier node --huge-pages collapse``) asks the kernel for 2 MiB pages at start;
    a kernel that refuses (before Linux 6.1, no THP) leaves small pages and the node serves all the same."""
    node = _native.NodeServer(str(tmp_path / "c.sock"), 8 << 20, str(tmp_path), huge_pages="collapse")
    try:
        assert node.stats()["capacity"] == 8 << 20
    finally:
        node.shutdown(1.0)


def test_default_zmq_endpoint_is_a_private_unix_socket_not_a_fixed_port(kvtier_env, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    kvtier_env.setenv("XDG_RUNTIME_DIR", str(runtime))
    ld = leader(link="zmq", channel="api-misuse")
    try:
        sock = runtime / "kvtier" / "zmq-api-misuse.sock"
        assert stat.S_ISSOCK(os.stat(sock).st_mode), "the leader does not listen on the default socket"
        assert stat.S_IMODE(os.stat(runtime / "kvtier").st_mode) == 0o700
        # A second live leader on the same channel is refused, not handed the first one's ranks.
        with pytest.raises(kvtier.KvtierError):
            leader(link="zmq", channel="api-misuse")
        # Another channel gets its own socket.
        other = leader(link="zmq", channel="other/chan nel")
        try:
            socks = sorted(p.name for p in (runtime / "kvtier").glob("zmq-*.sock"))
            assert len(socks) == 2 and "zmq-api-misuse.sock" in socks, socks
        finally:
            other.shutdown()
    finally:
        ld.shutdown()


def test_default_node_socket_is_per_user(monkeypatch):
    """Issue 26: the node socket used when none is named is the user's own, never the shared /tmp/kvtier-node that
    any local user can create first; ``python -m kvtier.node`` and ``kvtier node`` agree on it."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert _native.default_node_socket() == f"/tmp/kvtier-node-{os.geteuid()}/node.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert _native.default_node_socket() == "/run/user/4242/kvtier-node/node.sock"


def test_a_bogus_cpu_pointer_is_refused_not_a_segfault(kvtier_env):
    """Issue 28: a TensorDesc whose data_ptr names no memory of this process (aligned, non-null: past the checks of
    the descriptor itself) crashed the interpreter on the first store. The worker now checks a CPU tensor's bytes
    against the process's mappings when it registers them, and refuses with an exception naming the range."""
    pool = np.zeros((8, 2, 2, BS * 2 * 8), np.float16)
    good = describe(pool)
    bogus = kvtier.TensorDesc(0x1000, list(pool.shape), [s for s in pool.strides], pool.itemsize, "float16")
    s = {"block_size": BS, "host.num_blocks": 4, "link": "engine"}
    with pytest.raises(kvtier.KvtierError, match="not mapped readable and writable"):
        _native.Worker(s, bogus)
    _native.Worker(s, good).shutdown()


def test_a_bogus_cuda_pointer_is_refused_not_a_poisoned_context(kvtier_env):
    """Issue 28: a CUDA TensorDesc was trusted until its first copy, where a bogus pointer faults kvtier's copy
    kernel and poisons the engine's CUDA context. The worker now asks the CUDA driver (cuPointerGetAttribute)
    whether the tensor's bytes are memory of its device when it registers them. Needs a GPU (skips in CI)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pool = torch.zeros((8, 2, 2, BS * 2 * 8), dtype=torch.float16, device="cuda")
    s = {"block_size": BS, "host.num_blocks": 4, "link": "engine"}
    shape, strides = list(pool.shape), [x * pool.element_size() for x in pool.stride()]
    for ptr in (0x1000, pool.data_ptr() + (1 << 40)):
        bogus = kvtier.TensorDesc(ptr, shape, strides, pool.element_size(), "float16", device="cuda")
        with pytest.raises(kvtier.KvtierError, match="not its device's memory"):
            _native.Worker(s, bogus)
    _native.Worker(s, describe(pool)).shutdown()


class _LyingSequence:
    """A sequence whose ``__len__`` claims far more items than it yields: PyO3's own extraction reserved that many
    before reading one (an allocation failure aborted the process, a ``PanicException`` past isize::MAX)."""

    def __init__(self, n, item=1):
        self.n, self.item = n, item

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= 2:
            raise IndexError(i)
        return self.item


def test_a_sequence_that_lies_about_its_length_is_refused_not_an_abort(kvtier_env):
    ld = leader()
    _, w = worker()
    for n in (2**40, 2**62):
        for call, name in [
            (lambda: ld.get_num_new_matched_tokens("r", _LyingSequence(n), 0), "tokens"),
            (lambda: ld.update_state_after_alloc("r", _LyingSequence(n), 0), "block_ids"),
            (lambda: ld.allocate_offer("r", _LyingSequence(n)), "block_ids"),
            (lambda: ld.build_step(_LyingSequence(n, ("r", [1], [0], 0, 1))), "records"),
            (lambda: ld.build_step([], _LyingSequence(n, "r")), "finished"),
            (lambda: _native.StepRecord("r", _LyingSequence(n), [0], 0, 1), "new_tokens"),
            (lambda: _native.match_groups([ld], "r", _LyingSequence(n), 0), "tokens"),
            (lambda: w.get_finished(_LyingSequence(n, "r")), "finished"),
            (lambda: w.wait_for_requests(_LyingSequence(n, "r")), "request_ids"),
        ]:
            with pytest.raises(kvtier.ConnectorError, match=rf"{name}: \d+ items is more than kvtier takes"):
                call()
    # A lazy sequence of 10**10 tokens is refused by its length, without reading it.
    with pytest.raises(kvtier.ConnectorError, match="tokens: 10000000000 items"):
        ld.get_num_new_matched_tokens("r", range(10**10), 0)
    # Sequences that tell the truth still work: lists, tuples, NumPy arrays, ranges.
    assert ld.get_num_new_matched_tokens("r", np.arange(2 * BS), 0) == 0
    assert ld.get_num_new_matched_tokens("q", range(2 * BS), 0) == 0
    assert w.get_finished(("x",), started_loading=[]) == ([], [], [])
    w.shutdown()


def test_a_bad_item_of_a_long_sequence_is_named_by_its_index_not_the_whole_repr(kvtier_env):
    ld = leader()
    tokens = [1] * 1_000_000
    tokens[-1] = -1
    with pytest.raises(kvtier.ConnectorError) as e:
        ld.get_num_new_matched_tokens("r", tokens, 0)
    assert str(e.value) == "tokens: -1 at index 999999 is out of range (a non-negative integer is expected)"
    with pytest.raises(TypeError, match="argument 'block_ids': item 1: 'float' object"):
        ld.update_state_after_alloc("r", [0, 1.5])
    # A huge scalar is shown cut short, not as its whole repr.
    with pytest.raises(kvtier.ConnectorError) as e:
        ld.get_num_new_matched_tokens("r", [1], 10**1000)
    assert len(str(e.value)) < 200
    # take_hit_sources's count was a bare OverflowError.
    with pytest.raises(kvtier.ConnectorError, match="num_external_tokens: -1 is out of range"):
        ld.take_hit_sources("r", -1)


def test_settings_that_contain_themselves_are_config_errors_not_a_stack_overflow(kvtier_env):
    """A self-referential or deeply nested list or dict in the settings (vLLM's kv_connector_extra_config) was
    converted recursively until the engine's thread overflowed its stack (SIGSEGV)."""
    loop = []
    loop.append(loop)
    d = {}
    d["a"] = d
    deep = []
    for _ in range(100_000):
        deep = [deep]
    for value in (loop, d, deep):
        with pytest.raises(kvtier.ConfigError, match="nests deeper than 32 lists or dicts"):
            leader(**{"host.junk": value})
        with pytest.raises(kvtier.ConfigError, match="nests deeper than 32"):
            _native.configured_tiers({"x": value})


def test_kvtier_config_naming_a_device_or_a_fifo_is_a_config_error(kvtier_env, tmp_path):
    """``KVTIER_CONFIG=/dev/zero`` was read until memory ran out; a FIFO blocked the engine's start in ``open``."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        kvtier_env.setenv("KVTIER_CONFIG", path)
        with pytest.raises(kvtier.ConfigError, match="not a regular file"):
            leader()


def test_a_tensor_desc_whose_bytes_overflow_is_a_layout_error():
    """``TensorDesc.nbytes`` multiplied the shape unchecked: a PanicException (dev builds) or a wrapped count."""
    with pytest.raises(kvtier.LayoutError, match="more than 2\\*\\*64 bytes"):
        kvtier.TensorDesc(0x1000, [2**62, 2**62], [2, 2], 2, "float16").nbytes
    assert kvtier.TensorDesc(0x1000, [2**62, 2**62, 0], [2, 2, 2], 2, "float16").nbytes == 0
    assert kvtier.TensorDesc(0x1000, [4, 8], [16, 2], 2, "float16").nbytes == 64


_LIAR = """
class L:
    def __init__(self, item): self.item = item
    def __len__(self): return 2**40
    def __getitem__(self, i):
        if i >= 2: raise IndexError(i)
        return self.item
"""


def _probe(body):
    """Runs ``body`` (``_native`` and ``kvtier`` imported, ``L`` a lying sequence class) in a child interpreter: an
    abort there fails the test instead of killing pytest. Returns the child's stdout."""
    import subprocess
    import sys

    code = "import kvtier\nfrom kvtier import _native\n" + _LIAR + body
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-2000:]}"
    return r.stdout


@pytest.mark.parametrize(
    "call, name",
    [
        ("_native.Completions().begin_step(L('r'), {}, {}, {}, set())", "delayed_frees"),
        ("_native.Completions().begin_step(range(10**10), {}, {}, {}, set())", "delayed_frees"),
        ("_native.Completions().begin_step([], {'r': L(0)}, {}, {}, set())", "delayed_groups\\['r'\\]"),
        ("_native.Completions().begin_step([], {}, {'r': range(10**10)}, {}, set())", "recv_groups\\['r'\\]"),
        ("_native.Completions().begin_step([], {}, {}, {'r': L(0)}, set())", "failed_loads\\['r'\\]"),
        ("_native.Completions().finish(L(None))", "reports"),
        ("_native.Completions().finish([(L('r'), [], [])])", "reports\\[0\\]\\[0\\]"),
        ("_native.Completions().take_load_errors(L(0))", "from_workers"),
        ("_native.AllGroups(2).finish([([], range(10**10), [])])", "reports\\[0\\]\\[1\\]"),
        ("_native.AllGroups(2).finish_by_verdict(L(None), set())", "reports"),
        ("_native.Promises().received(L('r'))", "request_ids"),
        ("_native.Promises().received(range(10**10))", "request_ids"),
        ("_native.Promises().allocated('r', 0, False, 1, True, L(0), [])", "loading"),
        ("_native.Promises().allocated('r', 0, False, 1, True, [], range(10**10))", "failed"),
        ("_native.Promises().delay_free('r', L(0), False)", "groups"),
        ("kvtier.TensorDesc(0x1000, L(1), [2], 2, 'float16')", "shape"),
        ("_native.TensorDesc.contiguous_strides(range(10**10), 2)", "shape"),
    ],
)
def test_books_refuse_a_sequence_that_lies_about_its_length(call, name):
    """``Completions``/``Promises``/``AllGroups``/``TensorDesc`` still took PyO3 ``Vec`` arguments: a lying
    ``__len__`` or ``range(10**10)`` aborted the process (allocation failure) or raised PanicException."""
    err = "kvtier.LayoutError" if "TensorDesc" in call else "kvtier.ConnectorError"
    out = _probe(f"""
try:
    {call}
except {err} as e:
    print("refused:", e)
""")
    assert re.search(rf"refused: {name}: \d+ items is more than kvtier takes", out), out


def test_books_still_take_honest_sequences():
    c = _native.Completions()
    c.set_groups(2)
    c.begin_step(["a"], {"a": [0, 1]}, {"b": (0, 1)}, {"c": np.array([3], np.uint32)}, {"c"})
    assert c.finish([(["a"], [], []), None]) == (None, {"c"}, {"c"})  # c's async load failed
    assert c.take_load_errors((7,)) >= {7}
    p = _native.Promises()
    p.allocated("r", 16, True, 1, True, [0], [])
    p.received(("r",))
    p.delay_free("r", range(1), False)
    assert _native.AllGroups(2).finish([None, ([], [], [])]) == ([], [], [])
    with pytest.raises(TypeError, match="argument 'delayed_groups'"):
        c.begin_step([], [("a", [0])], {}, {}, set())


def test_zero_bytes_per_block_is_a_config_error_not_a_wait():
    """``bytes_per_block: 0`` was taken as "not given": the leader then waited the whole leader-worker timeout for an
    in-process worker's layout."""
    out = _probe("""
import time
t = time.monotonic()
try:
    _native.Leader({"block_size": 16, "bytes_per_block": 0, "num_device_blocks": 64, "host.num_blocks": 8,
                    "connector.leader_worker_timeout_secs": 5})
except kvtier.ConfigError as e:
    print("refused:", e)
print("took", time.monotonic() - t)
""")
    assert re.search(r"refused: .*bytes_per_block.*0 is not a block size", out), out
    assert float(out.rsplit("took", 1)[1]) < 2, out


def test_cancel_load_with_start_past_end_is_a_connector_error(kvtier_env):
    ld = leader()
    with pytest.raises(kvtier.ConnectorError, match="start 12 is past end 8"):
        ld.cancel_load("r", 12, 8)
    ld.cancel_load("r", 8, 8)
    ld.cancel_load("r", 0, 4)


def test_tensor_desc_negative_numbers_are_layout_errors():
    """A negative shape entry or ``device_index=-1`` raised a bare OverflowError."""
    with pytest.raises(kvtier.LayoutError, match=r"shape: -4 at index 1 is out of range"):
        kvtier.TensorDesc(0x1000, [4, -4], [16, 2], 2, "float16")
    with pytest.raises(kvtier.LayoutError, match=r"device_index: -1 is out of range"):
        kvtier.TensorDesc(0x1000, [4, 8], [16, 2], 2, "float16", "cuda", -1)
    with pytest.raises(kvtier.LayoutError, match=r"itemsize: -2 is out of range"):
        kvtier.TensorDesc(0x1000, [4, 8], [16, 2], -2, "float16")
    with pytest.raises(kvtier.LayoutError, match=r"shape: -1 at index 0"):
        _native.TensorDesc.contiguous_strides([-1], 2)
    assert kvtier.TensorDesc(0x1000, [4, 8], [16, 2], 2, "float16", "cuda", 1).device_index == 1


def test_kv_cache_group_counts_are_bounded():
    """``AllGroups(n)`` and ``Completions.set_groups(n)`` took n = 2**40 unbounded."""
    for make in (lambda n: _native.AllGroups(n), lambda n: _native.Completions().set_groups(n)):
        with pytest.raises(kvtier.ConnectorError, match=r"1099511627776 KV cache groups is more than kvtier takes \(at most 64\)"):
            make(2**40)
        with pytest.raises(kvtier.ConnectorError, match="n: -1 is out of range|groups: -1 is out of range"):
            make(-1)
        make(64)
