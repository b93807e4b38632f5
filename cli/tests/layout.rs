//! `gaps layout` and `gaps server --layout` (the `gaps-server` program) as real processes: a user's own
//! layout file is served by two shard processes and trained by a client; bad layout files stop the server
//! with a message that names the problem.

use gaps_common::wire::Role;
use gaps_worker::client::{Client, ClientOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const OWN_MODEL: &str = include_str!("fixtures/own_model.toml");

fn temp_dir(name: &str) -> PathBuf {
    let dir = gaps_common::scratch_dir(&format!("gaps-{name}")).expect("temp dir");
    dir
}

/// A shard process; killed when dropped.
struct Shard(Child);

impl Drop for Shard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `gaps server` and returns it with the address it printed.
fn start_shard(dir: &Path, layout: &Path, index: u32, shards: u32, coordinator: Option<&str>) -> (Shard, String) {
    let path = |f: &str| dir.join(f).display().to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gaps"));
    cmd.args(["server", "--listen", "127.0.0.1:0", "--rule", "sgd"])
        .arg(format!("--shard-index={index}"))
        .arg(format!("--num-shards={shards}"))
        .arg(format!("--layout={}", layout.display()))
        .arg(format!("--ca={}", path("ca.pem")))
        .arg(format!("--cert={}", path(&format!("shard-{index}.pem"))))
        .arg(format!("--key={}", path(&format!("shard-{index}.key"))))
        .env("GAPS_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(c) = coordinator {
        cmd.arg(format!("--coordinator={c}"));
    }
    let mut child = cmd.spawn().expect("start gaps server");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read the listening line");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["event"], "listening", "{line}");
    (Shard(child), v["addr"].as_str().expect("addr").to_string())
}

#[test]
fn gaps_layout_prints_files_the_server_accepts() {
    for (model, json) in [("logreg", false), ("dlrm", false), ("fm", true), ("lr", true)] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gaps"));
        cmd.args(["layout", "--model", model]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("gaps layout");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).expect("utf-8");
        let format = if json { gaps_common::layout_file::Format::Json } else { gaps_common::layout_file::Format::Toml };
        let layout = gaps_common::layout_file::parse(&text, format).unwrap_or_else(|e| panic!("{model}: {e}\n{text}"));
        if model == "dlrm" {
            assert_eq!(layout.tensors[0].shape, vec![32, 13 + 26 * 8], "dlrm.w1 is [hidden, input]");
        }
    }
}

