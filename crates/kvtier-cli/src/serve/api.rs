//! OpenAI wire types and their validation into a [`GenRequest`].
//!
//! Invariant: every request body goes through [`parse_completion`] / [`parse_chat`], which either return a
//! fully validated request (non-empty prompt of valid token ids that fits the context window, greedy
//! sampling, n = 1) or an [`ApiError`] with a 4xx status naming the offending parameter. Unknown fields are
//! ignored, as OpenAI clients send many optional ones.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::backend::{Backend, GenRequest, SubmitError};

/// An OpenAI-style error: `{"error":{"message","type","param","code"}}` with an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// `error.message`.
    pub message: String,
    /// `error.type` (e.g. `invalid_request_error`).
    pub kind: &'static str,
    /// `error.param`: the offending request field.
    pub param: Option<&'static str>,
    /// `error.code`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    /// 404 for an unknown model.
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// 503: the engine is overloaded or stopped; the client may retry.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("overloaded"),
        }
    }

    /// 500: generation failed inside the engine.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// Maps a backend refusal to its HTTP error.
pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Overloaded(m) => {
            ApiError::unavailable(format!("engine overloaded, retry later: {m}"))
        }
        SubmitError::Unavailable(m) => ApiError::unavailable(format!("engine unavailable: {m}")),
        SubmitError::Invalid(m) => ApiError::invalid(m, None),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        resp
    }
}

/// A prompt: text or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// Batches (`["a","b"]`, `[[1],[2]]`) are recognised only to be refused clearly.
    Batch(Vec<Value>),
}

/// Streaming options.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints.
#[derive(Debug, Clone, Deserialize)]
pub struct Sampling {
    /// The model asked for (must be the served one, if given).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Newer OpenAI name for `max_tokens` on chat.
    pub max_completion_tokens: Option<u32>,
    /// Only 0 (or absent): decoding is greedy.
    pub temperature: Option<f64>,
    /// Only 1 (or absent): decoding is greedy.
    pub top_p: Option<f64>,
    /// Only 1 (or absent).
    pub n: Option<u32>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Keep generating past end-of-sequence tokens (vLLM's extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Refused unless absent or empty: stop sequences are not supported.
    pub stop: Option<Value>,
    /// Refused unless absent: log probabilities are not supported.
    pub logprobs: Option<Value>,
    /// Non-standard (vLLM): include the generated token ids in each choice.
    #[serde(default)]
    pub return_token_ids: bool,
    /// OpenAI fields that would change the result and are not implemented: refused unless
    /// absent or neutral (see [`UNIMPLEMENTED`]).
    pub echo: Option<Value>,
    /// See `echo`.
    pub suffix: Option<Value>,
    /// See `echo`.
    pub logit_bias: Option<Value>,
    /// See `echo`.
    pub presence_penalty: Option<Value>,
    /// See `echo`.
    pub frequency_penalty: Option<Value>,
    /// See `echo`.
    pub seed: Option<Value>,
    /// See `echo`.
    pub best_of: Option<Value>,
    /// See `echo`.
    pub tools: Option<Value>,
}

/// The OpenAI fields that change results and that this server does not implement, with the
/// values that leave the result unchanged (#28: they were accepted and ignored while their
/// siblings were refused).
pub const UNIMPLEMENTED: &[&str] = &[
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "best_of",
    "tools",
];

/// The first unimplemented field of `s` set to a value that would change the result.
fn unimplemented_field(s: &Sampling) -> Option<&'static str> {
    let neutral = |v: &Option<Value>, ok: &dyn Fn(&Value) -> bool| match v {
        None | Some(Value::Null) => true,
        Some(v) => ok(v),
    };
    let zero = |v: &Value| v.as_f64() == Some(0.0);
    let checks: [(&'static str, bool); 8] = [
        ("echo", neutral(&s.echo, &|v| v == &Value::Bool(false))),
        ("suffix", neutral(&s.suffix, &|v| v.as_str() == Some(""))),
        (
            "logit_bias",
            neutral(&s.logit_bias, &|v| {
                v.as_object().is_some_and(|o| o.is_empty())
            }),
        ),
        ("presence_penalty", neutral(&s.presence_penalty, &zero)),
        ("frequency_penalty", neutral(&s.frequency_penalty, &zero)),
        ("seed", neutral(&s.seed, &|_| false)),
        ("best_of", neutral(&s.best_of, &|v| v.as_f64() == Some(1.0))),
        (
            "tools",
            neutral(&s.tools, &|v| v.as_array().is_some_and(|a| a.is_empty())),
        ),
    ];
    checks.into_iter().find(|(_, ok)| !ok).map(|(f, _)| f)
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    /// The prompt.
    pub prompt: Prompt,
    /// The shared fields.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Message content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// A list of parts (only text parts are accepted).
    Parts(Vec<ContentPart>),
}

/// One content part; only `text` parts are supported.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's `type` (only `text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text.
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Its content.
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    /// The conversation, in order.
    pub messages: Vec<Message>,
    /// The shared fields.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A validated request plus how to answer it.
#[derive(Debug, Clone)]
pub struct Validated {
    /// What to generate.
    pub gen: GenRequest,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Send a last chunk with the usage (streaming).
    pub include_usage: bool,
    /// Include the generated token ids in each choice.
    pub return_token_ids: bool,
    /// The model name to answer with.
    pub model: String,
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid(
            "request body is empty; expected a JSON object",
            None,
        ));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            "request body must be a JSON object",
            None,
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("invalid request: {e}"), None))
}

