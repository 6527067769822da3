//! A resolved storage location: the URL `resolve/` redirected to, whether the token may go there,
//! and when it stops being valid.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Taken off a signed URL's lifetime, so that a read started just before it expires still gets
/// its bytes (a request signed at t is checked when it arrives, and a body may take a while).
const MARGIN: Duration = Duration::from_secs(30);

/// Where a file's bytes are, as `resolve/` said.
#[derive(Debug, Clone)]
pub struct Location {
    pub url: url::Url,
    /// The URL is on the Hub's own host (a file not in LFS, a mirror that serves bytes itself):
    /// the token goes with requests. Never to another host.
    pub same_host: bool,
    /// When to resolve again: the signature's expiry less a margin, if the URL says.
    pub expires: Option<Instant>,
}

impl Location {
    pub fn new(url: url::Url, endpoint: &url::Url) -> Location {
        let same_host = same_origin(&url, endpoint);
        let expires = expiry(&url, SystemTime::now()).map(|left| Instant::now() + left);
        Location {
            url,
            same_host,
            expires,
        }
    }

    /// Still usable now.
    pub fn fresh(&self) -> bool {
        self.expires.is_none_or(|at| Instant::now() < at)
    }
}

/// Scheme, host and port equal: the token may be sent.
pub fn same_origin(a: &url::Url, b: &url::Url) -> bool {
    a.scheme() == b.scheme()
        && a.host_str() == b.host_str()
        && a.port_or_known_default() == b.port_or_known_default()
}

/// How long a signed URL stays valid from `now` (less [`MARGIN`], at least zero): CloudFront's
/// `Expires=<epoch seconds>` or S3's `X-Amz-Date=<YYYYMMDDTHHMMSSZ>` + `X-Amz-Expires=<seconds>`.
/// `None` when the URL carries neither (then it is used until the storage host refuses it).
pub fn expiry(url: &url::Url, now: SystemTime) -> Option<Duration> {
    let mut expires = None;
    let mut amz_date = None;
    let mut amz_expires = None;
    for (key, value) in url.query_pairs() {
        match key.as_ref() {
            "Expires" => expires = value.parse::<u64>().ok(),
            "X-Amz-Date" => amz_date = amz_time(&value),
            "X-Amz-Expires" => amz_expires = value.parse::<u64>().ok(),
            _ => {}
        }
    }
    let now_s = now.duration_since(UNIX_EPOCH).ok()?.as_secs();
    let at = match (expires, amz_date, amz_expires) {
        (Some(at), _, _) => at,
        (None, Some(signed), Some(valid)) => signed + valid,
        (None, None, Some(valid)) => now_s + valid,
        _ => return None,
    };
    Some(Duration::from_secs(at.saturating_sub(now_s)).saturating_sub(MARGIN))
}

/// `20261123T210800Z` as seconds since the epoch.
fn amz_time(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<u64>().ok();
    let (y, m, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (hh, mm, ss) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || y < 1970 {
        return None;
    }
    // Days since the epoch of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some(days * 86400 + hh * 3600 + mm * 60 + ss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn cloudfront_expires_less_the_margin() {
        let url = url::Url::parse("https://cdn.example/x?Expires=1000&Signature=abc").unwrap();
        assert_eq!(expiry(&url, at(900)), Some(Duration::from_secs(70)));
        // Already (nearly) expired: zero, so the location is resolved again at once.
        assert_eq!(expiry(&url, at(990)), Some(Duration::ZERO));
        assert_eq!(expiry(&url, at(2000)), Some(Duration::ZERO));
    }

    #[test]
    fn s3_date_plus_expires() {
        // 2026-11-23T21:08:00Z is 1795468080 s after the epoch.
        assert_eq!(amz_time("20261123T210800Z"), Some(1_795_468_080));
        assert_eq!(amz_time("19700101T000000Z"), Some(0));
        assert_eq!(amz_time("2026-11-23"), None);
        let url = url::Url::parse(
            "https://s3.example/b/k?X-Amz-Date=20261123T210800Z&X-Amz-Expires=3600&X-Amz-Signature=s",
        )
        .unwrap();
        assert_eq!(
            expiry(&url, at(1_795_468_080)),
            Some(Duration::from_secs(3570))
        );
    }

    #[test]
    fn unsigned_urls_do_not_expire() {
        let url = url::Url::parse("https://cdn.example/x?a=1").unwrap();
        assert_eq!(expiry(&url, at(0)), None);
    }

    #[test]
    fn the_token_only_goes_to_the_same_origin() {
        let hub = url::Url::parse("https://huggingface.co").unwrap();
        let same = url::Url::parse("https://huggingface.co:443/x").unwrap();
        let cdn = url::Url::parse("https://cdn-lfs.huggingface.co/x").unwrap();
        let other_port = url::Url::parse("https://huggingface.co:8443/x").unwrap();
        assert!(same_origin(&same, &hub));
        assert!(!same_origin(&cdn, &hub));
        assert!(!same_origin(&other_port, &hub));
    }
}
