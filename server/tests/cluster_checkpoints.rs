//! Cluster-consistent checkpoints over real shard services: the coordinator names the id and, in `sync`,
//! the step; every shard writes that id at that step, so the shards' files of one checkpoint never mix
//! steps. In async modes every shard takes it at its next quiescent point.

mod common;

use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::Role;
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, CheckpointConfig, Restore, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::{Init, ShardConfig};
use gaps_worker::client::{Client, ClientOptions};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

async fn start_shard(
    certs: &ClusterCerts,
    dir: &Path,
    shard: u32,
    coordinator: Option<String>,
    mode: Mode,
) -> RunningServer {
    let core = ShardConfig {
        shard,
        num_shards: 2,
        rule: Rule::Momentum,
        hyper: Hyper { lr: 0.01, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 4, std: 0.1 },
        epoch: 77,
        modes: ModeConfig { mode, ..ModeConfig::default() },
        ..ShardConfig::new(Layout::new(vec![TensorSpec::new("w", 600), TensorSpec::new("b", 7)], 64).expect("layout"))
    };
    let cfg = ServiceConfig {
        coordinator,
        join_timeout: Duration::from_secs(10),
        tick_interval: Duration::from_millis(100),
        checkpoint: Some(CheckpointConfig {
            dir: dir.to_path_buf(),
            every: Some(Duration::from_millis(200)),
            keep: 100,
        }),
        restore: Restore::Never,
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(core.shard).expect("tls"), core)
    };
    service::start(cfg).await.expect("start shard")
}

/// Each shard's checkpoints: id → (the step in its manifest, the step it was asked for).
/// A shard's checkpoints by id: (step, the step it was taken at where the coordinator named one).
type Checkpoints = BTreeMap<u64, (u64, Option<u64>)>;

fn steps(dir: &Path, shard: u32) -> Checkpoints {
    std::fs::read_dir(dir.join(format!("shard-{shard}")))
        .expect("checkpoint dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).expect("manifest")).expect("json");
            (m["id"].as_u64().expect("id"), (m["step"].as_u64().expect("step"), m["at_step"].as_u64()))
        })
        .collect()
}

