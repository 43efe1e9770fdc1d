//! The `stored_response` target: see `idempotency_fuzz::stored_response` for the parser and its properties.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz::stored_response(data));
