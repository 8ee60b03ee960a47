#!/usr/bin/env bash
# Regenerates the local working corpus fuzz/corpus/<target> (not in git) from the committed seeds
# fuzz/seeds/<target>, for cargo-fuzz runs: `bash fuzz/seed-corpus.sh && cd fuzz &&
# cargo +nightly fuzz run <target> corpus/<target>`. cargo test replays the seeds and fixed
# mutations of them on its own (fuzz/replay.rs).
set -euo pipefail
cd "$(dirname "$0")"
for d in seeds/*/; do
  t=$(basename "$d")
  mkdir -p "corpus/$t"
  cp -n "$d"* "corpus/$t/"
done
echo "fuzz/corpus seeded: $(ls seeds | tr '\n' ' ')"
