//! QUIC plumbing shared by every gaps process: transport tuning, endpoints with mutual TLS, and frame
//! I/O over one bidirectional stream per RPC.

use crate::identity::{identity_of, PeerIdentity, Role};
use crate::tls::{TlsMaterial, SERVER_NAME};
pub use bytes::Bytes;
use gaps_common::wire::{self, Frame, Limits, Message, WireError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

mod path;
mod payload;
mod read;
pub use path::*;
pub use payload::*;
pub use read::*;

/// Errors of one RPC.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The connection could not be made or broke (worth a retry on a new connection).
    #[error("connection to {addr}: {message}")]
    Connection {
        /// The peer.
        addr: String,
        /// What happened.
        message: String,
    },
    /// The peer sent something that is not a valid frame.
    #[error("bad frame from {addr}: {source}")]
    Wire {
        /// The peer.
        addr: String,
        /// The decoding error.
        source: WireError,
    },
    /// The peer refused the request.
    #[error("{addr} refused the request ({code:?}): {message}")]
    Remote {
        /// The peer.
        addr: String,
        /// Machine-readable reason.
        code: gaps_common::ErrorCode,
        /// Explanation.
        message: String,
    },
    /// The peer did not answer in time.
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout {
        /// The peer.
        addr: String,
        /// The limit.
        timeout: Duration,
    },
    /// The reply does not fit the request (other chunks, another length).
    #[error("{addr} sent a reply that does not fit the request: {message}")]
    BadReply {
        /// The peer.
        addr: String,
        /// What did not fit.
        message: String,
    },
    /// The reply was of the wrong kind.
    #[error("{addr} answered with an unexpected {kind} message")]
    Unexpected {
        /// The peer.
        addr: String,
        /// Kind name.
        kind: String,
    },
    /// The peer's certificate names another identity than expected (another shard, another cluster).
    #[error("{addr}: {message}")]
    Identity {
        /// The peer.
        addr: String,
        /// What was expected and found.
        message: String,
    },
    /// Local TLS or endpoint setup failed.
    #[error("setting up the endpoint: {0}")]
    Setup(String),
}

impl RpcError {
    /// True when the failure is in the transport, so the same request may be sent again on a new connection.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RpcError::Connection { .. } | RpcError::Timeout { .. })
    }
}

/// A connection whose peer sent nothing for this long is closed (keep-alives go every second).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(6);

/// Flow-control windows: enough for a multi-MiB push on a data-centre link (bandwidth × RTT of
/// 25 Gbit/s × 1.3 ms ≈ 4 MiB per stream), small enough that a burst fits the kernel's UDP buffers on the
/// receiving side (see [`SOCKET_BUFFER`]): on loopback, windows of 16/64 MiB measured no faster than
/// 4/16 MiB and let bursts overflow the receive buffer.
pub const STREAM_WINDOW: u32 = 4 << 20;
/// See [`STREAM_WINDOW`].
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// UDP socket buffers asked of the kernel, each way. Linux caps the request at `net.core.rmem_max` /
/// `net.core.wmem_max` (then doubles it for bookkeeping); with 64 KiB datagrams the stock 208 KiB cap
/// holds three of them, so a burst is dropped. Raise the caps (`sysctl -w net.core.rmem_max=8388608
/// net.core.wmem_max=8388608`) on hosts that run shards; the endpoint logs a warning when it got less.
pub const SOCKET_BUFFER: usize = 8 << 20;

