//! Training modes through ShardCore with virtual time: sync steps and dead workers, GBA aggregation and
//! staleness, automatic switching on a straggler and back, the elastic learning-rate ramp, bounded staleness.

use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::wire::{
    Ack, Frame, Heartbeat, Message, Pull, Push, PushChunk, PushPullReply, Register, Role, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::core::SparseSettings;
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::{CoreEvent, Init, ShardConfig, ShardCore};
use std::time::Duration;

const EPOCH: u64 = 3;
const LEASE_MS: u64 = 1000;
const ID: ChunkId = ChunkId { tensor: 0, chunk: 0 };

/// One shard of one 4-float chunk, SGD with lr 0.1, zero initial values, in `mode`.
fn config(mode: Mode) -> ShardConfig {
    ShardConfig {
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.0 },
        lease: Duration::from_millis(LEASE_MS),
        advertise: "x:1".into(),
        epoch: EPOCH,
        modes: ModeConfig { mode, gba_threshold: 1, ssp_bound: 1, ..ModeConfig::default() },
        ..ShardConfig::new(Layout::new(vec![TensorSpec::new("w", 4)], 4).expect("layout"))
    }
}

/// A core of `cfg` with `workers` workers registered (ids 0, 1, …).
fn with_workers(cfg: ShardConfig, workers: u32) -> ShardCore {
    let mut core = ShardCore::new(cfg).expect("core");
    for _ in 0..workers {
        let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() });
        core.handle(Frame::new(reg), Duration::ZERO);
    }
    core
}

fn core(mode: Mode, workers: u32) -> ShardCore {
    with_workers(config(mode), workers)
}

fn ms(t: u64) -> Duration {
    Duration::from_millis(t)
}

fn version(core: &mut ShardCore) -> u64 {
    let (r, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: EPOCH, chunks: vec![ID] })), Duration::ZERO);
    match r.msg {
        Message::PullReply(p) => p.chunks[0].version,
        other => panic!("{other:?}"),
    }
}

fn push(
    core: &mut ShardCore,
    worker: u32,
    seq: u64,
    read_version: u64,
    grad: f32,
    compute_ms: u32,
    now: Duration,
) -> (Ack, Vec<CoreEvent>) {
    let msg = Message::Push(Push {
        epoch: EPOCH,
        worker,
        seq,
        chunks: vec![PushChunk::f32(ID, read_version, 4)],
        compute_ms,
        // Each worker's pushes are its steps.
        step: seq - 1,
        decisions: Default::default(),
        data: None,
    });
    let (r, events) = core.handle(Frame { msg, payload: vec![grad; 4] }, now);
    match r.msg {
        Message::Ack(a) => (a, events),
        other => panic!("{other:?}"),
    }
}

/// A push sent again after its ack was lost — whole or as a part of a striped push — is acknowledged as a
/// duplicate with the wait the first ack asked for while its step is open, and without one once the step
/// is applied: the worker never leaves a synchronous step early.
#[test]
fn a_duplicate_in_sync_asks_for_the_wait_the_first_ack_did() {
    let mut core = core(Mode::Sync, 2);
    let (first, _) = push(&mut core, 0, 1, 0, 1.0, 0, ms(1));
    assert_eq!(first.wait_for_step, 1);
    let (again, _) = push(&mut core, 0, 1, 0, 1.0, 0, ms(2));
    assert_eq!((again.duplicate, again.wait_for_step), (true, 1));
    let part =
        gaps_common::wire::PushPart { part: 0, parts: 2, push: Push::new(EPOCH, 0, 1, vec![PushChunk::f32(ID, 0, 4)]) };
    let (r, _) = core.handle(Frame { msg: Message::PushPart(part.clone()), payload: vec![1.0; 4] }, ms(3));
    let Message::Ack(part_ack) = r.msg else { panic!("{:?}", r.msg) };
    assert_eq!((part_ack.duplicate, part_ack.wait_for_step), (true, 1));
    // Worker 1 completes the step: a duplicate now asks for nothing.
    push(&mut core, 1, 1, 0, 1.0, 0, ms(4));
    let (late, _) = push(&mut core, 0, 1, 0, 1.0, 0, ms(5));
    assert_eq!((late.duplicate, late.wait_for_step), (true, 0));
}

