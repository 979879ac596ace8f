//! Defences against hostile clients: API-key checks, Host/Origin checks (DNS rebinding, web
//! pages posting to a loopback server), opt-in CORS, a connection cap with header and body read
//! timeouts, and tokenising bounded in size and concurrency off the async workers.

use crate::error::{ApiError, Flavor};
use crate::Shared;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Why the server refuses its configuration.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GuardError {
    #[error("the API key is empty: give a non-empty --api-key / DSV4_API_KEY, or none to turn auth off")]
    EmptyKey,
}

/// An API key given on the command line or in the environment: an empty one would let an empty
/// header in, so it is refused rather than taken as "auth on".
pub fn check_api_key(key: Option<String>) -> Result<Option<String>, GuardError> {
    match key {
        Some(k) if k.trim().is_empty() => Err(GuardError::EmptyKey),
        k => Ok(k),
    }
}

/// Compares in time that depends only on the lengths, not on where the bytes differ.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= (x ^ y) as u64;
    }
    std::hint::black_box(diff) == 0
}

/// The credential of `Authorization: <scheme> <token>` when the scheme is Bearer (any case).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(|c: char| c.is_ascii_whitespace())?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// True when `headers` carry `key` as a Bearer token or in `x-api-key`.
pub fn key_matches(headers: &HeaderMap, key: &str) -> bool {
    let x = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    // Both are compared (no early exit on the first), so timing does not say which one is set.
    let b = bearer(headers).is_some_and(|t| ct_eq(t.as_bytes(), key.as_bytes()));
    let x = x.is_some_and(|t| ct_eq(t.as_bytes(), key.as_bytes()));
    b | x
}

/// Warnings about how the server is bound (printed at startup).
pub fn bind_warnings(addr: &std::net::SocketAddr, has_key: bool) -> Vec<String> {
    let mut w = Vec::new();
    if !addr.ip().is_loopback() && !has_key {
        w.push(format!(
            "listening on {addr}, reachable from other machines, WITHOUT an API key: anyone who can \
             reach this port can use the model; set --api-key (or DSV4_API_KEY) or bind to 127.0.0.1"
        ));
    }
    w
}

/// Connection and request limits of the listener.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Open connections at most; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time to receive a request's headers (also the idle time of a kept-alive connection).
    pub header_timeout: Duration,
    /// Time to receive a request's body.
    pub body_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_connections: 512, header_timeout: Duration::from_secs(10), body_timeout: Duration::from_secs(30) }
    }
}

/// A counting semaphore for blocking sections (tokenising), waited on outside the async workers.
pub struct Permits {
    free: Mutex<usize>,
    cv: Condvar,
}

impl Permits {
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        {
            let mut n = self.free.lock().unwrap_or_else(|e| e.into_inner());
            while *n == 0 {
                n = self.cv.wait(n).unwrap_or_else(|e| e.into_inner());
            }
            *n -= 1;
        }
        struct Release<'a>(&'a Permits);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                *self.0.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                self.0.cv.notify_one();
            }
        }
        let _r = Release(self);
        f()
    }
}

/// The server's defences; [`Guard::default`] is a loopback server with the default limits.
pub struct Guard {
    /// Bound to a loopback address: `Host` must name this machine.
    pub loopback: bool,
    /// More `Host` names accepted on a loopback bind (lower case, without port).
    pub allowed_hosts: Vec<String>,
    /// Origins that get CORS headers and may call the API from a browser (`*`: any).
    pub cors_origins: Vec<String>,
    /// `/metrics` needs the API key too.
    pub metrics_auth: bool,
    pub limits: Limits,
    /// Longest text tokenised for a prompt, in bytes (see [`Guard::for_context`]).
    pub max_prompt_bytes: usize,
    /// Stop strings per request, and bytes per stop string, at most.
    pub max_stops: usize,
    pub max_stop_bytes: usize,
    /// How many prompts are tokenised at once (half the cores, one or two).
    pub tokenize: Arc<Permits>,
}

