//! Checksums object_store 0.14 does not handle, added where it lets us: in the HTTP client.
//!
//! Every request of a store goes through the [`HttpService`] its [`HttpConnector`] builds. The
//! connector of S3, GCS and Azure stores wraps the shared client ([`SharedStoreClients`]) in
//! [`Checksummed`], which does two things.
//!
//! **Uploads** (`PUT`s that carry data) get the checksum their store verifies on receipt, computed
//! from the bytes about to be sent. object_store sends S3's `x-amz-checksum-*` itself
//! (`checksum_algorithm`), but nothing to GCS or Azure: `PutOptions`/`PutMultipartOptions` carry
//! no checksum, `Attributes` has no such attribute, and the Azure client's Put Block takes no
//! options at all.
//! - GCS (object PUTs and multipart parts): `x-goog-hash: crc32c=<base64 big-endian>`; GCS refuses
//!   a body of another CRC32C (400 `BadDigest`). Bearer tokens sign no headers.
//! - Azure (Put Blob and Put Block): `Content-MD5: <base64>`; the service refuses a body of
//!   another MD5 (400 `Md5Mismatch`). A SharedKey signature covers `Content-MD5`, so such a
//!   request is signed again by object_store's own [`AzureAuthorizer`] with the store's
//!   credential ([`AzureSigning`]). Bearer tokens and SAS sign no headers.
//!
//! **The stored checksum of an object** ([`StoredChecksum`]): a `HEAD` or `GET` that carries
//! [`WantChecksum`] in its extensions (object_store passes `GetOptions::extensions` to the
//! request) has the checksum its store reports parsed from the response headers into the
//! response's extensions, which object_store hands back in `GetResult::extensions`. S3 reports
//! checksums only when asked (`x-amz-checksum-mode: ENABLED`), a header that SigV4 must sign, so
//! the request is signed again by object_store's [`AwsAuthorizer`] ([`AwsSigning`]).
//!
//! A retried request is a new call here, done again from the same bytes.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use base64::Engine;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use http_body_util::BodyExt;
use object_store::aws::{AwsAuthorizer, AwsCredentialProvider};
use object_store::azure::{AzureAuthorizer, AzureCredential, AzureCredentialProvider};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
};
use object_store::ClientOptions;

use super::clients::SharedStoreClients;

/// The checksum of a whole object that its store keeps and reports (S3's
/// `x-amz-checksum-*` with `x-amz-checksum-mode: ENABLED`, GCS's `x-goog-hash`, Azure's
/// `Content-MD5`), which `verify=True` checks the bytes read against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredChecksum {
    /// CRCs, which combine: ranges read in any order are checked without holding their bytes.
    Crc64Nvme(u64),
    Crc32c(u32),
    Crc32(u32),
    /// Digests of the bytes in order.
    Sha256([u8; 32]),
    Md5([u8; 16]),
    /// S3's checksum of a multipart upload's part checksums (`<base64>-<parts>`,
    /// `x-amz-checksum-type: COMPOSITE`): checking it needs each part's size, which a HEAD
    /// does not give.
    Composite {
        algorithm: String,
        parts: u32,
    },
}

impl StoredChecksum {
    /// Its name, as the store's header says it ("crc64nvme", "md5", ...).
    pub fn algorithm(&self) -> &str {
        match self {
            StoredChecksum::Crc64Nvme(_) => "crc64nvme",
            StoredChecksum::Crc32c(_) => "crc32c",
            StoredChecksum::Crc32(_) => "crc32",
            StoredChecksum::Sha256(_) => "sha256",
            StoredChecksum::Md5(_) => "md5",
            StoredChecksum::Composite { algorithm, .. } => algorithm,
        }
    }
}

const GOOG_HASH: HeaderName = HeaderName::from_static("x-goog-hash");
const CONTENT_MD5: HeaderName = HeaderName::from_static("content-md5");
const CHECKSUM_MODE: HeaderName = HeaderName::from_static("x-amz-checksum-mode");
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The Azure store's credentials, set once the store is built (the connector is given to the
/// builder before there is a store to ask).
#[derive(Debug, Default)]
pub struct AzureSigning {
    pub credentials: OnceLock<AzureCredentialProvider>,
}

/// The S3 store's credentials, set once the store is built.
#[derive(Debug, Default)]
pub struct AwsSigning {
    pub credentials: OnceLock<AwsCredentialProvider>,
}

/// The store behind a connector.
#[derive(Debug, Clone)]
pub enum StoreChecksums {
    S3(Arc<AwsSigning>),
    Gcs,
    Azure(Arc<AzureSigning>),
}

/// A request extension: report the object's stored checksum (see the module's docs).
#[derive(Debug, Clone, Copy)]
pub struct WantChecksum;

/// A response extension: what the store reported (`None`: no checksum it keeps).
#[derive(Debug, Clone)]
pub struct Reported(pub Option<StoredChecksum>);

