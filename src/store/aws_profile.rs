//! boto3's shared configuration files for s3://: `~/.aws/credentials` and `~/.aws/config`
//! (or `AWS_SHARED_CREDENTIALS_FILE` / `AWS_CONFIG_FILE`), in the profile named by
//! `storage_options["profile"]`, `AWS_PROFILE` or `AWS_DEFAULT_PROFILE` ("default" otherwise).
//!
//! A profile fills only what the options and the environment left unset, as in boto3:
//! - credentials: static keys (the credentials file before the config file), or a web-identity
//!   token file with a role ARN, set on the builder here. Profiles whose credentials come from a
//!   flow (`role_arn` with `source_profile` or `credential_source`, SSO, `credential_process`)
//!   are only recognised here: aws_credentials.rs runs them through aws-config, as the AWS CLI
//!   would;
//! - `region`, `endpoint_url` (the `[services ...]` section's `s3` one first), and the `s3`
//!   sub-section's `addressing_style`, which aws-config does not give in this form.
//!
//! A profile named explicitly must exist; the implicit "default" may be absent.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};

use super::errors::remember_secret;
use super::keys::is_true;
use crate::bounded::Whole;
use crate::error::{Error, Result};

/// The most bytes of an AWS config or credentials file read (they are a few KB).
const MAX_FILE: u64 = 16 << 20;

/// One value of an INI section: a plain string, or a sub-section (`s3 =` followed by indented
/// `key = value` lines).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Plain(String),
    Nested(Vec<(String, String)>),
}

#[derive(Debug, Default)]
struct Section {
    name: String,
    values: Vec<(String, Value)>,
}

impl Section {
    fn get(&self, key: &str) -> Option<&str> {
        self.values.iter().rev().find_map(|(k, v)| match v {
            Value::Plain(s) if k == key && !s.is_empty() => Some(s.as_str()),
            _ => None,
        })
    }

    fn nested(&self, key: &str, sub: &str) -> Option<&str> {
        self.values.iter().rev().find_map(|(k, v)| match v {
            Value::Nested(pairs) if k == key => pairs
                .iter()
                .rev()
                .find(|(s, _)| s == sub)
                .map(|(_, v)| v.as_str()),
            _ => None,
        })
    }
}

/// Parses the INI dialect botocore reads: `[section]` headers, `key = value` or `key: value`,
/// `#`/`;` comment lines, keys case-insensitive, and indented lines under a key with an empty
/// value forming a sub-section. `file` names the file in errors.
fn parse(text: &str, file: &str) -> Result<Vec<Section>> {
    let bad = |line: usize, what: &str| {
        Error::option("AWS shared config", format!("{file}: line {line}: {what}"))
    };
    let mut sections: Vec<Section> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        let indented = trimmed.len() != line.len();
        if indented {
            // A continuation: a sub-section entry of the previous key.
            let Some((key, value)) = sections.last_mut().and_then(|s| s.values.last_mut()) else {
                return Err(bad(line_no, "indented line outside a section"));
            };
            let (sub, v) = split_pair(trimmed)
                .ok_or_else(|| bad(line_no, &format!("expected `key = value` under {key:?}")))?;
            match value {
                Value::Nested(pairs) => pairs.push((sub, v)),
                Value::Plain(s) if s.is_empty() => *value = Value::Nested(vec![(sub, v)]),
                Value::Plain(_) => {
                    return Err(bad(
                        line_no,
                        &format!("indented line after {key:?}, which has a value"),
                    ))
                }
            }
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .ok_or_else(|| bad(line_no, "section header without a closing `]`"))?;
            sections.push(Section {
                name: name.trim().to_string(),
                values: Vec::new(),
            });
            continue;
        }
        let Some(section) = sections.last_mut() else {
            return Err(bad(line_no, "a setting before any [section] header"));
        };
        let (key, value) =
            split_pair(trimmed).ok_or_else(|| bad(line_no, "expected `key = value`"))?;
        section.values.push((key, Value::Plain(value)));
    }
    Ok(sections)
}

fn split_pair(line: &str) -> Option<(String, String)> {
    let at = line.find(['=', ':'])?;
    let key = line[..at].trim().to_ascii_lowercase();
    (!key.is_empty()).then(|| (key, line[at + 1..].trim().to_string()))
}

/// The two files of one profile, parsed.
struct Files {
    profile: String,
    explicit: bool,
    credentials: (String, Vec<Section>),
    config: (String, Vec<Section>),
}

