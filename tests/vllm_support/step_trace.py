"""Per-step timeline of a vLLM engine and its KV connector, for profiling (``KVTIER_STEP_TRACE=path``).

Wraps, in the engine process: the scheduler's ``schedule`` and ``update_from_output`` (what each step scheduled,
which loads and stores vLLM heard were finished, which requests finished), and every connector hook of whichever
connector class the engine built (kvtier's or vLLM's own ``OffloadingConnector``: the same hooks, so the two
timelines compare). Each event is one JSON line ``{"t": perf_counter, "ev": name, "dt": seconds in the call, ...}``
written when the trace is dumped, so the wrapping costs a list append per call.

Invariant: tracing observes only; it never changes an argument or a return value.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

_EVENTS: list[dict[str, Any]] = []

_CONNECTOR_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "handle_preemptions", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "get_kv_connector_stats", "clear_connector_metadata",
)


def _wrap(owner: Any, name: str, summarize=None) -> None:
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_kvtier_traced", False):
        return

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        ev: dict[str, Any] = {"t": t, "ev": name, "dt": time.perf_counter() - t}
        if summarize is not None:
            try:
                ev.update(summarize(args, kwargs, out))
            except Exception as e:  # observing must never break the engine
                ev["summary_error"] = repr(e)
        _EVENTS.append(ev)
        return out

    traced._kvtier_traced = True  # type: ignore[attr-defined]
    setattr(owner, name, traced)


def _sched_summary(args, kwargs, out) -> dict[str, Any]:
    return {"tokens": dict(out.num_scheduled_tokens), "total": out.total_num_scheduled_tokens}


def _update_summary(args, kwargs, out) -> dict[str, Any]:
    # Bound method: args = (scheduler_output, model_runner_output).
    mo = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
    kco = getattr(mo, "kv_connector_output", None)
    fin = []
    for eco in (out or {}).values():
        for o in getattr(eco, "outputs", ()):
            if getattr(o, "finish_reason", None) is not None:
                fin.append(o.request_id)
    return {"recv": sorted(getattr(kco, "finished_recving", None) or ()),
            "send": sorted(getattr(kco, "finished_sending", None) or ()), "finished": fin}


def _matched_summary(args, kwargs, out) -> dict[str, Any]:
    return {"rid": getattr(args[1], "request_id", None), "n": list(out) if isinstance(out, tuple) else out}


def _finished_summary(args, kwargs, out) -> dict[str, Any]:
    if isinstance(out, tuple):
        return {"send": sorted(out[0] or ()), "recv": sorted(out[1] or ())}
    return {}


def install(llm: Any) -> None:
    """Wrap the scheduler of ``llm`` (an in-process ``vllm.LLM``) and its connector's class."""
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    # An instance attribute shadows the class's method: the engine core calls these through the instance.
    _wrap(sched, "schedule", _sched_summary)
    _wrap(sched, "update_from_output", _update_summary)
    for name in ("step", "step_with_batch_queue"):
        _wrap(core, name)
    if getattr(core, "step_fn", None) is not None:  # bound at construction: point it at the wrapped one
        core.step_fn = core.step_with_batch_queue if core.batch_queue is not None else core.step
    conn = getattr(sched, "connector", None)
    if conn is not None:
        cls = type(conn)
        special = {"get_num_new_matched_tokens": _matched_summary, "get_finished": _finished_summary}
        for name in _CONNECTOR_HOOKS:
            _wrap(cls, name, special.get(name))


def dump(path: str | Path) -> None:
    with open(path, "w") as f:
        for ev in _EVENTS:
            f.write(json.dumps(ev) + "\n")
