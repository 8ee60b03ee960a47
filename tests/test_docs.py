"""The docs cannot drift from the code: every repository path and every Rust item the docs cite exists.

Scanned: README.md, docs/**/*.md and the ``//!`` / ``///`` comments of every Rust file. A path is a backticked
or linked token that starts with a top-level folder of the repository (``crates/``, ``python/``, ``tests/``,
``scripts/``, ``docs/``, ``fuzz/``, ``.ci/``), or a Markdown link relative to the page; it must exist (``*`` globs
and ``:line`` / ``#anchor`` suffixes allowed). A Rust item is a backticked ``a::b::C`` path whose first segment is one
of kvtier's crates; its last segment must be defined somewhere in that crate (fn, struct, enum, trait, type, const,
static, mod, macro or enum variant). Files another project owns (vLLM's, TensorRT-LLM's) are cited with their own
project's folders (``vllm/...``, ``tensorrt_llm/...``) and are not checked here.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("crates/", "python/", "tests/", "scripts/", "docs/", "fuzz/", ".ci/")
CRATES = {"kvtier": "kvtier", "kvtier_io": "kvtier-io", "kvtier_engine": "kvtier-engine", "kvtier_cli": "kvtier-cli",
          "kvtier_py": "kvtier-py"}
TICK = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _docs() -> list[tuple[Path, str]]:
    out = [(p, p.read_text()) for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]]
    for p in sorted((REPO / "crates").rglob("*.rs")):
        if "/target/" in str(p):
            continue
        lines = [ln.strip()[3:] for ln in p.read_text().splitlines() if ln.strip().startswith(("//!", "///"))]
        out.append((p, "\n".join(lines)))
    return out


def _exists(token: str, base: Path) -> bool:
    token = re.sub(r"(:\d+(-\d+)?|#.*)$", "", token).rstrip("/.,;")
    if "<" in token:  # a placeholder, e.g. docs/bench/<part>.md
        return True
    roots = [REPO if token.startswith(TOP) or f"{token}/" in TOP else base]
    if token.startswith(("tests/", "src/", "benches/")):  # crate-relative, as a crate's own docs write it
        roots += sorted((REPO / "crates").iterdir())
    for root in roots:
        if "*" in token or "{" in token:
            if any(root.glob(re.sub(r"\{[^}]*\}", "*", token))):
                return True
        elif (root / token).exists():
            return True
    return False


def test_cited_paths_exist():
    missing = []
    for doc, text in _docs():
        for tok in TICK.findall(text):
            tok = tok.strip()
            if tok.startswith(TOP) and " " not in tok and not _exists(tok, doc.parent):
                missing.append(f"{doc.relative_to(REPO)}: `{tok}`")
        if doc.suffix == ".md":
            for tok in LINK.findall(text):
                if tok.startswith(("http://", "https://", "mailto:", "#")):
                    continue
                if not _exists(tok, doc.parent):
                    missing.append(f"{doc.relative_to(REPO)}: ]({tok})")
    assert not missing, "docs cite paths that do not exist:\n" + "\n".join(sorted(set(missing)))


@functools.lru_cache(maxsize=None)
def _crate_source(crate: str) -> str:
    return "\n".join(p.read_text() for p in (REPO / "crates" / crate).rglob("*.rs"))


def _defined(crate: str, name: str) -> bool:
    src = _crate_source(crate)
    n = re.escape(name)
    return bool(re.search(rf"\b(fn|struct|enum|trait|type|const|static|mod|macro_rules!)\s+{n}\b", src)
                or re.search(rf"^\s*{n}\s*(\{{|\(|,|=)", src, re.M)
                or re.search(rf"macro_rules!\s*{n}\b", src))


def test_cited_rust_items_exist():
    missing, checked = [], 0
    for doc, text in _docs():
        for tok in TICK.findall(text):
            m = re.fullmatch(r"([a-z_]+)((?:::[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?!?", tok.strip())
            if not m or m.group(1) not in CRATES:
                continue
            name = m.group(2).rsplit("::", 1)[1]
            checked += 1
            if not _defined(CRATES[m.group(1)], name):
                missing.append(f"{doc.relative_to(REPO)}: `{tok}`")
    assert checked > 20, f"only {checked} Rust items cited: the pattern no longer matches the docs"
    assert not missing, "docs cite Rust items that do not exist:\n" + "\n".join(sorted(set(missing)))
