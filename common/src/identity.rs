//! Who a certificate says its holder is. `gaps certs` writes the role into a URI subject alternative name:
//!
//! - `spiffe://<cluster>/shard/<index>` — shard `index` (server and client use);
//! - `spiffe://<cluster>/worker/<name>` — a worker or observer (client use only).
//!
//! The certificate has already been verified against the cluster CA by rustls when this runs; this module
//! only reads the name (the URI entries of the subject alternative names) and the validity period, with
//! x509-parser (the fuzz target `identity` feeds it arbitrary bytes). Anything it cannot read is an error,
//! never a panic.

use std::fmt;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

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

/// The certificate in `cert_der` (DER), read by x509-parser.
fn parse(cert_der: &[u8]) -> Result<X509Certificate<'_>, IdentityError> {
    match X509Certificate::from_der(cert_der) {
        Ok((_, cert)) => Ok(cert),
        Err(_) => Err(IdentityError::Malformed("not an X.509 certificate in DER")),
    }
}

/// Every URI in the certificate's subject alternative names.
pub fn san_uris(cert_der: &[u8]) -> Result<Vec<String>, IdentityError> {
    let cert = parse(cert_der)?;
    let san = match cert.subject_alternative_name() {
        Ok(Some(san)) => san,
        Ok(None) => return Ok(Vec::new()),
        Err(_) => return Err(IdentityError::Malformed("the subject alternative names")),
    };
    let uris = san.value.general_names.iter().filter_map(|name| match name {
        GeneralName::URI(uri) => Some(uri.to_string()),
        _ => None,
    });
    Ok(uris.collect())
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
    let validity = parse(cert_der)?.validity().clone();
    Ok((validity.not_before.timestamp(), validity.not_after.timestamp()))
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
