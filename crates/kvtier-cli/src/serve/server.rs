//! The OpenAI-compatible HTTP server: routes, request handling, SSE streaming.
//!
//! Invariants: every request body is validated by [`crate::serve::api`] before it reaches the engine; every
//! error leaves as OpenAI-style JSON (4xx for the client's mistakes, 503 when the engine is overloaded or
//! the prefill server unreachable, 500 for an engine failure); a stream always ends with `data: [DONE]`.
//! Generation itself goes through [`Generator`], which hides whether the first token comes from this
//! engine (aggregated, prefill) or from a remote prefill server (decode mode, see [`crate::serve::disagg`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::{Backend, FinishReason, Finished, GenEvent};
use crate::serve::api::{self, submit_error, ApiError, Validated};
use crate::serve::detok::Detokenizer;
use crate::serve::disagg::PrefillClient;
use crate::serve::listener::ServeOptions;
use crate::serve::prom::Exporter;

/// Where first tokens come from.
pub enum Generator {
    /// This engine computes the whole request (aggregated and prefill roles).
    Local,
    /// A prefill server computes the prompt and the first token; this engine continues.
    Decode(PrefillClient),
}

/// Shared state of one server.
pub struct AppState {
    /// The engine.
    pub backend: Arc<dyn Backend>,
    /// Where first tokens come from (this engine, or a prefill server).
    pub generator: Generator,
    /// The `/metrics` exporter.
    pub exporter: Exporter,
    next_id: AtomicU64,
    /// A label for `/health` (`agg`, `prefill`, `decode`).
    pub mode: &'static str,
    /// Timeouts and body limit of the HTTP server.
    pub limits: ServeOptions,
}

impl AppState {
    /// State for a server over `backend`.
    pub fn new(backend: Arc<dyn Backend>, generator: Generator, mode: &'static str) -> Arc<Self> {
        Self::with_limits(backend, generator, mode, ServeOptions::default())
    }

    /// As [`AppState::new`], with other server bounds.
    pub fn with_limits(
        backend: Arc<dyn Backend>,
        generator: Generator,
        mode: &'static str,
        limits: ServeOptions,
    ) -> Arc<Self> {
        Arc::new(AppState {
            backend,
            generator,
            exporter: Exporter::new(),
            next_id: AtomicU64::new(1),
            mode,
            limits,
        })
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Binds `addr` and serves until `shutdown` resolves. Returns the bound address through `on_bound`.
pub async fn serve(
    state: Arc<AppState>,
    addr: SocketAddr,
    on_bound: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    on_bound(listener.local_addr()?);
    let limits = state.limits;
    crate::serve::listener::run(listener, router(state), limits, shutdown).await
}

/// Counts one request in `kvtier_requests_in_flight` for as long as it lives. It is dropped when
/// the response is complete or failed, and also when the client goes away mid-request (the
/// handler future or the SSE stream is dropped), which explicit decrements missed.
struct InFlight(Arc<AppState>);

impl InFlight {
    fn new(st: Arc<AppState>) -> Self {
        st.exporter.in_flight(1.0);
        InFlight(st)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.exporter.in_flight(-1.0);
    }
}

/// The status a non-streaming request is counted under in `kvtier_http_requests_total` when its
/// client went away before the answer (nginx's "client closed request").
const CLIENT_CLOSED: u16 = 499;

/// Counts a non-streaming request whose handler is dropped before it answered (the client went
/// away) as [`CLIENT_CLOSED`] (#28: such requests were missing from the HTTP counters).
struct Unanswered<'a> {
    st: &'a AppState,
    endpoint: &'static str,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.st.exporter.http_request(self.endpoint, CLIENT_CLOSED);
        }
    }
}

