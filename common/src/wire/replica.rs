//! Messages between a primary and its backups (snapshots, log entries, reports, promotion), and those that
//! find the coordinator.

use super::*;

/// A piece of a snapshot of shard `shard`'s state as of its log entry `index`, sent by the shard's primary
/// to a backup (replicated shards, docs/replication.md): `bytes` bytes of the snapshot from `offset`, of
/// `total`, packed four to a payload word ([`bytes_to_words`]). The backup answers each piece with
/// [`ReplicaAck`]; the last one's carries `index` once the snapshot is restored. (Added in protocol 12.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaSnapshot {
    /// The shard replicated.
    pub shard: u32,
    /// The last log entry the snapshot holds.
    pub index: u64,
    /// Where this piece starts in the snapshot.
    pub offset: u64,
    /// The snapshot's length in bytes.
    pub total: u64,
    /// This piece's length in bytes.
    pub bytes: u32,
}

/// Entries of shard `shard`'s log from index `first` on, in order, sent by the primary to a backup: entry
/// `k` is `lens[k]` bytes (`gaps_shard::replica::LogEntry`), the entries one after the other packed four
/// bytes to a payload word ([`bytes_to_words`]). (Added in protocol 12.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaAppend {
    /// The shard replicated.
    pub shard: u32,
    /// The first entry's index.
    pub first: u64,
    /// Each entry's length in bytes.
    pub lens: Vec<u32>,
}

/// A backup's answer to [`ReplicaSnapshot`] and [`ReplicaAppend`]: the last log entry of `shard` it has
/// applied (0 after a snapshot piece that is not the last). (Added in protocol 12.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaAck {
    /// The shard replicated.
    pub shard: u32,
    /// The last entry applied.
    pub applied: u64,
}

impl ReplicaAppend {
    /// Bytes of the entries together.
    pub fn total_bytes(&self) -> u64 {
        self.lens.iter().map(|&n| u64::from(n)).sum()
    }
}

/// Packs bytes into payload words, four to a word (little-endian; the last word padded with zeros).
pub fn bytes_to_words(bytes: &[u8], out: &mut Vec<f32>) {
    out.reserve(bytes.len().div_ceil(4));
    for c in bytes.chunks(4) {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        out.push(f32::from_bits(u32::from_le_bytes(w)));
    }
}

/// The first `len` bytes packed in `words` by [`bytes_to_words`]; None when the words hold fewer.
pub fn words_to_bytes(words: &[f32], len: u64) -> Option<Vec<u8>> {
    let len = usize::try_from(len).ok()?;
    if words.len().checked_mul(4)? < len {
        return None;
    }
    let mut out = Vec::with_capacity(len);
    for w in words {
        out.extend_from_slice(&w.to_bits().to_le_bytes());
        if out.len() >= len {
            break;
        }
    }
    out.truncate(len);
    Some(out)
}

/// A primary's report to the coordinator (replicated shards): process `process` serves shard `shard` under
/// replica epoch `epoch`, and its replies wait for the backup processes `in_sync`, which therefore hold
/// every request it acknowledged. Sent after a backup starts counting and before one stops. The coordinator
/// refuses it ([`ErrorCode::Moved`]) when the shard is served under another epoch: this primary was replaced
/// and answers nothing more. (Added in protocol 13.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaReport {
    /// The shard.
    pub shard: u32,
    /// The process serving it (the sender).
    pub process: u32,
    /// The replica epoch it serves under.
    pub epoch: u64,
    /// Its backups in sync.
    pub in_sync: Vec<u32>,
}

/// A backup's request to the coordinator to take over shard `shard`, whose primary went silent: process
/// `process`, in sync under replica epoch `epoch`, serves its copy at `addr` from epoch `epoch + 1`.
/// (Added in protocol 13.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Promote {
    /// The shard.
    pub shard: u32,
    /// The backup process (the sender).
    pub process: u32,
    /// The replica epoch its copy was in sync under.
    pub epoch: u64,
    /// Where it serves the shard.
    pub addr: String,
}

/// The coordinator's answer to [`ReplicaReport`] and [`Promote`]: the shard's replica epoch now.
/// (Added in protocol 13.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaEpoch {
    /// The shard.
    pub shard: u32,
    /// Its replica epoch.
    pub epoch: u64,
}

/// Any peer's question to any shard process: where is the coordinator (shard 0) served now? Answered with
/// [`Message::CoordinatorAt`]: the last configuration of shard 0 the process knows chosen (version 0, process
/// 0 at the address the process was given, where a majority does not choose it), and the shards it holds
/// copies of. (Added in protocol 16; the answer's copies in 18.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct CoordinatorWhere {
    /// The version of shard 0's configuration the asker knows (for the answerer's logs).
    pub known: u64,
}

/// A shard process's answer to [`Message::CoordinatorWhere`] (protocol 18): where it knows the coordinator
/// to be, and which shards it holds a copy of in memory — none while it starts. A process serving shard 0
/// that starts again takes this as proof that a backup of its last configuration holds nothing it lacks.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct CoordinatorAt {
    /// The last configuration of shard 0 the process knows chosen.
    pub config: CoordinatorConfig,
    /// The shards whose copies the process holds (taken from their primaries since it started), sorted.
    pub copies: Vec<u32>,
    /// The process is starting: it answers only where the coordinator is and its part in choosing shard 0's
    /// configuration.
    pub starting: bool,
}
