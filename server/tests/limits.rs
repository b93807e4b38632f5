//! A shard's defences against slow, stalled or too many peers, and the client's total connect timeout, over
//! real QUIC on 127.0.0.1.

use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::{self, Message, Push, PushChunk, Role};
use gaps_kernels::Hyper;
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_transport::net;
use gaps_worker::client::{Client, ClientError, ClientOptions};
use std::time::{Duration, Instant};

async fn shard(certs: &ClusterCerts, max_connections: usize, request_timeout: Duration) -> RunningServer {
    let layout = Layout::new(vec![TensorSpec::new("w", 1 << 16)], 1 << 16).expect("layout");
    let core = ShardConfig {
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.0 },
        epoch: 5,
        ..ShardConfig::new(layout)
    };
    let tls = certs.shard_material(0).expect("tls");
    let cfg = ServiceConfig {
        max_connections,
        request_timeout,
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), tls, core)
    };
    service::start(cfg).await.expect("start shard")
}

async fn raw_connection(certs: &ClusterCerts, server: &RunningServer) -> Result<quinn::Connection, net::RpcError> {
    let tls = certs.worker_material().expect("tls");
    let endpoint = net::client_endpoint(&tls, server.addr)?;
    net::connect(&endpoint, server.addr, Duration::from_secs(3)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_senders_are_cut_off_and_the_shard_keeps_serving() {
    // On d75cfe4 a stream that sent a header and then nothing held the declared payload's allocation forever.
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let server = shard(&certs, 64, Duration::from_millis(300)).await;
    let conn = raw_connection(&certs, &server).await.expect("connect");
    // A header announcing a 256 KiB push, a few payload bytes, then silence.
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    let push = Message::Push(Push::new(
        5,
        0,
        1,
        vec![PushChunk {
            id: gaps_common::ChunkId { tensor: 0, chunk: 0 },
            read_version: 0,
            len: 1 << 16,
            echo: false,
            dtype: gaps_common::dtype::WireDtype::F32,
        }],
    ));
    send.write_all(&wire::encode_header(&push, 1 << 16).expect("header")).await.expect("write");
    send.write_all(&[0u8; 10]).await.expect("write");
    // And a stream that never finishes its header.
    let (mut send2, mut recv2) = conn.open_bi().await.expect("stream");
    send2.write_all(&[4u8, 0]).await.expect("write");
    let started = Instant::now();
    let mut buf = [0u8; 16];
    for recv in [&mut recv, &mut recv2] {
        let outcome = tokio::time::timeout(Duration::from_secs(10), recv.read(&mut buf)).await.expect("the shard acts");
        assert!(outcome.is_err(), "the shard resets a stalled request instead of answering: {outcome:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(server.requests_timed_out(), 2);
    assert_eq!(server.peak_inflight_bytes(), 0, "the stalled payload was never held");
    // The connection and the shard still serve a complete request.
    let pull =
        Message::Pull(gaps_common::wire::Pull { epoch: 5, chunks: vec![gaps_common::ChunkId { tensor: 0, chunk: 0 }] });
    let reply = net::call(&conn, &pull, &[], &wire::Limits::default(), Duration::from_secs(5)).await.expect("pull");
    assert_eq!(reply.payload.len(), 1 << 16);
    drop((send, send2));
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_maximum_are_refused_until_one_closes() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let server = shard(&certs, 1, service::DEFAULT_REQUEST_TIMEOUT).await;
    let first = raw_connection(&certs, &server).await.expect("the first connection is served");
    let second = raw_connection(&certs, &server).await;
    assert!(second.is_err(), "a second connection is refused");
    assert!(server.connections_refused() >= 1);
    first.close(0u32.into(), b"done");
    // The slot frees once the shard sees the close.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if raw_connection(&certs, &server).await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "a connection is served again after the first one closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connect_timeout_bounds_the_whole_wait() {
    // On d75cfe4 `--connect-timeout 2s` against an address where nothing answers gave up after 30 s: every
    // attempt got the full call timeout. A bound UDP socket that never answers is such an address.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let addr = silent.local_addr().expect("addr").to_string();
    let mut opts = ClientOptions::new(addr, certs.worker_material().expect("tls"), Role::Worker, "t");
    opts.connect_timeout = Duration::from_secs(1);
    opts.rpc_timeout = Duration::from_secs(30);
    let started = Instant::now();
    let err = Client::connect(opts).await.expect_err("nobody answers");
    assert!(matches!(err, ClientError::JoinTimeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
}
