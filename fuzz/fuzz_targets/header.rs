//! Fuzzes the safetensors header parser: it must never panic, and whatever it accepts must
//! describe a data section that the tensors tile exactly.
//!
//! Input layout: 8 bytes little-endian `extra`, then the first bytes of a file. The parser sees
//! those bytes and a file size of `bytes.len() + extra`, so one input covers both a whole file
//! (`extra == 0`) and the usual call where only the prefix and the header were read.

#![no_main]

use std::collections::HashSet;

use fastload::format::{self, Header, PREFIX_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (extra, bytes) = data.split_at(8);
    let extra = u64::from_le_bytes(extra.try_into().unwrap());
    let file_size = (bytes.len() as u64).saturating_add(extra);

    let Ok(header) = format::parse(bytes, file_size) else {
        return;
    };
    check(&header, bytes, file_size);
});

fn check(header: &Header, bytes: &[u8], file_size: u64) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert!(n <= format::MAX_HEADER_LEN);
    assert_eq!(header.data_start, PREFIX_LEN + n);
    assert!(header.data_start <= file_size);
    assert_eq!(format::header_len(bytes, file_size), Ok(n));

    let mut cursor = 0u64;
    let mut names = HashSet::new();
    for pair in header.tensors.windows(2) {
        assert!(
            (pair[0].begin, pair[0].end) <= (pair[1].begin, pair[1].end),
            "not sorted"
        );
    }
    for t in &header.tensors {
        assert!(names.insert(t.name.as_str()), "duplicate name {:?}", t.name);
        assert_eq!(
            t.begin, cursor,
            "tensor {:?} does not start where the last ended",
            t.name
        );
        assert!(t.end >= t.begin);
        cursor = t.end;
        let elems = t
            .shape
            .iter()
            .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
            .expect("accepted shape overflows u128");
        let bits = elems * t.dtype.bits() as u128;
        assert_eq!(bits % 8, 0, "tensor {:?} does not fill whole bytes", t.name);
        assert_eq!(
            bits / 8,
            t.len() as u128,
            "tensor {:?} has the wrong length",
            t.name
        );
        assert_eq!(t.is_empty(), t.begin == t.end);
    }
    assert_eq!(
        cursor,
        file_size - header.data_start,
        "tensors do not cover the data"
    );
    assert_eq!(header.data_len(), cursor);

    // Parsing just the JSON gives the same answer.
    let json = &bytes[PREFIX_LEN as usize..header.data_start as usize];
    assert_eq!(format::parse_header(json, file_size).as_ref(), Ok(header));
}
