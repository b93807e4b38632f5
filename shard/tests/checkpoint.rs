//! Checkpoints of the shard core: a restored shard continues exactly as the original would have; a push
//! acknowledged before the checkpoint is not applied again after it; a checkpoint of another shard, layout,
//! rule or format, or one cut short or corrupted anywhere, is refused with a reason and never panics.

mod common;
use common::{call, register};
use gaps_common::layout::{ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::wire::{ids_to_words, Frame, Message, Pull, Push, PushChunk, SparsePull, SparsePush};
use gaps_kernels::Rule;
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::testnet;
use gaps_shard::{CheckpointError, Init, ShardConfig, ShardCore, SparseSettings};

const EPOCH: u64 = 21;

fn layout(momentum_rule: &str) -> Layout {
    let mut w = TensorSpec::new("w", 40);
    w.rule.rule = Some("dana-zero".into());
    let mut b = TensorSpec::new("b", 7);
    b.rule.rule = Some(momentum_rule.into());
    Layout::with_tables(vec![w, b], 16, vec![SparseSpec::new("emb", 3)]).expect("layout")
}

fn config(mode: Mode, momentum_rule: &str) -> ShardConfig {
    ShardConfig {
        init: Init { seed: 4, std: 0.2 },
        sparse: SparseSettings { admit_after: 2, init_std: 0.1, ..SparseSettings::default() },
        modes: ModeConfig { mode, ..ModeConfig::default() },
        ..testnet::config(layout(momentum_rule), EPOCH)
    }
}

/// One training step of `worker`: dense pull and push, sparse pull and push (sequence numbers 2·seq − 1
/// and 2·seq, one counter per shard as a client keeps it); returns every reply.
fn step(core: &mut ShardCore, worker: u32, seq: u64, salt: f32) -> Vec<Frame> {
    let l = layout_of(core);
    let chunks: Vec<ChunkId> = l.chunks().collect();
    let pulled = call(core, Message::Pull(Pull { epoch: EPOCH, chunks: chunks.clone() }), vec![]);
    let Message::PullReply(reply) = &pulled.msg else { panic!("{:?}", pulled.msg) };
    let grads: Vec<f32> = pulled.payload.iter().enumerate().map(|(i, v)| 0.5 * v + salt * (i % 5) as f32).collect();
    let push_chunks = reply.chunks.iter().map(|c| PushChunk::f32(c.id, c.version, c.len)).collect();
    let pushed =
        call(core, Message::Push(Push { compute_ms: 5, ..Push::new(EPOCH, worker, 2 * seq - 1, push_chunks) }), grads);
    let ids: Vec<u64> = (0..6).map(|i| (i * 7 + seq) % 11).collect();
    let mut words = Vec::new();
    ids_to_words(&ids, &mut words);
    let sparse = call(core, Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: 6, create: true }), words);
    let n = ids.len();
    let mut payload = Vec::new();
    ids_to_words(&ids, &mut payload);
    payload.extend_from_slice(&sparse.payload[..n]);
    payload.extend(sparse.payload[n..].iter().map(|v| v - salt));
    let sparse_push = SparsePush { epoch: EPOCH, worker, seq: 2 * seq, table: 0, count: 6, dim: 3, echo_read: false };
    let sparse_ack = call(core, Message::SparsePush(sparse_push), payload);
    vec![pulled, pushed, sparse, sparse_ack]
}

fn layout_of(core: &ShardCore) -> Layout {
    core.config().layout.clone()
}

/// A shard of `mode` (`rule` for tensor b) with `workers` registered workers that trained steps 1 to `to`.
fn trained(mode: Mode, rule: &str, workers: usize, to: u64) -> (ShardCore, Vec<u32>) {
    let mut core = ShardCore::new(config(mode, rule)).expect("core");
    let ids: Vec<u32> = (0..workers).map(|_| register(&mut core)).collect();
    train(&mut core, &ids, 1, to);
    (core, ids)
}