/// The checksum `store` keeps for the whole object at `path` (a HEAD that asks for it), `None`
/// when it keeps none (or is a store this module does not wrap: plain HTTP).
pub async fn stored_checksum(
    store: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
) -> object_store::Result<Option<StoredChecksum>> {
    let mut extensions = http::Extensions::new();
    extensions.insert(WantChecksum);
    let options = object_store::GetOptions {
        head: true,
        extensions,
        ..Default::default()
    };
    let result = store.get_opts(path, options).await?;
    Ok(result
        .extensions
        .get::<Reported>()
        .and_then(|r| r.0.clone()))
}

/// The connector of an S3, GCS or Azure store: the shared client, wrapped in [`Checksummed`].
#[derive(Debug, Clone)]
pub struct ChecksumConnector(pub StoreChecksums);

impl HttpConnector for ChecksumConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = SharedStoreClients.connect(options)?;
        Ok(HttpClient::new(Checksummed {
            inner,
            kind: self.0.clone(),
        }))
    }
}

/// An [`HttpService`] that adds checksums to uploads and reads stored checksums, around `inner`.
#[derive(Debug)]
pub struct Checksummed {
    inner: HttpClient,
    kind: StoreChecksums,
}

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> HttpError {
    HttpError::new(HttpErrorKind::Request, e)
}

fn other(message: &str) -> HttpError {
    failed(std::io::Error::other(message.to_string()))
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
        let want = request.extensions().get::<WantChecksum>().is_some()
            && matches!(*request.method(), Method::GET | Method::HEAD);
        match &self.kind {
            StoreChecksums::Gcs if is_data_upload(&request) => {
                let mut crc = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
                each_chunk(&request, |data| crc.update(data)).await?;
                let value = format!("crc32c={}", crc32c_base64(crc.finalize() as u32));
                let value = HeaderValue::from_str(&value).map_err(failed)?;
                request.headers_mut().insert(GOOG_HASH, value);
            }
            StoreChecksums::Azure(signing) if is_data_upload(&request) => {
                use md5::Digest;
                let mut md5 = md5::Md5::new();
                each_chunk(&request, |data| md5.update(data)).await?;
                let value = HeaderValue::from_str(&B64.encode(md5.finalize())).map_err(failed)?;
                request.headers_mut().insert(CONTENT_MD5, value);
                resign_azure(&mut request, signing).await?;
            }
            // S3 Express session requests are signed with a session token this module does
            // not re-create: they go as they are.
            StoreChecksums::S3(signing)
                if want && !request.headers().contains_key("x-amz-s3session-token") =>
            {
                let enabled = HeaderValue::from_static("ENABLED");
                request.headers_mut().insert(CHECKSUM_MODE, enabled);
                resign_aws(&mut request, signing).await?;
            }
            _ => {}
        }
        let mut response = self.inner.execute(request).await?;
        if want {
            let found = reported(response.headers(), &self.kind);
            response.extensions_mut().insert(Reported(found));
        }
        Ok(response)
    }
}

/// Runs `f` on each chunk of `request`'s body (chunks are shared, not copied).
async fn each_chunk(request: &HttpRequest, mut f: impl FnMut(&[u8])) -> Result<(), HttpError> {
    let mut body = request.body().clone();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            f(&data);
        }
    }
    Ok(())
}

/// GCS's form of a CRC32C: base64 of its four bytes, big-endian.
pub fn crc32c_base64(crc: u32) -> String {
    B64.encode(crc.to_be_bytes())
}

fn decode<const N: usize>(value: &str) -> Option<[u8; N]> {
    B64.decode(value.trim()).ok()?.try_into().ok()
}

/// The whole object's checksum in `headers`, as `kind`'s store reports it.
fn reported(headers: &HeaderMap, kind: &StoreChecksums) -> Option<StoredChecksum> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    match kind {
        StoreChecksums::S3(_) => {
            let composite = get("x-amz-checksum-type") == Some("COMPOSITE");
            for algorithm in ["crc64nvme", "crc32c", "crc32", "sha256", "sha1"] {
                let Some(value) = get(&format!("x-amz-checksum-{algorithm}")) else {
                    continue;
                };
                if let Some((_, parts)) = value.rsplit_once('-') {
                    let parts = parts.parse().unwrap_or(0);
                    let algorithm = algorithm.to_string();
                    return Some(StoredChecksum::Composite { algorithm, parts });
                }
                if composite {
                    let algorithm = algorithm.to_string();
                    return Some(StoredChecksum::Composite {
                        algorithm,
                        parts: 0,
                    });
                }
                return match algorithm {
                    "crc64nvme" => {
                        decode(value).map(|b| StoredChecksum::Crc64Nvme(u64::from_be_bytes(b)))
                    }
                    "crc32c" => {
                        decode(value).map(|b| StoredChecksum::Crc32c(u32::from_be_bytes(b)))
                    }
                    "crc32" => decode(value).map(|b| StoredChecksum::Crc32(u32::from_be_bytes(b))),
                    "sha256" => decode(value).map(StoredChecksum::Sha256),
                    _ => None,
                };
            }
            None
        }
        // `x-goog-hash: crc32c=...,md5=...` (possibly as two headers); objects from a composite
        // or multipart upload have no MD5, every object has a CRC32C.
        StoreChecksums::Gcs => {
            let mut md5 = None;
            for value in headers.get_all(GOOG_HASH) {
                for item in value.to_str().unwrap_or("").split(',') {
                    match item.trim().split_once('=') {
                        Some(("crc32c", v)) => {
                            if let Some(b) = decode(v) {
                                return Some(StoredChecksum::Crc32c(u32::from_be_bytes(b)));
                            }
                        }
                        Some(("md5", v)) => md5 = decode(v).map(StoredChecksum::Md5),
                        _ => {}
                    }
                }
            }
            md5
        }
        // A whole read's `Content-MD5` is the blob's; a ranged one's is in
        // `x-ms-blob-content-md5`. Blobs committed from blocks have one only when the writer set
        // it.
        StoreChecksums::Azure(_) => get("x-ms-blob-content-md5")
            .or_else(|| get("content-md5"))
            .and_then(decode)
            .map(StoredChecksum::Md5),
    }
}

