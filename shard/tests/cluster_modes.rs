//! Cluster-wide modes and synchronous embedding rows, through several ShardCores with virtual time.
//!
//! - Under `auto` the coordinator alone decides; workers carry its numbered decisions to the other shards,
//!   which switch at the same worker step — with uneven traffic (a shard that owns no dense chunk, rows
//!   routed to one shard at a time, pushes delivered in a shuffled order) and a shard restarted mid-run.
//! - In `sync` and `gba` the row gradients of a step are summed per id and applied once; `async` applies
//!   each push on arrival.

mod common;

use gaps_common::layout::{sparse_owner, ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::rng::Rng;
use gaps_common::wire::{
    ids_to_words, Ack, Frame, Heartbeat, Message, ModeDecisions, ModeSwitchRecord, Pull, Push, PushChunk, Register,
    Role, SparsePull, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::core::SparseSettings;
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::{Init, ShardConfig, ShardCore};
use std::time::Duration;

const EPOCH: u64 = 7;
const DIM: u32 = 4;

fn config(shard: u32, num_shards: u32, mode: Mode) -> ShardConfig {
    // Two dense chunks over three shards: shard 2 owns none and sees only empty pushes and rows.
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 16)], 8, vec![SparseSpec::new("emb", DIM)]).expect("layout");
    ShardConfig {
        shard,
        num_shards,
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.0 },
        lease: Duration::from_secs(600),
        advertise: format!("shard-{shard}:1"),
        epoch: EPOCH,
        sparse: SparseSettings {
            rule: Rule::Sgd,
            hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
            init_std: 0.0,
            ..SparseSettings::default()
        },
        modes: ModeConfig { mode, gba_threshold: 1, ..ModeConfig::default() },
        ..ShardConfig::new(layout)
    }
}

/// Shards 0..n, the others joined to shard 0.
fn cluster(n: u32, mode: Mode) -> Vec<ShardCore> {
    let mut shards = vec![ShardCore::new(config(0, n, mode)).expect("coordinator")];
    for s in 1..n {
        let joined = join(&mut shards[0], s, n, mode);
        shards.push(joined);
    }
    shards
}

fn join(coordinator: &mut ShardCore, shard: u32, n: u32, mode: Mode) -> ShardCore {
    let mut core = ShardCore::new(config(shard, n, mode)).expect("shard");
    let (reply, _) = coordinator.handle(Frame::new(core.join_request()), Duration::ZERO);
    let Message::ClusterMap(map) = reply.msg else { panic!("join refused: {:?}", reply.msg) };
    core.joined(&map).expect("joined");
    core
}

/// Registers `n` workers with the coordinator and renews their leases everywhere.
fn register(shards: &mut [ShardCore], n: u32) {
    for _ in 0..n {
        let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() });
        let (reply, _) = shards[0].handle(Frame::new(reg), Duration::ZERO);
        assert!(matches!(reply.msg, Message::ClusterMap(_)), "{:?}", reply.msg);
    }
    for core in shards.iter_mut() {
        for worker in 0..n {
            core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker })), Duration::ZERO);
        }
    }
}

fn ack(frame: Frame) -> Ack {
    match frame.msg {
        Message::Ack(a) => a,
        other => panic!("expected an ack, got {other:?}"),
    }
}

/// The chunks a shard owns and their versions now.
fn owned_versions(core: &mut ShardCore) -> Vec<(ChunkId, u64)> {
    let n = core.config().num_shards;
    let me = core.config().shard;
    let ids: Vec<ChunkId> = core.config().layout.chunks_of_shard(me, n);
    let (reply, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: EPOCH, chunks: ids })), Duration::ZERO);
    match reply.msg {
        Message::PullReply(r) => r.chunks.iter().map(|c| (c.id, c.version)).collect(),
        other => panic!("{other:?}"),
    }
}

fn dense_push(
    worker: u32,
    seq: u64,
    step: u64,
    decisions: ModeDecisions,
    compute_ms: u32,
    chunks: &[(ChunkId, u64)],
) -> Frame {
    let chunks: Vec<PushChunk> = chunks.iter().map(|(id, v)| PushChunk::f32(*id, *v, 8)).collect();
    let payload = vec![0.01; chunks.len() * 8];
    Frame {
        msg: Message::Push(Push { epoch: EPOCH, worker, seq, chunks, compute_ms, step, decisions, data: None }),
        payload,
    }
}

fn row_pull(core: &mut ShardCore, ids: &[u64]) -> (Vec<u32>, Vec<f32>) {
    let mut words = Vec::new();
    ids_to_words(ids, &mut words);
    let msg = Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: ids.len() as u32, create: true });
    let (reply, _) = core.handle(Frame { msg, payload: words }, Duration::ZERO);
    match reply.msg {
        Message::SparsePullReply(r) => {
            let (v, rows) = reply.payload.split_at(r.count as usize);
            (v.iter().map(|w| w.to_bits()).collect(), rows.to_vec())
        }
        other => panic!("{other:?}"),
    }
}