/// Applies the shared sampling checks and the context-window check.
fn finish(
    backend: &dyn Backend,
    prompt: Vec<u32>,
    s: &Sampling,
    default_max: Option<u32>,
) -> Result<Validated, ApiError> {
    let model = backend.model_name();
    if let Some(m) = &s.model {
        if m != &model {
            return Err(ApiError::model_not_found(m));
        }
    }
    if let Some(field) = unimplemented_field(s) {
        return Err(ApiError::invalid(
            format!(
                "`{field}` is not supported by this server: it would change the result (greedy \
                 decoding of the prompt as given only); omit it"
            ),
            Some(field),
        ));
    }
    if let Some(t) = s.temperature {
        if t != 0.0 {
            return Err(ApiError::invalid(
                format!(
                    "temperature {t} is not supported: this server decodes greedily only (omit it or send 0) \
                     so that cached and recomputed runs give bit-identical text"
                ),
                Some("temperature"),
            ));
        }
    }
    if let Some(p) = s.top_p {
        if p != 1.0 {
            return Err(ApiError::invalid(
                "top_p other than 1 is not supported (greedy decoding only)",
                Some("top_p"),
            ));
        }
    }
    if let Some(n) = s.n {
        if n != 1 {
            return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
        }
    }
    match &s.stop {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "stop sequences are not supported",
                Some("stop"),
            ))
        }
    }
    match &s.logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "logprobs are not supported",
                Some("logprobs"),
            ))
        }
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt must not be empty",
            Some("prompt"),
        ));
    }
    let vocab = backend.vocab_size();
    if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid(
            format!("token id {bad} is out of range: the vocabulary has {vocab} tokens"),
            Some("prompt"),
        ));
    }
    let max_len = backend.max_model_len();
    if prompt.len() >= max_len {
        return Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {max_len} tokens, but the prompt has {} tokens \
                 (at least one token must be generated)",
                prompt.len()
            ),
            Some("prompt"),
        ));
    }
    let room = (max_len - prompt.len()) as u32;
    let requested = s.max_completion_tokens.or(s.max_tokens);
    let max_tokens = match requested {
        Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1", Some("max_tokens"))),
        Some(m) if m > room => {
            return Err(ApiError::invalid(
                format!(
                    "This model's maximum context length is {max_len} tokens; the prompt has {} tokens and \
                     max_tokens asks for {m} more",
                    prompt.len()
                ),
                Some("max_tokens"),
            ))
        }
        Some(m) => m,
        None => default_max.unwrap_or(room).min(room),
    };
    Ok(Validated {
        gen: GenRequest {
            prompt,
            max_tokens,
            ignore_eos: s.ignore_eos,
            prefilled: None,
        },
        stream: s.stream,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        return_token_ids: s.return_token_ids,
        model,
    })
}

/// Parses and validates a `/v1/completions` body (default `max_tokens` 16, as OpenAI).
pub fn parse_completion(backend: &dyn Backend, body: &[u8]) -> Result<Validated, ApiError> {
    let b: CompletionBody = parse_json(body)?;
    let prompt = match b.prompt {
        Prompt::Text(t) => backend.codec().encode(&t),
        Prompt::Tokens(t) => t,
        Prompt::Batch(_) => {
            return Err(ApiError::invalid(
                "batched prompts are not supported: send one prompt (a string or an array of token ids)",
                Some("prompt"),
            ))
        }
    };
    finish(backend, prompt, &b.sampling, Some(16))
}

/// The chat template of the built-in model: `<|role|>\n{content}\n` per message, then `<|assistant|>\n`.
pub fn render_chat(messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must contain at least one message",
            Some("messages"),
        ));
    }
    let mut out = String::new();
    for m in messages {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::invalid(
                format!("unknown message role `{}`", m.role),
                Some("messages"),
            ));
        }
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                format!(
                                    "content part type `{}` is not supported (text only)",
                                    p.kind
                                ),
                                Some("messages"),
                            ))
                        }
                    }
                }
                s
            }
        };
        out.push_str("<|");
        out.push_str(&m.role);
        out.push_str("|>\n");
        out.push_str(&text);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    Ok(out)
}