fn train(core: &mut ShardCore, workers: &[u32], from: u64, to: u64) -> Vec<Frame> {
    let mut replies = Vec::new();
    for seq in from..to {
        for w in workers {
            replies.extend(step(core, *w, seq, 0.01 * (*w as f32 + seq as f32)));
        }
    }
    replies
}

#[test]
fn a_restored_shard_continues_exactly_like_the_original() {
    for mode in [Mode::Async, Mode::Sync, Mode::Gba] {
        let (mut original, workers) = trained(mode, "nesterov", 3, 6);
        // Half a synchronous step is in flight: one worker pushed, two did not.
        step(&mut original, workers[0], 6, 0.2);
        let bytes = original.checkpoint(77).expect("checkpoint");
        let info = ShardCore::checkpoint_info(&bytes).expect("info");
        assert_eq!((info.id, info.shard, info.epoch), (77, 0, EPOCH));
        assert!(info.tensor_versions.iter().all(|v| *v > 0), "{mode}: {:?}", info.tensor_versions);

        let mut restored = ShardCore::restore(config(mode, "nesterov"), &bytes).expect("restore");
        assert_eq!(
            restored.checkpoint(77).expect("checkpoint"),
            bytes,
            "{mode}: a restore reproduces every byte of the state"
        );
        assert_eq!(restored.stats(), original.stats(), "{mode}");
        // The same traffic afterwards gives the same replies, bit for bit (leases are renewed by it).
        let a = train(&mut original, &workers[1..], 6, 7);
        let b = train(&mut restored, &workers[1..], 6, 7);
        assert_eq!(a, b, "{mode}");
        let a = train(&mut original, &workers, 7, 10);
        let b = train(&mut restored, &workers, 7, 10);
        assert_eq!(a, b, "{mode}");
        assert_eq!(restored.checkpoint(1).expect("checkpoint"), original.checkpoint(1).expect("checkpoint"), "{mode}");
        // The coordinator's worker counter survives: new workers get new ids.
        assert_eq!(register(&mut restored), 3);
    }
}

#[test]
fn a_push_acknowledged_before_the_checkpoint_is_not_applied_again_after_it() {
    let mut core = ShardCore::new(config(Mode::Async, "momentum")).expect("core");
    let w = register(&mut core);
    let replies = step(&mut core, w, 1, 0.1);
    assert!(matches!(replies[1].msg, Message::Ack(a) if !a.duplicate));
    let bytes = core.checkpoint(1).expect("checkpoint");
    let mut restored = ShardCore::restore(config(Mode::Async, "momentum"), &bytes).expect("restore");
    // The worker never saw the ack (say) and retries both pushes with the same numbers.
    let retried = step(&mut restored, w, 1, 0.1);
    assert!(matches!(retried[1].msg, Message::Ack(a) if a.duplicate), "{:?}", retried[1].msg);
    assert!(matches!(retried[3].msg, Message::Ack(a) if a.duplicate), "{:?}", retried[3].msg);
    assert_eq!(restored.stats().pushes_applied, 2);
}

#[test]
fn the_per_worker_ledger_goes_back_with_the_checkpoint_and_counts_what_its_state_holds() {
    let mut core = ShardCore::new(config(Mode::Async, "momentum")).expect("core");
    let (a, b) = (register(&mut core), register(&mut core));
    train(&mut core, &[a, b], 1, 3);
    let bytes = core.checkpoint(1).expect("checkpoint");
    train(&mut core, &[a], 4, 6);
    let applied = |core: &ShardCore| -> Vec<(u32, u64)> {
        core.stats().applied_by_worker.iter().map(|w| (w.worker, w.applied)).collect()
    };
    // Two pushes (dense and sparse) per step, steps 1-2 for both and 4-5 for `a`.
    assert_eq!(applied(&core), vec![(a, 8), (b, 4)]);
    let mut restored = ShardCore::restore(config(Mode::Async, "momentum"), &bytes).expect("restore");
    assert_eq!(applied(&restored), vec![(a, 4), (b, 4)], "what the restored state holds");
    // The steps after the checkpoint sent again with their numbers are applied once each, nothing twice.
    train(&mut restored, &[a], 4, 6);
    assert_eq!(applied(&restored), vec![(a, 8), (b, 4)]);
    let st = restored.stats();
    assert_eq!((st.pushes_applied, st.pushes_applied_twice), (12, 0));
}

