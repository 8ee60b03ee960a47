//! The configuration parser on arbitrary TOML text (what `KVTIER_CONFIG` points at): never
//! panics; a configuration that builds also validates.
#![no_main]
use kvtier::config::KvtierConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = KvtierConfig::builder().toml("fuzz", text).build() {
        c.validate().expect("a built configuration validates");
    }
});