/// `workers` workers train `iterations` steps each, and go on (up to 50 times as many) until `enough` says
/// the checkpoints the test needs were written while they trained (a schedule runs on the clock, training on
/// a machine whose load varies: no number of steps guarantees a number of checkpoints).
async fn train(
    certs: &ClusterCerts,
    coordinator: &str,
    workers: usize,
    iterations: usize,
    enough: impl Fn() -> bool + Send + Sync + 'static,
) {
    let enough = std::sync::Arc::new(enough);
    let mut tasks = Vec::new();
    for w in 0..workers {
        let o = common::options(certs, coordinator, Role::Worker, "t", Duration::from_secs(20));
        let enough = enough.clone();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(o).await.expect("connect");
            for i in 0..iterations * 50 {
                if i >= iterations && enough() {
                    break;
                }
                let s = c.pull().await.expect("pull");
                let g = common::toy_gradients(&s, i, w);
                c.push(g, &s).await.expect("push");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            c.leave().await.expect("leave");
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
}

/// Two shards in `mode` writing checkpoints into a fresh folder of their own.
struct TwoShards {
    dir: std::path::PathBuf,
    certs: ClusterCerts,
    s0: RunningServer,
    s1: RunningServer,
}

impl TwoShards {
    async fn start(name: &str, mode: Mode) -> TwoShards {
        let dir = common::fresh_dir(name);
        let certs = ClusterCerts::generate(&[]).expect("certs");
        let s0 = start_shard(&certs, &dir, 0, None, mode).await;
        let s1 = start_shard(&certs, &dir, 1, Some(s0.advertise.clone()), mode).await;
        TwoShards { dir, certs, s0, s1 }
    }

    /// Each shard's checkpoints: id → (step, the step it was taken at where the coordinator named one).
    fn checkpoints(&self) -> (Checkpoints, Checkpoints) {
        (steps(&self.dir, 0), steps(&self.dir, 1))
    }

    /// [`train`]s `workers` workers for `iterations` steps, on until `enough` holds of the shards' checkpoints.
    async fn train(&self, workers: usize, iterations: usize, enough: fn(&Checkpoints, &Checkpoints) -> bool) {
        let dir = self.dir.clone();
        train(&self.certs, &self.s0.advertise, workers, iterations, move || enough(&steps(&dir, 0), &steps(&dir, 1)))
            .await;
    }

    async fn stop(self) {
        self.s1.shutdown().await.expect("shutdown");
        self.s0.shutdown().await.expect("shutdown");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_sync_every_shard_writes_the_coordinators_checkpoint_at_the_same_step() {
    let cluster = TwoShards::start("gaps-cluster-ckpt-sync", Mode::Sync).await;
    let s0 = &cluster.s0;
    cluster
        .train(3, 150, |a, b| a.iter().filter(|(id, (_, at))| at.is_some() && b.contains_key(id)).count() >= 2)
        .await;

    let (a, b) = cluster.checkpoints();
    let common: Vec<u64> = a.keys().filter(|id| b.contains_key(id)).copied().collect();
    // Taken while workers trained: at a step the coordinator named, the same on both shards.
    let at_step: Vec<u64> = common.iter().filter(|id| a[id].1.is_some()).copied().collect();
    assert!(at_step.len() >= 2, "cluster checkpoints were taken while training: shard 0 {a:?}, shard 1 {b:?}");
    for id in &at_step {
        assert_eq!(a[id], b[id], "checkpoint {id} mixes steps: shard 0 {a:?}, shard 1 {b:?}");
        assert_eq!(Some(a[id].0), a[id].1, "checkpoint {id} was not taken at its step: {a:?}");
    }
    // Every checkpoint of the schedule reached both shards (none was left on one side only).
    let one_sided: Vec<u64> = a.keys().chain(b.keys()).filter(|id| !common.contains(id)).copied().collect();
    assert!(one_sided.len() <= 1, "checkpoints written by one shard only: {one_sided:?} ({a:?} / {b:?})");

    // Idle (no live worker): on demand, at once (the shards are quiescent), one id on both. (How many steps
    // each shard counted depends on when it learned of each worker, see issue 15; the scheduled
    // checkpoints above pin the step itself.)
    let done = s0.cluster_checkpoint().await.expect("cluster checkpoint");
    assert_eq!(done.shards.iter().map(|s| s.shard).collect::<Vec<_>>(), vec![0, 1], "{done:?}");
    assert!(done.shards.iter().all(|s| s.step >= 140), "{done:?}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_async_every_shard_writes_the_coordinators_id_and_gaps_checkpoint_reaches_all() {
    let cluster = TwoShards::start("gaps-cluster-ckpt-async", Mode::Async).await;
    let (certs, s0) = (&cluster.certs, &cluster.s0);
    cluster.train(2, 60, |a, b| a.keys().filter(|id| b.contains_key(id)).count() >= 2).await;
    let (a, b) = cluster.checkpoints();
    assert!(a.values().chain(b.values()).all(|(_, at)| at.is_none()), "async: at the quiescent point");
    let common = a.keys().filter(|id| b.contains_key(id)).count();
    assert!(common >= 2, "shard 0 {a:?}, shard 1 {b:?}");

    // What `gaps checkpoint` sends: the coordinator answers with every shard's file of one id.
    let mut o = ClientOptions::new(&s0.advertise, certs.shard_material(0).expect("tls"), Role::Observer, "op");
    o.rpc_timeout = Duration::from_secs(20);
    let c = Client::connect(o).await.expect("connect");
    let done = c.checkpoint().await.expect("checkpoint");
    assert_eq!(done.shards.iter().map(|s| s.shard).collect::<Vec<_>>(), vec![0, 1], "{done:?}");
    for s in &done.shards {
        assert!(Path::new(&s.path).exists(), "{done:?}");
        assert!(s.path.contains(&format!("{:020}", done.id)), "{done:?}");
    }
    c.close().await;
    cluster.stop().await;
}

/// A `CheckpointRequest` written by hand from the wire format (`common/src/wire/`): kind 17, the header's
/// length as u32 LE, then the bincode-2 header — `id` 0 (varint), `at` variant 2 (`Step`) and the step
/// 2^62 (varint marker 253, then 8 bytes LE). Before, such a request from any certificate held the
/// checkpoint lock for 20 s while it waited for the step.
fn checkpoint_at_a_far_step() -> Vec<u8> {
    let mut header = vec![0u8, 2, 253];
    header.extend_from_slice(&(1u64 << 62).to_le_bytes());
    let mut frame = vec![17u8];
    frame.extend_from_slice(&(header.len() as u32).to_le_bytes());
    frame.extend_from_slice(&header);
    frame
}

#[test]
fn the_hand_written_checkpoint_request_is_what_the_wire_format_says() {
    use gaps_common::wire::{decode_frame, CheckpointAt, Limits, Message};
    let frame = decode_frame(&checkpoint_at_a_far_step(), &Limits::default()).expect("decodes");
    match frame.msg {
        Message::CheckpointRequest(r) => assert_eq!((r.id, r.at), (0, CheckpointAt::Step(1 << 62))),
        other => panic!("decoded as {other:?}"),
    }
}

/// Scheduled checkpoints under attack: while workers train in sync, a raw client holding a worker
/// certificate keeps asking both shards for a checkpoint at a step that never comes. Every request is
/// refused at once, and the coordinator's schedule goes on: cluster checkpoints keep being written on both
/// shards, none far apart. (Before, three such requests gave 58 s without a cluster checkpoint.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_certificates_checkpoint_requests_are_refused_and_the_schedule_keeps_its_interval() {
    use gaps_common::wire::{decode_frame, Limits, Message};
    let cluster = TwoShards::start("gaps-cluster-ckpt-attack", Mode::Sync).await;
    let (dir, certs, s0, s1) = (&cluster.dir, &cluster.certs, &cluster.s0, &cluster.s1);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut attackers = Vec::new();
    for server in [&s0, &s1] {
        let (tls, addr, stop) = (certs.worker_material().expect("tls"), server.addr, stop.clone());
        attackers.push(tokio::spawn(async move {
            let endpoint = gaps_transport::net::client_endpoint(&tls, addr).expect("endpoint");
            let conn = gaps_transport::net::connect(&endpoint, addr, Duration::from_secs(5)).await.expect("connect");
            let mut refused = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (mut send, mut recv) = conn.open_bi().await.expect("stream");
                send.write_all(&checkpoint_at_a_far_step()).await.expect("write");
                send.finish().expect("finish");
                let reply = tokio::time::timeout(Duration::from_secs(30), recv.read_to_end(1 << 16))
                    .await
                    .expect("answered, not held")
                    .expect("a reply");
                match decode_frame(&reply, &Limits::default()).expect("a frame").msg {
                    Message::Error(e) => assert!(e.message.contains("coordinator"), "{e:?}"),
                    other => panic!("a worker certificate's checkpoint request was taken: {other:?}"),
                }
                refused += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            refused
        }));
    }
    let d = dir.clone();
    train(certs, &s0.advertise, 3, 150, move || {
        let (a, b) = (steps(&d, 0), steps(&d, 1));
        a.iter().filter(|(id, (_, at))| at.is_some() && b.contains_key(id)).count() >= 3
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for a in attackers {
        assert!(a.await.expect("attacker") >= 3, "the attack ran through the training");
    }
    let (a, b) = (steps(dir, 0), steps(dir, 1));
    let at_step: Vec<u64> = a.keys().filter(|id| b.contains_key(id) && a[id].1.is_some()).copied().collect();
    assert!(at_step.len() >= 3, "cluster checkpoints kept being written: shard 0 {a:?}, shard 1 {b:?}");
    // Ids are the milliseconds at which the coordinator asked: consecutive ones of a 200 ms schedule, each
    // held up by one attacker's 20 s wait before, stay far below that.
    let longest = at_step.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    eprintln!("{} cluster checkpoints under attack, longest interval {longest} ms", at_step.len());
    assert!(longest < 10_000, "a cluster checkpoint waited {longest} ms: {at_step:?}");
    cluster.stop().await;
}
