//! A worker's step in one request (`Message::Step`) through ShardCore: the same as its three requests one
//! after the other, refused whole when its parts disagree, and answered without values or rows where the
//! worker must wait for a synchronous step.

mod common;

use gaps_common::layout::{ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::wire::{
    ids_to_words, Ack, ErrorCode, Frame, Message, Pull, Push, PushChunk, PushPullReply, SparsePull, SparsePullReply,
    SparsePush, Step, StepReply,
};
use gaps_shard::core::SparseSettings;
use gaps_shard::{testnet, Mode, ModeConfig, ShardConfig, ShardCore};

const EPOCH: u64 = 9;
const DIM: u32 = 4;
const CHUNK: u32 = 8;

fn core(mode: Mode) -> ShardCore {
    let layout = Layout::with_tables(vec![TensorSpec::new("dense", 16)], CHUNK, vec![SparseSpec::new("emb", DIM)])
        .expect("layout");
    ShardCore::new(ShardConfig {
        modes: ModeConfig { mode, ..ModeConfig::default() },
        sparse: SparseSettings { init_std: 0.1, ..SparseSettings::default() },
        ..testnet::config(layout, EPOCH)
    })
    .expect("core")
}

fn chunks() -> Vec<ChunkId> {
    vec![ChunkId { tensor: 0, chunk: 0 }, ChunkId { tensor: 0, chunk: 1 }]
}

/// The dense values and their chunk versions.
fn pull(core: &mut ShardCore) -> (Vec<f32>, Vec<u64>) {
    let reply = common::call(core, Message::Pull(Pull { epoch: EPOCH, chunks: chunks() }), vec![]);
    let Message::PullReply(r) = reply.msg else { panic!("{:?}", reply.msg) };
    (reply.payload, r.chunks.iter().map(|c| c.version).collect())
}

/// The parts of a step: (row push, its payload), (dense push, its payload), (next rows, their ids).
type Parts = ((SparsePush, Vec<f32>), (Push, Vec<f32>), (SparsePull, Vec<f32>));

/// A core in `mode` with two workers registered, and the dense chunks' versions.
fn with_two_workers(mode: Mode) -> (ShardCore, u32, u32, Vec<u64>) {
    let mut core = core(mode);
    let (first, second) = (common::register(&mut core), common::register(&mut core));
    let versions = pull(&mut core).1;
    (core, first, second, versions)
}

/// The parts of step `k` of `worker`.
fn parts(worker: u32, k: u64, versions: &[u64], row_versions: &[u32]) -> Parts {
    let ids: Vec<u64> = (0..3).map(|i| 10 * k + i).collect();
    let next: Vec<u64> = (0..3).map(|i| 10 * (k + 1) + i + 1).collect();
    let mut rows = Vec::new();
    ids_to_words(&ids, &mut rows);
    rows.extend(row_versions.iter().map(|v| f32::from_bits(*v)));
    rows.extend((0..3 * DIM).map(|i| 0.01 * (i as f32 + k as f32)));
    let row_push = SparsePush { epoch: EPOCH, worker, seq: 2 * k + 1, table: 0, count: 3, dim: DIM, echo_read: false };
    let push_chunks = chunks().iter().zip(versions).map(|(id, v)| PushChunk::f32(*id, *v, CHUNK)).collect();
    let push = Push { step: k, ..Push::new(EPOCH, worker, 2 * k + 2, push_chunks) };
    let grads = (0..2 * CHUNK).map(|i| 0.02 * (i as f32 - k as f32)).collect();
    let mut words = Vec::new();
    ids_to_words(&next, &mut words);
    ((row_push, rows), (push, grads), (SparsePull { epoch: EPOCH, table: 0, count: 3, create: true }, words))
}

/// The step made of `parts`, its payload the parts' in order.
fn step_frame(parts: &Parts) -> Frame {
    let ((rows, rp), (push, pp), (next, ids)) = parts;
    let payload = [rp.as_slice(), pp.as_slice(), ids.as_slice()].concat();
    Frame { msg: Message::Step(Step { rows: Some(*rows), push: push.clone(), next_rows: Some(*next) }), payload }
}

fn ack(frame: &Frame) -> Ack {
    match &frame.msg {
        Message::Ack(a) => *a,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_step_does_what_a_row_push_a_push_pull_and_a_row_pull_do_one_after_the_other() {
    let (mut apart, mut fused) = (core(Mode::Async), core(Mode::Async));
    let worker = common::register(&mut apart);
    assert_eq!(common::register(&mut fused), worker);
    let mut versions = pull(&mut apart).1;
    let mut row_versions = vec![0u32; 3];
    for k in 0..4u64 {
        let p = parts(worker, k, &versions, &row_versions);
        let rows_ack = ack(&common::call(&mut apart, Message::SparsePush(p.0 .0), p.0 .1.clone()));
        let dense = common::call(&mut apart, Message::PushPull(p.1 .0.clone()), p.1 .1.clone());
        let next = common::call(&mut apart, Message::SparsePull(p.2 .0), p.2 .1.clone());
        let reply = common::call(&mut fused, step_frame(&p).msg, step_frame(&p).payload);
        let Message::StepReply(StepReply { rows, push, next_rows }) = &reply.msg else { panic!("{:?}", reply.msg) };
        assert_eq!(*rows, Some(rows_ack), "step {k}: the rows' ack");
        assert_eq!(Message::PushPullReply(push.clone()), dense.msg, "step {k}: the dense answer");
        let Message::SparsePullReply(want_rows) = next.msg else { panic!("{:?}", next.msg) };
        assert_eq!(*next_rows, Some(want_rows), "step {k}");
        assert_eq!(reply.payload, [dense.payload.as_slice(), next.payload.as_slice()].concat(), "step {k}: values");
        assert_eq!(reply.msg.payload_elems(), reply.payload.len() as u64);
        versions = push.chunks.iter().map(|c| c.version).collect();
        row_versions = next.payload[..3].iter().map(|w| w.to_bits()).collect();
    }
    assert_eq!(pull(&mut fused), pull(&mut apart), "the same dense state");
    let (a, f) = (apart.stats(), fused.stats());
    assert_eq!((f.pushes_applied, f.pushes_duplicate), (a.pushes_applied, a.pushes_duplicate));
    // Sent again (its answer lost): both pushes are duplicates and nothing changes.
    let before = pull(&mut fused);
    let again = step_frame(&parts(worker, 3, &versions, &row_versions));
    let reply = common::call(&mut fused, again.msg, again.payload);
    let Message::StepReply(r) = &reply.msg else { panic!("{:?}", reply.msg) };
    assert!(r.rows.is_some_and(|a| a.duplicate) && r.push.ack.duplicate, "{r:?}");
    assert_eq!(pull(&mut fused).0, before.0, "a step sent again changed the shard");
}

#[test]
fn a_step_whose_parts_disagree_or_whose_payload_is_not_theirs_is_refused_and_changes_nothing() {
    let (mut core, worker, other, versions) = with_two_workers(Mode::Async);
    let p = parts(worker, 0, &versions, &[0; 3]);
    let before = pull(&mut core);
    let refused = |core: &mut ShardCore, frame: Frame| match common::call(core, frame.msg, frame.payload).msg {
        Message::Error(e) => e.code,
        other => panic!("{other:?}"),
    };
    let mut other_rows = step_frame(&p);
    if let Message::Step(s) = &mut other_rows.msg {
        s.rows = s.rows.map(|r| SparsePush { worker: other, ..r });
    }
    assert_eq!(refused(&mut core, other_rows), ErrorCode::WrongShape);
    let mut other_epoch = step_frame(&p);
    if let Message::Step(s) = &mut other_epoch.msg {
        s.next_rows = s.next_rows.map(|n| SparsePull { epoch: EPOCH + 1, ..n });
    }
    assert_eq!(refused(&mut core, other_epoch), ErrorCode::WrongShape);
    for change in [-1i64, 1] {
        let mut frame = step_frame(&p);
        if change < 0 {
            frame.payload.pop();
        } else {
            frame.payload.push(0.0);
        }
        assert_eq!(refused(&mut core, frame), ErrorCode::WrongShape, "payload {change:+}");
    }
    assert_eq!(pull(&mut core), before, "a refused step changed the dense values");
    assert_eq!(core.stats().pushes_applied, 0);
    // Nothing of the rows was stored either: a read that creates nothing finds them at their initial values.
    let mut words = Vec::new();
    ids_to_words(&[0, 1, 2], &mut words);
    let peek = SparsePull { epoch: EPOCH, table: 0, count: 3, create: false };
    let rows = common::call(&mut core, Message::SparsePull(peek), words);
    assert!(rows.payload[..3].iter().all(|v| v.to_bits() == 0), "{:?}", rows.payload);
}

#[test]
fn a_synchronous_step_is_answered_without_values_or_rows_until_the_step_is_complete() {
    let (mut core, first, second, versions) = with_two_workers(Mode::Sync);
    let p = parts(first, 0, &versions, &[0; 3]);
    let reply = common::call(&mut core, step_frame(&p).msg, step_frame(&p).payload);
    let Message::StepReply(StepReply { rows, push: PushPullReply { ack, chunks }, next_rows }) = &reply.msg else {
        panic!("{:?}", reply.msg)
    };
    assert!(rows.is_some_and(|a| !a.duplicate), "the rows are taken into the step: {rows:?}");
    assert!(ack.wait_for_step > 0, "the worker waits for the step: {ack:?}");
    assert!(chunks.is_empty() && next_rows.is_none() && reply.payload.is_empty(), "{:?}", reply.msg);
    // The second worker's step completes it: it is answered with the new values and its next rows.
    let q = parts(second, 0, &versions, &[0; 3]);
    let reply = common::call(&mut core, step_frame(&q).msg, step_frame(&q).payload);
    let Message::StepReply(r) = &reply.msg else { panic!("{:?}", reply.msg) };
    assert_eq!((r.push.ack.wait_for_step, r.push.chunks.len()), (0, 2), "{r:?}");
    assert_eq!(r.next_rows, Some(SparsePullReply { table: 0, count: 3, dim: DIM }));
    assert_eq!(reply.payload.len(), 2 * CHUNK as usize + 3 * (1 + DIM as usize));
}

#[test]
fn a_peer_of_the_protocol_before_steps_is_refused_with_both_versions_named() {
    use gaps_common::wire::{Register, Role, PROTOCOL_VERSION};
    let mut core = core(Mode::Async);
    let old = Register { protocol: PROTOCOL_VERSION - 1, role: Role::Worker, name: "old".into() };
    match common::call(&mut core, Message::Register(old), vec![]).msg {
        Message::Error(e) => {
            assert_eq!(e.code, ErrorCode::Misconfigured);
            let (theirs, ours) = (format!("protocol {}", PROTOCOL_VERSION - 1), format!("speaks {PROTOCOL_VERSION}"));
            assert!(e.message.contains(&theirs) && e.message.contains(&ours), "{}", e.message);
        }
        other => panic!("an old client was answered with {other:?}"),
    }
}

#[test]
fn a_step_whose_dense_push_would_be_refused_leaves_its_rows_unapplied() {
    let (mut core, worker, _, versions) = with_two_workers(Mode::Async);
    let rows_before = |core: &mut ShardCore| {
        let mut words = Vec::new();
        ids_to_words(&[0, 1, 2], &mut words);
        let peek = SparsePull { epoch: EPOCH, table: 0, count: 3, create: false };
        common::call(core, Message::SparsePull(peek), words).payload
    };
    let untouched = rows_before(&mut core);
    // Read at a version the shard has not reached (as after its restore): the dense push is refused.
    let ahead: Vec<u64> = versions.iter().map(|v| v + 5).collect();
    let p = parts(worker, 0, &ahead, &[0; 3]);
    let reply = common::call(&mut core, step_frame(&p).msg, step_frame(&p).payload);
    assert!(matches!(&reply.msg, Message::Error(e) if e.code == ErrorCode::ReadAhead), "{:?}", reply.msg);
    // One sequence number for both pushes: refused too.
    let mut twice = step_frame(&parts(worker, 0, &versions, &[0; 3]));
    if let Message::Step(s) = &mut twice.msg {
        s.rows = s.rows.map(|r| SparsePush { seq: s.push.seq, ..r });
    }
    let reply = common::call(&mut core, twice.msg, twice.payload);
    assert!(matches!(&reply.msg, Message::Error(e) if e.code == ErrorCode::WrongShape), "{:?}", reply.msg);
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(rows_before(&mut core)), bits(untouched), "a refused step changed its rows");
    let s = core.stats();
    assert_eq!((s.pushes_applied, s.pushes_rejected), (0, 4), "each refused step counts its two pushes");
}
