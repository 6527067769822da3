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

fn lm(etag: Option<&str>, version: Option<&str>, last_modified: Option<&str>) -> Version {
    Version {
        etag: etag.map(String::from),
        version: version.map(String::from),
        last_modified: last_modified.map(String::from),
    }
}

#[test]
fn a_response_is_tied_to_the_pin_or_refused() {
    // A HEAD gave an ETag and Last-Modified; the GETs carry no ETag (a proxy dropped it).
    let pin = Pin::new(Some(10), Some(lm(Some("\"a\""), None, Some("t1")))).confirmed();
    assert_eq!(pin.current().strong_etag(), Some("\"a\""));
    assert_eq!(pin.current().last_modified, None, "If-Match says it all");
    pin.check("x", &lm(None, None, Some("t1")), Some(10))
        .unwrap();
    // Another Last-Modified, without an ETag to say the content is the same: changed.
    let err = pin.check("x", &lm(None, None, Some("t2")), Some(10));
    assert!(is_changed(&err.unwrap_err()));
    // Nothing to tie it to the pinned version: fail closed, saying why.
    for bare in [lm(None, None, None), lm(None, Some("v9"), None)] {
        let err = pin.check("x", &bare, Some(10)).unwrap_err();
        let text = err.to_string();
        assert!(!is_changed(&err), "{text}");
        assert!(
            text.contains("cannot be tied") && text.contains("ETag \"a\""),
            "{text}"
        );
    }

    // A version id ties a response on its own.
    let versioned = Pin::new(None, Some(lm(Some("\"a\""), Some("v1"), None)));
    versioned
        .check("x", &lm(None, Some("v1"), None), Some(5))
        .unwrap();
    assert_eq!(versioned.current().version.as_deref(), Some("v1"));

    // Only Last-Modified (a server without ETags): it is what is sent and compared.
    let dated = Pin::new(None, Some(lm(None, None, Some("t1")))).confirmed();
    assert_eq!(dated.current().last_modified.as_deref(), Some("t1"));
    dated
        .check("x", &lm(None, None, Some("t1")), Some(5))
        .unwrap();
    assert!(dated.check("x", &lm(None, None, None), Some(5)).is_err());
    assert!(is_changed(
        &dated
            .check("x", &lm(None, None, Some("t2")), Some(5))
            .unwrap_err()
    ));

    // A server that gives no validator at all: only the size is left to compare.
    let bare = Pin::new(None, None);
    bare.check("x", &Version::default(), Some(5)).unwrap();
    bare.check("x", &Version::default(), Some(5)).unwrap();
    assert!(is_changed(
        &bare.check("x", &Version::default(), Some(6)).unwrap_err()
    ));
}

/// A source whose answers are scripted, recording what each request was pinned to.
struct Scripted {
    answers: std::sync::Mutex<Vec<Answer>>,
    head: Option<Version>,
    asked: std::sync::Mutex<Vec<Version>>,
    heads: std::sync::atomic::AtomicUsize,
}

impl Scripted {
    fn new(mut answers: Vec<Answer>, head: Option<Version>) -> Scripted {
        answers.reverse();
        Scripted {
            answers: answers.into(),
            head,
            asked: Vec::new().into(),
            heads: 0.into(),
        }
    }
}

fn bytes(range: Range<u64>, version: Version) -> Answer {
    let body = vec![7u8; (range.end - range.start) as usize];
    Answer::Bytes(Response {
        size: Some(100),
        range,
        version,
        body: futures_util::stream::iter([Ok(Bytes::from(body))]).boxed(),
    })
}

impl RangedGet for Scripted {
    fn get<'a>(&'a self, _: Range<u64>, pin: &'a Version) -> BoxFuture<'a, Result<Answer>> {
        self.asked.lock().unwrap().push(pin.clone());
        let next = self
            .answers
            .lock()
            .unwrap()
            .pop()
            .expect("a scripted answer");
        Box::pin(async move { Ok(next) })
    }

    fn head(&self) -> BoxFuture<'_, Result<Option<Version>>> {
        self.heads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let head = self.head.clone();
        Box::pin(async move { Ok(head) })
    }
}

async fn read(get: &Scripted, pin: &Pin, at: u64) -> Result<()> {
    let mut dst = vec![0u8; 10];
    read_range(
        get,
        pin,
        "s3://b/k",
        at,
        &mut dst,
        &RetrySettings::default(),
    )
    .await
}

