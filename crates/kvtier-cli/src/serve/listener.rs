//! The HTTP/1 accept loop of `serve`, with the bounds `axum::serve` lacks.
//!
//! Invariants:
//! - a connection that does not deliver a complete request head within `header_timeout` is closed;
//!   this also bounds idle keep-alive connections (hyper starts the timer whenever it waits for the
//!   next request), so half-open and idle sockets cannot pile up and starve `/health`;
//! - request bodies are read by the handlers under `body_timeout` and `max_body_bytes`
//!   (`crate::serve::server::read_body`);
//! - once `shutdown` resolves, no connection is accepted, open ones are asked to finish, and after
//!   `shutdown_grace` the rest are dropped: `serve` always returns within `shutdown_grace` of the
//!   signal, also while a client holds a half-sent request.
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// Bounds of the HTTP server (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Complete request head (and idle keep-alive wait) within this. Default 10 s.
    pub header_timeout: Duration,
    /// Complete request body within this. Default 30 s.
    pub body_timeout: Duration,
    /// Largest request body accepted (larger: 413, read no further). Default 1 MiB (#28: a 15 MB
    /// chat body peaked the server at 511 MB before it was refused).
    pub max_body_bytes: usize,
    /// How long open connections may finish after the shutdown signal. Default 10 s.
    pub shutdown_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 1 << 20,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains (see the module docs).
pub async fn run(
    listener: tokio::net::TcpListener,
    router: Router,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer): (tokio::net::TcpStream, SocketAddr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let svc = TowerToHyperService::new(router.clone());
                let conn = builder.serve_connection(TokioIo::new(stream), svc);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection closed with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(opts.shutdown_grace) => {
            tracing::warn!(grace = ?opts.shutdown_grace, "connections still open after the shutdown grace period; closing them");
        }
    }
    Ok(())
}