#[test]
fn a_sync_step_averages_one_gradient_per_live_worker() {
    let mut core = core(Mode::Sync, 3);
    let (a0, _) = push(&mut core, 0, 1, 0, 1.0, 0, ms(1));
    let (a1, _) = push(&mut core, 1, 1, 0, 2.0, 0, ms(1));
    assert_eq!((a0.wait_for_step, a1.wait_for_step), (1, 1), "wait for step 1");
    assert_eq!(version(&mut core), 0, "nothing applied before every live worker pushed");
    let (a2, _) = push(&mut core, 2, 1, 0, 6.0, 0, ms(1));
    assert_eq!(a2.wait_for_step, 0, "the last gradient completes the step");
    assert_eq!(version(&mut core), 1);
    let w = core.chunk_values(ID).expect("chunk")[0];
    assert!((w + 0.1 * 3.0).abs() < 1e-6, "θ = −η·mean(1, 2, 6) = −0.3, got {w}");
    // A gradient computed on an old step is dropped, not averaged in.
    let (_, _) = push(&mut core, 0, 2, 0, 100.0, 0, ms(2));
    assert_eq!(core.stats().dropped_stale, 1);
    assert_eq!(core.stats().steps_sync, 1);
    // ... but it fills worker 0's place in step 2: the fresh gradients of 1 and 2 complete it, and worker 0
    // was not left to compute another gradient while the others wait for it.
    let (a1, _) = push(&mut core, 1, 2, 1, 1.0, 0, ms(2));
    assert_eq!(a1.wait_for_step, 2, "worker 2 is still missing");
    let (a2, _) = push(&mut core, 2, 2, 1, 3.0, 0, ms(2));
    assert_eq!(a2.wait_for_step, 0);
    assert_eq!(version(&mut core), 2, "step 2 completed without a second gradient from worker 0");
    let w2 = core.chunk_values(ID).expect("chunk")[0];
    assert!((w2 - w + 0.1 * 2.0).abs() < 1e-6, "θ −= η·mean(1, 3): {w} -> {w2}");
    // A stale gradient arriving after the fresh ones completes the step it fills.
    let (a0, _) = push(&mut core, 0, 3, 2, 1.0, 0, ms(3));
    assert_eq!(a0.wait_for_step, 3);
    push(&mut core, 1, 3, 2, 1.0, 0, ms(3));
    let (a2, _) = push(&mut core, 2, 3, 1, 50.0, 0, ms(3));
    assert_eq!(a2.wait_for_step, 0, "worker 2's stale gradient is its place in step 3");
    assert_eq!(version(&mut core), 3);
    assert_eq!(core.stats().dropped_stale, 2);
}

#[test]
fn a_push_pull_carries_values_only_when_the_worker_may_go_on() {
    let push_pull = |core: &mut ShardCore, worker: u32, seq: u64, read_version: u64| {
        push_pull_at(core, worker, seq, read_version, 1.0, ms(1))
    };
    // Sync: the first of two workers waits for the step and gets no values (a pull now would read the step
    // before); the push that completes the step is answered with the step's values.
    let mut sync = core(Mode::Sync, 2);
    let (ack, chunks, values) = push_pull(&mut sync, 0, 1, 0);
    assert_eq!((ack.wait_for_step, chunks.len(), values.len()), (1, 0, 0));
    let (ack, chunks, values) = push_pull(&mut sync, 1, 1, 0);
    assert_eq!((ack.wait_for_step, chunks.len()), (0, 1));
    assert_eq!((chunks[0].version, values), (1, sync.chunk_values(ID).expect("chunk").to_vec()));
    // Bounded staleness: a worker too far ahead of the slowest is told to wait, with no values.
    let mut ssp = core(Mode::Ssp, 2);
    let (ack, chunks, _) = push_pull(&mut ssp, 0, 1, 0);
    assert_eq!((ack.wait_for_clock, chunks.len()), (0, 1));
    let (ack, chunks, values) = push_pull(&mut ssp, 0, 2, 1);
    assert!(ack.wait_for_clock > 0, "{ack:?}");
    assert_eq!((chunks.len(), values.len()), (0, 0));
}

