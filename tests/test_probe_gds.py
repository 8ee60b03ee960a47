"""scripts/probe_gds.py (the disk tier against GDS and fio on a GPU machine) where there is no GPU: its selftest (the
cufile.h struct layouts, the file, kvtier's read path into plain memory, and a flipped byte of the file caught so the
row loses its figure), and a plain run that says what is missing (no CUDA, no libcufile or a refused driver open) in
FAIL lines and the JSON instead of a traceback, and still measures what it can.

Run: ``cd tests && ../.venv-vllm/bin/python -m pytest -q -p no:cacheprovider test_probe_gds.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "scripts" / "probe_gds.py"


def probe(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out, cwd = tmp_path / "gds.json", tmp_path / "cwd"
    cwd.mkdir()
    p = subprocess.run([sys.executable, str(PROBE), "--gib", "0.0625", "--dir", str(tmp_path / "data"), "--out",
                        str(out), *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert not list(cwd.iterdir()), "the probe wrote into the working directory (cufile.log?)"
    return p, json.loads(out.read_text())


def test_selftest_checks_layouts_and_catches_planted_corruption(tmp_path):
    p, d = probe(tmp_path, "--selftest")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SELFTEST PASS" in p.stdout
    assert "cufile.h layouts: sizes and offsets as the header implies" in p.stdout
    assert d["layout_problems"] == []
    assert d["checker_catches_flip"]["host check"] is True
    rows = d["rows"]
    assert len(rows) == 4
    clean, planted = rows[:2], rows[2:]
    assert all(r["verified"] and r["gb_s"] > 0 for r in clean)
    assert [(r["request"], r["threads"]) for r in clean] == [(2 << 20, 8), (64 << 20, 1)]
    # The flipped byte of the file: every row reads it back, none keeps a figure, and the table prints none.
    at = {r["verify_error"].split(":")[0] for r in planted}
    assert len(at) == 1 and at.pop().startswith("byte ")
    assert all(not r["verified"] and r["gb_s"] is None for r in planted)
    assert "caught, no figure" in p.stdout
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("| (b) same, one byte of the file flipped")]
    assert len(table) == 2 and all("| — |" in ln and "| NO: byte " in ln for ln in table)
    assert not list((tmp_path / "data").glob("kvtier-gds-*.dat")), "the test file was left behind"


def test_probe_without_gpu_says_what_is_missing_and_measures_the_rest(tmp_path):
    p, d = probe(tmp_path, "--reps", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    stages = {f["stage"] for f in d["failures"]}
    if "gpu" not in d:  # CI: no CUDA device (or no torch): a FAIL line, and path (b) into host memory still runs
        assert "cuda" in stages and "- FAIL cuda: " in p.stdout
        rows = [r for r in d["rows"] if r["path"] == "b"]
        assert len(rows) == 2 and all(r["verified"] and r["gb_s"] > 0 for r in rows)
        assert "NO GPU" in rows[0]["label"]
        assert d["checker_catches_flip"] == {"host check": True}
    # cuFile: either no library (a FAIL line) or its verdict by name, e.g. a refused driver open without a GPU.
    assert "cufile" in d
    if d["cufile"]["lib"] is None:
        assert "libcufile" in stages and "- FAIL libcufile: " in p.stdout
    else:
        assert "cuFileDriverOpen: " in p.stdout and "driver_open_0" in d["cufile"]
        assert d["cufile"]["driver_open_0"]["err_name"].startswith("CU_FILE_")
    assert "| path | request | threads |" in p.stdout
    assert d["cufile_log"].startswith(str(tmp_path / "data"))
