//! The Hugging Face cache's layout, exactly as `huggingface_hub` writes it, so that files this
//! crate caches from the Hub are found by `huggingface_hub`, transformers and vLLM, and files they
//! downloaded are found by us:
//!
//! ```text
//! <hub cache>/models--org--name/blobs/<blob id>                 the bytes (blob id: the file's etag)
//! <hub cache>/models--org--name/snapshots/<commit>/<path>       relative symlink to ../../blobs/<id>
//! <hub cache>/models--org--name/refs/<revision>                 the commit a branch or tag resolved to
//! <hub cache>/.locks/models--org--name/<blob id>.lock           the lock huggingface_hub's filelock takes
//! ```
//!
//! Pure path functions (plus [`read_ref`]); the root comes from the environment as
//! `huggingface_hub.constants` reads it.

use std::path::{Component, Path, PathBuf};

use crate::bounded::Whole;

/// The Hub cache directory: `HF_HUB_CACHE`, else the legacy `HUGGINGFACE_HUB_CACHE`, else
/// `HF_HOME/hub`, where `HF_HOME` defaults to `$XDG_CACHE_HOME/huggingface`, else
/// `~/.cache/huggingface`. A leading `~` is expanded as `os.path.expanduser` does.
pub fn hub_cache_root() -> PathBuf {
    hub_cache_root_from(|name| std::env::var_os(name).filter(|v| !v.is_empty()))
}

/// [`hub_cache_root`] over any lookup of variables (tests pass a map).
pub fn hub_cache_root_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    if let Some(dir) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return expand_user(Path::new(&dir), &var);
    }
    let home = match var("HF_HOME") {
        Some(dir) => expand_user(Path::new(&dir), &var),
        None => {
            let base = match var("XDG_CACHE_HOME") {
                Some(dir) => expand_user(Path::new(&dir), &var),
                None => user_home(&var).join(".cache"),
            };
            base.join("huggingface")
        }
    };
    home.join("hub")
}

fn user_home(var: &impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    var("HOME")
        .map(PathBuf::from)
        .or_else(dirs::home_dir)
        .unwrap_or_else(|| PathBuf::from("/"))
}

fn expand_user(path: &Path, var: &impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    match path.strip_prefix("~") {
        Ok(rest) => user_home(var).join(rest),
        Err(_) => path.to_path_buf(),
    }
}

/// The folder of one repository under the cache root: `models--org--name` (`datasets--`,
/// `spaces--` for the other repository types).
pub fn repo_folder(repo_type: &str, repo_id: &str) -> String {
    format!("{repo_type}s--{repo_id}").replace('/', "--")
}

/// Where one repository's files live under `root` (the folder of [`repo_folder`]).
pub fn repo_path(root: &Path, repo_type: &str, repo_id: &str) -> PathBuf {
    root.join(repo_folder(repo_type, repo_id))
}

/// `<repo>/blobs/<blob_id>`.
pub fn blob_path(repo: &Path, blob_id: &str) -> PathBuf {
    repo.join("blobs").join(blob_id)
}

/// `<repo>/snapshots/<commit>/<path_in_repo>` (nested folders as in the repository).
pub fn snapshot_path(repo: &Path, commit: &str, path_in_repo: &str) -> PathBuf {
    repo.join("snapshots").join(commit).join(path_in_repo)
}

/// `<repo>/refs/<revision>`: a revision with `/` (`refs/pr/1`, `feature/x`) is nested folders,
/// as `huggingface_hub` writes it.
pub fn ref_path(repo: &Path, revision: &str) -> PathBuf {
    repo.join("refs").join(revision)
}

/// `<root>/.locks/<repo folder>/<blob_id>.lock`: the file `huggingface_hub` locks while it
/// downloads a blob, so that the two never fill the same blob at once.
pub fn lock_path(root: &Path, repo_type: &str, repo_id: &str, blob_id: &str) -> PathBuf {
    root.join(".locks")
        .join(repo_folder(repo_type, repo_id))
        .join(format!("{blob_id}.lock"))
}

/// The symlink target from a snapshot file to its blob, relative to the link's folder:
/// `../../blobs/<id>` for a file at the snapshot's top, one more `../` per nested folder.
pub fn blob_link_target(path_in_repo: &str, blob_id: &str) -> PathBuf {
    let depth = Path::new(path_in_repo)
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count()
        .saturating_sub(1);
    let mut target = PathBuf::new();
    for _ in 0..depth + 2 {
        target.push("..");
    }
    target.join("blobs").join(blob_id)
}

