//! `gaps bench transport`: push+pull payload throughput of one worker against one and two shards, dense and
//! sparse, beside three baselines that move the same bytes, all measured in the same run, with the process's
//! CPU time per GB of payload for every case.
//!
//! - gaps dense case: one `Client::push_pull` of the whole tensor: the gradient pushed, the new parameters
//!   answered with the ack (so 2 × 4 × n payload bytes cross the wire per round), against in-process shards
//!   on 127.0.0.1 (real QUIC, mutual TLS); with `separate`, one `Client::push` then one `Client::pull`.
//! - gaps sparse case: one `Client::pull_sparse` of 4,096 random ids of a table of dim 16, then one
//!   `Client::push_sparse` of their gradients (payload: the rows pulled plus the gradients pushed); the
//!   sparse step case moves the same rows as `gaps-worker` does, one `Client::step` a round (the rows'
//!   gradients, a small dense push-pull and the next batch's rows: one request per shard). With the shards
//!   in the bench's process their table (10 M rows by default) is measured as a shard runs it minutes after
//!   it grew: the kernel is asked to merge the process's memory advised for huge pages (the table's arrays)
//!   onto huge pages before the clock starts (`buffers::collapse_advised_memory`); shard processes
//!   (`--processes`) are measured as just grown.
//! - quinn baseline: one bidirectional stream per round on one connection with the same TLS and transport
//!   settings; the client writes the bytes of one direction, the server echoes them back. No framing, no
//!   state. `default_quinn_gbytes_per_s` is the same with quinn's default transport settings.
//! - TCP baseline: the same echo over one loopback TCP connection (Nagle off), no encryption — what ps-lite's
//!   ZeroMQ transport amounts to.
//! - TCP + TLS baseline: the same echo over TCP with TLS 1.3 (rustls, ring, the same certificates and
//!   cipher suites as the QUIC connections).
//!
//! CPU time is the whole process's user + system time from `getrusage` (both ends run in this process),
//! divided by the payload moved. With `processes`, gaps' shards run as `gaps server` processes instead (as a
//! deployment runs them) and their CPU time, read from `/proc`, is counted too.

use crate::shards::Shards;
use anyhow::{Context, Result};
use gaps_common::dtype::WireDtype;
use gaps_common::layout::{Layout, SparseSpec, TensorSpec};
use gaps_common::wire::Role;
use gaps_setup::certs::ClusterCerts;
use gaps_transport::net;
use gaps_worker::client::{Client, ClientOptions};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a bench run is set up.
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// One small round per case (for `cargo bench -- --test`).
    pub quick: bool,
    /// Time each measurement at least this long.
    pub min_time: Duration,
    /// Run only the cases whose name contains this, or only the case named exactly this.
    pub only: Option<String>,
    /// Rows in the sparse case's table (10 M unless quick).
    pub sparse_rows: u64,
    /// Measurements of every case, alternating gaps and its baselines; the medians are reported.
    pub repeats: u32,
    /// Time gaps alone, without the baselines (for profiling one case; ratios print as 0).
    pub gaps_only: bool,
    /// Connections per shard that the gaps client stripes large transfers over (`ClientOptions::lanes`).
    pub lanes: usize,
    /// Dense rounds as `Client::push` then `Client::pull` (two requests per shard) instead of one
    /// `Client::push_pull`.
    pub separate: bool,
    /// Dense sizes in floats (1,000, 1 Mi and 16 Mi unless set; 64 Ki when quick); the bulk ones (64 Ki
    /// and more) also run with bfloat16 on the wire.
    pub floats: Option<Vec<u64>>,
    /// Busy processes run beside every case ([`crate::hog::CpuHog`]): the cases on a loaded machine.
    pub hog: usize,
    /// gaps' shards as `gaps server` processes rather than in the bench's process ([`Shards`]); the cases
    /// with copies (`_r2`) are left out.
    pub processes: bool,
    /// With `processes`: the shard processes' `--io-threads` (0: a shard's automatic count).
    pub shard_io_threads: u32,
}

impl TransportOptions {
    /// Every case, `min_time` each.
    pub fn new(quick: bool, min_time: Duration) -> Self {
        TransportOptions {
            quick,
            min_time,
            only: None,
            sparse_rows: if quick { 20_000 } else { 10_000_000 },
            repeats: if quick { 1 } else { 3 },
            gaps_only: false,
            lanes: gaps_worker::client::DEFAULT_LANES,
            floats: None,
            separate: false,
            hog: 0,
            processes: false,
            shard_io_threads: 0,
        }
    }
}

