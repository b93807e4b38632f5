//! ShardCore driven directly with virtual time: validation, exactly-once, staleness, coordinator.

use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::wire::{
    ErrorCode, Frame, Heartbeat, Message, Pull, Push, PushChunk, PushPullReply, Register, RegisterShard, Role,
    StatsRequest, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::{Init, ShardConfig, ShardCore, SEQ_WINDOW};
use std::time::Duration;

const EPOCH: u64 = 77;

fn layout() -> Layout {
    Layout::new(vec![TensorSpec::new("w", 10), TensorSpec::new("b", 1)], 4).expect("layout")
}

fn config(shard: u32, num_shards: u32, rule: Rule) -> ShardConfig {
    ShardConfig {
        shard,
        num_shards,
        rule,
        hyper: Hyper { lr: 0.5, momentum: 0.9, weight_decay: 0.0, ..Hyper::default() },
        init: Init { seed: 3, std: 0.1 },
        lease: Duration::from_secs(5),
        advertise: format!("127.0.0.1:{}", 4000 + shard),
        epoch: EPOCH,
        ..ShardConfig::new(layout())
    }
}

fn at(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn call(core: &mut ShardCore, msg: Message, payload: Vec<f32>) -> Frame {
    core.handle(Frame { msg, payload }, at(0)).0
}

fn error_code(frame: &Frame) -> Option<ErrorCode> {
    match &frame.msg {
        Message::Error(e) => Some(e.code),
        _ => None,
    }
}

/// Pulls every chunk the single-shard core owns; returns (values, versions).
fn pull_all(core: &mut ShardCore) -> (Vec<f32>, Vec<u64>) {
    let chunks: Vec<ChunkId> = layout().chunks().collect();
    let reply = call(core, Message::Pull(Pull { epoch: EPOCH, chunks }), vec![]);
    let Message::PullReply(r) = reply.msg else { panic!("expected a pull reply, got {:?}", reply.msg) };
    (reply.payload, r.chunks.iter().map(|c| c.version).collect())
}

fn full_push(worker: u32, seq: u64, versions: &[u64], grad: &[f32]) -> (Message, Vec<f32>) {
    let l = layout();
    let chunks =
        l.chunks().zip(versions).map(|(id, v)| PushChunk::f32(id, *v, l.chunk_len(id).expect("len") as u32)).collect();
    (Message::Push(Push::new(EPOCH, worker, seq, chunks)), grad.to_vec())
}

fn grad(seed: u32) -> Vec<f32> {
    (0..11).map(|i| ((i * 7 + seed * 13) % 11) as f32 / 10.0 - 0.5).collect()
}

#[test]
fn push_applies_the_rule_once_per_sequence_number_and_reports_staleness() {
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let (before, v0) = pull_all(&mut core);
    assert!(before.iter().any(|x| *x != 0.0), "initializer ran");
    let g = grad(1);
    let (msg, payload) = full_push(0, 1, &v0, &g);
    let ack = call(&mut core, msg.clone(), payload.clone());
    assert!(matches!(ack.msg, Message::Ack(a) if !a.duplicate && a.max_staleness == 0));
    let (after, v1) = pull_all(&mut core);
    for i in 0..11 {
        assert_eq!(after[i], before[i] - 0.5 * g[i], "element {i}");
    }
    assert!(v1.iter().all(|v| *v == 1));
    // The same (worker, seq) again: acknowledged as a duplicate, not applied.
    let dup = call(&mut core, msg, payload);
    assert!(matches!(dup.msg, Message::Ack(a) if a.duplicate));
    assert_eq!(pull_all(&mut core).0, after);
    // A push computed on version 0 after two more updates has staleness 2.
    for seq in 2..=3 {
        let (m, p) = full_push(1, seq - 1, &v1, &grad(seq as u32));
        let _ = call(&mut core, m, p);
    }
    let (m, p) = full_push(0, 2, &v1, &g);
    let ack = call(&mut core, m, p);
    assert!(matches!(ack.msg, Message::Ack(a) if a.max_staleness == 2), "{:?}", ack.msg);
    let stats = core.stats();
    assert_eq!((stats.pushes_applied, stats.pushes_duplicate), (4, 1));
    assert_eq!(stats.staleness_max, 2);
    assert_eq!(core.tensor_versions(), &[4, 4]);
}

/// A push as a push-pull: the same push, answered with the pushed chunks' values.
fn as_push_pull(msg: Message) -> Message {
    let Message::Push(push) = msg else { panic!("a push") };
    Message::PushPull(push)
}

#[test]
fn a_push_pull_applies_the_push_once_and_answers_what_a_pull_right_after_reads() {
    for rule in [Rule::Sgd, Rule::Momentum, Rule::DanaZero] {
        let mut plain = ShardCore::new(config(0, 1, rule)).expect("core");
        let mut fused = ShardCore::new(config(0, 1, rule)).expect("core");
        let (_, v0) = pull_all(&mut fused);
        let mut versions = v0.clone();
        for seq in 1..=3u64 {
            let (msg, payload) = full_push(0, seq, &versions, &grad(seq as u32));
            let ack = call(&mut plain, msg.clone(), payload.clone());
            let (want, want_versions) = pull_all(&mut plain);
            let reply = call(&mut fused, as_push_pull(msg), payload);
            let Message::PushPullReply(PushPullReply { ack: got_ack, chunks }) = &reply.msg else {
                panic!("{rule}: {:?}", reply.msg)
            };
            assert_eq!(Message::Ack(*got_ack), ack.msg, "{rule} seq {seq}");
            assert_eq!(reply.payload, want, "{rule} seq {seq}: the values a pull right after reads");
            assert_eq!(chunks.iter().map(|c| c.version).collect::<Vec<_>>(), want_versions);
            assert_eq!(chunks.iter().map(|c| c.id).collect::<Vec<_>>(), layout().chunks().collect::<Vec<_>>());
            versions = want_versions;
        }
        // Sent again (its reply lost): a duplicate, not applied again, and still answered with the values.
        let (msg, payload) = full_push(0, 3, &v0, &grad(3));
        let before = pull_all(&mut fused);
        let reply = call(&mut fused, as_push_pull(msg), payload);
        let Message::PushPullReply(r) = &reply.msg else { panic!("{:?}", reply.msg) };
        assert!(r.ack.duplicate, "{rule}");
        assert_eq!((reply.payload.clone(), r.chunks.iter().map(|c| c.version).collect()), before, "{rule}");
        assert_eq!(pull_all(&mut fused), before, "{rule}: a duplicate changed the shard");
        let stats = fused.stats();
        assert_eq!((stats.pushes_applied, stats.pushes_duplicate), (3, 1), "{rule}");
        // A refused push-pull is refused as the push is, and changes nothing.
        let mut nan = grad(4);
        nan[3] = f32::NAN;
        let (msg, payload) = full_push(0, 4, &versions, &nan);
        let reply = call(&mut fused, as_push_pull(msg), payload);
        assert_eq!(error_code(&reply), Some(ErrorCode::NonFinite), "{rule}: {:?}", reply.msg);
        assert_eq!(pull_all(&mut fused), before, "{rule}: a refused push-pull changed the shard");
        assert_eq!(fused.stats().pushes_rejected, 1);
    }
}

#[test]
fn shared_replies_keep_the_values_they_were_made_with_while_later_pushes_write_copies() {
    for rule in [Rule::Sgd, Rule::Momentum, Rule::DanaZero] {
        let mut plain = ShardCore::new(config(0, 1, rule)).expect("core");
        let mut shared = ShardCore::new(config(0, 1, rule)).expect("core");
        shared.set_shared_replies(true);
        let chunks: Vec<ChunkId> = layout().chunks().collect();
        let pull = Message::Pull(Pull { epoch: EPOCH, chunks });
        let (_, v0) = pull_all(&mut plain);
        let (msg, payload) = full_push(0, 1, &v0, &grad(1));
        call(&mut plain, msg.clone(), payload.clone());
        call(&mut shared, msg, payload);
        let want = call(&mut plain, pull.clone(), vec![]);
        let reply = call(&mut shared, pull.clone(), vec![]);
        assert_eq!(reply.msg, want.msg, "{rule}");
        let views = shared.take_reply_views();
        if rule.layout().lookahead {
            // A look-ahead is computed for the reply: nothing to share, the payload carries it.
            assert!(views.is_empty(), "{rule}");
            assert_eq!(reply.payload, want.payload, "{rule}");
            continue;
        }
        assert!(reply.payload.is_empty(), "{rule}: the values travel as shared buffers");
        assert_eq!(views.iter().flat_map(|v| v.iter().copied()).collect::<Vec<_>>(), want.payload, "{rule}");
        assert!(shared.take_reply_views().is_empty(), "{rule}: handed out once");
        // While the reply still holds the buffers, a push writes into copies: the reply keeps what it read.
        let (msg, payload) = full_push(0, 2, &[1; 4], &grad(2));
        call(&mut plain, msg.clone(), payload.clone());
        call(&mut shared, msg, payload);
        assert_eq!(views.iter().flat_map(|v| v.iter().copied()).collect::<Vec<_>>(), want.payload, "{rule}");
        let now = call(&mut plain, pull.clone(), vec![]).payload;
        assert_ne!(now, want.payload, "{rule}: the second push moved the values");
        call(&mut shared, pull.clone(), vec![]);
        let fresh = shared.take_reply_views();
        assert_eq!(fresh.iter().flat_map(|v| v.iter().copied()).collect::<Vec<_>>(), now, "{rule}");
        // Once no reply holds them, an update writes in place (no copy).
        drop(views);
        let before: Vec<*const f32> = fresh.iter().map(|v| v.as_ptr()).collect();
        drop(fresh);
        let (msg, payload) = full_push(0, 3, &[2; 4], &grad(3));
        call(&mut shared, msg, payload);
        call(&mut shared, pull.clone(), vec![]);
        let after: Vec<*const f32> = shared.take_reply_views().iter().map(|v| v.as_ptr()).collect();
        assert_eq!(before, after, "{rule}: updated in place");
        // The checkpoint holds the core's values, not a reply's.
        call(&mut plain, full_push(0, 3, &[2; 4], &grad(3)).0, grad(3));
        assert_eq!(shared.checkpoint(1).expect("checkpoint"), plain.checkpoint(1).expect("checkpoint"), "{rule}");
    }
}

#[test]
fn bad_pushes_get_typed_errors_and_leave_the_shard_unchanged() {
    let mut core = ShardCore::new(config(0, 1, Rule::Momentum)).expect("core");
    let (before, v0) = pull_all(&mut core);
    let mut cases: Vec<(&str, Message, Vec<f32>, ErrorCode)> = Vec::new();
    let mut nan = grad(2);
    nan[9] = f32::NAN;
    let (m, p) = full_push(0, 1, &v0, &nan);
    cases.push(("NaN gradient", m, p, ErrorCode::NonFinite));
    let mut inf = grad(2);
    inf[0] = f32::INFINITY;
    let (m, p) = full_push(0, 1, &v0, &inf);
    cases.push(("Inf gradient", m, p, ErrorCode::NonFinite));
    let (m, mut p) = full_push(0, 1, &v0, &grad(2));
    p.pop();
    cases.push(("wrong element count", m, p, ErrorCode::WrongShape));
    let (Message::Push(mut push), p) = full_push(0, 1, &v0, &grad(2)) else { unreachable!() };
    push.chunks[1].len = 3;
    push.chunks[2].len = 3;
    cases.push(("wrong chunk length", Message::Push(push.clone()), p.clone(), ErrorCode::WrongShape));
    push.chunks[1].len = 4;
    push.chunks[2].len = 2;
    push.chunks[3].id = ChunkId { tensor: 7, chunk: 0 };
    cases.push(("unknown tensor", Message::Push(push.clone()), p.clone(), ErrorCode::WrongShape));
    let (Message::Push(mut stale), p) = full_push(0, 1, &v0, &grad(2)) else { unreachable!() };
    stale.epoch = EPOCH + 1;
    cases.push(("wrong epoch", Message::Push(stale), p, ErrorCode::StaleEpoch));
    let (Message::Push(mut zero), p) = full_push(0, 0, &v0, &grad(2)) else { unreachable!() };
    zero.seq = 0;
    cases.push(("sequence 0", Message::Push(zero), p, ErrorCode::SequenceWindow));
    let (m, p) = full_push(0, 1, &[5, 0, 0, 0], &grad(2));
    cases.push(("read version from the future", m, p, ErrorCode::ReadAhead));
    cases.push(("a reply sent as a request", Message::error(ErrorCode::Internal, "x"), vec![], ErrorCode::UnknownKind));
    for (name, msg, payload, code) in cases {
        let reply = call(&mut core, msg, payload);
        assert_eq!(error_code(&reply), Some(code), "{name}: {:?}", reply.msg);
        assert_eq!(pull_all(&mut core), (before.clone(), v0.clone()), "{name} changed the shard");
    }
    // The refused seq 1 can still be used: nothing was recorded for it.
    let (m, p) = full_push(0, 1, &v0, &grad(2));
    assert!(matches!(call(&mut core, m, p).msg, Message::Ack(a) if !a.duplicate));
    assert_eq!(core.stats().pushes_rejected, 8);
}

#[test]
fn refused_and_abandoned_sequence_numbers_never_block_later_pushes() {
    // On d75cfe4 a hole in a worker's sequence numbers (a refused push whose number the client had
    // consumed, or one abandoned after failed retries) froze the window: 4096 pushes later, every push of
    // that worker was refused forever.
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let (_, v0) = pull_all(&mut core);
    let mut nan = grad(1);
    nan[0] = f32::NAN;
    let (m, p) = full_push(3, 1, &v0, &nan);
    assert_eq!(error_code(&call(&mut core, m, p)), Some(ErrorCode::NonFinite));
    // Seq 2 is "abandoned": never sent. Everything after goes through, far past the window.
    let total = 3 * SEQ_WINDOW;
    for seq in 3..=total {
        let (_, versions) = pull_all(&mut core);
        let (m, p) = full_push(3, seq, &versions, &grad(seq as u32));
        let reply = call(&mut core, m, p);
        assert!(matches!(reply.msg, Message::Ack(a) if !a.duplicate), "seq {seq}: {:?}", reply.msg);
    }
    assert_eq!(core.stats().pushes_applied, total - 2);
    // A retry inside the window is a duplicate; one older than the window is refused, never applied again.
    let (_, versions) = pull_all(&mut core);
    let (m, p) = full_push(3, total - 10, &versions, &grad(0));
    assert!(matches!(call(&mut core, m, p).msg, Message::Ack(a) if a.duplicate));
    let (m, p) = full_push(3, 5, &versions, &grad(0));
    assert_eq!(error_code(&call(&mut core, m, p)), Some(ErrorCode::SequenceWindow));
    // The abandoned number inside the window could still arrive late and be applied once.
    let (m, p) = full_push(3, total + 2, &versions, &grad(0));
    assert!(matches!(call(&mut core, m, p).msg, Message::Ack(a) if !a.duplicate));
    let (m, p) = full_push(3, total + 1, &versions, &grad(0));
    assert!(matches!(call(&mut core, m, p).msg, Message::Ack(a) if !a.duplicate), "a skipped number, late");
    let (m, p) = full_push(3, total + 1, &versions, &grad(0));
    assert!(matches!(call(&mut core, m, p).msg, Message::Ack(a) if a.duplicate));
    assert_eq!(core.stats().pushes_applied, total);
}

#[test]
fn out_of_order_sequence_numbers_are_each_applied_once() {
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let (_, v0) = pull_all(&mut core);
    for seq in [3u64, 1, 2, 3, 1, 5, 4, 5] {
        let (m, p) = full_push(9, seq, &v0, &grad(seq as u32));
        let _ = call(&mut core, m, p);
    }
    let s = core.stats();
    assert_eq!((s.pushes_applied, s.pushes_duplicate), (5, 3));
}

#[test]
fn chunks_route_to_their_owner_and_others_are_refused() {
    let mut s0 = ShardCore::new(config(0, 2, Rule::Sgd)).expect("s0");
    let mut s1 = ShardCore::new(config(1, 2, Rule::Sgd)).expect("s1");
    // Shard 1 serves nothing before it joined.
    let pull = Message::Pull(Pull { epoch: EPOCH, chunks: vec![ChunkId { tensor: 0, chunk: 1 }] });
    assert_eq!(error_code(&call(&mut s1, pull.clone(), vec![])), Some(ErrorCode::ClusterIncomplete));
    // A worker cannot register while shard 1 is missing; the error names the shard.
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() });
    let reply = call(&mut s0, reg.clone(), vec![]);
    match &reply.msg {
        Message::Error(e) => {
            assert_eq!(e.code, ErrorCode::ClusterIncomplete);
            assert!(e.message.contains("shard(s) 1 of 2"), "{}", e.message);
        }
        other => panic!("expected an error, got {other:?}"),
    }
    let join = s1.join_request();
    let map = call(&mut s0, join, vec![]);
    let Message::ClusterMap(map) = map.msg else { panic!("join refused: {:?}", map.msg) };
    s1.joined(&map).expect("joined");
    assert_eq!(s1.epoch(), EPOCH);
    assert!(matches!(call(&mut s1, pull, vec![]).msg, Message::PullReply(_)));
    let wrong = Message::Pull(Pull { epoch: EPOCH, chunks: vec![ChunkId { tensor: 0, chunk: 0 }] });
    assert_eq!(error_code(&call(&mut s1, wrong, vec![])), Some(ErrorCode::NotOwner));
    let reply = call(&mut s0, reg, vec![]);
    let Message::ClusterMap(m) = reply.msg else { panic!("register refused: {:?}", reply.msg) };
    assert_eq!(m.worker_id, Some(0));
    assert_eq!(m.shards.len(), 2);
    assert_eq!(m.shards[1].addr, "127.0.0.1:4001");
}

