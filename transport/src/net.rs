//! QUIC plumbing shared by every gaps process: transport tuning, endpoints with mutual TLS, and frame
//! I/O over one bidirectional stream per RPC.

use crate::identity::{identity_of, PeerIdentity, Role};
use crate::tls::{TlsMaterial, SERVER_NAME};
pub use bytes::Bytes;
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

/// Datagrams quinn puts into one segmentation-offload batch (`MAX_TRANSMIT_SEGMENTS` in quinn 0.11).
const QUINN_GSO_BATCH: usize = 10;

/// The most bytes one UDP send (one GSO batch included) can carry.
const MAX_UDP_SEND: usize = 65_535 - 48;

/// How an endpoint's UDP traffic is shaped, from the MTU of the interface it goes through.
///
/// - The largest UDP payload (`max_udp_payload`) is the interface MTU less the IP and UDP headers: it is
///   the ceiling of quinn's MTU discovery and the `max_udp_payload_size` this side announces, so the peer
///   never sends larger. 65 487 bytes on loopback, 8 952 on a 9,000-byte jumbo-frame link, 1 452 on plain
///   Ethernet. Discovery still probes the path from 1,200 bytes up, so a smaller MTU between the hosts
///   costs a few lost probes, not a black hole.
/// - Segmentation offload (GSO) is on only while a batch of quinn's 10 datagrams of the largest size fits
///   one UDP send: above that the kernel refuses the batch (`EMSGSIZE`), quinn-udp drops it silently as it
///   does a failed MTU probe, the losses look like a black hole and discovery falls back to 1,200 bytes.
///   (That is why an earlier 64 KiB MTU experiment measured no gain.) Large datagrams need no batching:
///   one 64 KiB datagram costs one system call and one AEAD pass, as one TLS record of 16 KiB does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTuning {
    /// Largest UDP payload in bytes.
    pub max_udp_payload: u16,
    /// Whether quinn batches datagrams with segmentation offload.
    pub segmentation_offload: bool,
    /// The interface the MTU was read from (or why none was).
    pub interface: String,
}

impl PathTuning {
    /// The tuning for an interface of `mtu` bytes carrying IPv4 (`ipv6` false) or IPv6 packets.
    pub fn for_mtu(mtu: u32, ipv6: bool, interface: impl Into<String>) -> Self {
        let headers = if ipv6 { 40 + 8 } else { 20 + 8 };
        let payload = mtu.min(65_535).saturating_sub(headers).clamp(1200, 65_527) as u16;
        PathTuning {
            max_udp_payload: payload,
            segmentation_offload: usize::from(payload) * QUINN_GSO_BATCH <= MAX_UDP_SEND,
            interface: interface.into(),
        }
    }

    /// Plain Ethernet (1,500 bytes), where nothing better is known.
    pub fn ethernet(why: &str) -> Self {
        Self::for_mtu(1500, true, why)
    }

    /// The tuning for traffic to `peer`: the MTU of the interface the kernel routes it through.
    pub fn toward(peer: SocketAddr) -> Self {
        let ip = peer.ip();
        match route_interface(ip).and_then(|i| interface_mtu(&i).map(|m| (i, m))) {
            Some((interface, mtu)) => Self::for_mtu(mtu, ip.is_ipv6(), interface),
            None => Self::ethernet("no route found"),
        }
    }

    /// The tuning for a server listening on `listen`: the interface of that address, or for an
    /// unspecified address (`0.0.0.0`, `[::]`) the largest MTU of the host's up, non-loopback interfaces
    /// (clients then come over the network). Each connection's discovery stays bounded by what its client
    /// announces.
    pub fn serving(listen: SocketAddr) -> Self {
        if !listen.ip().is_unspecified() {
            return Self::toward(listen);
        }
        let best = list_interfaces()
            .into_iter()
            .filter(|(_, flags)| flags & IFF_UP != 0 && flags & IFF_LOOPBACK == 0)
            .filter_map(|(name, _)| interface_mtu(&name).map(|m| (m, name)))
            .max();
        match best {
            Some((mtu, name)) => Self::for_mtu(mtu, true, name),
            None => Self::ethernet("no network interface found"),
        }
    }

    /// The quinn transport settings for this path.
    pub fn transport_config(&self) -> quinn::TransportConfig {
        let mut t = transport_config();
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        discovery.upper_bound(self.max_udp_payload);
        t.mtu_discovery_config(Some(discovery));
        t.enable_segmentation_offload(self.segmentation_offload);
        t
    }