/// Throughput and CPU cost of one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Measured {
    /// Rounds timed.
    pub rounds: u32,
    /// Payload GB/s (10^9 bytes, both directions counted).
    pub gbytes_per_s: f64,
    /// Process CPU seconds (user + system, all threads) per GB of payload.
    pub cpu_s_per_gb: f64,
}

/// One measured case.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportResult {
    /// `push_pull_<shards>shard_<size>` or `sparse_<shards>shard_<rows>x<dim>`.
    pub case: String,
    /// Shards.
    pub shards: u32,
    /// Payload bytes per round (push + pull).
    pub bytes: u64,
    /// Embedding rows pulled (and pushed) per round, for the sparse cases.
    pub rows: Option<u64>,
    /// Dense values pushed (and pulled) per round, and their wire format, for the dense cases.
    pub floats: Option<(u64, WireDtype)>,
    /// gaps.
    pub gaps: Measured,
    /// Plain quinn echo with the same settings.
    pub quinn: Measured,
    /// Plain quinn echo with quinn's default transport settings.
    pub quinn_default: Measured,
    /// Plain TCP echo.
    pub tcp: Measured,
    /// TCP + TLS 1.3 echo.
    pub tcp_tls: Measured,
    /// Busy processes that ran beside it (`--hog`).
    pub hog: usize,
    /// The shards ran as processes of their own (`--processes`).
    pub processes: bool,
    /// Sparse cases with the shards in the bench's process: MB of the process's memory advised for huge
    /// pages (the table's arrays) that the kernel merged onto them before the clock started — the table as
    /// a shard holds it minutes after it grew; None where nothing was merged (dense cases, shard processes).
    pub merged_mb: Option<u64>,
}

impl TransportResult {
    /// gaps ÷ quinn echo (0 when the baseline was not measured).
    pub fn ratio(&self) -> f64 {
        ratio_to(self.gaps.gbytes_per_s, self.quinn.gbytes_per_s)
    }

    /// gaps ÷ TCP + TLS echo (0 when the baseline was not measured).
    pub fn ratio_tcp_tls(&self) -> f64 {
        ratio_to(self.gaps.gbytes_per_s, self.tcp_tls.gbytes_per_s)
    }

    /// Milliseconds per round of `m` (the latency of one push+pull, or one echo of the same bytes).
    pub fn ms_per_round(&self, m: &Measured) -> f64 {
        self.bytes as f64 / (m.gbytes_per_s * 1e9).max(f64::MIN_POSITIVE) * 1e3
    }

    /// Rows per second (pull and push each count once per row), for sparse cases.
    pub fn rows_per_s(&self) -> Option<f64> {
        self.rows.map(|r| r as f64 * self.gaps.gbytes_per_s * 1e9 / self.bytes as f64)
    }

    /// Nanoseconds a row (pulled and pushed, as [`Self::rows_per_s`] counts it) at `m`'s rate: gaps' own, or
    /// the time an echo takes for a row's bytes. For sparse cases, and None where `m` was not measured.
    pub fn ns_per_row(&self, m: &Measured) -> Option<f64> {
        let rows = self.rows.filter(|_| m.gbytes_per_s > 0.0)?;
        Some(self.ms_per_round(m) * 1e6 / rows as f64)
    }

