//! Mutual TLS for the cluster: a private cluster CA signs every server and worker certificate (issued by
//! `gaps_setup::certs`); every connection authenticates both ends against that CA. rustls with the ring
//! provider only, TLS 1.3 only.
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

/// Everything that can go wrong loading TLS material or building a configuration from it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
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

impl TlsMaterial {
    /// Material from PEM text: the CA certificate(s), this process's certificate chain and its key.
    pub fn from_pem(ca: &str, cert: &str, key: &str) -> Result<Self, TlsError> {
        let pem_err = |what: &str, e: rustls::pki_types::pem::Error| TlsError::Pem {
            path: PathBuf::from(what),
            message: e.to_string(),
        };
        let ca = CertificateDer::pem_slice_iter(ca.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err("<ca>", e))?;
        let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err("<cert>", e))?;
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| pem_err("<key>", e))?;
        Ok(TlsMaterial { ca, identity: Identity { chain, key } })
    }

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

    /// The gaps identity this process's own certificate names.
    pub fn own_identity(&self) -> Result<crate::identity::PeerIdentity, crate::identity::IdentityError> {
        let leaf = self.identity.chain.first().ok_or(crate::identity::IdentityError::Malformed("no certificate"))?;
        crate::identity::identity_of(leaf)
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
    fn material_that_is_not_pem_is_a_clear_error() {
        let err = TlsMaterial::from_pem("not a certificate", "", "").expect_err("no key");
        assert!(matches!(err, TlsError::Pem { .. }), "{err}");
        let missing = std::path::Path::new("/nonexistent/gaps-ca.pem");
        let err = TlsMaterial::load(missing, missing, missing).expect_err("no file");
        assert!(err.to_string().contains("gaps-ca.pem"), "{err}");
    }
}
