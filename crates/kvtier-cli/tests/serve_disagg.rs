//! Disaggregated serving with the built binary: a prefill server and a decode server (two processes)
//! sharing a `dir://` remote tier produce exactly the tokens of an aggregated server, and the decode
//! server really loads the prompt's KV from the shared tier.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvtier_cli::serve::http_client::{self, HttpUrl};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(120);

/// A server process, killed when dropped.
struct Proc {
    child: Child,
    url: HttpUrl,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(args: &[&str], cache: &std::path::Path) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("serve")
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--num-device-blocks",
            "64",
            "--max-batch-tokens",
            "128",
        ])
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .env_remove("KVTIER_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on ").nth(1) {
                let _ = tx.send(
                    rest.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string(),
                );
            }
        }
    });
    let url = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(u) => u,
        Err(_) => {
            let _ = child.kill();
            panic!("server {args:?} did not start");
        }
    };
    Proc {
        child,
        url: HttpUrl::parse(&url).unwrap(),
    }
}

async fn complete(p: &Proc, prompt: &str, max_tokens: u32) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "return_token_ids": true});
    let (status, bytes) = http_client::call(&p.url, "POST", "/v1/completions", Some(&body), T)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(status.as_u16(), 200, "{v}");
    v
}

async fn metric(p: &Proc, prefix: &str) -> f64 {
    let (_, bytes) = http_client::call(&p.url, "GET", "/metrics", None, T)
        .await
        .unwrap();
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_processes_match_aggregated() {
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("shared-kv");
    std::fs::create_dir_all(&shared).unwrap();
    let remote = format!("dir://{}", shared.display());
    let common = ["--connector", "kvtier", "--remote-url", remote.as_str()];

    let agg = spawn(&["--connector", "none"], &tmp.path().join("c-agg"));
    let prefill = spawn(
        &[&common[..], &["--disaggregation-mode", "prefill"]].concat(),
        &tmp.path().join("c-pf"),
    );
    let pf_url = format!("http://{}", prefill.url.authority);
    let decode = spawn(
        &[
            &common[..],
            &[
                "--disaggregation-mode",
                "decode",
                "--prefill-url",
                pf_url.as_str(),
            ],
        ]
        .concat(),
        &tmp.path().join("c-dec"),
    );

    let prompts = [
        "In disaggregated serving, a prefill worker computes the prompt and a decode worker continues. ".repeat(3),
        "Short prompt".to_string(),
        "Tiered KV caches move blocks between GPU, host memory, local disk and a shared store. ".repeat(6),
    ];
    let remote_hits_before = metric(&decode, "kvtier_hit_tokens_total{tier=\"remote\"}").await;
    for (i, p) in prompts.iter().enumerate() {
        let want = complete(&agg, p, 20).await;
        let got = complete(&decode, p, 20).await;
        assert_eq!(
            got["choices"][0]["token_ids"], want["choices"][0]["token_ids"],
            "prompt {i}"
        );
        assert_eq!(
            got["choices"][0]["text"], want["choices"][0]["text"],
            "prompt {i}"
        );
        assert_eq!(got["usage"]["completion_tokens"], 20);
        assert_eq!(got["choices"][0]["finish_reason"], "length");
    }
    // max_tokens = 1 is answered by the prefill server alone.
    let want = complete(&agg, &prompts[0], 1).await;
    let got = complete(&decode, &prompts[0], 1).await;
    assert_eq!(
        got["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );

    // The long prompts' KV reached the decode server through the shared tier, not by recomputation.
    let remote_hits =
        metric(&decode, "kvtier_hit_tokens_total{tier=\"remote\"}").await - remote_hits_before;
    assert!(
        remote_hits >= 16.0 * 20.0,
        "decode server loaded only {remote_hits} tokens from the shared tier"
    );
    assert!(
        std::fs::read_dir(&shared).unwrap().count() > 0,
        "nothing was written to the shared tier"
    );
    // A prefill server answers a streaming client too (through the decode server).
    let body = json!({"prompt": prompts[2], "max_tokens": 5, "ignore_eos": true, "stream": true});
    let (status, events) = http_client::post_sse(&decode.url, "/v1/completions", &body, T)
        .await
        .unwrap();
    assert_eq!(status.as_u16(), 200);
    assert_eq!(events.last().unwrap(), "[DONE]");
}