    /// Dense values moved per second each way (a push and a pull of `n` values count `n`), for dense cases.
    pub fn floats_per_s(&self) -> Option<f64> {
        self.floats.map(|(n, _)| n as f64 * self.gaps.gbytes_per_s * 1e9 / self.bytes as f64)
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        /// The JSON line (rounded as printed).
        #[derive(serde::Serialize)]
        struct Line<'a> {
            case: &'a str,
            shards: u32,
            bytes: u64,
            rows: Option<u64>,
            rows_per_s: Option<f64>,
            ns_per_row: Option<f64>,
            tcp_tls_ns_per_row: Option<f64>,
            wire_dtype: Option<&'static str>,
            floats_per_s: Option<f64>,
            rounds: u32,
            ms_per_round: f64,
            tcp_tls_ms_per_round: f64,
            gbytes_per_s: f64,
            cpu_s_per_gb: f64,
            baseline_gbytes_per_s: f64,
            baseline_cpu_s_per_gb: f64,
            default_quinn_gbytes_per_s: f64,
            tcp_gbytes_per_s: f64,
            tcp_cpu_s_per_gb: f64,
            tcp_tls_gbytes_per_s: f64,
            tcp_tls_cpu_s_per_gb: f64,
            ratio: f64,
            ratio_tcp_tls: f64,
            hog: usize,
            /// Only with `--processes`: the lines of a default run keep their shape.
            #[serde(skip_serializing_if = "std::ops::Not::not")]
            processes: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            table_merged_mb: Option<u64>,
        }
        crate::json_line(&Line {
            hog: self.hog,
            processes: self.processes,
            table_merged_mb: self.merged_mb,
            case: &self.case,
            shards: self.shards,
            bytes: self.bytes,
            rows: self.rows,
            rows_per_s: self.rows_per_s().map(|r| r.round()),
            ns_per_row: self.ns_per_row(&self.gaps).map(round3),
            tcp_tls_ns_per_row: self.ns_per_row(&self.tcp_tls).map(round3),
            wire_dtype: self.floats.map(|(_, d)| d.name()),
            floats_per_s: self.floats_per_s().map(|f| f.round()),
            rounds: self.gaps.rounds,
            ms_per_round: round3(self.ms_per_round(&self.gaps)),
            tcp_tls_ms_per_round: round3(self.ms_per_round(&self.tcp_tls)),
            gbytes_per_s: round3(self.gaps.gbytes_per_s),
            cpu_s_per_gb: round3(self.gaps.cpu_s_per_gb),
            baseline_gbytes_per_s: round3(self.quinn.gbytes_per_s),
            baseline_cpu_s_per_gb: round3(self.quinn.cpu_s_per_gb),
            default_quinn_gbytes_per_s: round3(self.quinn_default.gbytes_per_s),
            tcp_gbytes_per_s: round3(self.tcp.gbytes_per_s),
            tcp_cpu_s_per_gb: round3(self.tcp.cpu_s_per_gb),
            tcp_tls_gbytes_per_s: round3(self.tcp_tls.gbytes_per_s),
            tcp_tls_cpu_s_per_gb: round3(self.tcp_tls.cpu_s_per_gb),
            ratio: round3(self.ratio()),
            ratio_tcp_tls: round3(self.ratio_tcp_tls()),
        })
    }
}