    /// The endpoint settings for this path (the largest UDP payload accepted).
    pub fn endpoint_config(&self) -> quinn::EndpointConfig {
        let mut c = quinn::EndpointConfig::default();
        // In range by construction (`for_mtu` clamps to 1200..=65527).
        let _ = c.max_udp_payload_size(self.max_udp_payload);
        c
    }
}

const IFF_UP: u32 = 0x1;
const IFF_LOOPBACK: u32 = 0x8;

/// The host's interfaces with their flags (`/sys/class/net`; empty where that is not readable).
fn list_interfaces() -> Vec<(String, u32)> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else { return Vec::new() };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let flags = std::fs::read_to_string(e.path().join("flags")).ok()?;
            let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).ok()?;
            Some((name, flags))
        })
        .collect()
}

/// An interface's MTU from `/sys/class/net/<name>/mtu`.
fn interface_mtu(name: &str) -> Option<u32> {
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?.trim().parse().ok()
}

/// The interface the kernel routes `ip` through: the longest matching prefix of the main routing table
/// (`/proc/net/route`, `/proc/net/ipv6_route`), the loopback interface for loopback addresses.
pub fn route_interface(ip: std::net::IpAddr) -> Option<String> {
    use std::net::IpAddr;
    if ip.is_loopback() {
        return list_interfaces().into_iter().find(|(_, f)| f & IFF_LOOPBACK != 0).map(|(n, _)| n);
    }
    match ip {
        IpAddr::V4(v4) => best_route_v4(&std::fs::read_to_string("/proc/net/route").ok()?, v4),
        IpAddr::V6(v6) => best_route_v6(&std::fs::read_to_string("/proc/net/ipv6_route").ok()?, v6),
    }
}

/// The interface of the longest-prefix up route to `ip` in `/proc/net/route`'s format (addresses and masks
/// as the hex of their bytes in host order, little-endian here).
fn best_route_v4(table: &str, ip: std::net::Ipv4Addr) -> Option<String> {
    let target = u32::from_le_bytes(ip.octets());
    let mut best: Option<(u32, u32, String)> = None;
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(iface), Some(dest), Some(flags), Some(metric), Some(mask)) =
            (f.first(), f.get(1), f.get(3), f.get(6), f.get(7))
        else {
            continue;
        };
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        let (Some(dest), Some(flags), Some(mask), Ok(metric)) =
            (hex(dest), hex(flags), hex(mask), metric.parse::<u32>())
        else {
            continue;
        };
        if flags & 0x1 == 0 || target & mask != dest {
            continue;
        }
        let prefix = mask.count_ones();
        let better = best.as_ref().is_none_or(|(p, m, _)| prefix > *p || (prefix == *p && metric < *m));
        if better {
            best = Some((prefix, metric, iface.to_string()));
        }
    }
    best.map(|(_, _, i)| i)
}

/// The interface of the longest-prefix up route to `ip` in `/proc/net/ipv6_route`'s format.
fn best_route_v6(table: &str, ip: std::net::Ipv6Addr) -> Option<String> {
    let target = u128::from_be_bytes(ip.octets());
    let mut best: Option<(u32, u32, String)> = None;
    for line in table.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 {
            continue;
        }
        let (Ok(dest), Ok(plen), Ok(metric), Ok(flags)) = (
            u128::from_str_radix(f[0], 16),
            u32::from_str_radix(f[1], 16),
            u32::from_str_radix(f[5], 16),
            u32::from_str_radix(f[8], 16),
        ) else {
            continue;
        };
        let mask = if plen == 0 { 0 } else { u128::MAX << (128 - plen.min(128)) };
        // Up (RTF_UP) and not an unreachable/reject route (RTF_REJECT).
        if flags & 0x1 == 0 || flags & 0x200 != 0 || target & mask != dest & mask {
            continue;
        }
        let better = best.as_ref().is_none_or(|(p, m, _)| plen > *p || (plen == *p && metric < *m));
        if better {
            best = Some((plen, metric, f[9].to_string()));
        }
    }
    best.map(|(_, _, i)| i)
}

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

/// Tensor data owned elsewhere (a `Vec<f32>`, a slice of shared tensors) seen as little-endian bytes.
struct F32Owner<T>(T);

impl<T: AsRef<[f32]>> AsRef<[u8]> for F32Owner<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_ref())
    }
}

