//! One local run in three rooms: the processes started ([`Launch`]), watched and steered while they train
//! ([`Supervisor`]: kills, restarts, added workers, progress), and what they did gathered into the report
//! ([`collect`]). Every process is stopped at the end, whatever happened ([`Procs::stop`]).

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::task::JoinHandle;

mod collect;
mod supervise;
use collect::collect;
use supervise::Supervisor;

/// Runs the cluster in `dir`: certificates and the layout file written there, every process started, trained,
/// stopped and reported on.
pub(super) async fn run_in(
    args: &LocalArgs,
    exe: &Path,
    dir: &Path,
    started: Instant,
    deadline: Instant,
) -> Result<LocalReport> {
    let opts = gaps_setup::certs::CertOptions { shards: args.servers, ..Default::default() };
    let certs = ClusterCerts::make(&opts, None).context("making throwaway certificates")?;
    certs.write_to(dir)?;
    // The shards serve the built-in model through the same layout file a user would write.
    let size = ModelSize { dim: args.dim, embedding_dim: args.embedding_dim, hidden: args.hidden };
    let layout = args.model.layout(&size, args.chunk_elems()).context("building the model layout")?;
    std::fs::write(dir.join("layout.toml"), layout_file::write(&layout, layout_file::Format::Toml))
        .context("writing the layout file")?;
    let checkpoint_dir = match (&args.checkpoint_dir, args.checkpoint_every, args.restart_shards.is_empty()) {
        (Some(d), _, _) => Some(d.clone()),
        (None, Some(_), _) | (None, None, false) => Some(dir.join("checkpoints")),
        (None, None, true) => None,
    };
    let mut launch = Launch { args, exe, dir, checkpoint_dir, coordinator: String::new() };
    let mut procs = Procs::default();
    let outcome = train(&mut launch, &certs, &mut procs, started, deadline).await;
    procs.stop().await;
    let mut report = outcome?;
    report.counters.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Starts the shards, then the workers, supervises them to the end and collects the report.
async fn train(
    launch: &mut Launch<'_>,
    certs: &ClusterCerts,
    procs: &mut Procs,
    started: Instant,
    deadline: Instant,
) -> Result<LocalReport> {
    let args = launch.args;
    eprintln!("[gaps local] starting {} shard(s) and {} worker(s) on 127.0.0.1", args.servers, args.workers);
    let addrs = launch.start_shards(procs).await?;
    let observer_tls = certs.worker_material()?;
    let mut opts = ClientOptions::new(&launch.coordinator, observer_tls, Role::Observer, "gaps-local");
    opts.connect_timeout = Duration::from_secs(30);
    let observer = Client::connect(opts).await.context("connecting to the cluster as an observer")?;
    let eval = Evaluation::prepare(args, &observer)?;
    let initial_loss = match &eval.ctr {
        Some((shape, held)) => {
            evaluate(&observer, shape, &held.samples).await.context("evaluating the initial model")?.0 as f32
        }
        None => eval_loss(
            &eval.data,
            &observer.pull().await.context("pulling the initial model")?.tensors,
            args.eval_samples,
        ),
    };
    eprintln!(
        "[gaps local] cluster up in {:.1}s; initial held-out loss {initial_loss:.4}",
        started.elapsed().as_secs_f64()
    );
    for w in 0..args.workers {
        procs.add_worker(launch, w)?;
    }
    let mut supervisor = Supervisor::new(args, addrs);
    supervisor.supervise(launch, procs, &observer, &eval, started, deadline).await?;
    collect(launch, procs, supervisor, observer, &eval, initial_loss).await
}

/// What every process of a run is started with.
struct Launch<'a> {
    args: &'a LocalArgs,
    /// The `gaps` executable.
    exe: &'a Path,
    /// The run's folder: certificates, layout, logs.
    dir: &'a Path,
    checkpoint_dir: Option<PathBuf>,
    /// Shard 0's address, once it listens.
    coordinator: String,
}

