"""Does shared memory of the kind the node tier's arena uses get 2 MiB pages on this machine, and what do they change
for first-touch copies? (docs/bench/node.md: the node's DMA rates at 0.88x / 0.90x of the pinned host tier.)

    python3 scripts/probe_shm_hugepages.py [--dir /dev/shm] [--gib 1]

For a file of ``--gib`` GiB in ``--dir`` mapped shared at a 2 MiB-aligned address, twice: (a) ``posix_fallocate`` then
``madvise(MADV_COLLAPSE)`` (what a node could do over a plain tmpfs whatever ``shmem_enabled`` says), reporting the
collapse's time and /proc/meminfo's ShmemHugePages; (b) ``posix_fallocate`` alone (a tmpfs mounted ``huge=always``
gets huge pages here). Each then copies ``--gib`` GiB into a second mapping of the file (first touch: page faults),
in GB/s. Linux only; a probe, not kvtier code (which maps its arena in crates/kvtier-io/src/sys/shm.rs).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

HUGE = 2 << 20
MADV_COLLAPSE = 25
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.posix_fallocate.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]


def aligned_map(fd: int, n: int) -> int:
    """Map ``n`` bytes of ``fd`` shared, read-write, at a 2 MiB-aligned address."""
    reserve = libc.mmap(None, n + HUGE, 0, 0x22 | 0x4000, -1, 0)  # PROT_NONE, PRIVATE|ANONYMOUS|NORESERVE
    if reserve in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap reserve")
    at = (reserve + HUGE - 1) // HUGE * HUGE
    p = libc.mmap(at, n, 3, 0x01 | 0x10, fd, 0)  # READ|WRITE, SHARED|FIXED
    if p != at:
        raise OSError(ctypes.get_errno(), "mmap fixed")
    return p


def shmem() -> dict[str, str]:
    with open("/proc/meminfo") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k.startswith("ShmemHuge")}


def probe(folder: str, n: int, collapse: bool) -> None:
    path = os.path.join(folder, f"kvtier-probe-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        libc.posix_fallocate(fd, 0, n)
        p = aligned_map(fd, n)
        what = "fallocate"
        if collapse:
            t = time.perf_counter()
            rc = libc.madvise(p, n, MADV_COLLAPSE)
            err = os.strerror(ctypes.get_errno()) if rc else "ok"
            what = f"fallocate + MADV_COLLAPSE ({err}, {time.perf_counter() - t:.2f} s)"
        q = aligned_map(fd, n)
        src = ctypes.create_string_buffer(256 << 20)
        t = time.perf_counter()
        for off in range(0, n, 256 << 20):
            ctypes.memmove(q + off, src, min(256 << 20, n - off))
        rate = n / (time.perf_counter() - t) / 1e9
        print(f"{what}: {shmem()}; first-touch copy {rate:.1f} GB/s")
        libc.munmap(p, n)
        libc.munmap(q, n)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--gib", type=float, default=1.0)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // HUGE * HUGE
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        print("shmem_enabled:", f.read().strip(), "| kernel", os.uname().release)
    probe(a.dir, n, collapse=True)
    probe(a.dir, n, collapse=False)


if __name__ == "__main__":
    main()
