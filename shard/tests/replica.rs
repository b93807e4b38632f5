//! The premise of replicated shards (docs/replication.md): a backup core that handles only the primary's
//! log — the requests that change state (`gaps_shard::replica::changes_state`) and the ticks, in order, at
//! the primary's clock, each entry encoded and decoded on the way — answers every logged request as the
//! primary did and ends holding the same state, in every mode: parameters and optimizer state (bit for bit),
//! embedding rows and their versions, exactly-once windows and ledgers, the step in progress, leases,
//! counters (apart from the primary's own read counters).

use gaps_common::layout::{sparse_owner, ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::rng::Rng;
use gaps_common::wire::{
    ids_to_words, Frame, Heartbeat, Leave, Limits, Message, Pull, Push, PushChunk, Register, Role, SparsePull,
    SparsePush, StatsRequest, TableScan, PROTOCOL_VERSION,
};
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::replica::{changes_state, Entry, LogEntry};
use gaps_shard::testnet;
use gaps_shard::{Init, ShardConfig, ShardCore, SparseSettings};
use std::time::Duration;

const EPOCH: u64 = 1;
const DIM: u32 = 4;

fn config(mode: Mode) -> ShardConfig {
    let mut adam = TensorSpec::new("b", 20);
    adam.rule.rule = Some("adam".into());
    let layout = Layout::with_tables(vec![TensorSpec::new("w", 40), adam], 16, vec![SparseSpec::new("emb", DIM)])
        .expect("layout");
    ShardConfig {
        init: Init { seed: 5, std: 0.1 },
        lease: Duration::from_millis(800),
        advertise: "primary:1".into(),
        sparse: SparseSettings { init_std: 0.05, ..SparseSettings::default() },
        modes: ModeConfig { mode, gba_threshold: 2, ssp_bound: 2, ..ModeConfig::default() },
        ..testnet::config(layout, EPOCH)
    }
}

/// The primary, its backup, and the log between them.
struct Pair {
    primary: ShardCore,
    backup: ShardCore,
    index: u64,
    logged: u64,
    handled: u64,
    /// The round at which the backup is replaced by a copy of the primary ([`ShardCore::copy_state`]).
    copy_at: Option<u64>,
}

impl Pair {
    fn handle(&mut self, frame: Frame, now: Duration) -> Frame {
        self.handled += 1;
        let logged = changes_state(&frame.msg);
        let entry = logged
            .then(|| LogEntry { index: self.index + 1, entry: Entry::Request { now, frame: Box::new(frame.clone()) } });
        let (reply, events) = self.primary.handle(frame, now);
        if let Some(entry) = entry {
            let (backup_reply, backup_events) = self.ship(entry).expect("a request entry");
            assert_eq!(backup_reply, reply, "the backup answers a logged request as the primary did");
            assert_eq!(backup_events, events);
        }
        reply
    }

    fn tick(&mut self, now: Duration) {
        let events = self.primary.tick(now);
        let backup_events = self.ship(LogEntry { index: self.index + 1, entry: Entry::Tick { now } });
        assert_eq!(backup_events.map(|(_, e)| e), Some(events), "the backup's tick reports the primary's events");
    }

    /// Encodes, decodes and applies an entry on the backup; the reply for a request.
    fn ship(&mut self, entry: LogEntry) -> Option<(Frame, Vec<gaps_shard::CoreEvent>)> {
        let bytes = entry.encode().expect("encodes");
        let back = LogEntry::decode(&bytes, &Limits::default()).expect("decodes");
        // (Bytes, not values: a NaN gradient is not equal to itself.)
        assert_eq!(back.encode().expect("re-encodes"), bytes, "an entry reads back as written");
        assert_eq!(back.index, self.index + 1, "in order");
        self.index = back.index;
        self.logged += 1;
        match back.entry {
            Entry::Request { now, frame } => Some(self.backup.handle(*frame, now)),
            Entry::Tick { now } => Some((Frame::new(Message::StatsRequest(StatsRequest)), self.backup.tick(now))),
        }
    }
}

fn rows_of(core: &mut ShardCore) -> Frame {
    let (reply, _) = core.handle(
        Frame::new(Message::TableScan(TableScan { epoch: EPOCH, table: 0, cursor: 0, max_rows: 1 << 16 })),
        Duration::ZERO,
    );
    reply
}

/// A random workload of four workers: registrations, dense and sparse pulls and pushes (some stale, some
/// repeated, some malformed), heartbeats, a worker leaving and joining again, reads, ticks.
fn workload(pair: &mut Pair, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut now_ms = 0u64;
    let mut seqs = [0u64; 6];
    let register = |pair: &mut Pair, now: Duration| {
        let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() });
        pair.handle(Frame::new(reg), now);
    };
    for _ in 0..4 {
        register(pair, Duration::ZERO);
    }
    let layout = pair.primary.config().layout.clone();
    let chunks: Vec<ChunkId> = layout.chunks().collect();
    let mut alive = [true, true, true, true, false, false];
    for round in 0..60u64 {
        now_ms += 5 + rng.below(40);
        let now = Duration::from_millis(now_ms);
        for w in 0..6u32 {
            if !alive[w as usize] || rng.below(5) == 0 {
                continue;
            }
            // Rows of this worker's batch.
            let ids: Vec<u64> = {
                let mut ids: Vec<u64> =
                    (0..6).map(|_| rng.below(40)).filter(|id| sparse_owner(0, *id, 1) == 0).collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            };
            let mut words = Vec::new();
            ids_to_words(&ids, &mut words);
            let sparse_pull = |create: bool| Frame {
                msg: Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: ids.len() as u32, create }),
                payload: words.clone(),
            };
            let pulled = pair.handle(sparse_pull(true), now);
            let versions: Vec<u32> = pulled.payload[..ids.len()].iter().map(|v| v.to_bits()).collect();
            // A read that creates nothing, and a dense pull: not logged.
            pair.handle(sparse_pull(false), now);
            let dense = pair.handle(Frame::new(Message::Pull(Pull { epoch: EPOCH, chunks: chunks.clone() })), now);
            let Message::PullReply(reply) = dense.msg else { panic!("pull: {:?}", dense.msg) };
            seqs[w as usize] += 1;
            // One time in three the rows, the dense push and the next rows go as one step (`Message::Step`).
            let combined = rng.below(3) == 0;
            let next_ids = words.clone();
            let mut payload = words;
            payload.extend(versions.iter().map(|v| f32::from_bits(*v)));
            payload.extend((0..ids.len() * DIM as usize).map(|_| (rng.uniform() as f32 - 0.5) * 0.2));
            let push = Message::SparsePush(SparsePush {
                epoch: EPOCH,
                worker: w,
                seq: seqs[w as usize],
                table: 0,
                count: ids.len() as u32,
                dim: DIM,
                echo_read: false,
            });
            let rows = Frame { msg: push, payload };
            if !combined {
                pair.handle(rows.clone(), now);
            }
            // The dense push, on the versions read (sometimes a round late, so some are stale).
            seqs[w as usize] += 1;
            let stale = rng.below(6) == 0;
            let push = Push {
                compute_ms: 10 + if w == 1 && round > 20 { 60 } else { rng.below(5) as u32 },
                step: seqs[w as usize] / 2,
                ..Push::new(
                    EPOCH,
                    w,
                    seqs[w as usize],
                    reply
                        .chunks
                        .iter()
                        .map(|c| PushChunk {
                            id: c.id,
                            read_version: c.version.saturating_sub(u64::from(stale)),
                            len: c.len,
                            echo: false,
                            dtype: c.dtype,
                        })
                        .collect(),
                )
            };
            let n: usize = reply.chunks.iter().map(|c| c.len as usize).sum();
            let mut grads: Vec<f32> = (0..n).map(|_| (rng.uniform() as f32 - 0.5) * 0.1).collect();
            if rng.below(40) == 0 {
                grads[0] = f32::NAN; // refused, by both
            }
            let msg = if rng.below(2) == 0 { Message::Push(push.clone()) } else { Message::PushPull(push.clone()) };
            match rows.msg {
                Message::SparsePush(row_push) if combined => {
                    let next_rows = Some(SparsePull { epoch: EPOCH, table: 0, count: ids.len() as u32, create: true });
                    let step = gaps_common::wire::Step { rows: Some(row_push), push: push.clone(), next_rows };
                    let payload = [rows.payload, grads.clone(), next_ids].concat();
                    pair.handle(Frame { msg: Message::Step(step), payload }, now);
                }
                _ => {
                    pair.handle(Frame { msg, payload: grads.clone() }, now);
                }
            }
            if rng.below(10) == 0 {
                // Sent again (a retry): a duplicate for both.
                pair.handle(Frame { msg: Message::Push(push), payload: grads }, now);
            }
            if rng.below(4) == 0 {
                pair.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: w })), now);
            }
        }
        if round > 25 && round % 7 == 0 {
            // A heartbeat of worker 2 that arrives after its Leave: refused by both, before and after a copy.
            pair.handle(Frame::new(Message::Heartbeat(Heartbeat { worker: 2 })), now);
        }
        pair.handle(Frame::new(Message::StatsRequest(StatsRequest)), now);
        if pair.copy_at == Some(round) {
            let cfg = pair.primary.config().clone();
            pair.backup = ShardCore::from_copy(cfg, &pair.primary.copy_state().expect("copy")).expect("from a copy");
        }
        if round == 25 {
            pair.handle(Frame::new(Message::Leave(Leave { worker: 2 })), now);
            alive[2] = false;
            register(pair, now);
            alive[4] = true;
        }
        if rng.below(3) == 0 {
            pair.tick(now);
        }
    }
    // Long enough for leases to expire.
    pair.tick(Duration::from_millis(now_ms + 5_000));
}

