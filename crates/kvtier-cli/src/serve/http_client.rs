//! A minimal HTTP/1.1 client (hyper, one connection per request) for `http://host:port/path` URLs.
//!
//! Used by decode-mode `serve` to reach its prefill server, and by tests. Invariant: every call is bounded
//! by the caller-supplied timeout and returns an error instead of hanging; SSE bodies are parsed into
//! `data:` payloads in order.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper_util::rt::TokioIo;

/// Errors reaching or reading from a server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `http://host:port[/path]`.
    #[error("bad url `{0}` (expected http://host:port[/path])")]
    BadUrl(String),
    /// The TCP connection failed.
    #[error("connecting to {addr}: {source}")]
    Connect {
        /// The `host:port` dialled.
        addr: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    /// The request could not be built.
    #[error("building request: {0}")]
    Request(#[from] hyper::http::Error),
    /// No complete answer within the timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// A parsed `http://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    /// `host:port`.
    pub authority: String,
    /// Path prefix without trailing slash (may be empty).
    pub base_path: String,
}

impl HttpUrl {
    /// Parses `http://host[:port][/path]`.
    pub fn parse(url: &str) -> Result<Self, ClientError> {
        let (authority, base_path) = kvtier::config::parse_http_endpoint(url)
            .map_err(|_| ClientError::BadUrl(url.to_string()))?;
        Ok(HttpUrl {
            authority,
            base_path,
        })
    }

    /// The full path for an endpoint such as `/v1/completions`.
    pub fn path(&self, endpoint: &str) -> String {
        format!("{}{endpoint}", self.base_path)
    }
}

async fn send(
    url: &HttpUrl,
    method: &str,
    endpoint: &str,
    payload: Bytes,
) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
    let stream = tokio::net::TcpStream::connect(&url.authority)
        .await
        .map_err(|source| ClientError::Connect {
            addr: url.authority.clone(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!("client connection closed: {e}");
        }
    });
    let req = hyper::Request::builder()
        .method(method)
        .uri(url.path(endpoint))
        .header("host", &url.authority)
        .header("content-type", "application/json")
        .body(Full::new(payload))?;
    Ok(sender.send_request(req).await?)
}

/// One request with `payload` as its body, the whole response body read, all within `timeout`.
async fn exchange(
    url: &HttpUrl,
    method: &str,
    endpoint: &str,
    payload: Bytes,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), ClientError> {
    let fut = async {
        let resp = send(url, method, endpoint, payload).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ClientError::Timeout(timeout))?
}

/// Sends a request (with `body` as JSON, if any) and reads the whole body.
pub async fn call(
    url: &HttpUrl,
    method: &str,
    endpoint: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), ClientError> {
    let payload = body.map(|v| Bytes::from(v.to_string())).unwrap_or_default();
    exchange(url, method, endpoint, payload, timeout).await
}

/// Posts a raw body (for malformed-JSON tests).
pub async fn call_raw(
    url: &HttpUrl,
    endpoint: &str,
    raw: &'static [u8],
    timeout: Duration,
) -> Result<(StatusCode, Bytes), ClientError> {
    exchange(url, "POST", endpoint, Bytes::from_static(raw), timeout).await
}

/// Posts JSON and returns the status plus the `data:` payloads of the SSE body, in order.
pub async fn post_sse(
    url: &HttpUrl,
    endpoint: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(StatusCode, Vec<String>), ClientError> {
    let (status, bytes) = call(url, "POST", endpoint, Some(body), timeout).await?;
    Ok((status, parse_sse(&String::from_utf8_lossy(&bytes))))
}

/// Extracts the `data:` payloads of an SSE body (events separated by blank lines).
pub fn parse_sse(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for event in text.split("\n\n") {
        let mut data = Vec::new();
        for line in event.lines() {
            if let Some(d) = line.strip_prefix("data:") {
                data.push(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        if !data.is_empty() {
            out.push(data.join("\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let u = HttpUrl::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!(u.authority, "127.0.0.1:8000");
        assert_eq!(u.path("/v1/models"), "/v1/models");
        let u = HttpUrl::parse("http://localhost/api/").unwrap();
        assert_eq!(u.authority, "localhost:80");
        assert_eq!(u.path("/v1/models"), "/api/v1/models");
        assert!(HttpUrl::parse("https://x").is_err());
        assert!(HttpUrl::parse("http://").is_err());
        assert_eq!(
            HttpUrl::parse("http://[::1]:9000/x").unwrap().authority,
            "[::1]:9000"
        );
    }

    #[test]
    fn parses_sse() {
        let body = "data: {\"a\":1}\n\ndata: [DONE]\n\n";
        assert_eq!(
            parse_sse(body),
            vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]
        );
    }
}
