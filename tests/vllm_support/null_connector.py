"""A KV connector that does nothing: the baseline for what merely having a connector costs vLLM.

vLLM runs extra code for any configured connector, whatever it does: the scheduler builds connector metadata
every step and processes ``KVConnectorOutput``; the model runner binds the metadata, calls ``start_load_kv``,
``wait_for_save``, ``get_finished`` and the stats hooks around every forward pass
(vllm/v1/worker/kv_connector_model_runner_mixin.py ``_get_kv_connector_output``), and ``handle_preemptions``
before ``_update_states`` (gpu_model_runner.py ``execute_model``). This class answers every hook with "nothing":
no match, no load, no save, blocks freed at once. ``bench_vllm_gpu.py --engines null`` runs it, so an
offloader's decode and miss-path costs can be split into vLLM's share (null vs vLLM alone) and its own
(kvtier vs null).

Invariant: it never changes what vLLM computes (no external tokens, no delayed frees).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def has_connector_metadata(self) -> bool:
        return False  # as kvtier: skips vLLM's two per-layer calls per attention layer

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None
