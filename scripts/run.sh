#!/usr/bin/env bash
# The main job: kvtier on its embedded defaults. Builds the `kvtier` binary and runs the default benchmark
# (built-in model, no connector vs the engine's prefix cache vs kvtier with host and disk tiers), writing a
# table, JSON and a PNG chart into ./bench-out/. Extra arguments go to `kvtier bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p kvtier-cli
exec ./target/release/kvtier bench "$@"
