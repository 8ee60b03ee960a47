//! kvtier's Prometheus endpoint inside an engine process (`metrics.enabled`, `metrics.port`,
//! `DYN_KVBM_METRICS`, `DYN_KVBM_METRICS_PORT`), as Dynamo KVBM served it: `GET /metrics` on
//! `0.0.0.0:<port>` (6880 by default) renders [`kvtier::metrics::METRICS`] over every live
//! leader of the process.
//!
//! Invariants: one endpoint per process: the first [`register`] binds the port and starts the
//! serving thread; later registrations (a second leader, or a leader rebuilt after a restart)
//! join it, whatever port they ask for (a different port is logged). A leader publishes
//! snapshots of its stats into its [`StatsPublisher`]; the endpoint only reads those snapshots,
//! so a scrape never takes a leader's lock. A dropped publisher's series leave the sum. The
//! serving thread lives for the rest of the process (it blocks in `accept`).
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvtier::connector::LeaderStats;

/// A leader's latest stats snapshot, shared with the endpoint.
#[derive(Clone, Debug, Default)]
pub struct StatsPublisher(Arc<Mutex<LeaderStats>>);

impl StatsPublisher {
    /// A publisher holding default (zero) stats until the first `publish`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replace the snapshot the endpoint serves.
    pub fn publish(&self, stats: LeaderStats) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = stats;
    }

    /// A copy of the latest published stats.
    pub fn snapshot(&self) -> LeaderStats {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Endpoint {
    addr: SocketAddr,
    sources: Arc<Mutex<Vec<Weak<Mutex<LeaderStats>>>>>,
}

static ENDPOINT: Mutex<Option<Endpoint>> = Mutex::new(None);

/// Where the process's endpoint listens, once one was started.
pub fn endpoint_addr() -> Option<SocketAddr> {
    ENDPOINT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|e| e.addr)
}

/// Serve `publisher`'s stats on the process's endpoint, starting it on `port` (0 = any free
/// port, for tests) if this is the first registration. Returns the endpoint's address.
pub fn register(port: u16, publisher: &StatsPublisher) -> std::io::Result<SocketAddr> {
    let mut g = ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = g.as_ref() {
        if port != 0 && port != e.addr.port() {
            tracing::warn!(
                asked = port,
                serving = e.addr.port(),
                "kvtier metrics: one endpoint per process; this leader joins the running one"
            );
        }
        let mut s = e.sources.lock().unwrap_or_else(|p| p.into_inner());
        s.retain(|w| w.strong_count() > 0);
        s.push(Arc::downgrade(&publisher.0));
        return Ok(e.addr);
    }
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("kvtier metrics: cannot listen on port {port} (metrics.port): {e}"),
        )
    })?;
    let addr = listener.local_addr()?;
    let sources = Arc::new(Mutex::new(vec![Arc::downgrade(&publisher.0)]));
    let served = Arc::clone(&sources);
    std::thread::Builder::new()
        .name("kvtier-metrics".into())
        .spawn(move || serve(listener, &served))?;
    tracing::info!(%addr, "kvtier metrics endpoint");
    *g = Some(Endpoint { addr, sources });
    Ok(addr)
}

fn serve(listener: TcpListener, sources: &Mutex<Vec<Weak<Mutex<LeaderStats>>>>) {
    for conn in listener.incoming() {
        match conn {
            Ok(c) => {
                if let Err(e) = answer(c, sources) {
                    tracing::debug!(error = %e, "kvtier metrics: a scrape failed");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "kvtier metrics: accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The exposition text of every live source, summed.
pub fn render(sources: &Mutex<Vec<Weak<Mutex<LeaderStats>>>>) -> String {
    let live: Vec<LeaderStats> = sources
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).clone())
        .collect();
    kvtier::metrics::render_prometheus(&live)
}

fn answer(mut c: TcpStream, sources: &Mutex<Vec<Weak<Mutex<LeaderStats>>>>) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    c.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut reader = BufReader::new(c.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Skip the headers (a scrape carries no body).
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = if method == "GET" && (path == "/metrics" || path == "/") {
        (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(sources),
        )
    } else {
        ("404 Not Found", "text/plain", "not found\n".to_string())
    };
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    c.flush()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Read;

    use super::*;

    fn scrape(addr: SocketAddr, path: &str) -> String {
        let mut c = TcpStream::connect(("127.0.0.1", addr.port())).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn one_endpoint_sums_live_leaders() {
        let a = StatsPublisher::new();
        let addr = register(0, &a).unwrap();
        let b = StatsPublisher::new();
        assert_eq!(register(0, &b).unwrap(), addr, "a second leader joins");
        let s = LeaderStats {
            host_capacity: 4,
            offload_confirmed: 3,
            onboard_host_blocks: 1,
            ..Default::default()
        };
        a.publish(s.clone());
        b.publish(s);
        let text = scrape(addr, "/metrics");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.contains("kvtier_blocks_total{direction=\"offload\",tier=\"host\"} 6"),
            "{text}"
        );
        drop(b);
        let text = scrape(addr, "/metrics");
        assert!(
            text.contains("kvtier_blocks_total{direction=\"onboard\",tier=\"host\"} 1"),
            "{text}"
        );
        assert!(scrape(addr, "/nope").starts_with("HTTP/1.1 404"));
        assert_eq!(endpoint_addr(), Some(addr));
    }
}
