//! Mutual TLS for the cluster: a private cluster CA signs every server and worker certificate; every
//! connection authenticates both ends against that CA. rustls with the ring provider only, TLS 1.3 only.
//!
//! Server certificates always carry the DNS name [`SERVER_NAME`]; clients verify servers against that
//! name (plus the CA), so a cluster can move hosts without re-issuing certificates. Extra names or IP
//! addresses can be added with `gaps certs --san`.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The DNS name every server certificate carries and every client verifies.
pub const SERVER_NAME: &str = "gaps-server";
/// ALPN protocol identifier of the gaps protocol.
pub const ALPN: &[u8] = b"gaps/1";

/// Everything that can go wrong making or loading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Certificate generation failed.
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the material or configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client verifier could not be built (e.g. an empty CA file).
    #[error("client certificate verifier: {0}")]
    Verifier(String),
    /// A PEM file could not be read or parsed.
    #[error("reading {path}: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A subject alternative name is neither an IP address nor a DNS host name.
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
}

/// A certificate chain and its private key.
#[derive(Debug)]
pub struct Identity {
    /// Leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity { chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

/// The trust anchor plus this process's identity.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    /// Certificates of the cluster CA.
    pub ca: Vec<CertificateDer<'static>>,
    /// This process's certificate and key.
    pub identity: Identity,
}

/// A certificate and key in PEM.
#[derive(Debug, Clone)]
pub struct PemPair {
    /// Certificate, PEM.
    pub cert: String,
    /// Private key, PEM (PKCS#8).
    pub key: String,
}

/// A freshly made cluster CA with one server and one worker certificate.
#[derive(Debug, Clone)]
pub struct ClusterCerts {
    /// The CA certificate and key.
    pub ca: PemPair,
    /// Certificate for every `gaps-server` (also used as client certificate between shards).
    pub server: PemPair,
    /// Certificate for every `gaps-worker` and for observers such as `gaps local`.
    pub worker: PemPair,
}

impl ClusterCerts {
    /// Makes a new CA and signs a server certificate (names: [`SERVER_NAME`], `localhost`, `127.0.0.1`,
    /// plus `extra_sans`) and a worker certificate.
    pub fn generate(extra_sans: &[String]) -> Result<Self, TlsError> {
        if let Some(bad) = extra_sans.iter().find(|n| !is_valid_san(n)) {
            return Err(TlsError::BadName(bad.clone()));
        }
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "gaps cluster CA");
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key)?;

        let leaf = |common_name: &str, sans: Vec<String>| -> Result<PemPair, TlsError> {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(sans)?;
            params.distinguished_name.push(DnType::CommonName, common_name);
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            // Shards also connect to the coordinator as clients, so both usages are allowed.
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
            let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
            Ok(PemPair { cert: cert.pem(), key: key.serialize_pem() })
        };
        let mut server_sans = vec![SERVER_NAME.to_string(), "localhost".to_string(), "127.0.0.1".to_string()];
        server_sans.extend(extra_sans.iter().cloned());
        Ok(ClusterCerts {
            ca: PemPair { cert: ca_cert.pem(), key: ca_key.serialize_pem() },
            server: leaf("gaps server", server_sans)?,
            worker: leaf("gaps worker", vec!["gaps-worker".to_string()])?,
        })
    }

    /// Writes `ca.pem`, `ca.key`, `server.pem`, `server.key`, `worker.pem`, `worker.key` into `dir`
    /// (keys readable by the owner only).
    pub fn write_to(&self, dir: &Path) -> Result<(), TlsError> {
        std::fs::create_dir_all(dir).map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })?;
        for (name, text, secret) in [
            ("ca.pem", &self.ca.cert, false),
            ("ca.key", &self.ca.key, true),
            ("server.pem", &self.server.cert, false),
            ("server.key", &self.server.key, true),
            ("worker.pem", &self.worker.cert, false),
            ("worker.key", &self.worker.key, true),
        ] {
            let path = dir.join(name);
            write_file(&path, text.as_bytes(), secret).map_err(|source| TlsError::Write { path, source })?;
        }
        Ok(())
    }

    /// TLS material for a server.
    pub fn server_material(&self) -> Result<TlsMaterial, TlsError> {
        material_from_pem(&self.ca.cert, &self.server)
    }

    /// TLS material for a worker or observer.
    pub fn worker_material(&self) -> Result<TlsMaterial, TlsError> {
        material_from_pem(&self.ca.cert, &self.worker)
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

fn material_from_pem(ca_pem: &str, pair: &PemPair) -> Result<TlsMaterial, TlsError> {
    let pem_err = |what: &str, e: rustls::pki_types::pem::Error| TlsError::Pem {
        path: PathBuf::from(what),
        message: e.to_string(),
    };
    let ca = CertificateDer::pem_slice_iter(ca_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err("<ca>", e))?;
    let chain = CertificateDer::pem_slice_iter(pair.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err("<cert>", e))?;
    let key = PrivateKeyDer::from_pem_slice(pair.key.as_bytes()).map_err(|e| pem_err("<key>", e))?;
    Ok(TlsMaterial { ca, identity: Identity { chain, key } })
}

impl TlsMaterial {
    /// Loads the CA certificate(s), this process's certificate chain and key from PEM files.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let pem_err = |path: &Path, e: rustls::pki_types::pem::Error| TlsError::Pem {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        let certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>, TlsError> {
            let list = CertificateDer::pem_file_iter(path)
                .map_err(|e| pem_err(path, e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| pem_err(path, e))?;
            if list.is_empty() {
                return Err(TlsError::Pem { path: path.to_path_buf(), message: "no certificate in the file".into() });
            }
            Ok(list)
        };
        let ca_certs = certs(ca)?;
        let chain = certs(cert)?;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| pem_err(key, e))?;
        Ok(TlsMaterial { ca: ca_certs, identity: Identity { chain, key } })
    }

    fn roots(&self) -> Result<rustls::RootCertStore, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in &self.ca {
            roots.add(c.clone())?;
        }
        Ok(roots)
    }

    /// A TLS 1.3 server configuration that requires a client certificate signed by the cluster CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TlsError> {
        let provider = provider();
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), provider.clone())
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.identity.chain.clone(), self.identity.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// A TLS 1.3 client configuration that verifies the server against the cluster CA and presents this
    /// process's certificate.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.identity.chain.clone(), self.identity.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }
}

/// The ring crypto provider (the only one this project links).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_material_builds_both_configs_and_files_round_trip() {
        let certs = ClusterCerts::generate(&["10.0.0.7".to_string(), "ps0.example".to_string()]).expect("generate");
        certs.server_material().expect("server material").server_config().expect("server config");
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
    fn only_ip_addresses_and_host_names_are_accepted_as_names() {
        for good in ["10.0.0.1", "::1", "ps0", "ps-0.example.net", "*.ps.example.net"] {
            assert!(is_valid_san(good), "{good}");
        }
        for bad in ["", "not a name!", "-x.example", "a..b", "x_y.example", "*", "é.example"] {
            assert!(!is_valid_san(bad), "{bad}");
        }
        assert!(matches!(ClusterCerts::generate(&["bad name".into()]), Err(TlsError::BadName(_))));
    }
}
