//! Replicated shards over real shard services (`--replicas 2`, docs/replication.md): each shard's primary
//! ships its log to the other process, which keeps a copy; after workers trained through both shards the
//! copy of each shard equals its primary — the same checkpoint bytes at the same log index, the primary's
//! read counters zeroed — in async and in sync, the coordinator's data dealer included.

mod common;

use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::Role;
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::dealer::{DealerConfig, SplitTable};
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::{Init, ShardConfig, ShardCore};
use gaps_worker::client::Client;
use std::time::Duration;

/// One test per mode of a scenario, each named as it is listed: `per_mode!(scenario: name => Mode::Async, …)`.
macro_rules! per_mode {
    ($scenario:ident: $($name:ident => $mode:expr),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $scenario($mode).await;
            }
        )+
    };
}

fn core_config(shard: u32, mode: Mode) -> ShardConfig {
    ShardConfig { num_shards: 2, ..core_config_of(shard, 2, mode) }
}

fn core_config_of(shard: u32, num_shards: u32, mode: Mode) -> ShardConfig {
    let mut adam = TensorSpec::new("b", 70);
    adam.rule.rule = Some("adam".into());
    ShardConfig {
        shard,
        num_shards,
        rule: Rule::Momentum,
        hyper: Hyper { lr: 0.01, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 4, std: 0.1 },
        epoch: 77,
        modes: ModeConfig { mode, ..ModeConfig::default() },
        ..ShardConfig::new(
            Layout::with_tables(
                vec![TensorSpec::new("w", 600), adam],
                64,
                vec![gaps_common::layout::SparseSpec::new("emb", 4)],
            )
            .expect("layout"),
        )
    }
}

async fn start_shard(certs: &ClusterCerts, shard: u32, coordinator: Option<String>, mode: Mode) -> RunningServer {
    let core = core_config(shard, mode);
    let cfg = ServiceConfig {
        coordinator,
        join_timeout: Duration::from_secs(20),
        // One tick at start and none after: once the workers left, the log stands still and the copies can
        // be compared at one index.
        tick_interval: Duration::from_secs(3600),
        replicas: 2,
        data: Some(DealerConfig {
            table: SplitTable::Synthetic { samples_per_split: 100 },
            epochs: None,
            grant_floor: 1 << 32,
        }),
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(shard).expect("tls"), core)
    };
    service::start(cfg).await.expect("start shard")
}

