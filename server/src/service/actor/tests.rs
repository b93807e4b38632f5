//! When a connection's task runs a request itself: only a small training request, only when the core is
//! idle — nothing queued, nobody holding the core, nothing held — and then its answer is ready when the call
//! returns; a push only in asynchronous training (in synchronous steps it may complete one).

use super::*;
use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::wire::{Pull, SparsePull, StatsRequest};

/// The way to a core serving 64 floats in chunks of 16 and one table, with nobody running its thread (the
/// test holds the queue's receiving end).
fn idle_core(rt: &tokio::runtime::Runtime, mode: gaps_shard::Mode) -> (CoreQueue, mpsc::Receiver<Command>) {
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 64)], 16, vec![gaps_common::layout::SparseSpec::new("emb", 4)])
            .expect("layout");
    let modes = gaps_shard::modes::ModeConfig { mode, ..Default::default() };
    let core = ShardCore::new(ShardConfig { modes, ..gaps_shard::testnet::config(layout, 1) }).expect("core");
    let (sender, receiver) = mpsc::channel(4);
    let wake = Alarm { runtime: rt.handle().clone(), queue: sender.downgrade(), armed: None };
    let sinks = Sinks { journal: None, log: None, record: None };
    let seat = seat(core, Instant::now(), Duration::from_secs(1), sinks, wake);
    (CoreQueue { sender, seat }, receiver)
}

fn pull() -> Box<Frame> {
    Box::new(Frame::new(Message::Pull(Pull { epoch: 1, chunks: vec![ChunkId { tensor: 0, chunk: 1 }] })))
}

/// A row pull of `count` distinct ids (creating the missing ones when `create`), with its ids as its payload.
fn pull_rows(count: u32, create: bool) -> Box<Frame> {
    let mut frame = Frame::new(Message::SparsePull(SparsePull { epoch: 1, table: 0, count, create }));
    let ids: Vec<u64> = (0..u64::from(count)).collect();
    gaps_common::wire::ids_to_words(&ids, &mut frame.payload);
    Box::new(frame)
}

#[test]
fn a_small_request_runs_inline_only_while_the_core_is_idle() {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let (queue, mut receiver) = idle_core(&rt, gaps_shard::Mode::Async);

    let mut answered = queue.try_inline(pull(), true).expect("idle: run here");
    let (reply, ..) = answered.try_recv().expect("answered before the call returned");
    match reply.msg {
        Message::PullReply(r) => assert_eq!((r.chunks.len(), reply.payload.len()), (1, 16)),
        other => panic!("{other:?}"),
    }

    // A command waiting in the queue goes first: the request is handed back for the queue, unchanged.
    queue.sender.try_send(Command::Wake).expect("room");
    assert_eq!(queue.try_inline(pull(), true).expect_err("something queued"), pull());
    assert!(matches!(receiver.try_recv(), Ok(Command::Wake)));

    // Whoever holds the core (its thread, another task) is not waited for.
    let held = queue.seat.lock().expect("lock");
    assert!(queue.try_inline(pull(), true).is_err(), "the core is busy");
    drop(held);

    // Large requests — by what they carry, by what their reply can hold or by the rows they touch — and
    // anything but training requests go to the core's thread.
    let rows = SparsePull { epoch: 1, table: 0, count: 70_000, create: true };
    assert!(queue.try_inline(Box::new(Frame::new(Message::SparsePull(rows))), true).is_err(), "140,000 ids");
    let many = SparsePull { epoch: 1, table: 0, count: 9_000, create: false };
    assert!(queue.try_inline(Box::new(Frame::new(Message::SparsePull(many))), true).is_err(), "9,000 rows");
    let mut heavy = Frame::new(Message::SparsePull(SparsePull { epoch: 1, table: 0, count: 100, create: false }));
    heavy.payload = vec![0.0; 140 * 1024];
    assert!(queue.try_inline(Box::new(heavy), true).is_err(), "140 Ki words carried");
    let every_chunk: Vec<ChunkId> = (0..4).cycle().take(8300).map(|chunk| ChunkId { tensor: 0, chunk }).collect();
    let big = Message::Pull(Pull { epoch: 1, chunks: every_chunk });
    assert!(queue.try_inline(Box::new(Frame::new(big)), true).is_err(), "132,800 values back");
    // Rows that could make the table grow (a fresh table's index holds 819 rows) stay off the task; rows
    // read without creating, or few enough to fit, run here.
    assert!(queue.try_inline(pull_rows(1_000, true), true).is_err(), "1,000 rows created would grow the index");
    let mut answered = queue.try_inline(pull_rows(8_000, false), true).expect("8,000 rows of 4 read: run here");
    let (reply, ..) = answered.try_recv().expect("answered before the call returned");
    assert_eq!(reply.payload.len(), 8_000 * 5, "versions and rows");
    // Once the core's thread has created 600 rows (and so reserved room for more), a pull whose rows would fit
    // were they all new runs here; one that would pass the index's 819 does not.
    {
        let (reply, _answer) = oneshot::channel();
        let mut actor = queue.seat.lock().expect("lock");
        actor.run(Command::Handle { frame: pull_rows(600, true), finite: true, reply });
        actor.after_command();
    }
    let mut answered = queue.try_inline(pull_rows(150, true), true).expect("150 rows fit: run here");
    assert_eq!(answered.try_recv().expect("answered").0.payload.len(), 150 * 5);
    assert!(queue.try_inline(pull_rows(300, true), true).is_err(), "300 more rows could grow the index");
    let stats = Box::new(Frame::new(Message::StatsRequest(StatsRequest)));
    assert!(queue.try_inline(stats, true).is_err(), "not a training request");
    assert!(queue.try_inline(pull(), true).is_ok(), "idle again");
}

