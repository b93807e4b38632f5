//! The gaps wire protocol.
//!
//! One RPC is one QUIC bidirectional stream: the client writes one request frame and finishes the stream;
//! the server answers with one reply frame and finishes. A frame is
//!
//! ```text
//! [kind: u8][header_len: u32 LE][header: bincode-2, header_len bytes][payload: little-endian values]
//! ```
//!
//! The header is the only part encoded with bincode; tensors travel as raw little-endian values whose
//! count and format are implied by the header: the payload is a sequence of sections
//! ([`Message::payload_sections`]), each `f32` or, for a dense chunk whose tensor says so, a 16-bit format
//! ([`WireDtype`]: bfloat16 or half). Receivers decode every section into `f32` ([`PayloadDecoder`]).
//! Every length is checked against [`Limits`] before anything is allocated, and a header must be consumed
//! exactly.
//!
//! This module and [`crate::quorum`] (shard 0's configuration and the messages that choose it) hold the only
//! types of the project that derive bincode's `Encode`/`Decode`.

use crate::dtype::WireDtype;
use crate::layout::{ChunkId, Layout};
use crate::quorum::{ConfigAccept, ConfigAccepted, ConfigPrepare, ConfigPromise, ConfigRefused, CoordinatorConfig};
use bincode::{Decode, Encode};

/// Protocol version carried by registrations; a peer with another version is refused.
pub const PROTOCOL_VERSION: u16 = 19;
/// Bytes before the header: the kind byte and the header length.
pub const FRAME_PREFIX_LEN: usize = 5;
/// Hard upper bound on an encoded header (also the bincode decode limit).
pub const MAX_HEADER_BYTES: u32 = 1 << 20;
/// Default upper bound on a frame's tensor payload (1 GiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: u64 = 1 << 30;

/// Bounds applied to every incoming frame before allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted header, in bytes (at most [`MAX_HEADER_BYTES`]).
    pub max_header_bytes: u32,
    /// Largest accepted tensor payload, in bytes.
    pub max_payload_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_header_bytes: MAX_HEADER_BYTES, max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES }
    }
}

/// Everything that can be wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame ended before the declared length.
    #[error("truncated frame: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the frame declared.
        needed: u64,
        /// Bytes that arrived.
        got: u64,
    },
    /// The header length exceeds the limit.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The payload length implied by the header exceeds the limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// Implied length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The kind byte names no message.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The header does not decode as the message its kind names.
    #[error("malformed header: {0}")]
    BadHeader(String),
    /// The number of payload elements differs from what the header declares.
    #[error("payload has {got} elements, header declares {expected}")]
    ElementCountMismatch {
        /// Declared by the header.
        expected: u64,
        /// Present.
        got: u64,
    },
    /// Bytes follow the end of the frame.
    #[error("{0} unexpected bytes after the end of the frame")]
    TrailingBytes(u64),
    /// The transport failed while reading or writing.
    #[error("transport error: {0}")]
    Io(String),
}

/// Why a request was refused; carried by [`ErrorReply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Encode, Decode)]
pub enum ErrorCode {
    /// The frame could not be decoded.
    Malformed,
    /// The frame's kind is unknown or not valid as a request.
    UnknownKind,
    /// A length exceeded a limit.
    TooLarge,
    /// A tensor/chunk reference or element count does not match the layout.
    WrongShape,
    /// A gradient holds NaN or ±Inf.
    NonFinite,
    /// The chunk belongs to another shard.
    NotOwner,
    /// The request carries an out-of-date cluster epoch.
    StaleEpoch,
    /// Not every shard has joined the cluster yet.
    ClusterIncomplete,
    /// The peer's configuration contradicts the cluster's (layout, shard count, protocol).
    Misconfigured,
    /// The worker id is unknown to this coordinator, or the request needs the coordinator.
    NotRegistered,
    /// The sequence number is too old to tell whether it was applied (or zero).
    SequenceWindow,
    /// The server is shutting down.
    ShuttingDown,
    /// An internal failure; the message says what.
    Internal,
    /// The push was computed on versions this shard has not reached: it was restored from a checkpoint
    /// taken before them. The gradient is stale; pull again.
    ReadAhead,
    /// A checkpoint was asked for at a synchronous step this shard has already passed.
    TooLate,
    /// The peer's certificate or credential does not allow this request.
    Unauthorized,
    /// The server had no room for the request's bytes in time (its in-flight memory budget was taken by
    /// other requests); nothing of it was applied, and the same request may be sent again after a pause.
    Busy,
    /// This process no longer serves the shard (a backup took it over): nothing was applied; fetch the map
    /// again and send the request where it says. (Added in protocol 13.)
    Moved,
}