/// `values` as a frame payload part. On little-endian hosts the bytes are the values' own memory, handed
/// to quinn's send queue without a copy (the owner is dropped once the peer acknowledged them).
pub fn f32_bytes<T: AsRef<[f32]> + Send + 'static>(values: T) -> Bytes {
    if cfg!(target_endian = "little") {
        Bytes::from_owner(F32Owner(values))
    } else {
        Bytes::from(wire::f32s_to_le_bytes(values.as_ref()).into_owned())
    }
}

/// A copy of `values` as a frame payload part (for small or borrowed data).
pub fn f32_bytes_copied(values: &[f32]) -> Bytes {
    Bytes::copy_from_slice(&wire::f32s_to_le_bytes(values))
}

/// `values` encoded as `dtype` for the wire: f32 without a copy ([`f32_bytes`]), 16-bit formats
/// converted (SIMD) into a new buffer ([`encode_slice`]).
pub fn dtype_bytes<T: AsRef<[f32]> + Send + 'static>(dtype: gaps_common::dtype::WireDtype, values: T) -> Bytes {
    match dtype {
        gaps_common::dtype::WireDtype::F32 => f32_bytes(values),
        other => encode_slice(other, values.as_ref()),
    }
}

/// 16-bit values held in an f32 buffer from the recycler (so that very large ones are reused rather than
/// faulted in afresh each round), seen as their first `bytes` bytes.
struct HalfOwner {
    buf: gaps_common::buffers::Recycled,
    bytes: usize,
}

impl AsRef<[u8]> for HalfOwner {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice::<f32, u8>(&self.buf.0)[..self.bytes]
    }
}

/// A copy of `values` in `dtype`'s wire bytes, in one conversion pass (16-bit formats into a recycled
/// buffer; f32 copied).
pub fn encode_slice(dtype: gaps_common::dtype::WireDtype, values: &[f32]) -> Bytes {
    encode_blocks(dtype, values, |_| {})
}

/// [`encode_slice`] into a 16-bit format, also telling whether every value of `values` is finite: each
/// block of the source is checked right after it was converted, while it is in the cache, instead of in a
/// pass of its own. (f32 is copied and checked.)
pub fn encode_slice_finite(dtype: gaps_common::dtype::WireDtype, values: &[f32]) -> (Bytes, bool) {
    let mut finite = true;
    let bytes = encode_blocks(dtype, values, |block| finite &= gaps_common::dtype::all_finite(block));
    (bytes, finite)
}

/// `values` in a 16-bit `dtype`'s little-endian wire bytes, converted block by block through a stack buffer
/// into a buffer from the recycler (no zero-fill first, [`gaps_common::dtype::Packer`]), with `each` called
/// on every source block right after it was converted (while it is in the cache).
fn encode_blocks(dtype: gaps_common::dtype::WireDtype, values: &[f32], mut each: impl FnMut(&[f32])) -> Bytes {
    if dtype == gaps_common::dtype::WireDtype::F32 {
        each(values);
        return f32_bytes_copied(values);
    }
    let n = values.len();
    // The 16-bit values' bytes, in order, held in the f32 slots of a recycled buffer (two per slot).
    let mut packer = gaps_common::dtype::Packer::new(gaps_common::buffers::take(n.div_ceil(2)));
    packer.push_with(dtype, values, each);
    Bytes::from_owner(HalfOwner { buf: gaps_common::buffers::Recycled(packer.finish()), bytes: 2 * n })
}

/// The payload parts of a frame whose values are `values`, in the formats `msg`'s sections declare: the
/// values' own memory when every section is f32 (very large buffers go back to the recycler once sent),
/// converted copies otherwise.
pub fn payload_parts(msg: &Message, values: Vec<f32>) -> Result<Vec<Bytes>, WireError> {
    let sections = msg.payload_sections();
    if sections.iter().all(|(_, d)| *d == gaps_common::dtype::WireDtype::F32) {
        let declared: u64 = sections.iter().map(|(n, _)| n).sum();
        if declared != values.len() as u64 {
            return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
        }
        return Ok(vec![f32_bytes(gaps_common::buffers::Recycled(values))]);
    }
    let declared: u64 = sections.iter().map(|(n, _)| n).sum();
    if declared != values.len() as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
    }
    // Runs of sections in one format become one part each.
    let mut parts = Vec::new();
    let (mut start, mut at) = (0usize, 0usize);
    for (i, (n, dtype)) in sections.iter().enumerate() {
        at += *n as usize;
        if sections.get(i + 1).is_none_or(|next| next.1 != *dtype) {
            parts.push(encode_slice(*dtype, &values[start..at]));
            start = at;
        }
    }
    gaps_common::buffers::give(values);
    Ok(parts)
}