impl Default for Guard {
    fn default() -> Self {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Guard {
            loopback: true,
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            metrics_auth: false,
            limits: Limits::default(),
            max_prompt_bytes: 64 << 20,
            max_stops: 64,
            max_stop_bytes: 1024,
            // Tokenising takes ~150x the text in memory: two at a time bound the peak.
            tokenize: Arc::new(Permits { free: Mutex::new((n / 2).clamp(1, 2)), cv: Condvar::new() }),
        }
    }
}

impl Guard {
    /// The prompt text limit for `max_context` tokens: no token spans more than the longest
    /// vocabulary entry, so a text longer than `max_context` of those needs more than
    /// `max_context` tokens and would be refused after tokenising anyway.
    pub fn for_context(mut self, tok: &dsv4_tokenizer::Tokenizer, max_context: usize) -> Self {
        // Byte-level BPE entries spell one byte per character; added tokens are literal text.
        let hf = tok.hf();
        let bpe = hf.get_vocab(false).keys().map(|k| k.chars().count()).max().unwrap_or(1);
        let added = hf.get_added_tokens_decoder().values().map(|t| t.content.len()).max().unwrap_or(1);
        let longest = bpe.max(added).max(1);
        self.max_prompt_bytes = max_context.saturating_mul(longest);
        self
    }

