//! HTTP clients shared by every open in a process. A client holds a pool of connections and, on
//! https, the system's CA certificates (read from files when it is built); one per open made
//! each `safe_open` handle hold its own sockets, and the next handle at the descriptor limit
//! failed to build its client at all. Stores and Hub opens with the same configuration share one
//! client here, and each keeps at most [`IDLE_PER_HOST`] idle connections to a host for
//! [`IDLE_TIMEOUT`] (object_store's `pool_max_idle_per_host` and `pool_idle_timeout` override
//! them for a store).
//!
//! A client is keyed by its whole configuration plus the variables reqwest and the CA loading
//! read when it is built (proxies, `SSL_CERT_FILE`, `SSL_CERT_DIR`), so a changed variable builds
//! a new one. The clients live per process ([`PerProcess`]): a forked child builds its own, as
//! a parent's connections are driven by the parent's runtime.

use std::collections::HashMap;
use std::time::Duration;

use object_store::client::{HttpClient, HttpConnector, ReqwestConnector};
use object_store::ClientOptions;

use crate::per_process::PerProcess;

/// Idle connections a client keeps to one host (reqwest keeps every one by default): the reads
/// in flight of a remote load by default, so that a load's connections are reused between its
/// requests rather than closed and opened again (fewer would be, at 64 in flight).
pub const IDLE_PER_HOST: usize = crate::options::DEFAULT_REMOTE_CONCURRENCY;
/// How long an idle connection is kept (reqwest's default is 90 s): long enough for the next
/// read of a `safe_open` handle, short enough that handles left open hold no sockets.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Configurations kept at once; past it the cache starts over (stores keep their clients).
const MAX_CLIENTS: usize = 64;

static STORE_CLIENTS: PerProcess<HashMap<String, HttpClient>> = PerProcess::new(HashMap::new);
static HUB_CLIENTS: PerProcess<HashMap<String, reqwest::Client>> = PerProcess::new(HashMap::new);

/// The variables a client reads when it is built, as part of its key.
fn environment() -> String {
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| {
            let k = k.to_ascii_uppercase();
            k.contains("PROXY") || k.starts_with("SSL_CERT") || k == "REQUEST_METHOD"
        })
        .collect();
    vars.sort();
    format!("{vars:?}")
}

/// The client for `key` in `cache`, built by `build` the first time.
fn shared<T: Clone, E>(
    cache: &'static PerProcess<HashMap<String, T>>,
    key: String,
    build: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if let Some(client) = cache.lock().get(&key) {
        return Ok(client.clone());
    }
    // Built outside the lock (it reads files); a thread that raced us wins, ours is dropped.
    let client = build()?;
    let mut clients = cache.lock();
    if clients.len() >= MAX_CLIENTS && !clients.contains_key(&key) {
        clients.clear();
    }
    Ok(clients.entry(key).or_insert(client).clone())
}

/// object_store's connector for every store fastload builds: the process's client for the
/// store's [`ClientOptions`].
#[derive(Debug, Default, Clone, Copy)]
pub struct SharedStoreClients;

impl HttpConnector for SharedStoreClients {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        // `ClientOptions` has no Eq or Hash; its Debug shows every setting fastload can set.
        let key = format!("{options:?} {}", environment());
        shared(&STORE_CLIENTS, key, || {
            ReqwestConnector::default().connect(options)
        })
    }
}

/// The process's client for the Hub, built by `build` the first time (its settings are fixed).
pub fn hub_client<E>(
    build: impl FnOnce() -> Result<reqwest::Client, E>,
) -> Result<reqwest::Client, E> {
    shared(&HUB_CLIENTS, environment(), build)
}

/// The process's client for peers (source/peer.rs), built by `build` the first time.
pub fn peer_client<E>(
    build: impl FnOnce() -> Result<reqwest::Client, E>,
) -> Result<reqwest::Client, E> {
    shared(&HUB_CLIENTS, format!("peer {}", environment()), build)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_per_key_built_once() {
        static CACHE: PerProcess<HashMap<String, u32>> = PerProcess::new(HashMap::new);
        let mut builds = 0;
        let mut get = |key: &str| {
            shared(&CACHE, key.to_string(), || {
                builds += 1;
                Ok::<_, ()>(builds)
            })
            .unwrap()
        };
        assert_eq!((get("a"), get("a"), get("b"), get("a")), (1, 1, 2, 1));
        let failed = shared(&CACHE, "c".into(), || Err::<u32, _>("no"));
        assert_eq!(failed, Err("no"));
        assert!(
            !CACHE.lock().contains_key("c"),
            "a failed build is not kept"
        );
    }

    #[test]
    fn the_key_tells_configurations_apart() {
        let key = |o: &ClientOptions| format!("{o:?}");
        let a = ClientOptions::new().with_allow_http(true);
        assert_eq!(key(&a), key(&ClientOptions::new().with_allow_http(true)));
        assert_ne!(key(&a), key(&ClientOptions::new()));
        let b = ClientOptions::new().with_timeout(Duration::from_secs(7));
        assert_ne!(key(&b), key(&ClientOptions::new()));
        let proxy = ClientOptions::new().with_proxy_url("http://127.0.0.1:1");
        assert_ne!(key(&proxy), key(&ClientOptions::new()));
    }
}
