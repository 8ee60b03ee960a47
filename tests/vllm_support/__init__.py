"""Helpers for kvtier's real-engine tests against vLLM's CPU build.

- :func:`make_model` writes the seeded tiny Llama checkpoint (scripts/make_tiny_llama.py) once per directory.
- :class:`Engine` runs one vLLM engine in a child process (``engine_proc``) and talks to it in JSON lines.
- :func:`prompts` builds deterministic token-id prompts that share prefixes the way chat histories do.
- :func:`connector_config` builds the ``--kv-transfer-config`` for kvtier.

Invariant: every engine configuration lives in its own process; tests never import vLLM themselves.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

# The tiny model's geometry (make_tiny_llama.py defaults): 2 layers, 2 KV heads, head dim 32, bf16.
BLOCK_SIZE = 32
NUM_LAYERS = 2
BYTES_PER_BLOCK = NUM_LAYERS * 2 * 2 * BLOCK_SIZE * 32 * 2  # layers * K/V * kv_heads * tokens * head_dim * bf16


def make_model(out: Path, seed: int = 0, extra: list[str] | None = None) -> Path:
    """Write the seeded random checkpoint into ``out`` (idempotent); ``extra``: more make_tiny_llama.py flags."""
    if not (out / "model.safetensors").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(out), "--seed", str(seed),
                        *(extra or [])], check=True, stdout=subprocess.DEVNULL)
    return out


def prompts(n: int, length: int, seed: int, shared_prefix: int = 0, vocab: int = 2048) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids; the first ``shared_prefix`` tokens are common to all of them."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(length - shared_prefix)] for _ in range(n)]


def connector_config(role: str = "kv_both", settings: dict[str, Any] | None = None) -> dict:
    """kvtier's kv-transfer configuration for vLLM (``KVTransferConfig`` keyword arguments); ``settings`` are
    kvtier configuration keys (docs/CONFIG.md), e.g. ``{"host.num_blocks": 512}``."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(settings or {}),
    }


class EngineError(RuntimeError):
    pass


class Engine:
    """A vLLM engine in a child process. Use as a context manager, or call :meth:`close`."""

    def __init__(self, model: Path, log: Path, *, kv_cache_blocks: int, kv_transfer_config: dict | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0,
                 bytes_per_block: int = BYTES_PER_BLOCK, **spec: Any) -> None:
        full = {
            "model": str(model),
            "block_size": BLOCK_SIZE,
            # vLLM sizes its cache in bytes; per block it needs all layers' K and V.
            "kv_cache_memory_bytes": kv_cache_blocks * bytes_per_block,
            "kv_transfer_config": kv_transfer_config,
            **spec,
        }
        child_env = dict(os.environ)
        child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        child_env.setdefault("OMP_NUM_THREADS", "1")
        child_env["PYTHONPATH"] = str(TESTS) + os.pathsep + child_env.get("PYTHONPATH", "")
        if env:
            child_env.update(env)
        self.log_path = log
        self._log = open(log, "wb")
        self._proc = subprocess.Popen([sys.executable, "-m", "vllm_support.engine_proc", json.dumps(full)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      env=child_env, cwd=str(TESTS))
        self.ready = self._read(start_timeout)
        self.start_seconds = self.ready["start_seconds"]

    def _read(self, timeout: float) -> dict:
        assert self._proc.stdout is not None
        import select

        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise EngineError(f"engine did not answer within {timeout}s; log {self.log_path}:\n{self.log_tail()}")
            r, _, _ = select.select([self._proc.stdout], [], [], min(left, 1.0))
            if r:
                line = self._proc.stdout.readline()
                if not line:
                    raise EngineError(f"engine exited ({self._proc.poll()}); log {self.log_path}:\n{self.log_tail()}")
                msg = json.loads(line)
                if "error" in msg:
                    raise EngineError(f"{msg['error']}\n{msg.get('traceback', '')}")
                return msg
            if self._proc.poll() is not None:
                raise EngineError(f"engine exited ({self._proc.returncode}); log {self.log_path}:\n{self.log_tail()}")

    def call(self, op: str, timeout: float = 600.0, **args: Any) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self._proc.stdin.flush()
        return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int, timeout: float = 600.0,
                 cache_salts: list[str | None] | None = None) -> list[list[int]]:
        """Greedy outputs; an engine that does not answer within ``timeout`` seconds (e.g. a stalled scheduler)
        raises :class:`EngineError` with the tail of its log."""
        return self.call("generate", timeout=timeout, prompts=prompts, max_tokens=max_tokens,
                         cache_salts=cache_salts)["outputs"]

    def prompt_logprobs(self, prompts: list[list[int]], max_tokens: int = 1) -> list[list[float | None]]:
        """Each prompt token's logprob (``SamplingParams.prompt_logprobs``: vLLM sets skip_reading_prefix_cache)."""
        return self.call("generate", prompts=prompts, max_tokens=max_tokens, prompt_logprobs=1)["prompt_logprobs"]

    def ttft(self, prompts: list[list[int]], cache_salts: list[str | None] | None = None) -> list[float]:
        return self.call("ttft", prompts=prompts, cache_salts=cache_salts)["seconds"]

    def drain(self, timeout: float = 60.0) -> bool:
        return self.call("drain", timeout=timeout + 60, seconds=timeout)["idle"]

    def reset_prefix_cache(self, connector: bool = False) -> bool:
        return self.call("reset_prefix_cache", connector=connector)["ok"]

    def stats(self) -> dict:
        return self.call("stats")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("exit", timeout=120)
            except EngineError:
                pass
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