impl Files {
    fn load(env: &[(String, String)], profile_option: Option<&str>) -> Result<Files> {
        let var = |name: &str| {
            env.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
                .filter(|v| !v.is_empty())
        };
        let named = profile_option
            .or_else(|| var("AWS_PROFILE"))
            .or_else(|| var("AWS_DEFAULT_PROFILE"));
        let home = var("HOME");
        let path = |override_var: &str, default: &str| -> Option<PathBuf> {
            match var(override_var) {
                Some(p) => Some(expand_home(p, home)),
                None => home.map(|h| Path::new(h).join(".aws").join(default)),
            }
        };
        let read = |p: Option<PathBuf>| -> Result<(String, Vec<Section>)> {
            let Some(p) = p else {
                return Ok((String::new(), Vec::new()));
            };
            let shown = p.display().to_string();
            // Capped (a file pointed at /dev/zero would never end; /dev/null is no config).
            match crate::bounded::read_file_limited(&p, &shown, Whole::Body, MAX_FILE) {
                Ok(bytes) => {
                    let text = String::from_utf8(bytes).map_err(|e| {
                        let e = std::io::Error::new(std::io::ErrorKind::InvalidData, e);
                        Error::io(&shown, e)
                    })?;
                    let sections = parse(&text, &shown)?;
                    Ok((shown, sections))
                }
                Err(Error::NotFound { .. }) => Ok((shown, Vec::new())),
                Err(e) => Err(e),
            }
        };
        Ok(Files {
            profile: named.unwrap_or("default").to_string(),
            explicit: named.is_some(),
            credentials: read(path("AWS_SHARED_CREDENTIALS_FILE", "credentials"))?,
            config: read(path("AWS_CONFIG_FILE", "config"))?,
        })
    }

    fn credentials_section(&self) -> Option<&Section> {
        self.credentials
            .1
            .iter()
            .rev()
            .find(|s| s.name == self.profile)
    }

    fn config_section(&self) -> Option<&Section> {
        let prefixed = format!("profile {}", self.profile);
        let by_name = |name: &str| {
            self.config
                .1
                .iter()
                .rev()
                .find(|s| s.name.split_whitespace().eq(name.split_whitespace()))
        };
        by_name(&prefixed).or_else(|| {
            if self.profile == "default" {
                by_name("default")
            } else {
                None
            }
        })
    }

    fn services_section(&self, name: &str) -> Option<&Section> {
        let want = format!("services {name}");
        self.config
            .1
            .iter()
            .rev()
            .find(|s| s.name.split_whitespace().eq(want.split_whitespace()))
    }

