//! Certificate issuance: the cluster CA and the shard and worker certificates it signs (rcgen with ring),
//! what `gaps certs` writes and what `gaps local` and the tests make in memory. Each leaf names its holder's
//! gaps identity ([`gaps_common::identity`]) in its URI name; loading material and the TLS configurations
//! that check it are [`gaps_transport::tls`]'s.

use gaps_common::identity;
use gaps_transport::tls::{TlsError, TlsMaterial, SERVER_NAME};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::path::{Path, PathBuf};

/// Everything that can go wrong issuing certificates or writing them.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// Certificate generation failed.
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// A subject alternative name is neither an IP address nor a DNS host name, or a cluster or worker name
    /// is not one.
    #[error("{0:?} is neither an IP address nor a DNS host name")]
    BadName(String),
    /// Writing certificate files failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The certificate asked for was not made.
    #[error("{file}: {message}")]
    Missing {
        /// The file it would be written to.
        file: String,
        /// What is missing.
        message: String,
    },
    /// A validity date the certificate cannot carry.
    #[error("a validity date out of range: {0}")]
    Date(String),
    /// What was issued did not load as TLS material.
    #[error(transparent)]
    Material(#[from] TlsError),
}

/// A certificate and key in PEM.
#[derive(Debug, Clone)]
pub struct PemPair {
    /// Certificate, PEM.
    pub cert: String,
    /// Private key, PEM (PKCS#8).
    pub key: String,
}

/// What `gaps certs` makes.
#[derive(Debug, Clone)]
pub struct CertOptions {
    /// The cluster's name, in every certificate: clusters sharing a CA cannot talk to each other.
    pub cluster: String,
    /// Shard certificates to issue (indices `0..shards`).
    pub shards: u32,
    /// Worker certificates to issue, by name (`worker` is the one `gaps local` and the README use).
    pub workers: Vec<String>,
    /// Extra DNS names or IP addresses for every shard certificate.
    pub sans: Vec<String>,
    /// How long the leaf certificates are valid (from an hour ago, for clock skew).
    pub validity: std::time::Duration,
    /// How long a new CA is valid.
    pub ca_validity: std::time::Duration,
}

/// Default of [`CertOptions::validity`]: a year.
pub const DEFAULT_VALIDITY: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);
/// Default of [`CertOptions::ca_validity`]: ten years.
pub const DEFAULT_CA_VALIDITY: std::time::Duration = std::time::Duration::from_secs(10 * 365 * 86_400);
/// The cluster name when none is given.
pub const DEFAULT_CLUSTER: &str = "gaps";

impl Default for CertOptions {
    fn default() -> Self {
        CertOptions {
            cluster: DEFAULT_CLUSTER.into(),
            shards: 4,
            workers: vec!["worker".into()],
            sans: Vec::new(),
            validity: DEFAULT_VALIDITY,
            ca_validity: DEFAULT_CA_VALIDITY,
        }
    }
}

/// The cluster CA: signs shard and worker certificates.
pub struct CertificateAuthority {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    /// Its certificate and key, PEM.
    pub pem: PemPair,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority").finish_non_exhaustive()
    }
}

fn time_in(from_now: std::time::Duration, back: bool) -> Result<time::OffsetDateTime, CertError> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let at = if back { now.saturating_sub(from_now) } else { now + from_now };
    time::OffsetDateTime::from_unix_timestamp(at.as_secs() as i64).map_err(|e| CertError::Date(e.to_string()))
}

fn ca_params(validity: std::time::Duration) -> Result<rcgen::CertificateParams, CertError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, "gaps cluster CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = time_in(std::time::Duration::from_secs(3600), true)?;
    params.not_after = time_in(validity, false)?;
    Ok(params)
}

