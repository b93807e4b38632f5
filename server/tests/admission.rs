//! An authenticated peer may still be hostile: requests that declare much and send little must not hold the
//! shard's in-flight memory, a stalled sender is cut off, and when the budget is truly taken a request is
//! answered busy (and sent again by the client) instead of waiting without end. The attacker here is a raw
//! QUIC client writing frame bytes by hand from the wire format (`common/src/wire/`: a kind byte, the
//! header's length as u32 LE, a bincode-2 varint header, then the payload), not the project's client.

mod common;

use gaps_common::wire::{self, ErrorCode, Limits, Message, Role};
use gaps_kernels::Hyper;
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_transport::net;
use gaps_worker::client::{Client, ClientOptions};
use std::time::{Duration, Instant};

/// Kind bytes of the wire format.
const KIND_PUSH: u8 = 6;
const KIND_SPARSE_PULL: u8 = 14;

fn config(certs: &ClusterCerts, inflight: u64, stall: Duration, budget_wait: Duration) -> ServiceConfig {
    let layout = common::weights_bias_table(20_000, 8, 4096, 16);
    let core = ShardConfig {
        hyper: Hyper { lr: 0.01, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 3, std: 0.1 },
        lease: Duration::from_secs(30),
        epoch: 7,
        ..ShardConfig::new(layout)
    };
    ServiceConfig {
        inflight_bytes: inflight,
        stall_timeout: stall,
        budget_wait,
        // Long enough that only the stall limit or the budget wait can end an attacker's stream here.
        request_timeout: Duration::from_secs(600),
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(0).expect("tls"), core)
    }
}

/// A SparsePull of 2^20 ids of table 0, creating rows, written by hand: epoch 7 (1 byte), table 0 (1 byte),
/// count 1,048,576 (varint marker 252, then u32 LE), create true.
fn sparse_pull_header_bytes() -> Vec<u8> {
    let header = [7u8, 0, 252, 0x00, 0x00, 0x10, 0x00, 1];
    let mut frame = vec![KIND_SPARSE_PULL];
    frame.extend_from_slice(&(header.len() as u32).to_le_bytes());
    frame.extend_from_slice(&header);
    frame
}

async fn attacker(certs: &ClusterCerts, server: &RunningServer) -> (quinn::Endpoint, quinn::Connection) {
    let tls = certs.worker_material().expect("tls");
    let endpoint = net::client_endpoint(&tls, server.addr).expect("endpoint");
    let conn = net::connect(&endpoint, server.addr, Duration::from_secs(5)).await.expect("connect");
    (endpoint, conn)
}

fn worker_options(certs: &ClusterCerts, server: &RunningServer) -> ClientOptions {
    common::options(certs, &server.advertise, Role::Worker, "honest", Duration::from_secs(20))
}

#[test]
fn the_hand_written_sparse_pull_is_what_the_wire_format_says() {
    let bytes = sparse_pull_header_bytes();
    let prefix: [u8; wire::FRAME_PREFIX_LEN] = bytes[..wire::FRAME_PREFIX_LEN].try_into().expect("prefix");
    let (kind, len) = wire::parse_prefix(&prefix, &Limits::default()).expect("prefix");
    match wire::decode_header(kind, &bytes[wire::FRAME_PREFIX_LEN..][..len], &Limits::default()).expect("header") {
        Message::SparsePull(p) => {
            assert_eq!((p.epoch, p.table, p.count, p.create), (7, 0, 1 << 20, true));
        }
        other => panic!("decoded as {other:?}"),
    }
}

