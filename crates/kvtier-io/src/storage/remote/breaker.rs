//! The circuit breaker in front of a remote server: it opens at once when the server refuses the
//! connection (nothing listens: [`Failure::Refused`]), and after `trip_after` consecutive other
//! connection-level failures (a missed deadline, a reset, a protocol error: [`Failure::Failed`]),
//! so one slow reply from a busy but alive server does not declare it down; while open,
//! operations fail at once instead of each waiting for its own timeout; when the window ends
//! exactly one operation probes the server (all others keep failing fast while it is in flight);
//! a probe that fails reopens the breaker for twice the window (up to `max_backoff`), one that
//! succeeds closes it.
//!
//! Invariants:
//! - while closed, any success (a reply, even an error reply) resets the count of consecutive
//!   failures: only an unbroken run of `trip_after` failures (or one refusal) opens the breaker;
//! - at most one operation is admitted while the breaker is not closed (the probe), so a stalled
//!   server costs one timeout per window, not one per caller; operations admitted just before
//!   it opened re-check with [`Ticket::still_admitted`] once they hold a connection, so at most
//!   one per pool connection waits out the failure that opens it;
//! - a probe that is dropped without a verdict (a panic) reopens the breaker, it never stays
//!   half-open;
//! - the counters only grow; `state` is the state after the last transition.
//!
//! Locking: `inner` guards the state; it is never held across network I/O.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The breaker's state, as reported in [`BreakerStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Operations go to the server.
    Closed,
    /// Operations fail at once until the window ends.
    Open,
    /// One operation (the probe) is testing the server; the others fail at once.
    Probing,
}

/// Counters and state of a breaker (all counters since the store was opened).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerStats {
    /// Whether operations reach the server now.
    pub state: BreakerState,
    /// Operations that reached the server (including probes).
    pub attempted: u64,
    /// Of those, the ones that failed at the connection level.
    pub failed: u64,
    /// Operations refused at once because the breaker was open or probing.
    pub short_circuited: u64,
    /// Times the breaker went from closed to open.
    pub opened: u64,
    /// Probes sent after a window ended.
    pub probes: u64,
}

#[derive(Debug)]
struct Inner {
    state: Phase,
    /// Consecutive `Failed` operations while closed.
    fails: u32,
    /// Consecutive windows opened without a successful operation in between.
    streak: u32,
    reason: String,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open { until: Instant },
    Probing,
}

/// See the module docs. A zero `backoff` disables the breaker (every operation is admitted).
#[derive(Debug)]
pub(crate) struct Breaker {
    backoff: Duration,
    trip_after: u32,
    max_backoff: Duration,
    inner: Mutex<Inner>,
    attempted: AtomicU64,
    failed: AtomicU64,
    short_circuited: AtomicU64,
    opened: AtomicU64,
    probes: AtomicU64,
}

/// How an admitted operation failed at the connection level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Nothing accepted the connection: the server is down; opens the breaker at once.
    Refused,
    /// A missed deadline, a reset or a protocol error: the server may only be slow or busy;
    /// opens the breaker after `trip_after` of these in a row.
    Failed,
}

/// Why an operation was not admitted.
pub(crate) struct Refused(pub(crate) String);

/// An admitted operation; report its outcome with [`Ticket::success`] or [`Ticket::failure`].
#[must_use]
pub(crate) struct Ticket<'a> {
    breaker: &'a Breaker,
    probe: bool,
    settled: bool,
}

