//! The `consumer_key` target: see `idempotency_fuzz::consumer_key` for the parser and its properties.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz::consumer_key(data));