/// A step's rows are its row push's and its next rows' together.
#[test]
fn a_steps_rows_are_counted_together() {
    let push = gaps_common::wire::Push {
        epoch: 1,
        worker: 1,
        seq: 2,
        chunks: Vec::new(),
        compute_ms: 0,
        step: 0,
        decisions: Default::default(),
        data: None,
    };
    let rows =
        gaps_common::wire::SparsePush { epoch: 1, worker: 1, seq: 1, table: 0, count: 4_096, dim: 4, echo_read: false };
    let next = SparsePull { epoch: 1, table: 0, count: 4_097, create: true };
    let step = Message::Step(gaps_common::wire::Step { rows: Some(rows), push, next_rows: Some(next) });
    assert_eq!(request_rows(&step), 8_193);
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let (queue, _receiver) = idle_core(&rt, gaps_shard::Mode::Async);
    assert!(queue.try_inline(Box::new(Frame::new(step)), true).is_err(), "8,193 rows");
}

#[test]
fn in_synchronous_steps_a_push_goes_to_the_cores_thread_and_a_pull_does_not() {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let (queue, _receiver) = idle_core(&rt, gaps_shard::Mode::Sync);
    let push = gaps_common::wire::Push {
        epoch: 1,
        worker: 1,
        seq: 1,
        chunks: Vec::new(),
        compute_ms: 0,
        step: 0,
        decisions: Default::default(),
        data: None,
    };
    assert!(queue.try_inline(Box::new(Frame::new(Message::Push(push))), true).is_err(), "may complete a step");
    assert!(queue.try_inline(pull(), true).is_ok());
}

/// A command that panics on a connection's task poisons the core's lock: the core's thread then ends and
/// lets every request the core held go (their waiters see the core gone instead of waiting for ever).
#[test]
fn after_a_panic_the_held_requests_are_let_go() {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let (queue, receiver) = idle_core(&rt, gaps_shard::Mode::Async);
    let (tx, mut held) = oneshot::channel();
    let wait = gaps_common::wire::WaitStep { step: 5, clock: 0, max_wait_ms: 60_000 };
    queue.seat.lock().expect("lock").parked.push((HeldRequest::Wait(wait), Duration::from_secs(60), tx));
    let seat = queue.seat.clone();
    let panicked = std::thread::spawn(move || {
        let _guard = seat.lock().expect("lock");
        panic!("a command panicked");
    });
    assert!(panicked.join().is_err());
    let thread = std::thread::spawn({
        let seat = queue.seat.clone();
        move || run_actor(seat, receiver)
    });
    queue.sender.try_send(Command::Wake).expect("room");
    thread.join().expect("the core's thread ends without a panic of its own");
    assert!(matches!(held.try_recv(), Err(oneshot::error::TryRecvError::Closed)), "the held wait was let go");
}