/// The settings every gaps connection shares: flow-control windows (see [`STREAM_WINDOW`]), many
/// concurrent streams, keep-alives well under the idle timeout. [`PathTuning::transport_config`] adds the
/// path's datagram size and segmentation offload. Congestion control stays quinn's default (CUBIC): a
/// larger initial window and BBR measured no better on loopback.
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(STREAM_WINDOW));
    t.receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW));
    t.send_window(u64::from(CONNECTION_WINDOW));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(1024));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    // A peer that stops answering (killed, partitioned) is noticed within the idle timeout; keep-alives
    // every second keep healthy but quiet connections open.
    t.keep_alive_interval(Some(Duration::from_secs(1)));
    // Ask the peer to acknowledge within 1 ms (QUIC's ack-frequency extension). With quinn's default 25 ms,
    // synchronous training on loopback was bimodal: whole runs of every worker's step ~14 ms longer (2 × 4
    // workers, 10 ms steps: 4.3 s instead of 2.65 s, about half the runs); with 1 ms, 2.55–2.69 s in every
    // run, and bulk transfers unchanged (`gaps bench transport --only 1shard_16Mi`: 1.22 vs 1.16 GB/s).
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.max_ack_delay(Some(Duration::from_millis(1)));
    t.ack_frequency_config(Some(ack));
    if let Ok(idle) = quinn::IdleTimeout::try_from(IDLE_TIMEOUT) {
        t.max_idle_timeout(Some(idle));
    }
    t
}

fn setup_err(e: impl std::fmt::Display) -> RpcError {
    RpcError::Setup(e.to_string())
}

/// A client-side QUIC configuration presenting this process's certificate.
pub fn client_config(tls: &TlsMaterial, path: &PathTuning) -> Result<quinn::ClientConfig, RpcError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.client_config().map_err(setup_err)?)
        .map_err(setup_err)?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(path.transport_config()));
    Ok(config)
}

/// A server-side QUIC configuration that requires client certificates signed by the cluster CA.
pub fn server_config(tls: &TlsMaterial, path: &PathTuning) -> Result<quinn::ServerConfig, RpcError> {
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls.server_config().map_err(setup_err)?)
        .map_err(setup_err)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(path.transport_config()));
    Ok(config)
}

/// A UDP socket bound to `addr` with kernel buffers of [`SOCKET_BUFFER`] where the host allows them.
pub fn bind_udp(addr: SocketAddr, path: &PathTuning) -> Result<std::net::UdpSocket, RpcError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| setup_err(format!("making a UDP socket for {addr}: {e}")))?;
    // Best effort: the kernel caps the sizes (and says so by what it reports back).
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER);
    let got = sock.recv_buffer_size().unwrap_or(0);
    // Linux reports twice the usable size; wanted: room for a few dozen of the largest datagrams.
    if got / 2 < 32 * usize::from(path.max_udp_payload) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                got_bytes = got,
                wanted_bytes = SOCKET_BUFFER,
                "the kernel capped this UDP socket's receive buffer; bursts of large datagrams may be dropped \
                 and retransmitted: raise net.core.rmem_max and net.core.wmem_max (e.g. to 8388608)"
            );
        });
    }
    sock.bind(&addr.into()).map_err(|e| setup_err(format!("binding {addr}: {e}")))?;
    Ok(sock.into())
}

