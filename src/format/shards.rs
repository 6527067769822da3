//! Which files of a folder make one whole checkpoint: the rule every source applies to the list of
//! `.safetensors` files it found (a local folder, an object-store prefix, a Hub repo's folder, a
//! cache's copy of one) before a byte of them is read. Pure: names in, a verdict out.
//!
//! A sharded checkpoint's files are named `<stem>-<K>-of-<N>.safetensors` (Hugging Face writes
//! `model-00001-of-00003.safetensors`). A save that stopped part-way leaves some of them, and a
//! save over an older checkpoint may leave the older set beside the new one; either would load as
//! a smaller or a mixed model without a word. So:
//!
//! - [`check_complete`]: every set of `K-of-N` names holds all `N` (whatever lists them: a folder,
//!   or an index's `weight_map`, whose names are then all that is read; a file the index names
//!   but storage lacks is the usual "not found" when it is opened);
//! - [`check_folder`], for a folder without an index: that, and one checkpoint per stem, so that
//!   `model.safetensors` beside `model-0000K-of-0000N.safetensors` files, or two sets of the same
//!   stem with different `N`, are refused with what to remove. An index settles which set loads
//!   (its names are checked by [`check_complete`] only); different stems (`model-*` beside
//!   `adapter.safetensors`) are different files and load together, as before.
//!
//! A file the user names on its own (`.../model-00001-of-00003.safetensors`) is not a folder
//! listing and is not checked: asking for one shard is a choice.

use std::collections::{BTreeMap, BTreeSet};

use super::FormatError;

const SUFFIX: &str = ".safetensors";
/// Names of missing shards an error spells out; the rest are counted.
const SHOWN: usize = 4;

/// `<stem>-<K>-of-<N>.safetensors`, split; `None` for any other name (`K` must be in `1..=N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShardName<'a> {
    stem: &'a str,
    k: u64,
    /// Digits of `K` as written (missing names are spelled with as many).
    k_width: usize,
    n: u64,
    /// `N` as written: `-of-3` and `-of-00003` are different sets.
    n_text: &'a str,
}

fn digits(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

fn shard_name(name: &str) -> Option<ShardName<'_>> {
    let (left, n_text) = name.strip_suffix(SUFFIX)?.rsplit_once("-of-")?;
    let (stem, k_text) = left.rsplit_once('-')?;
    let (k, n) = (digits(k_text)?, digits(n_text)?);
    (1..=n).contains(&k).then_some(ShardName {
        stem,
        k,
        k_width: k_text.len(),
        n,
        n_text,
    })
}

/// One set: `<stem>-*-of-<N>` and the `K`s present.
#[derive(Default)]
struct Set {
    n: u64,
    k_width: usize,
    present: BTreeSet<u64>,
}

impl Set {
    fn name(&self, stem: &str, n_text: &str, k: u64) -> String {
        format!(
            "{stem}-{k:0width$}-of-{n_text}{SUFFIX}",
            width = self.k_width
        )
    }

    /// `model-0000K-of-00003.safetensors`: how messages name the whole set.
    fn pattern(&self, stem: &str, n_text: &str) -> String {
        let zeros = "0".repeat(self.k_width.saturating_sub(1));
        format!("{stem}-{zeros}K-of-{n_text}{SUFFIX}")
    }
}

/// The sets among `names`, by (stem, `N` as written).
fn sets<S: AsRef<str>>(names: &[S]) -> BTreeMap<(&str, &str), Set> {
    let mut sets: BTreeMap<(&str, &str), Set> = BTreeMap::new();
    for shard in names.iter().filter_map(|n| shard_name(n.as_ref())) {
        let set = sets.entry((shard.stem, shard.n_text)).or_default();
        set.n = shard.n;
        set.k_width = set.k_width.max(shard.k_width);
        set.present.insert(shard.k);
    }
    sets
}