#[test]
fn a_dead_worker_holds_a_sync_step_no_longer_than_its_lease() {
    let mut core = core(Mode::Sync, 3);
    push(&mut core, 0, 1, 0, 1.0, 0, ms(100));
    push(&mut core, 1, 1, 0, 1.0, 0, ms(100));
    // Workers 0 and 1 keep heartbeating; worker 2 went silent after registering at t = 0.
    for t in [400, 800] {
        for w in 0..2 {
            core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: w })), ms(t));
        }
        assert!(core.tick(ms(t)).is_empty());
        assert_eq!(version(&mut core), 0, "still waiting at {t} ms");
    }
    let events = core.tick(ms(LEASE_MS));
    assert!(events.contains(&CoreEvent::WorkerExpired(2)), "{events:?}");
    assert_eq!(version(&mut core), 1, "the step completed without the dead worker");
    assert_eq!(core.stats().live_workers, 2);
}

#[test]
fn a_worker_that_heartbeats_but_never_pushes_holds_a_sync_step_at_most_one_lease() {
    let mut core = core(Mode::Sync, 3);
    push(&mut core, 0, 1, 0, 1.0, 0, ms(100));
    push(&mut core, 1, 1, 0, 1.0, 0, ms(100));
    // Worker 2 keeps its lease with heartbeats but sends no gradient; 0 and 1 wait at the step.
    let mut t = 100;
    while t < 100 + LEASE_MS {
        for w in 0..3 {
            core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: w })), ms(t));
        }
        core.tick(ms(t));
        assert_eq!(version(&mut core), 0, "within a lease of the step's first gradient it waits ({t} ms)");
        t += 200;
    }
    for w in 0..3 {
        core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: w })), ms(100 + LEASE_MS));
    }
    let events = core.tick(ms(100 + LEASE_MS));
    assert!(!events.iter().any(|e| matches!(e, CoreEvent::WorkerExpired(_))), "every lease holds: {events:?}");
    assert_eq!(version(&mut core), 1, "a lease after the step's first gradient, it went on without worker 2");
    assert_eq!(core.stats().live_workers, 3, "worker 2 is still a live worker");
    // A worker that does push is waited for as before: the next step needs all three.
    let t = 200 + LEASE_MS;
    push(&mut core, 0, 2, 1, 1.0, 0, ms(t));
    push(&mut core, 2, 1, 1, 1.0, 0, ms(t));
    assert_eq!(version(&mut core), 1, "the step waits for worker 1");
    push(&mut core, 1, 2, 1, 1.0, 0, ms(t));
    assert_eq!(version(&mut core), 2);
}

#[test]
fn gba_applies_one_update_per_k_gradients_and_drops_very_stale_ones() {
    let mut core = core(Mode::Gba, 2);
    let (a, _) = push(&mut core, 0, 1, 0, 1.0, 0, ms(1));
    assert_eq!(a.wait_for_step, 0, "GBA never makes a worker wait");
    push(&mut core, 0, 2, 0, 3.0, 0, ms(1));
    assert_eq!(version(&mut core), 1, "K = 2 live workers' worth of gradients, from anyone");
    push(&mut core, 1, 1, 1, 1.0, 0, ms(2));
    push(&mut core, 1, 2, 1, 1.0, 0, ms(2));
    assert_eq!(version(&mut core), 2);
    // Read at version 0, now at 2: staleness 2 > threshold 1, dropped.
    push(&mut core, 0, 3, 0, 1.0, 0, ms(3));
    assert_eq!(core.stats().dropped_stale, 1);
    assert_eq!(core.stats().steps_gba, 2);
}