/// A quinn endpoint on `addr` tuned for `path`, serving with `server` when given.
pub fn endpoint(
    addr: SocketAddr,
    path: &PathTuning,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, RpcError> {
    let socket = bind_udp(addr, path)?;
    let runtime = quinn::default_runtime().ok_or_else(|| setup_err("no async runtime is running"))?;
    quinn::Endpoint::new(path.endpoint_config(), server, socket, runtime)
        .map_err(|e| setup_err(format!("binding {addr}: {e}")))
}

/// A server endpoint on `listen` that requires client certificates signed by the cluster CA. It can also
/// open client connections (shards use that to join the coordinator). Returns the path tuning it chose.
pub fn server_endpoint(listen: SocketAddr, tls: &TlsMaterial) -> Result<(quinn::Endpoint, PathTuning), RpcError> {
    let path = PathTuning::serving(listen);
    let mut endpoint = endpoint(listen, &path, Some(server_config(tls, &path)?))?;
    endpoint.set_default_client_config(client_config(tls, &path)?);
    tracing::info!(
        interface = %path.interface,
        max_udp_payload = path.max_udp_payload,
        segmentation_offload = path.segmentation_offload,
        %listen,
        "UDP path tuned from the interface MTU"
    );
    Ok((endpoint, path))
}

/// A client-only endpoint on an ephemeral port of the right address family, tuned for the route to `peer`.
pub fn client_endpoint(tls: &TlsMaterial, peer: SocketAddr) -> Result<quinn::Endpoint, RpcError> {
    client_endpoint_tuned(tls, peer).map(|(endpoint, _)| endpoint)
}

/// [`client_endpoint`], also returning the path tuning it chose (kept for certificate reloads).
pub fn client_endpoint_tuned(tls: &TlsMaterial, peer: SocketAddr) -> Result<(quinn::Endpoint, PathTuning), RpcError> {
    let bind: SocketAddr = if peer.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().map_err(setup_err)?;
    let path = PathTuning::toward(peer);
    let mut endpoint = endpoint(bind, &path, None)?;
    endpoint.set_default_client_config(client_config(tls, &path)?);
    tracing::debug!(?path, %peer, "client endpoint");
    Ok((endpoint, path))
}

/// Resolves `host:port` to one socket address.
pub async fn resolve(addr: &str) -> Result<SocketAddr, RpcError> {
    let conn_err = |message: String| RpcError::Connection { addr: addr.to_string(), message };
    let mut addrs = tokio::net::lookup_host(addr).await.map_err(|e| conn_err(format!("resolving: {e}")))?;
    addrs.next().ok_or_else(|| conn_err("the name resolves to no address".into()))
}

/// Opens a mutually authenticated connection to a gaps server.
pub async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<quinn::Connection, RpcError> {
    connect_with(endpoint, None, addr, timeout).await
}

/// [`connect`] with `config` instead of the endpoint's default (after a certificate rotation).
pub async fn connect_with(
    endpoint: &quinn::Endpoint,
    config: Option<quinn::ClientConfig>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<quinn::Connection, RpcError> {
    let conn_err = |message: String| RpcError::Connection { addr: addr.to_string(), message };
    let connecting = match config {
        Some(config) => endpoint.connect_with(config, addr, SERVER_NAME),
        None => endpoint.connect(addr, SERVER_NAME),
    }
    .map_err(|e| conn_err(e.to_string()))?;
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(connection_failure(&addr.to_string(), &e)),
        Err(_) => Err(RpcError::Timeout { addr: addr.to_string(), timeout }),
    }
}

/// The name and likely cause of a TLS alert.
fn tls_alert(alert: u8) -> String {
    let (name, hint) = match alert {
        40 => ("handshake_failure", "no common TLS 1.3 parameters"),
        42 => ("bad_certificate", "a certificate is malformed or has the wrong key usage for its role"),
        44 => ("certificate_revoked", "the certificate was revoked"),
        45 => ("certificate_expired", "a certificate has expired or is not yet valid: check the clocks or issue new ones with `gaps certs`"),
        46 => ("certificate_unknown", "a certificate was refused"),
        51 => ("decrypt_error", "a certificate's signature does not verify: it is from another CA (another `gaps certs` run) than the ca.pem this side trusts"),
        48 => ("unknown_ca", "the certificate is not signed by the cluster's CA: use the ca.pem, certificate and key made together by `gaps certs`"),
        116 => ("certificate_required", "the client presented no certificate (every gaps client needs one from the cluster CA)"),
        120 => ("no_application_protocol", "the peer does not speak the gaps protocol (ALPN gaps/1)"),
        _ => ("alert", "see RFC 8446 §6"),
    };
    format!("TLS alert {alert} {name}: {hint}")
}

/// TLS alerts that refuse a certificate: trying again with the same certificates cannot succeed.
const CERTIFICATE_ALERTS: [u8; 7] = [42, 44, 45, 46, 48, 51, 116];

/// A closed connection as an error: [`RpcError::Identity`] (not retried) when a TLS alert refused a
/// certificate — a certificate from another CA, an expired one, none at all — so a client with the wrong
/// files fails at once with the reason; [`RpcError::Connection`] (retried) otherwise.
pub fn connection_failure(addr: &str, e: &quinn::ConnectionError) -> RpcError {
    use quinn::ConnectionError as E;
    let code = match e {
        E::ConnectionClosed(c) => Some(u64::from(c.error_code)),
        E::TransportError(t) => Some(u64::from(t.code)),
        _ => None,
    };
    let refused =
        code.is_some_and(|c| (0x100..0x200).contains(&c) && CERTIFICATE_ALERTS.contains(&((c - 0x100) as u8)));
    let message = describe_connection_error(e);
    if refused {
        RpcError::Identity { addr: addr.to_string(), message }
    } else {
        RpcError::Connection { addr: addr.to_string(), message }
    }
}

/// A connection failure in words: which side refused what, and why, where TLS or the peer said so.
pub fn describe_connection_error(e: &quinn::ConnectionError) -> String {
    use quinn::ConnectionError as E;
    let alert = |code: u64| (0x100..0x200).contains(&code).then(|| (code - 0x100) as u8);
    match e {
        E::ApplicationClosed(c) => {
            format!("the peer closed the connection: {}", String::from_utf8_lossy(&c.reason))
        }
        E::ConnectionClosed(c) => match alert(u64::from(c.error_code)) {
            Some(a) => format!("the peer refused the TLS handshake ({})", tls_alert(a)),
            None => e.to_string(),
        },
        E::TransportError(t) => match alert(u64::from(t.code)) {
            Some(a) => format!("this side refused the peer in the TLS handshake ({}; {})", tls_alert(a), t.reason),
            None => e.to_string(),
        },
        _ => e.to_string(),
    }
}

/// The gaps identity in the certificate the peer of `conn` presented.
pub fn peer_identity(conn: &quinn::Connection) -> Result<PeerIdentity, String> {
    let certs = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok())
        .ok_or_else(|| "the peer presented no certificate".to_string())?;
    let leaf = certs.first().ok_or_else(|| "the peer presented no certificate".to_string())?;
    identity_of(leaf).map_err(|e| e.to_string())
}

