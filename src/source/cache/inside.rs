//! Files inside a folder, reached only through real directories: each folder on the way is
//! opened from the one before it (`openat` with `O_NOFOLLOW`), and so is the file, so that a
//! symbolic link planted in the folder is refused instead of followed out of it. The folder
//! itself may be a link (a folder the user points elsewhere). The small files beside a
//! checkpoint go through these into folders that libraries read and that other processes may be
//! filling at the same time: each file is written under a unique temporary name and renamed into
//! place, so that a reader never sees half a file and writers racing on one name all succeed.
//!
//! std has no `openat`: the few calls go to libc here, each on a descriptor this module owns.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, Result};

/// A folder opened without following a link on the way.
struct Dir(OwnedFd);

fn c_name(name: &[u8]) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// A descriptor from a libc call that returns one (or -1 with `errno`).
fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by the kernel, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn done(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

const DIR_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;

impl Dir {
    fn root(dest: &Path) -> io::Result<Dir> {
        let path = c_name(dest.as_os_str().as_bytes())?;
        // SAFETY: a NUL-terminated path; the result is checked.
        owned(unsafe { libc::open(path.as_ptr(), DIR_FLAGS) }).map(Dir)
    }

    fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The folder `name` in this one, never through a link (made first when `create`).
    fn child(&self, name: &str, create: bool) -> io::Result<Dir> {
        let c = c_name(name.as_bytes())?;
        if create {
            // SAFETY: a NUL-terminated name relative to an open directory.
            if let Err(e) = done(unsafe { libc::mkdirat(self.fd(), c.as_ptr(), 0o777) }) {
                if e.kind() != io::ErrorKind::AlreadyExists {
                    return Err(e);
                }
            }
        }
        let flags = DIR_FLAGS | libc::O_NOFOLLOW;
        // SAFETY: as above.
        owned(unsafe { libc::openat(self.fd(), c.as_ptr(), flags) }).map(Dir)
    }

    /// The file `name` in this one opened with `flags` (and `O_NOFOLLOW`).
    fn open(&self, name: &str, flags: libc::c_int) -> io::Result<File> {
        let c = c_name(name.as_bytes())?;
        let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: as above; the mode is read only with O_CREAT.
        owned(unsafe { libc::openat(self.fd(), c.as_ptr(), flags, 0o666 as libc::c_uint) })
            .map(File::from)
    }

    /// What `name` is, the link itself for a link; `None` when there is nothing.
    fn kind(&self, name: &str) -> io::Result<Option<libc::mode_t>> {
        let c = c_name(name.as_bytes())?;
        // SAFETY: a zeroed stat buffer the call fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let flags = libc::AT_SYMLINK_NOFOLLOW;
        // SAFETY: as above.
        match done(unsafe { libc::fstatat(self.fd(), c.as_ptr(), &mut st, flags) }) {
            Ok(()) => Ok(Some(st.st_mode & libc::S_IFMT)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (from, to) = (c_name(from.as_bytes())?, c_name(to.as_bytes())?);
        // SAFETY: two NUL-terminated names relative to this open directory.
        done(unsafe { libc::renameat(self.fd(), from.as_ptr(), self.fd(), to.as_ptr()) })
    }

    fn unlink(&self, name: &str) -> io::Result<()> {
        let c = c_name(name.as_bytes())?;
        // SAFETY: as above.
        done(unsafe { libc::unlinkat(self.fd(), c.as_ptr(), 0) })
    }
}

/// The refusal to go through `dest/rel`: `what` is there where a real folder or file must be.
fn not_followed(dest: &Path, rel: &str, what: &str) -> Error {
    Error::Io {
        path: dest.join(rel).display().to_string(),
        source: io::Error::other(format!(
            "{what} in the destination folder; fastload writes no file through it"
        )),
    }
}

/// `rel`'s folders and its file name.
fn split(rel: &str) -> (Vec<&str>, &str) {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let leaf = parts.pop().unwrap_or_default();
    (parts, leaf)
}

/// `dest/folders...`, each a real directory (made when `create`).
fn open_folders(dest: &Path, folders: &[&str], create: bool) -> Result<Dir> {
    let mut dir = Dir::root(dest).map_err(|e| Error::io(dest.display().to_string(), e))?;
    for (i, part) in folders.iter().enumerate() {
        let rel = folders[..=i].join("/");
        dir = match dir.child(part, create) {
            Ok(child) => child,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                return Err(not_followed(
                    dest,
                    &rel,
                    "a symbolic link or not a directory",
                ))
            }
            Err(e) => return Err(Error::io(dest.join(rel).display().to_string(), e)),
        };
    }
    Ok(dir)
}

/// A name no other writer picks: `.<leaf>.<16 hex>.tmp` (the leaf cut to 200 bytes, so that the
/// name stays under the 255 a file name may have).
fn temporary_name(leaf: &str) -> String {
    let mut cut = leaf.len().min(200);
    while !leaf.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut random = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
    format!(".{}.{}.tmp", &leaf[..cut], super::entry::hex(&random))
}

/// Writes `data` to `dest/rel` (a relative `/`-separated name, checked by the caller): through
/// real directories inside `dest` only (made as needed), under a unique temporary name renamed
/// onto `rel`. A link (or anything but a regular file) already at `rel` or on the way is refused.
pub fn write(dest: &Path, rel: &str, data: &[u8]) -> Result<()> {
    let (folders, leaf) = split(rel);
    let dir = open_folders(dest, &folders, true)?;
    let io = |e: io::Error| Error::io(dest.join(rel).display().to_string(), e);
    match dir.kind(leaf).map_err(io)? {
        None | Some(libc::S_IFREG) => {}
        Some(libc::S_IFLNK) => return Err(not_followed(dest, rel, "a symbolic link")),
        Some(_) => return Err(not_followed(dest, rel, "not a regular file")),
    }
    let tmp = temporary_name(leaf);
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
    let written = dir
        .open(&tmp, flags)
        .and_then(|mut file| file.write_all(data))
        .and_then(|()| dir.rename(&tmp, leaf));
    if let Err(e) = written {
        let _ = dir.unlink(&tmp);
        return Err(io(e));
    }
    Ok(())
}

/// The regular file `dest/rel`, reached without following a link; `None` where there is none
/// (or a link is on the way).
pub fn open(dest: &Path, rel: &str) -> Option<File> {
    let (folders, leaf) = split(rel);
    let dir = open_folders(dest, &folders, false).ok()?;
    let file = dir.open(leaf, libc::O_RDONLY).ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// Removes `dest/rel` if it is there (never through a link on the way).
pub fn remove(dest: &Path, rel: &str) {
    let (folders, leaf) = split(rel);
    if let Ok(dir) = open_folders(dest, &folders, false) {
        let _ = dir.unlink(leaf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn read(dest: &Path, rel: &str) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        open(dest, rel)?.read_to_end(&mut out).ok()?;
        Some(out)
    }

    #[test]
    fn writes_through_real_folders_and_replaces_files_whole() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a/b/c.json", b"one").unwrap();
        write(dir.path(), "a/b/c.json", b"two").unwrap();
        assert_eq!(read(dir.path(), "a/b/c.json").unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(dir.path().join("a/b")).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file left");
        remove(dir.path(), "a/b/c.json");
        assert!(read(dir.path(), "a/b/c.json").is_none());
    }

    #[test]
    fn links_in_the_folder_are_refused_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (dest, elsewhere) = (dir.path().join("dest"), dir.path().join("elsewhere"));
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("x"), "precious").unwrap();
        std::os::unix::fs::symlink(&elsewhere, dest.join("sub")).unwrap();
        std::os::unix::fs::symlink(elsewhere.join("x"), dest.join("f")).unwrap();
        std::fs::create_dir(dest.join("d")).unwrap();
        for (rel, what) in [
            ("sub/x", "a symbolic link or not a directory"),
            ("f", "a symbolic link"),
            ("d", "not a regular file"),
        ] {
            let err = write(&dest, rel, b"new").unwrap_err().to_string();
            assert!(err.contains(what), "{rel}: {err}");
            assert!(read(&dest, rel).is_none(), "{rel}");
        }
        assert_eq!(std::fs::read(elsewhere.join("x")).unwrap(), b"precious");
        // The folder itself may be a link.
        std::os::unix::fs::symlink(&elsewhere, dir.path().join("link")).unwrap();
        write(&dir.path().join("link"), "y", b"y").unwrap();
        assert_eq!(std::fs::read(elsewhere.join("y")).unwrap(), b"y");
    }
}