#[test]
fn a_backup_fed_the_primarys_log_holds_the_primarys_state_in_every_mode() {
    backups_hold_the_primarys_state(None);
}

/// A backup that starts from a copy of the primary taken mid-run — past several leases, with steps in
/// progress and stragglers judged — continues exactly: the same replies and events for every entry after,
/// and the same state at the end.
#[test]
fn a_backup_started_from_a_copy_mid_run_holds_the_primarys_state_in_every_mode() {
    for round in [12, 33, 47] {
        backups_hold_the_primarys_state(Some(round));
    }
}

fn backups_hold_the_primarys_state(copy_at: Option<u64>) {
    for mode in [Mode::Async, Mode::Sync, Mode::Gba, Mode::Ssp, Mode::Auto] {
        for seed in 1..=3 {
            let mut pair = Pair {
                primary: ShardCore::new(config(mode)).expect("primary"),
                backup: ShardCore::new(config(mode)).expect("backup"),
                index: 0,
                logged: 0,
                handled: 0,
                copy_at,
            };
            workload(&mut pair, seed);
            let what = format!("{mode}, seed {seed}, copied at {copy_at:?}");
            let layout = pair.primary.config().layout.clone();
            for id in layout.chunks() {
                let bits =
                    |c: &ShardCore| c.chunk_values(id).expect("chunk").iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&pair.primary), bits(&pair.backup), "{what}: chunk {id:?}");
            }
            assert_eq!(rows_of(&mut pair.primary), rows_of(&mut pair.backup), "{what}: the table's rows");
            // The primary's own read counters aside, every counter agrees (pushes, duplicates, refusals,
            // staleness, steps, the per-worker ledgers, live workers, the mode).
            let counters = |c: &ShardCore| gaps_common::wire::Stats {
                pulls: 0,
                payload_bytes_in: 0,
                payload_bytes_out: 0,
                ..c.stats()
            };
            assert_eq!(counters(&pair.primary), counters(&pair.backup), "{what}: counters");
            assert!(pair.primary.stats().pushes_applied > 100, "{what}: {:?}", pair.primary.stats());
            // Everything a checkpoint holds — parameters, optimizer and per-worker planes, versions, rows with
            // their state and versions, exactly-once windows and ledgers, the step in progress, SSP clocks,
            // leases, counters — byte for byte, the primary's read counters aside.
            let reads = pair.primary.stats().pulls;
            for core in [&mut pair.primary, &mut pair.backup] {
                core.forget_read_counters();
            }
            assert_eq!(
                pair.primary.checkpoint(1).expect("checkpoint"),
                pair.backup.checkpoint(1).expect("checkpoint"),
                "{what}: the checkpoints"
            );
            // Reads (a third of the requests) went to the primary alone.
            assert!(pair.handled > pair.logged + reads / 2, "{what}: reads were logged");
        }
    }
}

