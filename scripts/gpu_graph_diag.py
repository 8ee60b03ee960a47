"""Where do CUDA-graph runs with kvtier part from vLLM alone? (H200 diagnosis; prints a table, writes JSON.)

Each engine runs in its own process with tests/test_vllm_gpu.py's spec (tiny random Llama, 48-block G1, one
request at a time, chunked prefill) and the same workload; outputs are compared token by token:
- vLLM alone twice in two processes (is vLLM itself reproducible across processes with CUDA graphs?);
- kvtier (host tier) with CUDA graphs;
- both again with deterministic Inductor (``DETERMINISTIC_COMPILE``, what the GPU tests run: no kernel tuning by
  timing), and with ``compilation_config={"backend": "eager"}`` (Dynamo's piecewise graphs, no Inductor codegen:
  vLLM's custom CUDA ops instead of Inductor's Triton kernels).
Usage: python3 scripts/gpu_graph_diag.py OUT.json [--only NAME,...]
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_vllm_gpu as t  # noqa: E402
from vllm_support import connector_config  # noqa: E402


first_diff = t._first_diff  # "same", or where and how two runs' outputs first differ


def main() -> None:
    out = Path(sys.argv[1])
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    work = Path("/tmp/graphdiag")
    work.mkdir(exist_ok=True)
    import subprocess
    model = work / "model"
    if not model.exists():
        subprocess.run([sys.executable, str(t.REPO / "scripts" / "make_tiny_llama.py"), str(model), "--layers",
                        str(t.LAYERS), "--hidden", "256", "--heads", "4", "--kv-heads", str(t.KV_HEADS),
                        "--head-dim", str(t.HEAD_DIM), "--seed", "0"], check=True, stdout=subprocess.DEVNULL)
    kt = connector_config(settings={"host.num_blocks": 1024})
    default = {"compilation_config": {}}  # vLLM's defaults: Inductor tunes kernels by timing, per process
    det = {"compilation_config": t.DETERMINISTIC_COMPILE}  # what tests/test_vllm_gpu.py runs
    noind = {"compilation_config": {"backend": "eager"}}
    runs = [("ref_a", None, default), ("ref_b", None, default), ("kvtier", kt, default),
            ("ref_det", None, det), ("kvtier_det", kt, det),
            ("ref_noinductor", None, noind), ("kvtier_noinductor", kt, noind)]
    res: dict[str, dict] = {}
    for name, ktc, kw in runs:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            with t._engine(model, work / f"{name}.log", ktc, eager=False, **kw) as e:
                res[name] = t._workload(e)
                st = e.stats().get("stats", {}) if ktc else {}
                res[name]["_onboard"] = st.get("onboard_host_blocks")
        except Exception as ex:  # report and go on
            res[name] = {"error": repr(ex)[:400]}
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)
    base = res.get("ref_a", {})
    for name, r in res.items():
        if "error" in r:
            print(f"{name:20s} ERROR {r['error']}")
            continue
        cmp = {k: first_diff(r[k], base.get(k, [])) for k in ("phase", "other", "again")} if base else {}
        self_again = first_diff(r["phase"], r["again"])
        print(f"{name:20s} vs ref_a: {cmp}  phase-vs-again: {self_again}  onboard: {r.get('_onboard')}")
    for ref, kv in (("ref_det", "kvtier_det"), ("ref_noinductor", "kvtier_noinductor")):
        a, b = res.get(ref), res.get(kv)
        if a and b and "error" not in a and "error" not in b:
            print(f"{kv} vs {ref}:", {k: first_diff(b[k], a[k]) for k in ("phase", "other", "again")})
    out.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
