//! S3 credentials as the AWS CLI finds them, for whatever our options, the environment's keys and
//! the profile's static keys left open: aws-config's default chain (the environment; the profile's
//! assumed role with `source_profile` or `credential_source`, SSO from the cached token, web
//! identity and `credential_process`; web identity from the environment; container credentials,
//! ECS and EKS Pod Identity; the EC2 instance metadata service, IMDSv2), behind object_store's
//! `CredentialProvider`, cached and fetched again before they expire.
//!
//! aws-config reads the process environment and the files it names (`AWS_CONFIG_FILE`, ...), as
//! the AWS CLI does; the profile chosen by `storage_options["profile"]` is passed to it. Its HTTP
//! client is rustls on ring, as the rest of the crate (no aws-lc build).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::default_provider::credentials::DefaultCredentialsChain;
use aws_config::imds;
use aws_config::provider_config::ProviderConfig;
use aws_config::Region;
use aws_credential_types::provider::ProvideCredentials;
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use object_store::aws::AwsCredential;
use object_store::CredentialProvider;
use tokio::sync::{Mutex, OnceCell};

use super::errors::{remember_secret, CredentialsUnavailable};

/// Credentials that expire within this are fetched again (object_store's own margin).
const REFRESH_BEFORE: Duration = Duration::from_secs(300);

/// What the chain needs from our configuration, and what messages say about where we looked.
#[derive(Debug, Clone, Default)]
pub(super) struct Sources {
    /// `storage_options["profile"]` (aws-config reads `AWS_PROFILE` itself).
    pub profile: Option<String>,
    /// The region our options, environment or profile chose, for STS and the like.
    pub region: Option<String>,
    /// The instance metadata endpoint: the option `metadata_endpoint`, or the variable
    /// `AWS_METADATA_ENDPOINT` (object_store's) or `AWS_EC2_METADATA_SERVICE_ENDPOINT` (the CLI's).
    pub metadata_endpoint: Option<String>,
    /// The profile's credential flow, when it has one ("credential_process", ...).
    pub flow: Option<&'static str>,
    /// The profile's name as messages show it.
    pub profile_shown: String,
    /// `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI` or `_FULL_URI` is set.
    pub container: bool,
}

/// aws-config's default chain as an object_store credential provider.
pub(super) struct Chain {
    sources: Sources,
    chain: OnceCell<DefaultCredentialsChain>,
    cached: Mutex<Option<(Arc<AwsCredential>, Option<SystemTime>)>>,
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chain")
            .field("sources", &self.sources)
            .finish_non_exhaustive()
    }
}

impl Chain {
    pub(super) fn new(sources: Sources) -> Chain {
        Chain {
            sources,
            chain: OnceCell::new(),
            cached: Mutex::new(None),
        }
    }

    /// Built on first use, inside the runtime that makes the requests.
    async fn chain(&self) -> Result<&DefaultCredentialsChain, CredentialsUnavailable> {
        self.chain
            .get_or_try_init(|| async {
                let http = aws_smithy_http_client::Builder::new()
                    .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
                    .build_https();
                let config = ProviderConfig::default().with_http_client(http);
                let mut b = DefaultCredentialsChain::builder();
                if let Some(profile) = &self.sources.profile {
                    b = b.profile_name(profile);
                }
                if let Some(region) = &self.sources.region {
                    b = b.region(Region::new(region.clone()));
                }
                if let Some(endpoint) = &self.sources.metadata_endpoint {
                    let client = imds::Client::builder()
                        .configure(&config)
                        .endpoint(endpoint)
                        .map_err(|e| CredentialsUnavailable {
                            message: format!(
                                "the instance metadata endpoint {endpoint:?} is not a URL: {e}"
                            ),
                        })?;
                    b = b.imds_client(client.build());
                }
                Ok(b.configure(config).build().await)
            })
            .await
    }

    /// Why no credentials came: the profile's flow failed, or nothing anywhere gave any.
    fn failure(&self, e: &dyn std::error::Error) -> CredentialsUnavailable {
        let detail = chain_text(e);
        let message = match self.sources.flow {
            Some(flow) => format!(
                "the AWS credentials of profile {} come through {flow}, which failed: {detail}",
                self.sources.profile_shown
            ),
            None if self.sources.container => format!(
                "no AWS credentials from the container credential endpoint \
                 (AWS_CONTAINER_CREDENTIALS_FULL_URI or AWS_CONTAINER_CREDENTIALS_RELATIVE_URI, \
                 with AWS_CONTAINER_AUTHORIZATION_TOKEN or its _FILE): {detail}"
            ),
            None => {
                let endpoint = self
                    .sources
                    .metadata_endpoint
                    .as_deref()
                    .unwrap_or("http://169.254.169.254");
                format!(
                    "no AWS credentials found: none in the storage options, in the environment \
                     (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE, \
                     AWS_CONTAINER_CREDENTIALS_*), or in the shared files \
                     (AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials, AWS_CONFIG_FILE or \
                     ~/.aws/config, profile {}); the EC2 instance metadata service at {endpoint} \
                     gave none ({detail}). Set credentials, set the storage \
                     option skip_signature=true for a public bucket, or set \
                     AWS_EC2_METADATA_DISABLED=true off EC2 to fail at once",
                    self.sources.profile_shown
                )
            }
        };
        CredentialsUnavailable { message }
    }
}

#[async_trait]
impl CredentialProvider for Chain {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        let generic = |e: CredentialsUnavailable| object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        };
        // One fetch at a time: requests waiting here take its result.
        let mut cached = self.cached.lock().await;
        if let Some((credential, expires)) = cached.as_ref() {
            let fresh = expires.is_none_or(|at| at > SystemTime::now() + REFRESH_BEFORE);
            if fresh {
                return Ok(Arc::clone(credential));
            }
        }
        let chain = self.chain().await.map_err(generic)?;
        let got = chain
            .provide_credentials()
            .await
            .map_err(|e| generic(self.failure(&e)))?;
        remember_secret(got.secret_access_key());
        if let Some(token) = got.session_token() {
            remember_secret(token);
        }
        let credential = Arc::new(AwsCredential {
            key_id: got.access_key_id().to_string(),
            secret_key: got.secret_access_key().to_string(),
            token: got.session_token().map(str::to_string),
        });
        *cached = Some((Arc::clone(&credential), got.expiry()));
        Ok(credential)
    }
}

/// An error and its sources, joined: aws-config's top-level messages alone say little.
fn chain_text(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut next = e.source();
    while let Some(err) = next {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = err.source();
    }
    parts.join(": ")
}
