//! Regression tests of the HTTP server's bounds (#13): in-flight accounting on client
//! disconnect, 405/413 as OpenAI JSON, header/idle timeouts, bounded shutdown.
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;
use crate::backend::fake::FakeBackend;
use crate::serve::http_client::{self, HttpUrl};
use crate::serve::listener::ServeOptions;

const T: Duration = Duration::from_secs(10);

struct Running {
    url: HttpUrl,
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

async fn start(backend: Arc<FakeBackend>, limits: ServeOptions) -> Running {
    let state = AppState::with_limits(backend, Generator::Local, "agg", limits);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (atx, arx) = tokio::sync::oneshot::channel();
    let done = tokio::spawn(async move {
        let _ = serve(
            state,
            "127.0.0.1:0".parse().unwrap_or_else(|_| unreachable!()),
            |a| {
                let _ = atx.send(a);
            },
            async move {
                let _ = rx.await;
            },
        )
        .await;
    });
    let addr = arx.await.expect("server bound");
    Running {
        url: HttpUrl::parse(&format!("http://{addr}")).expect("url"),
        addr,
        stop: Some(tx),
        done,
    }
}

async fn gauge(url: &HttpUrl, name: &str) -> f64 {
    let (_, bytes) = http_client::call(url, "GET", "/metrics", None, T)
        .await
        .expect("metrics");
    let text = String::from_utf8_lossy(&bytes).to_string();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn request(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Regression (#13, wrong reporting): `kvtier_requests_in_flight` grew by one per client that
/// disconnected mid-request (the decrement ran only when the response completed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_returns_to_zero_when_clients_disconnect() {
    let mut b = FakeBackend::new();
    b.hang = true;
    let b = Arc::new(b);
    let srv = start(b.clone(), ServeOptions::default()).await;
    for stream in [false, true] {
        for _ in 0..3 {
            let mut c = TcpStream::connect(srv.addr).await.expect("connect");
            let body = json!({"prompt": "abc", "max_tokens": 5, "stream": stream}).to_string();
            c.write_all(request("/v1/completions", &body).as_bytes())
                .await
                .expect("send");
            if stream {
                let mut buf = [0u8; 64];
                let _ = c.read(&mut buf).await;
            }
            // Wait until the engine has the request, then hang up.
            let deadline = Instant::now() + T;
            while b.held.lock().map(|h| h.len()).unwrap_or(0) == 0 {
                assert!(Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(gauge(&srv.url, "kvtier_requests_in_flight").await, 1.0);
            drop(c);
            let deadline = Instant::now() + T;
            while gauge(&srv.url, "kvtier_requests_in_flight").await != 0.0 {
                assert!(
                    Instant::now() < deadline,
                    "in-flight gauge stuck after a disconnect"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            b.held.lock().map(|mut h| h.clear()).unwrap_or(());
        }
    }
    // #28: the three non-streaming disconnects are counted (they were missing).
    let closed = "kvtier_http_requests_total{endpoint=\"completions\",status=\"499\"}";
    assert_eq!(gauge(&srv.url, closed).await, 3.0);
}

/// Regression (#13, unclear errors): 405 and 413 answers were plain text, not OpenAI JSON.
#[tokio::test]
async fn method_not_allowed_and_too_large_are_openai_json() {
    let limits = ServeOptions {
        max_body_bytes: 1000,
        ..ServeOptions::default()
    };
    let srv = start(Arc::new(FakeBackend::new()), limits).await;
    let (status, bytes) = http_client::call(&srv.url, "GET", "/v1/completions", None, T)
        .await
        .expect("call");
    assert_eq!(status, 405);
    let v: Value = serde_json::from_slice(&bytes).expect("405 body is JSON");
    assert_eq!(v["error"]["code"], "method_not_allowed");
    let big = json!({"prompt": "x".repeat(5000)});
    let (status, bytes) = http_client::call(&srv.url, "POST", "/v1/completions", Some(&big), T)
        .await
        .expect("call");
    assert_eq!(status, 413);
    let v: Value = serde_json::from_slice(&bytes).expect("413 body is JSON");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "payload_too_large");
}

/// Regression (#13, hangs): the server had no header/body/idle timeouts; 1,100 half-open
/// connections made `/health` time out. A connection that sends half a head, or nothing, or
/// half a body, is closed within the bound, and `/health` keeps answering meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_and_idle_connections_are_closed_within_the_timeouts() {
    let limits = ServeOptions {
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        ..ServeOptions::default()
    };
    let srv = start(Arc::new(FakeBackend::new()), limits).await;
    let mut half_head = Vec::new();
    for _ in 0..200 {
        let mut c = TcpStream::connect(srv.addr).await.expect("connect");
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost:")
            .await
            .expect("send");
        half_head.push(c);
    }
    let idle = TcpStream::connect(srv.addr).await.expect("connect");
    let mut half_body = TcpStream::connect(srv.addr).await.expect("connect");
    half_body
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        .await
        .expect("send");
    let t0 = Instant::now();
    let (status, _) = http_client::call(&srv.url, "GET", "/health", None, T)
        .await
        .expect("health");
    assert_eq!(status, 200);
    for mut c in half_head.into_iter().chain([idle]) {
        let mut buf = [0u8; 256];
        // EOF (or a reset) within the bound: the server closed it.
        let _closed = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("connection left open past the header timeout");
    }
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), half_body.read(&mut buf))
        .await
        .expect("half-sent body left open past the body timeout")
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// Regression (#13, hangs): shutdown never completed while a client held a half-sent request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_within_the_grace_period_despite_a_half_sent_request() {
    let limits = ServeOptions {
        header_timeout: Duration::from_secs(60),
        body_timeout: Duration::from_secs(60),
        shutdown_grace: Duration::from_millis(500),
        ..ServeOptions::default()
    };
    let mut srv = start(Arc::new(FakeBackend::new()), limits).await;
    let mut c = TcpStream::connect(srv.addr).await.expect("connect");
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let _ = srv.stop.take().map(|s| s.send(()));
    tokio::time::timeout(Duration::from_secs(5), &mut srv.done)
        .await
        .expect("serve did not return after the shutdown signal")
        .expect("serve task");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}

/// Regression (#28): the default body limit was 16 MiB (a 15 MB chat body peaked the server at
/// 511 MB before it was refused); a 2 MiB body is now refused with 413 under the defaults.
#[tokio::test]
async fn default_body_limit_refuses_two_megabytes() {
    assert_eq!(ServeOptions::default().max_body_bytes, 1 << 20);
    let srv = start(Arc::new(FakeBackend::new()), ServeOptions::default()).await;
    let big = json!({"prompt": "x".repeat(2 << 20)});
    let (status, _) = http_client::call(&srv.url, "POST", "/v1/completions", Some(&big), T)
        .await
        .expect("call");
    assert_eq!(status, 413);
}

/// Regression (#28): `Address already in use` named no address.
#[tokio::test]
async fn bind_error_names_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let state = AppState::with_limits(
        Arc::new(FakeBackend::new()),
        Generator::Local,
        "agg",
        ServeOptions::default(),
    );
    let e = serve(state, addr, |_| {}, async {})
        .await
        .expect_err("bound a taken port");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}