impl CertificateAuthority {
    /// A new CA valid for `validity`.
    pub fn new(validity: std::time::Duration) -> Result<Self, CertError> {
        let key = rcgen::KeyPair::generate()?;
        let cert = ca_params(validity)?.self_signed(&key)?;
        let pem = PemPair { cert: cert.pem(), key: key.serialize_pem() };
        Ok(CertificateAuthority { cert, key, pem })
    }

    /// The CA `gaps certs` made earlier, from its PEM files, to issue more certificates under it (they
    /// verify against the original `ca.pem`: same name, same key).
    pub fn load(pem: PemPair) -> Result<Self, CertError> {
        let key = rcgen::KeyPair::from_pem(&pem.key)?;
        let cert = ca_params(DEFAULT_CA_VALIDITY)?.self_signed(&key)?;
        Ok(CertificateAuthority { cert, key, pem })
    }

    fn leaf(
        &self,
        identity: &identity::PeerIdentity,
        names: Vec<String>,
        server: bool,
        validity: std::time::Duration,
    ) -> Result<PemPair, CertError> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType};
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, identity.uri());
        params.subject_alt_names.push(SanType::URI(identity.uri().try_into()?));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Shards also connect to the coordinator as clients; workers are clients only.
        params.extended_key_usages = if server {
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.not_before = time_in(std::time::Duration::from_secs(3600), true)?;
        params.not_after = time_in(validity, false)?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(PemPair { cert: cert.pem(), key: key.serialize_pem() })
    }

    /// A certificate for shard `index` of `cluster` (names: [`SERVER_NAME`], `localhost`, `127.0.0.1`,
    /// plus `sans`).
    pub fn issue_shard(
        &self,
        cluster: &str,
        index: u32,
        sans: &[String],
        validity: std::time::Duration,
    ) -> Result<PemPair, CertError> {
        if let Some(bad) = sans.iter().find(|n| !is_valid_san(n)) {
            return Err(CertError::BadName(bad.clone()));
        }
        check_name(cluster)?;
        let mut names = vec![SERVER_NAME.to_string(), "localhost".to_string(), "127.0.0.1".to_string()];
        names.extend(sans.iter().cloned());
        let id = identity::PeerIdentity { cluster: cluster.into(), role: identity::Role::Shard(index) };
        self.leaf(&id, names, true, validity)
    }

    /// A worker certificate named `name` (client use only).
    pub fn issue_worker(&self, cluster: &str, name: &str, validity: std::time::Duration) -> Result<PemPair, CertError> {
        check_name(cluster)?;
        check_name(name)?;
        let id = identity::PeerIdentity { cluster: cluster.into(), role: identity::Role::Worker(name.into()) };
        self.leaf(&id, Vec::new(), false, validity)
    }
}

fn check_name(name: &str) -> Result<(), CertError> {
    if identity::is_valid_name(name) {
        Ok(())
    } else {
        Err(CertError::BadName(format!("{name} (a cluster or worker name is 1-63 letters, digits, '-', '_' or '.')")))
    }
}

/// A cluster CA with shard and worker certificates.
#[derive(Debug, Clone)]
pub struct ClusterCerts {
    /// The cluster's name.
    pub cluster: String,
    /// The CA certificate and key.
    pub ca: PemPair,
    /// Shard `i`'s certificate at index `i`.
    pub shards: Vec<PemPair>,
    /// Worker certificates by name.
    pub workers: Vec<(String, PemPair)>,
}

impl ClusterCerts {
    /// A new CA with the default options and `extra_sans` on the shard certificates (4 shards, one worker
    /// certificate named `worker`, cluster [`DEFAULT_CLUSTER`]).
    pub fn generate(extra_sans: &[String]) -> Result<Self, CertError> {
        Self::make(&CertOptions { sans: extra_sans.to_vec(), ..CertOptions::default() }, None)
    }

