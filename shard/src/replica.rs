//! Replicated shards, first step (docs/replication.md): which requests a backup must see, and the log
//! entry that carries one to it. A shard is a deterministic state machine — the same `(request, now)` and
//! `tick(now)` sequence gives the same state — so a backup that handles the primary's log in order holds the
//! primary's state (parameters, optimizer planes, tables, ledgers, the step in progress, leases, the
//! dealer); reads are answered by the primary alone. `shard/tests/replica.rs` checks it in every mode.
//!
//! Not wired into the service yet: the replication connection, replies held for the backups' acks,
//! fail-over and re-replication are the next steps.

use gaps_common::wire::{self, Frame, Limits, Message, WireError};
use std::time::Duration;

/// Whether handling `msg` can change what a backup must hold: pushes (a striped push's parts are put
/// together by the service, which logs the whole push; a part reaches the core only as a duplicate, which
/// the backup answers the same way and counts), sparse pushes, workers' steps (which push), sparse pulls that
/// create rows, workers' registrations, heartbeats, departures, split requests, initial values and table loads — a
/// request of these kinds the core refuses included (the backup refuses it the same way, counters and all).
/// Everything else is not logged: reads (dense pulls, sparse pulls with `create = false`, stats and step
/// waits, data status, table pages), whose only trace is the primary's own read counters (`Stats::pulls`,
/// bytes in and out); the kinds the service handles itself and the core refuses unchanged (checkpoints,
/// rollbacks, authentication); and replies. State changed outside `ShardCore::handle` and
/// `tick` — joining the cluster, the dealer's settings, a rollback that replaces the core — reaches a backup
/// through a snapshot instead (docs/replication.md).
pub fn changes_state(msg: &Message) -> bool {
    match msg {
        Message::Push(_)
        | Message::PushPull(_)
        | Message::PushPart(_)
        | Message::SparsePush(_)
        | Message::Step(_)
        | Message::RegisterShard(_)
        | Message::Heartbeat(_)
        | Message::Leave(_)
        | Message::SplitRequest(_)
        | Message::Initialize(_)
        | Message::TableLoad(_)
        | Message::ReplicaReport(_)
        | Message::Promote(_) => true,
        Message::SparsePull(p) => p.create,
        // An observer's registration only reads the map.
        Message::Register(r) => r.role == wire::Role::Worker,
        _ => false,
    }
}

/// What a backup does with an entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// `ShardCore::handle(frame, now)`.
    Request {
        /// The primary's clock when it handled the request.
        now: Duration,
        /// The request as the primary's core got it (a striped push put together).
        frame: Box<Frame>,
    },
    /// `ShardCore::tick(now)`.
    Tick {
        /// The primary's clock at the tick.
        now: Duration,
    },
}

/// One entry of a shard's log, numbered from 1 in the order the primary's core handled them.
#[derive(Debug, Clone, PartialEq)]
pub struct LogEntry {
    /// The entry's place in the log.
    pub index: u64,
    /// What to do.
    pub entry: Entry,
}

/// Bytes before an entry's frame: index, clock in nanoseconds, kind.
const ENTRY_PREFIX: usize = 8 + 8 + 1;

impl LogEntry {
    /// The entry as bytes: `[index u64 LE][now ns u64 LE][kind u8]`, then, for a request, the frame as the
    /// wire encodes it.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let (now, kind, frame) = match &self.entry {
            Entry::Request { now, frame } => (*now, 1u8, Some(wire::encode_frame(frame)?)),
            Entry::Tick { now } => (*now, 2u8, None),
        };
        let nanos = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        let mut out = Vec::with_capacity(ENTRY_PREFIX + frame.as_ref().map_or(0, Vec::len));
        out.extend_from_slice(&self.index.to_le_bytes());
        out.extend_from_slice(&nanos.to_le_bytes());
        out.push(kind);
        if let Some(frame) = frame {
            out.extend_from_slice(&frame);
        }
        Ok(out)
    }

    /// Reads an entry written by [`LogEntry::encode`]; the frame is held to `limits` as any frame from the
    /// network is. Any other bytes are a typed error, never a panic.
    pub fn decode(bytes: &[u8], limits: &Limits) -> Result<LogEntry, WireError> {
        let truncated = || WireError::Truncated { needed: ENTRY_PREFIX as u64, got: bytes.len() as u64 };
        let prefix = bytes.get(..ENTRY_PREFIX).ok_or_else(truncated)?;
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&prefix[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let (index, now) = (word(0), Duration::from_nanos(word(8)));
        let rest = &bytes[ENTRY_PREFIX..];
        let entry = match prefix[16] {
            1 => Entry::Request { now, frame: Box::new(wire::decode_frame(rest, limits)?) },
            2 if rest.is_empty() => Entry::Tick { now },
            2 => return Err(WireError::TrailingBytes(rest.len() as u64)),
            kind => return Err(WireError::UnknownKind(kind)),
        };
        Ok(LogEntry { index, entry })
    }
}
