//! Test support for the remote store's deadline tests (single server and cluster): timing one
//! operation and checking it failed as `Unavailable` within its bound.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvtier::transfer::{RemoteError, TransferError};

/// The result of `f` and how long it took.
pub(crate) fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

/// `r` is `Unavailable`, reached after at least `min` and before `bound`.
pub(crate) fn assert_unavailable_within<V: std::fmt::Debug>(
    what: &str,
    r: Result<V, TransferError>,
    took: Duration,
    min: Duration,
    bound: Duration,
) {
    assert!(
        matches!(
            r,
            Err(TransferError::Remote(RemoteError::Unavailable { .. }))
        ),
        "{what}: {r:?}"
    );
    assert!(took < bound, "{what} took {took:?} (bound {bound:?})");
    assert!(took >= min, "{what}: {took:?} (at least {min:?})");
}
