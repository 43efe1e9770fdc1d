//! The `store_url` target: see `idempotency_fuzz::store_url` for the parser and its properties.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz::store_url(data));