    fn files_named(&self) -> String {
        [&self.credentials.0, &self.config.0]
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

fn expand_home(path: &str, home: Option<&str>) -> PathBuf {
    match (path.strip_prefix("~/"), home) {
        (Some(rest), Some(home)) => Path::new(home).join(rest),
        _ => PathBuf::from(path),
    }
}

/// Applies the profile's settings that `b` does not have yet. `has_credentials` says whether the
/// options or environment already chose credentials; `explicit` holds the keys they set.
/// Also returns, when the profile's credentials come from a flow that aws-config runs, how
/// (for messages), e.g. "credential_process".
pub(super) fn apply(
    mut b: AmazonS3Builder,
    env: &[(String, String)],
    profile_option: Option<&str>,
    has_credentials: bool,
    explicit: &mut HashSet<AmazonS3ConfigKey>,
) -> Result<(AmazonS3Builder, Option<&'static str>)> {
    let files = Files::load(env, profile_option)?;
    let creds = files.credentials_section();
    let config = files.config_section();
    if creds.is_none() && config.is_none() {
        if files.explicit {
            return Err(Error::option(
                "AWS profile",
                format!(
                    "profile {:?} not found{}",
                    files.profile,
                    match files.files_named() {
                        f if f.is_empty() => " (no HOME, and AWS_CONFIG_FILE is not set)".into(),
                        f => format!(" in {f}"),
                    }
                ),
            ));
        }
        return Ok((b, None));
    }
    let profile = &files.profile;
    let mut flow = None;
    if !has_credentials {
        match profile_credentials(profile, creds, config)? {
            Credentials::Keys(keys) => {
                for (key, value) in keys {
                    b = b.with_config(key, value);
                }
            }
            Credentials::Flow(how) => flow = Some(how),
            Credentials::None => {}
        }
    }
    let Some(config) = config else {
        return Ok((b, flow));
    };
    Ok((apply_config(b, env, &files, config, explicit), flow))
}

/// The profile's config-file settings that `b` does not have yet: region, endpoint (its
/// `services` section's first) and addressing style.
fn apply_config(
    mut b: AmazonS3Builder,
    env: &[(String, String)],
    files: &Files,
    config: &Section,
    explicit: &mut HashSet<AmazonS3ConfigKey>,
) -> AmazonS3Builder {
    let unset = |b: &AmazonS3Builder, key: AmazonS3ConfigKey| b.get_config_value(&key).is_none();
    if unset(&b, AmazonS3ConfigKey::Region) && unset(&b, AmazonS3ConfigKey::DefaultRegion) {
        if let Some(region) = config.get("region") {
            b = b.with_region(region);
        }
    }
    let ignore_endpoints = env
        .iter()
        .any(|(k, v)| k == "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS" && is_true(v))
        || config
            .get("ignore_configured_endpoint_urls")
            .is_some_and(is_true);
    if !ignore_endpoints
        && unset(&b, AmazonS3ConfigKey::Endpoint)
        && unset(&b, AmazonS3ConfigKey::S3Endpoint)
    {
        let endpoint = config
            .get("services")
            .and_then(|name| files.services_section(name))
            .and_then(|s| s.nested("s3", "endpoint_url"))
            .or_else(|| config.get("endpoint_url"));
        if let Some(endpoint) = endpoint {
            b = b.with_endpoint(endpoint);
        }
    }
    let virtual_key = AmazonS3ConfigKey::VirtualHostedStyleRequest;
    if !explicit.contains(&virtual_key) {
        let style = config.nested("s3", "addressing_style");
        if let Some(virtual_hosted) = match style {
            Some("path") => Some(false),
            Some("virtual") => Some(true),
            _ => None,
        } {
            b = b.with_virtual_hosted_style_request(virtual_hosted);
            explicit.insert(virtual_key);
        }
    }
    b
}

/// What a profile says about credentials.
enum Credentials {
    /// Keys (or a web identity) to set on the builder.
    Keys(Vec<(AmazonS3ConfigKey, String)>),
    /// A flow for aws-config to run, named for messages.
    Flow(&'static str),
    None,
}

/// The profile's credentials, in botocore's order: a web identity, then an assumed role, SSO,
/// then static keys from the credentials file, then from the config file, then
/// `credential_process`.
fn profile_credentials(
    profile: &str,
    creds: Option<&Section>,
    config: Option<&Section>,
) -> Result<Credentials> {
    if let Some(config) = config {
        if let (Some(token_file), Some(role)) = (
            config.get("web_identity_token_file"),
            config.get("role_arn"),
        ) {
            let mut out = vec![
                (AmazonS3ConfigKey::WebIdentityTokenFile, token_file.into()),
                (AmazonS3ConfigKey::RoleArn, role.into()),
            ];
            if let Some(name) = config.get("role_session_name") {
                out.push((AmazonS3ConfigKey::RoleSessionName, name.into()));
            }
            return Ok(Credentials::Keys(out));
        }
        if config.get("role_arn").is_some() {
            return Ok(Credentials::Flow("an assumed role (role_arn)"));
        }
        if config.get("sso_session").is_some() || config.get("sso_start_url").is_some() {
            return Ok(Credentials::Flow("AWS IAM Identity Center (SSO)"));
        }
    }
    for section in [creds, config].into_iter().flatten() {
        if let Some(keys) = static_keys(profile, section)? {
            return Ok(Credentials::Keys(keys));
        }
    }
    if [creds, config]
        .into_iter()
        .flatten()
        .any(|s| s.get("credential_process").is_some())
    {
        return Ok(Credentials::Flow("credential_process"));
    }
    Ok(Credentials::None)
}

fn static_keys(
    profile: &str,
    section: &Section,
) -> Result<Option<Vec<(AmazonS3ConfigKey, String)>>> {
    let id = section.get("aws_access_key_id");
    let secret = section.get("aws_secret_access_key");
    let (id, secret) = match (id, secret) {
        (None, None) => return Ok(None),
        (Some(id), Some(secret)) => (id, secret),
        (have, _) => {
            let (has, lacks) = if have.is_some() {
                ("aws_access_key_id", "aws_secret_access_key")
            } else {
                ("aws_secret_access_key", "aws_access_key_id")
            };
            return Err(Error::option(
                "AWS profile",
                format!("profile {profile:?} sets {has} but not {lacks}"),
            ));
        }
    };
    remember_secret(secret);
    let mut out = vec![
        (AmazonS3ConfigKey::AccessKeyId, id.to_string()),
        (AmazonS3ConfigKey::SecretAccessKey, secret.to_string()),
    ];
    let token = section
        .get("aws_session_token")
        .or_else(|| section.get("aws_security_token"));
    if let Some(token) = token {
        remember_secret(token);
        out.push((AmazonS3ConfigKey::Token, token.to_string()));
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_botocore_ini() {
        let text = "# comment\n[default]\nregion = eu-west-1\n; other comment\n\
                    [profile dev]\nRegion: us-east-2\ns3 =\n  addressing_style = path\n  \
                    endpoint_url=http://x:1\nservices = local\n\n[services local]\ns3 =\n    \
                    endpoint_url = http://127.0.0.1:9000\n";
        let sections = parse(text, "f").unwrap();
        assert_eq!(sections.len(), 3);
        assert_eq!(sections[0].get("region"), Some("eu-west-1"));
        let dev = &sections[1];
        assert_eq!(dev.name, "profile dev");
        assert_eq!(dev.get("region"), Some("us-east-2"));
        assert_eq!(dev.nested("s3", "addressing_style"), Some("path"));
        assert_eq!(dev.nested("s3", "endpoint_url"), Some("http://x:1"));
        assert_eq!(dev.get("s3"), None);
        assert_eq!(
            sections[2].nested("s3", "endpoint_url"),
            Some("http://127.0.0.1:9000")
        );
    }

    #[test]
    fn malformed_files_name_the_file_and_line() {
        for (text, what) in [
            ("region = x\n", "line 1: a setting before"),
            ("[default\n", "line 1: section header"),
            ("[default]\nnot a pair\n", "line 2: expected `key = value`"),
            (
                "[default]\nregion = x\n  sub = y\n",
                "line 3: indented line after",
            ),
            ("  x = y\n", "line 1: indented line outside"),
        ] {
            let err = parse(text, "/tmp/cfg").unwrap_err().to_string();
            assert!(
                err.contains("/tmp/cfg") && err.contains(what),
                "{text:?}: {err}"
            );
        }
    }

    fn env_for(dir: &Path, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = vec![("HOME".to_string(), dir.display().to_string())];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir.join(".aws")).unwrap();
        std::fs::write(dir.join(".aws").join(name), text).unwrap();
    }

    fn applied(env: &[(String, String)], option: Option<&str>) -> Result<AmazonS3Builder> {
        flow_of(env, option).map(|(b, _)| b)
    }

    fn flow_of(
        env: &[(String, String)],
        option: Option<&str>,
    ) -> Result<(AmazonS3Builder, Option<&'static str>)> {
        apply(
            AmazonS3Builder::new(),
            env,
            option,
            false,
            &mut HashSet::new(),
        )
    }

    #[test]
    fn profile_fills_credentials_region_and_endpoint() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "credentials",
            "[default]\naws_access_key_id = A\naws_secret_access_key = defaultsecret\n\
             [dev]\naws_access_key_id = DEVKEY\naws_secret_access_key = devsecret123\n\
             aws_session_token = devtoken123\n",
        );
        write(
            dir.path(),
            "config",
            "[default]\nregion = eu-west-1\n[profile dev]\nregion = us-east-2\n\
             endpoint_url = http://global:1\nservices = local\n[services local]\n\
             s3 =\n  endpoint_url = http://s3only:2\n",
        );
        let b = applied(&env_for(dir.path(), &[]), None).unwrap();
        assert_value!(b, AmazonS3ConfigKey::AccessKeyId, "A");
        assert_value!(b, AmazonS3ConfigKey::Region, "eu-west-1");
        assert_eq!(b.get_config_value(&AmazonS3ConfigKey::Endpoint), None);

        for (env, option) in [
            (env_for(dir.path(), &[("AWS_PROFILE", "dev")]), None),
            (env_for(dir.path(), &[("AWS_PROFILE", "nope")]), Some("dev")),
        ] {
            let b = applied(&env, option).unwrap();
            assert_value!(b, AmazonS3ConfigKey::AccessKeyId, "DEVKEY");
            assert_value!(b, AmazonS3ConfigKey::Token, "devtoken123");
            assert_value!(b, AmazonS3ConfigKey::Region, "us-east-2");
            // The services section's s3 endpoint wins over the profile-wide one.
            assert_value!(b, AmazonS3ConfigKey::Endpoint, "http://s3only:2");
        }
        let ignore = env_for(
            dir.path(),
            &[
                ("AWS_PROFILE", "dev"),
                ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true"),
            ],
        );
        let b = applied(&ignore, None).unwrap();
        assert_eq!(b.get_config_value(&AmazonS3ConfigKey::Endpoint), None);

        // Values already set (environment, options) are kept, credentials as a whole.
        let preset = AmazonS3Builder::new()
            .with_region("ap-south-1")
            .with_endpoint("http://mine:3");
        let (b, _) = apply(
            preset,
            &env_for(dir.path(), &[("AWS_PROFILE", "dev")]),
            None,
            true,
            &mut HashSet::new(),
        )
        .unwrap();
        assert_eq!(b.get_config_value(&AmazonS3ConfigKey::AccessKeyId), None);
        assert_value!(b, AmazonS3ConfigKey::Region, "ap-south-1");
        assert_value!(b, AmazonS3ConfigKey::Endpoint, "http://mine:3");
    }

    #[test]
    fn named_profile_must_exist_and_default_may_not() {
        let dir = tempfile::tempdir().unwrap();
        assert!(applied(&env_for(dir.path(), &[]), None).is_ok());
        assert!(applied(&[], None).is_ok());
        let err = applied(&env_for(dir.path(), &[("AWS_PROFILE", "prod")]), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"prod\" not found") && err.contains(".aws"),
            "{err}"
        );
        let moved = dir.path().join("elsewhere");
        let env = env_for(dir.path(), &[("AWS_CONFIG_FILE", moved.to_str().unwrap())]);
        let err = applied(&env, Some("x")).unwrap_err().to_string();
        assert!(err.contains("elsewhere"), "{err}");
    }