/// Reads a request body within the server's body timeout and size limit (408 / 413 as OpenAI
/// errors).
async fn read_body(st: &AppState, body: axum::body::Body) -> Result<Bytes, ApiError> {
    let limit = st.limits.max_body_bytes;
    match tokio::time::timeout(st.limits.body_timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "request body not received within {:?}",
                st.limits.body_timeout
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("timeout"),
        }),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                Err(ApiError {
                    status: StatusCode::PAYLOAD_TOO_LARGE,
                    message: format!("request body is larger than {limit} bytes"),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("payload_too_large"),
                })
            } else {
                Err(ApiError::invalid(
                    format!("reading the request body: {e}"),
                    None,
                ))
            }
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    st.exporter.http_request("health", 200);
    Json(json!({"status": "ok", "model": st.backend.model_name(), "mode": st.mode})).into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.exporter.http_request("models", 200);
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.backend.model_name(),
            "object": "model",
            "created": 0,
            "owned_by": "kvtier",
            "max_model_len": st.backend.max_model_len(),
        }]
    }))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.exporter.http_request("metrics", 200);
    let text = st.exporter.render(&st.backend.samples());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Drops the engine's G1 prefix cache (as vLLM's endpoint of the same name); kvtier's tiers keep their
/// blocks, so the next matching request is served by onboarding.
async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    st.exporter.http_request("reset_prefix_cache", 200);
    st.backend.reset_prefix_cache();
    Json(json!({"status": "ok"})).into_response()
}

async fn method_not_allowed() -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed for this endpoint (completions take POST; /health, /v1/models and /metrics take GET)".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
    .into_response()
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint; try /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
    .into_response()
}

/// Which OpenAI object family a response belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Completion,
    Chat,
}

impl Flavor {
    fn endpoint(self) -> &'static str {
        match self {
            Flavor::Completion => "completions",
            Flavor::Chat => "chat_completions",
        }
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: axum::body::Body) -> Response {
    let v = match read_body(&st, body).await {
        Ok(b) => api::parse_completion(st.backend.as_ref(), &b),
        Err(e) => Err(e),
    };
    respond(st, v, Flavor::Completion).await
}

async fn chat(State(st): State<Arc<AppState>>, body: axum::body::Body) -> Response {
    let v = match read_body(&st, body).await {
        Ok(b) => api::parse_chat(st.backend.as_ref(), &b),
        Err(e) => Err(e),
    };
    respond(st, v, Flavor::Chat).await
}

/// Starts generation for a validated request.
pub async fn start(st: &AppState, v: &Validated) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    match &st.generator {
        Generator::Local => st.backend.submit(v.gen.clone()).map_err(submit_error),
        Generator::Decode(client) => {
            crate::serve::disagg::start(client, st.backend.as_ref(), &v.gen).await
        }
    }
}

async fn respond(st: Arc<AppState>, v: Result<Validated, ApiError>, flavor: Flavor) -> Response {
    let arrived = Instant::now();
    let v = match v {
        Ok(v) => v,
        Err(e) => {
            st.exporter
                .http_request(flavor.endpoint(), e.status.as_u16());
            return e.into_response();
        }
    };
    let rx = match start(&st, &v).await {
        Ok(rx) => rx,
        Err(e) => {
            st.exporter
                .http_request(flavor.endpoint(), e.status.as_u16());
            return e.into_response();
        }
    };
    let in_flight = InFlight::new(st.clone());
    let id = st.id(if flavor == Flavor::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    if v.stream {
        st.exporter.http_request(flavor.endpoint(), 200);
        stream_response(st, v, flavor, rx, id, arrived, in_flight)
    } else {
        let mut pending = Unanswered {
            st: &st,
            endpoint: flavor.endpoint(),
            answered: false,
        };
        let resp = full_response(&st, &v, flavor, rx, &id, arrived, in_flight).await;
        pending.answered = true;
        st.exporter
            .http_request(flavor.endpoint(), resp.status().as_u16());
        resp
    }
}

/// The usage object.
fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

async fn full_response(
    st: &AppState,
    v: &Validated,
    flavor: Flavor,
    mut rx: UnboundedReceiver<GenEvent>,
    id: &str,
    arrived: Instant,
    in_flight: InFlight,
) -> Response {
    let mut tokens = Vec::new();
    let mut ttft = None;
    let outcome = loop {
        match rx.recv().await {
            Some(GenEvent::Token(t)) => {
                ttft.get_or_insert_with(|| arrived.elapsed());
                tokens.push(t);
            }
            Some(GenEvent::Done(f)) => break Ok(f),
            Some(GenEvent::Error(e)) => {
                break Err(ApiError::internal(format!("generation failed: {e}")))
            }
            None => break Err(ApiError::internal("generation ended without a result")),
        }
    };
    drop(in_flight);
    let Finished {
        finish_reason: reason,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    } = match outcome {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    st.exporter
        .finished(ttft, arrived.elapsed(), prompt, completion, cached);
    let text = st.backend.codec().decode(&tokens);
    let mut choice = match flavor {
        Flavor::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason.as_str()})
        }
        Flavor::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": reason.as_str(),
        }),
    };
    if v.return_token_ids {
        choice["token_ids"] = json!(tokens);
    }
    let object = if flavor == Flavor::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(json!({
        "id": id,
        "object": object,
        "created": now_secs(),
        "model": v.model,
        "choices": [choice],
        "usage": usage(prompt, completion, cached),
    }))
    .into_response()
}

