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

pub use crate::store::StoredChecksum;

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

/// The canonical identity string of a file's content (peer protocol v1), which a serve lists in
/// its manifest and sends as `X-Fastload-Identity`, and which a client loading the origin
/// computes from what it pinned: the two must be equal for a peer's bytes to stand in for the
/// origin's. With a sha256 (Hub LFS files, local folders hashed by a serve):
/// `sha256:<lowercase hex>`; otherwise the origin's validators as pinned:
/// `etag:<etag without quotes>;version:<version id>;size:<n>`, `-` for an absent validator (an
/// empty one, or S3's version `null` on a bucket without versioning, is absent). A weak ETag
/// keeps its `W/` so that it never equals a strong one.
pub fn canonical_identity(
    sha256: Option<&str>,
    etag: Option<&str>,
    version: Option<&str>,
    size: u64,
) -> String {
    if let Some(sha) = sha256.map(str::trim).filter(|s| !s.is_empty()) {
        return format!("sha256:{}", sha.to_ascii_lowercase());
    }
    let etag = etag
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| match e.strip_prefix("W/") {
            Some(weak) => format!("W/{}", weak.trim().trim_matches('"')),
            None => e.trim_matches('"').to_string(),
        });
    let etag = etag.filter(|e| !e.is_empty() && e != "W/");
    let version = version
        .map(str::trim)
        .filter(|v| !v.is_empty() && *v != "null");
    format!(
        "etag:{};version:{};size:{size}",
        etag.as_deref().unwrap_or("-"),
        version.unwrap_or("-")
    )
}

#[cfg(test)]
mod tests {
    use super::canonical_identity;

    #[test]
    fn sha256_wins_and_is_lowercase() {
        let id = canonical_identity(Some("ABCdef01"), Some("\"e\""), Some("v1"), 7);
        assert_eq!(id, "sha256:abcdef01");
    }

    #[test]
    fn validators_without_quotes_and_absent_as_dash() {
        let id = canonical_identity(None, Some("\"9b2cf535f27731c9\""), Some("3HL4kqtJ"), 1024);
        assert_eq!(id, "etag:9b2cf535f27731c9;version:3HL4kqtJ;size:1024");
        let id = canonical_identity(Some(""), Some("\"a-2\""), None, 0);
        assert_eq!(id, "etag:a-2;version:-;size:0");
        assert_eq!(
            canonical_identity(None, None, Some("null"), 5),
            "etag:-;version:-;size:5"
        );
        assert_eq!(
            canonical_identity(None, Some("  "), Some(""), 5),
            "etag:-;version:-;size:5"
        );
    }

    #[test]
    fn a_listing_and_a_header_give_the_same_string() {
        // GCS's JSON listing gives the ETag without quotes, its header with them.
        let listed = canonical_identity(None, Some("CJ2x"), Some("17"), 9);
        let header = canonical_identity(None, Some("\"CJ2x\""), Some("17"), 9);
        assert_eq!(listed, header);
    }

    #[test]
    fn weak_etag_never_equals_strong_and_size_or_version_tell_apart() {
        let weak = canonical_identity(None, Some("W/\"x\""), None, 3);
        assert_eq!(weak, "etag:W/x;version:-;size:3");
        assert_ne!(weak, canonical_identity(None, Some("\"x\""), None, 3));
        let a = canonical_identity(None, Some("\"x\""), Some("v1"), 3);
        assert_ne!(a, canonical_identity(None, Some("\"x\""), Some("v2"), 3));
        assert_ne!(a, canonical_identity(None, Some("\"x\""), Some("v1"), 4));
    }
}