#[test]
fn misconfigured_shards_are_refused_by_name() {
    let mut s0 = ShardCore::new(config(0, 2, Rule::Sgd)).expect("s0");
    let mut bad = config(1, 2, Rule::Sgd);
    bad.layout = Layout::new(vec![TensorSpec::new("w", 11)], 4).expect("layout");
    let other = ShardCore::new(bad).expect("core");
    let reply = call(&mut s0, other.join_request(), vec![]);
    assert_eq!(error_code(&reply), Some(ErrorCode::Misconfigured));
    let wrong_count = Message::RegisterShard(RegisterShard {
        protocol: PROTOCOL_VERSION,
        shard: 1,
        num_shards: 3,
        addr: "x:1".into(),
        layout_fingerprint: layout().fingerprint(),
    });
    let reply = call(&mut s0, wrong_count, vec![]);
    assert!(matches!(&reply.msg, Message::Error(e) if e.message.contains("--num-shards 3")), "{:?}", reply.msg);
    assert!(ShardCore::new(config(2, 2, Rule::Sgd)).is_err());
}

#[test]
fn leases_expire_without_heartbeats_and_heartbeats_renew_them() {
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() });
    for _ in 0..2 {
        let _ = core.handle(Frame::new(reg.clone()), at(0));
    }
    let obs = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: "o".into() });
    let (reply, _) = core.handle(Frame::new(obs), at(0));
    assert!(matches!(reply.msg, Message::ClusterMap(m) if m.worker_id.is_none()));
    assert_eq!(core.stats().live_workers, 2);
    let _ = core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: 1 })), at(4000));
    let events = core.tick(at(6000));
    assert_eq!(events, vec![gaps_shard::CoreEvent::WorkerExpired(0)]);
    assert_eq!(core.stats().live_workers, 1);
    let (reply, _) = core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: 99 })), at(6000));
    assert_eq!(error_code(&reply), Some(ErrorCode::NotRegistered));
    let (stats, _) = core.handle(Frame::new(Message::StatsRequest(StatsRequest)), at(6000));
    assert!(matches!(stats.msg, Message::Stats(s) if s.registered_workers == 2 && s.live_workers == 1));
    // A heartbeat that arrives after its worker's Leave (sent before it, on another connection) renews
    // nothing; the worker whose lease merely expired comes back with one.
    let _ = core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker: 1 })), at(6500));
    assert_eq!(core.stats().live_workers, 0);
    let (reply, _) = core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: 1 })), at(6600));
    assert_eq!(error_code(&reply), Some(ErrorCode::NotRegistered));
    assert!(matches!(&reply.msg, Message::Error(e) if e.message.contains("left")), "{:?}", reply.msg);
    assert_eq!(core.stats().live_workers, 0, "a late heartbeat brought back a worker that left");
    let (reply, _) = core.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: 0 })), at(6700));
    assert!(matches!(reply.msg, Message::HeartbeatAck(_)), "{:?}", reply.msg);
    assert_eq!(core.stats().live_workers, 1);
}