/// Per-stream state for the SSE body.
struct StreamState {
    st: Arc<AppState>,
    rx: UnboundedReceiver<GenEvent>,
    detok: Detokenizer,
    flavor: Flavor,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    return_token_ids: bool,
    arrived: Instant,
    ttft: Option<Duration>,
    /// Events still to send before reading the engine again (role chunk, final chunks).
    pending: std::collections::VecDeque<String>,
    done: bool,
    /// Released when the stream ends, or when the client disconnects and the stream is dropped.
    in_flight: Option<InFlight>,
}

impl StreamState {
    fn chunk(&self, delta_text: &str, tokens: &[u32], finish: Option<FinishReason>) -> String {
        let finish = finish.map(FinishReason::as_str);
        let mut choice = match self.flavor {
            Flavor::Completion => {
                json!({"index": 0, "text": delta_text, "logprobs": null, "finish_reason": finish})
            }
            Flavor::Chat => {
                let delta = if delta_text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": delta_text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        if self.return_token_ids {
            choice["token_ids"] = json!(tokens);
        }
        self.envelope(json!([choice]), None)
    }

    fn envelope(&self, choices: Value, usage: Option<Value>) -> String {
        let object = if self.flavor == Flavor::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v.to_string()
    }

    /// Next SSE payload, or None at the end.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Some(p);
            }
            if self.done {
                return None;
            }
            match self.rx.recv().await {
                Some(GenEvent::Token(t)) => {
                    self.ttft.get_or_insert_with(|| self.arrived.elapsed());
                    let delta = self.detok.push(t);
                    if !delta.is_empty() || self.return_token_ids {
                        return Some(self.chunk(&delta, &[t], None));
                    }
                }
                Some(GenEvent::Done(Finished {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                })) => {
                    self.done = true;
                    self.in_flight = None;
                    self.st.exporter.finished(
                        self.ttft,
                        self.arrived.elapsed(),
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    );
                    let tail = self.detok.finish();
                    let last = self.chunk(&tail, &[], Some(finish_reason));
                    self.pending.push_back(last);
                    if self.include_usage {
                        let u = usage(prompt_tokens, completion_tokens, cached_tokens);
                        self.pending.push_back(self.envelope(json!([]), Some(u)));
                    }
                    self.pending.push_back("[DONE]".into());
                }
                Some(GenEvent::Error(e)) => {
                    self.fail(format!("generation failed: {e}"));
                }
                None => {
                    self.fail("generation ended without a result".into());
                }
            }
        }
    }

    fn fail(&mut self, message: String) {
        self.done = true;
        self.in_flight = None;
        self.pending
            .push_back(ApiError::internal(message).body().to_string());
        self.pending.push_back("[DONE]".into());
    }
}

fn stream_response(
    st: Arc<AppState>,
    v: Validated,
    flavor: Flavor,
    rx: UnboundedReceiver<GenEvent>,
    id: String,
    arrived: Instant,
    in_flight: InFlight,
) -> Response {
    let codec = st.backend.codec();
    let mut s = StreamState {
        st,
        rx,
        detok: Detokenizer::new(codec),
        flavor,
        id,
        model: v.model.clone(),
        created: now_secs(),
        include_usage: v.include_usage,
        return_token_ids: v.return_token_ids,
        arrived,
        ttft: None,
        pending: Default::default(),
        done: false,
        in_flight: Some(in_flight),
    };
    if flavor == Flavor::Chat {
        let first = s.envelope(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            None,
        );
        s.pending.push_back(first);
    }
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        let payload = s.next().await?;
        Some((Ok::<Event, Infallible>(Event::default().data(payload)), s))
    });
    Sse::new(stream).into_response()
}