fn ratio_to(x: f64, baseline: f64) -> f64 {
    if baseline > 0.0 {
        x / baseline
    } else {
        0.0
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// User + system CPU seconds of this process so far (every thread).
#[allow(unsafe_code)]
pub fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass; all-zero bytes are a valid `rusage`.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a pointer to a live, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Times `round` (which moves `bytes` of payload) after one warm-up round, until `opts.min_time` has passed
/// (once when quick). The CPU it took is this process's and that of `shards` when they run as processes.
async fn measure<F, Fut>(bytes: u64, opts: &TransportOptions, shards: Option<&Shards>, mut round: F) -> Result<Measured>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let (quick, min_time) = (opts.quick, opts.min_time);
    let cpu_now = || process_cpu_seconds() + shards.map_or(0.0, Shards::outside_cpu_seconds);
    round().await?;
    let cpu0 = cpu_now();
    let started = Instant::now();
    let mut rounds = 0u32;
    while rounds == 0 || (!quick && started.elapsed() < min_time) {
        round().await?;
        rounds += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_now() - cpu0;
    let gb = bytes as f64 * f64::from(rounds) / 1e9;
    Ok(Measured { rounds, gbytes_per_s: gb / secs, cpu_s_per_gb: cpu / gb })
}

/// Runs every case (those matching `opts.only`).
pub async fn run(opts: &TransportOptions) -> Result<Vec<TransportResult>> {
    let certs = ClusterCerts::generate(&[]).context("making certificates")?;
    // Every measurement — gaps and its baselines alike — runs beside the hog, which stops when this returns.
    let _hog = crate::hog::CpuHog::start(opts.hog).context("starting the CPU hog's processes")?;
    // 1,000 floats: the latency of a small round trip; 1 Mi and 16 Mi: bulk throughput.
    let standard: &[u64] = if opts.quick { &[1 << 16] } else { &[1000, 1 << 20, 16 << 20] };
    let sizes = opts.floats.as_deref().unwrap_or(standard);
    let shard_counts: &[u32] = if opts.quick { &[1] } else { &[1, 2] };
    let mut out = Vec::new();
    // (name, shards, copies of each shard, sparse rows, dense floats, wire format)
    let mut cases: Vec<(String, u32, u32, Option<u64>, u64, WireDtype)> = Vec::new();
    // The sparse cases: rows pulled then pushed, two requests a round; and the same rows as a worker's
    // steps carry them, one request a round per shard.
    for &n in sizes {
        for &shards in shard_counts {
            cases.push((format!("push_pull_{shards}shard_{}", size_name(n)), shards, 1, None, n, WireDtype::F32));
        }
        // With two copies of each shard (`--replicas 2`): what the copies cost a push-pull.
        if let Some(&shards) = shard_counts.iter().find(|s| **s >= 2).filter(|_| !opts.processes) {
            let case = format!("push_pull_{shards}shard_{}_r2", size_name(n));
            cases.push((case, shards, 2, None, n, WireDtype::F32));
        }
    }
    // The same bulk cases with bfloat16 on the wire (half the bytes per value).
    for &n in sizes.iter().filter(|n| **n >= 1 << 16) {
        for &shards in shard_counts {
            let case = format!("push_pull_{shards}shard_{}_bf16", size_name(n));
            cases.push((case, shards, 1, None, n, WireDtype::Bf16));
        }
    }
    for kind in ["sparse", "sparse_step"] {
        for &shards in shard_counts {
            let case = format!("{kind}_{shards}shard_{SPARSE_ROWS}x{SPARSE_DIM}");
            cases.push((case, shards, 1, Some(SPARSE_ROWS), 0, WireDtype::F32));
        }
    }
    // A case named exactly by `only` runs alone; otherwise every case whose name contains it.
    let exact = cases.iter().any(|c| opts.only.as_deref() == Some(c.0.as_str()));
    let wanted = |case: &str| match opts.only.as_deref() {
        None => true,
        Some(o) if exact => case == o,
        Some(o) => case.contains(o),
    };
    for (case, shards, replicas, rows, n, dtype) in cases {
        if !wanted(&case) {
            continue;
        }
        let bytes = match rows {
            Some(r) => 2 * 4 * r * u64::from(SPARSE_DIM),
            None => 2 * dtype.bytes() as u64 * n,
        };
        // Alternate gaps and its baselines so that a machine whose speed drifts moves both.
        let mut runs: Vec<[Measured; 5]> = Vec::new();
        let mut merged_mb = None;
        for _ in 0..opts.repeats.max(1) {
            let gaps = match rows {
                Some(_) => {
                    let (measured, merged) = sparse_case(&certs, shards, case.starts_with("sparse_step"), opts).await?;
                    merged_mb = merged.map(|b| (b >> 20) as u64).filter(|mb| *mb > 0);
                    measured
                }
                None => dense_case(&certs, shards, replicas, n, dtype, opts).await?,
            };
            let [quinn, default, tcp, tls] =
                if opts.gaps_only { [Measured::default(); 4] } else { baselines_for(&certs, bytes / 2, opts).await? };
            runs.push([gaps, quinn, default, tcp, tls]);
        }
        let m = |i: usize| median_of(runs.iter().map(|r| r[i]).collect());
        out.push(TransportResult {
            case,
            shards,
            bytes,
            rows,
            floats: rows.is_none().then_some((n, dtype)),
            gaps: m(0),
            quinn: m(1),
            quinn_default: m(2),
            tcp: m(3),
            tcp_tls: m(4),
            hog: opts.hog,
            processes: opts.processes,
            merged_mb,
        });
    }
    Ok(out)
}

/// The median throughput and the median CPU cost (each on its own) of several measurements; rounds add up.
fn median_of(mut runs: Vec<Measured>) -> Measured {
    let rounds = runs.iter().map(|r| r.rounds).sum();
    let rates: Vec<f64> = runs.iter().map(|r| r.gbytes_per_s).collect();
    let cpu: Vec<f64> = runs.drain(..).map(|r| r.cpu_s_per_gb).collect();
    Measured { rounds, gbytes_per_s: crate::median(rates), cpu_s_per_gb: crate::median(cpu) }
}

/// Batches of ids a sparse case goes through in turn (see [`id_batches`]).
const SPARSE_BATCHES: usize = 256;

/// `batches` batches of [`SPARSE_ROWS`] distinct random ids each of a table holding the ids `scatter(0..rows)`
/// (xorshift; an id drawn twice in a batch is drawn again, so every round moves [`SPARSE_ROWS`] rows).
fn id_batches(rows: u64, batches: usize) -> Vec<Vec<u64>> {
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut seen = std::collections::HashSet::with_capacity(SPARSE_ROWS as usize);
    (0..batches)
        .map(|_| {
            seen.clear();
            let mut ids = Vec::with_capacity(SPARSE_ROWS as usize);
            while ids.len() < SPARSE_ROWS as usize {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let i = rng % rows;
                if seen.insert(i) {
                    ids.push(scatter(i));
                }
            }
            ids
        })
        .collect()
}

/// The sparse cases' ids: `0..rows` scattered over u64 by a fixed odd multiplier.
fn scatter(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Rows per sparse round and their dimension.
pub const SPARSE_ROWS: u64 = 4096;
/// See [`SPARSE_ROWS`].
pub const SPARSE_DIM: u32 = 16;

async fn baselines_for(certs: &ClusterCerts, one_way: u64, opts: &TransportOptions) -> Result<[Measured; 4]> {
    let loopback = net::PathTuning::toward("127.0.0.1:1".parse()?);
    let quinn = quinn_echo(certs, one_way, &loopback, loopback.transport_config(), opts).await?;
    let untuned = net::PathTuning::ethernet("quinn defaults");
    let default = quinn_echo(certs, one_way, &untuned, quinn::TransportConfig::default(), opts).await?;
    let tcp = tcp_echo(certs, one_way, false, opts).await?;
    let tls = tcp_echo(certs, one_way, true, opts).await?;
    Ok([quinn, default, tcp, tls])
}

fn size_name(n: u64) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}Mi", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}Ki", n >> 10)
    } else {
        n.to_string()
    }
}

