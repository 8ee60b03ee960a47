#!/usr/bin/env bash
# Rebuilds docs/BENCHMARKS.md from its parts: the overview in docs/benchmarks.head.md and one file per
# subsystem in docs/bench/ (each subsystem keeps its own figures). Run after editing any part.
# docs/ARCHITECTURE.md is written by hand (an index linking docs/arch/*.md); nothing assembles it.
set -euo pipefail
cd "$(dirname "$0")/../docs"
order="core conn io remote node engine cli py trtllm vllm"
{
  cat benchmarks.head.md
  for p in $order; do [ -f "bench/$p.md" ] && { echo; sed 's/^# /## /' "bench/$p.md"; }; done
} > BENCHMARKS.md
