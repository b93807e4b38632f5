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
fn identity_corpus_and_regressions() {
    replay("identity", drivers::identity);
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

/// Issue 16's CPU-side check of the device-resident path: every committed input drives a plain core and a
/// core whose dense state lives in the resident executor's arenas (`HostDevice`, the code a GPU shard runs
/// with its chunk table and copy plan), and every reply, event and checkpoint must agree bit for bit —
/// pushes of every rule in every mode, pulls (DANA's look-ahead included), synchronous steps, departures
/// that free a worker's planes, and checkpoints restored into a fresh device.
#[test]
fn shard_core_corpus_gives_the_same_answers_with_the_state_resident_on_a_device() {
    let stats = replay("shard_core", drivers::shard_core_resident);
    let sum = |f: fn(&gaps_common::wire::Stats) -> u64| stats.iter().map(f).sum::<u64>();
    assert!(sum(|s| s.pushes_applied) > 0, "no input applies a push");
    assert!(sum(|s| s.steps_sync + s.steps_gba) > 0, "no input completes a synchronous step");
}

/// Seeded random inputs through the same drivers (a bounded, deterministic stand-in for the fuzzer that
/// every `cargo test` runs): random byte strings choose rules, modes, request sequences, ticks and
/// checkpoint round trips; mutated corpus inputs reach the decoder's corners.
#[test]
fn seeded_random_inputs_keep_every_invariant() {
    let mut rng = gaps_common::rng::Rng::new(2026);
    let mut applied = 0;
    for _ in 0..300 {
        let len = 1 + rng.below(3000) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        applied += drivers::shard_core(&bytes).pushes_applied;
    }
    assert!(applied > 0, "random inputs applied no push at all");
    for (_, mut bytes) in inputs("frame_decoder") {
        for _ in 0..20 {
            if bytes.is_empty() {
                break;
            }
            let at = rng.below(bytes.len() as u64) as usize;
            match rng.below(3) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes.truncate(at),
                _ => bytes.insert(at, rng.below(256) as u8),
            }
            drivers::frame_decoder(&bytes);
        }
    }
}