/// The payload parts of a frame whose values were packed for the wire by [`gaps_common::dtype::Packer`]
/// (the shard's pull replies): slices of the one buffer, sent without a copy or a conversion.
pub fn packed_parts(msg: &Message, packed: Vec<f32>) -> Result<Vec<Bytes>, WireError> {
    let (runs, slots) = gaps_common::dtype::packed_runs(&msg.payload_sections());
    if packed.len() != slots {
        return Err(WireError::ElementCountMismatch { expected: slots as u64, got: packed.len() as u64 });
    }
    if runs.iter().all(|(d, _, _)| *d == gaps_common::dtype::WireDtype::F32) {
        return payload_parts(msg, packed);
    }
    let all = f32_bytes(gaps_common::buffers::Recycled(packed));
    Ok(runs.into_iter().map(|(_, range, bytes)| all.slice(4 * range.start..4 * range.start + bytes)).collect())
}

/// Writes one frame whose payload is the concatenation of `payload` parts, already in the formats the
/// header's sections declare (as made by [`f32_bytes`] or [`dtype_bytes`]); the byte count must match.
/// The parts go to quinn by reference count, not copied.
pub async fn write_frame(send: &mut quinn::SendStream, msg: &Message, payload: &[Bytes]) -> Result<u64, WireError> {
    let bytes: usize = payload.iter().map(|p| p.len()).sum();
    if bytes as u64 != msg.payload_bytes() {
        return Err(WireError::Io(format!(
            "a payload of {bytes} bytes where the header declares {} bytes",
            msg.payload_bytes()
        )));
    }
    let header = wire::encode_header(msg, msg.payload_elems() as usize)?;
    let io = |e: quinn::WriteError| WireError::Io(e.to_string());
    send.write_all(&header).await.map_err(io)?;
    for part in payload {
        if !part.is_empty() {
            send.write_chunk(part.clone()).await.map_err(io)?;
        }
    }
    Ok((header.len() + bytes) as u64)
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
    let msg = read_header(recv, limits).await?;
    let payload = read_payload(recv, &msg).await?;
    Ok(Frame { msg, payload })
}

/// Reads a frame's header only (see [`wire::read_header`]); [`read_payload`] reads the rest.
pub async fn read_header(recv: &mut quinn::RecvStream, limits: &Limits) -> Result<Message, WireError> {
    wire::read_header(&mut QuicReader(recv), limits).await
}

/// Reads the payload `msg` announced, straight from quinn's received chunks into the result (no zeroing,
/// one copy).
pub async fn read_payload(recv: &mut quinn::RecvStream, msg: &Message) -> Result<Vec<f32>, WireError> {
    let mut values = gaps_common::buffers::take(msg.payload_elems() as usize);
    read_sections(recv, msg, &mut |dtype, run| gaps_common::dtype::decode_extend(dtype, run, &mut values)).await?;
    Ok(values)
}

/// [`read_payload`], also telling whether every value is finite (no NaN or ±∞): each run is checked as it
/// is decoded, while in the cache, instead of in a second pass over the payload. A payload of megabytes is
/// checked on its wire bytes and written past the cache ([`STREAMING_DESTINATION`]).
pub async fn read_payload_finite(recv: &mut quinn::RecvStream, msg: &Message) -> Result<(Vec<f32>, bool), WireError> {
    let n = msg.payload_elems() as usize;
    let mut values = gaps_common::buffers::take(n);
    let mut finite = true;
    let decode = if n.saturating_mul(4) >= STREAMING_DESTINATION {
        gaps_common::dtype::decode_extend_finite_streaming
    } else {
        gaps_common::dtype::decode_extend_finite
    };
    read_sections(recv, msg, &mut |dtype, run| finite &= decode(dtype, run, &mut values)).await?;
    Ok((values, finite))
}

/// Why a server stopped reading a request before it was whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestReadError {
    /// The bytes do not make a valid request (answered with the reason).
    Wire(WireError),
    /// No byte arrived for the stall limit: the sender is stuck or holding the stream open on purpose.
    Stalled,
    /// The server's memory budget had no room for the request's bytes in time (answered
    /// [`gaps_common::ErrorCode::Busy`]; the client may send it again).
    Busy(String),
}

