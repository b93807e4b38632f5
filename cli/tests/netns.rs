//! Multi-host tests on real addresses: every shard and worker in a Linux network namespace of its own,
//! joined to a bridge by a veth pair, each process on its own IP. A host is cut off by taking its link
//! down. Latency, jitter and loss come from a UDP relay on the bridge (this machine's kernel has no
//! `sch_netem`, so `tc netem` cannot add them): shards advertise the relay's address, so every datagram
//! between a worker and a shard crosses it. The tests need root (CI runs as root) and are opt-in for
//! developers:
//!
//! ```sh
//! sudo -E cargo test -p gaps-cli --test netns -- --ignored
//! ```
//!
//! Without root or namespaces they fail with a message that says so; they never pass without running.

use std::collections::{BinaryHeap, HashMap};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Runs `ip ARGS`, panicking with its stderr when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| panic!("running ip {args:?}: {e}"));
    assert!(out.status.success(), "ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
}

/// A bridge in the test's own network namespace context plus `hosts` namespaces attached to it.
struct Net {
    tag: String,
    subnet: String,
    hosts: Vec<String>,
}

impl Net {
    /// `id` tells apart the nets of tests that run at the same time (names and subnets differ).
    fn new(id: u8, hosts: usize) -> Net {
        let probe = Command::new("ip").args(["netns", "list"]).output();
        let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
        assert!(
            is_root && probe.is_ok_and(|o| o.status.success()),
            "the netns tests need root and iproute2 (`ip netns`); CI runs them as root. Run them with \
             `sudo -E cargo test -p gaps-cli --test netns -- --ignored`"
        );
        let pid = std::process::id();
        let tag = format!("g{}n{id}", pid % 100_000);
        let subnet = format!("10.{}.{}", 200 + u32::from(id), pid % 250);
        let mut net = Net { tag, subnet, hosts: Vec::new() };
        let bridge = net.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"]);
        ip(&["addr", "add", &format!("{}.254/24", net.subnet), "dev", &bridge]);
        ip(&["link", "set", &bridge, "up"]);
        for i in 0..hosts {
            let ns = format!("{}h{i}", net.tag);
            ip(&["netns", "add", &ns]);
            net.hosts.push(ns.clone());
            let (outer, inner) = (net.port(i), format!("{}i{i}", net.tag));
            ip(&["link", "add", &outer, "type", "veth", "peer", "name", &inner, "netns", &ns]);
            ip(&["link", "set", &outer, "master", &bridge]);
            ip(&["link", "set", &outer, "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", net.addr(i)), "dev", &inner]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }

    /// The bridge side of host `i`'s link.
    fn port(&self, i: usize) -> String {
        format!("{}o{i}", self.tag)
    }

    /// The test process's own address on the bridge.
    fn hub(&self) -> String {
        format!("{}.254", self.subnet)
    }

    fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }

    /// Cuts host `i` off from every other host (and heals it with `up = true`).
    fn set_link(&self, i: usize, up: bool) {
        ip(&["link", "set", &self.port(i), if up { "up" } else { "down" }]);
    }

    /// Starts `bin ARGS` in host `i`, stdout piped, stderr into `log`.
    fn spawn(&self, i: usize, bin: &Path, args: &[String], log: &Path) -> Proc {
        let err = std::fs::File::create(log).expect("log file");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.hosts[i]])
            .arg(bin)
            .args(args)
            .env_remove("GAPS_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .expect("start a process in a namespace");
        Proc { child, log: log.to_path_buf() }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge()]).status();
    }
}

/// A process that is killed when the test ends, however it ends.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The first line of stdout (a server's `listening` line), within `timeout`.
    fn first_line(&mut self, timeout: Duration) -> String {
        let stdout = self.child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let mut reader = BufReader::new(stdout);
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Keep reading so the process never blocks on a full pipe.
            let mut rest = String::new();
            while reader.read_line(&mut rest).is_ok_and(|n| n > 0) {
                rest.clear();
            }
        });
        rx.recv_timeout(timeout).unwrap_or_else(|_| panic!("no output within {timeout:?}; log:\n{}", self.log()))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A UDP relay on the bridge that adds latency, jitter and loss to every datagram in both directions:
