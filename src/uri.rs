//! The one table of URI schemes: what a URI names, decided here for reading (`source::open`) and
//! writing (`sink`, `copy`) alike. A leaf: it imports nothing of the crate.
//!
//! Everything else asks this module what a URI is: [`kind`], [`store`], [`is_remote`],
//! [`any_remote`], [`remote_schemes`] (Python's `SCHEMES` and `is_remote_uri`).

/// What a URI names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A file or directory on this machine: a plain path or `file://` (the local fast path).
    Local,
    /// An object (or prefix) in an object store, opened through `object_store`
    /// (`store` builds its client, `source::object` reads, `sink` writes); which store: [`Store`].
    ObjectStore,
    /// A file or folder of a Hugging Face Hub repo (`source::hub`).
    Hub,
    /// A checkpoint a `fastload serve` serves, with no origin behind it (`source::peer`).
    Peer,
}

/// Which object store an [`Kind::ObjectStore`] URI names: what a write may do there differs
/// (S3 checks a checksum of each part, S3 and GCS take an upload's metadata when it is created,
/// an HTTP server is only read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    S3,
    Gcs,
    Azure,
    /// A plain HTTP(S) server: read, never written.
    Http,
}

/// One scheme: what it names, and for object stores which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    pub name: &'static str,
    pub kind: Kind,
    pub store: Option<Store>,
}

const fn scheme(name: &'static str, kind: Kind, store: Option<Store>) -> Scheme {
    Scheme { name, kind, store }
}

const fn object(name: &'static str, store: Store) -> Scheme {
    scheme(name, Kind::ObjectStore, Some(store))
}

/// Every scheme fastload reads or writes, and what it names. A URI with a scheme not listed here
/// is taken as a local path, which fails naming the scheme.
pub const SCHEMES: &[Scheme] = &[
    scheme("file", Kind::Local, None),
    object("s3", Store::S3),
    object("s3a", Store::S3),
    object("gs", Store::Gcs),
    object("az", Store::Azure),
    object("azure", Store::Azure),
    object("abfs", Store::Azure),
    object("abfss", Store::Azure),
    object("adl", Store::Azure),
    object("http", Store::Http),
    object("https", Store::Http),
    scheme("hf", Kind::Hub, None),
    scheme("peer", Kind::Peer, None),
];

/// The row of `uri`'s scheme (`scheme://`, any case); `None` for plain paths and schemes not
/// listed.
pub fn scheme_of(uri: &str) -> Option<&'static Scheme> {
    let (name, _) = uri.split_once("://")?;
    SCHEMES.iter().find(|s| s.name.eq_ignore_ascii_case(name))
}

/// What `uri` names, by its scheme; plain paths are local.
pub fn kind(uri: &str) -> Kind {
    scheme_of(uri).map_or(Kind::Local, |s| s.kind)
}

/// The object store `uri` names, if it names one.
pub fn store(uri: &str) -> Option<Store> {
    scheme_of(uri).and_then(|s| s.store)
}

/// The path a local URI names as writes and copies take it: the URI without its `file://` (any
/// case); a plain path as it is.
pub fn local_path(uri: &str) -> &str {
    match scheme_of(uri) {
        Some(s) if s.kind == Kind::Local => &uri[s.name.len() + "://".len()..],
        _ => uri,
    }
}

/// True when `uri` is read over the network (an object store or the Hub), not from this machine.
pub fn is_remote(uri: &str) -> bool {
    kind(uri) != Kind::Local
}

/// True when any URI is read over the network.
pub fn any_remote(uris: &[String]) -> bool {
    uris.iter().any(|u| is_remote(u))
}

/// The schemes read over the network, in table order (Python's `SCHEMES`).
pub fn remote_schemes() -> Vec<&'static str> {
    SCHEMES
        .iter()
        .filter(|s| s.kind != Kind::Local)
        .map(|s| s.name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_schemes() {
        for uri in [
            "s3://b/k",
            "S3://b/k",
            "s3a://b/k",
            "gs://b/k",
            "az://c/k",
            "abfs://c/k",
            "abfss://c@a.dfs.core.windows.net/k",
            "http://h/x",
            "https://h/x",
        ] {
            assert_eq!(kind(uri), Kind::ObjectStore, "{uri}");
            assert!(is_remote(uri), "{uri}");
        }
        for uri in ["hf://org/repo", "HF://org/repo@main/sub"] {
            assert_eq!(kind(uri), Kind::Hub, "{uri}");
            assert!(is_remote(uri), "{uri}");
        }
        for uri in [
            "/tmp/x",
            "x.safetensors",
            "file:///tmp/x",
            "memory:///x",
            "ftp://h/x",
            "",
        ] {
            assert_eq!(kind(uri), Kind::Local, "{uri}");
            assert!(!is_remote(uri), "{uri}");
        }
        assert!(any_remote(&["/x".into(), "hf://o/r".into()]));
        assert!(!any_remote(&["/x".into(), "file:///y".into()]));
        assert_eq!(
            remote_schemes(),
            [
                "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "hf",
                "peer"
            ]
        );
    }

    #[test]
    fn local_paths_lose_their_file_scheme_in_any_case() {
        assert_eq!(local_path("file:///tmp/x"), "/tmp/x");
        assert_eq!(local_path("FILE:///tmp/x"), "/tmp/x");
        assert_eq!(local_path("/tmp/file://x"), "/tmp/file://x");
        assert_eq!(local_path("rel/x"), "rel/x");
        assert_eq!(local_path("s3://b/k"), "s3://b/k");
    }

    #[test]
    fn names_the_store_in_any_case() {
        assert_eq!(store("S3A://b/k"), Some(Store::S3));
        assert_eq!(store("GS://b/k"), Some(Store::Gcs));
        assert_eq!(store("ABFSS://c@a/k"), Some(Store::Azure));
        assert_eq!(store("HTTP://h/x"), Some(Store::Http));
        for uri in ["hf://o/r", "file:///x", "/x", "ftp://h/x"] {
            assert_eq!(store(uri), None, "{uri}");
        }
    }
}
