//! The `canonical_json` target: see `idempotency_fuzz::canonical_json` for the parser and its properties.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz::canonical_json(data));
