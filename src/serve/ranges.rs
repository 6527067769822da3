//! The one `Range: bytes=...` form a serve answers (a single range), and the chunks a body is
//! streamed in.

/// What a request's `Range` header asks of a file of `size` bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Asked {
    /// No range (or one this serve ignores, as RFC 9110 allows: several ranges, another unit,
    /// bad syntax): the whole file, 200.
    Whole,
    /// `[start, end)`, 206.
    Part { start: u64, end: u64 },
    /// Nothing of the file: 416.
    Unsatisfiable,
}

/// Parses `header` (`bytes=a-b`, `bytes=a-`, `bytes=-n`) against a file of `size` bytes.
pub fn parse(header: Option<&str>, size: u64) -> Asked {
    let Some(spec) = header.and_then(|h| h.trim().strip_prefix("bytes=")) else {
        return Asked::Whole;
    };
    if spec.contains(',') {
        return Asked::Whole;
    }
    let Some((first, last)) = spec.trim().split_once('-') else {
        return Asked::Whole;
    };
    let number = |s: &str| -> Option<u64> {
        let s = s.trim();
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    match (first.trim().is_empty(), number(first), number(last)) {
        // `-n`: the last n bytes.
        (true, _, Some(n)) if n == 0 || size == 0 => Asked::Unsatisfiable,
        (true, _, Some(n)) => Asked::Part {
            start: size - n.min(size),
            end: size,
        },
        (false, Some(a), _) if a >= size => Asked::Unsatisfiable,
        (false, Some(a), None) if last.trim().is_empty() => Asked::Part {
            start: a,
            end: size,
        },
        (false, Some(a), Some(b)) if b >= a => Asked::Part {
            start: a,
            end: b.min(size - 1) + 1,
        },
        _ => Asked::Whole,
    }
}

/// Bytes per body chunk: a response is streamed in chunks of at most this many, each read when
/// the connection takes the previous one, so a huge range holds no more than this in memory
/// and connections take turns on the reads and the link.
pub const CHUNK: u64 = 1 << 20;

/// The chunks of `[start, end)`: `(offset, len)` of at most [`CHUNK`] bytes.
pub fn chunks(start: u64, end: u64) -> impl Iterator<Item = (u64, usize)> {
    (start..end)
        .step_by(CHUNK as usize)
        .map(move |at| (at, (end - at).min(CHUNK) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_ranges_in_every_form() {
        let p = |a, b| Asked::Part { start: a, end: b };
        assert_eq!(parse(Some("bytes=0-9"), 100), p(0, 10));
        assert_eq!(parse(Some("bytes=90-"), 100), p(90, 100));
        assert_eq!(parse(Some("bytes=90-500"), 100), p(90, 100));
        assert_eq!(parse(Some("bytes=-10"), 100), p(90, 100));
        assert_eq!(parse(Some("bytes=-500"), 100), p(0, 100));
        assert_eq!(parse(Some("bytes=99-99"), 100), p(99, 100));
    }

    #[test]
    fn ranges_outside_the_file_are_unsatisfiable() {
        assert_eq!(parse(Some("bytes=100-"), 100), Asked::Unsatisfiable);
        assert_eq!(parse(Some("bytes=100-200"), 100), Asked::Unsatisfiable);
        assert_eq!(parse(Some("bytes=-0"), 100), Asked::Unsatisfiable);
        assert_eq!(parse(Some("bytes=0-"), 0), Asked::Unsatisfiable);
    }

    #[test]
    fn other_forms_are_ignored_for_the_whole_file() {
        for h in [
            None,
            Some("items=0-1"),
            Some("bytes=0-1,5-6"),
            Some("bytes=5-1"),
            Some("bytes=a-b"),
            Some("bytes=+1-2"),
            Some("bytes=-"),
        ] {
            assert_eq!(parse(h, 100), Asked::Whole, "{h:?}");
        }
    }

    #[test]
    fn chunks_cover_the_range_once_in_bounded_pieces() {
        let end = 3 * CHUNK + 5;
        let all: Vec<_> = chunks(7, end).collect();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|&(_, len)| len as u64 <= CHUNK));
        let mut at = 7;
        for (off, len) in all {
            assert_eq!(off, at);
            at += len as u64;
        }
        assert_eq!(at, end);
        assert_eq!(chunks(5, 5).count(), 0);
    }
}