/// Checks that the server at the other end of `conn` holds shard `index`'s certificate of `cluster`.
pub fn expect_shard(conn: &quinn::Connection, cluster: &str, index: u32) -> Result<(), RpcError> {
    let addr = conn.remote_address().to_string();
    let refuse = |message: String| {
        conn.close(4u32.into(), b"unexpected server identity");
        RpcError::Identity { addr: addr.clone(), message }
    };
    match peer_identity(conn) {
        Ok(PeerIdentity { cluster: c, role: Role::Shard(i) }) if c == cluster && i == index => Ok(()),
        Ok(other) => {
            Err(refuse(format!("expected shard {index} of cluster {cluster:?}, the server's certificate is {other}")))
        }
        Err(e) => Err(refuse(e)),
    }
}

/// Checks that the server holds some shard process's certificate of `cluster`; returns that process's index
/// (the coordinator may be served by any shard process once a majority moved it).
pub fn expect_any_shard(conn: &quinn::Connection, cluster: &str) -> Result<u32, RpcError> {
    let addr = conn.remote_address().to_string();
    match peer_identity(conn) {
        Ok(PeerIdentity { cluster: c, role: Role::Shard(i) }) if c == cluster => Ok(i),
        other => {
            conn.close(4u32.into(), b"unexpected server identity");
            let message = match other {
                Ok(id) => format!("expected a shard of cluster {cluster:?}, the server's certificate is {id}"),
                Err(e) => e,
            };
            Err(RpcError::Identity { addr, message })
        }
    }
}

/// Asks the shard process at `addr` where the coordinator is ([`Message::CoordinatorWhere`]), all within
/// `wait`: the process that answered — its certificate must be a shard's of `cluster`, and process `expect`'s
/// where given — and its answer: the configuration of shard 0 it knows chosen last, the copies it holds. `config` replaces the endpoint's
/// client configuration (after a certificate rotation).
pub async fn coordinator_where(
    endpoint: &quinn::Endpoint,
    config: Option<quinn::ClientConfig>,
    addr: &str,
    (cluster, expect): (&str, Option<u32>),
    wait: Duration,
) -> Result<(u32, wire::CoordinatorAt), RpcError> {
    let ask = async {
        let target = resolve(addr).await?;
        let conn = connect_with(endpoint, config, target, wait).await?;
        let process = match expect {
            Some(i) => expect_shard(&conn, cluster, i).map(|()| i)?,
            None => expect_any_shard(&conn, cluster)?,
        };
        let msg = Message::CoordinatorWhere(wire::CoordinatorWhere { known: 0 });
        let reply = call(&conn, &msg, &[], &Limits::default(), wait).await;
        conn.close(0u32.into(), b"where");
        match reply?.msg {
            Message::CoordinatorAt(at) => Ok((process, at)),
            other => Err(RpcError::Unexpected { addr: addr.to_string(), kind: kind_name(&other).into() }),
        }
    };
    match tokio::time::timeout(wait, ask).await {
        Ok(answer) => answer,
        Err(_) => Err(RpcError::Timeout { addr: addr.to_string(), timeout: wait }),
    }
}