/// A push-pull of one gradient of `grad` at `now`: the ack, the chunks read and their values.
fn push_pull_at(
    core: &mut ShardCore,
    worker: u32,
    seq: u64,
    read_version: u64,
    grad: f32,
    now: Duration,
) -> (Ack, Vec<gaps_common::wire::ChunkVersion>, Vec<f32>) {
    let chunk = PushChunk { id: ID, read_version, len: 4, echo: false, dtype: gaps_common::dtype::WireDtype::F32 };
    let push = Push { step: seq - 1, ..Push::new(EPOCH, worker, seq, vec![chunk]) };
    let (r, _) = core.handle(Frame { msg: Message::PushPull(push), payload: vec![grad; 4] }, now);
    match r.msg {
        Message::PushPullReply(PushPullReply { ack, chunks }) => (ack, chunks, r.payload),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gba_push_pull_waits_for_a_step_the_others_are_due_to_complete() {
    let cfg = |hold: f64| ShardConfig {
        modes: ModeConfig { mode: Mode::Gba, gba_hold: hold, ..ModeConfig::default() },
        ..config(Mode::Gba)
    };
    for hold in [0.5, 0.0] {
        let mut core = with_workers(cfg(hold), 3);
        // Three workers of equal speed, one push every 10 ms each: a step per round.
        for round in 0..4u64 {
            for w in 0..3u32 {
                push(&mut core, w, round + 1, round, 1.0, 0, ms(10 * round + u64::from(w)));
            }
        }
        assert_eq!(version(&mut core), 4);
        // Round 5: worker 0 is first; the other two are due within half its 10 ms step.
        let (ack, chunks, values) = push_pull_at(&mut core, 0, 5, 4, 1.0, ms(40));
        let chunks = chunks.len();
        assert_eq!(ack.wait_for_step, 0, "a hold never asks the worker to wait itself");
        let held = core.take_gba_hold();
        if hold == 0.0 {
            assert_eq!((held, chunks), (None, 1), "--gba-hold 0 answers at once, with the step read ahead");
            continue;
        }
        assert_eq!((held, chunks, values.len()), (Some(ms(45)), 0, 0), "held until 45 ms, no values yet");
        assert_eq!(core.take_gba_hold(), None, "asked once");
        let (_, chunks, _) = push_pull_at(&mut core, 1, 5, 4, 1.0, ms(41));
        let chunks = chunks.len();
        assert_eq!((core.take_gba_hold(), chunks), (Some(ms(46)), 0), "worker 2 is due: held too");
        // The last gradient completes the step and is answered with its values.
        let (_, chunks, values) = push_pull_at(&mut core, 2, 5, 4, 1.0, ms(42));
        let chunks = chunks.len();
        assert_eq!((core.take_gba_hold(), chunks), (None, 1));
        assert_eq!(values, core.chunk_values(ID).expect("chunk").to_vec());
        // A retry of a push already applied is a duplicate, answered at once.
        let (ack, chunks, _) = push_pull_at(&mut core, 0, 5, 4, 1.0, ms(43));
        let chunks = chunks.len();
        assert!(ack.duplicate);
        assert_eq!((core.take_gba_hold(), chunks), (None, 1));
        // Round 6 with worker 2 gone quiet (it stops pushing): 0 and 1 push, and at 62 ms worker 2 is more
        // than one interval overdue, so nobody is held for it.
        push(&mut core, 0, 6, 5, 1.0, 0, ms(50));
        let (_, chunks, _) = push_pull_at(&mut core, 1, 6, 5, 1.0, ms(72));
        let chunks = chunks.len();
        assert_eq!((core.take_gba_hold(), chunks), (None, 1), "the step's missing gradient is due from nobody");
    }
}

#[test]
fn auto_switches_to_gba_when_a_worker_straggles_and_back_when_it_recovers() {
    let mut core = core(Mode::Auto, 4);
    assert_eq!(core.active_mode(), Mode::Sync);
    let mut seqs = [0u64; 4];
    let mut switches = Vec::new();
    // A round of steps takes 100 ms of the shard's clock.
    let mut now = 0u64;
    let mut run = |core: &mut ShardCore, rounds: u32, slow: u32| {
        for _ in 0..rounds {
            now += 100;
            for w in 0..4u32 {
                seqs[w as usize] += 1;
                let v = version(core);
                let compute = if w == 1 { slow } else { 100 };
                let (_, events) = push(core, w, seqs[w as usize], v, 0.1, compute, ms(now));
                switches.extend(events.into_iter().filter(|e| matches!(e, CoreEvent::ModeSwitch { .. })));
            }
        }
    };
    // Judged from the 3rd report, 4 judgments in a row make the verdict (at the 6th); the decision takes
    // effect two steps later.
    run(&mut core, 9, 400);
    assert_eq!(core.active_mode(), Mode::Gba);
    // Recovered: the window's median is fast from the 3rd fast report, 4 judgments later the verdict; the
    // switch back waits for the minimum time in a mode (2 s, 20 rounds) to pass.
    run(&mut core, 10, 100);
    assert_eq!(core.active_mode(), Mode::Gba, "held by the minimum time in a mode");
    run(&mut core, 15, 100);
    assert_eq!(core.active_mode(), Mode::Sync);
    assert_eq!(switches.len(), 2, "{switches:?}");
    match &switches[0] {
        CoreEvent::ModeSwitch { from, to, reason } => {
            assert_eq!((*from, *to), (Mode::Sync, Mode::Gba));
            assert!(reason.contains("worker 1"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let stats = core.stats();
    assert_eq!(stats.mode_switches, 2);
    assert!(stats.steps_sync > 0 && stats.steps_gba > 0, "{stats:?}");
}

#[test]
fn the_learning_rate_multiplier_ramps_when_workers_join() {
    let mut core = core(Mode::Sync, 2);
    assert_eq!(core.lr_multiplier(), 1.0);
    // Training starts with 2 workers (the reference for linear scaling) ...
    push(&mut core, 0, 1, 0, 0.0, 0, ms(1));
    push(&mut core, 1, 1, 0, 0.0, 0, ms(1));
    assert_eq!(version(&mut core), 1);
    // ... then a third joins.
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "late".into() });
    let (_, events) = core.handle(Frame::new(reg), ms(5));
    assert!(
        events.iter().any(|e| matches!(e, CoreEvent::LrRamp { workers: 3, target } if (target - 1.5).abs() < 1e-12)),
        "{events:?}"
    );
    // 8 × 1.5 = 12 steps from 1 to 1.5: after 6 steps halfway.
    let mut seqs = [1u64, 1, 0];
    for _ in 0..6 {
        let v = version(&mut core);
        for w in 0..3u32 {
            seqs[w as usize] += 1;
            push(&mut core, w, seqs[w as usize], v, 0.0, 0, ms(6));
        }
    }
    assert!((core.lr_multiplier() - 1.25).abs() < 1e-9, "{}", core.lr_multiplier());
    assert!((core.lr() - 0.125).abs() < 1e-6);
}

#[test]
fn ssp_makes_a_worker_far_ahead_wait_for_the_slowest() {
    let mut core = core(Mode::Ssp, 2);
    let (a1, _) = push(&mut core, 0, 1, 0, 0.1, 0, ms(1));
    assert_eq!(a1.wait_for_clock, 0, "one push ahead is within the bound");
    let (a2, _) = push(&mut core, 0, 2, 1, 0.1, 0, ms(1));
    assert_eq!(a2.wait_for_clock, 1, "two ahead of a worker at clock 0: wait until it reaches 1");
    assert_eq!(version(&mut core), 2, "updates still apply at once");
    push(&mut core, 1, 1, 2, 0.1, 0, ms(2));
    assert_eq!(core.stats().ssp_min_clock, 1);
}

/// A GBA shard of one dense chunk and one embedding table (SGD for both), two workers registered.
fn gba_core_with_table(lookahead: bool) -> ShardCore {
    use gaps_common::layout::SparseSpec;
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 4)], 4, vec![SparseSpec::new("emb", 2)]).expect("layout");
    let sparse = SparseSettings {
        rule: Rule::Sgd,
        hyper: Hyper { lr: 0.5, momentum: 0.0, ..Hyper::default() },
        init_std: 0.1,
        ..SparseSettings::default()
    };
    let modes = ModeConfig { mode: Mode::Gba, gba_lookahead: lookahead, ..ModeConfig::default() };
    with_workers(ShardConfig { layout, sparse, modes, ..config(Mode::Gba) }, 2)
}

/// Pulls the dense chunk: (version, values).
fn pull_dense(core: &mut ShardCore) -> (u64, Vec<f32>) {
    let (r, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: EPOCH, chunks: vec![ID] })), Duration::ZERO);
    let views = core.take_reply_views();
    match r.msg {
        Message::PullReply(p) if views.is_empty() => (p.chunks[0].version, r.payload),
        Message::PullReply(p) => (p.chunks[0].version, views.iter().flat_map(|v| v.iter().copied()).collect()),
        other => panic!("{other:?}"),
    }
}