/// The commit `refs/<revision>` holds, if that file exists and holds one.
pub fn read_ref(repo: &Path, revision: &str) -> Option<String> {
    // A ref is 40 characters: never read more than a little (a ref pointed at /dev/zero).
    let path = ref_path(repo, revision);
    let name = path.display().to_string();
    let bytes = crate::bounded::read_file_limited(&path, &name, Whole::Body, 4096).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let commit = text.trim();
    (!commit.is_empty()).then(|| commit.to_string())
}

/// Whether `path_in_repo` is a plain relative path inside the repo (the one rule for names from
/// data, [`crate::format::check_inside`]): only such paths may become files under a snapshot.
pub fn is_safe_path_in_repo(path_in_repo: &str) -> bool {
    crate::format::check_inside(path_in_repo).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn root(vars: &[(&str, &str)]) -> PathBuf {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        hub_cache_root_from(|name| map.get(name).cloned())
    }

    #[test]
    fn the_root_follows_huggingface_hub_rules() {
        let home = [("HOME", "/home/u")];
        assert_eq!(root(&home), PathBuf::from("/home/u/.cache/huggingface/hub"));
        let xdg = [("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")];
        assert_eq!(root(&xdg), PathBuf::from("/x/huggingface/hub"));
        let hf_home = [
            ("HOME", "/home/u"),
            ("XDG_CACHE_HOME", "/x"),
            ("HF_HOME", "~/hf"),
        ];
        assert_eq!(root(&hf_home), PathBuf::from("/home/u/hf/hub"));
        let legacy = [("HF_HOME", "/h"), ("HUGGINGFACE_HUB_CACHE", "/legacy")];
        assert_eq!(root(&legacy), PathBuf::from("/legacy"));
        let both = [("HUGGINGFACE_HUB_CACHE", "/legacy"), ("HF_HUB_CACHE", "/c")];
        assert_eq!(root(&both), PathBuf::from("/c"));
    }

    #[test]
    fn paths_match_the_layout_huggingface_hub_writes() {
        assert_eq!(repo_folder("model", "org/name"), "models--org--name");
        assert_eq!(repo_folder("dataset", "org/name"), "datasets--org--name");
        let repo = repo_path(Path::new("/c"), "model", "org/name");
        assert_eq!(repo, PathBuf::from("/c/models--org--name"));
        assert_eq!(
            blob_path(&repo, "abc"),
            PathBuf::from("/c/models--org--name/blobs/abc")
        );
        assert_eq!(
            snapshot_path(&repo, "c0ffee", "sub/m.safetensors"),
            PathBuf::from("/c/models--org--name/snapshots/c0ffee/sub/m.safetensors")
        );
        assert_eq!(
            ref_path(&repo, "refs/pr/1"),
            PathBuf::from("/c/models--org--name/refs/refs/pr/1")
        );
        assert_eq!(
            lock_path(Path::new("/c"), "model", "org/name", "abc"),
            PathBuf::from("/c/.locks/models--org--name/abc.lock")
        );
    }

    #[test]
    fn snapshot_links_climb_one_level_per_nested_folder() {
        assert_eq!(
            blob_link_target("m.safetensors", "abc"),
            PathBuf::from("../../blobs/abc")
        );
        assert_eq!(
            blob_link_target("a/b/m.safetensors", "abc"),
            PathBuf::from("../../../../blobs/abc")
        );
        // The link resolves to the blob from the snapshot file's folder.
        let repo = Path::new("/c/models--o--n");
        let link = snapshot_path(repo, "c0", "a/b/m.safetensors");
        let resolved = link
            .parent()
            .unwrap()
            .join(blob_link_target("a/b/m.safetensors", "abc"));
        let mut normal = PathBuf::new();
        for c in resolved.components() {
            match c {
                Component::ParentDir => {
                    normal.pop();
                }
                other => normal.push(other),
            }
        }
        assert_eq!(normal, blob_path(repo, "abc"));
    }

    #[test]
    fn refs_are_read_trimmed_and_missing_ones_are_none() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path();
        assert_eq!(read_ref(repo, "main"), None);
        std::fs::create_dir_all(repo.join("refs/feature")).unwrap();
        std::fs::write(ref_path(repo, "feature/x"), "c0ffee\n").unwrap();
        assert_eq!(read_ref(repo, "feature/x").as_deref(), Some("c0ffee"));
    }

    #[test]
    fn only_plain_relative_paths_are_safe() {
        assert!(is_safe_path_in_repo("a/b.safetensors"));
        for bad in [
            "",
            "/etc/x",
            "../x",
            "a/../../x",
            "a\\b",
            "%2e%2e/x",
            "C:x",
            "a\0b",
        ] {
            assert!(!is_safe_path_in_repo(bad), "{bad}");
        }
    }
}
