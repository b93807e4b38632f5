//! Seeded random request sequences against the shard core (a bounded, deterministic fuzz run that CI does
//! every time): requests of every kind with random ids, lengths, sequence numbers, versions and payloads,
//! valid and invalid mixed, and random byte mutations of valid frames through the decoder. Nothing may
//! panic; every reply must encode as a frame; every push is counted exactly once as applied, duplicate or
//! refused; and the state at the end survives a checkpoint round trip.

use gaps_common::layout::{ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::rng::Rng;
use gaps_common::wire::{
    self, ids_to_words, Frame, Heartbeat, Leave, Limits, Message, Pull, Push, PushChunk, Register, Role, SparsePull,
    SparsePush, StatsRequest, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::{Init, ShardConfig, ShardCore, SparseSettings};
use std::time::Duration;

const EPOCH: u64 = 3;

fn config(rule: Rule, mode: Mode) -> ShardConfig {
    let mut gated = TensorSpec::new("g", 9);
    gated.rule.rule = Some("gap-aware".into());
    ShardConfig {
        shard: 0,
        num_shards: 1,
        layout: Layout::with_tables(vec![TensorSpec::new("w", 50), gated], 16, vec![SparseSpec::new("e", 3)])
            .expect("layout"),
        rule,
        hyper: Hyper { lr: 0.05, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 9, std: 0.1 },
        lease: Duration::from_secs(5),
        advertise: "x".into(),
        epoch: EPOCH,
        threads: 1,
        sparse: SparseSettings { admit_after: 2, memory_budget: Some(256 << 10), ..SparseSettings::default() },
        modes: ModeConfig { mode, ..ModeConfig::default() },
    }
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

fn float(rng: &mut Rng) -> f32 {
    match rng.below(40) {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => -1e30,
        _ => (rng.normal() * 0.5) as f32,
    }
}

/// A request, sometimes valid, often not.
fn request(rng: &mut Rng, layout: &Layout) -> Frame {
    let chunks: Vec<ChunkId> = layout.chunks().collect();
    let epoch = if rng.below(30) == 0 { EPOCH + 1 } else { EPOCH };
    let worker = rng.below(4) as u32;
    let some_chunks = |rng: &mut Rng| -> Vec<ChunkId> {
        let n = rng.below(chunks.len() as u64 + 2) as usize;
        (0..n)
            .map(|_| {
                if rng.below(20) == 0 {
                    ChunkId { tensor: rng.below(4) as u32, chunk: rng.below(6) as u32 }
                } else {
                    pick(rng, &chunks)
                }
            })
            .collect()
    };
    match rng.below(9) {
        0 => Frame::new(Message::Pull(Pull { epoch, chunks: some_chunks(rng) })),
        1 | 2 => {
            let ids = some_chunks(rng);
            let push_chunks: Vec<PushChunk> = ids
                .iter()
                .map(|id| PushChunk {
                    id: *id,
                    read_version: rng.below(8),
                    len: match layout.chunk_len(*id) {
                        Ok(n) if rng.below(15) != 0 => n as u32,
                        _ => rng.below(20) as u32,
                    },
                    echo: if rng.below(15) == 0 { rng.below(2) == 0 } else { id.tensor == 1 },
                })
                .collect();
            let declared: usize = push_chunks.iter().map(|c| c.len as usize * (1 + usize::from(c.echo))).sum();
            let carried = if rng.below(15) == 0 { rng.below(declared as u64 + 3) as usize } else { declared };
            let payload = (0..carried).map(|_| float(rng)).collect();
            let seq = rng.below(40);
            Frame {
                msg: Message::Push(Push { epoch, worker, seq, chunks: push_chunks, compute_ms: rng.below(50) as u32 }),
                payload,
            }
        }
        3 => {
            let count = rng.below(6) as u32;
            let ids: Vec<u64> = (0..count).map(|_| rng.below(12)).collect();
            let mut payload = Vec::new();
            ids_to_words(&ids, &mut payload);
            if rng.below(10) == 0 {
                payload.pop();
            }
            Frame {
                msg: Message::SparsePull(SparsePull {
                    epoch,
                    table: rng.below(2) as u32,
                    count,
                    create: rng.below(2) == 0,
                }),
                payload,
            }
        }
        4 => {
            let count = rng.below(5) as u32;
            let dim = if rng.below(10) == 0 { 4 } else { 3 };
            let ids: Vec<u64> = (0..count).map(|_| rng.below(12)).collect();
            let mut payload = Vec::new();
            ids_to_words(&ids, &mut payload);
            payload.extend((0..count).map(|_| f32::from_bits(rng.below(5) as u32)));
            payload.extend((0..count * dim).map(|_| float(rng)));
            let seq = rng.below(40);
            let msg = SparsePush {
                epoch,
                worker,
                seq,
                table: rng.below(2) as u32,
                count,
                dim,
                echo_read: rng.below(10) == 0,
            };
            Frame { msg: Message::SparsePush(msg), payload }
        }
        5 => Frame::new(Message::Register(Register {
            protocol: if rng.below(10) == 0 { 1 } else { PROTOCOL_VERSION },
            role: if rng.below(3) == 0 { Role::Observer } else { Role::Worker },
            name: "r".into(),
        })),
        6 => Frame::new(Message::Heartbeat(Heartbeat { worker })),
        7 => Frame::new(Message::Leave(Leave { worker })),
        _ => Frame::new(Message::StatsRequest(StatsRequest)),
    }
}

#[test]
fn random_request_sequences_never_panic_and_keep_the_books() {
    let mut rng = Rng::new(2026);
    for (rule, mode) in [
        (Rule::Momentum, Mode::Async),
        (Rule::DanaZero, Mode::Async),
        (Rule::Adam, Mode::Sync),
        (Rule::DcAsgdAdaptive, Mode::Gba),
        (Rule::Sgd, Mode::Ssp),
        (Rule::Nesterov, Mode::Auto),
    ] {
        let mut core = ShardCore::new(config(rule, mode)).expect("core");
        let layout = core.config().layout.clone();
        let mut pushes = 0u64;
        for i in 0..4000u64 {
            let frame = request(&mut rng, &layout);
            pushes += u64::from(matches!(frame.msg, Message::Push(_) | Message::SparsePush(_)));
            let now = Duration::from_millis(i * 7);
            let (reply, _) = core.handle(frame, now);
            wire::encode_frame(&reply).unwrap_or_else(|e| panic!("{rule} {mode}: a reply that cannot be sent: {e}"));
            if i % 97 == 0 {
                core.tick(now);
            }
        }
        let s = core.stats();
        assert_eq!(s.pushes_applied + s.pushes_duplicate + s.pushes_rejected, pushes, "{rule} {mode}: {s:?}");
        assert!(s.pushes_applied > 0 && s.pushes_rejected > 0, "{rule} {mode}: the mix exercised both: {s:?}");
        let bytes = core.checkpoint(1);
        let restored = ShardCore::restore(config(rule, mode), &bytes).map_err(|e| e.to_string()).expect("restore");
        assert_eq!(restored.checkpoint(1), bytes, "{rule} {mode}");
    }
}

#[test]
fn mutated_frames_decode_to_a_frame_or_a_typed_error() {
    let mut rng = Rng::new(7);
    let layout = config(Rule::Sgd, Mode::Async).layout;
    let limits = Limits { max_payload_bytes: 1 << 20, ..Limits::default() };
    for _ in 0..20_000 {
        let frame = request(&mut rng, &layout);
        let Ok(mut bytes) = wire::encode_frame(&frame) else { continue };
        for _ in 0..=rng.below(4) {
            let at = rng.below(bytes.len() as u64) as usize;
            match rng.below(3) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes.truncate(at),
                _ => bytes.insert(at, rng.below(256) as u8),
            }
            if bytes.is_empty() {
                break;
            }
        }
        // Either outcome is fine; a panic or an allocation beyond the limits is not.
        let _ = wire::decode_frame(&bytes, &limits);
    }
}