impl Launch<'_> {
    fn path(&self, f: &str) -> String {
        self.dir.join(f).display().to_string()
    }

    /// Starts shard 0, then the others (each told where shard 0 is); returns every shard's address.
    async fn start_shards(&mut self, procs: &mut Procs) -> Result<Vec<String>> {
        let mut s0 = self.server("shard-0", 0, None, "127.0.0.1:0")?;
        self.coordinator = listening_addr(&mut s0, Duration::from_secs(30)).await?.0;
        procs.servers.push(s0);
        let mut addrs = vec![self.coordinator.clone()];
        for s in 1..self.args.servers {
            let mut p = self.server(&format!("shard-{s}"), s, Some(&self.coordinator), "127.0.0.1:0")?;
            addrs.push(listening_addr(&mut p, Duration::from_secs(30)).await?.0);
            procs.servers.push(p);
        }
        Ok(addrs)
    }

    /// Starts the server process `name` for `shard`.
    fn server(&self, name: &str, shard: u32, coordinator: Option<&str>, listen: &str) -> Result<Proc> {
        let flags = self.server_args(shard, coordinator, listen);
        spawn_role(self.exe, self.args.server_bin.as_deref(), name, &flags, self.dir)
    }

    /// Starts worker `w`.
    fn worker(&self, w: u32) -> Result<Proc> {
        spawn_role(self.exe, self.args.worker_bin.as_deref(), &format!("worker-{w}"), &self.worker_args(w), self.dir)
    }

    fn server_args(&self, shard: u32, coordinator: Option<&str>, listen: &str) -> Vec<String> {
        let args = self.args;
        let mut a: Vec<String> = vec![
            "server".into(),
            format!("--shard-index={shard}"),
            format!("--num-shards={}", args.servers),
            format!("--listen={listen}"),
            format!("--ca={}", self.path("ca.pem")),
            format!("--cert={}", self.path(&format!("shard-{shard}.pem"))),
            format!("--key={}", self.path(&format!("shard-{shard}.key"))),
            format!("--layout={}", self.path("layout.toml")),
            format!("--rule={}", args.rule()),
            format!("--lr={}", args.lr()),
            format!("--init-std={}", args.init_std()),
            format!("--device={}", args.device),
            format!("--wire-dtype={}", args.wire_dtype),
            format!("--seed={}", args.seed),
            format!("--lease={}ms", args.lease.as_millis()),
            // Every worker connects from 127.0.0.1 (to each shard one connection a lane, plus its
            // heartbeats' with one lane; a short-lived one to register; the observer and added workers):
            // the per-address limit must not refuse them.
            format!("--max-connections-per-ip={}", ((args.lanes.max(1) + 2) * args.workers + 64).max(512)),
        ];
        if let Some(c) = coordinator {
            a.push(format!("--coordinator={c}"));
        }
        if let Some(d) = &self.checkpoint_dir {
            a.push(format!("--checkpoint-dir={}", d.display()));
        }
        if let Some(every) = args.checkpoint_every {
            a.push(format!("--checkpoint-every={}ms", every.as_millis()));
        }
        if args.replicas > 1 {
            a.push(format!("--replicas={}", args.replicas));
        }
        // The processes keeping a copy of the coordinator need its data cut the same way to copy its dealer.
        let copies_coordinator =
            gaps_server::replication::backed_up_by(shard, args.servers, args.replicas).contains(&0);
        if (shard == 0 || copies_coordinator) && args.deals_data() {
            a.push(format!("--data={}", args.data));
            a.push(format!("--split-lines={}", args.split_lines));
            a.push(format!("--data-epochs={}", args.data_epochs()));
        }
        a.extend(args.hyper.to_flags());
        a.extend(args.tables().to_flags());
        a.extend(args.modes.to_flags());
        a
    }

    fn worker_args(&self, w: u32) -> Vec<String> {
        let args = self.args;
        let mut a: Vec<String> = vec![
            "worker".into(),
            format!("--coordinator={}", self.coordinator),
            format!("--ca={}", self.path("ca.pem")),
            format!("--cert={}", self.path("worker.pem")),
            format!("--key={}", self.path("worker.key")),
            format!("--model={}", args.model.name()),
            format!("--batch={}", args.batch()),
            format!("--data-seed={}", args.seed),
            format!("--data={}", args.data),
            format!("--data-shard={}/{}", w % args.workers, args.workers),
            format!("--data-sharding={}", args.data_sharding),
            format!("--name=worker-{w}"),
            // Hundreds of worker processes starting at once on a small machine take a while to join:
            // a fifth of a second each, 30 s at least.
            format!("--connect-timeout={}ms", (200 * u64::from(args.workers)).max(30_000)),
            format!("--compute-delay={}ms", args.compute_delay().as_millis()),
            format!("--shard-down-timeout={}ms", args.shard_down_timeout.as_millis()),
            format!("--lanes={}", args.lanes),
            "--json".into(),
            "--ledger".into(),
        ];
        a.extend(args.steps().map(|n| format!("--steps={n}")));
        a.extend(args.epochs.map(|n| format!("--epochs={n}")));
        if args.eval_every > 0 {
            a.push(format!("--eval-every={}", args.eval_every));
            a.push(format!("--eval-samples={}", args.eval_samples));
            a.push(format!("--patience={}", args.patience));
        }
        if args.step_log.is_some() {
            a.push(format!("--step-log={}", step_log_part(self.dir, w).display()));
        }
        for st in args.stragglers.iter().filter(|st| st.worker == w) {
            a.push(format!("--slowdown={}", st.factor));
            if let Some(until) = st.until {
                a.push(format!("--slowdown-for={}ms", until.as_millis()));
            }
        }
        a
    }

    /// Shard pushes a worker sends a step: its dense push goes to every shard every step (empty where the
    /// shard owns none of its chunks); a CTR step also pushes embedding rows to every shard (rows spread over
    /// all of them).
    fn pushes_per_step(&self) -> u64 {
        u64::from(self.args.servers) * if self.args.ctr() { 2 } else { 1 }
    }
}