mod train;
pub use train::*;
mod control;
pub use control::*;
mod replica;
pub use replica::*;
mod direction;
pub use direction::*;
/// Every message of the protocol. The kind byte on the wire is [`Message::kind`].
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Kind 1.
    Register(Register),
    /// Kind 2.
    RegisterShard(RegisterShard),
    /// Kind 3.
    ClusterMap(ClusterMap),
    /// Kind 4.
    Pull(Pull),
    /// Kind 5 (carries a payload).
    PullReply(PullReply),
    /// Kind 6 (carries a payload).
    Push(Push),
    /// Kind 7.
    Ack(Ack),
    /// Kind 8.
    Error(ErrorReply),
    /// Kind 9.
    Heartbeat(Heartbeat),
    /// Kind 10.
    HeartbeatAck(HeartbeatAck),
    /// Kind 11.
    StatsRequest(StatsRequest),
    /// Kind 12.
    Stats(Stats),
    /// Kind 13.
    Leave(Leave),
    /// Kind 14 (carries ids).
    SparsePull(SparsePull),
    /// Kind 15 (carries versions and rows).
    SparsePullReply(SparsePullReply),
    /// Kind 16 (carries ids, versions, gradients, optionally rows).
    SparsePush(SparsePush),
    /// Kind 17.
    CheckpointRequest(CheckpointRequest),
    /// Kind 18.
    CheckpointDone(CheckpointDone),
    /// Kind 19.
    Authenticate(Authenticate),
    /// Kind 20.
    Authenticated(Authenticated),
    /// Kind 21 (carries a payload).
    PushPart(PushPart),
    /// Kind 22 (carries a payload): a [`Push`] answered with the pushed chunks' new values, saving the
    /// worker the pull that would follow it.
    PushPull(Push),
    /// Kind 23 (carries a payload).
    PushPullReply(PushPullReply),
    /// Kind 24.
    Rollback(Rollback),
    /// Kind 25.
    RollbackReply(RollbackReply),
    /// Kind 26.
    SplitRequest(SplitRequest),
    /// Kind 27.
    SplitGrant(SplitGrant),
    /// Kind 28.
    DataStatusRequest(DataStatusRequest),
    /// Kind 29.
    DataStatus(DataStatus),
    /// Kind 30 (answered with [`Message::Stats`]).
    WaitStep(WaitStep),
    /// A model's own initial values for untouched dense chunks.
    Initialize(Initialize),
    /// Answer to [`Message::Initialize`].
    Initialized(Initialized),
    /// A page of a table's rows (export).
    TableScan(TableScan),
    /// Answer to [`Message::TableScan`].
    TableRows(TableRows),
    /// Rows loaded into a table (import).
    TableLoad(TableLoad),
    /// Answer to [`Message::TableLoad`].
    TableLoaded(TableLoaded),
    /// A piece of a snapshot, primary to backup.
    ReplicaSnapshot(ReplicaSnapshot),
    /// Log entries, primary to backup.
    ReplicaAppend(ReplicaAppend),
    /// A backup's answer to both.
    ReplicaAck(ReplicaAck),
    /// A primary's backups in sync, to the coordinator.
    ReplicaReport(ReplicaReport),
    /// A backup taking over its shard, to the coordinator.
    Promote(Promote),
    /// The coordinator's answer to both.
    ReplicaEpoch(ReplicaEpoch),
    /// Choosing shard 0's configuration ([`crate::quorum`], protocol 16), phase 1, proposer to acceptor.
    ConfigPrepare(ConfigPrepare),
    /// An acceptor's promise.
    ConfigPromise(ConfigPromise),
    /// Phase 2, proposer to acceptor.
    ConfigAccept(ConfigAccept),
    /// An acceptor accepted.
    ConfigAccepted(ConfigAccepted),
    /// An acceptor refused, with what it knows.
    ConfigRefused(ConfigRefused),
    /// A configuration chosen (to every process), and an acceptor's answer to it: the last it knows.
    ConfigChosen(CoordinatorConfig),
    /// Where the coordinator is, asked of any shard process.
    CoordinatorWhere(CoordinatorWhere),
    /// The answer to [`Message::CoordinatorWhere`].
    CoordinatorAt(CoordinatorAt),
    /// A worker's step on one shard: rows pushed, the dense push-pull, the next rows pulled (protocol 19).
    Step(Step),
    /// The answer to [`Message::Step`].
    StepReply(StepReply),
}

/// Defines `kind()`, header encoding and kind-directed decoding for every variant in one place.
macro_rules! message_kinds {
    ($($kind:literal => $variant:ident),* $(,)?) => {
        impl Message {
            /// The kind byte of this message on the wire.
            pub fn kind(&self) -> u8 {
                match self { $(Message::$variant(_) => $kind,)* }
            }

            /// True when `kind` names a message of this protocol.
            pub fn is_known_kind(kind: u8) -> bool {
                [$($kind),*].contains(&kind)
            }

            fn encode_body(&self, out: &mut Vec<u8>) -> Result<usize, bincode::error::EncodeError> {
                match self { $(Message::$variant(m) => bincode::encode_into_std_write(m, out, config()),)* }
            }

            fn decode_body(kind: u8, bytes: &[u8]) -> Result<(Message, usize), WireError> {
                let bad = |e: bincode::error::DecodeError| WireError::BadHeader(e.to_string());
                match kind {
                    $($kind => {
                        let (m, used) = bincode::decode_from_slice(bytes, config()).map_err(bad)?;
                        Ok((Message::$variant(m), used))
                    })*
                    other => Err(WireError::UnknownKind(other)),
                }
            }
        }
    };
}

