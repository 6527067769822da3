use std::io;

use super::*;

fn is_changed(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. }
        if source.kind() == io::ErrorKind::InvalidData
            && source.to_string().contains("changed while loading"))
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
