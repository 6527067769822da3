//! Who may read: a bearer token (from `--token-file` or `FASTLOAD_PEER_TOKEN`) compared in
//! constant time, and the rule that a serve reachable from other machines has one (or was told
//! `--no-auth`). The token is never formatted: [`Token`]'s `Debug` hides it.

use std::net::IpAddr;

use subtle::ConstantTimeEq;

use crate::error::{Error, Result};

/// The variable clients and serves read the token from.
pub const ENV_PEER_TOKEN: &str = "FASTLOAD_PEER_TOKEN";

/// A bearer secret.
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<hidden>)")
    }
}

impl Token {
    pub fn new(secret: &str) -> Option<Token> {
        let secret = secret.trim();
        (!secret.is_empty()).then(|| Token(secret.as_bytes().to_vec()))
    }

    /// Whether an `Authorization` header carries this token (`Bearer <token>`). The comparison
    /// takes the same time wherever the first difference is.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(given) = authorization.and_then(|h| {
            let (scheme, rest) = h.split_at(h.len().min(7));
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
        }) else {
            return false;
        };
        let given = given.trim_ascii();
        // Lengths differ: no comparison, but no early answer on the content either.
        bool::from(given.ct_eq(&self.0))
    }
}

/// The serve's token: the first line of `token_file`, else `FASTLOAD_PEER_TOKEN`, else none.
/// A named file that cannot be read or is empty is an error (never a serve without the token
/// that was meant).
pub fn load(token_file: Option<&str>) -> Result<Option<Token>> {
    if let Some(path) = token_file {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let first = text.lines().next().unwrap_or("");
        return Token::new(first)
            .map(Some)
            .ok_or_else(|| Error::option("--token-file", format!("{path} holds no token")));
    }
    Ok(std::env::var(ENV_PEER_TOKEN)
        .ok()
        .and_then(|t| Token::new(&t)))
}

/// Refuses to serve on an address other machines reach without a token, unless `no_auth`.
pub fn check_bind(ip: IpAddr, token: Option<&Token>, no_auth: bool) -> Result<()> {
    if ip.is_loopback() || token.is_some() || no_auth {
        return Ok(());
    }
    Err(Error::option(
        "--bind",
        format!(
            "{ip} is reachable from other machines: give a token (--token-file FILE or \
             {ENV_PEER_TOKEN}) or say --no-auth"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = Token::new("s3cret\n").unwrap();
        assert!(t.admits(Some(b"Bearer s3cret")));
        assert!(t.admits(Some(b"bearer s3cret")));
        for bad in [
            &b"Bearer s3cre"[..],
            b"Bearer s3cretx",
            b"Bearer S3cret",
            b"Basic s3cret",
            b"s3cret",
            b"Bearer ",
            b"",
        ] {
            assert!(!t.admits(Some(bad)), "{}", String::from_utf8_lossy(bad));
        }
        assert!(!t.admits(None));
        assert!(Token::new("  ").is_none());
    }

    #[test]
    fn the_token_never_formats() {
        let t = Token::new("s3cret").unwrap();
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn non_loopback_binds_need_a_token_or_no_auth() {
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let t = Token::new("x");
        assert!(check_bind(lo, None, false).is_ok());
        assert!(check_bind("::1".parse().unwrap(), None, false).is_ok());
        let e = check_bind(any, None, false).unwrap_err().to_string();
        assert!(e.contains("--no-auth"), "{e}");
        assert!(check_bind(any, t.as_ref(), false).is_ok());
        assert!(check_bind(any, None, true).is_ok());
    }
}
