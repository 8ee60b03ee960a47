#!/usr/bin/env bash
# Rebuilds docs/ARCHITECTURE.md and docs/BENCHMARKS.md from their parts: the overview in docs/*.head.md and one
# file per subsystem in docs/arch/ and docs/bench/ (each subsystem keeps its own file; these two are the index
# readers open). Run after editing any part.
set -euo pipefail
cd "$(dirname "$0")/../docs"
order="core conn io remote node engine cli py vllm"
{
  cat architecture.head.md
  for p in $order; do [ -f "arch/$p.md" ] && { echo; sed 's/^# /## /' "arch/$p.md"; }; done
} > ARCHITECTURE.md
{
  cat benchmarks.head.md
  for p in $order; do [ -f "bench/$p.md" ] && { echo; sed 's/^# /## /' "bench/$p.md"; }; done
} > BENCHMARKS.md