#[test]
fn reads_are_not_logged_and_a_bad_entry_is_a_typed_error() {
    assert!(!changes_state(&Message::Pull(Pull { epoch: EPOCH, chunks: vec![] })));
    assert!(!changes_state(&Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: 0, create: false })));
    assert!(changes_state(&Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: 0, create: true })));
    assert!(changes_state(&Message::Heartbeat(Heartbeat { worker: 0 })));
    let tick = LogEntry { index: 7, entry: Entry::Tick { now: Duration::from_millis(1234) } };
    let bytes = tick.encode().expect("encode");
    assert_eq!(LogEntry::decode(&bytes, &Limits::default()), Ok(tick));
    for cut in 0..bytes.len() {
        assert!(LogEntry::decode(&bytes[..cut], &Limits::default()).is_err(), "cut at {cut}");
    }
    let mut unknown = bytes.clone();
    unknown[16] = 9;
    assert!(LogEntry::decode(&unknown, &Limits::default()).is_err());
    let mut trailing = bytes;
    trailing.push(0);
    assert!(LogEntry::decode(&trailing, &Limits::default()).is_err());
}

/// The coordinator's replica sets: a backup takes a shard over only while in sync under the shard's epoch,
/// the replaced primary's reports are refused as moved from then on, the process that comes back joins as
/// a spare (it does not take the shard back), and the sets survive a checkpoint.
#[test]
fn the_coordinator_promotes_only_a_backup_in_sync_and_fences_the_old_primary() {
    use gaps_common::wire::{ErrorCode, Promote, RegisterShard, ReplicaReport};
    let mut cfg = config(Mode::Async);
    cfg.num_shards = 3;
    let mut c = ShardCore::new(cfg.clone()).expect("coordinator");
    let now = Duration::ZERO;
    let call = |c: &mut ShardCore, msg: Message| c.handle(Frame::new(msg), now).0.msg;
    let code = |m: &Message| match m {
        Message::Error(e) => Some(e.code),
        _ => None,
    };
    let join = |shard: u32, addr: &str| {
        Message::RegisterShard(RegisterShard {
            protocol: PROTOCOL_VERSION,
            shard,
            num_shards: 3,
            addr: addr.into(),
            layout_fingerprint: cfg.layout.fingerprint(),
        })
    };
    for s in [1, 2] {
        assert!(matches!(call(&mut c, join(s, &format!("p{s}:1"))), Message::ClusterMap(_)));
    }
    let report = |process: u32, epoch: u64, in_sync: Vec<u32>| {
        Message::ReplicaReport(ReplicaReport { shard: 1, process, epoch, in_sync })
    };
    let promote = |process: u32, epoch: u64| {
        Message::Promote(Promote { shard: 1, process, epoch, addr: format!("p{process}:2") })
    };
    // Not in sync yet: refused.
    assert_eq!(code(&call(&mut c, promote(2, 0))), Some(ErrorCode::Misconfigured));
    assert!(matches!(call(&mut c, report(1, 0, vec![2, 2, 1, 9])), Message::ReplicaEpoch(_)));
    // Only the process serving the shard under its epoch reports.
    assert_eq!(code(&call(&mut c, report(2, 0, vec![]))), Some(ErrorCode::Moved));
    assert_eq!(code(&call(&mut c, promote(2, 3))), Some(ErrorCode::Moved), "another epoch");
    assert_eq!(
        code(&call(&mut c, Message::Promote(Promote { shard: 0, process: 1, epoch: 0, addr: "x:1".into() }))),
        Some(ErrorCode::Misconfigured),
        "the coordinator's own shard"
    );
    match call(&mut c, promote(2, 0)) {
        Message::ReplicaEpoch(e) => assert_eq!((e.shard, e.epoch), (1, 1)),
        other => panic!("promoted: {other:?}"),
    }
    assert_eq!(code(&call(&mut c, promote(2, 0))), Some(ErrorCode::Moved), "taken over once");
    assert_eq!(code(&call(&mut c, report(1, 0, vec![2]))), Some(ErrorCode::Moved), "the old primary is fenced");
    // The process that comes back does not take it back by joining: it learns it serves none (a spare).
    let Message::ClusterMap(back) = call(&mut c, join(1, "p1:9")) else { panic!("a map for the spare") };
    let one = &back.shards[1];
    assert_eq!((one.addr.as_str(), one.process), ("p2:2", 2), "shard 1 stays with process 2");
    assert_eq!(back.spare.iter().map(|s| (s.index, s.addr.as_str())).collect::<Vec<_>>(), vec![(1, "p1:9")]);
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: "o".into() });
    let Message::ClusterMap(map) = call(&mut c, reg.clone()) else { panic!("a map") };
    let one = &map.shards[1];
    assert_eq!((one.addr.as_str(), one.process, one.epoch), ("p2:2", 2, 1));
    assert_eq!(map.spare.len(), 1, "the spare process is in the map");
    // The sets are in the checkpoint.
    let bytes = c.checkpoint_into(1, Vec::new()).expect("checkpoint");
    let mut back = ShardCore::restore(cfg.clone(), &bytes).expect("restore");
    let Message::ClusterMap(again) = back.handle(Frame::new(reg), now).0.msg else { panic!("a map") };
    assert_eq!((&again.shards[1], &again.spare), (&map.shards[1], &map.spare));
    assert_eq!(code(&back.handle(Frame::new(report(1, 0, vec![])), now).0.msg), Some(ErrorCode::Moved));
}
