//! Checkpoint files of a real shard service: written periodically, on demand and at shutdown, restored at
//! start-up with the model, versions and exactly-once windows as they were; a damaged newest checkpoint is
//! skipped for the previous intact one; a damaged checkpoint named explicitly stops the start with the file
//! name.

mod common;

use gaps_common::wire::Role;
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, CheckpointConfig, Restore, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_worker::client::{Client, ClientOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn config(certs: &ClusterCerts, dir: &Path, every: Option<Duration>, restore: Restore) -> ServiceConfig {
    let layout = common::weights_bias_table(300, 5, 64, 4);
    let core = ShardConfig {
        rule: Rule::DanaZero,
        hyper: Hyper { lr: 0.05, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 2, std: 0.1 },
        epoch: 99,
        ..ShardConfig::new(layout)
    };
    ServiceConfig {
        checkpoint: Some(CheckpointConfig { dir: dir.to_path_buf(), every, keep: 2 }),
        restore,
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(core.shard).expect("tls"), core)
    }
}

async fn client(certs: &ClusterCerts, server: &RunningServer, role: Role) -> Client {
    let o = common::options(certs, &server.advertise, role, "t", Duration::from_secs(10));
    Client::connect(o).await.expect("connect")
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("shard-0"))
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_restarts_from_its_newest_intact_checkpoint() {
    let dir = common::fresh_dir("gaps-ckpt-service");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let server =
        service::start(config(&certs, &dir, Some(Duration::from_millis(150)), Restore::Auto)).await.expect("start");
    assert!(server.restored.is_none(), "an empty directory starts fresh");
    let c = client(&certs, &server, Role::Worker).await;
    for _ in 0..10 {
        let s = c.pull().await.expect("pull");
        let g = s.tensors.iter().map(|t| t.iter().map(|v| v * 0.5 + 0.1).collect()).collect();
        c.push(g, &s).await.expect("push");
        let rows = c.pull_sparse(0, &[1, 2, 3], true).await.expect("rows");
        c.push_sparse(0, &rows, &[0.5; 12]).await.expect("sparse push");
    }
    // The schedule writes every 150 ms; the machine's load decides when a write is done, so the test waits
    // for the first one (bounded) instead of sleeping a fixed time. (The schedule itself, which shard
    // checkpoints when, runs on the virtual clock in shard/tests/testnet.rs, `periodic_checkpoints_…`.)
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while server.checkpoints_written() == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(server.checkpoints_written() >= 1, "periodic checkpoints are written");
    // A worker's certificate may not order checkpoints: refused, and nothing is written.
    let before_refusal = server.checkpoints_written();
    match c.checkpoint().await {
        Err(gaps_worker::ClientError::Rpc(gaps_transport::net::RpcError::Remote { code, .. })) => {
            assert_eq!(code, gaps_common::ErrorCode::Unauthorized)
        }
        other => panic!("a worker's checkpoint request must be refused, got {other:?}"),
    }
    assert!(server.unauthorized() >= 1);
    // On demand, through the protocol, with the coordinator's certificate (what `gaps checkpoint` sends).
    let mut o = ClientOptions::new(&server.advertise, certs.shard_material(0).expect("tls"), Role::Observer, "op");
    o.rpc_timeout = Duration::from_secs(10);
    let operator = Client::connect(o).await.expect("connect");
    let written = operator.checkpoint().await.expect("checkpoint on demand");
    assert!(server.checkpoints_written() > before_refusal);
    assert_eq!(written.shards.len(), 1);
    assert_eq!(written.shards[0].shard, 0);
    assert!(Path::new(&written.shards[0].path).exists(), "{written:?}");
    // (Leaving first: under DANA a departing worker's momentum leaves the look-ahead.)
    c.leave().await.expect("leave");
    let before = c.pull().await.expect("pull");
    let rows_before = c.pull_sparse(0, &[1, 2, 3], false).await.expect("rows");
    server.shutdown().await.expect("shutdown writes a final checkpoint");
    // --keep-checkpoints of each kind: cluster checkpoints (the schedule's and the on-demand one) and the
    // shard's own (the final one).
    assert!(files(&dir, "bin").len() <= 4, "only --keep-checkpoints of each kind are kept: {:?}", files(&dir, "bin"));

    // Restart: the model, its versions and the tables come back exactly.
    let server = service::start(config(&certs, &dir, None, Restore::Auto)).await.expect("restart");
    let info = server.restored.clone().expect("restored");
    assert_eq!(info.tensor_versions, vec![10, 10]);
    let observer = client(&certs, &server, Role::Observer).await;
    let after = observer.pull().await.expect("pull");
    assert_eq!(after.tensors, before.tensors, "the DANA look-ahead (θ and S) is as it was");
    assert_eq!(after.versions, before.versions);
    let rows_after = observer.pull_sparse(0, &[1, 2, 3], false).await.expect("rows");
    assert_eq!(rows_after.values, rows_before.values);
    // New workers get new ids: the coordinator's counter was kept, and moved past the ids it may have handed
    // out after the checkpoint (`ShardCore::restarted`), so none is handed out twice.
    let w = client(&certs, &server, Role::Worker).await;
    assert_eq!(w.map().worker_id, Some(1 + gaps_shard::RESTART_ID_GAP));
    w.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");

    // Damage the newest checkpoint: the start skips it for the previous intact one.
    let newest = files(&dir, "bin").pop().expect("a checkpoint");
    let mut bytes = std::fs::read(&newest).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&newest, bytes).expect("write");
    let server = service::start(config(&certs, &dir, None, Restore::Auto)).await.expect("restart");
    let previous = server.restored.clone().expect("restored from the previous checkpoint");
    assert!(
        previous.id < u64::MAX
            && files(&dir, "bin").iter().any(|p| p.to_string_lossy().contains(&format!("{:020}", previous.id)))
    );
    assert_ne!(
        files(&dir, "bin").last().map(|p| p.to_string_lossy().contains(&format!("{:020}", previous.id))),
        Some(true)
    );
    server.shutdown().await.expect("shutdown");

    // Naming a damaged checkpoint explicitly is an error that names the file.
    let err = service::start(config(&certs, &dir, None, Restore::Path(newest.clone()))).await.expect_err("corrupt");
    assert!(format!("{err:#}").contains("checksum"), "{err:#}");
    assert!(format!("{err:#}").contains(&newest.display().to_string()), "{err:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--device cuda` puts the dense state in GPU memory, restored checkpoint included, or stops with the
/// reason where no GPU can be used; `--device auto` then keeps it on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_on_the_gpu_holds_its_state_there_or_stops_with_the_reason() {
    let dir = common::fresh_dir("gaps-ckpt-device");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let gpu = gaps_kernels::cuda::CudaArenas::open(0);
    let cuda =
        ServiceConfig { device: gaps_kernels::cuda::DeviceChoice::Cuda, ..config(&certs, &dir, None, Restore::Auto) };
    match (&gpu, service::start(cuda).await) {
        (Err(_), Err(e)) => {
            let why = format!("{e:#}");
            assert!(why.contains("--device") && why.contains("CUDA"), "{why}");
        }
        (Err(e), Ok(_)) => panic!("--device cuda started although no GPU can be used ({e})"),
        (Ok(_), Err(e)) => panic!("a GPU is present but the shard did not start on it: {e:#}"),
        (Ok(_), Ok(server)) => {
            let device = server.with_core(|c| c.dense_device()).await.expect("core");
            assert_ne!(device, "host");
            server.checkpoint_now().await.expect("a checkpoint reads the GPU");
            server.shutdown().await.expect("shutdown");
        }
    }
    drop(gpu);
    let auto =
        ServiceConfig { device: gaps_kernels::cuda::DeviceChoice::Auto, ..config(&certs, &dir, None, Restore::Auto) };
    let server = service::start(auto).await.expect("--device auto always starts");
    let c = client(&certs, &server, Role::Worker).await;
    assert!(c.pull().await.is_ok());
    drop(c);
    server.shutdown().await.expect("shutdown");
    let _ = std::fs::remove_dir_all(&dir);
}