/// Pulls one embedding row: (version, values).
fn pull_row(core: &mut ShardCore, id: u64) -> (u32, Vec<f32>) {
    let mut words = Vec::new();
    gaps_common::wire::ids_to_words(&[id], &mut words);
    let msg = Message::SparsePull(gaps_common::wire::SparsePull { epoch: EPOCH, table: 0, count: 1, create: true });
    let (r, _) = core.handle(Frame { msg, payload: words }, Duration::ZERO);
    assert!(matches!(r.msg, Message::SparsePullReply(_)), "{:?}", r.msg);
    (r.payload[0].to_bits(), r.payload[1..].to_vec())
}

fn push_row(core: &mut ShardCore, worker: u32, seq: u64, id: u64, version: u32, grad: [f32; 2]) {
    let mut payload = Vec::new();
    gaps_common::wire::ids_to_words(&[id], &mut payload);
    payload.push(f32::from_bits(version));
    payload.extend_from_slice(&grad);
    let msg = Message::SparsePush(gaps_common::wire::SparsePush {
        epoch: EPOCH,
        worker,
        seq,
        table: 0,
        count: 1,
        dim: 2,
        echo_read: false,
    });
    assert!(matches!(core.handle(Frame { msg, payload }, Duration::ZERO).0.msg, Message::Ack(_)));
}

