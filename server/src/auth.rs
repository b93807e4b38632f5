//! Who may do what. Every connection carries the identity its certificate names (see
//! `gaps_transport::identity`): shard `i` of a cluster, or a worker. Before a request reaches the core the
//! service checks it against that identity:
//!
//! - only shard `i`'s certificate joins the coordinator as shard `i`;
//! - only a worker certificate registers a worker (any certificate of the cluster may observe);
//! - pushes, heartbeats and leaves for worker `w` are accepted only on a connection authenticated as `w`,
//!   with the credential the coordinator gave `w` at registration: an HMAC-SHA256 over the cluster epoch,
//!   `w` and the registrant's certificate identity, under a key only the shards hold. So no other worker
//!   (even one holding the same certificate) can act as `w`, and a credential is useless with another
//!   certificate;
//! - checkpoint requests come from the coordinator's certificate only (its schedule, or an operator holding it);
//!   so do rollbacks, which any shard may ask the coordinator for after it restarted.
//!
//! Refusals are typed (`Unauthorized`), say nothing about the model, are counted, and logged at a bounded
//! rate.

use anyhow::{Context, Result};
use gaps_common::wire::{Message, Role as WireRole, Rollback, RollbackStage, Token};
use gaps_transport::identity::{PeerIdentity, Role};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The cluster's credential key and epoch: makes and checks workers' tokens.
pub struct Credentials {
    raw: Token,
    key: ring::hmac::Key,
    epoch: u64,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("epoch", &self.epoch).finish_non_exhaustive()
    }
}

impl Credentials {
    /// Credentials under `raw` for cluster epoch `epoch`.
    pub fn new(raw: Token, epoch: u64) -> Self {
        Credentials { raw, key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &raw), epoch }
    }

    /// The key itself (handed to joining shards only).
    pub fn raw(&self) -> Token {
        self.raw
    }

    fn message(&self, worker: u32, identity: &PeerIdentity) -> Vec<u8> {
        let mut m = b"gaps worker token v1\0".to_vec();
        m.extend_from_slice(&self.epoch.to_le_bytes());
        m.extend_from_slice(&worker.to_le_bytes());
        m.extend_from_slice(identity.uri().as_bytes());
        m
    }

    /// The token of worker `worker` registered by `identity`.
    pub fn token(&self, worker: u32, identity: &PeerIdentity) -> Token {
        let tag = ring::hmac::sign(&self.key, &self.message(worker, identity));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// True when `token` is worker `worker`'s for `identity` (constant time).
    pub fn verify(&self, worker: u32, identity: &PeerIdentity, token: &Token) -> bool {
        ring::hmac::verify(&self.key, &self.message(worker, identity), token).is_ok()
    }
}

/// A fresh random key.
pub fn random_key() -> Result<Token> {
    let mut key = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
        .map_err(|_| anyhow::anyhow!("the system's random source failed"))?;
    Ok(key)
}

/// The coordinator's key, kept in `dir/auth.key` (owner-only) so that a restarted coordinator accepts the
/// tokens it gave before; made on first use.
pub fn load_or_create_key(dir: &Path) -> Result<Token> {
    let path = dir.join("auth.key");
    if let Ok(bytes) = std::fs::read(&path) {
        return bytes
            .try_into()
            .map_err(|_| anyhow::anyhow!("{} is not a 32-byte key: delete it to make a new one", path.display()));
    }
    let key = random_key()?;
    write_key(dir, &key)?;
    Ok(key)
}

/// Keeps `key` as the cluster's credential key in `dir` (a process serving shard 0 that it took over: served
/// again from this folder, it hands out the same key).
pub fn keep_key(dir: &Path, key: &Token) -> Result<()> {
    match std::fs::read(dir.join("auth.key")) {
        Ok(bytes) if bytes == key.as_slice() => Ok(()),
        _ => write_key(dir, key),
    }
}

