use std::io;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

use super::*;
use crate::source::object::read_pinned;

fn data(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn put(store: &InMemory, bytes: Vec<u8>) -> Option<String> {
    let put = store
        .put(&Path::from("m"), PutPayload::from(bytes))
        .await
        .unwrap();
    put.e_tag
}

fn is_changed(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. }
        if source.kind() == io::ErrorKind::InvalidData
            && source.to_string().contains("changed while loading"))
}

#[tokio::test]
async fn an_object_overwritten_between_reads_is_changed_not_torn() {
    let store = InMemory::new();
    let (a, b) = (data(10_000, 1), data(10_000, 2));
    put(&store, a.clone()).await;
    let pin = Pin::new(Some(10_000), None);
    let retry = RetrySettings::default();
    let path = Path::from("m");
    let mut first = vec![0u8; 5_000];
    read_pinned(&store, &path, 0, &mut first, "s3://b/m", &retry, &pin)
        .await
        .unwrap();
    assert_eq!(first, a[..5_000]);
    // Same size, other bytes: only the version tells them apart.
    put(&store, b).await;
    let mut second = vec![0u8; 5_000];
    let err = read_pinned(&store, &path, 5_000, &mut second, "s3://b/m", &retry, &pin)
        .await
        .unwrap_err();
    assert!(is_changed(&err), "{err}");
    assert!(err.to_string().contains("412 Precondition Failed"), "{err}");
    assert!(err.to_string().contains("s3://b/m"), "{err}");
}

#[tokio::test]
async fn a_listing_etag_pins_the_first_read_too() {
    let store = InMemory::new();
    let listed = put(&store, data(1000, 1)).await;
    put(&store, data(1000, 2)).await;
    let known = Version {
        etag: listed,
        ..Version::default()
    };
    let pin = Pin::new(Some(1000), Some(known));
    let mut dst = vec![0u8; 1000];
    let retry = RetrySettings::default();
    let path = Path::from("m");
    let err = read_pinned(&store, &path, 0, &mut dst, "s3://b/m", &retry, &pin)
        .await
        .unwrap_err();
    assert!(is_changed(&err), "{err}");
}

#[test]
fn responses_are_checked_against_the_pin_whatever_the_server_honours() {
    let pin = Pin::new(Some(100), None);
    let v = |etag: &str, lm: &str| Version {
        etag: Some(etag.into()),
        version: None,
        last_modified: Some(lm.into()),
    };
    pin.check("x", &v("\"a\"", "t1"), Some(100)).unwrap();
    // A strong ETag is the identity: Last-Modified may differ between replicas.
    pin.check("x", &v("\"a\"", "t2"), Some(100)).unwrap();
    assert!(is_changed(
        &pin.check("x", &v("\"b\"", "t1"), Some(100)).unwrap_err()
    ));
    assert!(is_changed(
        &pin.check("x", &v("\"a\"", "t1"), Some(101)).unwrap_err()
    ));
    assert_eq!(pin.current().strong_etag(), Some("\"a\""));

    // A weak ETag is never sent as If-Match; Last-Modified and size are compared instead.
    let listed = Version {
        etag: Some("W/\"w\"".into()),
        ..Version::default()
    };
    let weak = Pin::new(Some(100), Some(listed));
    assert_eq!(
        weak.current(),
        Version::default(),
        "a weak listing ETag pins nothing"
    );
    weak.check("x", &v("W/\"w\"", "t1"), Some(100)).unwrap();
    assert_eq!(weak.current().strong_etag(), None);
    assert!(weak.etag().is_none());
    assert!(is_changed(
        &weak.check("x", &v("W/\"w\"", "t2"), Some(100)).unwrap_err()
    ));
    assert!(is_changed(
        &weak.check("x", &v("W/\"v\"", "t1"), Some(100)).unwrap_err()
    ));

    // A version id pins too; S3's "null" (no versioning) does not.
    let versioned = Pin::new(None, None);
    let with = |id: &str| Version {
        version: Some(id.into()),
        ..Version::default()
    };
    versioned.check("x", &with("v1"), Some(5)).unwrap();
    assert!(is_changed(
        &versioned.check("x", &with("v2"), Some(5)).unwrap_err()
    ));
    assert_eq!(Version::identifying(with("null")).version, None);
}
