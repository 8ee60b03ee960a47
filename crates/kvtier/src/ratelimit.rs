//! Rate-limited logging: [`RateLimit`] lets at most `burst` events through per `window` and
//! counts the rest; [`warn_limited!`](crate::warn_limited) is `tracing::warn!` through a
//! limiter of its own call site, adding `suppressed = N` (events dropped since the last line
//! it let through) to each line.
//!
//! Invariant: under a flood of one repeated warning, a call site logs at most `burst` lines per
//! window, and no event is lost from the count: the next line let through carries the number of
//! lines suppressed before it.
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[doc(hidden)]
pub use tracing as __tracing;

#[derive(Debug)]
struct State {
    window_start: Option<Instant>,
    in_window: u32,
    suppressed: u64,
}

/// A limiter of `burst` events per `window`. See the module docs.
#[derive(Debug)]
pub struct RateLimit {
    burst: u32,
    window: Duration,
    state: Mutex<State>,
}

impl RateLimit {
    /// At most `burst` events per `window`.
    pub const fn new(burst: u32, window: Duration) -> Self {
        RateLimit {
            burst,
            window,
            state: Mutex::new(State {
                window_start: None,
                in_window: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(suppressed)` when this event may be logged (with the count of events suppressed
    /// since the last one that was), `None` when it is suppressed (and counted).
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = s
            .window_start
            .is_none_or(|t| now.saturating_duration_since(t) >= self.window);
        if fresh {
            s.window_start = Some(now);
            s.in_window = 0;
        }
        if s.in_window < self.burst {
            s.in_window += 1;
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed = s.suppressed.saturating_add(1);
            None
        }
    }
}

/// `tracing::warn!` limited to 10 lines per 10 s at this call site; each line carries
/// `suppressed = N`, the lines this call site dropped since the last one it logged.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static LIMIT: $crate::ratelimit::RateLimit =
            $crate::ratelimit::RateLimit::new(10, ::std::time::Duration::from_secs(10));
        if let Some(suppressed) = LIMIT.check() {
            $crate::ratelimit::__tracing::warn!(suppressed, $($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_suppressed_and_counted() {
        let r = RateLimit::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let got: Vec<Option<u64>> = (0..10).map(|_| r.check_at(t0)).collect();
        assert_eq!(&got[..3], &[Some(0), Some(0), Some(0)]);
        assert!(got[3..].iter().all(Option::is_none));
        // The next window's first line carries the 7 suppressed ones.
        assert_eq!(r.check_at(t0 + Duration::from_secs(11)), Some(7));
        assert_eq!(r.check_at(t0 + Duration::from_secs(11)), Some(0));
    }

    #[test]
    fn macro_expands() {
        for i in 0..50 {
            crate::warn_limited!(i, "test line");
        }
    }
}
