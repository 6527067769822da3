//! Who a remote object is: the plain data that remote sources report
//! ([`crate::source::Source::cache_identity`]), the Hub fills in, and the local cache
//! (source/cache/) files copies under. Both the Hub and the cache import it; neither
//! imports the other for it.

/// Who a remote object is: enough to find a cached copy and to tell whether it is still current.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheIdentity {
    /// Canonical URI without credentials or query: `s3://bucket/key`,
    /// `hf://org/repo@<commit>/path`.
    pub uri: String,
    pub size: u64,
    /// The object's ETag (or version) as the store reported it, quotes included.
    pub etag: Option<String>,
    /// Lowercase hex sha256 of the content, when the source knows it (Hub LFS files).
    pub sha256: Option<String>,
    /// Where the object lives in a Hugging Face repository; the copy then goes to the HF cache.
    pub hub: Option<HubLocation>,
}

/// A file of a Hugging Face repository at one commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubLocation {
    /// "model" ("dataset", "space").
    pub repo_type: String,
    /// "org/name".
    pub repo_id: String,
    /// The 40-hex commit the revision resolved to.
    pub commit: String,
    /// The ref asked for (branch or tag): `refs/<revision>` gets `commit`. `None` when a commit
    /// was asked for.
    pub revision: Option<String>,
    /// "sub/model-00001-of-00002.safetensors".
    pub path_in_repo: String,
    /// The blob's name in the HF cache: the file's etag without quotes (the sha256 for LFS files,
    /// the git sha1 otherwise).
    pub blob_id: String,
}

/// What a file's content is checked against, where its store gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Digest {
    /// Lowercase hex sha256 (Hub LFS files).
    Sha256(String),
    /// Git blob id: sha1 of `blob <len>\0` and the bytes (Hub files outside LFS).
    GitBlob(String),
}

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

impl CacheIdentity {
    /// What the content can be checked against: its sha256, else (a Hub file outside LFS) the
    /// git blob id its ETag gives.
    pub fn digest(&self) -> Option<Digest> {
        if let Some(sha) = &self.sha256 {
            return Some(Digest::Sha256(sha.to_ascii_lowercase()));
        }
        let id = self.hub.as_ref()?.blob_id.as_str();
        let git = id.len() == 40 && id.bytes().all(|b| b.is_ascii_hexdigit());
        git.then(|| Digest::GitBlob(id.to_ascii_lowercase()))
    }
}
