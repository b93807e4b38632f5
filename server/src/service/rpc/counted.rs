//! What a request and its reply count as in the shard's metrics.

use super::*;

/// What a request counts as in the metrics: dense and sparse pushes are pushes, dense and sparse pulls are
/// pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::service) enum RpcKind {
    Push,
    Pull,
    /// A push answered with the pushed chunks' values: counted as a push and, when it carries them, a pull.
    PushPull,
    /// A worker's step (`true`: with rows): its dense push and its rows' push as pushes, its values and its
    /// next rows as pulls; refused, as its pushes refused.
    Step(bool),
    Other,
}

impl RpcKind {
    pub(in crate::service) fn of(msg: &Message) -> Self {
        match msg {
            Message::Push(_) | Message::PushPart(_) | Message::SparsePush(_) => RpcKind::Push,
            Message::PushPull(_) => RpcKind::PushPull,
            Message::Step(s) => RpcKind::Step(s.rows.is_some()),
            Message::Pull(_) | Message::SparsePull(_) => RpcKind::Pull,
            _ => RpcKind::Other,
        }
    }
}

pub(in crate::service) fn record(m: &ShardMetrics, request: RpcKind, reply: &Message) {
    let (acks, pulls) = match (request, reply) {
        (RpcKind::PushPull, Message::PushPullReply(r)) => ([Some(r.ack), None], u64::from(!r.chunks.is_empty())),
        (RpcKind::Step(_), Message::StepReply(r)) => {
            let values = u64::from(!r.push.chunks.is_empty()) + u64::from(r.next_rows.is_some());
            ([Some(r.push.ack), r.rows], values)
        }
        _ => ([None, None], 0),
    };
    if acks[0].is_some() {
        for ack in acks.into_iter().flatten() {
            record(m, RpcKind::Push, &Message::Ack(ack));
        }
        m.pulls.increment(pulls);
        return;
    }
    match (request, reply) {
        (RpcKind::Push, Message::Ack(ack)) if ack.duplicate => m.push_duplicates.increment(1),
        (RpcKind::Push, Message::Ack(ack)) => {
            m.pushes.increment(1);
            m.staleness.record(ack.max_staleness as f64);
        }
        (RpcKind::Push | RpcKind::PushPull, _) => m.push_rejected.increment(1),
        (RpcKind::Step(rows), _) => m.push_rejected.increment(1 + u64::from(rows)),
        (RpcKind::Pull, Message::PullReply(_) | Message::SparsePullReply(_)) => m.pulls.increment(1),
        _ => {}
    }
}