/// Every process of a run, stopped at its end whatever happened.
#[derive(Default)]
struct Procs {
    servers: Vec<Proc>,
    workers: Vec<Proc>,
    /// Each worker's stdout, read as it comes ([`drain_worker_output`]).
    readers: Vec<JoinHandle<std::io::Result<String>>>,
    /// The longest time between two steps of any worker, µs.
    longest_step_us: Arc<AtomicU64>,
}

impl Procs {
    /// Starts worker `w` and reads its output.
    fn add_worker(&mut self, launch: &Launch<'_>, w: u32) -> Result<()> {
        self.workers.push(launch.worker(w)?);
        let longest = self.longest_step_us.clone();
        self.readers.extend(self.workers.last_mut().map(|p| drain_worker_output(p, longest)));
        Ok(())
    }

    /// Stops everything: workers first (only still running after a failure), then shards.
    async fn stop(&mut self) {
        for p in self.workers.iter_mut() {
            let _ = p.child.start_kill();
        }
        for p in &self.servers {
            terminate(p);
        }
        for p in self.servers.iter_mut() {
            match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => eprintln!("[gaps local] {} stopped with {status}", p.name),
                _ => {
                    eprintln!("[gaps local] {} did not stop within 10 s; killing it", p.name);
                    let _ = p.child.kill().await;
                }
            }
        }
    }
}

/// How the model is judged: the synthetic logistic-regression data, or a CTR model's shape and held-out
/// samples.
struct Evaluation {
    data: SyntheticLogreg,
    ctr: Option<(CtrShape, gaps_models::criteo::HeldOut)>,
}

impl Evaluation {
    fn prepare(args: &LocalArgs, observer: &Client) -> Result<Evaluation> {
        let data = SyntheticLogreg::new(args.dim as usize, args.seed);
        let data_spec: DataSpec = match args.data.parse().map_err(anyhow::Error::msg)? {
            DataSpec::Synthetic { .. } => DataSpec::Synthetic { seed: args.seed },
            file => file,
        };
        let ctr = match args.model.ctr() {
            Some(model) => {
                let shape = CtrShape::from_layout(model, observer.layout()).map_err(anyhow::Error::msg)?;
                let held = held_out(&data_spec, args.eval_samples as usize).map_err(anyhow::Error::msg)?;
                Some((shape, held))
            }
            None => None,
        };
        Ok(Evaluation { data, ctr })
    }
}

fn eval_loss(data: &SyntheticLogreg, tensors: &[Vec<f32>], n: u32) -> f32 {
    let (xs, ys) = data.batch(EVAL_BASE, n as usize);
    logreg_loss(tensors, &xs, &ys)
}
