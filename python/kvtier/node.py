"""kvtier's node tier: one host cache shared by every engine process on this machine.

Run one per machine (the same service as ``kvtier node``, for installations that have only the wheel)::

    python -m kvtier.node --socket /run/kvtier/node.sock --capacity-gb 64

and point every engine at it through kvtier's configuration: ``"remote.url": "node:///run/kvtier/node.sock"``
(vLLM ``kv_connector_extra_config``, TensorRT-LLM ``KVTIER_REMOTE_URL``, ``kvtier serve``'s configuration). Blocks
one engine stores are hits for every other engine with the same model identity; an engine that crashes mid-transfer
leaves no half-written block and no lease behind; a full node turns stores into skips and lookups into misses.
Only this user (and ``--allow-uid``) may attach: the socket is mode 0600 in a private 0700 directory (0666 in a 0711
directory with ``--allow-uid``) and every peer is checked with SO_PEERCRED.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional, Sequence

from ._native import NodeServer, default_node_socket

__all__ = ["NodeServer", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.node", description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=default_node_socket(),
                   help="Unix socket engines attach to (default: per user, as `kvtier node`'s)")
    p.add_argument("--capacity-gb", type=float, default=4.0, help="shared host memory for blocks (decimal GB)")
    p.add_argument("--shm-dir", default=None, help="tmpfs directory of the shared arena (default /dev/shm)")
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        help="another user id allowed to attach (it gets an arena of its own: the capacity is split evenly)",
    )
    p.add_argument(
        "--share",
        default="equal",
        help="how the arena is shared among models: equal, or weighted:NAME=W,... (unlisted models weigh 1)",
    )
    p.add_argument("--disk-dir", default=None, help="the node's own disk tier behind the arena (kept across restarts)")
    p.add_argument("--disk-gb", type=float, default=0.0, help="size of the node's disk tier (decimal GB)")
    p.add_argument("--huge-pages", choices=("advise", "collapse"), default="advise",
                   help="how the arena gets 2 MiB pages: advise (a hint), or collapse it at start (as `kvtier node`)")
    args = p.parse_args(argv)
    if args.disk_dir is not None and not args.disk_gb > 0:
        p.error("--disk-dir needs --disk-gb > 0")
    if not args.capacity_gb > 0:
        p.error("--capacity-gb must be positive")
    server = NodeServer(
        args.socket, int(args.capacity_gb * 1e9), args.shm_dir, args.allow_uid, args.share, args.disk_dir, int(args.disk_gb * 1e9),
        args.huge_pages,
    )
    stop = threading.Event()
    signals = []

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        if len(signals) > 1:  # a second signal: exit at once
            sys.exit(130)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"serving {server.socket}", flush=True)
    while not stop.wait(0.5):
        pass
    stats = server.stats()
    server.shutdown(5.0)
    print(f"kvtier node: stopped {stats}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
