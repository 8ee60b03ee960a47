//! Settings from the environment and from an engine's string map (vLLM's
//! `kv_connector_extra_config`, TensorRT-LLM's connector config) on arbitrary bytes: lines
//! `NAME=VALUE`, the first half read as environment variables, the second as engine keys. Never
//! panics; a configuration that builds also validates.
#![no_main]
use std::collections::HashMap;

use kvtier::config::KvtierConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let lines: Vec<&str> = text.lines().collect();
    let (env_lines, engine_lines) = lines.split_at(lines.len() / 2);
    let map = |ls: &[&str]| -> HashMap<String, String> {
        ls.iter()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    };
    let built = KvtierConfig::builder()
        .env(&map(env_lines))
        .engine_strings(&map(engine_lines))
        .build();
    if let Ok(c) = built {
        c.validate().expect("a built configuration validates");
    }
});
