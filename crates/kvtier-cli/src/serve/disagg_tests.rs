//! Tests of the decode-mode prefill hop against a real prefill server (a child of `server`, so
//! that `disagg` itself never imports the server that uses it).
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::fake::FakeBackend;
use crate::backend::{Backend, FinishReason, GenEvent, GenRequest};
use crate::serve::disagg::*;
use crate::serve::http_client::HttpUrl;
use crate::serve::server::{serve, AppState, Generator};

async fn collect(mut rx: UnboundedReceiver<GenEvent>) -> (Vec<u32>, FinishReason, u32) {
    let mut toks = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => toks.push(t),
            GenEvent::Done(f) => return (toks, f.finish_reason, f.completion_tokens),
            GenEvent::Error(e) => panic!("{e}"),
        }
    }
    panic!("no Done");
}

#[tokio::test]
async fn decode_through_a_prefill_server_matches_aggregated() {
    let mut pf = FakeBackend::new();
    pf.prefill_role = true;
    let state = AppState::new(Arc::new(pf), Generator::Local, "prefill");
    let (atx, arx) = tokio::sync::oneshot::channel();
    tokio::spawn(serve(
        state,
        "127.0.0.1:0".parse().unwrap(),
        move |a| {
            let _ = atx.send(a);
        },
        std::future::pending(),
    ));
    let addr = arx.await.unwrap();
    let client = PrefillClient {
        url: HttpUrl::parse(&format!("http://{addr}")).unwrap(),
        timeout: Duration::from_secs(10),
    };
    let decode = FakeBackend::new();
    let agg = FakeBackend::new();
    for max_tokens in [1u32, 2, 7] {
        let req = GenRequest {
            prompt: vec![104, 105, 33],
            max_tokens,
            ignore_eos: true,
            prefilled: None,
        };
        let got = collect(start(&client, &decode, &req).await.unwrap()).await;
        let want = collect(agg.submit(req.clone()).unwrap()).await;
        assert_eq!(got, want, "max_tokens {max_tokens}");
    }
    // A prefill server that is gone is a 503, not a hang or a wrong answer.
    let dead = PrefillClient {
        url: HttpUrl::parse("http://127.0.0.1:9").unwrap(),
        timeout: Duration::from_secs(5),
    };
    let req = GenRequest {
        prompt: vec![1],
        max_tokens: 3,
        ignore_eos: true,
        prefilled: None,
    };
    let err = start(&dead, &decode, &req).await.unwrap_err();
    assert_eq!(err.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
}
