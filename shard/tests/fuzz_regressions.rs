//! Replays the fuzz targets' committed corpus and regression inputs (`fuzz/corpus/<target>/`,
//! `fuzz/regressions/<target>/`) through the same drivers libFuzzer runs (`fuzz/src/lib.rs`, included here
//! as a module), so every input that once crashed, and every input that reached new code, is checked on
//! every `cargo test` without the fuzzer. `.ci/fuzz` runs the fuzzer itself for a bounded time.

#[path = "../../fuzz/src/lib.rs"]
mod drivers;

use std::path::Path;

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut out = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(kind).join(target)) else { continue };
        for entry in entries {
            let path = entry.expect("entry").path();
            if path.is_file() {
                out.push((path.display().to_string(), std::fs::read(&path).expect("read input")));
            }
        }
    }
    out.sort();
    out
}

fn replay<T>(target: &str, driver: fn(&[u8]) -> T) -> Vec<T> {
    let inputs = inputs(target);
    assert!(!inputs.is_empty(), "no committed inputs for fuzz target {target}");
    inputs
        .iter()
        .map(|(name, bytes)| {
            std::panic::catch_unwind(|| driver(bytes))
                .unwrap_or_else(|_| panic!("fuzz target {target} fails on {name}"))
        })
        .collect()
}

#[test]
fn frame_decoder_corpus_and_regressions() {
    replay("frame_decoder", drivers::frame_decoder);
}

#[test]
fn shard_core_corpus_and_regressions_reach_deep_into_the_core() {
    let stats = replay("shard_core", drivers::shard_core);
    // The corpus is worth replaying only if it gets past validation: pushes applied and refused, sparse
    // rows created, synchronous steps completed.
    let sum = |f: fn(&gaps_common::wire::Stats) -> u64| stats.iter().map(f).sum::<u64>();
    assert!(sum(|s| s.pushes_applied) > 0, "no input applies a push");
    assert!(sum(|s| s.pushes_rejected) > 0, "no input is refused");
    assert!(sum(|s| s.pushes_duplicate) > 0, "no input repeats a push");
    assert!(sum(|s| s.table_rows) > 0, "no input creates a sparse row");
    assert!(sum(|s| s.steps_sync + s.steps_gba) > 0, "no input completes a synchronous step");
}