/// Leaves the cluster and shuts its shards down.
async fn stop(client: Client, shards: Shards) -> Result<()> {
    client.leave().await?;
    shards.stop().await
}

async fn dense_case(
    certs: &ClusterCerts,
    shards: u32,
    replicas: u32,
    n: u64,
    dtype: WireDtype,
    opts: &TransportOptions,
) -> Result<Measured> {
    let mut spec = TensorSpec::new("bench", n);
    spec.wire_dtype = Some(dtype);
    // Chunks of 256 Ki floats, or fewer floats so that every shard holds a part of the tensor: the 2-shard
    // 1,000-float case splits its floats 500 and 500, two exchanges side by side as ps-lite's servers each
    // take their key range (until 2026-11-29 all 1,000 lived on one shard and the other got an empty push).
    let chunk = (1u64 << 18).min(n.div_ceil(u64::from(shards.max(1))));
    let layout = Layout::new(vec![spec], u32::try_from(chunk)?)?;
    let servers =
        Shards::start(certs, shards, replicas, &layout, opts.processes.then_some(opts.shard_io_threads)).await?;
    let mut options = ClientOptions::new(servers.coordinator(), certs.worker_material()?, Role::Worker, "bench");
    options.lanes = opts.lanes;
    let client = Client::connect(options).await?;
    // The same gradient every round, in a buffer the bench keeps and the push shares (as the baselines send
    // the same bytes every round; until 2026-11-25 the bench wrote it afresh each round, 0.34 ms at 1 Mi).
    let gradient = Arc::new(vec![vec![1e-3f32; n as usize]]);
    let snapshot = std::cell::RefCell::new(Some(client.pull().await?));
    let measured = measure(2 * dtype.bytes() as u64 * n, opts, Some(&servers), || async {
        let taken = snapshot.borrow_mut().take().context("no snapshot")?;
        let next = if opts.separate {
            client.push_shared(gradient.clone(), &taken).await?;
            client.pull().await?
        } else {
            client.push_pull_shared(gradient.clone(), &taken).await?.1
        };
        // Recycled after the pull, as a trainer drops its old snapshot once the new one is there (handing
        // it back before the pull measured 40 % slower at 1 Mi: glibc trims the freed top of its heap and
        // the pull's allocation faults the pages in again).
        taken.recycle();
        *snapshot.borrow_mut() = Some(next);
        Ok(())
    })
    .await?;
    stop(client, servers).await?;
    Ok(measured)
}

