//! Test builds only: the global allocator of the crate's unit tests, the system allocator with
//! per-thread counters of the bytes held and their peak, so a test can bound what one operation
//! allocates ([`peak_during`]).
//!
//! Invariant: every call is forwarded to `System` unchanged; the counters only observe (they
//! are const-initialised thread-locals, which never allocate, and are skipped while a thread
//! is being torn down).
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = HELD.try_with(|h| {
        let v = h.get() + delta;
        h.set(v);
        let _ = PEAK.try_with(|p| {
            if v > p.get() {
                p.set(v);
            }
        });
    });
}

/// See the module docs.
pub(crate) struct Counting;

// SAFETY: each method forwards its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the bookkeeping neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        // SAFETY: `ptr` was allocated by `System` (every allocation goes through it) with
        // `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize);
        // SAFETY: as for `dealloc`, and the caller guarantees `new_size` is valid for `layout`'s
        // alignment.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns its result and the most bytes this thread held allocated at once
/// during it, above what it held before.
pub(crate) fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = HELD.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get) - base;
    (r, usize::try_from(peak).unwrap_or(0))
}