/// The newest configuration of shard 0 that the shard processes `peers` (process, address) know chosen:
/// all asked at once ([`coordinator_where`], each within `wait`), in once `enough` answered (a dead process
/// is not waited for) or none is left to; None when none answered.
pub async fn newest_coordinator(
    endpoint: &quinn::Endpoint,
    config: Option<quinn::ClientConfig>,
    cluster: &str,
    peers: &[(u32, String)],
    (enough, wait): (usize, Duration),
) -> Option<gaps_common::quorum::CoordinatorConfig> {
    let mut asks = tokio::task::JoinSet::new();
    for (process, addr) in peers.iter().cloned() {
        let (endpoint, config, cluster) = (endpoint.clone(), config.clone(), cluster.to_string());
        asks.spawn(async move {
            let answer = coordinator_where(&endpoint, config, &addr, (&cluster, Some(process)), wait).await;
            if let Err(e) = &answer {
                tracing::debug!(process, %addr, error = %e, "no answer to where the coordinator is");
            }
            answer.ok().map(|(_, at)| at.config)
        });
    }
    let (mut newest, mut answers): (Option<gaps_common::quorum::CoordinatorConfig>, usize) = (None, 0);
    while let Some(joined) = asks.join_next().await {
        if let Ok(Some(c)) = joined {
            answers += 1;
            if newest.as_ref().is_none_or(|n| c.version > n.version) {
                newest = Some(c);
            }
            if answers >= enough {
                break;
            }
        }
    }
    newest
}

/// One RPC on its own stream: send the request, finish, read the reply. An error reply becomes
/// [`RpcError::Remote`].
pub async fn call(
    conn: &quinn::Connection,
    msg: &Message,
    payload: &[Bytes],
    limits: &Limits,
    timeout: Duration,
) -> Result<Frame, RpcError> {
    call_with(conn, msg, payload, limits, timeout, &mut InFrame).await
}