message_kinds! {
    1 => Register, 2 => RegisterShard, 3 => ClusterMap, 4 => Pull, 5 => PullReply, 6 => Push, 7 => Ack,
    8 => Error, 9 => Heartbeat, 10 => HeartbeatAck, 11 => StatsRequest, 12 => Stats, 13 => Leave,
    14 => SparsePull, 15 => SparsePullReply, 16 => SparsePush, 17 => CheckpointRequest, 18 => CheckpointDone,
    19 => Authenticate, 20 => Authenticated, 21 => PushPart, 22 => PushPull, 23 => PushPullReply,
    24 => Rollback, 25 => RollbackReply, 26 => SplitRequest, 27 => SplitGrant, 28 => DataStatusRequest,
    29 => DataStatus, 30 => WaitStep, 31 => Initialize, 32 => Initialized,
    33 => TableScan, 34 => TableRows, 35 => TableLoad, 36 => TableLoaded,
    37 => ReplicaSnapshot, 38 => ReplicaAppend, 39 => ReplicaAck, 40 => ReplicaReport, 41 => Promote,
    42 => ReplicaEpoch, 43 => ConfigPrepare, 44 => ConfigPromise, 45 => ConfigAccept, 46 => ConfigAccepted,
    47 => ConfigRefused, 48 => ConfigChosen, 49 => CoordinatorWhere, 50 => CoordinatorAt, 51 => Step,
    52 => StepReply,
}

mod frame;
pub use frame::*;
impl Message {
    /// The payload's sections in order: `(values, format)`. Sparse payloads and everything else are f32.
    pub fn payload_sections(&self) -> Vec<(u64, WireDtype)> {
        match self {
            Message::PullReply(PullReply { chunks }) | Message::PushPullReply(PushPullReply { chunks, .. }) => {
                chunks.iter().map(|c| (u64::from(c.len), c.dtype)).collect()
            }
            Message::Push(p) | Message::PushPull(p) | Message::PushPart(PushPart { push: p, .. }) => {
                p.payload_sections().collect()
            }
            Message::Step(s) => {
                let (rows, _, ids) = s.payload_split();
                let f32s = |n: u64| (n > 0).then_some((n, WireDtype::F32));
                f32s(rows).into_iter().chain(s.push.payload_sections()).chain(f32s(ids)).collect()
            }
            Message::StepReply(r) => {
                let rows = r.next_rows.as_ref().map_or(0, SparsePullReply::payload_elems);
                let dense = r.push.chunks.iter().map(|c| (u64::from(c.len), c.dtype));
                dense.chain((rows > 0).then_some((rows, WireDtype::F32))).collect()
            }
            other => match other.payload_elems() {
                0 => Vec::new(),
                n => vec![(n, WireDtype::F32)],
            },
        }
    }

    /// Bytes of payload on the wire (each section's values times its format's size).
    pub fn payload_bytes(&self) -> u64 {
        let sections = self.payload_sections();
        sections.iter().fold(0u64, |sum, (n, d)| sum.saturating_add(n.saturating_mul(d.bytes() as u64)))
    }

    /// Number of payload values this header declares (sum of the chunk lengths), whatever their format;
    /// receivers hold them as f32.
    pub fn payload_elems(&self) -> u64 {
        match self {
            Message::PullReply(PullReply { chunks }) | Message::PushPullReply(PushPullReply { chunks, .. }) => {
                chunks.iter().map(|c| u64::from(c.len)).sum()
            }
            Message::Push(p) | Message::PushPull(p) | Message::PushPart(PushPart { push: p, .. }) => p.payload_elems(),
            Message::Step(s) => {
                let (rows, dense, ids) = s.payload_split();
                rows.saturating_add(dense).saturating_add(ids)
            }
            Message::StepReply(r) => {
                let dense: u64 = r.push.chunks.iter().map(|c| u64::from(c.len)).sum();
                dense.saturating_add(r.next_rows.as_ref().map_or(0, SparsePullReply::payload_elems))
            }
            Message::SparsePull(p) => p.payload_elems(),
            Message::SparsePullReply(r) => r.payload_elems(),
            Message::SparsePush(p) => p.payload_elems(),
            Message::Initialize(i) => i.chunks.iter().map(|c| u64::from(c.len)).sum(),
            Message::TableRows(r) => u64::from(r.count) * (2 + u64::from(r.dim)),
            Message::TableLoad(r) => u64::from(r.count) * (2 + u64::from(r.dim)),
            Message::ReplicaSnapshot(r) => u64::from(r.bytes).div_ceil(4),
            Message::ReplicaAppend(r) => r.total_bytes().div_ceil(4),
            _ => 0,
        }
    }

    /// Shorthand for an [`ErrorReply`].
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Message {
        Message::Error(ErrorReply { code, message: message.into() })
    }
}

#[cfg(test)]
mod tests;
