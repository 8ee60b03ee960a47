//! Disaggregated decode: the first token comes from a prefill server, the rest from this engine.
//!
//! Protocol (HTTP, no extra wire format): the decode server posts the tokenized prompt to the prefill
//! server's `/v1/completions` with `max_tokens: 1, return_token_ids: true`. The prefill engine computes
//! the prompt, its connector offloads every full prompt block to the shared tier (G4, e.g. `dir://` or
//! Redis) before the request is reported done, and the response carries the first token `t0`. The decode
//! engine is then given `prompt ++ [t0]`; its connector finds the prompt's blocks in the shared tier and
//! onboards them, so only the partial tail block and `t0` are computed locally.
//!
//! Invariant: the token stream is exactly the aggregated one — `t0` is the greedy argmax over the same
//! prompt, and every later token is computed over bit-identical KV (loaded or, if the shared tier misses,
//! recomputed). A prefill failure is reported to the client (503/4xx), never papered over.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::backend::{Backend, FinishReason, Finished, GenEvent, GenRequest};
use crate::serve::api::{submit_error, ApiError};
use crate::serve::http_client::{self, HttpUrl};

/// How a decode server reaches its prefill server.
#[derive(Debug, Clone)]
pub struct PrefillClient {
    /// The prefill server.
    pub url: HttpUrl,
    /// Bound on one prefill call.
    pub timeout: Duration,
}

/// The prefill server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefilled {
    /// The first generated token.
    pub first_token: u32,
    /// Why the prefill stopped (`Prefilled`: continue here).
    pub finish_reason: FinishReason,
    /// Prompt tokens the prefill server did not compute.
    pub cached_tokens: u32,
}

/// Asks the prefill server for the first token of `req` (sending the client's own `max_tokens`, so
/// the prefill engine knows whether the request continues and must publish its KV before answering).
pub async fn prefill(client: &PrefillClient, req: &GenRequest) -> Result<Prefilled, ApiError> {
    let body = json!({
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": req.ignore_eos,
        "return_token_ids": true,
    });
    let (status, bytes) = http_client::call(
        &client.url,
        "POST",
        "/v1/completions",
        Some(&body),
        client.timeout,
    )
    .await
    .map_err(|e| ApiError::unavailable(format!("prefill server unreachable: {e}")))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::unavailable(format!("prefill server sent invalid JSON ({status}): {e}"))
    })?;
    if !status.is_success() {
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or("unknown error")
            .to_string();
        let mut err = if status.is_client_error() {
            ApiError::invalid(msg, None)
        } else {
            ApiError::unavailable(msg)
        };
        err.message = format!("prefill server: {}", err.message);
        err.status = status;
        return Err(err);
    }
    let choice = &v["choices"][0];
    let ids = choice["token_ids"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let first_token = match ids {
        [t] => t.as_u64().and_then(|t| u32::try_from(t).ok()),
        _ => None,
    }
    .ok_or_else(|| {
        ApiError::internal(
            "prefill server must answer exactly one token id (is it in prefill mode?)",
        )
    })?;
    let finish_reason = choice["finish_reason"]
        .as_str()
        .and_then(FinishReason::parse)
        .ok_or_else(|| ApiError::internal("prefill server response has no valid finish_reason"))?;
    let cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0) as u32;
    Ok(Prefilled {
        first_token,
        finish_reason,
        cached_tokens,
    })
}

/// Runs `req` disaggregated: prefill remotely, then decode on `backend`. The returned channel carries
/// the same events an aggregated run would.
pub async fn start(
    client: &PrefillClient,
    backend: &dyn Backend,
    req: &GenRequest,
) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    let p = prefill(client, req).await?;
    if p.finish_reason != FinishReason::Prefilled {
        // Finished on the prefill server (EOS, or max_tokens = 1): nothing to decode.
        let (tx, rx) = unbounded_channel();
        let _ = tx.send(GenEvent::Token(p.first_token));
        let _ = tx.send(GenEvent::Done(Finished {
            finish_reason: p.finish_reason,
            prompt_tokens: req.prompt.len() as u32,
            completion_tokens: 1,
            cached_tokens: p.cached_tokens,
        }));
        return Ok(rx);
    }
    let rest = GenRequest {
        prefilled: Some(p.first_token),
        ..req.clone()
    };
    backend.submit(rest).map_err(submit_error)
}