async fn train(certs: &ClusterCerts, coordinator: &str, workers: usize, iterations: usize) {
    let mut tasks = Vec::new();
    for w in 0..workers {
        let o = common::options(certs, coordinator, Role::Worker, "t", Duration::from_secs(20));
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(o).await.expect("connect");
            let mut split = None;
            for i in 0..iterations {
                if i % 10 == 0 {
                    split = c.next_split(split).await.expect("split").split.map(|s| s.grant);
                }
                let s = c.pull().await.expect("pull");
                let g = common::toy_gradients(&s, i, w);
                // Every other iteration a whole step (`Message::Step`): rows pushed, the next rows read (in
                // synchronous training once the step is released, logged for the backups then).
                let ids = |i: usize| (0..6).map(|k| ((i * 5 + k * 7 + w) % 40) as u64).collect::<Vec<_>>();
                if i % 2 == 0 {
                    c.push(g, &s).await.expect("push");
                } else {
                    let rows = c.pull_sparse(0, &ids(i), true).await.expect("rows");
                    let row_grads = vec![0.01f32; rows.values.len()];
                    c.step(g, &s, (0, &rows, &row_grads), Some(&ids(i + 1))).await.expect("step");
                }
            }
            c.leave().await.expect("leave");
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
}

/// The state of checkpoint `bytes` of shard `shard`, with the read counters zeroed.
fn without_reads(shard: u32, mode: Mode, bytes: &[u8]) -> Vec<u8> {
    let mut core = ShardCore::restore(core_config(shard, mode), bytes).expect("restores");
    core.forget_read_counters();
    core.checkpoint_into(0, Vec::new()).expect("checkpoint")
}

async fn copies_equal_their_primaries(mode: Mode) {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let s0 = start_shard(&certs, 0, None, mode).await;
    let s1 = start_shard(&certs, 1, Some(s0.advertise.clone()), mode).await;
    // Each process backs up the other's shard; replies wait for a backup once it caught up.
    both_copies_count(&s0, &s1).await;
    train(&certs, &s0.advertise, 3, 60).await;

    for (primary, backup, shard) in [(&s0, &s1, 0u32), (&s1, &s0, 1u32)] {
        let (index, bytes) = primary.snapshot().await.expect("primary snapshot");
        assert!(index > 100, "shard {shard}'s log holds the training ({index} entries)");
        // Every acknowledged request was applied by the backup before its reply; the last ones (leaves) too.
        let (applied, copy) = backup.replica_copy(shard).expect("a copy");
        assert_eq!(applied, index, "shard {shard}'s backup applied the whole log");
        assert!(
            without_reads(shard, mode, &copy) == without_reads(shard, mode, &bytes),
            "shard {shard}'s copy differs from its primary at entry {index} ({mode:?})"
        );
    }
    s1.shutdown().await.expect("shutdown");
    s0.shutdown().await.expect("shutdown");
}

per_mode!(copies_equal_their_primaries:
    in_async_each_backup_holds_its_primarys_state => Mode::Async,
    in_sync_each_backup_holds_its_primarys_state => Mode::Sync,
);

/// Waits until each of the two shards has its backup counting (replies wait for it), and checks it.
async fn both_copies_count(s0: &RunningServer, s1: &RunningServer) {
    for _ in 0..400 {
        if s0.live_backups() == 1 && s1.live_backups() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!((s0.live_backups(), s1.live_backups()), (1, 1), "both backups live before training");
}

/// `workers` workers that each pull and push `iterations` times (heartbeating, 5 ms apart), returned once
/// `started` steps were taken between them (with the count of steps taken); each ends with its id and the pushes each shard acknowledged.
async fn spawn_workers(
    certs: &ClusterCerts,
    coordinator: &str,
    workers: usize,
    iterations: usize,
    started: usize,
) -> (Vec<tokio::task::JoinHandle<(u32, Vec<u64>)>>, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let progress = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks = (0..workers)
        .map(|w| {
            let mut o = common::options(certs, coordinator, Role::Worker, "t", Duration::from_secs(20));
            o.shard_down_timeout = Duration::from_secs(60);
            let progress = progress.clone();
            tokio::spawn(async move {
                let c = Client::connect(o).await.expect("connect");
                let heartbeats = c.spawn_heartbeats(Duration::from_millis(200));
                for i in 0..iterations {
                    let s = c.pull().await.expect("pull");
                    let g = common::toy_gradients(&s, i, w);
                    c.push(g, &s).await.expect("push");
                    progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                heartbeats.abort();
                let acked = c.pushes_acknowledged_by_shard();
                let id = c.worker_id().expect("a worker id");
                c.leave().await.expect("leave");
                (id, acked)
            })
        })
        .collect();
    while progress.load(std::sync::atomic::Ordering::Relaxed) < started {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (tasks, progress)
}

/// Starts a shard whose backup takes over after `failover_after` of silence (ticks every 100 ms keep a live
/// primary's log flowing).
async fn start_failing_over(
    certs: &ClusterCerts,
    shard: u32,
    coordinator: Option<String>,
    mode: Mode,
) -> RunningServer {
    started(failing_over_config(certs, (shard, 2), coordinator, mode, None)).await
}

/// A shard process started with `cfg`.
async fn started(cfg: ServiceConfig) -> RunningServer {
    service::start(cfg).await.expect("start shard")
}

/// The configuration of a process serving shard `shard` of `num_shards` whose backups take it over after
/// 0.8 s of silence, keeping its state (its acceptor's among it) in `dir` where given.
fn failing_over_config(
    certs: &ClusterCerts,
    (shard, num_shards): (u32, u32),
    coordinator: Option<String>,
    mode: Mode,
    dir: Option<&std::path::Path>,
) -> ServiceConfig {
    let core = core_config_of(shard, num_shards, mode);
    ServiceConfig {
        checkpoint: dir.map(|d| service::CheckpointConfig { dir: d.to_path_buf(), every: None, keep: 2 }),
        coordinator,
        join_timeout: Duration::from_secs(20),
        tick_interval: Duration::from_millis(100),
        replicas: 2,
        failover_after: Duration::from_millis(800),
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(shard).expect("tls"), core)
    }
}

/// Shard 1's process dies (as SIGKILL would have it) while three workers push; its backup on the
/// coordinator's process takes it over; every worker goes on, and the copy that took over holds every push
/// that shard 1 acknowledged, none twice.
async fn a_killed_primarys_backup_takes_over(mode: Mode) {
    a_killed_primarys_backup_takes_over_with(mode, false).await;
}

/// [`a_killed_primarys_backup_takes_over`]; `again`: shard 1's process is started again at once, before
/// its backup took over — it must not serve shard 1 from what it holds (nothing: its backup holds more) but
/// join as a spare and leave the shard to that backup.
async fn a_killed_primarys_backup_takes_over_with(mode: Mode, again: bool) {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    // Started again, shard 1's process joins well before its backup (here) takes over.
    let mut cfg0 = failing_over_config(&certs, (0, 2), None, mode, None);
    if again {
        cfg0.failover_after = Duration::from_secs(4);
    }
    let s0 = service::start(cfg0).await.expect("start shard");
    let s1 = start_failing_over(&certs, 1, Some(s0.advertise.clone()), mode).await;
    both_copies_count(&s0, &s1).await;
    let (tasks, _) = spawn_workers(&certs, &s0.advertise, 3, 120, 90).await;
    // The last pushes reach shard 1 but not its backup before it dies: they must not have been acknowledged
    // (each worker sends them again, to the backup that took over).
    s1.hold_replication(true);
    tokio::time::sleep(Duration::from_millis(150)).await;
    s1.crash();
    let restarted = match again {
        true => {
            let s1 = start_failing_over(&certs, 1, Some(s0.advertise.clone()), mode).await;
            // It joined before the takeover: listed as a spare while shard 1 is still its own — it serves
            // nothing from what it holds.
            let tables = s0.with_core(|c| (c.serving(1), c.spare_processes())).await.expect("the coordinator");
            let (serving, spare) = tables;
            assert_eq!(serving.map(|(_, p, e)| (p, e)), Some((1, 0)), "not taken over yet");
            assert_eq!(spare, [1], "process 1 waits as a spare");
            Some(s1)
        }
        false => None,
    };
    let mut acked = Vec::new();
    for t in tasks {
        acked.push(t.await.expect("a worker trained through the fail-over"));
    }
    let o = common::options(&certs, &s0.advertise, Role::Observer, "o", Duration::from_secs(20));
    let observer = Client::connect(o).await.expect("observer");
    let map = observer.map().clone();
    assert_eq!((map.shards[1].process, map.shards[1].epoch), (0, 1), "shard 1 served by process 0: {map:?}");
    if again {
        assert!(map.spare.iter().any(|s| s.index == 1), "process 1 came back as a spare: {map:?}");
    }
    let stats = observer.stats().await.expect("stats");
    holds_what_it_acknowledged(&stats, 1, &acked, mode);
    if let Some(s1) = restarted {
        s1.shutdown().await.expect("shutdown");
    }
    s0.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_started_again_before_its_backup_took_over_waits_for_it_and_loses_nothing() {
    a_killed_primarys_backup_takes_over_with(Mode::Async, true).await;
}

/// Shard `shard`'s ledger holds, for each worker, exactly the pushes that worker saw it acknowledge (`acked`:
/// worker id, acknowledged per shard), and none applied twice.
fn holds_what_it_acknowledged(stats: &[gaps_common::wire::Stats], shard: usize, acked: &[(u32, Vec<u64>)], mode: Mode) {
    for (worker, by_shard) in acked {
        let held = stats[shard].applied_by_worker.iter().find(|a| a.worker == *worker).map_or(0, |a| a.applied);
        assert_eq!(
            held, by_shard[shard],
            "worker {worker}: shard {shard} holds exactly what it acknowledged ({mode:?})"
        );
    }
    assert_eq!(stats[shard].pushes_applied_twice, 0, "shard {shard} ({mode:?})");
}

per_mode!(a_killed_primarys_backup_takes_over:
    in_async_a_killed_primarys_backup_takes_over_and_loses_nothing => Mode::Async,
    in_sync_a_killed_primarys_backup_takes_over_and_loses_nothing => Mode::Sync,
    in_gba_a_killed_primarys_backup_takes_over_and_loses_nothing => Mode::Gba,
);

/// The coordinator's process dies (as SIGKILL would have it) while three workers push, its last pushes held
/// from its backup; a majority of the other two chooses that backup (process 1) to serve shard 0, which it
/// does from its copy; the workers find it, go on and end; shard 0's copy holds exactly the pushes shard 0
/// acknowledged, none twice, and the other shards lost nothing either.
async fn the_coordinators_backup_takes_over(mode: Mode) {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let s0 = started(failing_over_config(&certs, (0, 3), None, mode, None)).await;
    let s1 = started(failing_over_config(&certs, (1, 3), Some(s0.advertise.clone()), mode, None)).await;
    let s2 = started(failing_over_config(&certs, (2, 3), Some(s0.advertise.clone()), mode, None)).await;
    for _ in 0..400 {
        let counted = [&s0, &s1, &s2].iter().all(|s| s.live_backups() == 1);
        if counted && s2.shard0_config().is_some_and(|c| c.in_sync == [1]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(s2.shard0_config().map(|c| c.in_sync), Some(vec![1]), "shard 0's backup in sync, chosen");
    let (tasks, _) = spawn_workers(&certs, &s0.advertise, 3, 120, 90).await;
    s0.hold_replication(true);
    tokio::time::sleep(Duration::from_millis(150)).await;
    s0.crash();
    let mut acked = Vec::new();
    for t in tasks {
        acked.push(t.await.expect("a worker trained through the coordinator's fail-over"));
    }
    let chosen = s2.shard0_config().expect("a configuration");
    assert_eq!((chosen.serving, chosen.in_sync.clone()), (1, vec![]), "process 1 serves shard 0: {chosen:?}");
    let o = common::options(&certs, &chosen.addr, Role::Observer, "o", Duration::from_secs(20));
    let observer = Client::connect(o).await.expect("an observer registers with the new coordinator");
    let map = observer.map().clone();
    assert_eq!((map.shards[0].process, map.shards[0].epoch), (1, 1), "shard 0 served by process 1: {map:?}");
    let stats = observer.stats().await.expect("stats");
    for shard in 0..3 {
        holds_what_it_acknowledged(&stats, shard, &acked, mode);
    }
    s1.shutdown().await.expect("shutdown");
    s2.shutdown().await.expect("shutdown");
}

per_mode!(the_coordinators_backup_takes_over:
    in_async_the_coordinators_backup_takes_over_and_loses_nothing => Mode::Async,
    in_sync_the_coordinators_backup_takes_over_and_loses_nothing => Mode::Sync,
);

/// Process 0 killed and started again at once, before its backup took shard 0 over: it does not serve shard
/// 0 from what it held (its backup in sync holds more), waits until a majority chose that backup to serve
/// it, and comes back as a spare — one that tells a worker registering through it where the coordinator is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_0_started_again_before_the_takeover_waits_for_it_and_comes_back_as_a_spare() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let dir = common::fresh_dir("gaps-replication-restart-0");
    let start = |shard: u32, coordinator: Option<String>| {
        started(failing_over_config(&certs, (shard, 3), coordinator, Mode::Async, Some(dir.as_path())))
    };
    let s0 = start(0, None).await;
    let s1 = start(1, Some(s0.advertise.clone())).await;
    let s2 = start(2, Some(s0.advertise.clone())).await;
    for _ in 0..400 {
        if s2.shard0_config().is_some_and(|c| c.in_sync == [1]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(s2.shard0_config().map(|c| c.in_sync), Some(vec![1]), "shard 0's backup in sync, chosen");
    s0.crash();
    // Started again with its acceptor's file (configuration 1: process 1 in sync) and process 1 to ask.
    let again = start(0, Some(s1.advertise.clone())).await;
    let now = again.shard0_config().expect("a configuration");
    assert_eq!((now.serving, now.in_sync.clone()), (1, vec![]), "process 1 took shard 0 over: {now:?}");
    assert_eq!(s2.shard0_config().map(|c| c.serving), Some(1));
    // A worker given process 0's address registers with the coordinator it names.
    let o = common::options(&certs, &again.advertise, Role::Worker, "w", Duration::from_secs(10));
    let worker = Client::connect(o).await.expect("registered through the spare");
    assert_eq!((worker.map().shards[0].process, worker.map().shards[0].epoch), (1, 1));
    assert!(worker.map().spare.iter().any(|s| s.index == 0), "process 0 is a spare: {:?}", worker.map().spare);
    let s = worker.pull().await.expect("pull");
    let g = s.tensors.iter().map(|t| vec![0.01; t.len()]).collect();
    worker.push(g, &s).await.expect("a push through the new coordinator");
    for s in [again, s1, s2] {
        s.shutdown().await.expect("shutdown");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The copy of `shard` that `holder` keeps equals the shard's state on `primary` (the shard served there as
/// its own or as one it took over), read until both stand at the same log index (ticks keep the log moving).
async fn copy_matches(holder: &RunningServer, primary: &RunningServer, shard: u32, mode: Mode) {
    for _ in 0..200 {
        let (index, bytes) = match primary.taken_over(shard).await {
            Some((state, _)) => state.expect("the shard taken over"),
            None => primary.snapshot().await.expect("the primary"),
        };
        let Some((applied, copy)) = holder.replica_copy(shard) else { panic!("no copy of shard {shard}") };
        if applied == index {
            assert!(
                without_reads(shard, mode, &copy) == without_reads(shard, mode, &bytes),
                "the copy of shard {shard} differs from its primary at entry {index}"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    panic!("the copy of shard {shard} never stood at its primary's index");
}

/// Shard 1's process is killed and its copy takes shard 1 over; the process is started again, empty: the
/// coordinator tells it its shard is served elsewhere, and it comes back as a spare — serving no shard,
/// keeping copies of shard 0 (as before) and of shard 1 (now served by process 0) — while the workers go
/// on. Both copies count again, and each equals its primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_started_again_keeps_copies_again_while_training_goes_on() {
    let mode = Mode::Async;
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let s0 = start_failing_over(&certs, 0, None, mode).await;
    let s1 = start_failing_over(&certs, 1, Some(s0.advertise.clone()), mode).await;
    both_copies_count(&s0, &s1).await;
    let (tasks, progress) = spawn_workers(&certs, &s0.advertise, 2, 400, 60).await;
    s1.crash();
    for _ in 0..400 {
        if s0.taken_over(1).await.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(s0.taken_over(1).await.is_some(), "process 0 took shard 1 over");
    let before = progress.load(std::sync::atomic::Ordering::Relaxed);
    let again = start_failing_over(&certs, 1, Some(s0.advertise.clone()), mode).await;
    let mut counted = false;
    for _ in 0..400 {
        let taken = s0.taken_over(1).await.map_or(0, |(_, live)| live);
        if s0.live_backups() == 1 && taken == 1 {
            counted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(counted, "the process started again keeps copies that count for shard 0 and shard 1");
    assert!(
        progress.load(std::sync::atomic::Ordering::Relaxed) < 800,
        "training went on while the copies were made ({before} steps before)"
    );
    for t in tasks {
        t.await.expect("a worker trained through the fail-over and the new copies");
    }
    copy_matches(&again, &s0, 0, mode).await;
    copy_matches(&again, &s0, 1, mode).await;
    again.shutdown().await.expect("shutdown");
    s0.shutdown().await.expect("shutdown");
}

/// With three processes a majority chooses shard 0's configuration (docs/replication.md, step 4): the
/// coordinator's backup in sync is chosen once it counts; when that backup dies, the coordinator's replies
/// go on without it only once a majority (itself and process 2) chose the configuration without it. With
/// process 2 dead first, no majority is left when the backup dies: the configuration stays as it was, and a
/// push to shard 0 is refused as busy rather than acknowledged without its copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_0_goes_on_without_its_backup_only_once_a_majority_chose_so() {
    for without_majority in [false, true] {
        let certs = ClusterCerts::generate(&[]).expect("certs");
        let start = |shard: u32, coordinator: Option<String>| {
            let cfg = ServiceConfig {
                coordinator,
                join_timeout: Duration::from_secs(20),
                tick_interval: Duration::from_millis(100),
                replicas: 2,
                replica_ack_timeout: Duration::from_millis(500),
                failover_after: Duration::from_secs(3600),
                request_timeout: Duration::from_secs(3),
                data: Some(DealerConfig {
                    table: SplitTable::Synthetic { samples_per_split: 100 },
                    epochs: None,
                    grant_floor: 1 << 32,
                }),
                ..ServiceConfig::new(
                    "127.0.0.1:0".parse().expect("addr"),
                    certs.shard_material(shard).expect("tls"),
                    core_config_of(shard, 3, Mode::Async),
                )
            };
            async move { service::start(cfg).await.expect("start shard") }
        };
        let s0 = start(0, None).await;
        let s1 = start(1, Some(s0.advertise.clone())).await;
        let s2 = start(2, Some(s0.advertise.clone())).await;
        let config = |s: &RunningServer| s.shard0_config().expect("a majority chooses shard 0's configuration");
        for _ in 0..400 {
            if config(&s0).in_sync == [1] && config(&s2).in_sync == [1] {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!((config(&s0).version, config(&s0).serving, config(&s0).in_sync), (1, 0, vec![1]));
        // Any process tells any certificate where the coordinator is: a worker's asks process 2.
        let asked = coordinator_where(&certs, &s2.advertise).await;
        assert_eq!((asked.version, asked.serving, asked.addr.as_str()), (1, 0, s0.advertise.as_str()), "{asked:?}");
        // A split request goes to the coordinator alone and changes its state (the dealer's loans): its
        // answer waits for shard 0's backups as a push's does.
        let o = common::options(&certs, &s0.advertise, Role::Worker, "t", Duration::from_secs(6));
        let worker = Client::connect(o).await.expect("connect");
        let first = worker.next_split(None).await.expect("a split with every process up").split.expect("a split").grant;
        if without_majority {
            s2.crash();
            s1.crash();
            let refused = worker.next_split(Some(first)).await;
            assert!(refused.is_err(), "shard 0 answered a change its only copy never got: {refused:?}");
            assert_eq!(config(&s0).in_sync, vec![1], "no majority, no new configuration");
            // Nor does it show a worker a map while its backups lack what it logged (a read index): a
            // coordinator cut off from a majority must not send workers after changes nobody else has.
            let map = worker.current_map().await;
            assert!(map.is_err(), "shard 0 showed a worker its map without its backups: {map:?}");
        } else {
            s1.crash();
            for _ in 0..400 {
                if config(&s0).in_sync.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            let chosen = config(&s0);
            assert_eq!((chosen.version, chosen.serving, chosen.in_sync.clone()), (2, 0, vec![]));
            for _ in 0..100 {
                if config(&s2) == chosen {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            assert_eq!(config(&s2), chosen, "process 2 was told");
            worker.next_split(Some(first)).await.expect("shard 0 goes on without its backup");
            s2.shutdown().await.expect("shutdown");
        }
        s0.shutdown().await.expect("shutdown");
    }
}

/// What shard process `addr` answers a worker certificate's [`Message::CoordinatorWhere`] with.
async fn coordinator_where(certs: &ClusterCerts, addr: &str) -> gaps_common::quorum::CoordinatorConfig {
    use gaps_common::wire::{CoordinatorWhere, Limits, Message};
    use gaps_transport::net;
    let tls = certs.worker_material().expect("tls");
    let target = net::resolve(addr).await.expect("address");
    let (endpoint, _) = net::client_endpoint_tuned(&tls, target).expect("endpoint");
    let conn = net::connect(&endpoint, target, Duration::from_secs(5)).await.expect("connect");
    let ask = Message::CoordinatorWhere(CoordinatorWhere { known: 0 });
    let reply = net::call(&conn, &ask, &[], &Limits::default(), Duration::from_secs(5)).await.expect("an answer");
    match reply.msg {
        // A running process answers as running, with the copies it holds (process 1 holds shard 0's).
        Message::CoordinatorAt(at) => {
            assert!(!at.starting, "{at:?}");
            at.config
        }
        other => panic!("answered with {other:?}"),
    }
}
