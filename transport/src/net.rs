//! QUIC plumbing shared by every gaps process: transport tuning, endpoints with mutual TLS, and frame
//! I/O over one bidirectional stream per RPC.

use crate::identity::{identity_of, PeerIdentity, Role};
use crate::tls::{TlsMaterial, SERVER_NAME};
use gaps_common::wire::{self, Frame, Limits, Message, WireError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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

/// Transport settings sized for multi-MiB tensors: flow-control windows large enough that a many-MiB push
/// is not throttled by the receiver on a data-centre link (bandwidth × RTT of 25 Gbit/s × 5 ms ≈ 16 MiB),
/// many concurrent streams, keep-alives well under the idle timeout. Congestion control and MTU discovery
/// stay at quinn's defaults: a larger initial window, BBR, and a 64 KiB MTU probe ceiling all measured no
/// better on loopback (see README, transport bench).
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let stream_window: u32 = 16 << 20;
    let conn_window: u32 = 64 << 20;
    t.stream_receive_window(quinn::VarInt::from_u32(stream_window));
    t.receive_window(quinn::VarInt::from_u32(conn_window));
    t.send_window(u64::from(conn_window));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(1024));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    // A peer that stops answering (killed, partitioned) is noticed within the idle timeout; keep-alives
    // every second keep healthy but quiet connections open.
    t.keep_alive_interval(Some(Duration::from_secs(1)));
    if let Ok(idle) = quinn::IdleTimeout::try_from(IDLE_TIMEOUT) {
        t.max_idle_timeout(Some(idle));
    }
    t
}

fn setup_err(e: impl std::fmt::Display) -> RpcError {
    RpcError::Setup(e.to_string())
}

/// A client-side QUIC configuration presenting this process's certificate.
pub fn client_config(tls: &TlsMaterial) -> Result<quinn::ClientConfig, RpcError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.client_config().map_err(setup_err)?)
        .map_err(setup_err)?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(transport_config()));
    Ok(config)
}

/// A server-side QUIC configuration that requires client certificates signed by the cluster CA.
pub fn server_config(tls: &TlsMaterial) -> Result<quinn::ServerConfig, RpcError> {
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls.server_config().map_err(setup_err)?)
        .map_err(setup_err)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(transport_config()));
    Ok(config)
}

/// A server endpoint on `listen` that requires client certificates signed by the cluster CA. It can also
/// open client connections (shards use that to join the coordinator).
pub fn server_endpoint(listen: SocketAddr, tls: &TlsMaterial) -> Result<quinn::Endpoint, RpcError> {
    let config = server_config(tls)?;
    let mut endpoint =
        quinn::Endpoint::server(config, listen).map_err(|e| setup_err(format!("binding {listen}: {e}")))?;
    endpoint.set_default_client_config(client_config(tls)?);
    Ok(endpoint)
}

/// A client-only endpoint on an ephemeral port of the right address family.
pub fn client_endpoint(tls: &TlsMaterial, peer: SocketAddr) -> Result<quinn::Endpoint, RpcError> {
    let bind: SocketAddr = if peer.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().map_err(setup_err)?;
    let mut endpoint = quinn::Endpoint::client(bind).map_err(|e| setup_err(format!("binding {bind}: {e}")))?;
    endpoint.set_default_client_config(client_config(tls)?);
    Ok(endpoint)
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
        Ok(Err(e)) => Err(conn_err(describe_connection_error(&e))),
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

/// Writes one frame whose payload is the concatenation of `payload` slices (no copy of tensor data on
/// little-endian hosts).
pub async fn write_frame(send: &mut quinn::SendStream, msg: &Message, payload: &[&[f32]]) -> Result<u64, WireError> {
    let elems: usize = payload.iter().map(|p| p.len()).sum();
    let header = wire::encode_header(msg, elems)?;
    let io = |e: quinn::WriteError| WireError::Io(e.to_string());
    send.write_all(&header).await.map_err(io)?;
    for part in payload {
        send.write_all(&wire::f32s_to_le_bytes(part)).await.map_err(io)?;
    }
    Ok(header.len() as u64 + elems as u64 * 4)
}

/// Adapts a QUIC receive stream to [`wire::ReadExact`].
struct QuicReader<'a>(&'a mut quinn::RecvStream);

impl wire::ReadExact for QuicReader<'_> {
    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), WireError> {
        let needed = buf.len() as u64;
        self.0.read_exact(buf).await.map_err(|e| match e {
            quinn::ReadExactError::FinishedEarly(got) => WireError::Truncated { needed, got: got as u64 },
            quinn::ReadExactError::ReadError(e) => WireError::Io(e.to_string()),
        })
    }
}

/// Reads one frame, bounded by `limits`.
pub async fn read_frame(recv: &mut quinn::RecvStream, limits: &Limits) -> Result<Frame, WireError> {
    wire::read_frame(&mut QuicReader(recv), limits).await
}

/// Reads a frame's header only (see [`wire::read_header`]); [`read_payload`] reads the rest.
pub async fn read_header(recv: &mut quinn::RecvStream, limits: &Limits) -> Result<Message, WireError> {
    wire::read_header(&mut QuicReader(recv), limits).await
}

/// Reads the payload `msg` announced.
pub async fn read_payload(recv: &mut quinn::RecvStream, msg: &Message) -> Result<Vec<f32>, WireError> {
    wire::read_payload(&mut QuicReader(recv), msg).await
}

/// After a request frame: the stream must end here.
pub async fn expect_end(recv: &mut quinn::RecvStream) -> Result<(), WireError> {
    let mut probe = [0u8; 64];
    match recv.read(&mut probe).await {
        Ok(None) => Ok(()),
        Ok(Some(n)) => Err(WireError::TrailingBytes(n as u64)),
        Err(e) => Err(WireError::Io(e.to_string())),
    }
}

/// One RPC on its own stream: send the request, finish, read the reply. An error reply becomes
/// [`RpcError::Remote`].
pub async fn call(
    conn: &quinn::Connection,
    msg: &Message,
    payload: &[&[f32]],
    limits: &Limits,
    timeout: Duration,
) -> Result<Frame, RpcError> {
    let addr = conn.remote_address().to_string();
    let fut = async {
        // When the connection itself closed, say why (a TLS alert, the peer's reason) rather than how the
        // stream noticed.
        let conn_err = |message: String| RpcError::Connection {
            addr: addr.clone(),
            message: conn.close_reason().map_or(message, |reason| describe_connection_error(&reason)),
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| conn_err(e.to_string()))?;
        write_frame(&mut send, msg, payload).await.map_err(|e| conn_err(e.to_string()))?;
        send.finish().map_err(|e| conn_err(e.to_string()))?;
        let frame = read_frame(&mut recv, limits).await.map_err(|e| match e {
            WireError::Io(m) => conn_err(m),
            WireError::Truncated { .. } if conn.close_reason().is_some() => conn_err(e.to_string()),
            other => RpcError::Wire { addr: addr.clone(), source: other },
        })?;
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
    }
}