impl Breaker {
    /// A breaker that opens after `trip_after` (at least 1) consecutive failures.
    pub(crate) fn new(backoff: Duration, max_backoff: Duration, trip_after: u32) -> Self {
        Breaker {
            backoff,
            trip_after: trip_after.max(1),
            max_backoff: max_backoff.max(backoff),
            inner: Mutex::new(Inner {
                state: Phase::Closed,
                fails: 0,
                streak: 0,
                reason: String::new(),
            }),
            attempted: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            short_circuited: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            probes: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits an operation, or refuses it at once with the reason the server is considered down.
    pub(crate) fn admit(&self) -> Result<Ticket<'_>, Refused> {
        let mut g = self.lock();
        let probe = match g.state {
            Phase::Closed => false,
            Phase::Open { until } if Instant::now() >= until => {
                g.state = Phase::Probing;
                self.probes.fetch_add(1, Ordering::Relaxed);
                true
            }
            Phase::Open { .. } | Phase::Probing => {
                self.short_circuited.fetch_add(1, Ordering::Relaxed);
                return Err(Refused(format!("server marked down after: {}", g.reason)));
            }
        };
        self.attempted.fetch_add(1, Ordering::Relaxed);
        Ok(Ticket {
            breaker: self,
            probe,
            settled: false,
        })
    }

    fn window(&self, streak: u32) -> Duration {
        let factor = 1u32 << streak.saturating_sub(1).min(16);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }

    fn open(&self, g: &mut Inner, reason: String, was_probe: bool, how: Failure) {
        if self.backoff.is_zero() {
            g.state = Phase::Closed;
            return;
        }
        if !was_probe && matches!(g.state, Phase::Closed) && how == Failure::Failed {
            g.fails = g.fails.saturating_add(1);
            if g.fails < self.trip_after {
                tracing::debug!(error = %reason, fails = g.fails, "remote operation failed");
                return;
            }
        }
        g.fails = 0;
        // Another operation admitted while closed may fail after the breaker already opened:
        // it does not extend the window.
        if !was_probe && !matches!(g.state, Phase::Closed) {
            return;
        }
        g.streak = g.streak.saturating_add(1);
        let window = self.window(g.streak);
        if matches!(g.state, Phase::Closed) {
            self.opened.fetch_add(1, Ordering::Relaxed);
            kvtier::warn_limited!(error = %reason, ?window, "remote server marked down");
        } else {
            tracing::debug!(error = %reason, ?window, "remote server probe failed");
        }
        g.state = Phase::Open {
            until: Instant::now() + window,
        };
        g.reason = reason;
    }

    pub(crate) fn stats(&self) -> BreakerStats {
        let state = match self.lock().state {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { .. } => BreakerState::Open,
            Phase::Probing => BreakerState::Probing,
        };
        BreakerStats {
            state,
            attempted: self.attempted.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            short_circuited: self.short_circuited.load(Ordering::Relaxed),
            opened: self.opened.load(Ordering::Relaxed),
            probes: self.probes.load(Ordering::Relaxed),
        }
    }
}

impl Ticket<'_> {
    /// The server answered (a reply, even an error reply): close the breaker.
    pub(crate) fn success(mut self) {
        self.settled = true;
        let mut g = self.breaker.lock();
        match (self.probe, g.state) {
            (true, _) => {
                tracing::info!("remote server reachable again");
                g.state = Phase::Closed;
                g.streak = 0;
                g.fails = 0;
            }
            (false, Phase::Closed) => {
                g.streak = 0;
                g.fails = 0;
            }
            // Opened by another operation meanwhile: only a probe closes it.
            (false, _) => {}
        }
    }

    /// False when the breaker opened after this (non-probe) operation was admitted: an operation
    /// that waited for a pool connection meanwhile then fails fast instead of adding its own
    /// timeout.
    pub(crate) fn still_admitted(&self) -> bool {
        self.probe || matches!(self.breaker.lock().state, Phase::Closed)
    }

    /// The operation was not sent after all (see [`Ticket::still_admitted`]): counted as
    /// short-circuited.
    pub(crate) fn withdraw(mut self) {
        self.settled = true;
        self.breaker.attempted.fetch_sub(1, Ordering::Relaxed);
        self.breaker.short_circuited.fetch_add(1, Ordering::Relaxed);
    }

