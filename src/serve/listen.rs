//! The listener: plain TCP or TLS (rustls on ring), HTTP/1.1 and HTTP/2 on each connection
//! (hyper's automatic builder), until SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::{Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::routes::Client;
use crate::error::{Error, Result};

/// A TLS acceptor for the PEM certificate chain and private key in these files.
pub fn tls(cert: &str, key: &str) -> Result<TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |flag: &str, path: &str, e: &dyn std::fmt::Display| {
        Error::option(flag, format!("{path}: {e}"))
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| bad("--tls-cert", cert, &e))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("--tls-key", key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
        .map_err(|e| bad("--tls-cert", cert, &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// SIGTERM or SIGINT, whichever comes first; the handlers are in place once this returns (a
/// serve installs them before it says it is ready, so a signal right after stops it cleanly).
pub fn stop_signals() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let signal_error = |e: std::io::Error| Error::io("signal handler", e);
    let mut term = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut int = signal(SignalKind::interrupt()).map_err(signal_error)?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Serves `router` on `listener` until `stop`; each connection in its own task.
pub async fn run(
    listener: TcpListener,
    router: Router,
    tls: Option<TlsAcceptor>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of descriptors, a connection reset before accept: the next one may do.
                Err(e) => {
                    eprintln!("fastload serve: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => return,
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(stream, peer, router.clone(), tls.clone()));
    }
}

async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    router: Router,
    tls: Option<TlsAcceptor>,
) {
    let service = TowerToHyperService::new(router.layer(Extension(Client(peer.ip()))));
    let builder = auto::Builder::new(TokioExecutor::new());
    // A connection that fails (a client gone, a TLS handshake refused) ends only itself.
    let _ = match tls {
        None => {
            builder
                .serve_connection(TokioIo::new(stream), service)
                .await
        }
        Some(tls) => match tls.accept(stream).await {
            Ok(stream) => {
                builder
                    .serve_connection(TokioIo::new(stream), service)
                    .await
            }
            Err(_) => return,
        },
    };
}