    /// Tokenises on a blocking thread (never on an async worker), a few at a time, after the size
    /// check; the caller's task waits without holding up other requests.
    pub fn encode<T>(
        &self,
        bytes: usize,
        flavor: Flavor,
        f: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, ApiError> {
        if bytes > self.max_prompt_bytes {
            return Err(ApiError::bad(
                flavor,
                format!(
                    "the prompt text ({bytes} bytes) is longer than any prompt that fits the context \
                     ({} bytes at most)",
                    self.max_prompt_bytes
                ),
            ));
        }
        let permits = self.tokenize.clone();
        let run = move || permits.run(f);
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let r = if multi { tokio::task::block_in_place(run) } else { run() };
        r.map_err(|e| ApiError::bad(flavor, e))
    }

    /// Stop strings within the limits (matching them costs time per generated token).
    pub fn check_stops(&self, stops: &[String], flavor: Flavor) -> Result<(), ApiError> {
        if stops.len() > self.max_stops {
            return Err(ApiError::bad(
                flavor,
                format!("at most {} stop sequences, found {}", self.max_stops, stops.len()),
            )
            .param("stop"));
        }
        if let Some(s) = stops.iter().find(|s| s.len() > self.max_stop_bytes) {
            return Err(ApiError::bad(
                flavor,
                format!("stop sequences are at most {} bytes, found one of {}", self.max_stop_bytes, s.len()),
            )
            .param("stop"));
        }
        Ok(())
    }

    fn host_ok(&self, host: &str) -> bool {
        let h = host_name(host);
        is_local_name(&h) || self.allowed_hosts.iter().any(|a| a.eq_ignore_ascii_case(&h))
    }

    fn cors_allows(&self, origin: &str) -> bool {
        self.cors_origins.iter().any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
    }

    /// Whether a request carrying this `Origin` may be served.
    fn origin_ok(&self, origin: &str) -> bool {
        if self.cors_allows(origin) {
            return true;
        }
        // A page on this machine (http://localhost:3000) is as local as the client itself.
        match origin.split_once("://") {
            Some(("http" | "https", rest)) => is_local_name(&host_name(rest)),
            _ => false,
        }
    }
}

/// The host of a `Host` header or an origin's authority: lower case, without port or brackets.
fn host_name(h: &str) -> String {
    let h = h.trim().trim_end_matches('/');
    let name = if let Some(rest) = h.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        h.rsplit_once(':').map_or(h, |(n, p)| if p.chars().all(|c| c.is_ascii_digit()) { n } else { h })
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn is_local_name(h: &str) -> bool {
    h == "localhost" || h.ends_with(".localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// Refuses requests from web pages and rebound DNS names; answers CORS preflights of listed
/// origins and adds CORS headers to their responses. No CORS header is ever sent otherwise.
pub async fn check_request(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let g = &s.guard;
    let fl = flavor_of(req.uri().path());
    let forbid = |m: String| ApiError::new(StatusCode::FORBIDDEN, fl, m).into_response();
    if g.loopback {
        if let Some(host) = req.headers().get(header::HOST) {
            match host.to_str() {
                Ok(h) if g.host_ok(h) => {}
                _ => {
                    return forbid(format!(
                        "Host {host:?} is not this machine: a server on loopback only answers local names \
                         (add the name with --allowed-hosts)"
                    ))
                }
            }
        }
    }
    let origin = req.headers().get(header::ORIGIN).cloned();
    if let Some(o) = &origin {
        let ok = o.to_str().is_ok_and(|o| g.origin_ok(o));
        if !ok {
            return forbid(format!("requests from web origin {o:?} are refused (allow one with --cors-allow-origin)"));
        }
    }
    let cors = origin.filter(|o| o.to_str().is_ok_and(|o| g.cors_allows(o)));
    if req.method() == Method::OPTIONS {
        if let Some(o) = cors {
            return preflight(o);
        }
    }
    let mut resp = next.run(req).await;
    if let Some(o) = cors {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("*"));
    }
    resp
}

fn preflight(origin: HeaderValue) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("origin"));
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("authorization, content-type, x-api-key, anthropic-version, anthropic-beta"),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    r
}

/// Bytes of an over-limit body read and thrown away before the 413. A client that is still
/// sending when the server answers and closes gets a reset or a broken pipe instead of the
/// answer; reading the rest first (nginx's "lingering close") lets it see the 413. Bodies that
/// declare more than the limit plus this are refused at once.
const DRAIN_BYTES: u64 = 64 << 20;

enum BodyFault {
    TooLarge,
    Broken(String),
}

/// Reads a body within the size limit and the body timeout. An over-limit body is read to
/// its end (up to [`DRAIN_BYTES`] more) and discarded, then refused with a 413.
pub async fn read_body(s: &crate::AppState, body: Body, flavor: Flavor) -> Result<axum::body::Bytes, ApiError> {
    use axum::body::HttpBody;
    use futures_util::StreamExt;
    let limit = s.max_body;
    let declared = body.size_hint().lower();
    let read = async {
        if declared > limit as u64 + DRAIN_BYTES {
            return Err(BodyFault::TooLarge);
        }
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.min(limit as u64) as usize);
        let mut drained: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| BodyFault::Broken(e.to_string()))?;
            if drained == 0 && buf.len() + chunk.len() <= limit {
                buf.extend_from_slice(&chunk);
                continue;
            }
            if drained == 0 {
                buf = Vec::new();
            }
            drained += chunk.len() as u64;
            if drained > DRAIN_BYTES {
                break;
            }
        }
        if drained > 0 {
            Err(BodyFault::TooLarge)
        } else {
            Ok(axum::body::Bytes::from(buf))
        }
    };
    match tokio::time::timeout(s.guard.limits.body_timeout, read).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            flavor,
            format!("the request body did not arrive within {:?}", s.guard.limits.body_timeout),
        )),
        Ok(Err(BodyFault::TooLarge)) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            flavor,
            format!("request body exceeds the limit of {limit} bytes"),
        )),
        Ok(Err(BodyFault::Broken(e))) => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, flavor, format!("the request body could not be read: {e}")))
        }
        Ok(Ok(b)) => Ok(b),
    }
}