#[test]
fn a_gba_pull_reads_the_step_in_progress_and_the_step_applied_is_unchanged() {
    for lookahead in [true, false] {
        let mut core = gba_core_with_table(lookahead);
        let (v0, row0) = pull_row(&mut core, 7);
        // Worker 0's step: a row gradient, then its dense gradient (1 of K = 2).
        push_row(&mut core, 0, 1, 7, v0, [1.0, -2.0]);
        push(&mut core, 0, 2, 0, 1.0, 0, ms(1));
        let (version, dense) = pull_dense(&mut core);
        let (row_version, row) = pull_row(&mut core, 7);
        assert_eq!((version, row_version), (0, v0), "nothing applied yet: versions stay");
        if lookahead {
            // θ − η·(sum / K): −0.1 · 1/2; the row: −0.5 · (1, −2)/2.
            assert!(dense.iter().all(|w| (w + 0.05).abs() < 1e-6), "{dense:?}");
            assert!(
                (row[0] - (row0[0] - 0.25)).abs() < 1e-6 && (row[1] - (row0[1] + 0.5)).abs() < 1e-6,
                "{row0:?} -> {row:?}"
            );
        } else {
            assert_eq!(dense, vec![0.0; 4], "GBA as published reads the last applied step");
            assert_eq!(row, row0);
        }
        // Worker 1 completes the step with a zero gradient and no rows: the step applied is the mean of the
        // two, which is what the pulls above read ahead.
        push(&mut core, 1, 1, 0, 0.0, 0, ms(2));
        let (version, applied) = pull_dense(&mut core);
        let (_, applied_row) = pull_row(&mut core, 7);
        assert_eq!(version, 1);
        assert!(applied.iter().all(|w| (w + 0.05).abs() < 1e-6), "{applied:?}");
        assert!((applied_row[0] - (row0[0] - 0.25)).abs() < 1e-6, "{applied_row:?}");
        if lookahead {
            assert_eq!((dense, row), (applied, applied_row), "read ahead = applied when the rest adds nothing");
        }
    }
}

