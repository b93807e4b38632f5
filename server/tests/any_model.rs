//! A shard serves any model from a layout file, with per-tensor and per-table rules, trained over real QUIC
//! by a small client; and under many concurrent pushes the buffers a shard holds stay within its in-flight
//! budget.

use gaps_common::layout::Layout;
use gaps_common::wire::Role;
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_worker::client::{Client, ClientOptions};
use std::time::Duration;

/// A model none of the built-in ones has: a momentum matrix, an SGD bias with its own learning rate, a
/// Gap-Aware vector (its pushes carry the read echo, the others' do not), and an Adagrad embedding table.
const LAYOUT: &str = include_str!("fixtures/any_model.toml");

fn config(certs: &ClusterCerts, layout: Layout, shard: u32, shards: u32, coordinator: Option<String>) -> ServiceConfig {
    let core = ShardConfig {
        shard,
        num_shards: shards,
        // The shard-wide defaults differ from every tensor's own settings, so using them would show.
        rule: Rule::Nesterov,
        hyper: Hyper { lr: 0.01, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 3, std: 0.0 },
        epoch: 77,
        sparse: gaps_shard::SparseSettings { init_std: 0.0, ..gaps_shard::SparseSettings::default() },
        ..ShardConfig::new(layout)
    };
    ServiceConfig {
        coordinator,
        join_timeout: Duration::from_secs(10),
        tick_interval: Duration::from_millis(100),
        ..ServiceConfig::new(
            "127.0.0.1:0".parse().expect("addr"),
            certs.shard_material(core.shard).expect("server tls"),
            core,
        )
    }
}

async fn client(certs: &ClusterCerts, coordinator: &str) -> Client {
    let mut o = ClientOptions::new(coordinator, certs.worker_material().expect("worker tls"), Role::Worker, "test");
    o.connect_timeout = Duration::from_secs(5);
    o.rpc_timeout = Duration::from_secs(10);
    Client::connect(o).await.expect("client connects")
}

