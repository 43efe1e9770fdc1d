//! Replays the fuzz targets' committed corpus (`fuzz/corpus/<target>/`) and every crash ever
//! found (`fuzz/regressions/<target>/`, minimised, kept after the fix) through the targets'
//! bodies, on stable Rust: what the fuzzer once found stays found.

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut inputs = Vec::new();
    for folder in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(folder).join(target)) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_file() {
                inputs.push(path);
            }
        }
    }
    inputs.sort();
    inputs
}

fn replay(target: &str) {
    let (_, body) = idempotency_fuzz::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .unwrap_or_else(|| panic!("no fuzz target {target}"));
    let inputs = inputs(target);
    assert!(
        !inputs.is_empty(),
        "fuzz/corpus/{target} holds no input: the replay would test nothing"
    );
    for path in &inputs {
        let data = std::fs::read(path).unwrap();
        if let Err(panic) = std::panic::catch_unwind(|| body(&data)) {
            eprintln!("{target}: {} fails", path.display());
            std::panic::resume_unwind(panic);
        }
    }
    eprintln!("{target}: {} inputs replayed", inputs.len());
}

#[test]
fn key_header() {
    replay("key_header");
}

#[test]
fn stored_response() {
    replay("stored_response");
}

#[test]
fn store_url() {
    replay("store_url");
}

#[test]
fn canonical_json() {
    replay("canonical_json");
}

#[test]
fn consumer_key() {
    replay("consumer_key");
}

#[test]
fn every_target_is_replayed_here() {
    let here = include_str!("corpus.rs");
    for (name, _) in idempotency_fuzz::TARGETS {
        assert!(
            here.contains(&format!("fn {name}()")),
            "no replay test for the fuzz target {name}"
        );
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../fuzz/fuzz_targets/{name}.rs"));
        assert!(file.is_file(), "no fuzz/fuzz_targets/{name}.rs");
    }
}