/// what `tc netem` would do on the link. This machine's kernel has no `sch_netem` (nor fq, prio or sfq:
/// `tc qdisc add … netem` answers "Specified qdisc kind is unknown"), so the faults are made here, on the
/// same real addresses. Shards advertise the relay's address; workers reach them only through it.
struct Relay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    dropped: Arc<AtomicU64>,
    relayed: Arc<AtomicU64>,
}

/// A datagram waiting for its departure time.
struct Due {
    at: Instant,
    seq: u64,
    sock: Arc<UdpSocket>,
    to: Option<SocketAddr>,
    data: Vec<u8>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

type Queue = Arc<(Mutex<BinaryHeap<Due>>, Condvar)>;

/// Delay `base ± jitter` and loss probability `loss` for each datagram, from a seeded generator.
#[derive(Clone, Copy)]
struct Impairment {
    base: Duration,
    jitter: Duration,
    loss: f64,
}

impl Relay {
    /// A relay to `upstream`; datagrams from `slow.0` (a host's address) wait `slow.1` microseconds more
    /// (changeable while it runs: a link that gets slow and recovers).
    fn start(
        bind_ip: &str,
        upstream: SocketAddr,
        imp: Impairment,
        seed: u64,
        slow: Option<(IpAddr, Arc<AtomicU64>)>,
    ) -> Relay {
        let front = Arc::new(UdpSocket::bind((bind_ip, 0)).expect("relay socket"));
        front.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
        let addr = front.local_addr().expect("relay address");
        let stop = Arc::new(AtomicBool::new(false));
        let (dropped, relayed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let queue: Queue = Arc::new((Mutex::new(BinaryHeap::new()), Condvar::new()));
        {
            let (queue, stop) = (queue.clone(), stop.clone());
            std::thread::spawn(move || sender(&queue, &stop));
        }
        let schedule = {
            let (queue, dropped, relayed) = (queue.clone(), dropped.clone(), relayed.clone());
            let rng = Arc::new(Mutex::new(seed | 1));
            let seq = Arc::new(AtomicU64::new(0));
            move |sock: &Arc<UdpSocket>, to: Option<SocketAddr>, data: &[u8], extra: Duration| {
                let (u1, u2) = {
                    let mut x = rng.lock().expect("rng");
                    let mut next = || {
                        *x ^= *x << 13;
                        *x ^= *x >> 7;
                        *x ^= *x << 17;
                        (*x >> 11) as f64 / (1u64 << 53) as f64
                    };
                    (next(), next())
                };
                if u1 < imp.loss {
                    dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                relayed.fetch_add(1, Ordering::Relaxed);
                let delay = imp.base.as_secs_f64() + (2.0 * u2 - 1.0) * imp.jitter.as_secs_f64();
                let at = Instant::now() + Duration::from_secs_f64(delay.max(0.0)) + extra;
                let due =
                    Due { at, seq: seq.fetch_add(1, Ordering::Relaxed), sock: sock.clone(), to, data: data.to_vec() };
                let (heap, ready) = &*queue;
                heap.lock().expect("queue").push(due);
                ready.notify_one();
            }
        };
        let schedule = Arc::new(schedule);
        let (stop2, bind_ip) = (stop.clone(), bind_ip.to_string());
        std::thread::spawn(move || {
            let mut peers: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
            let mut buf = vec![0u8; 65_536];
            while !stop2.load(Ordering::Relaxed) {
                let Ok((n, client)) = front.recv_from(&mut buf) else { continue };
                let back = peers.entry(client).or_insert_with(|| {
                    let sock = Arc::new(UdpSocket::bind((bind_ip.as_str(), 0)).expect("upstream socket"));
                    sock.connect(upstream).expect("connect upstream");
                    sock.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
                    let (sock2, front2, stop3, schedule2) =
                        (sock.clone(), front.clone(), stop2.clone(), schedule.clone());
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 65_536];
                        while !stop3.load(Ordering::Relaxed) {
                            if let Ok(n) = sock2.recv(&mut buf) {
                                schedule2(&front2, Some(client), &buf[..n], Duration::ZERO);
                            }
                        }
                    });
                    sock
                });
                let extra = match &slow {
                    Some((ip, micros)) if *ip == client.ip() => Duration::from_micros(micros.load(Ordering::Relaxed)),
                    _ => Duration::ZERO,
                };
                schedule(back, None, &buf[..n], extra);
            }
        });
        Relay { addr, stop, dropped, relayed }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Sends each queued datagram at its time.
fn sender(queue: &Queue, stop: &AtomicBool) {
    let (heap, ready) = &**queue;
    let mut guard = heap.lock().expect("queue");
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        match guard.peek().map(|d| d.at) {
            Some(at) if at <= now => {
                let due = guard.pop().expect("a datagram");
                drop(guard);
                let _ = match due.to {
                    Some(to) => due.sock.send_to(&due.data, to),
                    None => due.sock.send(&due.data),
                };
                guard = heap.lock().expect("queue");
            }
            Some(at) => guard = ready.wait_timeout(guard, at - now).expect("queue").0,
            None => guard = ready.wait_timeout(guard, Duration::from_millis(50)).expect("queue").0,
        }
    }
}

/// The `gaps` binary: `gaps server …` and `gaps worker …` are the role programs.
fn gaps_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gaps"))
}

