//! A real `gaps server` process under a flood of request prefixes from a certificate of the cluster: 4,000
//! streams that each send only a frame's 5-byte prefix, declaring a header of 1 MiB. Before headers were
//! admitted as their bytes arrived, each such stream allocated its declared header at once (VmSize
//! 350 MB → 4.5 GB). The attacker is a raw QUIC client writing the prefix by hand (a kind byte, then the
//! header's length as u32 LE).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const LAYOUT: &str = include_str!("fixtures/hostile.toml");

struct Shard(Child);

impl Drop for Shard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (VmRSS, VmSize) of a process, in bytes.
fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name}"));
        let kb: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number of kB");
        kb * 1024
    };
    (field("VmRSS:"), field("VmSize:"))
}

/// A `gaps server` process (shard 0 of 1, the layout above) started in a fresh folder with certificates,
/// with `extra` flags and `GAPS_LOG=log`; its log output is piped when `log` is not "error".
struct Started {
    shard: Shard,
    dir: std::path::PathBuf,
    addr: std::net::SocketAddr,
    pid: u32,
    stderr: Option<std::process::ChildStderr>,
}

fn start_server(name: &str, extra: &[&str], log: &str) -> Started {
    let dir = gaps_common::scratch_dir(&format!("gaps-{name}")).expect("dir");
    let certs = gaps_setup::certs::ClusterCerts::generate(&[]).expect("certs");
    certs.write_to(&dir).expect("write certs");
    let layout = dir.join("layout.toml");
    std::fs::write(&layout, LAYOUT).expect("layout");
    let path = |f: &str| dir.join(f).display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["server", "--listen", "127.0.0.1:0", "--shard-index=0", "--num-shards=1"])
        .arg(format!("--layout={}", layout.display()))
        .arg(format!("--ca={}", path("ca.pem")))
        .arg(format!("--cert={}", path("shard-0.pem")))
        .arg(format!("--key={}", path("shard-0.key")))
        .args(extra)
        .env("GAPS_LOG", log)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(if log == "error" { Stdio::null() } else { Stdio::piped() })
        .spawn()
        .expect("start gaps server");
    let pid = child.id();
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take();
    let shard = Shard(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("the listening line");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let addr = v["addr"].as_str().expect("addr").parse().expect("socket address");
    Started { shard, dir, addr, pid, stderr }
}

fn worker_tls(dir: &std::path::Path) -> gaps_transport::tls::TlsMaterial {
    gaps_transport::tls::TlsMaterial::load(&dir.join("ca.pem"), &dir.join("worker.pem"), &dir.join("worker.key"))
        .expect("worker tls")
}