fn loss(tensors: &[Vec<f32>], target: f32) -> f32 {
    tensors.iter().flatten().map(|v| 0.5 * (v - target) * (v - target)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_file_with_per_tensor_rules_is_served_and_trained() {
    let path = std::env::temp_dir().join(format!("gaps-any-model-{}.toml", std::process::id()));
    std::fs::write(&path, LAYOUT).expect("write layout");
    let layout = gaps_server::cli::load_layout(&path).expect("layout file loads");
    let _ = std::fs::remove_file(&path);
    assert_eq!(layout.tensors[0].shape, vec![8, 4]);

    let certs = ClusterCerts::generate(&[]).expect("certs");
    let s0 = service::start(config(&certs, layout.clone(), 0, 2, None)).await.expect("shard 0");
    let s1 = service::start(config(&certs, layout, 1, 2, Some(s0.advertise.clone()))).await.expect("shard 1");
    let c = client(&certs, &s0.advertise).await;
    assert_eq!(c.tensor_rule(0), Some(Rule::Momentum));
    assert_eq!(c.tensor_rule(2), Some(Rule::GapAware));
    let rules = s1.with_core(|core| (0..3).map(|t| core.tensor_rule(t).map(|(r, h)| (r, h.lr))).collect::<Vec<_>>());
    assert_eq!(
        rules.await.expect("core"),
        vec![Some((Rule::Momentum, 0.1)), Some((Rule::Sgd, 0.5)), Some((Rule::GapAware, 0.2))]
    );

    // One push of the gradient of ½‖θ − 1‖² at θ = 0 (that is, −1 everywhere): the first step of each rule
    // is −η·g with the tensor's own η (momentum and Gap-Aware at zero staleness start as plain steps).
    let target = 1.0f32;
    let snapshot = c.pull().await.expect("pull");
    let grads: Vec<Vec<f32>> = snapshot.tensors.iter().map(|t| t.iter().map(|v| v - target).collect()).collect();
    c.push(grads, &snapshot).await.expect("push");
    let after = c.pull().await.expect("pull");
    for (t, lr) in [(0usize, 0.1f32), (1, 0.5), (2, 0.2)] {
        assert!(after.tensors[t].iter().all(|v| (*v - lr).abs() < 1e-6), "tensor {t}: {:?}", after.tensors[t]);
    }
    // The embedding table: Adagrad's first step is −η·sign(g).
    let ids: Vec<u64> = (0..40).map(|i| i * 7919).collect();
    let rows = c.pull_sparse(0, &ids, true).await.expect("sparse pull");
    let grads: Vec<f32> = rows.values.iter().map(|v| v - target).collect();
    c.push_sparse(0, &rows, &grads).await.expect("sparse push");
    let rows = c.pull_sparse(0, &ids, false).await.expect("sparse pull");
    assert!(rows.values.iter().all(|v| (*v - 0.1).abs() < 1e-5), "adagrad rows: {:?}", &rows.values[..4]);

    // Training to the target works for every part of the model.
    let initial = loss(&after.tensors, target) + loss(std::slice::from_ref(&rows.values), target);
    for _ in 0..60 {
        let snapshot = c.pull().await.expect("pull");
        let grads = snapshot.tensors.iter().map(|t| t.iter().map(|v| v - target).collect()).collect();
        c.push(grads, &snapshot).await.expect("push");
        let rows = c.pull_sparse(0, &ids, true).await.expect("sparse pull");
        let grads: Vec<f32> = rows.values.iter().map(|v| v - target).collect();
        c.push_sparse(0, &rows, &grads).await.expect("sparse push");
    }
    let end = c.pull().await.expect("pull");
    let rows = c.pull_sparse(0, &ids, false).await.expect("sparse pull");
    let dense_final = loss(&end.tensors, target);
    let sparse_final = loss(&[rows.values], target);
    assert!(dense_final + sparse_final < initial / 10.0, "{initial} -> {dense_final} + {sparse_final}");
    assert!(sparse_final < loss(&[vec![0.1; ids.len() * 4]], target) / 10.0, "embedding rows trained");
    for s in [s1, s0] {
        s.shutdown().await.expect("shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pushes_hold_no_more_than_the_in_flight_budget() {
    const ELEMS: u64 = 256 << 10; // 1 MiB of f32 per push
    const BUDGET: u64 = 3 << 20;
    const PUSHES: usize = 24;
    let layout = Layout::new(vec![gaps_common::layout::TensorSpec::new("big", ELEMS)], 1 << 16).expect("layout");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let mut cfg = config(&certs, layout, 0, 1, None);
    cfg.core.rule = Rule::Sgd;
    cfg.inflight_bytes = BUDGET;
    cfg.queue_depth = 2;
    let server: RunningServer = service::start(cfg).await.expect("shard");
    let c = client(&certs, &server.advertise).await;
    let snapshot = c.pull().await.expect("pull");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..PUSHES {
        let (c, snapshot) = (c.clone(), snapshot.clone());
        tasks.spawn(async move { c.push(vec![vec![0.001; ELEMS as usize]], &snapshot).await });
    }
    let mut applied = 0;
    while let Some(done) = tasks.join_next().await {
        applied += done.expect("task").expect("push").applied;
    }
    assert_eq!(applied as usize, PUSHES);
    let stats = server.with_core(|core| core.stats()).await.expect("core");
    assert_eq!(stats.pushes_applied, PUSHES as u64);
    // 24 MiB of pushes arrived at once; the shard held at most its budget of them, and did hold some.
    let peak = server.peak_inflight_bytes();
    assert!(peak <= BUDGET, "held {peak} bytes at once, budget {BUDGET}");
    assert!(peak >= ELEMS * 4, "held {peak} bytes: the pushes were not measured");
    server.shutdown().await.expect("shutdown");
}
