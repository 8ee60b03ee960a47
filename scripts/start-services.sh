#!/usr/bin/env bash
# Installs the services kvtier's tests use; idempotent, exports nothing.
# redis-server: the remote-store tests start their own private servers (random port, no persistence).
# fio: the disk baselines.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v fio >/dev/null 2>&1 || missing+=(fio)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
redis-server --version
fio --version
