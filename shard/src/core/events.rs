//! What a shard core says back besides its replies: why it refused a request, whether a checkpoint may be
//! taken now, the other shards it knows, and the events its callers act on.

use super::*;

/// Why the core refused a request. Each maps to an [`ErrorCode`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// See [`ErrorCode::WrongShape`].
    #[error("{0}")]
    WrongShape(String),
    /// See [`ErrorCode::NonFinite`].
    #[error("gradient for chunk {tensor}/{chunk} holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
        /// Element inside the chunk.
        index: usize,
        /// The offending value, printed.
        value: String,
    },
    /// See [`ErrorCode::NotOwner`].
    #[error("chunk {tensor}/{chunk} belongs to shard {owner}, not to shard {me}")]
    NotOwner {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
        /// Its owner.
        owner: u32,
        /// This shard.
        me: u32,
    },
    /// See [`ErrorCode::StaleEpoch`].
    #[error("request carries cluster epoch {got}, the cluster is at epoch {current}: fetch a new cluster map")]
    StaleEpoch {
        /// Epoch in the request.
        got: u64,
        /// This shard's epoch.
        current: u64,
    },
    /// See [`ErrorCode::ClusterIncomplete`].
    #[error("{0}")]
    ClusterIncomplete(String),
    /// See [`ErrorCode::Misconfigured`].
    #[error("{0}")]
    Misconfigured(String),
    /// See [`ErrorCode::Moved`].
    #[error("{0}")]
    Moved(String),
    /// See [`ErrorCode::NotRegistered`].
    #[error("{0}")]
    NotRegistered(String),
    /// See [`ErrorCode::SequenceWindow`].
    #[error("{0}")]
    SequenceWindow(String),
    /// See [`ErrorCode::UnknownKind`].
    #[error("{0} is an answer, not a request")]
    NotARequest(&'static str),
    /// A sparse row belongs to another shard; see [`ErrorCode::NotOwner`].
    #[error("row {id} of table {table} belongs to shard {owner}, not to shard {me}")]
    RowNotOwned {
        /// Table.
        table: u32,
        /// Row id.
        id: u64,
        /// Its owner.
        owner: u32,
        /// This shard.
        me: u32,
    },
    /// See [`ErrorCode::ReadAhead`].
    #[error("chunk {tensor}/{chunk} was read at version {read} but this shard is at version {current} (restored from a checkpoint): pull again")]
    ReadAhead {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
        /// The version in the push.
        read: u64,
        /// The chunk's version here.
        current: u64,
    },
    /// The update could not be applied on the device; see [`ErrorCode::Internal`].
    #[error("applying the update: {0}")]
    Device(String),
}

impl ShardError {
    /// The wire code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            ShardError::WrongShape(_) => ErrorCode::WrongShape,
            ShardError::NonFinite { .. } => ErrorCode::NonFinite,
            ShardError::NotOwner { .. } => ErrorCode::NotOwner,
            ShardError::StaleEpoch { .. } => ErrorCode::StaleEpoch,
            ShardError::ClusterIncomplete(_) => ErrorCode::ClusterIncomplete,
            ShardError::Misconfigured(_) => ErrorCode::Misconfigured,
            ShardError::Moved(_) => ErrorCode::Moved,
            ShardError::NotRegistered(_) => ErrorCode::NotRegistered,
            ShardError::SequenceWindow(_) => ErrorCode::SequenceWindow,
            ShardError::NotARequest(_) => ErrorCode::UnknownKind,
            ShardError::Device(_) => ErrorCode::Internal,
            ShardError::RowNotOwned { .. } => ErrorCode::NotOwner,
            ShardError::ReadAhead { .. } => ErrorCode::ReadAhead,
        }
    }
}

/// Whether a checkpoint can be taken at the point it was asked for (see [`ShardCore::checkpoint_readiness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Now.
    Ready,
    /// Not yet: the step has not completed.
    Later,
    /// Never: the shard has applied this many steps, past the one asked for, or no live worker is left to
    /// reach it.
    Never(u64),
}

/// Another shard as the coordinator knows it ([`ShardCore::peer_shards`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerShard {
    /// The shard.
    pub index: u32,
    /// Where it is served.
    pub addr: String,
    /// The shard process serving it (its certificate's index).
    pub process: u32,
}

/// Something the core wants the embedding service to log or export.
#[derive(Debug, Clone, PartialEq)]
pub enum CoreEvent {
    /// A worker registered.
    WorkerJoined(u32),
    /// A worker left on its own.
    WorkerLeft(u32),
    /// A worker's lease expired.
    WorkerExpired(u32),
    /// A shard joined the cluster.
    ShardJoined(u32),
    /// A backup took over a shard whose primary went silent (replicated shards).
    ShardPromoted {
        /// The shard.
        shard: u32,
        /// The backup process now serving it.
        process: u32,
        /// The shard's new replica epoch.
        epoch: u64,
    },
    /// A shard's backups in sync gained one (replicated shards): only these may take it over, so the
    /// coordinator keeps the news in a checkpoint.
    InSyncGrew {
        /// The shard.
        shard: u32,
        /// Its backups in sync now.
        in_sync: Vec<u32>,
    },
    /// The coordinator decided a cluster-wide mode (`auto`); every shard switches at `from_step`.
    ModeDecided {
        /// The decision's number.
        number: u64,
        /// The mode decided.
        to: Mode,
        /// The first worker step run in it.
        from_step: u64,
        /// Why.
        reason: String,
    },
    /// The training mode changed.
    ModeSwitch {
        /// Mode before.
        from: Mode,
        /// Mode after.
        to: Mode,
        /// Why.
        reason: String,
    },
    /// The device holding the dense state failed at something the shard did on its own (freeing a departed
    /// worker's planes); the shard goes on, the message says what is affected.
    DeviceFault(String),
    /// The learning-rate multiplier starts moving toward a new value because the live worker count changed.
    LrRamp {
        /// Live workers now.
        workers: u32,
        /// The multiplier it moves to.
        target: f64,
    },
}