/// [`call`] with the reply's payload going where `sink` says (the returned frame's payload is then
/// empty).
pub async fn call_with(
    conn: &quinn::Connection,
    msg: &Message,
    payload: &[Bytes],
    limits: &Limits,
    timeout: Duration,
    sink: &mut (impl ReplySink + ?Sized),
) -> Result<Frame, RpcError> {
    let addr = conn.remote_address().to_string();
    sink.begin();
    let fut = async {
        // When the connection itself closed, say why (a TLS alert, the peer's reason) rather than how the
        // stream noticed.
        let conn_err = |message: String| match conn.close_reason() {
            Some(reason) => connection_failure(&addr, &reason),
            None => RpcError::Connection { addr: addr.clone(), message },
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| conn_err(e.to_string()))?;
        if let Err(e) = write_frame(&mut send, msg, payload).await {
            // A server that refuses a request before reading it all (busy, too large) answers, then stops
            // the stream: its answer says why better than the write's error does.
            if conn.close_reason().is_none() {
                let answer = tokio::time::timeout(Duration::from_secs(1), read_frame(&mut recv, limits)).await;
                if let Ok(Ok(Frame { msg: Message::Error(refusal), .. })) = answer {
                    return Err(RpcError::Remote { addr: addr.clone(), code: refusal.code, message: refusal.message });
                }
            }
            return Err(conn_err(e.to_string()));
        }
        send.finish().map_err(|e| conn_err(e.to_string()))?;
        let wire_err = |e: WireError| match e {
            WireError::Io(m) => conn_err(m),
            WireError::Truncated { .. } if conn.close_reason().is_some() => conn_err(e.to_string()),
            other => RpcError::Wire { addr: addr.clone(), source: other },
        };
        let reply = read_header(&mut recv, limits).await.map_err(wire_err)?;
        let destination = match &reply {
            Message::Error(_) => None,
            other => sink.destination(other).map_err(|message| RpcError::BadReply { addr: addr.clone(), message })?,
        };
        let frame = match destination {
            None => Frame { payload: read_payload(&mut recv, &reply).await.map_err(wire_err)?, msg: reply },
            Some(mut dest) => {
                let room: u64 = dest.iter().map(|d| d.len() as u64).sum();
                if room != reply.payload_elems() {
                    let n = reply.payload_elems();
                    let message = format!("the reply carries {n} values where {room} were expected");
                    return Err(RpcError::BadReply { addr: addr.clone(), message });
                }
                read_payload_into(&mut recv, &reply, &mut dest).await.map_err(wire_err)?;
                Frame { msg: reply, payload: Vec::new() }
            }
        };
        // The stream's end (in the same datagram as the reply's last bytes as a rule): read, not dropped,
        // so quinn does not ask the peer to stop sending, a packet and its acknowledgement more a call.
        if !matches!(frame.msg, Message::Error(_)) {
            expect_end(&mut recv).await.map_err(wire_err)?;
        }
        match frame.msg {
            Message::Error(e) => Err(RpcError::Remote { addr: addr.clone(), code: e.code, message: e.message }),
            _ => Ok(frame),
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result,
        Err(_) => Err(RpcError::Timeout { addr: addr.clone(), timeout }),
    }
}

/// The message kind as a word, for logs and errors.
pub fn kind_name(msg: &Message) -> &'static str {
    match msg {
        Message::Register(_) => "register",
        Message::RegisterShard(_) => "register-shard",
        Message::ClusterMap(_) => "cluster-map",
        Message::Pull(_) => "pull",
        Message::PullReply(_) => "pull-reply",
        Message::Push(_) => "push",
        Message::PushPart(_) => "push-part",
        Message::PushPull(_) => "push-pull",
        Message::PushPullReply(_) => "push-pull-reply",
        Message::Step(_) => "step",
        Message::StepReply(_) => "step-reply",
        Message::Ack(_) => "ack",
        Message::Error(_) => "error",
        Message::Heartbeat(_) => "heartbeat",
        Message::HeartbeatAck(_) => "heartbeat-ack",
        Message::StatsRequest(_) => "stats-request",
        Message::CheckpointRequest(_) => "checkpoint-request",
        Message::CheckpointDone(_) => "checkpoint-done",
        Message::Authenticate(_) => "authenticate",
        Message::Authenticated(_) => "authenticated",
        Message::Stats(_) => "stats",
        Message::Leave(_) => "leave",
        Message::SparsePull(_) => "sparse-pull",
        Message::SparsePullReply(_) => "sparse-pull-reply",
        Message::SparsePush(_) => "sparse-push",
        Message::Rollback(_) => "rollback",
        Message::RollbackReply(_) => "rollback-reply",
        Message::SplitRequest(_) => "split-request",
        Message::SplitGrant(_) => "split-grant",
        Message::DataStatusRequest(_) => "data-status-request",
        Message::DataStatus(_) => "data-status",
        Message::WaitStep(_) => "wait-step",
        Message::Initialize(_) => "initialize",
        Message::Initialized(_) => "initialized",
        Message::TableScan(_) => "table-scan",
        Message::TableRows(_) => "table-rows",
        Message::TableLoad(_) => "table-load",
        Message::TableLoaded(_) => "table-loaded",
        Message::ReplicaSnapshot(_) => "replica-snapshot",
        Message::ReplicaAppend(_) => "replica-append",
        Message::ReplicaAck(_) => "replica-ack",
        Message::ReplicaReport(_) => "replica-report",
        Message::Promote(_) => "promote",
        Message::ReplicaEpoch(_) => "replica-epoch",
        Message::ConfigPrepare(_) => "config-prepare",
        Message::ConfigPromise(_) => "config-promise",
        Message::ConfigAccept(_) => "config-accept",
        Message::ConfigAccepted(_) => "config-accepted",
        Message::ConfigRefused(_) => "config-refused",
        Message::ConfigChosen(_) => "config-chosen",
        Message::CoordinatorWhere(_) => "coordinator-where",
        Message::CoordinatorAt(_) => "coordinator-at",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::dtype::WireDtype;

    #[test]
    fn sixteen_bit_parts_are_the_bulk_encoding_and_flag_bad_values() {
        let values: Vec<f32> = (0..9001).map(|i| (i as f32 - 4500.0) * 0.013).collect();
        for dtype in [WireDtype::Bf16, WireDtype::F16, WireDtype::F32] {
            let want = gaps_common::dtype::encode_bulk(dtype, &values);
            assert_eq!(&encode_slice(dtype, &values)[..], &want[..], "{dtype}");
            let (bytes, finite) = encode_slice_finite(dtype, &values);
            assert!(finite && bytes[..] == want[..], "{dtype}");
            for pos in [0, 4095, 4096, 9000] {
                let mut bad = values.clone();
                bad[pos] = f32::NAN;
                assert!(!encode_slice_finite(dtype, &bad).1, "{dtype} NaN at {pos}");
            }
        }
        assert!(encode_slice(WireDtype::Bf16, &[]).is_empty());
    }

    #[test]
    fn f32_parts_are_the_values_own_bytes() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.25).collect();
        let bytes = f32_bytes(values.clone());
        assert_eq!(&bytes[..], bytemuck::cast_slice::<f32, u8>(&values), "little-endian bytes, no copy");
        assert_eq!(f32_bytes_copied(&[1.0]), f32_bytes(vec![1.0f32]));
        assert_eq!(dtype_bytes(WireDtype::F32, values.clone()), bytes);
        assert_eq!(dtype_bytes(WireDtype::Bf16, values.clone()).len(), 2000);
    }

    #[test]
    fn payloads_fill_slices_across_chunk_and_section_boundaries() {
        use gaps_common::wire::{ChunkVersion, PayloadDecoder, PullReply};
        let id = gaps_common::ChunkId { tensor: 0, chunk: 0 };
        // Small integers and halves are exact in every format, so the decoded values are the originals.
        let values: Vec<f32> = (0..777).map(|i| (i % 200) as f32 - 100.5).collect();
        let chunks = vec![
            ChunkVersion { id, version: 1, len: 300, dtype: WireDtype::Bf16 },
            ChunkVersion { id, version: 1, len: 77, dtype: WireDtype::F32 },
            ChunkVersion { id, version: 1, len: 400, dtype: WireDtype::F16 },
        ];
        let msg = Message::PullReply(PullReply { chunks });
        let parts = wire::encode_payload(&msg, &values).expect("encode");
        let bytes: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(bytes.len() as u64, msg.payload_bytes());
        assert_eq!(bytes.len(), 300 * 2 + 77 * 4 + 400 * 2);
        // Both ways of writing: through the cache, and past it (as into a destination of megabytes).
        for (cut, streaming) in [1usize, 3, 4, 6, 100, 3108].into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let mut a = vec![0f32; 5];
            let mut b = vec![0f32; 0];
            let mut c = vec![0f32; 772];
            let mut dest: Vec<&mut [f32]> = vec![&mut a, &mut b, &mut c];
            let mut fill = SliceFiller { dest: &mut dest, slice: 0, offset: 0, streaming };
            let mut decoder = PayloadDecoder::new(&msg);
            for part in bytes.chunks(cut) {
                decoder.feed(part, &mut |dtype, run| fill.put(dtype, run));
            }
            assert!(decoder.is_done());
            let joined: Vec<f32> = a.iter().chain(&b).chain(&c).copied().collect();
            assert_eq!(joined, values, "chunks of {cut} bytes, streaming {streaming}");
        }
    }

    /// `/proc/net/route` as Linux writes it: a default route, a /24 and a more specific /28 on another link.
    const ROUTES_V4: &str = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0
