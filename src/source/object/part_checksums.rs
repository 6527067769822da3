//! Per-request checksums on uploads to GCS and Azure, which object_store 0.14 does not send.
//!
//! object_store sends S3's `x-amz-checksum-*` itself (`checksum_algorithm`), but nothing to GCS
//! or Azure: its `PutOptions`/`PutMultipartOptions` carry no checksum, `Attributes` has no such
//! attribute, and the Azure client's Put Block takes no options at all. What it does offer is the
//! HTTP client: every request goes through the [`HttpService`] its [`HttpConnector`] builds. So
//! the connector of GCS and Azure stores wraps the shared client ([`SharedStoreClients`]) in
//! [`Checksummed`], which adds to each `PUT` that carries data the checksum the store verifies on
//! receipt, computed from the bytes about to be sent:
//!
//! - GCS (object PUTs and multipart parts): `x-goog-hash: crc32c=<base64 big-endian>`; GCS
//!   refuses a body of another CRC32C (400 `BadDigest`). Bearer authentication does not sign
//!   headers, so nothing else changes.
//! - Azure (Put Blob and Put Block): `Content-MD5: <base64>`; the service refuses a body of
//!   another MD5 (400 `Md5Mismatch`). A SharedKey signature covers `Content-MD5`, so a request
//!   signed with the account key is signed again, by object_store's own [`AzureAuthorizer`],
//!   with the store's credential ([`AzureSigning`]). Bearer tokens and SAS sign no headers.
//!
//! A retried request is a new call here, checksummed again from the same bytes.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use base64::Engine;
use http::{HeaderName, HeaderValue, Method};
use http_body_util::BodyExt;
use object_store::azure::{AzureAuthorizer, AzureCredential, AzureCredentialProvider};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
};
use object_store::ClientOptions;

use crate::source::clients::SharedStoreClients;

const GOOG_HASH: HeaderName = HeaderName::from_static("x-goog-hash");
const CONTENT_MD5: HeaderName = HeaderName::from_static("content-md5");

/// The Azure store's credentials, set once the store is built (the connector is given to the
/// builder before there is a store to ask).
#[derive(Debug, Default)]
pub struct AzureSigning {
    pub credentials: OnceLock<AzureCredentialProvider>,
}

/// Which checksum a store's uploads carry.
#[derive(Debug, Clone)]
pub enum PartChecksum {
    /// GCS: `x-goog-hash: crc32c=`.
    Crc32c,
    /// Azure: `Content-MD5`, re-signed with SharedKey credentials.
    Md5(Arc<AzureSigning>),
}

/// The connector of a GCS or Azure store: the shared client, wrapped in [`Checksummed`].
#[derive(Debug, Clone)]
pub struct ChecksumConnector(pub PartChecksum);

impl HttpConnector for ChecksumConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = SharedStoreClients.connect(options)?;
        Ok(HttpClient::new(Checksummed {
            inner,
            kind: self.0.clone(),
        }))
    }
}

/// An [`HttpService`] that adds a checksum header to uploads, then sends them with `inner`.
#[derive(Debug)]
pub struct Checksummed {
    inner: HttpClient,
    kind: PartChecksum,
}

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> HttpError {
    HttpError::new(HttpErrorKind::Request, e)
}

/// Whether `request` is an upload of data the store can check: a `PUT` with a body, other than
/// Azure's Put Block List (its body is the list, not data).
fn is_data_upload(request: &HttpRequest) -> bool {
    request.method() == Method::PUT
        // Not `is_empty()`: object_store 0.14's is true for a non-empty multi-chunk payload.
        && request.body().content_length() > 0
        && !request
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "comp=blocklist"))
}

#[async_trait]
impl HttpService for Checksummed {
    async fn call(&self, mut request: HttpRequest) -> Result<HttpResponse, HttpError> {
        if is_data_upload(&request) {
            let mut body = request.body().clone();
            match &self.kind {
                PartChecksum::Crc32c => {
                    let mut crc = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
                    while let Some(frame) = body.frame().await {
                        if let Ok(data) = frame?.into_data() {
                            crc.update(&data);
                        }
                    }
                    let value = format!("crc32c={}", crc32c_base64(crc.finalize() as u32));
                    let value = HeaderValue::from_str(&value).map_err(failed)?;
                    request.headers_mut().insert(GOOG_HASH, value);
                }
                PartChecksum::Md5(signing) => {
                    use md5::Digest;
                    let mut md5 = md5::Md5::new();
                    while let Some(frame) = body.frame().await {
                        if let Ok(data) = frame?.into_data() {
                            md5.update(&data);
                        }
                    }
                    let value = base64::engine::general_purpose::STANDARD.encode(md5.finalize());
                    let value = HeaderValue::from_str(&value).map_err(failed)?;
                    request.headers_mut().insert(CONTENT_MD5, value);
                    resign(&mut request, signing).await?;
                }
            }
        }
        self.inner.execute(request).await
    }
}

/// GCS's form of a CRC32C: base64 of its four bytes, big-endian.
pub fn crc32c_base64(crc: u32) -> String {
    base64::engine::general_purpose::STANDARD.encode(crc.to_be_bytes())
}

/// Signs `request` again when it was signed with the account key (its headers changed).
async fn resign(request: &mut HttpRequest, signing: &AzureSigning) -> Result<(), HttpError> {
    // `SharedKey <account>:<signature>`: the account is the one object_store signed for.
    let Some(account) = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("SharedKey "))
        .and_then(|v| v.split_once(':'))
        .map(|(account, _)| account.to_string())
    else {
        return Ok(());
    };
    let Some(credentials) = signing.credentials.get() else {
        return Err(failed(std::io::Error::other(
            "the Azure store's credentials were not recorded for re-signing",
        )));
    };
    let credential = credentials.get_credential().await.map_err(failed)?;
    if !matches!(*credential, AzureCredential::AccessKey(_)) {
        return Ok(());
    }
    request.headers_mut().remove(http::header::AUTHORIZATION);
    AzureAuthorizer::new(&credential, &account)
        .try_authorize(request)
        .map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_gcs_base64_big_endian() {
        // RFC 3720's check value of CRC32C("123456789") is 0xE3069283.
        let crc = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, b"123456789") as u32;
        assert_eq!(crc, 0xE306_9283);
        assert_eq!(crc32c_base64(crc), "4waSgw==");
    }

    #[test]
    fn only_puts_of_data_are_checksummed() {
        let req = |method: Method, uri: &str, body: &'static [u8]| {
            http::Request::builder()
                .method(method)
                .uri(uri)
                .body(bytes::Bytes::from_static(body).into())
                .unwrap()
        };
        assert!(is_data_upload(&req(
            Method::PUT,
            "http://h/c/b?comp=block&blockid=QQ",
            b"x"
        )));
        assert!(is_data_upload(&req(Method::PUT, "http://h/b/o", b"x")));
        assert!(!is_data_upload(&req(
            Method::PUT,
            "http://h/c/b?comp=blocklist",
            b"<x/>"
        )));
        assert!(!is_data_upload(&req(Method::PUT, "http://h/b/o", b"")));
        assert!(!is_data_upload(&req(
            Method::POST,
            "http://h/b/o?uploads",
            b"x"
        )));
        assert!(!is_data_upload(&req(Method::GET, "http://h/b/o", b"")));
    }
}