/// Parses and validates a `/v1/chat/completions` body (default `max_tokens`: the rest of the context).
pub fn parse_chat(backend: &dyn Backend, body: &[u8]) -> Result<Validated, ApiError> {
    let b: ChatBody = parse_json(body)?;
    let text = render_chat(&b.messages)?;
    let prompt = backend.codec().encode(&text);
    finish(backend, prompt, &b.sampling, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;

    #[test]
    fn completion_text_and_tokens() {
        let b = FakeBackend::new();
        let v = parse_completion(
            &b,
            br#"{"model":"fake-model","prompt":"hi","max_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(v.gen.prompt, vec![104, 105]);
        assert_eq!(v.gen.max_tokens, 3);
        let v = parse_completion(
            &b,
            br#"{"prompt":[1,2,3],"temperature":0,"ignore_eos":true}"#,
        )
        .unwrap();
        assert_eq!(v.gen.prompt, vec![1, 2, 3]);
        assert_eq!(v.gen.max_tokens, 16);
        assert!(v.gen.ignore_eos);
    }

    #[test]
    fn errors_name_the_parameter() {
        let b = FakeBackend::new();
        let e = parse_completion(&b, b"{not json").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_completion(&b, br#"{"model":"fake-model"}"#).unwrap_err();
        assert!(
            e.message.contains("missing field `prompt`"),
            "{}",
            e.message
        );
        let e = parse_completion(&b, br#"{"model":"other","prompt":"x"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code, Some("model_not_found"));
        let e = parse_completion(&b, br#"{"prompt":"x","temperature":0.7}"#).unwrap_err();
        assert_eq!(e.param, Some("temperature"));
        let e = parse_completion(&b, br#"{"prompt":[1,999]}"#).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
        let long = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(64));
        let e = parse_completion(&b, long.as_bytes()).unwrap_err();
        assert!(
            e.message.contains("maximum context length"),
            "{}",
            e.message
        );
        let e = parse_completion(&b, br#"{"prompt":"x","max_tokens":100}"#).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        let e = parse_completion(&b, br#"{"prompt":["a","b"]}"#).unwrap_err();
        assert!(e.message.contains("batched"));
        let e = parse_completion(&b, br#"{"prompt":""}"#).unwrap_err();
        assert!(e.message.contains("empty"));
        let e = parse_chat(&b, br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let e = parse_chat(&b, br#"{"messages":[{"role":"wizard","content":"x"}]}"#).unwrap_err();
        assert_eq!(e.param, Some("messages"));
    }

    /// Regression (#28): OpenAI fields that change results were accepted and ignored. Each is
    /// refused with 400 naming it; its neutral value is accepted.
    #[test]
    fn result_changing_fields_are_refused_by_name() {
        let b = FakeBackend::new();
        for (field, bad, neutral) in [
            ("echo", "true", "false"),
            ("suffix", "\"x\"", "\"\""),
            ("logit_bias", "{\"5\":100}", "{}"),
            ("presence_penalty", "0.5", "0"),
            ("frequency_penalty", "-1", "0.0"),
            ("seed", "7", "null"),
            ("best_of", "2", "1"),
            ("tools", "[{\"type\":\"function\"}]", "[]"),
        ] {
            let body = format!(r#"{{"prompt":"hi","max_tokens":2,"{field}":{bad}}}"#);
            let e = parse_completion(&b, body.as_bytes()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{field}");
            assert_eq!(e.param, Some(field), "{field}");
            assert!(e.message.contains(field), "{}", e.message);
            let chat = format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":2,"{field}":{bad}}}"#
            );
            assert_eq!(
                parse_chat(&b, chat.as_bytes()).unwrap_err().param,
                Some(field)
            );
            let ok = format!(r#"{{"prompt":"hi","max_tokens":2,"{field}":{neutral}}}"#);
            assert!(
                parse_completion(&b, ok.as_bytes()).is_ok(),
                "{field}={neutral}"
            );
        }
        assert_eq!(UNIMPLEMENTED.len(), 8);
    }

    #[test]
    fn chat_template_is_stable() {
        let b = FakeBackend::new();
        let v = parse_chat(
            &b,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"yo"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            b.codec().decode(&v.gen.prompt),
            "<|user|>\nyo\n<|assistant|>\n"
        );
        // default max_tokens = the rest of the context window (64)
        assert_eq!(v.gen.max_tokens as usize, 64 - v.gen.prompt.len());
    }

    #[test]
    fn error_body_shape() {
        let e = ApiError::invalid("bad", Some("prompt"));
        assert_eq!(
            e.body(),
            json!({"error":{"message":"bad","type":"invalid_request_error","param":"prompt","code":null}})
        );
    }
}

#[cfg(test)]
#[path = "api_fuzz_tests.rs"]
mod fuzz_tests;
