"""One vLLM engine (CPU build) in its own process, driven by JSON lines on stdin/stdout.

Run as ``python -m vllm_support.engine_proc SPEC_JSON`` (from the tests/ directory). The spec names the model
directory, the KV-cache size in blocks, and the kv-transfer configuration (or none). Commands, one JSON object
per line on stdin, each answered with one JSON line on stdout (vLLM's own output goes to stderr):

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}`` -> ``{"outputs": [[ids]], "seconds": s}``
- ``{"op": "ttft", "prompts": [[ids]]}`` -> per prompt the wall time of a 1-token generation, run one at a time
  (``"profile": path`` records the last prompt's CPU and CUDA activity there, a Chrome trace)
- ``{"op": "ttft_batch", "prompts": [[ids]], "max_tokens": n}`` -> every prompt submitted at once (concurrent
  users, ``LLMEngine.add_request``, the engine stepped as a server's busy loop does): per prompt the seconds from
  submission to its first token, and its first ``max_tokens`` tokens (``{"ttft": [s], "outputs": [[ids]]}``)
- ``{"op": "drain"}`` -> steps the engine until its scheduler has nothing left (connector jobs included)
- ``{"op": "reset_prefix_cache", "connector": false}`` -> ``{"ok": bool}`` (vLLM's device prefix cache; with
  ``"connector": true`` also the connector's cache, vLLM's ``reset_connector``)
- ``generate`` and ``ttft`` take an optional ``"cache_salts"`` list (one per prompt, or null entries)
- ``{"op": "abort_mix", "prompts": [[ids]], "max_tokens": n, "aborts": {"i": rule}}`` -> steps the engine itself
  (``LLMEngine.step``, as a server's busy loop does) and aborts request ``i`` the way a client that goes away does
  (``LLMEngine.abort_request``): rule ``{"when": "loading"}`` while vLLM waits for its asynchronous load
  (``WAITING_FOR_REMOTE_KVS``), ``{"when": "step", "step": k}`` before step ``k``, ``{"when": "tokens", "n": k}``
  once it streamed ``k`` tokens. Answers ``{"outputs": {i: [ids]}, "aborted": {i: rule}, "steps": s}`` for the
  requests that were not aborted
- ``{"op": "stats"}`` -> kvtier's counters (summed over this process's connector instances) and the number of
  ERROR records and exceptions kvtier produced so far
- ``{"op": "exit"}``

Invariant: one engine per process, so every configuration starts from a clean process (vLLM keeps global state).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class _ErrorCounter(logging.Handler):
    """Counts ERROR (and worse) records from kvtier's loggers."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _reply(obj: dict) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def _prompts(cmd: dict) -> list[dict]:
    salts = cmd.get("cache_salts") or [None] * len(cmd["prompts"])
    out = []
    for p, salt in zip(cmd["prompts"], salts):
        d = {"prompt_token_ids": p}
        if salt:
            d["cache_salt"] = salt
        out.append(d)
    return out


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _profiler():
    """A started torch.profiler over CPU and CUDA activity (every stream and thread of the process, kvtier's copies
    included); the caller exits it and exports a Chrome trace."""
    import torch.profiler as tp

    acts = [tp.ProfilerActivity.CPU]
    if torch_cuda_available():
        acts.append(tp.ProfilerActivity.CUDA)
    prof = tp.profile(activities=acts)
    prof.__enter__()
    return prof


def _ttft_batch(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=int(cmd.get("max_tokens", 1)), detokenize=False, ignore_eos=True)
    tag = cmd.get("tag", "tb")
    ids = [f"{tag}{i:05d}x" for i in range(len(cmd["prompts"]))]
    t0 = time.perf_counter()
    for rid, p in zip(ids, _prompts(cmd)):
        eng.add_request(rid, p, sp)
    first: dict[int, float] = {}
    outputs: dict[int, list[int]] = {}
    deadline = time.time() + float(cmd.get("seconds", 600))
    while eng.has_unfinished_requests() and time.time() < deadline:
        for o in eng.step():
            key = o.request_id[:len(ids[0])]
            if key not in ids:
                continue
            i = ids.index(key)
            if o.outputs and o.outputs[0].token_ids and i not in first:
                first[i] = time.perf_counter() - t0
            if o.finished:
                outputs[i] = list(o.outputs[0].token_ids)
    n = len(ids)
    return {"ttft": [first.get(i) for i in range(n)], "outputs": [outputs.get(i) for i in range(n)]}


def _abort_mix(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    sp = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), detokenize=False, ignore_eos=True)
    seq = cmd.get("tag", "am")
    ids = [f"{seq}{i:04d}x" for i in range(len(cmd["prompts"]))]
    rules = {int(k): v for k, v in (cmd.get("aborts") or {}).items()}
    for rid, p in zip(ids, _prompts(cmd)):
        eng.add_request(rid, p, sp)
    outputs: dict[int, list[int]] = {}
    streamed: dict[int, int] = {}
    aborted: dict[int, str] = {}
    deadline = time.time() + float(cmd.get("seconds", 300))
    step = 0

    def status(i: int):
        for r in list(sched.requests.values()):  # vLLM may suffix the id it was given
            if r.request_id.startswith(ids[i]):
                return r.status
        return None

    while eng.has_unfinished_requests() and time.time() < deadline:
        for i, rule in rules.items():
            if i in aborted or i in outputs:
                continue
            when = rule.get("when")
            if ((when == "loading" and status(i) == RequestStatus.WAITING_FOR_REMOTE_KVS)
                    or (when == "step" and step >= int(rule.get("step", 0)))
                    or (when == "tokens" and streamed.get(i, 0) >= int(rule.get("n", 1)))):
                eng.abort_request([ids[i]])
                aborted[i] = when
        for o in eng.step():
            i = ids.index(o.request_id[:len(ids[0])]) if o.request_id[:len(ids[0])] in ids else None
            if i is None or i in aborted:
                continue
            streamed[i] = len(o.outputs[0].token_ids) if o.outputs else 0
            if o.finished:
                outputs[i] = list(o.outputs[0].token_ids)
        step += 1
    return {"outputs": outputs, "aborted": aborted, "steps": step, "idle": not eng.has_unfinished_requests()}