/// A model's own initial values: the first upload of a chunk nothing touched wins (version 0 → 1), a second
/// upload keeps it, a chunk that was trained keeps its values; a bad upload changes nothing.
#[test]
fn initial_values_are_taken_once_by_untouched_chunks_and_bad_uploads_change_nothing() {
    use gaps_common::wire::{InitChunk, Initialize};
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let reg = Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() };
    let Message::ClusterMap(map) = call(&mut core, Message::Register(reg), vec![]).msg else { panic!("map") };
    let worker = map.worker_id.expect("id");
    let chunks: Vec<InitChunk> =
        layout().chunks().map(|id| InitChunk { id, len: layout().chunk_len(id).expect("len") as u32 }).collect();
    let upload = |values: Vec<f32>, chunks: Vec<InitChunk>| {
        (Message::Initialize(Initialize { epoch: EPOCH, worker, chunks }), values)
    };
    let (before, _) = pull_all(&mut core);
    // Refused whole: a length that is not the chunk's, a NaN, too few values.
    let mut short = chunks.clone();
    short[0].len -= 1;
    let (msg, values) = upload(vec![1.0; 10], short);
    assert_eq!(error_code(&call(&mut core, msg, values)), Some(ErrorCode::WrongShape));
    let mut nan = vec![1.0; 11];
    nan[5] = f32::NAN;
    let (msg, values) = upload(nan, chunks.clone());
    assert_eq!(error_code(&call(&mut core, msg, values)), Some(ErrorCode::NonFinite));
    let (msg, values) = upload(vec![1.0; 7], chunks.clone());
    assert_eq!(error_code(&call(&mut core, msg, values)), Some(ErrorCode::WrongShape));
    assert_eq!(pull_all(&mut core).0, before, "a refused upload changed nothing");

    // Train chunk 0 of w once, then upload: the trained chunk keeps its values, the others take the upload.
    let (_, versions) = pull_all(&mut core);
    let (push, grad) = full_push(worker, 1, &versions, &grad(1));
    call(&mut core, push, grad);
    let (trained, _) = pull_all(&mut core);
    let first: Vec<f32> = (0..11).map(|i| i as f32 * 0.25).collect();
    let (msg, values) = upload(first.clone(), chunks.clone());
    match call(&mut core, msg, values).msg {
        Message::Initialized(i) => assert_eq!((i.taken, i.kept), (0, 4), "every chunk was trained by the push"),
        other => panic!("{other:?}"),
    }
    assert_eq!(pull_all(&mut core).0, trained);

    // A fresh shard: the first upload is taken everywhere (versions become 1), a second one is kept out.
    let mut core = ShardCore::new(config(0, 1, Rule::Sgd)).expect("core");
    let reg = Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() };
    call(&mut core, Message::Register(reg), vec![]);
    let (msg, values) = upload(first.clone(), chunks.clone());
    match call(&mut core, msg, values).msg {
        Message::Initialized(i) => assert_eq!((i.taken, i.kept), (4, 0)),
        other => panic!("{other:?}"),
    }
    let (values_now, versions) = pull_all(&mut core);
    assert_eq!(values_now, first);
    assert!(versions.iter().all(|v| *v == 1), "{versions:?}");
    let (msg, values) = upload(vec![9.0; 11], chunks);
    match call(&mut core, msg, values).msg {
        Message::Initialized(i) => assert_eq!((i.taken, i.kept), (0, 4), "the first writer won"),
        other => panic!("{other:?}"),
    }
    assert_eq!(pull_all(&mut core).0, first);
}