impl From<WireError> for RequestReadError {
    fn from(e: WireError) -> Self {
        RequestReadError::Wire(e)
    }
}

/// A server's reservation of memory for one request, grown as the request's bytes arrive, so that a request
/// holds budget for what it sent rather than for what it declared.
pub trait Admission {
    /// Makes room for `bytes` bytes of this request in all (the reservation never shrinks); an error
    /// refuses the request with that reason.
    fn grow_to(&mut self, bytes: u64) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// The first room a request's payload gets when its first byte arrives: one stream window, what a sender
/// can have in flight before the server reads. The rest, if any, is admitted once this much has arrived.
pub const FIRST_PAYLOAD_ADMISSION: u64 = STREAM_WINDOW as u64;

/// The next byte chunk of a request, or [`RequestReadError::Stalled`] when none came within `stall`.
async fn next_chunk(
    recv: &mut quinn::RecvStream,
    max: usize,
    stall: Duration,
) -> Result<Option<quinn::Chunk>, RequestReadError> {
    match tokio::time::timeout(stall, recv.read_chunk(max, true)).await {
        Err(_) => Err(RequestReadError::Stalled),
        Ok(Err(e)) => Err(WireError::Io(e.to_string()).into()),
        Ok(Ok(chunk)) => Ok(chunk),
    }
}

/// Reads a request's prefix and header as a server must: the header's buffer grows with the bytes that
/// arrived (never to the declared length up front), each byte is admitted by `admission` before it is
/// kept, and a sender that sends nothing for `stall` is given up on.
pub async fn read_request_header(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    stall: Duration,
    admission: &mut impl Admission,
) -> Result<Message, RequestReadError> {
    let mut prefix = [0u8; wire::FRAME_PREFIX_LEN];
    let mut got = 0;
    while got < prefix.len() {
        match next_chunk(recv, prefix.len() - got, stall).await? {
            Some(chunk) => {
                prefix[got..got + chunk.bytes.len()].copy_from_slice(&chunk.bytes);
                got += chunk.bytes.len();
            }
            None => return Err(WireError::Truncated { needed: prefix.len() as u64, got: got as u64 }.into()),
        }
    }
    let (kind, header_len) = wire::parse_prefix(&prefix, limits)?;
    let mut header = Vec::new();
    while header.len() < header_len {
        match next_chunk(recv, header_len - header.len(), stall).await? {
            Some(chunk) => {
                let total = (prefix.len() + header.len() + chunk.bytes.len()) as u64;
                admission.grow_to(total).await.map_err(RequestReadError::Busy)?;
                header.extend_from_slice(&chunk.bytes);
            }
            None => {
                let needed = header_len as u64;
                return Err(WireError::Truncated { needed, got: header.len() as u64 }.into());
            }
        }
    }
    Ok(wire::decode_header(kind, &header, limits)?)
}

/// [`read_payload_finite`] as a server must read it: memory for the decoded values is admitted by
/// `admission` (on top of `already` bytes the request holds) and allocated only as the payload arrives —
/// one stream window ([`FIRST_PAYLOAD_ADMISSION`]) at its first byte, the rest once that much came — and a
/// sender that sends nothing for `stall` is given up on.
pub async fn read_request_payload(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    stall: Duration,
    already: u64,
    admission: &mut impl Admission,
) -> Result<(Vec<f32>, bool), RequestReadError> {
    let n = msg.payload_elems() as usize;
    let decoded_bytes = msg.payload_elems() * 4;
    let needed = msg.payload_bytes();
    let mut values = Vec::new();
    let mut admitted = 0u64;
    let mut finite = true;
    let decode = if n.saturating_mul(4) >= STREAMING_DESTINATION {
        gaps_common::dtype::decode_extend_finite_streaming
    } else {
        gaps_common::dtype::decode_extend_finite
    };
    let mut decoder = wire::PayloadDecoder::new(msg);
    while !decoder.is_done() {
        let missing = usize::try_from(decoder.bytes_missing()).unwrap_or(usize::MAX);
        let Some(chunk) = next_chunk(recv, missing, stall).await? else {
            return Err(WireError::Truncated { needed, got: needed - decoder.bytes_missing() }.into());
        };
        // The decoded bytes this chunk brings the payload to, in proportion to its wire bytes.
        let arrived = needed - decoder.bytes_missing() + chunk.bytes.len() as u64;
        let decoded_so_far = (u128::from(decoded_bytes) * u128::from(arrived)).div_ceil(u128::from(needed.max(1)));
        let decoded_so_far = u64::try_from(decoded_so_far).unwrap_or(decoded_bytes).min(decoded_bytes);
        if decoded_so_far > admitted {
            let next = if admitted == 0 { FIRST_PAYLOAD_ADMISSION.max(decoded_so_far) } else { decoded_bytes };
            admitted = next.min(decoded_bytes);
            admission.grow_to(already + admitted).await.map_err(RequestReadError::Busy)?;
            let floats = (admitted / 4) as usize;
            if values.capacity() == 0 {
                values = gaps_common::buffers::take(floats);
            } else {
                values.reserve_exact(floats.saturating_sub(values.len()));
            }
        }
        decoder.feed(&chunk.bytes, &mut |dtype, run| finite &= decode(dtype, run, &mut values));
    }
    Ok((values, finite))
}

/// Reads the payload `msg` announced chunk by chunk as quinn received it, decoding its sections and
/// handing each run of whole values to `emit`.
async fn read_sections(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    emit: &mut impl FnMut(gaps_common::dtype::WireDtype, &[u8]),
) -> Result<(), WireError> {
    let needed = msg.payload_bytes();
    let mut decoder = wire::PayloadDecoder::new(msg);
    while !decoder.is_done() {
        let missing = usize::try_from(decoder.bytes_missing()).unwrap_or(usize::MAX);
        match recv.read_chunk(missing, true).await {
            Ok(Some(chunk)) => decoder.feed(&chunk.bytes, emit),
            Ok(None) => return Err(WireError::Truncated { needed, got: needed - decoder.bytes_missing() }),
            Err(e) => return Err(WireError::Io(e.to_string())),
        }
    }
    Ok(())
}

/// Where a reply's payload goes. [`call_with`] asks once the reply's header is read and valid; `Ok(None)`
/// keeps the payload in the returned frame, `Ok(Some(slices))` has it read straight into the caller's
/// buffers (their lengths must add up to the payload's), `Err` refuses the reply.
pub trait ReplySink {
    /// The destination of the payload of reply `msg`.
    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String>;
}

/// The reply's payload stays in its frame.
#[derive(Debug, Clone, Copy, Default)]
pub struct InFrame;

impl ReplySink for InFrame {
    fn destination<'s>(&'s mut self, _msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        Ok(None)
    }
}

