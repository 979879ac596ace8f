//! What operators see: one log line per request (id, endpoint, status, tokens, time to first
//! token, duration), HTTP requests by endpoint and status in `/metrics`, and `x-request-id`
//! taken from the client (or made up) and returned.

use crate::Shared;
use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Requests by (endpoint, status).
#[derive(Default)]
pub struct HttpMetrics {
    counts: Mutex<BTreeMap<(String, u16), u64>>,
}

impl HttpMetrics {
    pub fn inc(&self, endpoint: &str, status: u16) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *c.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    /// Appends the Prometheus lines.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        out.push_str("# HELP dsv4_http_requests_total HTTP requests by endpoint and status\n");
        out.push_str("# TYPE dsv4_http_requests_total counter\n");
        for ((e, st), n) in self.counts.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "dsv4_http_requests_total{{endpoint=\"{e}\",status=\"{st}\"}} {n}");
        }
    }
}

/// Token counts of one HTTP request, filled by the generation(s) it runs.
#[derive(Clone, Default)]
pub struct ReqStats(Arc<Mutex<StatsInner>>);

#[derive(Default)]
struct StatsInner {
    prompt: usize,
    cached: usize,
    completion: usize,
    first_token: Option<Instant>,
}

impl ReqStats {
    /// The stats of the request being handled on this task, if any.
    pub fn current() -> Option<ReqStats> {
        STATS.try_with(|s| s.clone()).ok()
    }
    pub fn first_token(&self) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.first_token.get_or_insert_with(Instant::now);
    }
    /// Adds one finished generation's usage (n > 1 runs several).
    pub fn add(&self, prompt: usize, cached: usize, completion: usize) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.prompt += prompt;
        g.cached += cached;
        g.completion += completion;
    }
}

tokio::task_local! {
    static STATS: ReqStats;
}

/// Logs the request's line when its response body is done (or dropped by a client that left).
struct LogOnDrop {
    rid: String,
    method: String,
    endpoint: String,
    status: u16,
    start: Instant,
    stats: ReqStats,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let g = self.stats.0.lock().unwrap_or_else(|p| p.into_inner());
        let ms = |d: Duration| (d.as_secs_f64() * 1e3).round() as u64;
        let ttft = g.first_token.map(|t| ms(t.duration_since(self.start)).to_string()).unwrap_or_else(|| "-".into());
        tracing::info!(
            target: "dsv4::request",
            "request {} {} {} status={} prompt={} cached={} completion={} ttft_ms={} duration_ms={}",
            self.rid,
            self.method,
            self.endpoint,
            self.status,
            g.prompt,
            g.cached,
            g.completion,
            ttft,
            ms(self.start.elapsed())
        );
    }
}

/// A short random id for requests that bring none.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// The middleware: request id in and out, per-endpoint counters, the log line.
pub async fn track(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let endpoint =
        req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let rid = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 200)
        .map(str::to_string)
        .unwrap_or_else(|| format!("req_{:016x}", random_u64()));
    let stats = ReqStats::default();
    let mut resp = STATS.scope(stats.clone(), next.run(req)).await;
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    let status = resp.status().as_u16();
    s.live.http.inc(&endpoint, status);
    // Health checks and scrapes are counted, not logged.
    if matches!(endpoint.as_str(), "/health" | "/metrics") {
        return resp;
    }
    let guard = LogOnDrop { rid, method, endpoint, status, start, stats };
    // A complete body is logged now and keeps its Content-Length; only a stream is wrapped, so
    // that its line is written when the stream ends.
    let streaming = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !streaming {
        drop(guard);
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _ = &guard;
        chunk
    }));
    Response::from_parts(parts, body)
}