#[tokio::test]
async fn refusals_and_disagreements_say_what_happened() {
    let etag = |e: &str| lm(Some(e), None, None);
    // 412 to a request that carried no precondition: not a change.
    let get = Scripted::new(
        vec![Answer::Refused {
            sent: String::new(),
        }],
        None,
    );
    let err = read(&get, &Pin::new(None, None), 0).await.unwrap_err();
    assert!(!is_changed(&err), "{err}");
    assert!(err.to_string().contains("carried no precondition"), "{err}");

    // 412 once a response was read: changed, naming what was refused.
    let get = Scripted::new(
        vec![
            bytes(0..10, etag("\"a\"")),
            Answer::Refused {
                sent: "If-Match: \"a\"".into(),
            },
        ],
        None,
    );
    let pin = Pin::new(None, None);
    read(&get, &pin, 0).await.unwrap();
    let err = read(&get, &pin, 10).await.unwrap_err();
    assert!(
        is_changed(&err) && err.to_string().contains("If-Match: \"a\""),
        "{err}"
    );

    // The first GET answers with another ETag than the HEAD's, and a HEAD asked again still
    // gives the first: the validators disagree (a CDN), the object did not change.
    let known = Some(etag("\"a\""));
    let cdn = || bytes(0..1, etag("\"cdn\""));
    let get = Scripted::new(
        vec![bytes(0..10, etag("\"cdn\"")), cdn(), cdn()],
        known.clone(),
    );
    let err = read(&get, &Pin::new(None, known.clone()).confirmed(), 0)
        .await
        .unwrap_err();
    assert!(!is_changed(&err), "{err}");
    assert!(err.to_string().contains("validators disagree"), "{err}");
    // A GET asked again that gives the HEAD's ETag: the object was overwritten back and forth.
    let get = Scripted::new(
        vec![bytes(0..10, etag("\"b\"")), bytes(0..1, etag("\"a\""))],
        known.clone(),
    );
    let err = read(&get, &Pin::new(None, known.clone()).confirmed(), 0)
        .await
        .unwrap_err();
    assert!(is_changed(&err), "{err}");
    // ... and when the HEAD says the new ETag too, the object changed.
    let get = Scripted::new(vec![bytes(0..10, etag("\"b\""))], Some(etag("\"b\"")));
    let err = read(&get, &Pin::new(None, known).confirmed(), 0)
        .await
        .unwrap_err();
    assert!(is_changed(&err), "{err}");

    // The pinned version deleted midway: gone, not missing.
    let get = Scripted::new(vec![Answer::Gone], None);
    let pin = Pin::new(None, Some(lm(None, Some("v1"), None)));
    let err = read(&get, &pin, 0).await.unwrap_err();
    assert!(is_changed(&err), "{err}");
    assert!(
        err.to_string()
            .contains("version v1, the one being loaded, is gone"),
        "{err}"
    );
    // Nothing pinned yet: a missing object.
    let get = Scripted::new(vec![Answer::Gone], None);
    let err = read(&get, &Pin::new(None, None), 0).await.unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
}

#[tokio::test]
async fn a_listing_etag_is_confirmed_by_a_head_when_gets_carry_none() {
    let listed = lm(Some("a"), None, Some("t1"));
    let get = Scripted::new(
        vec![
            bytes(0..10, lm(None, None, Some("t1"))),
            bytes(10..20, lm(None, None, Some("t1"))),
        ],
        Some(lm(Some("\"a\""), None, Some("t1"))),
    );
    let pin = Pin::new(None, Some(listed));
    read(&get, &pin, 0).await.unwrap();
    read(&get, &pin, 10).await.unwrap();
    let asked = get.asked.lock().unwrap().clone();
    assert_eq!(asked[0].etag, None, "the listing's form is not sent");
    assert_eq!(asked[1].etag.as_deref(), Some("\"a\""), "the HEAD's is");

    // A HEAD that gives no ETag either is asked once, not for every read.
    let listed = lm(Some("a"), None, Some("t1"));
    let answers = (0..3).map(|i| bytes(i * 10..i * 10 + 10, lm(None, None, Some("t1"))));
    let get = Scripted::new(answers.collect(), Some(lm(None, None, Some("t1"))));
    let pin = Pin::new(None, Some(listed));
    for at in [0, 10, 20] {
        read(&get, &pin, at).await.unwrap();
    }
    assert_eq!(get.heads.load(std::sync::atomic::Ordering::Relaxed), 1);
}