def main() -> None:
    spec = json.loads(sys.argv[1])
    # vLLM prints progress bars and logs to stdout in places: keep stdout for the protocol only.
    sys.stdout = sys.stderr
    counter = _ErrorCounter()
    logging.getLogger("kvtier").addHandler(counter)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    block_size = int(spec.get("block_size", 32))
    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=bool(spec.get("enforce_eager", True)),
        max_model_len=int(spec.get("max_model_len", 512)),
        distributed_executor_backend="uni",
        block_size=block_size,
        seed=0,
        max_num_seqs=int(spec.get("max_num_seqs", 8)),
        enable_prefix_caching=bool(spec.get("enable_prefix_caching", True)),
    )
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    # GPU runs (tests/test_vllm_gpu.py) pass a few engine arguments as they are.
    for k in ("gpu_memory_utilization", "async_scheduling", "enable_chunked_prefill", "dtype", "load_format",
              "kv_offloading_size", "kv_offloading_backend", "compilation_config", "disable_hybrid_kv_cache_manager"):
        if spec.get(k) is not None:
            kwargs[k] = spec[k]
    if spec.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    ktc = spec.get("kv_transfer_config")
    if ktc:
        kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
    t0 = time.time()
    llm = LLM(**kwargs)
    step_trace = os.environ.get("KVTIER_STEP_TRACE")
    if step_trace:  # profiling: the per-step timeline of the scheduler and the connector (step_trace.py)
        from vllm_support import step_trace as st

        st.install(llm)
    sched = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    _reply({"ready": True, "start_seconds": time.time() - t0,
            "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
            "kv_cache_layout": str(getattr(llm.llm_engine.vllm_config.cache_config, "kv_cache_layout", None))})

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                plp = cmd.get("prompt_logprobs")
                sp = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), detokenize=False,
                                    ignore_eos=True, prompt_logprobs=int(plp) if plp else None)
                prof = _profiler() if cmd.get("profile") else None  # bench_vllm_gpu.py --profile-decode
                t = time.time()
                outs = llm.generate(_prompts(cmd), sp, use_tqdm=False)
                seconds = time.time() - t
                if prof is not None:
                    prof.__exit__(None, None, None)
                    prof.export_chrome_trace(cmd["profile"])
                reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds}
                if plp:  # each prompt token's logprob (the first has none)
                    reply["prompt_logprobs"] = [
                        [None if d is None else float(d[t].logprob) for t, d in zip(o.prompt_token_ids, o.prompt_logprobs)]
                        for o in outs]
                _reply(reply)
            elif op == "ttft":
                sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
                times = []
                firsts = []
                todo = _prompts(cmd)
                for i, p in enumerate(todo):
                    prof = None
                    if cmd.get("profile") and i == len(todo) - 1:
                        # Profiling (bench_vllm_gpu.py --profile): CPU and CUDA activity of the last prompt.
                        prof = _profiler()
                    t = time.perf_counter()
                    o = llm.generate([p], sp, use_tqdm=False)
                    times.append(time.perf_counter() - t)
                    firsts.append(o[0].outputs[0].token_ids[0])
                    if prof is not None:
                        prof.__exit__(None, None, None)
                        prof.export_chrome_trace(cmd["profile"])
                _reply({"seconds": times, "first_tokens": firsts})
            elif op == "abort_mix":
                _reply(_abort_mix(llm, cmd))
            elif op == "ttft_batch":
                _reply(_ttft_batch(llm, cmd))
            elif op == "drain":
                # Step the engine while the scheduler still has work (e.g. a connector's pending copies):
                # LLM.generate returns once outputs are complete, a server's busy loop would keep stepping.
                core = llm.llm_engine.engine_core.engine_core
                deadline = time.time() + float(cmd.get("seconds", 60))
                steps = 0
                # With async scheduling (vLLM's GPU default) the core steps through its batch queue (step_fn).
                step = getattr(core, "step_fn", None) or core.step
                while core.scheduler.has_requests() and time.time() < deadline:
                    step()
                    steps += 1
                _reply({"steps": steps, "idle": not core.scheduler.has_requests()})
            elif op == "reset_prefix_cache":
                _reply({"ok": bool(llm.reset_prefix_cache(reset_connector=bool(cmd.get("connector", False))))})
            elif op == "stats":
                stats: dict = {}
                try:
                    import kvtier.vllm as kv

                    stats = kv.process_stats()
                    getattr(kv, "_trace_dump", lambda: None)()  # KVTIER_VLLM_TRACE: write what was recorded
                except ImportError:
                    pass
                if step_trace:
                    st.dump(step_trace)
                _reply({"stats": stats, "kvtier_errors": counter.records})
            elif op == "exit":
                _reply({"bye": True})
                break
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # the test sees the failure instead of a hung pipe
            _reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    # vLLM's shutdown calls the connector's shutdown(); make it happen before interpreter teardown.
    del llm
    sys.__stdout__.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
