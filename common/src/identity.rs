//! Who a certificate says its holder is. `gaps certs` writes the role into a URI subject alternative name:
//!
//! - `spiffe://<cluster>/shard/<index>` — shard `index` (server and client use);
//! - `spiffe://<cluster>/worker/<name>` — a worker or observer (client use only).
//!
//! The certificate has already been verified against the cluster CA by rustls when this runs; this module
//! only reads the name (a small DER reader: the certificate, its extensions, the SAN extension, its URI
//! entries) and the validity period. Anything it cannot read is an error, never a panic.

use std::fmt;

/// The role a certificate grants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Role {
    /// Shard `index` of the cluster.
    Shard(u32),
    /// A worker (or observer) with this name.
    Worker(String),
}

/// The identity a certificate names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    /// The cluster the certificate belongs to.
    pub cluster: String,
    /// What the holder may do.
    pub role: Role,
}

impl PeerIdentity {
    /// The SAN URI that carries this identity.
    pub fn uri(&self) -> String {
        match &self.role {
            Role::Shard(i) => format!("spiffe://{}/shard/{i}", self.cluster),
            Role::Worker(name) => format!("spiffe://{}/worker/{name}", self.cluster),
        }
    }

    /// Parses a SAN URI; None when it is not a gaps identity.
    pub fn from_uri(uri: &str) -> Option<PeerIdentity> {
        let rest = uri.strip_prefix("spiffe://")?;
        let mut parts = rest.splitn(3, '/');
        let (cluster, kind, value) = (parts.next()?, parts.next()?, parts.next()?);
        if !is_valid_name(cluster) || !is_valid_name(value) {
            return None;
        }
        let role = match kind {
            "shard" => Role::Shard(value.parse().ok().filter(|_| value.bytes().all(|b| b.is_ascii_digit()))?),
            "worker" => Role::Worker(value.to_string()),
            _ => return None,
        };
        Some(PeerIdentity { cluster: cluster.to_string(), role })
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

/// A cluster or worker name: 1–63 ASCII letters, digits, `-`, `_` or `.`.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 63 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Why a certificate's identity could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The DER structure is not a certificate as expected.
    #[error("malformed certificate: {0}")]
    Malformed(&'static str),
    /// The certificate names no gaps role.
    #[error("the certificate carries no gaps role (a spiffe://<cluster>/shard/<i> or spiffe://<cluster>/worker/<name> name); it was not made by this version of `gaps certs`: issue new certificates")]
    NoRole,
    /// It names more than one.
    #[error("the certificate names more than one gaps role")]
    Ambiguous,
}

/// One DER element: its tag and contents.
struct Tlv<'a> {
    tag: u8,
    body: &'a [u8],
}

/// Reads the element at the start of `input`; returns it and the rest.
fn tlv(input: &[u8]) -> Result<(Tlv<'_>, &[u8]), IdentityError> {
    let bad = IdentityError::Malformed;
    let (&tag, rest) = input.split_first().ok_or(bad("truncated tag"))?;
    if tag & 0x1f == 0x1f {
        return Err(bad("multi-byte tags are not used in certificates"));
    }
    let (&first, rest) = rest.split_first().ok_or(bad("truncated length"))?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return Err(bad("bad length"));
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return Err(bad("element longer than its container"));
    }
    Ok((Tlv { tag, body: &rest[..len] }, &rest[len..]))
}

/// The elements of a constructed element's contents.
fn children(mut body: &[u8]) -> Result<Vec<Tlv<'_>>, IdentityError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let (t, rest) = tlv(body)?;
        out.push(t);
        body = rest;
    }
    Ok(out)
}

const SEQUENCE: u8 = 0x30;
/// The OID 2.5.29.17 (subjectAltName), DER contents.
const SAN_OID: &[u8] = &[0x55, 0x1d, 0x11];

/// The fields of tbsCertificate after the optional version: serial, signature, issuer, validity, subject,
/// subject public key info, then optional unique ids and `[3]` extensions.
fn tbs_fields(cert_der: &[u8]) -> Result<Vec<Tlv<'_>>, IdentityError> {
    let (cert, _) = tlv(cert_der)?;
    if cert.tag != SEQUENCE {
        return Err(IdentityError::Malformed("not a SEQUENCE"));
    }
    let parts = children(cert.body)?;
    let tbs = parts.first().filter(|t| t.tag == SEQUENCE).ok_or(IdentityError::Malformed("no tbsCertificate"))?;
    let mut fields = children(tbs.body)?;
    if fields.first().is_some_and(|f| f.tag == 0xa0) {
        fields.remove(0);
    }
    if fields.len() < 6 {
        return Err(IdentityError::Malformed("tbsCertificate too short"));
    }
    Ok(fields)
}

