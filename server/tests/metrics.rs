//! `/metrics` serves Prometheus text with the shard's counters and explicit histogram buckets. Its own test
//! binary, because the recorder is process-global.

use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::Role;
use gaps_kernels::Rule;
use gaps_server::service::{self, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_worker::client::{Client, ClientOptions};
use std::io::{Read, Write};
use std::time::Duration;

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    http(addr, "GET", path)
}

/// One request over a plain TCP socket, written by hand (an independent HTTP client).
fn http(addr: std::net::SocketAddr, method: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("write");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_exports_pushes_pulls_bytes_latency_staleness_and_live_workers() {
    let handle = gaps_server::metrics::install_recorder().expect("recorder");
    let health = std::sync::Arc::new(gaps_server::metrics::Health::default());
    let (metrics_addr, _task) =
        gaps_server::metrics::serve("127.0.0.1:0".parse().expect("addr"), handle, health.clone()).await.expect("serve");
    let get = |path: &'static str| tokio::task::spawn_blocking(move || http_get(metrics_addr, path));
    // Before the shard serves: alive, not ready (with what it is doing).
    let (alive, ready) = (get("/healthz").await.expect("join"), get("/readyz").await.expect("join"));
    assert!(alive.starts_with("HTTP/1.1 200") && alive.contains("alive, starting"), "{alive}");
    assert!(ready.starts_with("HTTP/1.1 503") && ready.contains("not ready"), "{ready}");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 100)], 32, vec![gaps_common::layout::SparseSpec::new("emb", 4)])
            .expect("layout");
    let cfg = ServiceConfig {
        join_timeout: Duration::from_secs(5),
        tick_interval: Duration::from_millis(50),
        ..ServiceConfig::new(
            "127.0.0.1:0".parse().expect("addr"),
            certs.shard_material(0).expect("tls"),
            ShardConfig {
                rule: Rule::Momentum,
                init: Init { seed: 1, std: 0.0 },
                epoch: 5,
                ..ShardConfig::new(layout)
            },
        )
    };
    let cfg = ServiceConfig { health: Some(health.clone()), ..cfg };
    let server = service::start(cfg).await.expect("start");
    // Serving: ready, and alive because the core answers.
    let (alive, ready) = (get("/healthz").await.expect("join"), get("/readyz").await.expect("join"));
    assert!(alive.starts_with("HTTP/1.1 200") && alive.ends_with("ok\n"), "{alive}");
    assert!(ready.starts_with("HTTP/1.1 200") && ready.ends_with("ready\n"), "{ready}");
    let client = Client::connect(ClientOptions::new(
        &server.advertise,
        certs.worker_material().expect("tls"),
        Role::Worker,
        "m",
    ))
    .await
    .expect("connect");
    for _ in 0..3 {
        let snap = client.pull().await.expect("pull");
        client.push(vec![vec![0.5; 100]], &snap).await.expect("push");
    }
    // Sparse requests count as pushes and pulls too.
    let rows = client.pull_sparse(0, &[7, 9], true).await.expect("sparse pull");
    client.push_sparse(0, &rows, &[0.1; 8]).await.expect("sparse push");
    let needles = [
        "gaps_pushes_applied_total{shard=\"0\"} 4",
        "gaps_pulls_total{shard=\"0\"} 4",
        "gaps_bytes_in_total",
        "gaps_bytes_out_total",
        "gaps_live_workers{shard=\"0\"} 1",
        "gaps_table_rows{shard=\"0\"} 2",
        "gaps_staleness_updates_bucket{shard=\"0\",le=\"0\"} 4",
        "gaps_rpc_seconds_bucket{shard=\"0\",kind=\"push\",le=\"0.001\"}",
        "gaps_mode{shard=\"0\"} 0",
        "gaps_mode_switches_total{shard=\"0\"} 0",
        "gaps_lr_multiplier{shard=\"0\"} 1",
    ];
    // The counters are recorded as the replies go out; the machine's load decides when, so the test reads the
    // endpoint until every one shows (bounded) instead of sleeping a fixed time. (What each reply counts is
    // checked with no server and no clock in server/src/service/rpc/tests.rs.)
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let body = loop {
        let body = tokio::task::spawn_blocking(move || http_get(metrics_addr, "/metrics")).await.expect("join");
        if needles.iter().all(|n| body.contains(n)) || std::time::Instant::now() >= deadline {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    for needle in needles {
        assert!(body.contains(needle), "missing {needle:?} in:\n{body}");
    }
    let missing = tokio::task::spawn_blocking(move || http_get(metrics_addr, "/other")).await.expect("join");
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    let post = tokio::task::spawn_blocking(move || http(metrics_addr, "POST", "/metrics")).await.expect("join");
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    // Garbage instead of a request head is answered or closed, and the endpoint keeps serving.
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(metrics_addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let _ = s.write_all(b"\x00\x01 not http at all\r\n\r\n");
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    })
    .await
    .expect("join");
    let again = tokio::task::spawn_blocking(move || http_get(metrics_addr, "/metrics")).await.expect("join");
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    client.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
    // Stopped: neither alive nor ready, so a cluster manager replaces it.
    let (alive, ready) = (get("/healthz").await.expect("join"), get("/readyz").await.expect("join"));
    assert!(alive.starts_with("HTTP/1.1 503") && alive.contains("stopping"), "{alive}");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
}