/// For a rule that normalises its step (Adagrad), a GBA pull reads the share of the step in hand of the
/// step its gradients' mean would make — not a whole step in the direction of the first gradient: with two
/// equal gradients of K = 2, the read after the first is halfway to where the step lands.
#[test]
fn a_gba_pull_under_adagrad_reads_its_share_of_the_step() {
    let cfg = ShardConfig {
        rule: Rule::Adagrad,
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.1 },
        modes: ModeConfig { mode: Mode::Gba, gba_lookahead: true, ..ModeConfig::default() },
        ..config(Mode::Gba)
    };
    let mut core = with_workers(cfg, 2);
    let (_, start) = pull_dense(&mut core);
    push(&mut core, 0, 1, 0, 0.3, 0, ms(1));
    let (version, ahead) = pull_dense(&mut core);
    assert_eq!(version, 0, "nothing applied yet");
    push(&mut core, 1, 1, 0, 0.3, 0, ms(2));
    let (version, applied) = pull_dense(&mut core);
    assert_eq!(version, 1);
    for ((s, a), p) in start.iter().zip(&applied).zip(&ahead) {
        // Adagrad's first step moves each parameter by about η whatever the gradient's size.
        assert!((s - a - 0.1).abs() < 1e-4, "applied step {s} -> {a}");
        assert!((p - (s + a) / 2.0).abs() < 1e-5, "read ahead {p}, halfway between {s} and {a}");
    }
}

/// Reading ahead changes only what workers compute on: with stateful rules (momentum, Adam, DANA's
/// look-ahead pull) the same gradients in the same order leave bit-identical parameters with it on and off.
#[test]
fn the_read_ahead_leaves_the_applied_state_bit_identical() {
    for rule in [Rule::Momentum, Rule::Adam, Rule::DanaZero, Rule::GapAware] {
        let mut cores: Vec<ShardCore> = [true, false]
            .into_iter()
            .map(|lookahead| {
                let cfg = ShardConfig {
                    rule,
                    hyper: Hyper { lr: 0.1, momentum: 0.9, ..Hyper::default() },
                    init: Init { seed: 1, std: 0.1 },
                    modes: ModeConfig { mode: Mode::Gba, gba_lookahead: lookahead, ..ModeConfig::default() },
                    ..config(Mode::Gba)
                };
                with_workers(cfg, 3)
            })
            .collect();
        let mut reads = [Vec::new(), Vec::new()];
        for (c, core) in cores.iter_mut().enumerate() {
            let mut seq = [0u64; 3];
            for step in 0..7u32 {
                for w in 0..3u32 {
                    seq[w as usize] += 1;
                    let (version, values) = pull_dense(core);
                    reads[c].push(values.clone());
                    let grad = 0.1 * (step as f32 + 1.0) - 0.05 * w as f32;
                    // Rules that measure drift get the values read back with the gradient.
                    let echo = rule.layout().needs_read;
                    let msg = Message::Push(Push {
                        step: seq[w as usize] - 1,
                        ..Push::new(
                            EPOCH,
                            w,
                            seq[w as usize],
                            vec![PushChunk {
                                id: ID,
                                read_version: version,
                                len: 4,
                                echo,
                                dtype: gaps_common::dtype::WireDtype::F32,
                            }],
                        )
                    });
                    let mut payload = vec![grad; 4];
                    if echo {
                        payload.extend_from_slice(&values);
                    }
                    let (r, _) = core.handle(Frame { msg, payload }, ms(u64::from(step)));
                    assert!(matches!(r.msg, Message::Ack(_)), "{rule}: {:?}", r.msg);
                }
            }
        }
        let bits =
            |core: &ShardCore| core.chunk_values(ID).expect("chunk").iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&cores[0]), bits(&cores[1]), "{rule}: the applied parameters");
        assert_eq!(cores[0].stats().steps_gba, cores[1].stats().steps_gba);
        assert_ne!(reads[0], reads[1], "{rule}: but what the pulls read differs");
    }
}
