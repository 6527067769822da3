//! Files and bodies read whole into memory (index files, the Hub's API answers, small config
//! files) stop at one cap, [`MAX_WHOLE_READ`], checked while the bytes arrive: a size claimed up
//! front (a file's length, a `Content-Length`) is refused at once, and a body that claims nothing
//! (chunked) or claims less than it sends stops at the cap. A file is opened without blocking and
//! checked to be a regular file before a byte is read, so a FIFO or a device put in its place
//! neither hangs the load nor streams for ever.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::FormatError;

/// The most bytes read whole into memory from one file or body (as the reference implementation
/// caps a header; an index of a 100,000-shard checkpoint is a few MB).
pub const MAX_WHOLE_READ: u64 = crate::format::MAX_HEADER_LEN;

/// What is being read, for the error when it is too large.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whole {
    /// An index file: too large is a `FormatError` naming it.
    Index,
    /// Anything else (an API answer, a config file): too large is a storage error naming it.
    Body,
}

/// The error for `name`, which has more than `limit` bytes.
pub fn too_large(name: &str, what: Whole, limit: u64) -> Error {
    let index = FormatError::IndexTooLarge { limit };
    let body = format!("more than {limit} bytes, the limit for a body read whole");
    refusal(name, what, index, io::ErrorKind::InvalidData, body)
}

/// The refusal of `name`: an index's is the `FormatError` `index`; anything else's is a storage
/// error of `kind` that says `body`.
fn refusal(
    name: &str,
    what: Whole,
    index: FormatError,
    kind: io::ErrorKind,
    body: String,
) -> Error {
    match what {
        Whole::Index => Error::format(name, index),
        Whole::Body => Error::Io {
            path: name.to_string(),
            source: io::Error::new(kind, body),
        },
    }
}

/// A body being collected, refused once it would pass its cap.
#[derive(Debug)]
pub struct Capped {
    name: String,
    what: Whole,
    limit: u64,
    bytes: Vec<u8>,
}

impl Capped {
    /// Collects `name`'s bytes up to [`MAX_WHOLE_READ`]; `claimed` (a `Content-Length`, an
    /// object's listed size) over the cap is refused before anything is read.
    pub fn new(name: &str, what: Whole, claimed: Option<u64>) -> Result<Capped> {
        Capped::with_limit(name, what, claimed, MAX_WHOLE_READ)
    }

    pub fn with_limit(name: &str, what: Whole, claimed: Option<u64>, limit: u64) -> Result<Capped> {
        if claimed.is_some_and(|n| n > limit) {
            return Err(too_large(name, what, limit));
        }
        // The claim is a hint only: never more than the cap is reserved up front.
        let reserve = claimed.unwrap_or(0).min(limit).min(1 << 20) as usize;
        Ok(Capped {
            name: name.to_string(),
            what,
            limit,
            bytes: Vec::with_capacity(reserve),
        })
    }

    /// Adds a chunk; an error once the bytes so far pass the cap.
    pub fn push(&mut self, chunk: &[u8]) -> Result<()> {
        if (self.bytes.len() + chunk.len()) as u64 > self.limit {
            return Err(too_large(&self.name, self.what, self.limit));
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    pub fn finish(self) -> Vec<u8> {
        self.bytes
    }
}

/// A small file read whole: opened without blocking (a FIFO put at the path does not wait for a
/// writer), an index refused unless it is a regular file, and never read past
/// [`MAX_WHOLE_READ`]. `name` is the file as messages show it.
pub fn read_file(path: &Path, name: &str, what: Whole) -> Result<Vec<u8>> {
    read_file_limited(path, name, what, MAX_WHOLE_READ)
}

pub fn read_file_limited(path: &Path, name: &str, what: Whole, limit: u64) -> Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(name, e))?;
    let meta = file.metadata().map_err(|e| Error::io(name, e))?;
    // An index must be a regular file. A config file may also be a device (`/dev/null` is a
    // common "no config"; `/dev/zero` stops at the cap) or a FIFO (opened without blocking, a
    // read with no data waiting fails rather than waits), never a directory.
    if !meta.is_file() && (what == Whole::Index || meta.is_dir()) {
        return Err(not_regular(name, what, &meta));
    }
    let claimed = meta.is_file().then_some(meta.len());
    let mut out = Capped::with_limit(name, what, claimed, limit)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut file = file;
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(out.finish()),
            Ok(n) => out.push(&buf[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(name, e)),
        }
    }
}

/// What kind of file that is not a regular one `meta` describes, for refusals.
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else {
        "special file"
    }
}

/// The refusal of a file that is not a regular one (a directory, FIFO, device or socket).
pub fn not_regular(name: &str, what: Whole, meta: &std::fs::Metadata) -> Error {
    let kind = file_kind(meta);
    let index = FormatError::NotARegularFile { kind };
    let body = format!("is a {kind}, not a regular file");
    refusal(name, what, index, io::ErrorKind::InvalidInput, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_stops_at_the_cap_whatever_it_claimed() {
        let mut body = Capped::with_limit("b", Whole::Body, Some(4), 10).unwrap();
        body.push(b"12345").unwrap();
        body.push(b"67890").unwrap();
        let err = body.push(b"x").unwrap_err().to_string();
        assert_eq!(
            err,
            "b: more than 10 bytes, the limit for a body read whole"
        );
        let err = Capped::with_limit("i", Whole::Index, Some(11), 10).unwrap_err();
        assert!(matches!(
            err,
            Error::Format {
                source: FormatError::IndexTooLarge { limit: 10 },
                ..
            }
        ));
    }

    #[test]
    fn files_are_read_up_to_the_cap_and_devices_refused() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.json");
        std::fs::write(&small, b"{}").unwrap();
        assert_eq!(read_file(&small, "small", Whole::Index).unwrap(), b"{}");
        let big = dir.path().join("big.json");
        std::fs::write(&big, vec![b' '; 11]).unwrap();
        let err = read_file_limited(&big, "big", Whole::Body, 10).unwrap_err();
        assert!(err.to_string().contains("more than 10 bytes"), "{err}");
        // A character device: an index is refused before a byte is read (reading /dev/zero
        // never ends); a config file is read up to its cap (/dev/null is "no config").
        let err = read_file(Path::new("/dev/zero"), "zero", Whole::Index).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let err = read_file_limited(Path::new("/dev/zero"), "zero", Whole::Body, 1000);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("more than 1000 bytes"));
        let null = read_file(Path::new("/dev/null"), "null", Whole::Body).unwrap();
        assert!(null.is_empty());
        // A FIFO without a writer: refused at once, not waited on.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        #[allow(unsafe_code)]
        // SAFETY: a NUL-terminated path.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0);
        let err = read_file(&fifo, "fifo", Whole::Index).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
    }
}