#[cfg(test)]
#[path = "server_bounds_tests.rs"]
mod bounds_tests;

#[cfg(test)]
#[path = "disagg_tests.rs"]
mod disagg_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::serve::http_client::{self, HttpUrl};

    async fn start_fake(backend: Arc<FakeBackend>) -> (HttpUrl, tokio::sync::oneshot::Sender<()>) {
        let state = AppState::new(backend, Generator::Local, "agg");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (atx, arx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = serve(
                state,
                "127.0.0.1:0".parse().unwrap(),
                |a| {
                    let _ = atx.send(a);
                },
                async move {
                    let _ = rx.await;
                },
            )
            .await;
        });
        let addr = arx.await.unwrap();
        (HttpUrl::parse(&format!("http://{addr}")).unwrap(), tx)
    }

    const T: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn completion_roundtrip_and_stream_agree() {
        let (url, _stop) = start_fake(Arc::new(FakeBackend::new())).await;
        let body = json!({"model": "fake-model", "prompt": "abc", "max_tokens": 5, "return_token_ids": true});
        let (status, bytes) = http_client::call(&url, "POST", "/v1/completions", Some(&body), T)
            .await
            .unwrap();
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let text = v["choices"][0]["text"].as_str().unwrap().to_string();
        assert_eq!(text.len(), 5);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        assert_eq!(v["usage"]["completion_tokens"], 5);
        assert_eq!(v["choices"][0]["finish_reason"], "length");

        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        sbody["stream_options"] = json!({"include_usage": true});
        let (status, events) = http_client::post_sse(&url, "/v1/completions", &sbody, T)
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert_eq!(events.last().unwrap(), "[DONE]");
        let mut streamed = String::new();
        for e in &events[..events.len() - 1] {
            let c: Value = serde_json::from_str(e).unwrap();
            if let Some(t) = c["choices"][0]["text"].as_str() {
                streamed.push_str(t);
            }
        }
        assert_eq!(streamed, text);
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 5);
    }

    #[tokio::test]
    async fn chat_stream_has_role_then_content() {
        let (url, _stop) = start_fake(Arc::new(FakeBackend::new())).await;
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true});
        let (status, events) = http_client::post_sse(&url, "/v1/chat/completions", &body, T)
            .await
            .unwrap();
        assert_eq!(status, 200);
        let first: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["object"], "chat.completion.chunk");
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(events.last().unwrap(), "[DONE]");
    }

    #[tokio::test]
    async fn overload_is_503_json_and_bad_route_is_404() {
        let backend = Arc::new(FakeBackend::new());
        backend.overloaded.store(true, Ordering::SeqCst);
        let (url, _stop) = start_fake(backend).await;
        let (status, bytes) = http_client::call(
            &url,
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": "x"})),
            T,
        )
        .await
        .unwrap();
        assert_eq!(status, 503);
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["code"], "overloaded");
        let (status, _) = http_client::call(&url, "GET", "/v2/nothing", None, T)
            .await
            .unwrap();
        assert_eq!(status, 404);
        let (status, bytes) = http_client::call_raw(&url, "/v1/completions", b"{\"prompt\":", T)
            .await
            .unwrap();
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[tokio::test]
    async fn eos_stops_unless_ignored() {
        let mut b = FakeBackend::new();
        b.eos_after = Some(1);
        let (url, _stop) = start_fake(Arc::new(b)).await;
        let body = json!({"prompt": "abc", "max_tokens": 5, "return_token_ids": true});
        let (_, bytes) = http_client::call(&url, "POST", "/v1/completions", Some(&body), T)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 2);
        let body = json!({"prompt": "abc", "max_tokens": 5, "ignore_eos": true});
        let (_, bytes) = http_client::call(&url, "POST", "/v1/completions", Some(&body), T)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 5);
    }
}
