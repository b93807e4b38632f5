//! How a shard process reaches the coordinator (the process serving shard 0): reports of backups in sync,
//! promotions, the cluster map, rollbacks.
//!
//! Without a majority choosing shard 0's configuration ([`crate::quorum::enabled`]) the coordinator is
//! process 0 at the address this process was given, always. With one, it is whoever the last configuration
//! chosen names ([`gaps_common::quorum::CoordinatorConfig`]): this process's acceptor knows the last one it
//! heard of, and when the coordinator it names does not answer or answers `Moved`, the link asks every shard
//! process it knows ([`Message::CoordinatorWhere`]) and adopts the newest configuration any of them knows
//! before it tries once more.

use crate::quorum::Quorum;
use gaps_common::wire::{ErrorCode, Frame, Limits, Message, Register, Role, PROTOCOL_VERSION};
use gaps_transport::net::{self, RpcError};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::info;

/// How long one process is given to say where the coordinator is.
const WHERE_WAIT: Duration = Duration::from_millis(1500);

/// How a shard process reaches the coordinator: its endpoint and client configuration, the cluster the
/// coordinator's certificate must be of, and where the coordinator is.
#[derive(Clone)]
pub struct CoordinatorLink {
    /// The coordinator's address as this process was given it (its own on shard 0): where the coordinator
    /// is without a majority to move it, and the start's configuration with one.
    pub given: String,
    pub cluster: String,
    pub endpoint: quinn::Endpoint,
    /// The client configuration after a certificate rotation (None: the endpoint's own).
    pub rotated: Arc<Mutex<Option<quinn::ClientConfig>>>,
    /// This process's acceptor where a majority chooses shard 0's configuration.
    pub quorum: Option<Arc<Quorum>>,
    /// Every shard process and where it listens, as the coordinator's last map said (asked where the
    /// coordinator is when it does not answer).
    processes: Arc<Mutex<Vec<(u32, String)>>>,
    /// When [`CoordinatorLink::locate_rarely`] last asked.
    located: Arc<Mutex<Option<std::time::Instant>>>,
}

impl std::fmt::Debug for CoordinatorLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorLink").field("coordinator", &self.coordinator()).finish()
    }
}

impl CoordinatorLink {
    /// A link to the coordinator given at `given` (moved by `quorum`'s choices, where there is one).
    pub fn new(
        given: String,
        cluster: String,
        endpoint: quinn::Endpoint,
        rotated: Arc<Mutex<Option<quinn::ClientConfig>>>,
        quorum: Option<Arc<Quorum>>,
    ) -> Self {
        CoordinatorLink {
            given,
            cluster,
            endpoint,
            rotated,
            quorum,
            processes: Arc::new(Mutex::new(Vec::new())),
            located: Arc::new(Mutex::new(None)),
        }
    }

    /// Where the coordinator is as this process knows it: its address and the shard process serving it.
    pub fn coordinator(&self) -> (String, u32) {
        match &self.quorum {
            Some(q) => {
                let c = q.chosen();
                (c.addr, c.serving)
            }
            None => (self.given.clone(), 0),
        }
    }

    /// Connects to `addr`, which must hold shard process `index`'s certificate of the cluster (within 5 s).
    pub async fn connect(&self, addr: &str, index: u32) -> Result<quinn::Connection, RpcError> {
        self.connect_within(addr, index, Duration::from_secs(5)).await
    }

    /// [`CoordinatorLink::connect`] within `within`.
    pub async fn connect_within(
        &self,
        addr: &str,
        index: u32,
        within: Duration,
    ) -> Result<quinn::Connection, RpcError> {
        let target = net::resolve(addr).await?;
        let config = self.rotated.lock().ok().and_then(|c| c.clone());
        let conn = net::connect_with(&self.endpoint, config, target, within).await?;
        net::expect_shard(&conn, &self.cluster, index)?;
        Ok(conn)
    }

    /// One request to shard process `process` at `addr` on a connection of its own (2 s to connect: a
    /// coordinator that does not answer is looked for elsewhere).
    pub async fn call_at(&self, addr: &str, process: u32, msg: &Message, wait: Duration) -> Result<Frame, RpcError> {
        let conn = self.connect_within(addr, process, Duration::from_secs(2).min(wait)).await?;
        let reply = net::call(&conn, msg, &[], &Limits::default(), wait).await;
        conn.close(0u32.into(), b"done");
        reply
    }

