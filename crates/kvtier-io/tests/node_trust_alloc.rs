//! A frame's declared length costs the node nothing until its bytes arrive (issue 26): a client
//! that declares a 4 MiB frame and sends a few bytes makes the node allocate only for what it
//! sent. Alone in its test binary: a counting allocator watches the largest allocation.
#![allow(clippy::unwrap_used)]
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvtier_io::storage::node::{
    NodeOptions, NodeServer, Reply, Request, MAX_FRAME, NODE_PROTOCOL_VERSION,
};

struct Watch;

static WATCHING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(n, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Watch = Watch;

#[test]
fn a_declared_frame_length_is_not_allocated_before_its_bytes_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = NodeOptions::new(dir.path().join("node.sock"), 1 << 20);
    o.shm_dir = dir.path().to_path_buf();
    let n = NodeServer::start(&o).unwrap();
    let mut s = UnixStream::connect(n.socket()).unwrap();
    let body = postcard::to_stdvec(&Request::Hello {
        version: NODE_PROTOCOL_VERSION,
        namespace: "m".into(),
    })
    .unwrap();
    s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut buf).unwrap();
    assert!(matches!(
        postcard::from_bytes::<Reply>(&buf).unwrap(),
        Reply::Welcome { .. }
    ));
    s.read_exact(&mut [0u8; 1]).unwrap();
    LARGEST.store(0, Ordering::SeqCst);
    WATCHING.store(true, Ordering::SeqCst);
    // Declares the largest frame allowed, sends 16 bytes of it, and waits.
    s.write_all(&(MAX_FRAME as u32).to_le_bytes()).unwrap();
    s.write_all(&[0u8; 16]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    WATCHING.store(false, Ordering::SeqCst);
    let largest = LARGEST.load(Ordering::SeqCst);
    assert!(
        largest < 64 << 10,
        "the node allocated {largest} bytes for 16 received"
    );
    drop(s);
}
