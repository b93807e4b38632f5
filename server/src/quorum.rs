//! The service's part in choosing shard 0's configuration by a majority of the shard processes
//! (`gaps_common::quorum`, docs/replication.md step 4): each process's acceptor — its state written to
//! its checkpoint folder before it answers, so that a restarted process keeps its promises — and the
//! proposals of the process serving shard 0 (its backups in sync, before its replies stop waiting for one).
//! On with `--replicas` ≥ 2 and at least 3 shard processes; with 2, no majority survives either's loss, and
//! shard 0 keeps its backups as before (dropped without asking; never taken over).

use crate::link::CoordinatorLink;
use anyhow::{anyhow, bail, Context, Result};
use gaps_common::quorum::{Acceptor, CoordinatorConfig, Outcome, Proposer, Refusal, Send};
use gaps_common::wire::{ErrorCode, Frame, Limits, Message};
use gaps_transport::net;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

/// How long a proposer waits for one acceptor's answer.
const ANSWER_WAIT: Duration = Duration::from_millis(1500);

/// Whether a cluster chooses shard 0's configuration by majority.
pub fn enabled(replicas: u32, processes: u32) -> bool {
    replicas >= 2 && processes >= 3
}

/// Whether `msg` is one of the messages that choose shard 0's configuration.
pub fn is_quorum_message(msg: &Message) -> bool {
    matches!(msg, Message::ConfigPrepare(_) | Message::ConfigAccept(_) | Message::ConfigChosen(_))
}

/// This process's acceptor and its proposals.
#[derive(Debug)]
pub struct Quorum {
    process: u32,
    processes: u32,
    acceptor: Mutex<Acceptor>,
    /// The acceptor's last chosen configuration, read without waiting for the acceptor's lock (held across
    /// a file sync).
    chosen: Mutex<CoordinatorConfig>,
    file: Option<PathBuf>,
    /// The highest round this process proposed with (its ballots never repeat: a late phase-2 message of an
    /// earlier proposal could otherwise overwrite a later one's choice).
    last_round: AtomicU64,
    /// One proposal at a time: two at once would take the same round.
    proposing: tokio::sync::Mutex<()>,
    /// Held across a change of shard 0's backups in sync: reading the backups that count, having the
    /// configuration chosen, and acting on it (see [`Quorum::changing`]).
    changes: tokio::sync::Mutex<()>,
}

