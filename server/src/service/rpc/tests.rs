//! What each reply counts in a shard's metrics, with no server and no clock: the counters `/metrics` shows
//! are read from a recorder of the test's own once the replies are recorded (the end-to-end test in
//! `server/tests/metrics.rs` checks the endpoint's wiring on a real service).

use super::*;
use gaps_common::dtype::WireDtype;
use gaps_common::layout::ChunkId;
use gaps_common::wire::{Ack, ChunkVersion, ErrorCode, PullReply, PushPullReply, SparsePullReply, StepReply};
use metrics_exporter_prometheus::PrometheusBuilder;

#[test]
fn replies_count_as_pushes_duplicates_refusals_and_pulls() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let chunk = ChunkVersion { id: ChunkId { tensor: 0, chunk: 0 }, version: 3, len: 4, dtype: WireDtype::F32 };
    metrics::with_local_recorder(&recorder, || {
        let m = ShardMetrics::register(3);
        let applied = Ack { seq: 1, max_staleness: 2, ..Ack::default() };
        record(&m, RpcKind::Push, &Message::Ack(applied));
        record(&m, RpcKind::Push, &Message::Ack(Ack { seq: 1, duplicate: true, ..Ack::default() }));
        record(&m, RpcKind::Push, &Message::error(ErrorCode::Malformed, "bad"));
        record(&m, RpcKind::PushPull, &Message::error(ErrorCode::StaleEpoch, "old"));
        // A push answered with values counts as a push and a pull; one asked to wait for its step, as a push.
        let with_values = PushPullReply { ack: Ack { seq: 2, ..Ack::default() }, chunks: vec![chunk] };
        record(&m, RpcKind::PushPull, &Message::PushPullReply(with_values));
        let waits = PushPullReply { ack: Ack { seq: 3, wait_for_step: 5, ..Ack::default() }, chunks: Vec::new() };
        record(&m, RpcKind::PushPull, &Message::PushPullReply(waits));
        record(&m, RpcKind::Pull, &Message::PullReply(PullReply { chunks: vec![chunk] }));
        record(&m, RpcKind::Pull, &Message::error(ErrorCode::Malformed, "a refused pull counts nothing"));
        record(&m, RpcKind::Other, &Message::Ack(applied));
        // A step: its rows' push and its dense push, its values and its next rows; refused, its two pushes.
        let step = StepReply {
            rows: Some(Ack { seq: 4, ..Ack::default() }),
            push: PushPullReply { ack: Ack { seq: 5, ..Ack::default() }, chunks: vec![chunk] },
            next_rows: Some(SparsePullReply { table: 0, count: 1, dim: 4 }),
        };
        record(&m, RpcKind::Step(true), &Message::StepReply(step));
        record(&m, RpcKind::Step(true), &Message::error(ErrorCode::ReadAhead, "read ahead"));
        record(&m, RpcKind::Step(false), &Message::error(ErrorCode::StaleEpoch, "old"));
    });
    let text = handle.render();
    for line in [
        "gaps_pushes_applied_total{shard=\"3\"} 5",
        "gaps_push_duplicates_total{shard=\"3\"} 1",
        "gaps_push_rejected_total{shard=\"3\"} 5",
        "gaps_pulls_total{shard=\"3\"} 4",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }
}