    #[test]
    fn flows_are_recognised_and_partial_keys_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "config",
            "[profile role]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = default\n\
             [profile sso]\nsso_session = corp\n\
             [profile proc]\ncredential_process = /bin/creds\n\
             [profile half]\naws_access_key_id = K\n\
             [profile web]\nrole_arn = arn:aws:iam::1:role/w\nweb_identity_token_file = /t\n\
             [profile both]\ncredential_process = /bin/creds\naws_access_key_id = K\n\
             aws_secret_access_key = secretsecret\n",
        );
        let env = env_for(dir.path(), &[]);
        // Flows are left to aws-config (aws_credentials.rs): no keys set, the flow named.
        for (profile, what) in [
            ("role", "assumed role"),
            ("sso", "SSO"),
            ("proc", "credential_process"),
        ] {
            let (b, flow) = flow_of(&env, Some(profile)).unwrap();
            assert!(
                flow.is_some_and(|f| f.contains(what)),
                "{profile}: {flow:?}"
            );
            assert_eq!(b.get_config_value(&AmazonS3ConfigKey::AccessKeyId), None);
        }
        let err = applied(&env, Some("half")).unwrap_err().to_string();
        assert!(
            err.contains("sets aws_access_key_id but not aws_secret_access_key"),
            "{err}"
        );
        assert_eq!(flow_of(&env, Some("both")).unwrap().1, None);
        let b = applied(&env, Some("web")).unwrap();
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::WebIdentityTokenFile)
                .as_deref(),
            Some("/t")
        );
        // Static keys come before credential_process, as in botocore.
        let b = applied(&env, Some("both")).unwrap();
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::AccessKeyId)
                .as_deref(),
            Some("K")
        );
    }

    #[test]
    fn addressing_style_from_the_s3_subsection() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "config",
            "[default]\ns3 =\n  addressing_style = virtual\n",
        );
        let mut explicit = HashSet::new();
        let (b, _) = apply(
            AmazonS3Builder::new(),
            &env_for(dir.path(), &[]),
            None,
            false,
            &mut explicit,
        )
        .unwrap();
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::VirtualHostedStyleRequest)
                .as_deref(),
            Some("true")
        );
        assert!(explicit.contains(&AmazonS3ConfigKey::VirtualHostedStyleRequest));
    }
}