jumbo0\t100200C0\t00000000\t0001\t0\t0\t0\tF0FFFFFF\t0\t0\t0
down0\t000010AC\t00000000\t0000\t0\t0\t0\t0000FFFF\t0\t0\t0
";

    #[test]
    fn ipv4_routes_pick_the_longest_up_prefix() {
        let route = |ip: &str| best_route_v4(ROUTES_V4, ip.parse().expect("ip"));
        assert_eq!(route("192.0.2.17").as_deref(), Some("jumbo0"), "192.0.2.16/28 beats 192.0.2.0/24");
        assert_eq!(route("192.0.2.5").as_deref(), Some("eth0"));
        assert_eq!(route("8.8.8.8").as_deref(), Some("eth0"), "the default route");
        assert_eq!(route("172.16.3.4").as_deref(), Some("eth0"), "a route that is not up is skipped");
        assert_eq!(best_route_v4("Iface\tDestination\n", "10.0.0.1".parse().expect("ip")), None);
        assert_eq!(best_route_v4("garbage line\nx y z\n", "10.0.0.1".parse().expect("ip")), None);
    }

    /// `/proc/net/ipv6_route` as Linux writes it (with the kernel's reject route on lo).
    const ROUTES_V6: &str = "\
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
fd000000000000010000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001   jumbo0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000002 00000000 00000003     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";

    #[test]
    fn ipv6_routes_pick_the_longest_up_prefix_and_skip_reject_routes() {
        let route = |ip: &str| best_route_v6(ROUTES_V6, ip.parse().expect("ip"));
        assert_eq!(route("fd00::1:2").as_deref(), Some("eth0"));
        assert_eq!(route("fd00:0:0:1::9").as_deref(), Some("jumbo0"));
        assert_eq!(route("2001:db8::1").as_deref(), Some("eth0"), "the default route, not lo's reject route");
    }

    #[test]
    fn datagram_size_and_offload_follow_the_mtu() {
        let lo = PathTuning::for_mtu(65_536, false, "lo");
        assert_eq!(lo.max_udp_payload, 65_507, "an IPv4 datagram is at most 65,535 bytes");
        assert!(!lo.segmentation_offload, "ten 64 KiB datagrams cannot go in one UDP send");
        let lo6 = PathTuning::for_mtu(65_536, true, "lo");
        assert_eq!(lo6.max_udp_payload, 65_487);
        let jumbo = PathTuning::for_mtu(9000, false, "eth0");
        assert_eq!(jumbo.max_udp_payload, 8972);
        assert!(!jumbo.segmentation_offload);
        let ethernet = PathTuning::for_mtu(1500, false, "eth0");
        assert_eq!(ethernet.max_udp_payload, 1472);
        assert!(ethernet.segmentation_offload, "1,472-byte datagrams batch ten to a send");
        assert_eq!(PathTuning::for_mtu(576, false, "tiny").max_udp_payload, 1200, "QUIC's floor");
        assert_eq!(PathTuning::ethernet("test").max_udp_payload, 1452);
        // The settings are accepted by quinn.
        let _ = lo.transport_config();
        assert_eq!(lo.endpoint_config().get_max_udp_payload_size(), 65_507);
    }

    #[test]
    fn loopback_traffic_uses_the_loopback_interface() {
        // Every Linux host (and network namespace) has lo; where /sys is not mounted the fallback applies.
        let t = PathTuning::toward("127.0.0.1:9".parse().expect("addr"));
        if std::path::Path::new("/sys/class/net/lo/mtu").exists() {
            assert_eq!(route_interface("127.0.0.1".parse().expect("ip")).as_deref(), Some("lo"));
            assert_eq!(t.interface, "lo");
            let mtu = interface_mtu("lo").expect("lo has an MTU");
            assert_eq!(t, PathTuning::for_mtu(mtu, false, "lo"));
        } else {
            assert_eq!(t.max_udp_payload, 1452);
        }
        assert_eq!(interface_mtu("../etc"), None, "names are not paths");
    }
}