/// Every `<stem>-<K>-of-<N>.safetensors` set among `names` (`/`-separated paths; a stem keeps its
/// folder) holds all `N` of its files; else [`FormatError::ShardsMissing`] for the first set that
/// does not, naming the files it lacks.
pub fn check_complete<S: AsRef<str>>(names: &[S]) -> Result<(), FormatError> {
    for ((stem, n_text), set) in sets(names) {
        let count = set.n - set.present.len() as u64;
        if count == 0 {
            continue;
        }
        // Bounded by the names present plus SHOWN, whatever N claims.
        let missing = (1..=set.n)
            .filter(|k| !set.present.contains(k))
            .take(SHOWN)
            .map(|k| set.name(stem, n_text, k))
            .collect();
        return Err(FormatError::ShardsMissing {
            set: set.pattern(stem, n_text),
            n: set.n,
            missing,
            count,
        });
    }
    Ok(())
}

/// What a folder holds of one stem: its single file, and each set's pattern and files present.
type StemFiles = (Option<String>, Vec<(String, usize)>);

/// The `.safetensors` files a folder without an index lists (names directly in it) make one
/// checkpoint per stem, each whole: [`FormatError::CheckpointsMixed`] when one stem has a single
/// file and a set, or sets of different `N`; else [`check_complete`].
pub fn check_folder<S: AsRef<str>>(names: &[S]) -> Result<(), FormatError> {
    let mut by_stem: BTreeMap<&str, StemFiles> = BTreeMap::new();
    for name in names.iter().map(AsRef::as_ref) {
        if let Some(stem) = name
            .strip_suffix(SUFFIX)
            .filter(|_| shard_name(name).is_none())
        {
            by_stem.entry(stem).or_default().0 = Some(name.to_string());
        }
    }
    for ((stem, n_text), set) in &sets(names) {
        let found = (set.pattern(stem, n_text), set.present.len());
        by_stem.entry(stem).or_default().1.push(found);
    }
    let mixed = by_stem
        .into_values()
        .find(|(single, sets)| sets.len() + usize::from(single.is_some()) > 1);
    if let Some((single, sets)) = mixed {
        return Err(FormatError::CheckpointsMixed { single, sets });
    }
    check_complete(names)
}

/// `a`, `a and b`, `a, b and c` (`and` as `word`).
fn listed(items: &[String], word: &str) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} {word} {last}", rest.join(", ")),
    }
}

/// [`FormatError::ShardsMissing`]'s list: the names shown, then how many more.
pub(super) fn missing_text(missing: &[String], count: u64) -> String {
    let more = count.saturating_sub(missing.len() as u64);
    let verb = if count == 1 { "is" } else { "are" };
    match more {
        0 => format!("{} {verb}", listed(missing, "and")),
        _ => format!("{} and {more} more {verb}", missing.join(", ")),
    }
}