fn write_key(dir: &Path, key: &Token) -> Result<()> {
    let (path, tmp) = (dir.join("auth.key"), dir.join("auth.key.tmp"));
    {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut f = options.open(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(key).and_then(|()| f.sync_all()).with_context(|| format!("writing {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))
}

/// The worker a request acts for, if it is one that must come from that worker.
pub fn acting_worker(msg: &Message) -> Option<u32> {
    match msg {
        Message::Push(p) | Message::PushPull(p) | Message::PushPart(gaps_common::wire::PushPart { push: p, .. }) => {
            Some(p.worker)
        }
        Message::SparsePush(p) => Some(p.worker),
        // The core refuses a step whose parts name different workers.
        Message::Step(s) => Some(s.push.worker),
        Message::Heartbeat(h) => Some(h.worker),
        Message::Leave(l) => Some(l.worker),
        Message::SplitRequest(r) => Some(r.worker),
        Message::Initialize(i) => Some(i.worker),
        Message::TableLoad(l) => Some(l.worker),
        _ => None,
    }
}

/// Whether `peer`, on a connection authenticated as `bound` (if any), may send `msg`; the reason if not.
/// ([`Message::Authenticate`] is checked by its handler.) `coordinator` says which shard process serves
/// shard 0 now (asked only for the coordinator's orders: besides shard 0's own certificate, which an
/// operator presents, that process's may give them once a majority moved the coordinator there).
pub fn authorize(
    msg: &Message,
    peer: &PeerIdentity,
    bound: Option<u32>,
    coordinator: &dyn Fn() -> u32,
) -> Result<(), String> {
    let is_coordinator = |role: &Role| *role == Role::Shard(0) || *role == Role::Shard(coordinator());
    match (msg, &peer.role) {
        (Message::RegisterShard(r), Role::Shard(i)) if *i == r.shard => Ok(()),
        (Message::RegisterShard(r), _) => Err(format!("{peer} cannot join as shard {}", r.shard)),
        (Message::Register(r), Role::Shard(_)) if r.role == WireRole::Worker => {
            Err(format!("{peer} is a shard certificate; it cannot register a worker"))
        }
        // Checkpoints are the coordinator's to order: its schedule asks every shard, and an operator's
        // on-demand checkpoint (`gaps checkpoint`) presents the coordinator's certificate. A worker that
        // could order them could make shards write without end, or wait for a step never reached.
        (Message::CheckpointRequest(_), role) if !is_coordinator(role) => {
            Err(format!("{peer} cannot ask for checkpoints (only the coordinator's certificate can)"))
        }
        // A restarted shard asks the coordinator to roll the cluster back; only the coordinator lists a
        // shard's checkpoints or makes it restore one.
        (Message::Rollback(Rollback { stage: RollbackStage::Restored, .. }), Role::Shard(_)) => Ok(()),
        (Message::Rollback(_), role) if !is_coordinator(role) => {
            Err(format!("{peer} cannot roll shards back (only the coordinator's certificate can)"))
        }
        // A shard's log and snapshots come from a shard process (the copies check that it is one of the
        // processes that may serve that shard, `replication::ring`).
        (Message::ReplicaSnapshot(_) | Message::ReplicaAppend(_), Role::Shard(_)) => Ok(()),
        (Message::ReplicaSnapshot(gaps_common::wire::ReplicaSnapshot { shard, .. }), _)
        | (Message::ReplicaAppend(gaps_common::wire::ReplicaAppend { shard, .. }), _) => {
            Err(format!("{peer} cannot replicate shard {shard} (only a shard certificate can)"))
        }
        // The coordinator hears of a shard's backups from the process serving it, and of a takeover from the
        // backup taking it.
        (Message::ReplicaReport(gaps_common::wire::ReplicaReport { process, .. }), Role::Shard(i))
        | (Message::Promote(gaps_common::wire::Promote { process, .. }), Role::Shard(i))
            if i == process =>
        {
            Ok(())
        }
        (Message::ReplicaReport(gaps_common::wire::ReplicaReport { process, .. }), _)
        | (Message::Promote(gaps_common::wire::Promote { process, .. }), _) => {
            Err(format!("{peer} cannot speak for shard process {process} (only that process's certificate can)"))
        }
        // Shard 0's configuration is chosen by the shard processes alone.
        (msg, Role::Shard(_)) if crate::quorum::is_quorum_message(msg) => Ok(()),
        (msg, _) if crate::quorum::is_quorum_message(msg) => {
            Err(format!("{peer} cannot choose shard 0's configuration (only a shard certificate can)"))
        }
        // Data is dealt to workers only (a split dealt to anyone else would never be trained).
        (Message::SplitRequest(_), Role::Shard(_)) => {
            Err(format!("{peer} is not a worker certificate; only workers are dealt data"))
        }
        _ => match acting_worker(msg) {
            Some(w) if bound == Some(w) => Ok(()),
            Some(w) => Err(format!("this connection is not authenticated as worker {w}")),
            None => Ok(()),
        },
    }
}

/// Lets one log line through per interval and counts the rest, so a flood of bad requests cannot flood
/// the log.
#[derive(Debug)]
pub struct LogLimiter {
    started: Instant,
    interval_ms: u64,
    /// Milliseconds since `started` of the last line let through (+1; 0: never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimiter {
    /// At most one line per `interval`.
    pub fn new(interval: std::time::Duration) -> Self {
        LogLimiter {
            started: Instant::now(),
            interval_ms: interval.as_millis() as u64,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Some(lines suppressed since the last one) when a line may be written now.
    pub fn allow(&self) -> Option<u64> {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        if last != 0 && now < last + self.interval_ms {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        match self.last.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => Some(self.suppressed.swap(0, Ordering::Relaxed)),
            Err(_) => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::wire::{Heartbeat, Leave, RegisterShard};

    fn id(role: Role) -> PeerIdentity {
        PeerIdentity { cluster: "c".into(), role }
    }

    #[test]
    fn tokens_bind_worker_epoch_and_certificate() {
        let creds = Credentials::new([5; 32], 9);
        let alice = id(Role::Worker("alice".into()));
        let t = creds.token(3, &alice);
        assert!(creds.verify(3, &alice, &t));
        assert!(!creds.verify(4, &alice, &t), "another worker id");
        assert!(!creds.verify(3, &id(Role::Worker("bob".into())), &t), "another certificate");
        assert!(!Credentials::new([5; 32], 10).verify(3, &alice, &t), "another epoch");
        assert!(!Credentials::new([6; 32], 9).verify(3, &alice, &t), "another key");
    }

    #[test]
    fn only_the_named_shard_joins_and_only_the_bound_worker_acts() {
        let join = |shard| {
            Message::RegisterShard(RegisterShard {
                protocol: 4,
                shard,
                num_shards: 3,
                addr: "x".into(),
                layout_fingerprint: 0,
            })
        };
        assert!(authorize(&join(1), &id(Role::Shard(1)), None, &|| 0).is_ok());
        assert!(authorize(&join(2), &id(Role::Shard(1)), None, &|| 0).is_err());
        assert!(authorize(&join(1), &id(Role::Worker("w".into())), None, &|| 0).is_err());
        let hb = Message::Heartbeat(Heartbeat { worker: 7 });
        let w = id(Role::Worker("w".into()));
        assert!(authorize(&hb, &w, Some(7), &|| 0).is_ok());
        assert!(authorize(&hb, &w, Some(6), &|| 0).is_err());
        assert!(authorize(&hb, &w, None, &|| 0).is_err());
        assert!(authorize(&Message::Leave(Leave { worker: 7 }), &id(Role::Shard(0)), None, &|| 0).is_err());
        let split =
            |worker| Message::SplitRequest(gaps_common::wire::SplitRequest { epoch: 1, worker, finished: None });
        assert!(authorize(&split(7), &w, Some(7), &|| 0).is_ok());
        assert!(authorize(&split(7), &w, Some(6), &|| 0).is_err(), "another worker's split");
        assert!(authorize(&split(7), &w, None, &|| 0).is_err(), "an unbound connection");
        assert!(authorize(&split(7), &id(Role::Shard(0)), Some(7), &|| 0).is_err(), "a shard certificate");
        let err = authorize(&join(2), &id(Role::Shard(1)), None, &|| 0).expect_err("refused");
        assert!(!err.contains("fingerprint") && !err.contains("layout"), "{err}");
    }

    #[test]
    fn only_the_coordinators_certificate_asks_for_checkpoints() {
        use gaps_common::wire::{CheckpointAt, CheckpointRequest};
        for (req_id, at) in [(0, CheckpointAt::Quiescent), (0, CheckpointAt::Step(1 << 62)), (9, CheckpointAt::Now)] {
            let req = Message::CheckpointRequest(CheckpointRequest { id: req_id, at });
            assert!(authorize(&req, &id(Role::Shard(0)), None, &|| 0).is_ok(), "{req:?}");
            assert!(authorize(&req, &id(Role::Shard(2)), None, &|| 0).is_err(), "another shard: {req:?}");
            // Once a majority moved the coordinator to process 2, its certificate orders them too.
            assert!(authorize(&req, &id(Role::Shard(2)), None, &|| 2).is_ok(), "the coordinator now: {req:?}");
            assert!(authorize(&req, &id(Role::Shard(1)), None, &|| 2).is_err(), "another shard: {req:?}");
            let worker = id(Role::Worker("w".into()));
            assert!(authorize(&req, &worker, None, &|| 0).is_err(), "a worker: {req:?}");
            assert!(authorize(&req, &worker, Some(3), &|| 0).is_err(), "an authenticated worker: {req:?}");
        }
    }

    #[test]
    fn only_shards_start_a_rollback_and_only_the_coordinator_runs_one() {
        let restored = Message::Rollback(Rollback { id: 5, stage: RollbackStage::Restored });
        assert!(authorize(&restored, &id(Role::Shard(3)), None, &|| 0).is_ok());
        assert!(authorize(&restored, &id(Role::Worker("w".into())), Some(1), &|| 0).is_err());
        for stage in [RollbackStage::List, RollbackStage::Apply] {
            let req = Message::Rollback(Rollback { id: 5, stage });
            assert!(authorize(&req, &id(Role::Shard(0)), None, &|| 0).is_ok());
            assert!(authorize(&req, &id(Role::Shard(1)), None, &|| 0).is_err());
            assert!(authorize(&req, &id(Role::Shard(1)), None, &|| 1).is_ok(), "the coordinator now");
            assert!(authorize(&req, &id(Role::Worker("w".into())), Some(1), &|| 0).is_err());
        }
    }

    /// Whether shard process `shard`'s certificate may send `msg` (shard 0 the coordinator).
    fn from_shard(msg: &Message, shard: u32) -> bool {
        authorize(msg, &id(Role::Shard(shard)), None, &|| 0).is_ok()
    }

    /// Whether an authenticated worker may send `msg`.
    fn from_worker(msg: &Message) -> bool {
        authorize(msg, &id(Role::Worker("w".into())), Some(2), &|| 0).is_ok()
    }

    #[test]
    fn only_shard_certificates_replicate() {
        use gaps_common::wire::{ReplicaAppend, ReplicaSnapshot};
        let append = Message::ReplicaAppend(ReplicaAppend { shard: 2, first: 1, lens: vec![] });
        let snapshot = Message::ReplicaSnapshot(ReplicaSnapshot { shard: 2, index: 0, offset: 0, total: 1, bytes: 1 });
        for msg in [append, snapshot] {
            // Which shard processes may serve shard 2 is the copies' to check (`replication::ring`).
            assert!(from_shard(&msg, 2) && from_shard(&msg, 3), "{msg:?}");
            assert!(!from_worker(&msg), "a worker: {msg:?}");
        }
    }

    #[test]
    fn only_a_process_speaks_for_itself_to_the_coordinator() {
        use gaps_common::wire::{Promote, ReplicaReport};
        let report = Message::ReplicaReport(ReplicaReport { shard: 1, process: 2, epoch: 0, in_sync: vec![] });
        let promote = Message::Promote(Promote { shard: 1, process: 2, epoch: 0, addr: "x:1".into() });
        for msg in [report, promote] {
            assert!(from_shard(&msg, 2), "{msg:?}");
            assert!(!from_shard(&msg, 1), "the shard's own index: {msg:?}");
            assert!(!from_worker(&msg), "a worker: {msg:?}");
        }
    }

    #[test]
    fn the_limiter_lets_one_line_through_per_interval() {
        let l = LogLimiter::new(std::time::Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        let l = LogLimiter::new(std::time::Duration::ZERO);
        assert!(l.allow().is_some() && l.allow().is_some());
    }
}