#[test]
fn foreign_truncated_and_corrupt_checkpoints_are_refused_with_a_reason() {
    let mut core = ShardCore::new(config(Mode::Async, "momentum")).expect("core");
    let w = register(&mut core);
    train(&mut core, &[w], 1, 4);
    let bytes = core.checkpoint(5).expect("checkpoint");
    let refuse = |cfg: ShardConfig, bytes: &[u8]| match ShardCore::restore(cfg, bytes) {
        Ok(_) => panic!("a foreign checkpoint was restored"),
        Err(e) => e,
    };

    let err = refuse(ShardConfig { shard: 1, num_shards: 2, ..config(Mode::Async, "momentum") }, &bytes);
    assert!(matches!(err, CheckpointError::Mismatch(_)) && err.to_string().contains("shard 0 of 1"), "{err}");
    let err = refuse(config(Mode::Async, "sgd"), &bytes);
    assert!(err.to_string().contains("layout"), "a per-tensor rule is part of the layout: {err}");
    let other_sparse = SparseSettings { rule: Rule::Sgd, ..config(Mode::Async, "momentum").sparse };
    let err = refuse(ShardConfig { sparse: other_sparse, ..config(Mode::Async, "momentum") }, &bytes);
    assert!(err.to_string().contains("rules"), "{err}");
    let mut other_version = bytes.clone();
    other_version[8] = 99;
    assert!(matches!(refuse(config(Mode::Async, "momentum"), &other_version), CheckpointError::Version { found: 99 }));
    assert!(matches!(refuse(config(Mode::Async, "momentum"), b"not a checkpoint"), CheckpointError::Magic));

    // Every cut is an error, and so is trailing garbage; none panics.
    // (The admission sketch makes the file 4 MiB: every byte of the first 512, then 400 cuts spread over the rest.)
    let spread = (512..bytes.len()).step_by((bytes.len() / 400).max(1));
    for cut in (0..512).chain(spread).chain([bytes.len() - 1]) {
        assert!(ShardCore::restore(config(Mode::Async, "momentum"), &bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(ShardCore::restore(config(Mode::Async, "momentum"), &longer).is_err());
    // Flipped bytes either fail to parse or restore a shard that still works (the file's checksum is what
    // catches those); they never panic.
    let mut rng = gaps_common::rng::Rng::new(3);
    for _ in 0..100 {
        let mut flipped = bytes.clone();
        let at = (rng.next_u64() % flipped.len() as u64) as usize;
        flipped[at] ^= 1 << (rng.next_u64() % 8);
        if let Ok(mut c) = ShardCore::restore(config(Mode::Async, "momentum"), &flipped) {
            step(&mut c, w, 50, 0.1);
        }
    }
}

#[test]
fn a_rollback_returns_the_training_state_to_the_checkpoint_and_keeps_who_is_in_the_cluster() {
    for mode in [Mode::Async, Mode::Sync, Mode::Gba] {
        let (mut live, workers) = trained(mode, "nesterov", 3, 4);
        let bytes = live.checkpoint(5).expect("checkpoint");
        let at_checkpoint = ShardCore::restore(config(mode, "nesterov"), &bytes).expect("restore");
        // Training goes on; worker 2 leaves and a fourth worker joins after the checkpoint.
        train(&mut live, &workers, 4, 8);
        call(&mut live, Message::Leave(gaps_common::wire::Leave { worker: workers[2] }), vec![]);
        let late = register(&mut live);
        assert_ne!(live.stats().pushes_applied, at_checkpoint.stats().pushes_applied, "{mode}: training moved on");

        let mut back = live.rolled_back(&bytes).expect("roll back");
        let chunks: Vec<ChunkId> = layout_of(&back).chunks().collect();
        for c in &chunks {
            assert_eq!(
                back.chunk_values(*c).expect("values"),
                at_checkpoint.chunk_values(*c).expect("values"),
                "{mode}"
            );
        }
        assert_eq!(back.global_step(), at_checkpoint.global_step(), "{mode}: the step went back");
        assert_eq!(back.stats().pushes_applied, at_checkpoint.stats().pushes_applied, "{mode}");
        assert_eq!(back.live_workers(), 3, "{mode}: workers 0, 1 and the late one are live, 2 left");
        assert_eq!(register(&mut back), late + 1, "{mode}: worker ids are never handed out twice");
        // The cluster trains on from there: the remaining and the late workers' pushes are applied.
        let replies = train(&mut back, &[workers[0], workers[1], late], 8, 10);
        assert!(replies.iter().all(|f| !matches!(f.msg, Message::Error(_))), "{mode}: {replies:?}");
        // A checkpoint of another shard configuration is refused with the reason, and nothing changes.
        let mut other = ShardCore::new(config(mode, "momentum")).expect("core");
        assert!(other.rolled_back(&bytes).is_err(), "{mode}: another rule set");
    }
}

/// Format 7 writes the header as a derived struct in JSON, found by name; a header with a field this
/// version does not know is refused. A format-6 checkpoint — the same state with its header at fixed
/// places, as gaps wrote before — reads back to the same header and restores to the same state.
#[test]
fn the_header_is_named_fields_and_a_format_6_checkpoint_restores_the_same() {
    let (core, _) = trained(Mode::Sync, "nesterov", 2, 4);
    let bytes = core.checkpoint(9).expect("checkpoint");
    let info = ShardCore::checkpoint_info(&bytes).expect("info");
    assert_eq!((info.id, info.shard, info.num_shards, info.epoch), (9, 0, 1, EPOCH));
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")), 7, "the format");
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")) as usize;
    let (header, state) = (&bytes[20..20 + len], &bytes[20 + len..]);
    let text = std::str::from_utf8(header).expect("the header is text");
    assert!(text.contains("\"layout_fingerprint\":") && text.contains("\"rules\":"), "{text}");
    let with_header = |format: u32, header: &[u8]| {
        let mut out = b"GAPSSHRD".to_vec();
        out.extend(format.to_le_bytes());
        out.extend(header);
        out.extend(state);
        out
    };

    let unknown = text.replacen('{', "{\"written_by\":\"the future\",", 1);
    let mut framed = (unknown.len() as u64).to_le_bytes().to_vec();
    framed.extend(unknown.as_bytes());
    let err = ShardCore::checkpoint_info(&with_header(7, &framed)).expect_err("an unknown field");
    assert!(matches!(err, CheckpointError::Corrupt(_)) && err.to_string().contains("written_by"), "{err}");

    let mut fixed = Vec::new();
    fixed.extend(info.id.to_le_bytes());
    fixed.extend(info.shard.to_le_bytes());
    fixed.extend(info.num_shards.to_le_bytes());
    fixed.extend(info.epoch.to_le_bytes());
    fixed.extend(info.layout_fingerprint.to_le_bytes());
    fixed.extend((info.tensor_versions.len() as u64).to_le_bytes());
    info.tensor_versions.iter().for_each(|v| fixed.extend(v.to_le_bytes()));
    fixed.extend((info.rules.len() as u64).to_le_bytes());
    fixed.extend(info.rules.as_bytes());
    let old = with_header(6, &fixed);
    assert_eq!(ShardCore::checkpoint_info(&old), Ok(info));
    let from_new = ShardCore::restore(config(Mode::Sync, "nesterov"), &bytes).expect("format 7");
    let from_old = ShardCore::restore(config(Mode::Sync, "nesterov"), &old).expect("format 6");
    assert_eq!(from_old.checkpoint(9).expect("again"), from_new.checkpoint(9).expect("again"), "the same state");
}
