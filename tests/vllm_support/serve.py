"""``vllm serve`` (the OpenAI-compatible server of vLLM's CPU build) in a child process, for tests and benchmarks.

Invariant: every server runs in its own process on its own free port and is stopped by :meth:`Server.close`; the
prompts are token ids (``--skip-tokenizer-init``: the tiny checkpoints have no tokenizer).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm serve``: ``ktc`` is the ``--kv-transfer-config`` (None: no connector), ``g1_bytes`` vLLM's KV
    cache (``--kv-cache-memory-bytes``)."""

    def __init__(self, model: Path, log: Path, ktc: dict | None, g1_bytes: int, *, block_size: int = 32,
                 max_model_len: int = 512, max_num_seqs: int = 4, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port",
                str(self.port), "--host", "127.0.0.1", "--skip-tokenizer-init", "--block-size", str(block_size),
                "--max-model-len", str(max_model_len), "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
                "--seed", "0", "--kv-cache-memory-bytes", str(g1_bytes)]
        if ktc:
            args += ["--kv-transfer-config", json.dumps(ktc)]
        args += extra_args or []
        tests = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING",
                   PYTHONPATH=os.pathsep.join(x for x in (tests, os.environ.get("PYTHONPATH")) if x))
        self.log = log
        self._f = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._f, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        self.name = self._model_name()
                        return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"vllm serve did not start:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy completion of ``prompt``; the generated token ids."""
        body = json.dumps({"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        return list(out["choices"][0].get("token_ids") or [])

    def _model_name(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._f.close()


def scrape(port: int) -> dict[str, float]:
    """A Prometheus text endpoint as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