/// Signs `request` again when it was signed with the account key (its headers changed).
async fn resign_azure(request: &mut HttpRequest, signing: &AzureSigning) -> Result<(), HttpError> {
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
        return Err(other("the Azure store's credentials were not recorded"));
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

/// Signs `request` again (SigV4) when object_store signed it, for the region and service its
/// signature named, with the same payload hash.
async fn resign_aws(request: &mut HttpRequest, signing: &AwsSigning) -> Result<(), HttpError> {
    let headers = request.headers();
    let Some(auth) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(()); // unsigned (skip_signature): nothing to sign again
    };
    // `AWS4-HMAC-SHA256 Credential=<key>/<date>/<region>/<service>/aws4_request, ...`
    let scope: Vec<&str> = auth
        .split("Credential=")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map(|s| s.split('/').collect())
        .unwrap_or_default();
    let [_, _, region, service, _] = scope[..] else {
        return Err(other("an S3 request's signature has no credential scope"));
    };
    let (region, service) = (region.to_string(), service.to_string());
    let payload = headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("UNSIGNED-PAYLOAD")
        .to_string();
    let Some(credentials) = signing.credentials.get() else {
        return Err(other("the S3 store's credentials were not recorded"));
    };
    let credential = credentials.get_credential().await.map_err(failed)?;
    request.headers_mut().remove(http::header::AUTHORIZATION);
    let authorizer = AwsAuthorizer::new(&credential, &service, &region);
    let digest = (payload.len() == 64)
        .then(|| {
            (0..32)
                .map(|i| u8::from_str_radix(&payload[2 * i..2 * i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()
        })
        .flatten();
    match digest {
        Some(digest) => authorizer.try_authorize(request, Some(&digest)),
        None => authorizer
            .with_sign_payload(false)
            .try_authorize(request, None),
    }
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

    #[test]
    fn stored_checksums_are_read_as_each_store_sends_them() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_static(v));
            }
            h
        };
        let s3 = StoreChecksums::S3(Arc::default());
        let got = reported(&headers(&[("x-amz-checksum-crc32c", "4waSgw==")]), &s3);
        assert_eq!(got, Some(StoredChecksum::Crc32c(0xE306_9283)));
        let got = reported(
            &headers(&[("x-amz-checksum-crc64nvme", "rosUhgp5mIg=")]),
            &s3,
        );
        assert_eq!(got, Some(StoredChecksum::Crc64Nvme(0xAE8B_1486_0A79_9888)));
        let composite = [
            (
                "x-amz-checksum-sha256",
                "X2xVbDgfqxC4Crnz0iRiVdplfva7ILBOxgwkVgUO6Oc=-2",
            ),
            ("x-amz-checksum-type", "COMPOSITE"),
        ];
        let got = reported(&headers(&composite), &s3);
        let algorithm = "sha256".to_string();
        assert_eq!(
            got,
            Some(StoredChecksum::Composite {
                algorithm,
                parts: 2
            })
        );
        assert_eq!(reported(&headers(&[("etag", "\"x\"")]), &s3), None);

        let gcs = StoreChecksums::Gcs;
        let both = [
            ("x-goog-hash", "md5=XrY7u+Ae7tCTyyK7j1rNww=="),
            ("x-goog-hash", "crc32c=4waSgw=="),
        ];
        assert_eq!(
            reported(&headers(&both), &gcs),
            Some(StoredChecksum::Crc32c(0xE306_9283))
        );
        let md5 = [("x-goog-hash", "md5=XrY7u+Ae7tCTyyK7j1rNww==")];
        assert!(matches!(
            reported(&headers(&md5), &gcs),
            Some(StoredChecksum::Md5(_))
        ));

        let az = StoreChecksums::Azure(Arc::default());
        let md5 = [("content-md5", "XrY7u+Ae7tCTyyK7j1rNww==")];
        assert!(matches!(
            reported(&headers(&md5), &az),
            Some(StoredChecksum::Md5(_))
        ));
        assert_eq!(reported(&headers(&[]), &az), None);
    }
}
