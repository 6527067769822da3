//! Checking a remote object's bytes against the CRC of the whole object that its store keeps
//! (`verify=True`: S3's `x-amz-checksum-crc64nvme` / `-crc32c` / `-crc32`, GCS's crc32c).
//!
//! CRCs of adjacent ranges combine (`crc(a ‖ b)` from `crc(a)`, `crc(b)` and `b`'s length, the
//! crc-fast crate's `checksum_combine`), so [`CrcSource`] computes each block's CRC as the block
//! lands, on the thread that read it, and keeps only `(offset, length, crc)` for blocks ahead of
//! the verified prefix: ranged reads in parallel, in any order, are checked without holding or
//! copying their bytes (unlike a digest, which must see the bytes in order:
//! [`super::verify::VerifyingSource`]). The read that completes the file gets the verdict; a
//! mismatch fails it (and every later read), naming the file.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crc_fast::CrcAlgorithm;

use super::Decorator;
use crate::error::Result;
use crate::source::identity::StoredChecksum;
use crate::source::Source;

/// A source whose bytes are checked against the CRC its store keeps for the whole object.
#[derive(Debug)]
pub struct CrcSource {
    inner: Arc<dyn Source>,
    algorithm: CrcAlgorithm,
    name: &'static str,
    want: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The CRC of `[0, done)`.
    crc: u64,
    done: u64,
    /// Blocks read beyond `done`: offset → (length, CRC).
    ahead: BTreeMap<u64, (u64, u64)>,
    /// Once every byte was checked: `Err(got)` on a mismatch, repeated to later reads.
    outcome: Option<std::result::Result<(), u64>>,
    /// A block ahead overlapped the prefix partially (reads that overlap): its CRC cannot be
    /// cut, so the file is not judged ([`CrcSource::judged`]).
    unjudged: bool,
}

impl CrcSource {
    /// `None` for checksums that are not a CRC of the whole object.
    pub fn new(inner: Arc<dyn Source>, want: &StoredChecksum) -> Option<CrcSource> {
        let (algorithm, name, want) = match *want {
            StoredChecksum::Crc64Nvme(v) => (CrcAlgorithm::Crc64Nvme, "crc64nvme", v),
            StoredChecksum::Crc32c(v) => (CrcAlgorithm::Crc32Iscsi, "crc32c", u64::from(v)),
            StoredChecksum::Crc32(v) => (CrcAlgorithm::Crc32IsoHdlc, "crc32", u64::from(v)),
            _ => return None,
        };
        Some(CrcSource {
            inner,
            algorithm,
            name,
            want,
            state: Mutex::new(State::default()),
        })
    }

    /// Whether every byte was checked and matched.
    #[cfg(test)]
    fn judged(&self) -> Option<bool> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.outcome.map(|o| o.is_ok())
    }

    fn take(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let size = self.inner.size();
        let end = offset + bytes.len() as u64;
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if s.outcome.is_none() && !s.unjudged {
            if offset <= s.done {
                if end > s.done {
                    let tail = &bytes[(s.done - offset) as usize..];
                    let crc = crc_fast::checksum(self.algorithm, tail);
                    s.crc = self.combine(s.crc, crc, tail.len() as u64, s.done);
                    s.done = end;
                }
            } else {
                // Computed outside the prefix's order; kept small.
                let crc = crc_fast::checksum(self.algorithm, bytes);
                let len = bytes.len() as u64;
                if s.ahead.get(&offset).is_none_or(|&(l, _)| l < len) {
                    s.ahead.insert(offset, (len, crc));
                }
            }
            while let Some(entry) = s.ahead.first_entry() {
                let at = *entry.key();
                if at > s.done {
                    break;
                }
                let (len, crc) = entry.remove();
                if at + len <= s.done {
                    continue; // covered already
                }
                if at < s.done {
                    s.unjudged = true;
                    break;
                }
                s.crc = self.combine(s.crc, crc, len, s.done);
                s.done = at + len;
            }
            if s.done >= size && !s.unjudged {
                s.ahead.clear();
                s.outcome = Some(if s.crc == self.want {
                    Ok(())
                } else {
                    Err(s.crc)
                });
            }
        }
        match s.outcome {
            Some(Err(got)) => {
                let (want, got) = (self.shown(self.want), self.shown(got));
                let what = format!("stored {}", self.name);
                Err(super::verify::mismatch_of(
                    self.inner.name(),
                    &what,
                    &want,
                    &got,
                ))
            }
            _ => Ok(()),
        }
    }

    /// `crc(a ‖ b)` from `crc(a)` of `a_len` bytes and `crc(b)` of `b_len` bytes.
    fn combine(&self, a: u64, b: u64, b_len: u64, a_len: u64) -> u64 {
        if a_len == 0 {
            return b;
        }
        crc_fast::checksum_combine(self.algorithm, a, b, b_len)
    }

    fn shown(&self, crc: u64) -> String {
        match self.algorithm {
            CrcAlgorithm::Crc64Nvme => format!("{crc:016x}"),
            _ => format!("{crc:08x}"),
        }
    }
}

// boilerplate: a checking decorator: reads go to its source, each read is checked (as in verify.rs)
impl Decorator for CrcSource {
    fn inner(&self) -> &dyn Source {
        self.inner.as_ref()
    }

    fn after_read(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.take(offset, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{mem, read_all};
    use super::*;

    #[tokio::test]
    async fn blocks_in_any_order_combine_into_the_whole_objects_crc() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        // The header probe, then blocks out of order, one overlapping the probe.
        let order = [
            (0, 4096),
            (60_000, 40_000),
            (1000, 29_000),
            (30_000, 30_000),
        ];
        for (algorithm, want) in [
            (CrcAlgorithm::Crc64Nvme, None),
            (CrcAlgorithm::Crc32Iscsi, None),
            (CrcAlgorithm::Crc32IsoHdlc, None),
            (CrcAlgorithm::Crc32Iscsi, Some(0xE306_9283u64)),
        ] {
            let sample: &[u8] = if want.is_some() { b"123456789" } else { &data };
            let crc = crc_fast::checksum(algorithm, sample);
            if let Some(want) = want {
                assert_eq!(crc, want, "CRC32C's check value");
                continue;
            }
            let stored = match algorithm {
                CrcAlgorithm::Crc64Nvme => StoredChecksum::Crc64Nvme(crc),
                CrcAlgorithm::Crc32Iscsi => StoredChecksum::Crc32c(crc as u32),
                _ => StoredChecksum::Crc32(crc as u32),
            };
            let good = CrcSource::new(mem(data.clone()), &stored).unwrap();
            read_all(&good, &order).await.unwrap();
            assert_eq!(good.judged(), Some(true), "{algorithm:?}");

            let mut bad = data.clone();
            bad[77_777] ^= 0x10;
            let bad = CrcSource::new(mem(bad), &stored).unwrap();
            let err = read_all(&bad, &order).await.unwrap_err().to_string();
            assert!(err.contains("mem://x") && err.contains("mismatch"), "{err}");
            assert!(
                read_all(&bad, &[(0, 10)]).await.is_err(),
                "later reads fail too"
            );
        }
        // A file read in part is never judged.
        let stored = StoredChecksum::Crc32c(0);
        let part = CrcSource::new(mem(data), &stored).unwrap();
        read_all(&part, &[(0, 1000), (2000, 1000)]).await.unwrap();
        assert_eq!(part.judged(), None);
    }
}