/// A sparse case: `steps` false, each round pulls a batch of rows and pushes their gradients (two requests);
/// `steps` true, each round is one [`Client::step`] as `gaps-worker` sends it — the gradients of the rows
/// pulled the round before, a push of the 16-float dense tensor answered with its values, and the next
/// batch's rows — one request per shard. Returns the measurement and the bytes of memory merged onto huge
/// pages before the clock started (None with `--processes`).
async fn sparse_case(
    certs: &ClusterCerts,
    shards: u32,
    steps: bool,
    opts: &TransportOptions,
) -> Result<(Measured, Option<usize>)> {
    anyhow::ensure!(opts.sparse_rows >= 2 * SPARSE_ROWS, "the sparse table needs at least {} rows", 2 * SPARSE_ROWS);
    let layout =
        Layout::with_tables(vec![TensorSpec::new("dense", 16)], 1 << 18, vec![SparseSpec::new("bench", SPARSE_DIM)])?;
    let servers = Shards::start(certs, shards, 1, &layout, opts.processes.then_some(opts.shard_io_threads)).await?;
    let options = ClientOptions::new(servers.coordinator(), certs.worker_material()?, Role::Worker, "bench");
    let client = Client::connect(options).await?;
    // Fill the table: every id in 0..rows, scattered.
    let batch = 1u64 << 16;
    let mut start = 0;
    while start < opts.sparse_rows {
        let ids: Vec<u64> = (start..(start + batch).min(opts.sparse_rows)).map(scatter).collect();
        client.pull_sparse(0, &ids, true).await?;
        start += batch;
    }
    // Shards in this process: their table measured as it runs minutes after it grew, once the kernel has
    // merged its pages (`collapse_advised_memory`; khugepaged takes ~13 minutes for this table). Shard
    // processes (`--processes`) are measured as just grown.
    let merged = match opts.processes {
        true => None,
        // Seconds of blocking system calls: on a thread of the blocking pool, not the runtime's.
        false => {
            let merging = Instant::now();
            let merged = tokio::task::spawn_blocking(gaps_common::buffers::collapse_advised_memory).await?;
            eprintln!(
                "[gaps bench] the shards' memory merged onto huge pages: {} MB in {:.1} s",
                merged.unwrap_or(0) >> 20,
                merging.elapsed().as_secs_f64()
            );
            merged
        }
    };
    let grads = vec![1e-3f32; (SPARSE_ROWS * u64::from(SPARSE_DIM)) as usize];
    // The rounds' ids, drawn before the clock starts (until 2026-11-29 each round drew its own inside the
    // timing, 5-8 % of a round): a pool of batches the rounds go through in turn, large enough that the rows
    // they touch (about a million of the 10 M, ~150 MB with their state and index) are not in the caches.
    let pool = id_batches(opts.sparse_rows, if opts.quick { 2 } else { SPARSE_BATCHES });
    let next = std::cell::Cell::new(0usize);
    let bytes = 2 * 4 * SPARSE_ROWS * u64::from(SPARSE_DIM);
    let measured = if steps {
        let held = std::sync::Mutex::new(Some((client.pull_sparse(0, &pool[0], true).await?, client.pull().await?)));
        measure(bytes, opts, Some(&servers), || {
            next.set(next.get() + 1);
            let (client, grads, held, ids) = (&client, &grads, &held, &pool[next.get() % pool.len()]);
            async move {
                let (rows, snapshot) = held.lock().unwrap_or_else(|e| e.into_inner()).take().context("no rows")?;
                let dense = vec![vec![1e-3f32; 16]];
                let outcome = client.step(dense, &snapshot, (0, &rows, grads), Some(ids)).await?;
                snapshot.recycle();
                let pulled = outcome.rows.context("a step brought no rows")?;
                anyhow::ensure!(pulled.ids.len() == ids.len(), "pulled {} of {} rows", pulled.ids.len(), ids.len());
                *held.lock().unwrap_or_else(|e| e.into_inner()) = Some((pulled, outcome.dense));
                Ok(())
            }
        })
        .await?
    } else {
        measure(bytes, opts, Some(&servers), || {
            let ids = &pool[next.get() % pool.len()];
            next.set(next.get() + 1);
            let client = &client;
            let grads = &grads;
            async move {
                let rows = client.pull_sparse(0, ids, false).await?;
                anyhow::ensure!(rows.ids.len() == ids.len(), "pulled {} of {} rows", rows.ids.len(), ids.len());
                client.push_sparse(0, &rows, grads).await?;
                Ok(())
            }
        })
        .await?
    };
    stop(client, servers).await?;
    Ok((measured, merged))
}