fn run_gaps(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(args).output().expect("run gaps");
    assert!(out.status.success(), "gaps {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A scratch folder with a CA, shard certificates (valid for `sans` too), worker certificates named
/// `workers`, and a logreg layout of 8 chunks (both shards own some).
fn setup(net: &Net, test: &str, workers: &[&str], sans: &[String]) -> PathBuf {
    setup_shards(net, test, workers, sans, 2)
}

/// [`setup`] with certificates for `shards` shard processes (on hosts `0..shards`).
fn setup_shards(net: &Net, test: &str, workers: &[&str], sans: &[String], shards: usize) -> PathBuf {
    let dir = gaps_common::scratch_dir(&format!("gaps-netns-{test}")).expect("temp dir");
    let out = dir.join("certs").display().to_string();
    let mut args = vec!["certs".to_string(), "--out".into(), out, "--shards".into(), shards.to_string()];
    for san in (0..shards).map(|i| net.addr(i)).collect::<Vec<_>>().iter().chain(sans) {
        args.extend(["--san".into(), san.clone()]);
    }
    for w in workers {
        args.extend(["--worker".into(), w.to_string()]);
    }
    run_gaps(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let layout = run_gaps(&["layout", "--model", "logreg", "--dim", "8192", "--chunk-elems", "1024"]);
    std::fs::write(dir.join("layout.toml"), layout).expect("layout");
    dir
}

fn path(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

/// Starts shards 0 and 1 on hosts 0 and 1 (port 7070), advertising `advertise[i]` where given, and waits
/// until both serve.
fn start_shards(net: &Net, dir: &Path, advertise: &[Option<SocketAddr>], extra: &[&str]) -> Vec<Proc> {
    start_n_shards(net, dir, 2, advertise, extra)
}

/// [`start_shards`] for shards `0..n` on hosts `0..n`.
fn start_n_shards(net: &Net, dir: &Path, n: usize, advertise: &[Option<SocketAddr>], extra: &[&str]) -> Vec<Proc> {
    let server = gaps_exe();
    (0..n)
        .map(|i| {
            let mut a = vec![
                "server".into(),
                format!("--shard-index={i}"),
                format!("--num-shards={n}"),
                format!("--listen={}:7070", net.addr(i)),
                format!("--ca={}", path(dir, "certs/ca.pem")),
                format!("--cert={}", path(dir, &format!("certs/shard-{i}.pem"))),
                format!("--key={}", path(dir, &format!("certs/shard-{i}.key"))),
                format!("--layout={}", path(dir, "layout.toml")),
            ];
            if i > 0 {
                a.push(format!("--coordinator={}:7070", net.addr(0)));
            }
            if let Some(Some(addr)) = advertise.get(i) {
                a.push(format!("--advertise={addr}"));
            }
            a.extend(extra.iter().map(|x| x.to_string()));
            let mut p = net.spawn(i, &server, &a, &dir.join(format!("shard-{i}.log")));
            assert!(p.first_line(Duration::from_secs(30)).contains("listening"), "{}", p.log());
            p
        })
        .collect()
}

/// Starts worker `name` (its own certificate) on host `host`.
fn start_worker(net: &Net, dir: &Path, host: usize, name: &str, coordinator: &str, steps: u64) -> Proc {
    let args: Vec<String> = vec![
        "worker".into(),
        format!("--coordinator={coordinator}"),
        format!("--ca={}", path(dir, "certs/ca.pem")),
        format!("--cert={}", path(dir, &format!("certs/{name}.pem"))),
        format!("--key={}", path(dir, &format!("certs/{name}.key"))),
        format!("--name={name}"),
        "--model=logreg".into(),
        format!("--steps={steps}"),
        "--compute-delay=20ms".into(),
        "--shard-down-timeout=90s".into(),
        "--json".into(),
    ];
    net.spawn(host, &gaps_exe(), &args, &dir.join(format!("{name}.log")))
}

/// One relay on the bridge in front of each of the two shards (seeds `seed`, `seed + 1`).
fn shard_relays(net: &Net, link: Impairment, seed: u64, slow: Option<(IpAddr, Arc<AtomicU64>)>) -> Vec<Relay> {
    (0..2)
        .map(|i| {
            let upstream: SocketAddr = format!("{}:7070", net.addr(i)).parse().expect("address");
            Relay::start(&net.hub(), upstream, link, seed + i as u64, slow.clone())
        })
        .collect()
}

/// Waits for a worker to exit successfully and returns its summary line.
fn summary(worker: &mut Proc, timeout: Duration) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = worker.child.try_wait().expect("worker state") {
            break status;
        }
        assert!(Instant::now() < deadline, "the worker did not finish within {timeout:?}:\n{}", worker.log());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "worker failed ({status}):\n{}", worker.log());
    let mut out = String::new();
    std::io::Read::read_to_string(&mut worker.child.stdout.take().expect("stdout"), &mut out).expect("read");
    let line = out.lines().rev().find(|l| l.contains("worker_done")).unwrap_or_else(|| panic!("no summary in {out:?}"));
    serde_json::from_str(line).expect("JSON summary")
}

/// The shards' counters, read over the bridge by an observer connecting to `coordinator` directly.
fn shard_stats(dir: &Path, coordinator: &str, worker: &str) -> Vec<gaps_common::wire::Stats> {
    let (runtime, observer) = observer(dir, coordinator, worker);
    runtime.block_on(async move { observer.stats().await }).expect("shard stats")
}

/// A cluster checkpoint asked by an observer with certificate `cert` (only shard 0's may ask): each shard's
/// file.
fn cluster_checkpoint(dir: &Path, coordinator: &str, cert: &str) -> gaps_common::wire::CheckpointDone {
    let (runtime, observer) = observer(dir, coordinator, cert);
    runtime.block_on(async move { observer.checkpoint().await }).expect("a cluster checkpoint")
}

/// An observer connected to the cluster with `worker`'s certificate, and the runtime it runs on.
fn observer(dir: &Path, coordinator: &str, worker: &str) -> (tokio::runtime::Runtime, gaps_worker::client::Client) {
    use gaps_worker::client::{Client, ClientOptions};
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let tls = gaps_transport::tls::TlsMaterial::load(
        Path::new(&path(dir, "certs/ca.pem")),
        Path::new(&path(dir, &format!("certs/{worker}.pem"))),
        Path::new(&path(dir, &format!("certs/{worker}.key"))),
    )
    .expect("worker certificate");
    let opts = ClientOptions::new(coordinator.to_string(), tls, gaps_common::wire::Role::Observer, "netns-test");
    let observer = runtime.block_on(Client::connect(opts)).expect("observer connects over the bridge");
    (runtime, observer)
}

/// Issue 14 (c): a shard cut off from the network is noticed by the worker within seconds (its requests
/// to that shard fail over and it says which shard is unreachable), keeps being retried, and once the
/// link is back training resumes where it stopped and finishes with every push applied exactly once.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn a_partitioned_shard_is_detected_and_training_resumes_when_the_partition_heals() {
    let net = Net::new(1, 3);
    let dir = setup(&net, "partition", &["worker"], &[]);
    let shards = start_shards(&net, &dir, &[], &[]);
    let steps = 400u64;
    let coordinator = format!("{}:7070", net.addr(0));
    let mut worker = start_worker(&net, &dir, 2, "worker", &coordinator, steps);
    std::thread::sleep(Duration::from_secs(2));
    assert!(worker.child.try_wait().expect("worker state").is_none(), "the worker ended early:\n{}", worker.log());

    let cut = Instant::now();
    net.set_link(1, false);
    let mut detected = None;
    while cut.elapsed() < Duration::from_secs(12) {
        if detected.is_none() && worker.log().lines().any(|l| l.contains("shard unreachable") && l.contains("shard=1"))
        {
            detected = Some(cut.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    net.set_link(1, true);
    let detected =
        detected.unwrap_or_else(|| panic!("the worker never reported shard 1 unreachable:\n{}", worker.log()));
    assert!(detected < Duration::from_secs(10), "detected only after {detected:?}");
    eprintln!("shard 1 cut off for 12 s; the worker reported it unreachable after {detected:?}");

    let summary = summary(&mut worker, Duration::from_secs(120));
    assert_eq!(summary["steps"], steps, "{summary}");
    assert_eq!(summary["pushes_sent"], summary["pushes_acknowledged"], "{summary}");
    assert!(summary["retries"].as_u64().unwrap_or(0) > 0, "the partition cost no retry: {summary}");
    // Every push applied exactly once, read from the shards themselves.
    let stats = shard_stats(&dir, &coordinator, "worker");
    let applied: u64 = stats.iter().map(|s| s.pushes_applied).sum();
    assert_eq!(applied, summary["pushes_sent"].as_u64().expect("pushes_sent"), "{stats:?}");
    assert_eq!(applied, 2 * steps, "every step pushed to both shards once: {stats:?}");
    eprintln!("worker: {summary}; shards applied {applied} pushes");
    drop(shards);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 (a): two workers train against two shards over links with 5 ms ± 2 ms of latency each way and
/// 1 % loss (both directions, every datagram); training completes and every push is applied exactly once.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn training_over_links_with_latency_jitter_and_loss_applies_every_push_once() {
    let net = Net::new(2, 4);
    let hub = net.hub();
    let dir = setup(&net, "lossy", &["w0", "w1"], std::slice::from_ref(&hub));
    let link = Impairment { base: Duration::from_millis(5), jitter: Duration::from_millis(2), loss: 0.01 };
    let relays = shard_relays(&net, link, 0x5eed, None);
    let shards = start_shards(&net, &dir, &[Some(relays[0].addr), Some(relays[1].addr)], &[]);
    let steps = 150u64;
    let coordinator = relays[0].addr.to_string();
    let mut workers: Vec<Proc> =
        ["w0", "w1"].iter().enumerate().map(|(k, w)| start_worker(&net, &dir, 2 + k, w, &coordinator, steps)).collect();
    let mut sent = 0;
    for w in &mut workers {
        let s = summary(w, Duration::from_secs(240));
        assert_eq!(s["steps"], steps, "{s}");
        assert_eq!(s["pushes_sent"], s["pushes_acknowledged"], "{s}");
        sent += s["pushes_sent"].as_u64().expect("pushes_sent");
    }
    let stats = shard_stats(&dir, &format!("{}:7070", net.addr(0)), "w0");
    let applied: u64 = stats.iter().map(|s| s.pushes_applied).sum();
    assert_eq!(applied, sent, "{stats:?}");
    assert_eq!(applied, 2 * 2 * steps, "{stats:?}");
    let (dropped, relayed): (u64, u64) = relays
        .iter()
        .map(|r| (r.dropped.load(Ordering::Relaxed), r.relayed.load(Ordering::Relaxed)))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert!(dropped > 0 && relayed > 100 * dropped / 2, "{dropped} dropped of {relayed}");
    eprintln!("{relayed} datagrams relayed with 5 ms ± 2 ms, {dropped} dropped; {applied} pushes applied once");
    drop(shards);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14 (b): in `auto` mode, a worker whose link gets 50 ms of extra latency is judged a straggler (a
/// worker's step cost includes its round trips to the shard, from QUIC's RTT estimate), the cluster leaves
/// synchronous training for GBA, and it switches back once the delay is gone.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn auto_mode_treats_a_slow_link_as_a_straggler_and_switches_back_when_it_recovers() {
    let net = Net::new(3, 4);
    let hub = net.hub();
    let dir = setup(&net, "slowlink", &["w0", "w1"], std::slice::from_ref(&hub));
    let extra = Arc::new(AtomicU64::new(0));
    let slow_ip: IpAddr = net.addr(3).parse().expect("address");
    let link = Impairment { base: Duration::ZERO, jitter: Duration::ZERO, loss: 0.0 };
    let relays = shard_relays(&net, link, 0xb0, Some((slow_ip, extra.clone())));
    let _shards = start_shards(&net, &dir, &[Some(relays[0].addr), Some(relays[1].addr)], &["--mode=auto"]);
    let coordinator = relays[0].addr.to_string();
    let _workers: Vec<Proc> = ["w0", "w1"]
        .iter()
        .enumerate()
        .map(|(k, w)| start_worker(&net, &dir, 2 + k, w, &coordinator, 1_000_000))
        .collect();
    let direct = format!("{}:7070", net.addr(0));
    let wait_for = |what: &str, done: &dyn Fn(&gaps_common::wire::Stats) -> bool| {
        let started = Instant::now();
        loop {
            let stats = shard_stats(&dir, &direct, "w0");
            let s0 = stats.iter().find(|s| s.shard == 0).expect("shard 0's counters");
            if done(s0) {
                return (started.elapsed(), s0.clone());
            }
            assert!(started.elapsed() < Duration::from_secs(60), "{what} did not happen within 60 s: {s0:?}");
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    let (_, before) = wait_for("synchronous steps", &|s| s.steps_sync >= 20);
    assert_eq!(before.mode_switches, 0, "no switch before the link slows: {before:?}");
    extra.store(50_000, Ordering::Relaxed);
    let (took, slow) = wait_for("the switch to GBA", &|s| s.mode_switches >= 1);
    eprintln!("50 ms added to worker w1's link: switched after {took:?} ({slow:?})");
    extra.store(0, Ordering::Relaxed);
    let (took, back) = wait_for("the switch back", &|s| s.mode_switches >= 2);
    eprintln!("delay removed: switched back after {took:?}");
    assert!(back.steps_gba > 0, "steps ran in GBA while the link was slow: {back:?}");
    let (_, after) = wait_for("more synchronous steps", &|s| s.steps_sync > back.steps_sync + 10);
    assert_eq!(after.mode_switches, 2, "{after:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `scripts/bench-link` runs the transport bench over a loopback held to the rate it is given: the plain
/// TCP echo, which alone moves 2–5 GB/s here, stays under the link's 800 Mbit/s (100 MB/s), and the gaps
/// cases still run and report.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn the_link_bench_moves_its_bytes_at_the_rate_it_was_given() {
    let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    assert!(is_root, "the link bench needs root (tc, ip netns); CI runs it as root");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench-link");
    let out = Command::new(&script)
        .args(["800mbit", "--only", "push_pull_1shard", "--floats", "256Ki", "--repeats", "1", "--seconds", "0.5"])
        .arg("--json")
        .env("GAPS", env!("CARGO_BIN_EXE_gaps"))
        .output()
        .expect("running scripts/bench-link");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench-link failed: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("tbf") && text.contains("800Mbit"), "the loopback was not shaped: {text}");
    let rows: Vec<serde_json::Value> =
        text.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("a JSON row")).collect();
    let cases: Vec<&str> = rows.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(cases, ["push_pull_1shard_256Ki", "push_pull_1shard_256Ki_bf16"], "{text}");
    for row in &rows {
        let (tcp, gaps) =
            (row["tcp_gbytes_per_s"].as_f64().unwrap_or(0.0), row["gbytes_per_s"].as_f64().unwrap_or(0.0));
        // One direction at a time at most 0.1 GB/s, plus what the 512 KiB bucket lets through at once.
        assert!(tcp > 0.0 && tcp < 0.13, "TCP moved {tcp} GB/s over an 800 Mbit/s link: {row}");
        assert!(gaps > 0.0 && gaps < 0.13, "gaps moved {gaps} GB/s over an 800 Mbit/s link: {row}");
    }
}

/// Waits until `proc`'s log holds a line containing `needle`, within `timeout`.
fn wait_for_line(proc: &Proc, needle: &str, timeout: Duration) {
    let started = Instant::now();
    while !proc.log().contains(needle) {
        assert!(started.elapsed() < timeout, "no {needle:?} within {timeout:?}:\n{}", proc.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Issue 34: with `--replicas 2`, shard 1's primary (host 1) is cut off from the coordinator's host (host
/// 0, which keeps shard 1's copy) by blackhole routes both ways, while the workers on hosts 2 and 3 still
/// reach it. The copy takes shard 1 over; from then on the old primary acknowledges nothing (its replies
/// wait for a backup it cannot reach and for the coordinator's leave), the workers find the copy in the
/// coordinator's map and send their pushes there; once the routes are back the old primary is fenced.
/// Every push a worker saw acknowledged by shard 1 is in the copy's per-worker ledger, and none twice.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn a_primary_cut_off_from_the_coordinator_acknowledges_nothing_once_its_copy_took_over() {
    let net = Net::new(4, 4);
    let dir = setup(&net, "failover", &["worker", "w2"], &[]);
    // Every request that changes a shard's state is recorded (the old primary's and the copy's), and the
    // cluster's checkpoint at the end is compared with a replay of the records.
    let (record, checkpoints) = (path(&dir, "records"), path(&dir, "checkpoints"));
    let (record_flag, checkpoint_flag) =
        (format!("--record-requests={record}"), format!("--checkpoint-dir={checkpoints}"));
    let shards = start_shards(
        &net,
        &dir,
        &[],
        &["--replicas=2", "--request-timeout=5s", record_flag.as_str(), checkpoint_flag.as_str()],
    );
    for s in &shards {
        wait_for_line(s, "backup caught up", Duration::from_secs(30));
    }
    let steps = 300u64;
    let coordinator = format!("{}:7070", net.addr(0));
    let mut workers = [
        start_worker(&net, &dir, 2, "worker", &coordinator, steps),
        start_worker(&net, &dir, 3, "w2", &coordinator, steps),
    ];
    std::thread::sleep(Duration::from_secs(2));
    let cut = |verb: &str| {
        ip(&["-n", &net.hosts[1], "route", verb, "blackhole", &format!("{}/32", net.addr(0))]);
        ip(&["-n", &net.hosts[0], "route", verb, "blackhole", &format!("{}/32", net.addr(1))]);
    };
    cut("add");
    let partitioned = Instant::now();
    wait_for_line(&shards[0], "took over a shard whose primary went silent", Duration::from_secs(20));
    eprintln!("shard 1's copy took over {:?} after the partition", partitioned.elapsed());
    // The workers go on through the copy while the old primary stays cut off from its backup and the
    // coordinator; then the routes come back and it learns it was replaced.
    std::thread::sleep(Duration::from_secs(4));
    cut("del");
    wait_for_line(&shards[1], "answers nothing more", Duration::from_secs(30));
    let summaries: Vec<serde_json::Value> = workers.iter_mut().map(|w| summary(w, Duration::from_secs(180))).collect();
    let stats = shard_stats(&dir, &coordinator, "worker");
    assert_eq!(stats[1].pushes_applied_twice, 0, "{:?}", stats[1]);
    for s in &summaries {
        assert_eq!(s["steps"], steps, "{s}");
        let id = s["worker"].as_u64().expect("worker id") as u32;
        let acked = s["acknowledged_by_shard"][1].as_u64().expect("acknowledged by shard 1");
        let held = stats[1].applied_by_worker.iter().find(|a| a.worker == id).map_or(0, |a| a.applied);
        assert_eq!(held, acked, "worker {id}: shard 1 (now its copy) holds exactly what it acknowledged: {s}");
        assert!(acked >= steps, "worker {id} pushed to shard 1 every step: {s}");
    }
    eprintln!("workers: {summaries:?}");
    // The final model equals a replay of the acknowledged requests: the old primary's record up to the last
    // entry its copy had when it took over, then the copy's own, applied to the state the old primary
    // started from, ends exactly at the copy's checkpoint (parameters, optimizer state, ledgers, counters).
    let done = cluster_checkpoint(&dir, &coordinator, "shard-0");
    let file = &done.shards.iter().find(|c| c.shard == 1).expect("shard 1's checkpoint").path;
    let replay = Command::new(gaps_exe())
        .args([
            "server",
            "--shard-index=1",
            "--num-shards=2",
            &format!("--listen={}:7070", net.addr(1)),
            &format!("--ca={}", path(&dir, "certs/ca.pem")),
            &format!("--cert={}", path(&dir, "certs/shard-1.pem")),
            &format!("--key={}", path(&dir, "certs/shard-1.key")),
            &format!("--layout={}", path(&dir, "layout.toml")),
            &format!("--coordinator={coordinator}"),
            "--replicas=2",
            &format!("--replay-records={record}/shard-1-process-1.rec,{record}/shard-1-process-0.rec"),
            &format!("--replay-checkpoint={file}"),
        ])
        .output()
        .expect("run the replay");
    let report = String::from_utf8_lossy(&replay.stdout);
    assert!(replay.status.success(), "the replay: {report}\n{}", String::from_utf8_lossy(&replay.stderr));
    let report: serde_json::Value = serde_json::from_str(report.trim()).expect("the replay's report");
    let acked: u64 = summaries.iter().map(|s| s["acknowledged_by_shard"][1].as_u64().unwrap_or(0)).sum();
    assert_eq!(report["pushes_applied"], acked, "the replay applied exactly the acknowledged pushes: {report}");
    eprintln!("replay: {report}");
    drop(shards);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 34, step 4: with `--replicas 2` on three shard processes, the coordinator's host (process 0) is cut
/// off from the other two shard hosts by blackhole routes both ways, while the workers on hosts 3 and 4
/// still reach it. A majority (processes 1 and 2) chooses process 1, which kept shard 0's copy, to serve
/// shard 0; the old coordinator acknowledges nothing from then on (its replies wait for a backup it cannot
/// reach, and it cannot have a configuration without that backup chosen); the workers ask the shard
/// processes where the coordinator is and go on through process 1; once the routes are back the old
/// coordinator learns it was replaced and answers nothing more. Every push a worker saw acknowledged, by any
/// shard, is in that shard's per-worker ledger, and none twice.
#[test]
#[ignore = "needs root and network namespaces: cargo test -p gaps-cli --test netns -- --ignored (.ci/run runs it)"]
fn a_coordinator_cut_off_from_a_majority_is_replaced_and_acknowledges_nothing_more() {
    let net = Net::new(5, 5);
    let dir = setup_shards(&net, "coordinator", &["worker", "w2"], &[], 3);
    let checkpoints = format!("--checkpoint-dir={}", path(&dir, "checkpoints"));
    let shards = start_n_shards(&net, &dir, 3, &[], &["--replicas=2", "--request-timeout=5s", checkpoints.as_str()]);
    for s in &shards {
        wait_for_line(s, "backup caught up", Duration::from_secs(30));
    }
    wait_for_line(&shards[2], "shard 0's configuration chosen", Duration::from_secs(30));
    let steps = 300u64;
    let coordinator = format!("{}:7070", net.addr(0));
    let mut workers = [
        start_worker(&net, &dir, 3, "worker", &coordinator, steps),
        start_worker(&net, &dir, 4, "w2", &coordinator, steps),
    ];
    std::thread::sleep(Duration::from_secs(2));
    let cut = |verb: &str| {
        for other in [1, 2] {
            ip(&["-n", &net.hosts[0], "route", verb, "blackhole", &format!("{}/32", net.addr(other))]);
            ip(&["-n", &net.hosts[other], "route", verb, "blackhole", &format!("{}/32", net.addr(0))]);
        }
    };
    cut("add");
    let partitioned = Instant::now();
    wait_for_line(&shards[1], "took over shard 0 (the coordinator)", Duration::from_secs(20));
    eprintln!("process 1 serves shard 0 {:?} after the partition", partitioned.elapsed());
    std::thread::sleep(Duration::from_secs(4));
    cut("del");
    wait_for_line(&shards[0], "answers nothing more", Duration::from_secs(30));
    let summaries: Vec<serde_json::Value> = workers.iter_mut().map(|w| summary(w, Duration::from_secs(180))).collect();
    // The observer is given the old coordinator's address: it answers `Moved`, and says where the new one is.
    let stats = shard_stats(&dir, &coordinator, "worker");
    for (shard, st) in stats.iter().enumerate() {
        assert_eq!(st.pushes_applied_twice, 0, "shard {shard}: {st:?}");
        for s in &summaries {
            assert_eq!(s["steps"], steps, "{s}");
            let id = s["worker"].as_u64().expect("worker id") as u32;
            let acked = s["acknowledged_by_shard"][shard].as_u64().expect("acknowledged by the shard");
            let held = st.applied_by_worker.iter().find(|a| a.worker == id).map_or(0, |a| a.applied);
            assert_eq!(held, acked, "worker {id}: shard {shard} holds exactly what it acknowledged: {s}");
        }
    }
    eprintln!("workers: {summaries:?}");
    drop(shards);
    let _ = std::fs::remove_dir_all(&dir);
}
