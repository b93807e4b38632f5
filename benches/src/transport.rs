//! `gaps bench transport`: push+pull payload throughput of one worker against one and two shards, with a
//! plain quinn bulk transfer of the same bytes over the same kind of connection as the baseline, measured in
//! the same run.
//!
//! - gaps case: one `Client::push` of the whole tensor followed by one `Client::pull` (so 2 × 4 × n payload
//!   bytes cross the wire per round), against in-process shards on 127.0.0.1 (real QUIC, mutual TLS).
//! - baseline: one bidirectional stream per round on one connection with the same TLS and transport
//!   settings; the client writes 4 × n bytes, the server echoes 4 × n bytes back. No framing, no state.
//! - `default_quinn_gbytes_per_s`: the same baseline with quinn's default transport settings, to show what
//!   the tuning buys.

use anyhow::{Context, Result};
use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::Role;
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_shard::{Init, ShardConfig};
use gaps_transport::net;
use gaps_transport::tls::ClusterCerts;
use gaps_worker::client::{Client, ClientOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One measured case.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportResult {
    /// `push_pull_<shards>shard_<size>`.
    pub case: String,
    /// Shards.
    pub shards: u32,
    /// Payload bytes per round (push + pull).
    pub bytes: u64,
    /// Rounds timed.
    pub rounds: u32,
    /// gaps payload throughput, GB/s (10^9 bytes).
    pub gbytes_per_s: f64,
    /// Plain quinn bulk transfer with the same settings, GB/s.
    pub baseline_gbytes_per_s: f64,
    /// Plain quinn bulk transfer with quinn's default transport settings, GB/s.
    pub default_quinn_gbytes_per_s: f64,
}

impl TransportResult {
    /// gaps ÷ baseline.
    pub fn ratio(&self) -> f64 {
        self.gbytes_per_s / self.baseline_gbytes_per_s.max(f64::MIN_POSITIVE)
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "case": self.case,
            "shards": self.shards,
            "bytes": self.bytes,
            "rounds": self.rounds,
            "gbytes_per_s": round3(self.gbytes_per_s),
            "baseline_gbytes_per_s": round3(self.baseline_gbytes_per_s),
            "default_quinn_gbytes_per_s": round3(self.default_quinn_gbytes_per_s),
            "ratio": round3(self.ratio()),
        })
        .to_string()
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Runs every case. `quick` runs one small case with one round (for `cargo bench -- --test`).
pub async fn run(quick: bool, min_time: Duration) -> Result<Vec<TransportResult>> {
    let certs = ClusterCerts::generate(&[]).context("making certificates")?;
    let sizes: &[u64] = if quick { &[1 << 16] } else { &[1 << 20, 16 << 20] };
    let shard_counts: &[u32] = if quick { &[1] } else { &[1, 2] };
    let mut out = Vec::new();
    for &n in sizes {
        let baseline = bulk_baseline(&certs, n * 4, net::transport_config(), quick, min_time).await?;
        let default = bulk_baseline(&certs, n * 4, quinn::TransportConfig::default(), quick, min_time).await?;
        for &shards in shard_counts {
            let (rounds, gbps) = gaps_case(&certs, shards, n, quick, min_time).await?;
            out.push(TransportResult {
                case: format!("push_pull_{shards}shard_{}", size_name(n)),
                shards,
                bytes: 2 * 4 * n,
                rounds,
                gbytes_per_s: gbps,
                baseline_gbytes_per_s: baseline,
                default_quinn_gbytes_per_s: default,
            });
        }
    }
    Ok(out)
}

fn size_name(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{}Mi", n >> 20)
    } else {
        format!("{}Ki", n >> 10)
    }
}