/// Quinn echo server + client over one connection; `one_way` bytes each way per round. The server runs on
/// a thread and runtime of its own, as the TCP echoes' servers run on plain threads: the bench's client runs
/// as a worker does, and a worker of one lane has a current-thread runtime.
async fn quinn_echo(
    certs: &ClusterCerts,
    one_way: u64,
    path: &net::PathTuning,
    transport: quinn::TransportConfig,
    opts: &TransportOptions,
) -> Result<Measured> {
    let transport = Arc::new(transport);
    let server_tls = certs.shard_material(0)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls.server_config()?)?;
    let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_config.transport_config(transport.clone());
    let (bound, addr) = std::sync::mpsc::channel();
    let server_path = path.clone();
    // Ends when the client's connection closes (or at once, should the endpoint not bind; errors after it
    // bound end the thread and the client's rounds fail on their own).
    std::thread::spawn(move || {
        let report = bound.clone();
        let serve = async move {
            let server = net::endpoint("127.0.0.1:0".parse()?, &server_path, Some(server_config))?;
            let _ = report.send(server.local_addr().map_err(anyhow::Error::from));
            // Bounded: should the client fail before it connects, the thread ends anyway.
            let accepted = tokio::time::timeout(Duration::from_secs(60), server.accept()).await;
            let Ok(Some(incoming)) = accepted else { return Ok(()) };
            let conn = incoming.await?;
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                let data = recv.read_to_end(usize::MAX).await?;
                send.write_all(&data).await?;
                let _ = send.finish();
            }
            anyhow::Ok(())
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Err(e) = runtime.map_err(anyhow::Error::from).and_then(|rt| rt.block_on(serve)) {
            let _ = bound.send(Err(e));
        }
    });
    let addr = addr.recv().map_err(|_| anyhow::anyhow!("the quinn echo's server thread ended before it bound"))??;
    let client_tls = certs.worker_material()?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client_tls.client_config()?)?;
    let mut client_config = quinn::ClientConfig::new(Arc::new(crypto));
    client_config.transport_config(transport);
    let mut endpoint = net::endpoint("127.0.0.1:0".parse()?, path, None)?;
    endpoint.set_default_client_config(client_config);
    let conn = net::connect(&endpoint, addr, Duration::from_secs(5)).await?;
    let payload = vec![7u8; one_way as usize];
    let measured = measure(2 * one_way, opts, None, || async {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&payload).await?;
        send.finish()?;
        let back = recv.read_to_end(usize::MAX).await?;
        anyhow::ensure!(back.len() == payload.len(), "echo returned {} bytes", back.len());
        Ok(())
    })
    .await?;
    conn.close(0u32.into(), b"done");
    Ok(measured)
}

/// Reads a length-prefixed message into `buf` and writes it back, until the peer closes.
fn echo_loop(stream: &mut impl ReadWrite) -> std::io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let mut len = [0u8; 8];
        match stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        buf.resize(u64::from_le_bytes(len) as usize, 0);
        stream.read_exact(&mut buf)?;
        stream.write_all(&buf)?;
        stream.flush()?;
    }
}

