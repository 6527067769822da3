//! Reads of a changing object through object_store (an in-memory store), pinned to one version
//! by [`crate::source::remote`]'s one resumable read.

use std::io;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

use super::read_pinned;
use crate::error::Error;
use crate::source::remote::{Pin, RetrySettings, Version};

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
