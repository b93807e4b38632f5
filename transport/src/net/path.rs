//! The path a process's datagrams take: the largest UDP payload its interface carries, segmentation
//! offload, socket buffers (`PathTuning`), read from the interface the route to a peer goes through.

use super::*;

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
pub(super) fn interface_mtu(name: &str) -> Option<u32> {
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
pub(super) fn best_route_v4(table: &str, ip: std::net::Ipv4Addr) -> Option<String> {
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
pub(super) fn best_route_v6(table: &str, ip: std::net::Ipv6Addr) -> Option<String> {
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