/// One echo round from the client side.
fn echo_round(stream: &mut impl ReadWrite, payload: &[u8], back: &mut Vec<u8>) -> std::io::Result<()> {
    stream.write_all(&(payload.len() as u64).to_le_bytes())?;
    stream.write_all(payload)?;
    stream.flush()?;
    back.resize(payload.len(), 0);
    stream.read_exact(back)
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// TCP echo over loopback, with TLS 1.3 (the cluster's certificates, rustls with ring) when `tls`.
async fn tcp_echo(certs: &ClusterCerts, one_way: u64, tls: bool, opts: &TransportOptions) -> Result<Measured> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server_config = Arc::new(certs.shard_material(0)?.server_config()?);
    let server = std::thread::spawn(move || -> Result<()> {
        let (sock, _) = listener.accept()?;
        sock.set_nodelay(true)?;
        if tls {
            let conn = rustls::ServerConnection::new(server_config)?;
            echo_loop(&mut rustls::StreamOwned::new(conn, sock))?;
        } else {
            echo_loop(&mut { sock })?;
        }
        Ok(())
    });
    let client_config = Arc::new(certs.worker_material()?.client_config()?);
    let sock = std::net::TcpStream::connect(addr)?;
    sock.set_nodelay(true)?;
    let stream: Box<dyn ReadWrite + Send> = if tls {
        let name = rustls::pki_types::ServerName::try_from(gaps_transport::tls::SERVER_NAME)?;
        let conn = rustls::ClientConnection::new(client_config, name)?;
        Box::new(rustls::StreamOwned::new(conn, sock))
    } else {
        Box::new(sock)
    };
    let payload = vec![7u8; one_way as usize];
    let mut back = Vec::new();
    let stream = std::cell::RefCell::new(stream);
    let back = std::cell::RefCell::new(&mut back);
    let measured = measure(2 * one_way, opts, None, || {
        // Blocking I/O on the bench's own thread: the echo server is a plain thread, nothing else runs.
        let r = echo_round(&mut *stream.borrow_mut(), &payload, &mut back.borrow_mut());
        async move { r.map_err(anyhow::Error::from) }
    })
    .await?;
    // Closing the client ends the server's loop.
    drop(stream.into_inner());
    let _ = server.join();
    Ok(measured)
}

/// Prints the table (stderr) and one JSON line per case (stdout when `json`).
pub fn print(results: &[TransportResult], json: bool) {
    eprintln!(
        "{:<26} {:>10} {:>6} {:>16} {:>16} {:>12} {:>16} {:>16} {:>6} {:>7}",
        "case",
        "bytes/rnd",
        "rounds",
        "gaps GB/s cpu/GB",
        "quinn GB/s cpu",
        "quinn dflt",
        "tcp GB/s cpu",
        "tcp+tls GB/s cpu",
        "×quinn",
        "×tls"
    );
    let pair = |m: &Measured| format!("{:.3} {:.2}", m.gbytes_per_s, m.cpu_s_per_gb);
    for r in results {
        eprintln!(
            "{:<26} {:>10} {:>6} {:>16} {:>16} {:>12.3} {:>16} {:>16} {:>6.2} {:>7.2}",
            r.case,
            r.bytes,
            r.gaps.rounds,
            pair(&r.gaps),
            pair(&r.quinn),
            r.quinn_default.gbytes_per_s,
            pair(&r.tcp),
            pair(&r.tcp_tls),
            r.ratio(),
            r.ratio_tcp_tls()
        );
        if let (Some(rows), Some(ns)) = (r.rows_per_s(), r.ns_per_row(&r.gaps)) {
            let echo =
                r.ns_per_row(&r.tcp_tls).map_or(String::new(), |e| format!("; the TCP + TLS echo of its bytes {e:.0}"));
            eprintln!("{:<26} {:.2} M rows/s (pull + push), {ns:.0} ns a row{echo}", "", rows / 1e6);
        } else if let (Some(f), Some((n, WireDtype::Bf16))) = (r.floats_per_s(), r.floats) {
            // Against the f32 case of the same size and shards measured in this run.
            let f32_case = results.iter().find(|o| o.shards == r.shards && o.floats == Some((n, WireDtype::F32)));
            if let Some(base) = f32_case.and_then(|o| o.floats_per_s()) {
                eprintln!("{:<26} {:.0} M floats/s each way, {:.2}x the f32 case", "", f / 1e6, f / base);
            }
        } else if r.bytes < 1 << 20 {
            let (gaps, tls) = (r.ms_per_round(&r.gaps), r.ms_per_round(&r.tcp_tls));
            eprintln!("{:<26} {gaps:.3} ms per push+pull, {tls:.3} ms per TCP+TLS echo", "");
        }
    }
    if json {
        for r in results {
            println!("{}", r.to_json());
        }
    }
}
