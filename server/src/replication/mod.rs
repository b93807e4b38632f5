//! Replicated shards (`--replicas R`, docs/replication.md), step 2: the log a primary keeps of every
//! request that changes its state, shipped in order to the backups of its shard on other shard processes,
//! and replies held until every live backup has applied their request.
//!
//! - **Primary.** [`Log`] is written by the core's actor thread: before the core handles a request that
//!   changes state ([`changes_state`]) and at every tick it appends a [`LogEntry`] (the request as the core
//!   gets it and the clock it gets), numbered from 1, and the reply carries the entry's index. The RPC task
//!   sends the reply only once every live backup acknowledged that index ([`Log::wait`]). One shipping task
//!   per backup ([`ship`]) finds the backup's address in the cluster map, copies a snapshot of the core to
//!   it (`ShardCore::copy_state`, taken by the actor between two entries), then sends the entries that
//!   accumulated while the previous batch was in flight, one batch at a time. A backup counts as live
//!   (replies wait for it) once it has caught up, and the coordinator is told; one that fails or answers late
//!   (`--replica-ack-timeout`) stops counting only once the coordinator has taken it out of the shard's
//!   in-sync set ([`ReplicaReport`]), and is then copied a new snapshot.
//! - **Backup.** [`Backups`] holds a copy per shard this process backs up (shard `i`'s copies live on the
//!   processes of its [`ring`], `i … i+R−1` mod the shard count, except the one serving it): it restores
//!   the snapshot and handles the entries strictly in order, as the primary did; it answers with the last
//!   index applied. A copy whose primary went silent is taken over by its process with the coordinator's
//!   leave (the service's `watch_primaries`), which fences the old primary.
//!
//! Since a shard is a deterministic state machine, a backup that applied entry `n` holds what the primary
//! held after it (`shard/tests/replica.rs`, `server/tests/replication.rs`).

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{ErrorCode, Frame, Limits, Message, ReplicaAck, ReplicaAppend, ReplicaReport, ReplicaSnapshot};
use gaps_shard::replica::{changes_state, Entry, LogEntry};
use gaps_shard::{ShardConfig, ShardCore};
use gaps_transport::net::{self, Bytes, RpcError};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tracing::{info, warn};

mod backups;
mod log;
mod ship;
pub use backups::*;
pub use log::*;
pub use ship::*;

/// How long a primary waits for a backup's answer to a batch before it drops the backup from the live set.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// A backup whose primary sent nothing for this long asks the coordinator to take its shard over (the primary
/// logs a tick every 250 ms, so a live one is never that silent).
pub const DEFAULT_FAILOVER_AFTER: Duration = Duration::from_secs(1);
/// Bytes of a snapshot sent in one request.
const SNAPSHOT_PIECE: usize = 4 << 20;
/// A batch of entries is cut once it holds this many bytes (or entries).
const BATCH_BYTES: u64 = 4 << 20;
const BATCH_ENTRIES: usize = 4096;
/// How long a shipping task waits for a new entry before it checks that it is still wanted.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How long a shipping task waits before it tries a backup again after a failure.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The shard processes that ever hold shard `shard` among `num_shards` with `replicas` copies of each: its
/// own and the next `replicas − 1` round the ring.
pub fn ring(shard: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    (0..replicas.min(num_shards)).map(|k| (shard + k) % num_shards).collect()
}

/// The backups of shard `shard` while process `serving` serves it: the rest of its ring.
pub fn backups_of(shard: u32, serving: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    ring(shard, num_shards, replicas).into_iter().filter(|p| *p != serving).collect()
}

/// The shards whose backup process `process` is.
pub fn backed_up_by(process: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    (1..replicas).map(|k| (process + num_shards - k % num_shards) % num_shards).collect()
}

