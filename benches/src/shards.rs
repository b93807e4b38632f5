//! The shards a transport case runs against: in the bench's own process (the default), or as `gaps server`
//! child processes (`--processes`), as a deployment runs them — then no shard shares a runtime, a thread or
//! a scheduler wake-up with the client, and the CPU they spend is read from `/proc` and counted with the
//! bench's own.

use anyhow::{Context, Result};
use gaps_common::layout::Layout;
use gaps_kernels::Hyper;
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;

/// The hyper-parameters every bench shard runs with: plain updates at a tiny rate (values hardly move), on
/// parameters that start at zero.
const LR: f32 = 1e-6;
const SEED: u64 = 1;

/// Running shards.
pub(crate) enum Shards {
    InProcess(Vec<RunningServer>),
    Processes { children: Vec<tokio::process::Child>, coordinator: String, _dir: Scratch },
}

/// The shards' directory (certificates and keys, the layout, their logs), removed with them however the
/// case ends.
pub(crate) struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Shards {
    /// Starts `shards` shards serving `layout`, each with `replicas` copies; as child processes of the
    /// executable running this, with these `--io-threads`, when `processes` is given.
    pub(crate) async fn start(
        certs: &ClusterCerts,
        shards: u32,
        replicas: u32,
        layout: &Layout,
        processes: Option<u32>,
    ) -> Result<Shards> {
        if let Some(io_threads) = processes {
            return start_processes(certs, shards, replicas, layout, io_threads).await;
        }
        let mut servers: Vec<RunningServer> = Vec::new();
        for s in 0..shards {
            let core = ShardConfig {
                shard: s,
                num_shards: shards,
                hyper: Hyper { lr: LR, momentum: 0.0, weight_decay: 0.0, ..Hyper::default() },
                init: Init { seed: SEED, std: 0.0 },
                lease: Duration::from_secs(60),
                epoch: 7,
                ..ShardConfig::new(layout.clone())
            };
            let cfg = ServiceConfig {
                coordinator: servers.first().map(|s0| s0.advertise.clone()),
                join_timeout: Duration::from_secs(10),
                replicas,
                ..ServiceConfig::new("127.0.0.1:0".parse()?, certs.shard_material(core.shard)?, core)
            };
            servers.push(service::start(cfg).await?);
        }
        // With copies, every push waits for its backup once the backup caught up: measure from then on.
        let started = Instant::now();
        while replicas > 1 && servers.iter().any(|s| s.live_backups() + 1 < replicas as usize) {
            anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "the backups did not catch up in 30 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Shards::InProcess(servers))
    }

    /// The coordinator's address.
    pub(crate) fn coordinator(&self) -> &str {
        match self {
            Shards::InProcess(servers) => &servers[0].advertise,
            Shards::Processes { coordinator, .. } => coordinator,
        }
    }

    /// CPU seconds the shards spent so far beyond this process's own (their processes'; 0 in-process).
    pub(crate) fn outside_cpu_seconds(&self) -> f64 {
        match self {
            Shards::InProcess(_) => 0.0,
            Shards::Processes { children, .. } => children.iter().filter_map(|c| c.id()).map(cpu_seconds_of).sum(),
        }
    }

    /// Shuts the shards down.
    pub(crate) async fn stop(self) -> Result<()> {
        match self {
            Shards::InProcess(servers) => {
                for s in servers {
                    s.shutdown().await?;
                }
            }
            Shards::Processes { mut children, .. } => {
                for c in &mut children {
                    c.kill().await.context("stopping a shard process")?;
                }
            }
        }
        Ok(())
    }
}

/// `gaps server` processes with the in-process shards' settings; each one's address read from the line it
/// prints once it serves.
async fn start_processes(
    certs: &ClusterCerts,
    shards: u32,
    replicas: u32,
    layout: &Layout,
    io_threads: u32,
) -> Result<Shards> {
    anyhow::ensure!(replicas == 1, "--processes runs shards without copies (the _r2 cases run in-process)");
    let scratch = Scratch(gaps_common::scratch_dir("gaps-bench-shards").context("making the shards' directory")?);
    let dir = scratch.0.clone();
    certs.write_to(&dir)?;
    let layout_path = dir.join("layout.toml");
    let text = gaps_common::layout_file::write(layout, gaps_common::layout_file::Format::Toml);
    std::fs::write(&layout_path, text).with_context(|| format!("writing {}", layout_path.display()))?;
    let exe = std::env::current_exe().context("locating the gaps executable")?;
    let mut children = Vec::new();
    let mut coordinator = String::new();
    for s in 0..shards {
        let file = |name: String| dir.join(name).display().to_string();
        let mut args = vec![
            "server".to_owned(),
            format!("--shard-index={s}"),
            format!("--num-shards={shards}"),
            "--listen=127.0.0.1:0".to_owned(),
            format!("--ca={}", file("ca.pem".into())),
            format!("--cert={}", file(format!("shard-{s}.pem"))),
            format!("--key={}", file(format!("shard-{s}.key"))),
            format!("--layout={}", layout_path.display()),
            "--rule=momentum".to_owned(),
            format!("--lr={LR}"),
            "--momentum=0".to_owned(),
            "--init-std=0".to_owned(),
            format!("--seed={SEED}"),
            "--lease=60s".to_owned(),
            format!("--io-threads={io_threads}"),
        ];
        if s > 0 {
            args.push(format!("--coordinator={coordinator}"));
        }
        let log = std::fs::File::create(dir.join(format!("shard-{s}.log"))).context("creating a shard's log")?;
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(&args).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).stderr(log);
        cmd.kill_on_drop(true).env("GAPS_LOG", "warn");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("GAPS_") && key != "GAPS_LOG" {
                cmd.env_remove(key);
            }
        }
        let mut child = cmd.spawn().with_context(|| format!("starting shard {s} ({})", exe.display()))?;
        let stdout = child.stdout.take().context("a shard's stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .with_context(|| format!("shard {s} did not start in 60 s (its log: {})", dir.display()))??
            .with_context(|| format!("shard {s} exited before it served (its log: {})", dir.display()))?;
        let listening: gaps_server::cli::Listening =
            serde_json::from_str(&line).with_context(|| format!("shard {s} printed {line:?}"))?;
        if s == 0 {
            coordinator = listening.addr;
        }
        children.push(child);
    }
    Ok(Shards::Processes { children, coordinator, _dir: scratch })
}

/// User + system CPU seconds process `pid` spent (`/proc/<pid>/stat`; 0 when it cannot be read).
fn cpu_seconds_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // The fields after the command name (which may hold spaces) in parentheses: utime and stime are the
    // 14th and 15th of the line, the 12th and 13th after the name.
    let Some((_, rest)) = stat.rsplit_once(')') else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / clock_ticks_per_second()
}

#[allow(unsafe_code)]
fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_processs_cpu_time_is_read_from_proc() {
        let pid = std::process::id();
        let before = cpu_seconds_of(pid);
        let started = Instant::now();
        let mut x = 1u64;
        // Busy until the kernel's clock (10 ms ticks) has counted some of it.
        while cpu_seconds_of(pid) <= before && started.elapsed() < Duration::from_secs(60) {
            for i in 0..1_000_000u64 {
                x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
            }
        }
        assert!(cpu_seconds_of(pid) > before, "no CPU time read for this process ({x})");
        assert_eq!(cpu_seconds_of(u32::MAX), 0.0, "no such process");
    }
}