/// Every URI in the certificate's subject alternative names.
pub fn san_uris(cert_der: &[u8]) -> Result<Vec<String>, IdentityError> {
    let fields = tbs_fields(cert_der)?;
    let Some(ext) = fields.iter().find(|f| f.tag == 0xa3) else { return Ok(Vec::new()) };
    let (list, _) = tlv(ext.body)?;
    let mut uris = Vec::new();
    for e in children(list.body)? {
        let parts = children(e.body)?;
        let is_san = parts.first().is_some_and(|oid| oid.tag == 0x06 && oid.body == SAN_OID);
        // extnValue is the last part (an optional `critical` BOOLEAN may come before it).
        let Some(value) = parts.last().filter(|v| is_san && v.tag == 0x04) else { continue };
        let (names, _) = tlv(value.body)?;
        for name in children(names.body)? {
            // uniformResourceIdentifier [6] IA5String, implicitly tagged.
            if name.tag == 0x86 {
                let uri = std::str::from_utf8(name.body).map_err(|_| IdentityError::Malformed("URI not ASCII"))?;
                uris.push(uri.to_string());
            }
        }
    }
    Ok(uris)
}

/// The gaps identity a certificate (DER) names.
pub fn identity_of(cert_der: &[u8]) -> Result<PeerIdentity, IdentityError> {
    let found: Vec<PeerIdentity> = san_uris(cert_der)?.iter().filter_map(|u| PeerIdentity::from_uri(u)).collect();
    match found.as_slice() {
        [] => Err(IdentityError::NoRole),
        [one] => Ok(one.clone()),
        _ => Err(IdentityError::Ambiguous),
    }
}

/// The certificate's validity period, in seconds since the Unix epoch (not before, not after).
pub fn validity(cert_der: &[u8]) -> Result<(i64, i64), IdentityError> {
    let fields = tbs_fields(cert_der)?;
    let times = children(fields[3].body)?;
    let [from, to] = times.as_slice() else { return Err(IdentityError::Malformed("validity")) };
    Ok((der_time(from)?, der_time(to)?))
}

/// UTCTime (YYMMDDHHMMSSZ) or GeneralizedTime (YYYYMMDDHHMMSSZ) to seconds since the Unix epoch.
fn der_time(t: &Tlv<'_>) -> Result<i64, IdentityError> {
    let bad = IdentityError::Malformed("time");
    let s = std::str::from_utf8(t.body).map_err(|_| bad)?;
    let digits = s.strip_suffix('Z').ok_or(bad)?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad);
    }
    let num = |r: std::ops::Range<usize>| digits.get(r).and_then(|d| d.parse::<i64>().ok()).ok_or(bad);
    let (year, rest) = match (t.tag, digits.len()) {
        (0x17, 12) => {
            let yy = num(0..2)?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, 2)
        }
        (0x18, 14) => (num(0..4)?, 4),
        _ => return Err(bad),
    };
    let (month, day) = (num(rest..rest + 2)?, num(rest + 2..rest + 4)?);
    let (h, m, sec) = (num(rest + 4..rest + 6)?, num(rest + 6..rest + 8)?, num(rest + 8..rest + 10)?);
    Ok(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip_and_strangers_are_not_identities() {
        for id in [
            PeerIdentity { cluster: "prod-1".into(), role: Role::Shard(3) },
            PeerIdentity { cluster: "c".into(), role: Role::Worker("alice.b_2".into()) },
        ] {
            assert_eq!(PeerIdentity::from_uri(&id.uri()), Some(id));
        }
        for bad in [
            "https://c/shard/1",
            "spiffe://c/shard/x",
            "spiffe://c/shard/+1",
            "spiffe://c/admin/1",
            "spiffe:///shard/1",
            "spiffe://c/worker/",
            "spiffe://c/worker/a/b",
            "spiffe://c d/worker/a",
        ] {
            assert_eq!(PeerIdentity::from_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn civil_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2026, 11, 23), 20_780);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut rng = crate::rng::Rng::new(3);
        for len in 0..200 {
            let bytes: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
            let _ = identity_of(&bytes);
            let _ = validity(&bytes);
        }
        assert!(identity_of(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