/// [`FormatError::CheckpointsMixed`]'s text: what the folder holds, and what to remove.
pub(super) fn mixed_text(single: &Option<String>, sets: &[(String, usize)]) -> String {
    let mut found: Vec<String> = single.iter().cloned().collect();
    let mut remove = found.clone();
    for (pattern, files) in sets {
        let plural = if *files == 1 { "" } else { "s" };
        found.push(format!("{pattern} ({files} file{plural})"));
        remove.push(format!("the {pattern} files"));
    }
    let hint = match remove.len() {
        2 => format!("remove {}", listed(&remove, "or")),
        _ => format!(
            "keep one of {} and remove the others",
            listed(&remove, "and")
        ),
    };
    format!(
        "holds more than one checkpoint of one name: {} (an older save's files beside a newer \
         one's?); {hint}, or add a {} that names the files to load",
        listed(&found, "and"),
        super::INDEX_FILE
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize, of: usize) -> Vec<String> {
        (1..=n)
            .map(|k| format!("model-{k:05}-of-{of:05}.safetensors"))
            .collect()
    }

    #[test]
    fn parses_shard_names() {
        let s = shard_name("model-00002-of-00003.safetensors").unwrap();
        assert_eq!(
            (s.stem, s.k, s.k_width, s.n, s.n_text),
            ("model", 2, 5, 3, "00003")
        );
        let s = shard_name("sub/a-b-1-of-2.safetensors").unwrap();
        assert_eq!((s.stem, s.k, s.n), ("sub/a-b", 1, 2));
        assert_eq!(shard_name("-1-of-1.safetensors").unwrap().stem, "");
        for other in [
            "model.safetensors",
            "model-00001-of-00003.bin",
            "model-00000-of-00003.safetensors",
            "model-00004-of-00003.safetensors",
            "model-x-of-00003.safetensors",
            "model-00001-of-.safetensors",
            "model-00001-of-3a.safetensors",
            "model00001-of-00003.safetensors",
            "model-+1-of-3.safetensors",
            "model-1-of-99999999999999999999999.safetensors",
        ] {
            assert_eq!(shard_name(other), None, "{other}");
        }
    }

    #[test]
    fn whole_sets_and_plain_files_pass() {
        check_complete(&names(3, 3)).unwrap();
        check_folder(&names(3, 3)).unwrap();
        check_folder(&["model.safetensors"]).unwrap();
        check_folder(&names(1, 1)).unwrap();
        check_complete::<&str>(&[]).unwrap();
        // Different stems are different checkpoints' files (an adapter beside the model).
        let mut mixed = names(2, 2);
        mixed.extend([
            "adapter_model.safetensors".into(),
            "a-1-of-1.safetensors".into(),
        ]);
        check_folder(&mixed).unwrap();
    }

    #[test]
    fn a_set_missing_files_is_refused_naming_them() {
        let got = check_folder(&names(1, 3)).unwrap_err();
        assert_eq!(
            got,
            FormatError::ShardsMissing {
                set: "model-0000K-of-00003.safetensors".into(),
                n: 3,
                missing: vec![
                    "model-00002-of-00003.safetensors".into(),
                    "model-00003-of-00003.safetensors".into()
                ],
                count: 2,
            }
        );
        let text = got.to_string();
        assert!(
            text.contains("model-00002-of-00003.safetensors and model-00003-of-00003"),
            "{text}"
        );
        // The middle one, through an index's names too (paths keep their folder).
        let index = ["sub/m-1-of-3.safetensors", "sub/m-3-of-3.safetensors"];
        assert!(matches!(
            check_complete(&index),
            Err(FormatError::ShardsMissing { ref missing, count: 1, .. })
                if missing == &["sub/m-2-of-3.safetensors"]
        ));
    }

    #[test]
    fn a_huge_n_is_counted_not_listed() {
        let one = ["m-1-of-18446744073709551615.safetensors"];
        let Err(FormatError::ShardsMissing { missing, count, .. }) = check_complete(&one) else {
            panic!("accepted");
        };
        assert_eq!((missing.len(), count), (SHOWN, u64::MAX - 1));
        assert!(FormatError::ShardsMissing {
            set: "s".into(),
            n: 9,
            missing,
            count
        }
        .to_string()
        .contains("and 18446744073709551610 more"));
    }

    #[test]
    fn two_checkpoints_of_one_stem_are_refused_saying_what_to_remove() {
        let mut both = names(3, 3);
        both.push("model.safetensors".into());
        let got = check_folder(&both).unwrap_err();
        assert_eq!(
            got,
            FormatError::CheckpointsMixed {
                single: Some("model.safetensors".into()),
                sets: vec![("model-0000K-of-00003.safetensors".into(), 3)],
            }
        );
        let text = got.to_string();
        assert!(
            text.contains("remove model.safetensors or the model-0000K-of-00003.safetensors"),
            "{text}"
        );
        // Sets of different N side by side (an older save with more shards).
        let mut two = names(2, 2);
        two.extend(names(3, 3));
        assert!(matches!(
            check_folder(&two),
            Err(FormatError::CheckpointsMixed { single: None, ref sets }) if sets.len() == 2
        ));
        let text = check_folder(&two).unwrap_err().to_string();
        assert!(text.contains("model-0000K-of-00002.safetensors (2 files) and model-0000K-of-00003.safetensors (3 files)"), "{text}");
        assert!(text.contains("remove the model-0000K-of-00002.safetensors files or the model-0000K-of-00003.safetensors files"), "{text}");
        // An index's names are not a folder: the index decided which files load.
        check_complete(&two).unwrap();
    }
}