#[test]
fn a_users_layout_file_is_served_by_shard_processes_and_trained() {
    let dir = temp_dir("own-layout");
    gaps_setup::certs::ClusterCerts::generate(&[]).expect("certs").write_to(&dir).expect("write certs");
    let layout = dir.join("own.toml");
    std::fs::write(&layout, OWN_MODEL).expect("layout file");
    let (_s0, coordinator) = start_shard(&dir, &layout, 0, 2, None);
    let (_s1, _) = start_shard(&dir, &layout, 1, 2, Some(&coordinator));

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    runtime.block_on(async {
        let tls = gaps_transport::tls::TlsMaterial::load(
            &dir.join("ca.pem"),
            &dir.join("worker.pem"),
            &dir.join("worker.key"),
        )
        .expect("worker tls");
        let mut opts = ClientOptions::new(&coordinator, tls, Role::Worker, "own-model");
        opts.rpc_timeout = Duration::from_secs(10);
        let client = Client::connect(opts).await.expect("connect");
        let map = client.map().clone();
        assert_eq!(map.layout.tensors[0].shape, vec![4, 6]);
        assert_eq!(client.tensor_rule(0), Some(gaps_kernels::Rule::Nesterov));
        assert_eq!(client.tensor_rule(1), Some(gaps_kernels::Rule::DcAsgd), "its pushes carry the read echo");

        // Minimise ½‖θ − 1‖² over the dense tensors and the rows of 50 ids.
        let ids: Vec<u64> = (1..=50).collect();
        let loss = |dense: &[Vec<f32>], rows: &[f32]| -> f32 {
            dense.iter().flatten().chain(rows).map(|v| 0.5 * (v - 1.0) * (v - 1.0)).sum()
        };
        let start = client.pull().await.expect("pull");
        let rows = client.pull_sparse(0, &ids, true).await.expect("sparse pull");
        let initial = loss(&start.tensors, &rows.values);
        for _ in 0..80 {
            let snapshot = client.pull().await.expect("pull");
            let grads = snapshot.tensors.iter().map(|t| t.iter().map(|v| v - 1.0).collect()).collect();
            client.push(grads, &snapshot).await.expect("push");
            let rows = client.pull_sparse(0, &ids, true).await.expect("sparse pull");
            let grads: Vec<f32> = rows.values.iter().map(|v| v - 1.0).collect();
            client.push_sparse(0, &rows, &grads).await.expect("sparse push");
        }
        let end = client.pull().await.expect("pull");
        let rows = client.pull_sparse(0, &ids, false).await.expect("sparse pull");
        let last = loss(&end.tensors, &rows.values);
        assert!(last < initial / 20.0, "loss {initial} -> {last}");
        client.leave().await.expect("leave");
    });
    // These shards keep no checkpoints: `gaps checkpoint` says so instead of pretending.
    let path = |f: &str| dir.join(f).display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["checkpoint", "--coordinator", &coordinator, "--ca", &path("ca.pem")])
        .args(["--cert", &path("shard-0.pem"), "--key", &path("shard-0.key")])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("gaps checkpoint");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--checkpoint-dir"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_layout_files_stop_the_server_with_the_reason() {
    let dir = temp_dir("bad-layout");
    gaps_setup::certs::ClusterCerts::generate(&[]).expect("certs").write_to(&dir).expect("write certs");
    let cases = [
        ("[[tensor]]\nname = \"w\"\nshape = [3]\nrule = \"adamw\"\n", "adamw"),
        ("[[tensor]]\nname = \"w\"\nshape = [3]\nlr = -1.0\n", "lr"),
        (
            "[[tensor]]\nname = \"w\"\nshape = [3]\n[[table]]\nname = \"e\"\ndim = 4\nrule = \"dana-zero\"\n",
            "per worker",
        ),
        ("[[tensor]]\nname = \"w\"\nshape = [3]\nlearning_rate = 0.1\n", "unknown field"),
        ("[[tensor]]\nname = \"w\"\nshape = [2, 0]\n", "elements"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let layout = dir.join(format!("bad{i}.toml"));
        std::fs::write(&layout, text).expect("write");
        let path = |f: &str| dir.join(f).display().to_string();
        let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
            .args(["server", "--listen", "127.0.0.1:0"])
            .arg(format!("--layout={}", layout.display()))
            .arg(format!("--ca={}", path("ca.pem")))
            .arg(format!("--cert={}", path("shard-0.pem")))
            .arg(format!("--key={}", path("shard-0.key")))
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run gaps server");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text:?} was accepted");
        assert!(stderr.contains(needle), "{text:?}: {stderr}");
    }
    let missing = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["server", "--layout", "/nonexistent/layout.toml", "--ca", "x", "--cert", "x", "--key", "x"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run gaps server");
    assert!(!missing.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gaps_cluster_serves_a_layout_until_stopped_and_prints_a_workers_credentials() {
    let dir = temp_dir("cluster");
    let layout = dir.join("own.toml");
    std::fs::write(&layout, OWN_MODEL).expect("write layout");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["cluster", "--servers", "2", "--server-arg=--rule=sgd"])
        .arg(format!("--layout={}", layout.display()))
        .arg(format!("--dir={}", dir.join("run").display()))
        .env("GAPS_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start gaps cluster");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON line");
    let s = |k: &str| v[k].as_str().unwrap_or_else(|| panic!("{k} in {line}")).to_string();
    // The printed credentials are a worker's, ready for a client.
    let tls = gaps_transport::tls::TlsMaterial::load(s("ca").as_ref(), s("cert").as_ref(), s("key").as_ref())
        .expect("credentials");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut o = ClientOptions::new(s("coordinator"), tls, Role::Worker, "t");
        o.connect_timeout = Duration::from_secs(20);
        let c = Client::connect(o).await.expect("connect");
        assert_eq!(c.map().num_shards, 2);
        let snap = c.pull().await.expect("pull");
        c.push(snap.tensors.iter().map(|t| vec![0.1; t.len()]).collect(), &snap).await.expect("push");
        c.leave().await.expect("leave");
        c.close().await;
    });
    // SIGTERM stops the shards and the command exits cleanly.
    #[allow(unsafe_code)]
    // SAFETY: kill(2) on the child we spawned with a valid signal number.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}
