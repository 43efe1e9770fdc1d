//! The `key_header` target: see `idempotency_fuzz::key_header` for the parser and its properties.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz::key_header(data));