    /// Certificates as `opts` says, under `ca` (a new CA when None).
    pub fn make(opts: &CertOptions, ca: Option<&CertificateAuthority>) -> Result<Self, CertError> {
        let fresh;
        let ca = match ca {
            Some(ca) => ca,
            None => {
                fresh = CertificateAuthority::new(opts.ca_validity)?;
                &fresh
            }
        };
        let shards = (0..opts.shards)
            .map(|i| ca.issue_shard(&opts.cluster, i, &opts.sans, opts.validity))
            .collect::<Result<Vec<_>, _>>()?;
        let workers = opts
            .workers
            .iter()
            .map(|w| ca.issue_worker(&opts.cluster, w, opts.validity).map(|p| (w.clone(), p)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ClusterCerts { cluster: opts.cluster.clone(), ca: ca.pem.clone(), shards, workers })
    }

    /// The file names [`ClusterCerts::write_to`] writes (certificate, key), CA first.
    pub fn file_names(&self) -> Vec<(String, String)> {
        let mut names = vec![("ca.pem".to_string(), "ca.key".to_string())];
        names.extend((0..self.shards.len()).map(|i| (format!("shard-{i}.pem"), format!("shard-{i}.key"))));
        names.extend(self.workers.iter().map(|(w, _)| (format!("{w}.pem"), format!("{w}.key"))));
        names
    }

    /// Writes `ca.pem`/`ca.key`, `shard-<i>.pem`/`.key` and `<worker>.pem`/`.key` into `dir` (keys readable
    /// by the owner only).
    pub fn write_to(&self, dir: &Path) -> Result<(), CertError> {
        std::fs::create_dir_all(dir).map_err(|source| CertError::Write { path: dir.to_path_buf(), source })?;
        let pairs = std::iter::once(&self.ca).chain(&self.shards).chain(self.workers.iter().map(|(_, p)| p));
        for ((cert_name, key_name), pair) in self.file_names().into_iter().zip(pairs) {
            for (name, text, secret) in [(cert_name, &pair.cert, false), (key_name, &pair.key, true)] {
                let path = dir.join(name);
                write_file(&path, text.as_bytes(), secret).map_err(|source| CertError::Write { path, source })?;
            }
        }
        Ok(())
    }

    /// TLS material for shard `index`.
    pub fn shard_material(&self, index: u32) -> Result<TlsMaterial, CertError> {
        let pair = self.shards.get(index as usize).ok_or_else(|| CertError::Missing {
            file: format!("shard-{index}.pem"),
            message: format!("only {} shard certificates were made", self.shards.len()),
        })?;
        Ok(TlsMaterial::from_pem(&self.ca.cert, &pair.cert, &pair.key)?)
    }

    /// The CA's certificate, as trust anchors (to combine CAs during a rotation).
    pub fn ca_certs(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(self.ca.cert.as_bytes()).filter_map(Result::ok).collect()
    }

    /// TLS material for a worker or observer (the first worker certificate).
    pub fn worker_material(&self) -> Result<TlsMaterial, CertError> {
        let (_, pair) = self.workers.first().ok_or_else(|| CertError::Missing {
            file: "worker.pem".into(),
            message: "no worker certificate was made".into(),
        })?;
        Ok(TlsMaterial::from_pem(&self.ca.cert, &pair.cert, &pair.key)?)
    }

    /// TLS material for the worker certificate named `name`.
    pub fn named_worker_material(&self, name: &str) -> Result<TlsMaterial, CertError> {
        let (_, pair) = self.workers.iter().find(|(w, _)| w == name).ok_or_else(|| CertError::Missing {
            file: format!("{name}.pem"),
            message: "no such worker certificate".into(),
        })?;
        Ok(TlsMaterial::from_pem(&self.ca.cert, &pair.cert, &pair.key)?)
    }
}

/// An IP address, or a DNS host name: dot-separated labels of 1–63 letters, digits and inner hyphens
/// (a leading `*.` wildcard label is allowed), at most 253 characters.
fn is_valid_san(name: &str) -> bool {
    if name.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let host = name.strip_prefix("*.").unwrap_or(name);
    !host.is_empty()
        && name.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn write_file(path: &Path, bytes: &[u8], secret: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    options.open(path)?.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_material_builds_both_configs_and_files_round_trip() {
        let certs = ClusterCerts::generate(&["10.0.0.7".to_string(), "ps0.example".to_string()]).expect("generate");
        certs.shard_material(0).expect("server material").server_config().expect("server config");
        certs.worker_material().expect("worker material").client_config().expect("client config");
        let dir = std::env::temp_dir().join(format!("gaps-tls-test-{}", std::process::id()));
        certs.write_to(&dir).expect("write");
        let loaded =
            TlsMaterial::load(&dir.join("ca.pem"), &dir.join("worker.pem"), &dir.join("worker.key")).expect("load");
        assert_eq!(loaded.ca.len(), 1);
        let missing = TlsMaterial::load(&dir.join("nope.pem"), &dir.join("worker.pem"), &dir.join("worker.key"));
        assert!(matches!(missing, Err(TlsError::Pem { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn certificates_carry_their_role_cluster_and_a_bounded_validity() {
        use gaps_common::identity::{identity_of, validity, PeerIdentity, Role};
        let opts = CertOptions {
            cluster: "blue".into(),
            shards: 2,
            workers: vec!["worker".into(), "alice".into()],
            validity: std::time::Duration::from_secs(30 * 86_400),
            ..CertOptions::default()
        };
        let certs = ClusterCerts::make(&opts, None).expect("certs");
        let der = |pem: &str| CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem").to_vec();
        for (i, shard) in certs.shards.iter().enumerate() {
            let id = identity_of(&der(&shard.cert)).expect("identity");
            assert_eq!(id, PeerIdentity { cluster: "blue".into(), role: Role::Shard(i as u32) });
        }
        let alice = identity_of(&der(&certs.workers[1].1.cert)).expect("identity");
        assert_eq!(alice.role, Role::Worker("alice".into()));
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() as i64;
        let (from, to) = validity(&der(&certs.workers[0].1.cert)).expect("validity");
        assert!(from <= now && now - from <= 3700, "{from} {now}");
        assert!((to - now - 30 * 86_400).abs() < 120, "valid for 30 days: {to} {now}");
        // The CA's own certificate names no role.
        assert!(identity_of(&der(&certs.ca.cert)).is_err());
        // A CA loaded back from its files issues certificates that verify against the original ca.pem.
        let again = CertificateAuthority::load(certs.ca.clone()).expect("load ca");
        let other = ClusterCerts::make(&CertOptions { cluster: "green".into(), ..opts }, Some(&again)).expect("more");
        assert_eq!(other.ca.cert, certs.ca.cert);
        let der_ca = der(&certs.ca.cert);
        let anchor = webpki_anchor_check(&der_ca, &der(&other.shards[1].cert));
        assert!(anchor, "a certificate issued by the reloaded CA verifies under the original");
    }

    /// Verifies `leaf` against `ca` as a server certificate, the way rustls does.
    fn webpki_anchor_check(ca: &[u8], leaf: &[u8]) -> bool {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(ca.to_vec())).expect("root");
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            gaps_transport::tls::provider(),
        )
        .build()
        .expect("verifier");
        use rustls::client::danger::ServerCertVerifier;
        let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).expect("name");
        verifier
            .verify_server_cert(
                &CertificateDer::from(leaf.to_vec()),
                &[],
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .is_ok()
    }

    #[test]
    fn only_ip_addresses_and_host_names_are_accepted_as_names() {
        for good in ["10.0.0.1", "::1", "ps0", "ps-0.example.net", "*.ps.example.net"] {
            assert!(is_valid_san(good), "{good}");
        }
        for bad in ["", "not a name!", "-x.example", "a..b", "x_y.example", "*", "é.example"] {
            assert!(!is_valid_san(bad), "{bad}");
        }
        assert!(matches!(ClusterCerts::generate(&["bad name".into()]), Err(CertError::BadName(_))));
    }
}