/// Two header-only SparsePulls that declare 2^20 ids (8 MiB of ids, a 68 MiB reply) each, on a shard whose
/// whole in-flight budget is 96 MiB: before admission followed the bytes, they reserved 152 MiB between
/// them and a worker's pushes waited behind them for the request timeout. Now they hold nothing, the
/// worker trains on, and the stall limit cuts them off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_only_requests_that_declare_hundreds_of_megabytes_hold_nothing_and_are_cut_off() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let server =
        service::start(config(&certs, 96 << 20, Duration::from_secs(3), Duration::from_secs(2))).await.expect("start");
    let (_endpoint, conn) = attacker(&certs, &server).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let (mut send, recv) = conn.open_bi().await.expect("stream");
        send.write_all(&sparse_pull_header_bytes()).await.expect("write the header");
        held.push((send, recv));
    }
    let worker = Client::connect(worker_options(&certs, &server)).await.expect("connect");
    let mut longest = Duration::ZERO;
    let mut last = Instant::now();
    for step in 0..30 {
        let snapshot = worker.pull().await.expect("pull beside the attack");
        let grads = snapshot.tensors.iter().map(|t| vec![0.01 * (step % 3) as f32; t.len()]).collect();
        worker.push(grads, &snapshot).await.expect("push beside the attack");
        longest = longest.max(last.elapsed());
        last = Instant::now();
    }
    eprintln!("longest gap between acknowledged pushes beside two 76 MiB header-only requests: {longest:?}");
    assert!(
        server.peak_inflight_bytes() < 16 << 20,
        "the shard held {} bytes at most: the declared sizes were reserved",
        server.peak_inflight_bytes()
    );
    // The attacker's streams are cut off by the stall limit: its reads end in a reset, not a reply.
    for (_send, mut recv) in held {
        let mut buf = [0u8; 16];
        let ended = tokio::time::timeout(Duration::from_secs(60), recv.read(&mut buf)).await.expect("cut off in time");
        assert!(ended.is_err(), "a stalled request gets no reply: {ended:?}");
    }
    assert!(server.requests_timed_out() >= 2, "both stalled requests were counted");
    worker.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
}

/// A Push header declaring the whole dense model (20,008 floats), then one payload byte: this holds the first
/// admission of its payload.
fn push_started_bytes(worker: u32) -> Vec<u8> {
    let chunk = |tensor, chunk, len| wire::PushChunk::f32(gaps_common::layout::ChunkId { tensor, chunk }, 0, len);
    let mut chunks: Vec<_> = (0..5).map(|c| chunk(0, c, if c < 4 { 4096 } else { 3616 })).collect();
    chunks.push(chunk(1, 0, 8));
    let push = wire::Push { decisions: wire::ModeDecisions::default(), ..wire::Push::new(7, worker, 1, chunks) };
    let mut bytes = wire::encode_header(&Message::Push(push), 20_008).expect("header");
    assert_eq!(bytes[0], KIND_PUSH);
    bytes.push(0);
    bytes
}

/// Four connections each start a push and stall after its first byte, taking the whole (small) budget.
/// A worker's request is answered busy within the budget wait instead of waiting behind them; the worker's
/// client sends it again, and once the stall limit has cut the attackers off, it goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_budget_answers_busy_and_the_client_sends_again_once_stalled_senders_are_cut_off() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    // 320 KiB in all, 80 KiB per connection: each stalled push holds its connection's share.
    let server = service::start(config(&certs, 320 << 10, Duration::from_secs(3), Duration::from_millis(300)))
        .await
        .expect("start");
    let worker = Client::connect(worker_options(&certs, &server)).await.expect("connect");
    let snapshot = worker.pull().await.expect("pull");
    let mut attackers = Vec::new();
    for a in 0..4 {
        let (endpoint, conn) = attacker(&certs, &server).await;
        let (mut send, recv) = conn.open_bi().await.expect("stream");
        send.write_all(&push_started_bytes(1000 + a)).await.expect("write");
        attackers.push((endpoint, conn, send, recv));
    }
    // A raw request now, from a fifth connection, is refused as busy with the reason.
    let (_e, conn) = attacker(&certs, &server).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let refusal = loop {
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        let _ = send.write_all(&push_started_bytes(2000)).await;
        let _ = send.write_all(&[0u8; 80_031]).await;
        let _ = send.finish();
        let reply = net::read_frame(&mut recv, &Limits::default()).await.expect("an answer");
        match reply.msg {
            Message::Error(e) if e.code == ErrorCode::Busy => break e,
            // Until every attacker's first byte has been admitted the request may get further (and be
            // refused for its unknown worker); try again.
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("expected a busy refusal, got {other:?}"),
        }
    };
    assert!(refusal.message.contains("no room"), "{}", refusal.message);
    assert!(server.requests_busy() >= 1);
    // The worker's push is refused busy too, sent again, and applied once the attackers are cut off.
    let grads = snapshot.tensors.iter().map(|t| vec![0.5; t.len()]).collect();
    worker.push(grads, &snapshot).await.expect("the push goes through after busy answers");
    let after = worker.pull().await.expect("pull");
    assert_ne!(after.tensors[0][0], snapshot.tensors[0][0], "the push was applied");
    assert!(server.requests_timed_out() >= 1, "room was made by cutting off stalled pushes");
    worker.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
}