impl Quorum {
    /// Process `process` of `processes`: its acceptor as its folder `dir` kept it, or a new one that knows
    /// the cluster's start (process 0 serving shard 0 at `coordinator`). Without a folder the state lives in
    /// memory only (a process restarted during a choice could then answer twice; give every process
    /// `--checkpoint-dir`).
    pub fn open(process: u32, processes: u32, coordinator: &str, dir: Option<&Path>) -> Result<Self> {
        let file = dir.map(|d| d.join(format!("quorum-process-{process}.bin")));
        let acceptor = match file.as_ref().filter(|f| f.exists()) {
            Some(f) => {
                let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
                let a = Acceptor::from_bytes(&bytes)
                    .map_err(|e| anyhow!("{}: not an acceptor's state: {e}", f.display()))?;
                info!(process, chosen = ?a.chosen(), "shard 0's configuration as this process last knew it");
                a
            }
            None => Acceptor::new(CoordinatorConfig {
                version: 0,
                serving: 0,
                addr: coordinator.to_string(),
                in_sync: Vec::new(),
            }),
        };
        Ok(Quorum {
            process,
            processes,
            chosen: Mutex::new(acceptor.chosen().clone()),
            acceptor: Mutex::new(acceptor),
            file,
            last_round: AtomicU64::new(0),
            proposing: tokio::sync::Mutex::new(()),
            changes: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Acceptor> {
        // Every change to the acceptor is one call that leaves it whole.
        self.acceptor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Held by whoever changes shard 0's backups in sync, from reading which backups count to acting on the
    /// configuration chosen (a shipping task's report, a rollback that drops every backup): two such changes
    /// interleaved could leave a chosen configuration naming a backup whose replies no longer wait for it.
    pub async fn changing(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changes.lock().await
    }

    /// This process's index.
    pub fn process(&self) -> u32 {
        self.process
    }

    /// How many shard processes vote.
    pub fn processes(&self) -> u32 {
        self.processes
    }

    /// The last configuration of shard 0 this process knows chosen.
    pub fn chosen(&self) -> CoordinatorConfig {
        self.chosen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Adopts `config`, which a shard process knows chosen, if it is newer than the last one this process
    /// knows (kept in the acceptor's file as a `ConfigChosen` from that process would be).
    pub async fn learn(self: &Arc<Self>, config: &CoordinatorConfig) {
        self.handle_async(self.process, &Message::ConfigChosen(config.clone())).await;
    }

    /// Writes the acceptor's state (before any answer that depends on it goes out).
    fn save(&self, a: &Acceptor) -> Result<()> {
        let Some(file) = &self.file else { return Ok(()) };
        let bytes = a.to_bytes();
        let tmp = file.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
            f.write_all(&bytes).and_then(|()| f.sync_all()).with_context(|| format!("writing {}", tmp.display()))?;
        }
        std::fs::rename(&tmp, file).with_context(|| format!("renaming {}", tmp.display()))?;
        // The rename itself must outlive a crash: the folder is synced too.
        if let Some(dir) = file.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .with_context(|| format!("syncing {}", dir.display()))?;
        }
        Ok(())
    }

    /// [`Quorum::handle`] off the async threads (it writes and syncs a file).
    pub async fn handle_async(self: &Arc<Self>, sender: u32, msg: &Message) -> Frame {
        let (this, msg) = (self.clone(), msg.clone());
        tokio::task::spawn_blocking(move || this.handle(sender, &msg)).await.unwrap_or_else(|e| {
            Frame::new(Message::error(ErrorCode::Internal, format!("the acceptor's task failed: {e}")))
        })
    }

    /// Answers a [`is_quorum_message`] request from shard process `sender` (blocking: it writes and syncs
    /// the acceptor's file before answering).
    pub fn handle(&self, sender: u32, msg: &Message) -> Frame {
        let ballot = match msg {
            Message::ConfigPrepare(p) => Some(p.ballot),
            Message::ConfigAccept(x) => Some(x.ballot),
            _ => None,
        };
        if let Some(b) = ballot.filter(|b| b.proposer != sender) {
            let why = format!("shard process {sender} cannot propose under process {}'s ballot", b.proposer);
            return Frame::new(Message::error(ErrorCode::Unauthorized, why));
        }
        let mut a = self.lock();
        let before = a.clone();
        let answer = match msg {
            Message::ConfigPrepare(p) => a.prepare(p).map(Message::ConfigPromise),
            Message::ConfigAccept(x) => a.accept(x).map(Message::ConfigAccepted),
            Message::ConfigChosen(c) => {
                if a.learn(c) {
                    info!(from = sender, version = c.version, serving = c.serving, in_sync = ?c.in_sync, "shard 0's configuration chosen");
                }
                Ok(Message::ConfigChosen(a.chosen().clone()))
            }
            other => Err(Refusal::Invalid(format!("{} does not choose a configuration", net::kind_name(other)))),
        };
        if *a != before {
            if let Err(e) = self.save(&a) {
                // Nothing is answered on a promise that may not outlive a restart.
                *a = before;
                return Frame::new(Message::error(ErrorCode::Internal, format!("keeping the acceptor's state: {e:#}")));
            }
            *self.chosen.lock().unwrap_or_else(|p| p.into_inner()) = a.chosen().clone();
        }
        Frame::new(match answer {
            Ok(m) => m,
            Err(Refusal::Outdated(r)) => Message::ConfigRefused(r),
            Err(Refusal::Invalid(why)) => Message::error(ErrorCode::Misconfigured, why),
        })
    }

    /// Proposes `want` (the version after the last chosen one this process knows, built from it by `want`)
    /// to every process in `peers` (process, address) and this one, until a configuration is chosen for that
    /// version — this one, or one proposed earlier that a majority had accepted — or `within` has passed.
    /// Every process is told what was chosen.
    pub async fn propose(
        self: &Arc<Self>,
        want: impl Fn(&CoordinatorConfig) -> CoordinatorConfig,
        peers: &[(u32, String)],
        link: &CoordinatorLink,
        within: Duration,
    ) -> Result<CoordinatorConfig> {
        let _one = self.proposing.lock().await;
        let (base, promised) = {
            let a = self.lock();
            (a.chosen().clone(), a.promised_round())
        };
        let above = self.last_round.load(Ordering::SeqCst).max(promised);
        let mut proposer =
            Proposer::new(self.process, self.processes, base.clone(), want(&base), above).map_err(|e| anyhow!(e))?;
        let started = std::time::Instant::now();
        let mut next = Send::Prepare(proposer.prepare());
        let outcome = loop {
            if started.elapsed() >= within {
                bail!("no majority of the {} shard processes agreed within {within:?}", self.processes);
            }
            self.last_round.fetch_max(proposer.round(), Ordering::SeqCst);
            let msg = match &next {
                Send::Prepare(p) => Message::ConfigPrepare(p.clone()),
                Send::Accept(a) => Message::ConfigAccept(a.clone()),
                Send::Nothing => unreachable!("set to a message below"),
            };
            let own = self.handle_async(self.process, &msg).await;
            if let Message::Error(e) = &own.msg {
                bail!("this process's own acceptor: {}", e.message);
            }
            let mut answers = vec![(self.process, own)];
            // In once a majority answered with this process's own answer (a peer cut off is not waited for).
            answers.extend(ask_all(link, peers, &msg, self.processes as usize / 2).await);
            let mut accept = None;
            for (from, frame) in answers {
                match frame.msg {
                    Message::ConfigPromise(p) => {
                        if let Send::Accept(a) = proposer.on_promise(from, &p) {
                            accept = Some(a);
                        }
                    }
                    Message::ConfigAccepted(a) => drop(proposer.on_accepted(from, &a)),
                    Message::ConfigRefused(r) => drop(proposer.on_refused(&r)),
                    _ => {}
                }
            }
            match proposer.outcome() {
                Outcome::Pending => {}
                done => break done,
            }
            next = match accept {
                Some(a) => Send::Accept(a),
                None => {
                    // Refused or too few answers: a higher ballot after a pause (two proposers that keep
                    // pre-empting each other drift apart).
                    let pause = 20 + u64::from(self.process) * 17 + (started.elapsed().as_millis() as u64 % 50);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    Send::Prepare(proposer.retry().context("the proposal ended")?)
                }
            };
        };
        let chosen = match outcome {
            Outcome::Chosen(c) | Outcome::Superseded(c) => c,
            Outcome::Pending => unreachable!("left the loop on an outcome"),
        };
        let tell = Message::ConfigChosen(chosen.clone());
        self.handle_async(self.process, &tell).await;
        let (link, peers) = (link.clone(), peers.to_vec());
        tokio::spawn(async move { ask_all(&link, &peers, &tell, usize::MAX).await });
        Ok(chosen)
    }
}

/// What became of a proposal of shard 0's backups in sync ([`Quorum::propose_in_sync`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InSync {
    /// Chosen as proposed (or already the configuration).
    Chosen,
    /// Another process serves shard 0 now: this one must acknowledge nothing more.
    Moved(CoordinatorConfig),
    /// A configuration proposed earlier was chosen for that version instead: propose again.
    Other(CoordinatorConfig),
}

impl Quorum {
    /// This process, serving shard 0 at `addr`, has backups `in_sync` (sorted): chosen, unless the last
    /// configuration it knows is that already and `skip_if_known` (a new configuration that drops a backup
    /// is always proposed: a proposal this process never heard the end of may have been chosen since).
    pub async fn propose_in_sync(
        self: &Arc<Self>,
        in_sync: Vec<u32>,
        addr: String,
        skip_if_known: bool,
        peers: &[(u32, String)],
        link: &CoordinatorLink,
    ) -> Result<InSync> {
        let me = self.process;
        let base = self.chosen();
        if base.serving != me {
            return Ok(InSync::Moved(base));
        }
        if skip_if_known && base.in_sync == in_sync {
            return Ok(InSync::Chosen);
        }
        let want = |base: &CoordinatorConfig| CoordinatorConfig {
            version: base.version.saturating_add(1),
            serving: me,
            addr: addr.clone(),
            in_sync: in_sync.clone(),
        };
        let chosen = self.propose(want, peers, link, PROPOSAL_WAIT).await?;
        Ok(if chosen.serving != me {
            InSync::Moved(chosen)
        } else if chosen.in_sync != in_sync {
            InSync::Other(chosen)
        } else {
            info!(version = chosen.version, in_sync = ?chosen.in_sync, "shard 0's backups in sync, chosen by a majority");
            InSync::Chosen
        })
    }
}

impl Quorum {
    /// Proposes that this process serve shard 0 at `addr` with no backup in sync — a backup in sync taking it
    /// over, or the process serving it at a new address — to `peers` and this one: the configuration chosen
    /// for that version, and whether it is exactly that.
    pub async fn propose_serving(
        self: &Arc<Self>,
        addr: &str,
        peers: &[(u32, String)],
        link: &CoordinatorLink,
    ) -> Result<(CoordinatorConfig, bool)> {
        let me = self.process;
        let want = |base: &CoordinatorConfig| CoordinatorConfig {
            version: base.version.saturating_add(1),
            serving: me,
            addr: addr.to_string(),
            in_sync: Vec::new(),
        };
        let chosen = self.propose(want, peers, link, PROPOSAL_WAIT).await?;
        let mine = chosen.serving == me && chosen.addr == addr;
        Ok((chosen, mine))
    }
}

/// How long one proposal of shard 0's backups waits for a majority of the shard processes.
const PROPOSAL_WAIT: Duration = Duration::from_secs(5);

/// Sends `msg` to every process in `peers` at once; the answers that came within [`ANSWER_WAIT`], returned
/// once `enough` answered (the others are given up).
async fn ask_all(link: &CoordinatorLink, peers: &[(u32, String)], msg: &Message, enough: usize) -> Vec<(u32, Frame)> {
    let mut tasks = tokio::task::JoinSet::new();
    for (process, addr) in peers.iter().cloned() {
        let (link, msg) = (link.clone(), msg.clone());
        tasks.spawn(async move {
            let call = async {
                let conn = link.connect(&addr, process).await?;
                let reply = net::call(&conn, &msg, &[], &Limits::default(), ANSWER_WAIT).await;
                conn.close(0u32.into(), b"done");
                reply
            };
            match tokio::time::timeout(ANSWER_WAIT, call).await {
                Ok(Ok(frame)) => Some((process, frame)),
                Ok(Err(e)) => {
                    tracing::debug!(process, %addr, error = %e, "no answer about shard 0's configuration");
                    None
                }
                Err(_) => None,
            }
        });
    }
    let mut out = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Some(answer)) => {
                out.push(answer);
                if out.len() >= enough {
                    break;
                }
            }
            Ok(None) => {}
            Err(e) => warn!(error = %e, "a request about shard 0's configuration failed"),
        }
    }
    out
}