    /// Whether shard process `process` at `addr` answers a stats request on a new connection within `within`
    /// (a probe before a takeover: a primary that answers is not taken over).
    pub async fn answers(&self, addr: &str, process: u32, within: Duration) -> bool {
        let probe = Message::StatsRequest(gaps_common::wire::StatsRequest);
        matches!(tokio::time::timeout(within, self.call_at(addr, process, &probe, within)).await, Ok(Ok(_)))
    }

    /// One request to the coordinator on a connection of its own. Where a majority chooses shard 0's
    /// configuration, a coordinator that does not answer (or answers that it no longer serves shard 0) is
    /// looked for anew among the shard processes, and the request goes once more if it moved.
    pub async fn call(&self, msg: &Message) -> Result<Frame, RpcError> {
        let (addr, process) = self.coordinator();
        let first = self.call_at(&addr, process, msg, Duration::from_secs(10)).await;
        match first {
            Err(e) if self.quorum.is_some() && (e.is_retryable() || is_moved(&e)) => {
                if self.locate().await {
                    let (addr, process) = self.coordinator();
                    return self.call_at(&addr, process, msg, Duration::from_secs(10)).await;
                }
                Err(e)
            }
            other => other,
        }
    }

    /// The coordinator's cluster map (as an observer sees it). The processes it lists are remembered (they
    /// are asked where the coordinator is should it move).
    pub async fn map(&self, who: &str) -> Result<gaps_common::wire::ClusterMap, RpcError> {
        let request =
            Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: who.to_string() });
        match self.call(&request).await? {
            Frame { msg: Message::ClusterMap(map), .. } => {
                self.remember(map.process_addrs());
                Ok(map)
            }
            other => Err(RpcError::Unexpected { addr: self.coordinator().0, kind: net::kind_name(&other.msg).into() }),
        }
    }

    /// Remembers where the shard processes listen (from a map, or a core's coordinator tables).
    pub fn remember(&self, processes: Vec<(u32, String)>) {
        if processes.is_empty() {
            return;
        }
        if let Ok(mut p) = self.processes.lock() {
            *p = processes;
        }
    }

    /// The shard processes this link knows, with where they listen.
    pub fn processes(&self) -> Vec<(u32, String)> {
        self.processes.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Asks every shard process this link knows where the coordinator is, and adopts the newest configuration
    /// any of them knows chosen; true when that moved the coordinator. (Without a majority choosing shard 0's
    /// configuration the coordinator never moves: false.)
    pub async fn locate(&self) -> bool {
        let Some(quorum) = &self.quorum else { return false };
        let before = quorum.chosen();
        let peers: Vec<(u32, String)> = self.processes().into_iter().filter(|(p, _)| *p != quorum.process()).collect();
        // With this process's own answer, a majority of the processes is in once half of them answered.
        let enough = (quorum.processes() as usize / 2).max(1);
        let config = self.rotated.lock().ok().and_then(|c| c.clone());
        let newest = net::newest_coordinator(&self.endpoint, config, &self.cluster, &peers, (enough, WHERE_WAIT)).await;
        let Some(newest) = newest.filter(|c| c.version > before.version) else { return false };
        quorum.learn(&newest).await;
        let after = quorum.chosen();
        let moved = (after.serving, &after.addr) != (before.serving, &before.addr);
        if moved {
            info!(version = after.version, serving = after.serving, addr = %after.addr, "the coordinator moved");
        }
        moved
    }

    /// [`CoordinatorLink::locate`] at most once a second (for what a peer's request makes this process ask:
    /// a peer must not make it ask the whole cluster per request); false when it did not ask.
    pub async fn locate_rarely(&self) -> bool {
        {
            let Ok(mut last) = self.located.lock() else { return false };
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return false;
            }
            *last = Some(std::time::Instant::now());
        }
        self.locate().await
    }
}

/// Whether `e` is a shard's answer that another process serves it now.
pub fn is_moved(e: &RpcError) -> bool {
    matches!(e, RpcError::Remote { code: ErrorCode::Moved, .. })
}