    /// The operation failed at the connection level: open (or reopen) the breaker, at once for a
    /// refusal or a failed probe, after `trip_after` in a row otherwise.
    pub(crate) fn failure(mut self, reason: String, how: Failure) {
        self.settled = true;
        self.breaker.failed.fetch_add(1, Ordering::Relaxed);
        let mut g = self.breaker.lock();
        self.breaker.open(&mut g, reason, self.probe, how);
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.settled && self.probe {
            let mut g = self.breaker.lock();
            self.breaker
                .open(&mut g, "probe abandoned".into(), true, Failure::Refused);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn opens_on_failure_probes_once_and_doubles_the_window() {
        let b = Breaker::new(ms(40), ms(100), 3);
        b.admit()
            .ok()
            .unwrap()
            .failure("reset".into(), Failure::Refused);
        assert_eq!(b.stats().state, BreakerState::Open);
        assert!(b.admit().is_err(), "open: fails fast");
        std::thread::sleep(ms(45));
        let probe = b.admit().ok().unwrap();
        assert_eq!(b.stats().state, BreakerState::Probing);
        assert!(b.admit().is_err(), "only one probe at a time");
        probe.failure("timeout".into(), Failure::Failed);
        // Second window is 80 ms: still open after 45 ms.
        std::thread::sleep(ms(45));
        assert!(b.admit().is_err());
        std::thread::sleep(ms(40));
        b.admit().ok().unwrap().success();
        assert_eq!(b.stats().state, BreakerState::Closed);
        let s = b.stats();
        assert_eq!((s.opened, s.probes, s.failed), (1, 2, 2));
        assert_eq!(s.short_circuited, 3);
        assert_eq!(b.window(1), ms(40));
        assert_eq!(b.window(2), ms(80));
        assert_eq!(b.window(3), ms(100), "capped by max_backoff");
    }

    #[test]
    fn abandoned_probe_reopens() {
        let b = Breaker::new(ms(10), ms(10), 3);
        b.admit()
            .ok()
            .unwrap()
            .failure("x".into(), Failure::Refused);
        std::thread::sleep(ms(15));
        drop(b.admit().ok().unwrap());
        assert_eq!(b.stats().state, BreakerState::Open);
    }

    #[test]
    fn zero_backoff_never_opens() {
        let b = Breaker::new(Duration::ZERO, Duration::ZERO, 1);
        b.admit()
            .ok()
            .unwrap()
            .failure("x".into(), Failure::Refused);
        assert_eq!(b.stats().state, BreakerState::Closed);
        assert!(b.admit().is_ok());
    }

    /// Regression (#28): a healthy store on a busy machine was declared down by one GET that
    /// missed its deadline. Timeouts trip the breaker only `trip_after` in a row; any reply in
    /// between starts the count again; a refused connection still opens it at once.
    #[test]
    fn slow_replies_trip_only_after_a_run_of_failures() {
        let b = Breaker::new(ms(1000), ms(1000), 3);
        for _ in 0..2 {
            b.admit()
                .ok()
                .unwrap()
                .failure("deadline".into(), Failure::Failed);
            assert_eq!(b.stats().state, BreakerState::Closed);
        }
        b.admit().ok().unwrap().success();
        for _ in 0..2 {
            b.admit()
                .ok()
                .unwrap()
                .failure("deadline".into(), Failure::Failed);
        }
        assert_eq!(
            b.stats().state,
            BreakerState::Closed,
            "count restarts after a reply"
        );
        b.admit()
            .ok()
            .unwrap()
            .failure("deadline".into(), Failure::Failed);
        assert_eq!(b.stats().state, BreakerState::Open, "third in a row");
        assert_eq!(b.stats().opened, 1);

        let b = Breaker::new(ms(1000), ms(1000), 3);
        b.admit()
            .ok()
            .unwrap()
            .failure("refused".into(), Failure::Refused);
        assert_eq!(
            b.stats().state,
            BreakerState::Open,
            "a refusal opens at once"
        );
    }
}
