//! The child processes of a local run: started with their logs, their output read as it comes, stopped;
//! the files they leave (checkpoints, step logs).

use super::*;

pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    log: PathBuf,
}

impl Proc {
    pub(crate) fn log_tail(&self) -> String {
        Self::tail_of(&self.log)
    }

    fn tail_of(log: &Path) -> String {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        // The error and its causes matter here, not a backtrace after them.
        let text = text.split("\nStack backtrace:").next().unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

/// Starts `role` (`server` or `worker`) as `gaps ROLE …` from `exe`, or as the dedicated binary when one
/// was given.
pub(super) fn spawn_role(exe: &Path, binary: Option<&Path>, name: &str, args: &[String], dir: &Path) -> Result<Proc> {
    match binary {
        Some(bin) => spawn(bin, name, &args[1..], dir),
        None => spawn(exe, name, args, dir),
    }
}

pub(crate) fn spawn(exe: &Path, name: &str, args: &[String], dir: &Path) -> Result<Proc> {
    let log = dir.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log_file)).kill_on_drop(true);
    // The children get every setting as a flag; stray GAPS_* variables of the caller must not override them.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("GAPS_") && key != "GAPS_LOG" {
            cmd.env_remove(key);
        }
    }
    let child = cmd.spawn().with_context(|| format!("starting {name} ({})", exe.display()))?;
    Ok(Proc { name: name.to_string(), child, log })
}

/// Reads a worker's stdout while it runs, so that its per-step ledger never fills the pipe and stalls it, and
/// keeps only what the report needs: the last ledger line (`"pushes"`) and the summary (`worker_done`), in
/// the order printed. Memory stays bounded however long the run.
///
/// The ledger line comes after every step: the longest time between two of them, of any worker, goes to
/// `longest_step_us`.
pub(super) fn drain_worker_output(
    p: &mut Proc,
    longest_step_us: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<std::io::Result<String>> {
    let stdout = p.child.stdout.take();
    tokio::spawn(async move {
        let Some(stdout) = stdout else { return Ok(String::new()) };
        let mut lines = BufReader::new(stdout).lines();
        let (mut ledger, mut done) = (None, None);
        let mut last_step: Option<Instant> = None;
        while let Some(line) = lines.next_line().await? {
            if line.contains("worker_done") {
                done = Some(line);
            } else if line.contains("\"pushes\"") {
                ledger = Some(line);
                if let Some(t) = last_step.replace(Instant::now()) {
                    let us = t.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
                    longest_step_us.fetch_max(us, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        Ok(ledger.into_iter().chain(done).collect::<Vec<_>>().join("\n"))
    })
}

/// Reads a server's `listening` line: its address and the version it restored, if it restored.
pub(crate) async fn listening_addr(p: &mut Proc, timeout: Duration) -> Result<(String, Option<u64>)> {
    listening_reader(p, timeout)?.await.context("the listening line's reader")?
}

/// A server's address and the version it restored, if it restored.
pub(crate) type Listened = (String, Option<u64>);

/// [`listening_addr`] as a task of its own (a server started again may wait for others to start before it
/// serves; nothing else waits for it meanwhile).
pub(crate) fn listening_reader(p: &mut Proc, timeout: Duration) -> Result<tokio::task::JoinHandle<Result<Listened>>> {
    let stdout = p.child.stdout.take().context("server stdout")?;
    let (name, log) = (p.name.clone(), p.log.clone());
    Ok(tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(timeout, lines.next_line())
            .await
            .map_err(|_| anyhow!("{name} did not report its address within {timeout:?}"))?
            .context("reading server output")?;
        let Some(line) = line else {
            let tail = Proc::tail_of(&log);
            bail!("{name} exited before serving; its log ends with:\n{tail}");
        };
        let v: gaps_server::cli::Listening = serde_json::from_str(&line)
            .with_context(|| format!("{name}'s first line is not its listening line: {line:?}"))?;
        if v.event != gaps_server::cli::Listening::EVENT {
            bail!("{name}'s first line is a {:?} event, not its listening line", v.event);
        }
        Ok((v.addr, v.restored_version))
    }))
}

/// Checkpoint manifests present now, as (shard folder, file name).
pub(super) fn checkpoint_files(dir: &Path) -> Vec<(String, String)> {
    let Ok(shards) = std::fs::read_dir(dir) else { return Vec::new() };
    shards
        .flatten()
        .flat_map(|shard| {
            let folder = shard.file_name().to_string_lossy().to_string();
            std::fs::read_dir(shard.path())
                .into_iter()
                .flatten()
                .flatten()
                .map(|f| f.file_name().to_string_lossy().to_string())
                .filter(|f| f.ends_with(".json"))
                .map(move |f| (folder.clone(), f))
                .collect::<Vec<_>>()
        })
        .collect()
}

pub(crate) fn terminate(p: &Proc) {
    if let Some(pid) = p.child.id() {
        // SIGTERM lets the shard finish in-flight RPCs and close its endpoint cleanly.
        #[allow(unsafe_code)]
        // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory-safety effects.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
}

/// Where worker `w` of a run writes its `--step-log`.
pub(super) fn step_log_part(dir: &Path, w: u32) -> PathBuf {
    dir.join(format!("steps-{w}.csv"))
}

/// Concatenates the workers' step logs into `out` under one header; returns the steps written. A killed
/// worker's log may end in a partial line, which is left out.
pub(super) fn merge_step_logs(dir: &Path, workers: u32, out: &Path) -> Result<u64> {
    let mut text = String::from("worker,seconds\n");
    let mut lines = 0;
    for w in 0..workers {
        let Ok(part) = std::fs::read_to_string(step_log_part(dir, w)) else { continue };
        let complete = part.rfind('\n').map_or("", |end| &part[..end]);
        for line in complete.lines().filter(|l| !l.is_empty() && !l.starts_with("worker")) {
            text.push_str(line);
            text.push('\n');
            lines += 1;
        }
    }
    std::fs::write(out, text).with_context(|| format!("writing the step log {}", out.display()))?;
    Ok(lines)
}
