"""TensorRT-LLM engines attached node-only to one node tier (#14): no host tier of their own, the node's arena is
their G2. Engines run in this process through the TensorRT-LLM 1.4 executor driver (tests/trtllm_driver.py) with
kvtier's real connector classes; the node is ``kvtier._native.NodeServer`` (what ``python -m kvtier.node`` runs).

What must hold: a fresh engine of the same model is served the blocks another engine stored (hits from the node,
tokens identical to the model's), and an engine of another model with identical KV shapes matches nothing."""

from __future__ import annotations

import pytest

import kvtier
from trtllm_scenarios import GEO1, engine, reference_tokens, stats, tokens, workload

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "NodeServer"), reason="native node tier not built")


@pytest.fixture
def node(kvtier_env, tmp_path):
    sock = tmp_path / "node" / "node.sock"
    server = kvtier._native.NodeServer(str(sock), 64 << 20, str(tmp_path))
    kvtier_env.setenv("KVTIER_REMOTE_URL", f"node://{sock}")  # node-only: no host tier configured
    yield server
    server.shutdown()


def test_node_only_engines_share_blocks_by_model(node):
    prompts = workload(seed=41, n_docs=3, per_doc=1)
    produced: set = set()
    a = engine(geo=GEO1, num_device_blocks=40, model="model-a", model_seed=1, produced=produced)
    first = [a.add_request(p, 3) for p in prompts]
    a.run()
    assert stats(a)["remote_put_confirmed"] > 0, stats(a)
    assert stats(a).get("host_capacity", 0) == 0  # no private G2
    # Another model with identical KV shapes: nothing matches (a match would fail the driver's byte checks).
    b = engine(geo=GEO1, num_device_blocks=40, model="model-b", model_seed=2, produced=produced)
    other = [b.add_request(p, 3) for p in prompts]
    b.run()
    assert b.stats.matched_tokens == 0
    assert tokens(other) == reference_tokens(prompts, 3, seed=2)
    # A fresh engine of model-a is served model-a's blocks from the node.
    c = engine(geo=GEO1, num_device_blocks=40, model="model-a", model_seed=1, produced=produced)
    again = [c.add_request(p, 3) for p in prompts]
    c.run()
    assert c.stats.matched_tokens > 0 and stats(c)["onboard_remote_blocks"] > 0, stats(c)
    assert tokens(first) == tokens(again) == reference_tokens(prompts, 3, seed=1)
    ns = node.stats()
    assert ns["puts"] > 0 and ns["gets"] > 0, ns


def stored_then_replayed(node, geo, seed: int, die: bool) -> tuple:
    """One engine stores ``workload(seed)`` on the node; a fresh engine of the same model replays it, the node
    shut down (when ``die``) right after the scheduler matched the replay's hits on it. Returns (the replaying
    engine, its requests, the prompts)."""
    from kvtier import trtllm

    prompts = workload(seed=seed, n_docs=3, per_doc=1)
    produced: set = set()
    a = engine(geo=geo, num_device_blocks=40, produced=produced)
    [a.add_request(p, 3) for p in prompts]
    a.run()
    assert stats(a)["remote_put_confirmed"] > 0, stats(a)

    class NodeDiesAfterTheMatch(trtllm.KvtierConnectorWorker):
        def start_load_kv(self, stream):
            if die:
                node.shutdown()  # the scheduler matched this step's hits on the node; now it is gone
            super().start_load_kv(stream)

    c = engine(geo=geo, num_device_blocks=40, produced=produced, worker=NodeDiesAfterTheMatch)
    again = [c.add_request(p, 3) for p in prompts]
    c.run()
    assert c.stats.matched_tokens > 0
    return c, again, prompts


def test_a_node_that_dies_between_match_and_load_costs_a_recompute_never_wrong_kv(node, kvtier_env):
    """TensorRT-LLM cannot recompute a failed synchronous load (docs/arch/trtllm.md): a hit from the node tier
    loads asynchronously even with ``connector.sync_host_loads`` (which loads *host* hits in the step), so a node
    that dies after the match is a failed asynchronous load, rewound by its verdict and recomputed."""
    kvtier_env.setenv("KVTIER_SYNC_HOST_LOADS", "true")
    _, again, prompts = stored_then_replayed(node, GEO1, 43, die=True)
    assert tokens(again) == reference_tokens(prompts, 3)


@pytest.mark.parametrize("die", [False, True])
def test_tp2_node_only_engines_share_blocks_and_survive_the_node(node, die):
    """TP=2 (both ranks in this process, each rank its own share of every block on the node): a fresh engine is
    served the blocks another stored; with the node gone between the match and the load, every rank recomputes
    from the same token (the leader's verdict) and the tokens stay exact."""
    from trtllm_driver import Geometry

    c, again, prompts = stored_then_replayed(node, Geometry(world_size=2, kv_heads=4), 47, die)
    assert tokens(again) == reference_tokens(prompts, 3)
    recomputed = {w.recomputed_loads for w in c.workers.values()}
    assert len(recomputed) == 1, recomputed  # every rank rewound alike
    if die:
        assert recomputed.pop() > 0
    else:
        assert stats(c)["onboard_remote_blocks"] > 0 and recomputed.pop() == 0