async fn gaps_case(certs: &ClusterCerts, shards: u32, n: u64, quick: bool, min_time: Duration) -> Result<(u32, f64)> {
    let layout = Layout::new(vec![TensorSpec::new("bench", n)], 1 << 18)?;
    let mut servers: Vec<RunningServer> = Vec::new();
    for s in 0..shards {
        let core = ShardConfig {
            shard: s,
            num_shards: shards,
            layout: layout.clone(),
            rule: Rule::Sgd,
            hyper: Hyper { lr: 1e-6, momentum: 0.0, weight_decay: 0.0, ..Hyper::default() },
            init: Init { seed: 1, std: 0.0 },
            lease: Duration::from_secs(60),
            advertise: String::new(),
            epoch: 7,
            threads: 1,
            sparse: gaps_shard::core::SparseSettings::default(),
            modes: gaps_shard::modes::ModeConfig::default(),
        };
        let cfg = ServiceConfig {
            coordinator: servers.first().map(|s0| s0.advertise.clone()),
            join_timeout: Duration::from_secs(10),
            ..ServiceConfig::new("127.0.0.1:0".parse()?, certs.shard_material(core.shard)?, core)
        };
        servers.push(service::start(cfg).await?);
    }
    let opts = ClientOptions::new(&servers[0].advertise, certs.worker_material()?, Role::Worker, "bench");
    let client = Client::connect(opts).await?;
    let grads = vec![vec![1e-3f32; n as usize]];
    let mut snapshot = client.pull().await?;
    // One warm-up round, then time whole rounds until min_time has passed.
    client.push(grads.clone(), &snapshot).await?;
    snapshot = client.pull().await?;
    let started = Instant::now();
    let mut rounds = 0u32;
    while rounds == 0 || (!quick && started.elapsed() < min_time) {
        client.push(grads.clone(), &snapshot).await?;
        snapshot = client.pull().await?;
        rounds += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    client.leave().await?;
    for s in servers {
        s.shutdown().await?;
    }
    Ok((rounds, (2 * 4 * n) as f64 * f64::from(rounds) / secs / 1e9))
}

/// Echo server + client over one connection; returns GB/s of payload (both directions counted).
async fn bulk_baseline(
    certs: &ClusterCerts,
    bytes: u64,
    transport: quinn::TransportConfig,
    quick: bool,
    min_time: Duration,
) -> Result<f64> {
    let transport = Arc::new(transport);
    let server_tls = certs.shard_material(0)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls.server_config()?)?;
    let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_config.transport_config(transport.clone());
    let server = quinn::Endpoint::server(server_config, "127.0.0.1:0".parse()?)?;
    let addr = server.local_addr()?;
    let echo = tokio::spawn(async move {
        let Some(incoming) = server.accept().await else { return };
        let Ok(conn) = incoming.await else { return };
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let Ok(data) = recv.read_to_end(usize::MAX).await else { return };
            if send.write_all(&data).await.is_err() {
                return;
            }
            let _ = send.finish();
        }
    });
    let client_tls = certs.worker_material()?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client_tls.client_config()?)?;
    let mut client_config = quinn::ClientConfig::new(Arc::new(crypto));
    client_config.transport_config(transport);
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(client_config);
    let conn = net::connect(&endpoint, addr, Duration::from_secs(5)).await?;
    let payload = vec![7u8; bytes as usize];
    let round = || async {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&payload).await?;
        send.finish()?;
        let back = recv.read_to_end(usize::MAX).await?;
        anyhow::ensure!(back.len() == payload.len(), "echo returned {} bytes", back.len());
        anyhow::Ok(())
    };
    round().await?;
    let started = Instant::now();
    let mut rounds = 0u32;
    while rounds == 0 || (!quick && started.elapsed() < min_time) {
        round().await?;
        rounds += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    conn.close(0u32.into(), b"done");
    echo.abort();
    Ok((2 * bytes) as f64 * f64::from(rounds) / secs / 1e9)
}

/// Prints the table (stderr) and one JSON line per case (stdout when `json`).
pub fn print(results: &[TransportResult], json: bool) {
    eprintln!(
        "{:<26} {:>12} {:>7} {:>10} {:>12} {:>14} {:>7}",
        "case", "bytes/round", "rounds", "gaps GB/s", "quinn GB/s", "default GB/s", "ratio"
    );
    for r in results {
        eprintln!(
            "{:<26} {:>12} {:>7} {:>10.3} {:>12.3} {:>14.3} {:>7.2}",
            r.case,
            r.bytes,
            r.rounds,
            r.gbytes_per_s,
            r.baseline_gbytes_per_s,
            r.default_quinn_gbytes_per_s,
            r.ratio()
        );
    }
    if json {
        for r in results {
            println!("{}", r.to_json());
        }
    }
}