/// Reads the payload `msg` announced into `dest`, whose lengths must add up to it.
pub async fn read_payload_into(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    dest: &mut [&mut [f32]],
) -> Result<(), WireError> {
    let n = msg.payload_elems() as usize;
    let room: usize = dest.iter().map(|d| d.len()).sum();
    if room != n {
        return Err(WireError::Io(format!("the reply carries {n} values where {room} were expected")));
    }
    let streaming = room.saturating_mul(4) >= STREAMING_DESTINATION;
    let mut fill = SliceFiller { dest, slice: 0, offset: 0, streaming };
    read_sections(recv, msg, &mut |dtype, run| fill.put(dtype, run)).await
}

/// Destinations of at least this many bytes (a core's L2 cache here) are written with non-temporal stores
/// ([`gaps_common::dtype::decode_into_streaming`]): they do not stay in the cache anyway.
const STREAMING_DESTINATION: usize = 2 << 20;

/// Writes runs of whole values into a sequence of slices, splitting runs at slice boundaries.
struct SliceFiller<'d, 'b> {
    dest: &'d mut [&'b mut [f32]],
    slice: usize,
    offset: usize,
    /// The slices are large: written past the caches.
    streaming: bool,
}

impl SliceFiller<'_, '_> {
    /// Decodes `run` (whole `dtype` values; never more than the slices' room, as the decoder stops at the
    /// payload's end) into the slices.
    fn put(&mut self, dtype: gaps_common::dtype::WireDtype, mut run: &[u8]) {
        let width = dtype.bytes();
        while !run.is_empty() {
            while self.dest[self.slice].len() == self.offset {
                self.slice += 1;
                self.offset = 0;
            }
            let target = &mut self.dest[self.slice][self.offset..];
            let count = target.len().min(run.len() / width);
            let (from, to) = (&run[..count * width], &mut target[..count]);
            if self.streaming {
                gaps_common::dtype::decode_into_streaming(dtype, from, to);
            } else {
                gaps_common::dtype::decode_into(dtype, from, to);
            }
            self.offset += count;
            run = &run[count * width..];
        }
    }
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