#[test]
fn four_thousand_prefix_only_streams_leave_the_shards_memory_near_where_it_was() {
    if !std::path::Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc on this system to read a process's memory from");
        return;
    }
    // Long enough that no limit cuts the streams off while memory is measured.
    let Started { shard, dir, addr, pid, .. } =
        start_server("hostile", &["--stall-timeout=120s", "--request-timeout=300s"], "error");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    runtime.block_on(async {
        let tls = worker_tls(&dir);
        // A first connection and request settle the shard's own allocations before the baseline is read.
        let endpoint = gaps_transport::net::client_endpoint(&tls, addr).expect("endpoint");
        let probe = gaps_transport::net::connect(&endpoint, addr, Duration::from_secs(10)).await.expect("connect");
        let stats = gaps_common::wire::Message::StatsRequest(gaps_common::wire::StatsRequest);
        let limits = gaps_common::wire::Limits::default();
        gaps_transport::net::call(&probe, &stats, &[], &limits, Duration::from_secs(10)).await.expect("stats");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss_before, size_before) = memory_of(pid);

        // SparsePull (kind 14), header of 1,048,576 bytes declared, not one of them sent.
        let prefix = [14u8, 0x00, 0x00, 0x10, 0x00];
        let mut streams = Vec::new();
        let mut conns = Vec::new();
        for _ in 0..4 {
            let conn = gaps_transport::net::connect(&endpoint, addr, Duration::from_secs(10)).await.expect("connect");
            for _ in 0..1000 {
                let (mut send, recv) = conn.open_bi().await.expect("stream");
                send.write_all(&prefix).await.expect("write a prefix");
                streams.push((send, recv));
            }
            conns.push(conn);
        }
        // Every stream has reached the shard once a request behind them on the same connections is answered.
        for conn in &conns {
            gaps_transport::net::call(conn, &stats, &[], &limits, Duration::from_secs(30)).await.expect("stats");
        }
        let (mut rss_peak, mut size_peak) = (0, 0);
        for _ in 0..10 {
            let (rss, size) = memory_of(pid);
            (rss_peak, size_peak) = (rss_peak.max(rss), size_peak.max(size));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprintln!(
            "4,000 prefix-only streams: RSS {:.1} -> {:.1} MiB, VmSize {:.1} -> {:.1} MiB",
            mib(rss_before),
            mib(rss_peak),
            mib(size_before),
            mib(size_peak)
        );
        assert!(rss_peak < rss_before + (64 << 20), "RSS grew {:.1} MiB", mib(rss_peak - rss_before.min(rss_peak)));
        assert!(size_peak < 1 << 30, "VmSize {:.1} MiB", mib(size_peak));
        // The shard still serves.
        gaps_transport::net::call(&probe, &stats, &[], &limits, Duration::from_secs(10)).await.expect("stats after");
        drop(streams);
    });
    drop(shard);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Six SparsePulls that each create 2^20 new embedding rows (6.3 M rows asked for, about 50 bytes of row
/// data each here) against a shard whose tables may hold 64 MiB: the least recently used rows are evicted,
/// and once the burst's buffers have gone back to the kernel (every few seconds) the shard's resident
/// memory is within 1.5× the budget + 200 MB. (Before, with no default budget, 6.36 M rows took the RSS to
/// 882 MB, and with `--table-memory 100MiB` it settled at 751 MB.)
#[test]
fn six_creating_sparse_pulls_of_a_million_new_ids_keep_the_shard_near_its_table_budget() {
    let budget: u64 = 64 << 20;
    let Started { shard, dir, addr, pid, .. } =
        start_server("table-budget", &[&format!("--table-memory={budget}")], "error");
    let addr = addr.to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    runtime.block_on(async {
        let tls = worker_tls(&dir);
        let mut opts = gaps_worker::ClientOptions::new(&addr, tls, gaps_common::wire::Role::Worker, "rows");
        opts.rpc_timeout = Duration::from_secs(120);
        let client = gaps_worker::Client::connect(opts).await.expect("connect");
        for round in 0..6u64 {
            let ids: Vec<u64> = (0..1u64 << 20).map(|i| (round << 32) | i).collect();
            let rows = client.pull_sparse(0, &ids, true).await.expect("a creating sparse pull");
            assert_eq!(rows.values.len(), ids.len() * 8);
        }
        // The burst's buffers go back to the kernel within a few seconds; read the settled memory.
        tokio::time::sleep(Duration::from_secs(8)).await;
        let (rss, _) = memory_of(pid);
        let bound = budget * 3 / 2 + 200 * 1_000_000;
        eprintln!(
            "six creating pulls of 2^20 ids, table budget 64 MiB: RSS {:.1} MiB (bound {:.1} MiB)",
            rss as f64 / (1 << 20) as f64,
            bound as f64 / (1 << 20) as f64
        );
        assert!(rss <= bound, "RSS {rss} bytes over {bound}");
        client.leave().await.expect("leave");
    });
    drop(shard);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `--table-memory` a shard's tables get a quarter of the memory the process may use, and it says so
/// when it starts.
#[test]
fn a_shard_announces_its_default_table_budget() {
    let Started { shard: _shard, dir, stderr, .. } = start_server("table-default", &[], "info");
    let stderr = stderr.expect("the log");
    let said = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .take(50)
        .find(|l| l.contains("embedding tables: memory budget"))
        .expect("the budget is announced");
    assert!(said.contains("a quarter of the"), "{said}");
    let expected = gaps_common::buffers::usable_memory().map(|m| (m / 4).max(64 << 20) >> 20);
    if let Some(mib) = expected {
        assert!(said.contains(&format!("memory budget {mib} MiB")), "{said}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