fn row_push(worker: u32, seq: u64, ids: &[u64], versions: &[u32], grads: &[f32]) -> Frame {
    common::sparse_push_frame(EPOCH, worker, seq, DIM, ids, versions, grads)
}

/// The mode a worker step runs in, by the coordinator's switches.
fn mode_at(switches: &[ModeSwitchRecord], step: u64) -> u8 {
    switches.iter().rfind(|s| step >= s.from_step).map_or(Mode::Sync.code(), |s| s.to)
}

fn decisions(core: &ShardCore) -> Vec<(u64, u8, u8, u64)> {
    core.switches().map(|s| (s.number, s.from, s.to, s.from_step)).collect()
}

#[test]
fn shards_never_disagree_on_the_mode_with_uneven_traffic_and_a_restart() {
    // Each seed delivers the pushes in other orders, so the decisions fall at different points of a step.
    for seed in 1..=16 {
        uneven_run(seed);
    }
}

fn uneven_run(seed: u64) {
    const WORKERS: u32 = 4;
    const ROUNDS: u64 = 60;
    let mut shards = cluster(3, Mode::Auto);
    register(&mut shards, WORKERS);
    let mut rng = Rng::new(seed);
    let mut seqs = vec![[0u64; 3]; WORKERS as usize];
    let mut known = vec![ModeDecisions::default(); WORKERS as usize];
    // (shard, step, mode the push ran in), for every dense push of the run.
    let mut ran: Vec<(usize, u64, u8)> = Vec::new();
    let mut before_restart = Vec::new();
    for step in 0..ROUNDS {
        if step == 30 {
            // Shard 2 restarts with nothing (no checkpoint): it learns the decision in force from the next push.
            before_restart = decisions(&shards[2]);
            let fresh = join(&mut shards[0], 2, 3, Mode::Auto);
            shards[2] = fresh;
            assert_eq!(shards[2].decisions().latest.number, 0);
        }
        // Worker 1 straggles from step 10 to 25 (a step takes 100 ms of the shards' clock).
        let compute = |w: u32| if w == 1 && (10..25).contains(&step) { 400 } else { 100 };
        let reads: Vec<Vec<(ChunkId, u64)>> = shards.iter_mut().map(owned_versions).collect();
        let mut messages: Vec<(usize, u32, Frame)> = Vec::new();
        for w in 0..WORKERS {
            // One row per worker and step, on whichever shard owns it: rows reach the shards unevenly. The
            // row goes before the worker's dense push to its shard, as the client orders them.
            let id = rng.next_u64() % 1000;
            let owner = sparse_owner(0, id, 3) as usize;
            let (versions, _) = row_pull(&mut shards[owner], &[id]);
            seqs[w as usize][owner] += 1;
            let frame = row_push(w, seqs[w as usize][owner], &[id], &versions, &[0.5; DIM as usize]);
            let reply = ack(shards[owner].handle(frame, Duration::from_millis(100 * step)).0);
            known[w as usize].merge(&reply.decisions);
            for s in 0..3 {
                seqs[w as usize][s] += 1;
                let frame = dense_push(w, seqs[w as usize][s], step, known[w as usize], compute(w), &reads[s]);
                messages.push((s, w, frame));
            }
        }
        // Shuffled delivery: shards see the workers in different orders.
        for i in (1..messages.len()).rev() {
            messages.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut learned = known.clone();
        for (s, w, frame) in messages {
            let reply = ack(shards[s].handle(frame, Duration::from_millis(100 * step)).0);
            ran.push((s, step, shards[s].active_mode().code()));
            learned[w as usize].merge(&reply.decisions);
        }
        known = learned;
    }
    let coordinator: Vec<ModeSwitchRecord> = shards[0].switches().cloned().collect();
    assert_eq!(coordinator.len(), 2, "sync -> gba -> sync: {coordinator:?}");
    assert_eq!((coordinator[0].from, coordinator[0].to), (Mode::Sync.code(), Mode::Gba.code()));
    assert_eq!((coordinator[1].from, coordinator[1].to), (Mode::Gba.code(), Mode::Sync.code()));
    assert!(coordinator[0].reason.contains("worker 1"), "{:?}", coordinator[0].reason);
    assert!(coordinator[1].reason.contains("recovered"), "{:?}", coordinator[1].reason);
    assert_eq!(decisions(&shards[1]), decisions(&shards[0]), "seed {seed}: shard 1 switched elsewhere");
    assert_eq!(before_restart, decisions(&shards[0])[..before_restart.len()], "shard 2 before its restart");
    // The restarted shard took over the decision in force (gba, decided before the restart) at its first
    // push, and the next one at the same step as the others.
    let restarted = decisions(&shards[2]);
    let in_force = decisions(&shards[0]).into_iter().filter(|d| d.0 >= restarted[0].0).collect::<Vec<_>>();
    assert_eq!(restarted, in_force, "shard 2 after its restart");
    for (s, step, mode) in &ran {
        assert_eq!(*mode, mode_at(&coordinator, *step), "seed {seed}: shard {s} ran step {step} in mode {mode}");
    }
    let steps: Vec<u64> = shards.iter().map(|c| c.stats().steps_gba).collect();
    assert!(steps.iter().all(|n| *n > 0), "every shard ran gba steps: {steps:?}");
}

/// Two workers pull and push the same row in one step; returns the row's version and values after both
/// dense pushes.
fn same_row_twice(mode: Mode) -> (u32, Vec<f32>, u64) {
    let mut shards = cluster(1, mode);
    register(&mut shards, 2);
    let core = &mut shards[0];
    let (versions, before) = row_pull(core, &[7]);
    assert_eq!((versions[0], before[0]), (0, 0.0));
    let reads = owned_versions(core);
    for (w, g) in [(0u32, 1.0f32), (1, 3.0)] {
        let reply = ack(core.handle(row_push(w, 1, &[7], &versions, &[g; DIM as usize]), Duration::ZERO).0);
        assert!(!reply.duplicate);
    }
    for w in 0..2u32 {
        ack(core.handle(dense_push(w, 2, 0, ModeDecisions::default(), 10, &reads), Duration::ZERO).0);
    }
    let (versions, after) = row_pull(core, &[7]);
    (versions[0], after, core.stats().rows_dropped_stale)
}

#[test]
fn sync_and_gba_apply_a_row_once_per_step_with_the_mean_gradient() {
    for mode in [Mode::Sync, Mode::Gba] {
        let (version, row, dropped) = same_row_twice(mode);
        assert_eq!(version, 1, "{mode}: one update of row 7 per step");
        // SGD, η 0.1, mean of 1 and 3 over the step's two pushes.
        assert!(row.iter().all(|v| (v + 0.2).abs() < 1e-6), "{mode}: {row:?}");
        assert_eq!(dropped, 0);
    }
    let (version, row, _) = same_row_twice(Mode::Async);
    assert_eq!(version, 2, "async applies each push on arrival");
    assert!(row.iter().all(|v| (v + 0.4).abs() < 1e-6), "{row:?}");
}

#[test]
fn stale_rows_are_dropped_per_id_in_sync_and_beyond_the_threshold_in_gba() {
    for (mode, kept) in [(Mode::Sync, false), (Mode::Gba, true)] {
        let mut shards = cluster(1, mode);
        register(&mut shards, 1);
        let core = &mut shards[0];
        let (old, _) = row_pull(core, &[3, 4]);
        // One step updates row 3 only.
        let reads = owned_versions(core);
        ack(core.handle(row_push(0, 1, &[3], &old[..1], &[1.0; DIM as usize]), Duration::ZERO).0);
        ack(core.handle(dense_push(0, 2, 0, ModeDecisions::default(), 10, &reads), Duration::ZERO).0);
        // A gradient computed on the old rows: row 3 is one update stale, row 4 is current.
        let reads = owned_versions(core);
        ack(core.handle(row_push(0, 3, &[3, 4], &old, &[1.0; 2 * DIM as usize]), Duration::ZERO).0);
        ack(core.handle(dense_push(0, 4, 1, ModeDecisions::default(), 10, &reads), Duration::ZERO).0);
        let (versions, _) = row_pull(core, &[3, 4]);
        let stats = core.stats();
        assert_eq!(versions[1], 1, "{mode}: row 4 was current");
        if kept {
            assert_eq!((versions[0], stats.rows_dropped_stale), (2, 0), "{mode}: staleness 1 is within the threshold");
        } else {
            assert_eq!((versions[0], stats.rows_dropped_stale), (1, 1), "{mode}: a stale row is dropped");
        }
    }
}

#[test]
fn a_checkpoint_keeps_the_rows_of_a_step_in_progress_and_the_decision() {
    let mut shards = cluster(1, Mode::Sync);
    register(&mut shards, 2);
    let core = &mut shards[0];
    let (versions, _) = row_pull(core, &[9]);
    ack(core.handle(row_push(0, 1, &[9], &versions, &[2.0; DIM as usize]), Duration::ZERO).0);
    assert!(core.step_in_progress(), "summed rows are a step in progress");
    let bytes = core.checkpoint(1).expect("checkpoint");
    let mut restored = ShardCore::restore(config(0, 1, Mode::Sync), &bytes).expect("restore");
    let reads = owned_versions(&mut restored);
    for w in 0..2u32 {
        ack(restored.handle(dense_push(w, 2, 0, ModeDecisions::default(), 10, &reads), Duration::ZERO).0);
    }
    let (versions, row) = row_pull(&mut restored, &[9]);
    assert_eq!(versions[0], 1);
    assert!(row.iter().all(|v| (v + 0.1).abs() < 1e-6), "2.0 over the step's two pushes at η 0.1: {row:?}");
}
