//! The sizes of the streaming format's header and tag: plain numbers that `segment` (the wire
//! format) and `keyset` (which checks a key's segment size against them) both need, in a leaf
//! below both.

/// The GCM tag after each segment.
pub const TAG: usize = 16;
/// The random prefix of every segment's nonce, in the header.
pub const NONCE_PREFIX: usize = 7;

/// Bytes of the header for keys deriving `derived_key_size`-byte keys (its first byte says so).
pub const fn header_len(derived_key_size: usize) -> usize {
    1 + derived_key_size + NONCE_PREFIX
}