/// Checks `--replicas` against the cluster: every copy of a shard on another process.
pub fn check_replicas(replicas: u32, num_shards: u32) -> Result<()> {
    if replicas == 0 {
        bail!("--replicas must be at least 1 (1: no backups)");
    }
    if replicas > num_shards {
        bail!(
            "--replicas {replicas} needs at least {replicas} shard processes (each copy of a shard lives on another \
             one); this cluster has {num_shards}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::wire::{bytes_to_words, Heartbeat, Pull};

    fn log() -> Log {
        Log::new(0, 1 << 20)
    }

    fn heartbeat() -> Frame {
        Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))
    }

    #[test]
    fn replicas_sit_on_the_next_processes_round_the_ring() {
        assert_eq!(backups_of(2, 2, 3, 2), vec![0]);
        assert_eq!(backups_of(0, 0, 4, 3), vec![1, 2]);
        assert_eq!(backups_of(1, 0, 2, 2), vec![1], "taken over by process 0: its own process backs it up");
        assert_eq!(backed_up_by(0, 4, 3), vec![3, 2]);
        assert_eq!(backed_up_by(1, 3, 1), Vec::<u32>::new());
        for (s, n, r) in [(0, 5, 3), (4, 5, 5), (2, 3, 2)] {
            for b in backups_of(s, s, n, r) {
                assert!(backed_up_by(b, n, r).contains(&s), "{s} {n} {r}");
                assert_ne!(b, s);
            }
        }
        assert!(check_replicas(3, 2).is_err() && check_replicas(0, 2).is_err() && check_replicas(2, 2).is_ok());
    }

    #[test]
    fn nothing_is_logged_without_a_backup_and_reads_never_are() {
        let l = log();
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(0));
        assert_eq!(l.tick(Duration::ZERO), 0);
        assert_eq!(l.follow(1), 0);
        let read = Frame::new(Message::Pull(Pull { epoch: 1, chunks: vec![] }));
        assert_eq!(l.request(Duration::ZERO, &read), Ok(0), "a read");
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(1));
        assert_eq!(l.tick(Duration::from_millis(5)), 2);
    }

    #[test]
    fn replies_wait_for_a_backup_once_it_caught_up_and_stop_waiting_when_it_is_dropped() {
        let l = log();
        l.follow(1);
        let first = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        // Catching up: replies do not wait for it yet.
        assert_eq!(*l.acked.borrow(), u64::MAX);
        assert_eq!(l.batch(1, 0).expect("follows").iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![first]);
        assert!(l.acknowledged(1, first));
        assert_eq!(l.live_backups(), 1);
        let second = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        assert_eq!(*l.acked.borrow(), first, "the second entry waits for the backup");
        assert_eq!(l.batch(1, first).expect("follows").len(), 1, "acknowledged entries are dropped");
        assert!(l.acknowledged(1, second));
        assert_eq!(*l.acked.borrow(), second);
        l.request(Duration::ZERO, &heartbeat()).expect("logged");
        l.unfollow(1);
        assert_eq!(*l.acked.borrow(), u64::MAX, "no live backup: nothing waits");
        assert!(l.batch(1, second).is_err() && !l.acknowledged(1, 3));
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(0), "nothing logged without a backup");
    }

    #[test]
    fn each_backups_copies_are_counted_across_drops() {
        let l = log();
        l.follow(1);
        l.snapshot_taken(1, Duration::from_micros(300));
        l.snapshot_progress(1, 40, 100, 40);
        let copying = l.copies();
        assert_eq!(copying.len(), 1);
        assert_eq!((copying[0].copying_sent, copying[0].copying_total, copying[0].live), (40, 100, false));
        l.snapshot_progress(1, 100, 100, 60);
        let first = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        assert!(l.acknowledged(1, first));
        let c = l.copies()[0];
        assert_eq!((c.snapshots, c.bytes_sent, c.copying_total, c.live, c.pause_peak_us), (1, 100, 0, true, 300));
        // Dropped, then copied again: the counts go on, the longest pause stays the longest.
        l.unfollow(1);
        assert!(!l.copies()[0].live);
        l.follow(1);
        l.snapshot_taken(1, Duration::from_micros(100));
        l.snapshot_progress(1, 100, 100, 100);
        let c = l.copies()[0];
        assert_eq!((c.backup, c.snapshots, c.bytes_sent, c.pause_peak_us), (1, 2, 200, 300));
    }

    #[test]
    fn a_backup_catching_up_further_behind_than_the_log_holds_is_dropped_a_live_one_never() {
        let l = Log::new(0, 200);
        l.follow(1);
        let mut last = 0;
        for _ in 0..20 {
            last = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        }
        assert_eq!(last, 0, "the log dropped the backup catching up once it held more than its cap");
        assert!(l.batch(1, 0).is_err());
        // A live backup is only dropped with the coordinator's leave (replies wait for it meanwhile): past
        // the cap, requests are refused as busy, unhandled, until it catches up; ticks are still logged.
        let at = l.follow(2);
        assert!(l.acknowledged(2, at));
        let mut logged = Vec::new();
        let refused = loop {
            match l.request(Duration::ZERO, &heartbeat()) {
                Ok(i) => logged.push(i),
                Err(e) => break e,
            }
            assert!(logged.len() < 100, "the cap holds");
        };
        assert_eq!(refused.0, ErrorCode::Busy);
        assert_eq!(logged, (at + 1..=at + logged.len() as u64).collect::<Vec<_>>(), "in order, none skipped");
        let tick = l.tick(Duration::from_millis(1));
        assert_eq!(tick, at + logged.len() as u64 + 1);
        assert_eq!(*l.acked.borrow(), at);
        assert!(l.acknowledged(2, tick));
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(tick + 1), "room again");
        l.fence();
        assert_eq!(*l.acked.borrow(), u64::MAX, "fenced: waiting replies wake up");
        assert!(l.fenced());
    }

    fn backups() -> Arc<Backups> {
        let cfg = crate::test_support::shard_config(1, 2, gaps_kernels::Rule::Sgd);
        Arc::new(Backups::new(&[0], &cfg, 2, None, |_| 1 << 20))
    }

    fn words(bytes: &[u8]) -> Vec<f32> {
        let mut w = Vec::new();
        bytes_to_words(bytes, &mut w);
        w
    }

    fn refused(b: &Backups, msg: Message, payload: Vec<f32>) -> String {
        format!("{:#}", b.handle_now(Frame { msg, payload }).expect_err("refused"))
    }

    #[test]
    fn a_backup_refuses_what_does_not_continue_its_copy() {
        let b = backups();
        let append = |first, lens: Vec<u32>| Message::ReplicaAppend(ReplicaAppend { shard: 0, first, lens });
        assert!(refused(&b, append(1, vec![]), vec![]).contains("no snapshot"));
        let other = Message::ReplicaAppend(ReplicaAppend { shard: 1, first: 1, lens: vec![] });
        assert!(refused(&b, other, vec![]).contains("does not back up shard 1"));
        let piece = |index, offset, total, bytes| {
            Message::ReplicaSnapshot(ReplicaSnapshot { shard: 0, index, offset, total, bytes })
        };
        assert!(refused(&b, piece(4, 8, 16, 8), words(&[0; 8])).contains("without its start"));
        assert!(refused(&b, piece(4, 0, 4, 8), words(&[0; 8])).contains("past the snapshot's end"));
        assert!(refused(&b, piece(4, 0, 8, 8), words(&[0; 4])).contains("shorter"));
        assert!(refused(&b, piece(4, 0, 8, 8), words(&[7; 8])).contains("restoring"), "not a checkpoint");
        // A real snapshot of shard 0, then entries in order only.
        let core =
            ShardCore::new(ShardConfig { shard: 0, ..b.replicas[&0].lock().expect("lock").cfg.clone() }).expect("core");
        let snap = core.copy_state().expect("snapshot");
        let half = snap.len() / 2;
        let total = snap.len() as u64;
        let first = b.handle_now(Frame { msg: piece(9, 0, total, half as u32), payload: words(&snap[..half]) });
        assert_eq!(first.expect("first piece").applied, 0);
        let rest = snap.len() - half;
        let last =
            b.handle_now(Frame { msg: piece(9, half as u64, total, rest as u32), payload: words(&snap[half..]) });
        assert_eq!(last.expect("last piece").applied, 9);
        assert!(refused(&b, append(11, vec![]), vec![]).contains("where 10 comes next"));
        let tick = LogEntry { index: 10, entry: Entry::Tick { now: Duration::from_secs(1) } }.encode().expect("entry");
        let wrong = LogEntry { index: 12, entry: Entry::Tick { now: Duration::from_secs(1) } }.encode().expect("entry");
        let mut both = tick.clone();
        both.extend_from_slice(&wrong);
        let lens = vec![tick.len() as u32, wrong.len() as u32];
        assert!(refused(&b, append(10, lens), words(&both)).contains("entry 12 where 11 comes next"));
        assert_eq!(b.applied(), vec![(0, 10)], "the entries before the bad one stay applied");
        let garbage = append(11, vec![3]);
        assert!(refused(&b, garbage, words(&[1, 2, 3])).contains("entry 11"));
    }
}