/// Serves `router` on `listener` until `shutdown` resolves: at most `max_connections` at once
/// (more get a 503 and are closed), headers within `header_timeout`. On shutdown, open
/// connections finish their requests (up to `drain`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let conns = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut refused: u64 = 0;
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!("connection limit ({}) reached: {refused} connections refused", limits.max_connections);
            }
            // Best effort, never waiting on the client.
            let _ = stream.try_write(
                b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        let mut stop = stop_rx.clone();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new()).header_read_timeout(header_timeout);
            let conn = b.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => { let _ = r; }
                _ = stopped(&mut stop) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
            drop(permit);
        });
    }
    let _ = stop_tx.send(true);
    // Every permit back means every connection closed.
    let all = limits.max_connections.max(1) as u32;
    let _ = tokio::time::timeout(drain, conns.acquire_many(all)).await;
    Ok(())
}

/// Resolves once the stop flag is set (or its sender is gone).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// Resolves on SIGINT (ctrl-c) or SIGTERM (what `kill`, systemd and containers send), or when
/// `dead` does (the engine stopped).
pub async fn shutdown_signal(dead: impl std::future::Future<Output = ()>) {
    let term = async {
        #[cfg(unix)]
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
        _ = term => tracing::info!("SIGTERM: stopping"),
        _ = dead => tracing::error!("the engine stopped: shutting the server down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(header::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn empty_keys_are_refused() {
        assert_eq!(check_api_key(Some(String::new())), Err(GuardError::EmptyKey));
        assert_eq!(check_api_key(Some("  ".into())), Err(GuardError::EmptyKey));
        assert_eq!(check_api_key(None), Ok(None));
        assert_eq!(check_api_key(Some("k".into())), Ok(Some("k".into())));
    }

    #[test]
    fn constant_time_compare_is_exact() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(!ct_eq(b"", b"x"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER k1", "bEaReR   k1 "] {
            assert!(key_matches(&headers(&[("authorization", v)]), "k1"), "{v}");
        }
        for v in ["Bearer", "Bearer ", "Basic k1", "Bearerk1", "Bearer k2"] {
            assert!(!key_matches(&headers(&[("authorization", v)]), "k1"), "{v}");
        }
        assert!(key_matches(&headers(&[("x-api-key", "k1")]), "k1"));
        assert!(!key_matches(&headers(&[("x-api-key", "")]), "k1"));
        assert!(!key_matches(&HeaderMap::new(), "k1"));
    }

    #[test]
    fn public_bind_without_key_warns() {
        let any: std::net::SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let lo: std::net::SocketAddr = "127.0.0.1:8000".parse().unwrap();
        assert_eq!(bind_warnings(&any, false).len(), 1);
        assert!(bind_warnings(&any, true).is_empty());
        assert!(bind_warnings(&lo, false).is_empty());
        assert_eq!(bind_warnings(&"[::]:1".parse().unwrap(), false).len(), 1);
    }

    #[test]
    fn local_hosts_and_origins() {
        let g = Guard { allowed_hosts: vec!["box.lan".into()], ..Guard::default() };
        for h in
            ["localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "127.0.0.2", "api.localhost", "BOX.lan:1"]
        {
            assert!(g.host_ok(h), "{h}");
        }
        for h in ["evil.com", "evil.com:8000", "127.0.0.1.evil.com", "10.0.0.1:8000", "localhost.evil.com"] {
            assert!(!g.host_ok(h), "{h}");
        }
        assert!(g.origin_ok("http://localhost:3000"));
        assert!(g.origin_ok("http://127.0.0.1:8000"));
        assert!(!g.origin_ok("https://evil.com"));
        assert!(!g.origin_ok("null"));
        assert!(!g.origin_ok("file://"));
        let c = Guard { cors_origins: vec!["https://app.example".into()], ..Guard::default() };
        assert!(c.origin_ok("https://app.example") && c.cors_allows("https://APP.example"));
        assert!(!c.cors_allows("http://localhost:3000"));
    }

    #[test]
    fn stop_limits() {
        let g = Guard::default();
        assert!(g.check_stops(&["a".repeat(1024)], Flavor::OpenAi).is_ok());
        assert!(g.check_stops(&["a".repeat(1025)], Flavor::OpenAi).is_err());
        assert!(g.check_stops(&vec!["x".to_string(); 65], Flavor::OpenAi).is_err());
    }
}
