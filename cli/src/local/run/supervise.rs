//! The run while it trains: kills, restarts and added workers carried out when due, outputs taken, progress
//! shown.

use super::*;

/// Seconds from now until the coordinator's map shows `shard` at a replica epoch above `before` (a backup
/// took it over), asked every 100 ms; None if that did not happen within a minute.
async fn watch_failover(observer: Client, shard: u32, before: u64) -> Option<f64> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Ok(map) = observer.current_map().await {
            if map.shards.get(shard as usize).is_some_and(|s| s.epoch > before) {
                return Some(start.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The run while it trains: the injected failures, restarts and arrivals carried out when due, the workers'
/// outputs taken as they finish, progress shown, until every worker finished and every event happened.
pub(super) struct Supervisor {
    pub(super) training_started: Instant,
    /// Every shard's address (a shard started again listens where it did).
    pub(super) addrs: Vec<String>,
    pub(super) interactive: bool,
    pub(super) last_decile: u64,
    /// Worker kills and additions still to come.
    pub(super) kills: Vec<Kill>,
    pub(super) adds: Vec<Duration>,
    /// Each worker's output once it exited.
    pub(super) outputs: Vec<Option<String>>,
    /// Workers killed.
    pub(super) killed: Vec<usize>,
    /// Shard kills still to come.
    pub(super) shard_kills: Vec<Kill>,
    /// Replicated shards: whether every shard's backups counted once (kills wait for it).
    pub(super) copies_ready: bool,
    /// Per shard, how much later than asked its last kill came (a restart keeps its distance from it).
    pub(super) kill_delay: BTreeMap<u32, Duration>,
    /// Replicated shards: for each shard killed, a task that measures how long until a backup serves it.
    pub(super) failover_watches: Vec<JoinHandle<Option<f64>>>,
    pub(super) shard_restarts_due: Vec<Kill>,
    pub(super) shard_restarts: u32,
    pub(super) restored_version: u64,
    /// How many times each shard was started again (each life keeps its log).
    pub(super) restarts_of: BTreeMap<usize, u32>,
    /// The listening lines of the servers started again, read as they come.
    pub(super) restart_reports: Vec<(usize, JoinHandle<Result<Listened>>)>,
    pub(super) checkpoints_seen: BTreeSet<(String, String)>,
    /// (seconds, AUC, log-loss) of the held-out evaluations during training (`--eval-interval`).
    pub(super) timeline: Vec<(f64, f64, f64)>,
}

impl Supervisor {
    pub(super) fn new(args: &LocalArgs, addrs: Vec<String>) -> Supervisor {
        Supervisor {
            training_started: Instant::now(),
            addrs,
            interactive: std::io::stderr().is_terminal(),
            last_decile: 0,
            kills: args.kill_workers.clone(),
            adds: args.add_workers.clone(),
            outputs: Vec::new(),
            killed: Vec::new(),
            shard_kills: args.kill_shards.clone(),
            copies_ready: false,
            kill_delay: BTreeMap::new(),
            failover_watches: Vec::new(),
            shard_restarts_due: args.restart_shards.clone(),
            shard_restarts: 0,
            restored_version: 0,
            restarts_of: BTreeMap::new(),
            restart_reports: Vec::new(),
            checkpoints_seen: BTreeSet::new(),
            timeline: Vec::new(),
        }
    }

    /// Every tenth of a second until the run is over: events due, outputs, progress.
    pub(super) async fn supervise(
        &mut self,
        launch: &Launch<'_>,
        procs: &mut Procs,
        observer: &Client,
        eval: &Evaluation,
        started: Instant,
        deadline: Instant,
    ) -> Result<()> {
        loop {
            let since = self.training_started.elapsed();
            if let Some(d) = &launch.checkpoint_dir {
                self.checkpoints_seen.extend(checkpoint_files(d));
            }
            self.kill_shards(launch.args, since, procs, observer).await;
            self.restart_shards(launch, since, procs)?;
            self.steer_workers(launch, since, procs)?;
            self.take_outputs(procs).await?;
            if self.finished() {
                break;
            }
            if Instant::now() >= deadline {
                bail!("timed out after {:?} waiting for the workers", started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            self.show_progress(launch, since, observer, eval).await;
        }
        if self.interactive {
            eprintln!();
        }
        Ok(())
    }

    /// Kills the shards due now. With copies, kills wait until every shard's backups count (a copy still
    /// catching up could not take over: the run would not test a fail-over), at the start and after a
    /// restart; bounded by a minute from the start.
    async fn kill_shards(&mut self, args: &LocalArgs, since: Duration, procs: &mut Procs, observer: &Client) {
        let kills_due = self.shard_kills.iter().any(|k| k.at <= since);
        if kills_due && args.replicas > 1 && !self.copies_ready {
            let map = tokio::time::timeout(Duration::from_secs(1), observer.current_map()).await;
            let counted = |m: &gaps_common::wire::ClusterMap| {
                let shard0_listed = args.replicas >= 2 && args.servers >= 3;
                m.shards.iter().filter(|s| s.index != 0 || shard0_listed).all(|s| !s.backups.is_empty())
            };
            self.copies_ready =
                matches!(&map, Ok(Ok(m)) if counted(m)) || self.training_started.elapsed() > Duration::from_secs(60);
        }
        let kills_now: Vec<Kill> = if args.replicas > 1 && !self.copies_ready {
            Vec::new()
        } else {
            self.shard_kills.iter().filter(|k| k.at <= since).cloned().collect()
        };
        // The shards' replica epochs before the kills (a take-over raises one), asked once for all the
        // kills due now (kills due together come together) and for at most 1 s.
        let watched = |k: &Kill| args.replicas > 1 && (k.index != 0 || (args.replicas >= 2 && args.servers >= 3));
        let epochs_before = if kills_now.iter().any(watched) {
            tokio::time::timeout(Duration::from_secs(1), observer.current_map()).await.ok().and_then(Result::ok)
        } else {
            None
        };
        for k in &kills_now {
            // A server started again that is killed before it reported is not waited for.
            self.restart_reports.retain(|(i, r)| {
                let killed = *i == k.index as usize;
                if killed {
                    r.abort();
                }
                !killed
            });
            if let Some(p) = procs.servers.get_mut(k.index as usize) {
                let watched = watched(k);
                let before = epochs_before.as_ref().and_then(|m| m.shards.get(k.index as usize).map(|s| s.epoch));
                eprintln!("[gaps local] killing shard {} (SIGKILL) at {:.1}s", k.index, since.as_secs_f64());
                let _ = p.child.start_kill();
                let _ = p.child.wait().await;
                if watched {
                    // One entry per shard killed, in kill order: unknown when the epoch before was.
                    self.failover_watches.push(match before {
                        Some(before) => tokio::spawn(watch_failover(observer.clone(), k.index, before)),
                        None => tokio::spawn(async { None }),
                    });
                }
            }
        }
        for k in &kills_now {
            self.kill_delay.insert(k.index, since.saturating_sub(k.at));
        }
        self.shard_kills.retain(|k| !kills_now.contains(k));
    }

    /// Starts again the shards due now (a shard is started again only once it was killed).
    fn restart_shards(&mut self, launch: &Launch<'_>, since: Duration, procs: &mut Procs) -> Result<()> {
        let args = launch.args;
        let restarts_now: Vec<Kill> = self
            .shard_restarts_due
            .iter()
            .filter(|k| {
                let delay = self.kill_delay.get(&k.index).copied().unwrap_or_default();
                k.at + delay <= since && !self.shard_kills.iter().any(|x| x.index == k.index && x.at <= k.at)
            })
            .cloned()
            .collect();
        // Every restart due now starts before any is waited for: a whole cluster started again settles who
        // serves shard 0 among its processes before they serve.
        let mut restarted = Vec::new();
        for k in &restarts_now {
            let i = k.index as usize;
            let addr = self.addrs[i].clone();
            eprintln!("[gaps local] restarting shard {i} on {addr} at {:.1}s", since.as_secs_f64());
            // Process 0 restarted where a majority moves the coordinator asks process 1 where it is now.
            let moves = args.replicas >= 2 && args.servers >= 3;
            let coordinator_arg = match i {
                0 if moves => Some(self.addrs[1].as_str()),
                0 => None,
                _ => Some(launch.coordinator.as_str()),
            };
            // A shard started again more than once keeps each life's log.
            let name = match self.restarts_of.entry(i).and_modify(|n| *n += 1).or_insert(1) {
                1 => format!("shard-{i}-restart"),
                n => format!("shard-{i}-restart-{n}"),
            };
            restarted.push((i, launch.server(&name, i as u32, coordinator_arg, &addr)?));
        }
        for (i, mut p) in restarted {
            // A process started again may wait for the others (up to its join timeout, twice: to settle who
            // serves shard 0, then to join) before it serves.
            self.restart_reports.push((i, listening_reader(&mut p, Duration::from_secs(150))?));
            self.shard_restarts += 1;
            procs.servers[i] = p;
        }
        // Kills after a restart wait for the copies to count again (the process started again copies).
        self.copies_ready &= restarts_now.is_empty();
        self.shard_restarts_due.retain(|k| !restarts_now.contains(k));
        Ok(())
    }

    /// Worker kills and arrivals due now.
    fn steer_workers(&mut self, launch: &Launch<'_>, since: Duration, procs: &mut Procs) -> Result<()> {
        for k in self.kills.iter().filter(|k| k.at <= since) {
            if let Some(p) = procs.workers.get_mut(k.index as usize) {
                eprintln!("[gaps local] killing worker {} at {:.1}s", k.index, since.as_secs_f64());
                let _ = p.child.start_kill();
                self.killed.push(k.index as usize);
            }
        }
        self.kills.retain(|k| k.at > since);
        for _ in self.adds.iter().filter(|t| **t <= since) {
            let w = procs.workers.len() as u32;
            eprintln!("[gaps local] adding worker {w} at {:.1}s", since.as_secs_f64());
            procs.add_worker(launch, w)?;
        }
        self.adds.retain(|t| *t > since);
        Ok(())
    }

    /// Takes the output of every worker that exited (one that failed unasked fails the run), and the
    /// listening lines of the servers started again (one that does not come up fails the run).
    async fn take_outputs(&mut self, procs: &mut Procs) -> Result<()> {
        self.outputs.resize(procs.workers.len(), None);
        for (i, p) in procs.workers.iter_mut().enumerate() {
            if self.outputs[i].is_some() {
                continue;
            }
            if let Some(status) = p.child.try_wait().with_context(|| format!("waiting for {}", p.name))? {
                if !status.success() && !self.killed.contains(&i) {
                    bail!("{} failed ({status}); its log ends with:\n{}", p.name, p.log_tail());
                }
                let text = (&mut procs.readers[i]).await.context("worker output reader")?;
                self.outputs[i] = Some(text.with_context(|| format!("reading {}'s output", p.name))?);
            }
        }
        let mut pending = Vec::new();
        for (i, report) in self.restart_reports.drain(..) {
            if !report.is_finished() {
                pending.push((i, report));
                continue;
            }
            let (_, restored) = report.await.context("the listening line's reader")??;
            self.restored_version = self.restored_version.max(restored.unwrap_or(0));
        }
        self.restart_reports = pending;
        Ok(())
    }

    /// Every worker finished and every event happened.
    fn finished(&self) -> bool {
        self.outputs.iter().all(Option::is_some)
            && self.kills.is_empty()
            && self.adds.is_empty()
            && self.shard_kills.is_empty()
            && self.shard_restarts_due.is_empty()
            && self.restart_reports.is_empty()
    }

    /// The held-out evaluation when due (`--eval-interval`), and the pushes applied so far every half second;
    /// both best effort: a shard that is down skips a point and must not hold up the schedule.
    async fn show_progress(&mut self, launch: &Launch<'_>, since: Duration, observer: &Client, eval: &Evaluation) {
        let args = launch.args;
        if let (Some(every), Some((shape, held))) = (args.eval_interval, &eval.ctr) {
            let due = every.as_secs_f64() * (self.timeline.len() + 1) as f64;
            if self.training_started.elapsed().as_secs_f64() >= due {
                let at = self.training_started.elapsed().as_secs_f64();
                if let Ok(Ok((logloss, auc))) =
                    tokio::time::timeout(every.max(Duration::from_secs(1)), evaluate(observer, shape, &held.samples))
                        .await
                {
                    self.timeline.push((at, auc, logloss));
                }
            }
        }
        if since.as_millis() / 500 == self.training_started.elapsed().as_millis() / 500 {
            return;
        }
        let stats = tokio::time::timeout(Duration::from_millis(500), observer.stats()).await;
        let applied: u64 = match stats {
            Ok(Ok(s)) => s.iter().map(|x| x.pushes_applied).sum(),
            _ => 0,
        };
        let expected = args
            .steps()
            .map(|n| u64::from(args.workers + args.add_workers.len() as u32) * n * launch.pushes_per_step());
        match expected {
            Some(expected) => {
                let pct = 100 * applied / expected.max(1);
                if self.interactive {
                    eprint!("\r[gaps local] training: {applied}/{expected} shard pushes applied ({pct}%)   ");
                } else if pct / 10 > self.last_decile {
                    self.last_decile = pct / 10;
                    eprintln!("[gaps local] training: {applied}/{expected} shard pushes applied ({pct}%)");
                }
            }
            None if self.interactive => eprint!("\r[gaps local] training: {applied} shard pushes applied   "),
            None => {}
        }
    }
}
