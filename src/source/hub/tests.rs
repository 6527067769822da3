use std::collections::HashMap;

use super::*;

fn uri(repo: &str, rev: Option<&str>, path: &str) -> HubUri {
    HubUri {
        repo_id: repo.into(),
        revision: rev.map(str::to_string),
        path: path.into(),
    }
}

#[test]
fn parses_repo_revision_and_path() {
    let cases = [
        ("hf://org/repo", uri("org/repo", None, "")),
        ("hf://org/repo/", uri("org/repo", None, "")),
        ("HF://org/repo@v1.0", uri("org/repo", Some("v1.0"), "")),
        (
            "hf://org/repo@0123456789abcdef0123456789abcdef01234567/sub/model.safetensors",
            uri(
                "org/repo",
                Some("0123456789abcdef0123456789abcdef01234567"),
                "sub/model.safetensors",
            ),
        ),
        (
            "hf://org/repo/sub/folder/",
            uri("org/repo", None, "sub/folder"),
        ),
        (
            "hf://org/repo@refs%2Fpr%2F1/a.safetensors",
            uri("org/repo", Some("refs/pr/1"), "a.safetensors"),
        ),
        (
            "hf://org/repo@refs/pr/12/a.safetensors",
            uri("org/repo", Some("refs/pr/12"), "a.safetensors"),
        ),
        (
            "hf://org/repo@refs/convert/parquet",
            uri("org/repo", Some("refs/convert/parquet"), ""),
        ),
        // An '@' in the path is part of the path.
        (
            "hf://org/repo/a@b.safetensors",
            uri("org/repo", None, "a@b.safetensors"),
        ),
    ];
    for (text, expected) in cases {
        assert_eq!(HubUri::parse(text).unwrap(), expected, "{text}");
    }
    assert_eq!(uri("o/r", None, "").revision(), "main");
}

#[test]
fn rejects_what_is_not_a_repo() {
    for bad in [
        "hf://org",
        "hf://org/",
        "hf:///repo",
        "hf://org/repo@",
        "hf://org/repo?x=1",
        "hf://org/repo/../other",
        "hf://org/../repo",
        "hf://../repo/x",
        "hf://org/.@main",
        "s3://org/repo",
    ] {
        let err = HubUri::parse(bad).unwrap_err();
        assert!(matches!(err, Error::UnsupportedUri { .. }), "{bad}: {err}");
    }
}

fn settings(vars: &[(&str, &str)], options: &[(&str, &str)]) -> Result<HubSettings> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let options: Vec<(String, String)> = options
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    HubSettings::from_lookup(|k| vars.get(k).cloned(), &options)
}

#[test]
fn token_order_is_huggingface_hubs() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().to_str().unwrap();
    std::fs::write(dir.path().join("token"), "hf_file\n").unwrap();

    let s = settings(&[("HF_HOME", home)], &[]).unwrap();
    let (token, source) = s.token.clone().unwrap();
    assert_eq!(token, "hf_file");
    assert_eq!(source, TokenSource::File(dir.path().join("token")));
    // Messages name where the token came from, never the token.
    assert!(s.token_note().contains("token"));
    assert!(!s.token_note().contains("hf_file"));

    let s = settings(
        &[("HF_HOME", home), ("HUGGING_FACE_HUB_TOKEN", "hf_old")],
        &[],
    )
    .unwrap();
    assert_eq!(
        s.token.unwrap().1,
        TokenSource::Env("HUGGING_FACE_HUB_TOKEN")
    );
    let s = settings(
        &[
            ("HF_HOME", home),
            ("HUGGING_FACE_HUB_TOKEN", "hf_old"),
            ("HF_TOKEN", "hf_new"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        s.token.unwrap(),
        ("hf_new".into(), TokenSource::Env("HF_TOKEN"))
    );
    let s = settings(&[("HF_TOKEN", "hf_new")], &[("token", "hf_opt")]).unwrap();
    assert_eq!(s.token.unwrap(), ("hf_opt".into(), TokenSource::Option));

    let other = dir.path().join("elsewhere");
    std::fs::write(&other, "hf_path").unwrap();
    let s = settings(
        &[
            ("HF_HOME", home),
            ("HF_TOKEN_PATH", other.to_str().unwrap()),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        s.token.unwrap(),
        ("hf_path".into(), TokenSource::File(other))
    );

    let empty = tempfile::tempdir().unwrap();
    let s = settings(&[("HF_HOME", empty.path().to_str().unwrap())], &[]).unwrap();
    assert!(s.token.is_none());
    assert!(
        s.token_note().starts_with("without a token"),
        "{}",
        s.token_note()
    );
}

#[test]
fn endpoint_and_offline() {
    let s = settings(&[], &[]).unwrap();
    assert_eq!(s.endpoint, DEFAULT_ENDPOINT);
    assert!(!s.offline);
    let s = settings(
        &[
            ("HF_ENDPOINT", "http://127.0.0.1:9/hub/"),
            ("HF_HUB_OFFLINE", "yes"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(s.endpoint, "http://127.0.0.1:9/hub");
    assert!(s.offline);
    assert!(!settings(&[("HF_HUB_OFFLINE", "0")], &[]).unwrap().offline);
    let err = settings(&[], &[("region", "x")]).unwrap_err();
    assert!(matches!(err, Error::InvalidOption { .. }), "{err}");
}

#[test]
fn hf_home_follows_xdg() {
    let env = |k: &str| (k == "XDG_CACHE_HOME").then(|| "/x/cache".to_string());
    assert_eq!(hf_home(&env), PathBuf::from("/x/cache/huggingface"));
}
