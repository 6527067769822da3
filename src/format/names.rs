//! Names that come from data (an index's `weight_map` entries, object keys, `auto_map` modules,
//! component folders of a pipeline) and become a path under a model's folder, prefix or
//! destination. The one rule for all of them, pure: [`check_inside`].
//!
//! A name passes when every reading of it stays inside the folder it is joined to: as a local
//! path, as an object key, and as a relative URL reference (which a URL parser resolves,
//! decoding `%2e%2e` into `..` and `\` into `/`, and where `:`, `?` and `#` change the meaning).
//! So it is a non-empty sequence of `/`-separated segments, none empty, `.` or `..`, none
//! starting or ending with white space (a URL parser drops it at the ends of a URL: `..␠` at the
//! end is `..`), with no `\`, `%`, `:`, `?`, `#` and no control character (NUL included).

use std::fmt;

/// Why a name cannot name a file inside its folder.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameProblem {
    Empty,
    Absolute,
    /// A `..` segment.
    Parent,
    /// A `.` or empty segment (`a/./b`, `a//b`, a trailing `/`).
    DotOrEmptySegment,
    /// A segment that starts or ends with white space.
    SpaceAtEnd,
    Backslash,
    /// A `%`: a URL decodes `%2e%2e` to `..` and `%2f` to `/`.
    Percent,
    /// A `:`: a drive (`C:x`), a scheme (`s3://x`) or a URL.
    Colon,
    /// A `?` or `#`: a URL's query or fragment.
    QueryOrFragment,
    /// NUL or another control character.
    Control,
}

impl fmt::Display for NameProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameProblem::Empty => "it is empty",
            NameProblem::Absolute => "it is an absolute path",
            NameProblem::Parent => "it climbs out with '..'",
            NameProblem::DotOrEmptySegment => "it has a '.' or empty path segment",
            NameProblem::SpaceAtEnd => {
                "a path segment starts or ends with white space, which a URL drops ('.. ' is '..')"
            }
            NameProblem::Backslash => "it has a '\\', which URLs and Windows read as '/'",
            NameProblem::Percent => "it has a '%', which a URL decodes ('%2e%2e' is '..')",
            NameProblem::Colon => "it has a ':' (a drive, a scheme or a URL)",
            NameProblem::QueryOrFragment => "it has a '?' or '#', which end a URL's path",
            NameProblem::Control => "it has a NUL or control character",
        })
    }
}

/// Whether `name`, joined to a folder, names something inside that folder under every reading
/// (see the module's documentation); the first problem found otherwise.
pub fn check_inside(name: &str) -> Result<(), NameProblem> {
    if name.is_empty() {
        return Err(NameProblem::Empty);
    }
    // Characters first: `\..\x` is a backslash problem before it is anything else.
    for c in name.chars() {
        let problem = match c {
            '\\' => NameProblem::Backslash,
            '%' => NameProblem::Percent,
            ':' => NameProblem::Colon,
            '?' | '#' => NameProblem::QueryOrFragment,
            c if c.is_control() => NameProblem::Control,
            _ => continue,
        };
        return Err(problem);
    }
    if name.starts_with('/') {
        return Err(NameProblem::Absolute);
    }
    for segment in name.split('/') {
        match segment {
            ".." => return Err(NameProblem::Parent),
            "" | "." => return Err(NameProblem::DotOrEmptySegment),
            _ => {}
        }
        if segment.starts_with(char::is_whitespace) || segment.ends_with(char::is_whitespace) {
            return Err(NameProblem::SpaceAtEnd);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass() {
        for name in [
            "model.safetensors",
            "sub/model-00001-of-00002.safetensors",
            "a/b/c.json",
            "..hidden",
            "x..y",
            "...",
            "ünïcode/名前.json",
            "with space.json",
            "a b/c d",
            "~/x",
        ] {
            assert_eq!(check_inside(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn names_that_leave_the_folder_are_refused() {
        use NameProblem::*;
        for (name, problem) in [
            ("", Empty),
            ("../victim/model.safetensors", Parent),
            ("sub/../../x", Parent),
            ("a/..", Parent),
            ("..", Parent),
            ("/etc/passwd", Absolute),
            ("//host/x", Absolute),
            ("./a", DotOrEmptySegment),
            ("a/./b", DotOrEmptySegment),
            ("a//b", DotOrEmptySegment),
            ("a/", DotOrEmptySegment),
            ("..  ", SpaceAtEnd),
            ("a/ ../x", SpaceAtEnd),
            (" ", SpaceAtEnd),
            ("a\u{3000}", SpaceAtEnd),
            ("%2e%2e/x", Percent),
            ("%2E%2e/x", Percent),
            (".%2e/x", Percent),
            ("a%2f..%2fx", Percent),
            ("%252e%252e/x", Percent),
            ("..\\x", Backslash),
            ("a\\..\\..\\x", Backslash),
            ("\\\\host\\share", Backslash),
            ("s3://other/x", Colon),
            ("http://evil/x", Colon),
            ("C:x", Colon),
            ("C:/x", Colon),
            ("file:/etc/passwd", Colon),
            ("x?y=../z", QueryOrFragment),
            ("x#../y", QueryOrFragment),
            ("a\0b", Control),
            ("a\nb", Control),
            ("\u{7f}", Control),
        ] {
            assert_eq!(check_inside(name), Err(problem), "{name:?}");
        }
    }
}
