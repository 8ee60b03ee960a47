#!/usr/bin/env bash
# The main job: kvtier on its embedded defaults. Builds the `kvtier` binary and runs the default benchmark
# (built-in model: no cache at all (prefix cache off) vs the engine's own prefix cache vs kvtier with host and
# disk tiers, in one run), writing a table, JSON and a PNG chart into ./bench-out/ (about 1.5 minutes after the
# build on a 2-core box). Extra arguments go to `kvtier bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p kvtier-cli
exec ./target/release/kvtier bench "$@"
