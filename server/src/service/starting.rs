//! A shard process answering the others before it serves (where a majority chooses shard 0's
//! configuration): where it knows the coordinator to be — holding no copy of any shard, since it has just
//! started — and its part in choosing shard 0's configuration. A whole cluster started again thereby
//! chooses who serves shard 0 while every other process waits to join it, and a process that served shard 0
//! learns for certain that the backups of its last configuration hold nothing it lacks (docs/replication.md,
//! "Starting again").

use super::*;

/// Connections answered at once while starting (more are refused).
const MAX_CONNECTIONS: usize = 64;
/// Connections of one certificate answered at once while starting: one peer cannot take every slot.
const MAX_PER_IDENTITY: u32 = 4;
/// How long a handshake may take (a connection that does not finish it gives its slot back).
const HANDSHAKE_WAIT: Duration = Duration::from_secs(2);
/// How long one connection is served while starting.
const CONNECTION_LIFE: Duration = Duration::from_secs(10);
/// Requests answered on one connection while starting.
const REQUESTS_PER_CONNECTION: usize = 64;

/// Connections per certificate under way.
type PerIdentity = Arc<std::sync::Mutex<std::collections::HashMap<PeerIdentity, u32>>>;

/// The answering task, until [`Answering::stop`].
pub(super) struct Answering {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Answering {
    /// Answers on `endpoint` for process `quorum.process()` of `cluster` until stopped.
    pub(super) fn start(endpoint: quinn::Endpoint, quorum: Arc<crate::quorum::Quorum>, cluster: String) -> Self {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(answer(endpoint, quorum, cluster, stopped));
        Answering { stop, task }
    }

    /// Stops answering (the connections under way are cut) before the process serves on the endpoint.
    pub(super) async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn answer(
    endpoint: quinn::Endpoint,
    quorum: Arc<crate::quorum::Quorum>,
    cluster: String,
    mut stopped: watch::Receiver<bool>,
) {
    let mut connections = tokio::task::JoinSet::new();
    let per_identity = PerIdentity::default();
    loop {
        let incoming = tokio::select! {
            _ = stopped.changed() => break,
            // Connections that ended are reaped as others come.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            incoming = endpoint.accept() => incoming,
        };
        let Some(incoming) = incoming else { break };
        if connections.len() >= MAX_CONNECTIONS {
            incoming.refuse();
            continue;
        }
        let (quorum, cluster, per_identity) = (quorum.clone(), cluster.clone(), per_identity.clone());
        connections.spawn(async move {
            let answering = answer_connection(incoming, quorum, &cluster, &per_identity);
            let _ = tokio::time::timeout(CONNECTION_LIFE, answering).await;
        });
    }
    connections.abort_all();
}

async fn answer_connection(
    incoming: quinn::Incoming,
    quorum: Arc<crate::quorum::Quorum>,
    cluster: &str,
    per_identity: &PerIdentity,
) {
    let Ok(Ok(conn)) = tokio::time::timeout(HANDSHAKE_WAIT, incoming).await else { return };
    let identity = match net::peer_identity(&conn) {
        Ok(id) if id.cluster == cluster => id,
        _ => {
            conn.close(3u32.into(), b"refused: not a certificate of this cluster");
            return;
        }
    };
    let Some(_slot) = IdentitySlot::take(per_identity, &identity) else {
        conn.close(4u32.into(), b"refused: this certificate holds its share of a starting process's connections");
        return;
    };
    for _ in 0..REQUESTS_PER_CONNECTION {
        let Ok((mut send, mut recv)) = conn.accept_bi().await else { return };
        // Only the small questions of a start are answered: a request with a payload is refused unread.
        let reply = match net::read_header(&mut recv, &Limits::default()).await {
            Ok(msg) if msg.payload_elems() == 0 => answer_request(&quorum, &identity, &msg).await,
            Ok(msg) => {
                let _ = recv.stop(0u32.into());
                starting_refusal(&quorum, &msg)
            }
            Err(e) => Message::error(ErrorCode::Malformed, e.to_string()),
        };
        if net::write_frame(&mut send, &reply, &[]).await.is_ok() {
            let _ = send.finish();
        }
    }
    conn.close(0u32.into(), b"enough");
}

/// The answer of a process that is starting to `msg` from `identity`.
async fn answer_request(quorum: &Arc<crate::quorum::Quorum>, identity: &PeerIdentity, msg: &Message) -> Message {
    match (msg, &identity.role) {
        (Message::CoordinatorWhere(_), _) => Message::CoordinatorAt(gaps_common::wire::CoordinatorAt {
            config: quorum.chosen(),
            copies: Vec::new(),
            starting: true,
        }),
        (m, Role::Shard(sender)) if crate::quorum::is_quorum_message(m) => quorum.handle_async(*sender, m).await.msg,
        (m, _) => starting_refusal(quorum, m),
    }
}

/// A request a starting process does not answer yet: `Busy` (nothing applied; sent again after a pause).
fn starting_refusal(quorum: &crate::quorum::Quorum, msg: &Message) -> Message {
    let why = format!("shard process {} is starting: it cannot answer {} yet", quorum.process(), net::kind_name(msg));
    Message::error(ErrorCode::Busy, why)
}

/// One connection of a certificate counted while it is answered.
struct IdentitySlot<'a> {
    map: &'a PerIdentity,
    identity: PeerIdentity,
}

impl<'a> IdentitySlot<'a> {
    fn take(map: &'a PerIdentity, identity: &PeerIdentity) -> Option<Self> {
        let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(identity.clone()).or_insert(0);
        if *n >= MAX_PER_IDENTITY {
            return None;
        }
        *n += 1;
        Some(IdentitySlot { map, identity: identity.clone() })
    }
}

impl Drop for IdentitySlot<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.identity);
            }
        }
    }
}
