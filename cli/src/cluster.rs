//! `gaps cluster`: shards for a layout file, kept running until stopped — for pointing a training script
//! (the Python package, your own worker) at a cluster on one machine.

use crate::local::{listening_addr, spawn, terminate, Proc};
use anyhow::{bail, Context, Result};
use gaps_setup::certs::{CertOptions, ClusterCerts};
use std::path::PathBuf;
use std::time::Duration;

/// Flags of `gaps cluster`.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// The layout file every shard serves.
    #[arg(long, env = "GAPS_LAYOUT")]
    pub layout: PathBuf,
    /// Number of shards.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub servers: u32,
    /// Folder for the certificates and the shards' logs (kept); default: a new temporary folder.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Address the shards listen on (ports are picked by the system).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// A flag for every `gaps server`, repeatable: `--server-arg=--rule=adam --server-arg=--lr=0.01`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    pub server_args: Vec<String>,
}

/// Starts the shards, prints one JSON line — `{"event":"cluster","coordinator":…,"dir":…,"ca":…,"cert":…,
/// "key":…}` (a worker's credentials) — and keeps them running until SIGINT or SIGTERM, or until a shard
/// exits (an error, with its log's tail).
pub async fn run(args: &ClusterArgs) -> Result<()> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("gaps-cluster-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let layout = std::fs::canonicalize(&args.layout).with_context(|| format!("finding {}", args.layout.display()))?;
    let certs = ClusterCerts::make(&CertOptions { shards: args.servers, ..CertOptions::default() }, None)?;
    certs.write_to(&dir)?;
    let path = |f: &str| dir.join(f).display().to_string();
    let mut shards: Vec<Proc> = Vec::new();
    let mut coordinator: Option<String> = None;
    let started = async {
        for i in 0..args.servers {
            let mut a = vec![
                "server".to_string(),
                format!("--shard-index={i}"),
                format!("--num-shards={}", args.servers),
                format!("--listen={}:0", args.host),
                format!("--ca={}", path("ca.pem")),
                format!("--cert={}", path(&format!("shard-{i}.pem"))),
                format!("--key={}", path(&format!("shard-{i}.key"))),
                format!("--layout={}", layout.display()),
            ];
            if let Some(c) = &coordinator {
                a.push(format!("--coordinator={c}"));
            }
            a.extend(args.server_args.iter().cloned());
            let mut p = spawn(&exe, &format!("shard-{i}"), &a, &dir)?;
            let (addr, _) = listening_addr(&mut p, Duration::from_secs(60)).await?;
            coordinator.get_or_insert(addr);
            shards.push(p);
        }
        anyhow::Ok(())
    };
    let result = match started.await {
        Ok(()) => {
            let line = crate::reports::ClusterUp {
                event: "cluster".into(),
                coordinator: coordinator.clone(),
                dir: dir.display().to_string(),
                ca: path("ca.pem"),
                cert: path("worker.pem"),
                key: path("worker.key"),
            };
            println!("{}", crate::reports::line(&line));
            eprintln!(
                "[gaps cluster] {} shards serving {}; coordinator {}; worker credentials in {}; Ctrl-C stops them",
                args.servers,
                layout.display(),
                coordinator.as_deref().unwrap_or("?"),
                dir.display()
            );
            wait(&mut shards).await
        }
        Err(e) => Err(e),
    };
    for p in &shards {
        terminate(p);
    }
    for p in shards.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await.is_err() {
            let _ = p.child.start_kill();
        }
    }
    result
}

/// Until SIGINT or SIGTERM (Ok), or a shard exits (an error naming it).
async fn wait(shards: &mut [Proc]) -> Result<()> {
    let stop = async {
        #[cfg(unix)]
        if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        for p in shards.iter_mut() {
            if let Some(status) = p.child.try_wait()? {
                bail!("{} exited ({status}); its log ends with:\n{}", p.name, p.log_tail());
            }
        }
    }
}
