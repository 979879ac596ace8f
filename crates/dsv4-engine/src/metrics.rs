//! Engine metrics, rendered in the Prometheus text format by [`Metrics::render`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }
    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                g.0[i] += 1;
            }
        }
        g.1 += v;
        g.2 += 1;
    }
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (b, c) in self.bounds.iter().zip(&g.0) {
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {c}\n"));
        }
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n", g.2, g.1, g.2));
    }
}

const LATENCY_BOUNDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Counters and gauges the engine thread updates and the server reads.
pub struct Metrics {
    pub requests_total: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    pub pool_capacity: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub steps_total: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_misses: AtomicU64,
    pub prefix_tokens_reused: AtomicU64,
    pub prefix_cache_bytes: AtomicU64,
    pub prefix_cache_entries: AtomicU64,
    pub disk_cache_bytes: AtomicU64,
    pub disk_cache_files: AtomicU64,
    pub disk_cache_writes: AtomicU64,
    pub disk_cache_rejected: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    started: std::time::Instant,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests_total: AtomicU64::new(0),
            requests_rejected: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            queue_depth: AtomicU64::new(0),
            running: AtomicU64::new(0),
            pool_capacity: AtomicU64::new(0),
            prompt_tokens_total: AtomicU64::new(0),
            generated_tokens_total: AtomicU64::new(0),
            steps_total: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_misses: AtomicU64::new(0),
            prefix_tokens_reused: AtomicU64::new(0),
            prefix_cache_bytes: AtomicU64::new(0),
            prefix_cache_entries: AtomicU64::new(0),
            disk_cache_bytes: AtomicU64::new(0),
            disk_cache_files: AtomicU64::new(0),
            disk_cache_writes: AtomicU64::new(0),
            disk_cache_rejected: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BOUNDS),
            itl: Histogram::new(LATENCY_BOUNDS),
            started: std::time::Instant::now(),
        }
    }
}

impl Metrics {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut gauge = |name: &str, kind: &str, help: &str, v: f64| {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        gauge("dsv4_requests_total", "counter", "Requests admitted.", g(&self.requests_total));
        gauge("dsv4_requests_rejected_total", "counter", "Requests refused at admission.", g(&self.requests_rejected));
        gauge("dsv4_requests_cancelled_total", "counter", "Requests cancelled.", g(&self.requests_cancelled));
        gauge("dsv4_queue_depth", "gauge", "Requests waiting for a sequence slot.", g(&self.queue_depth));
        gauge("dsv4_running_sequences", "gauge", "Sequences holding a slot.", g(&self.running));
        gauge("dsv4_pool_capacity", "gauge", "Sequence slots in the state pool.", g(&self.pool_capacity));
        let cap = g(&self.pool_capacity).max(1.0);
        gauge("dsv4_pool_usage_ratio", "gauge", "Fraction of sequence slots in use.", g(&self.running) / cap);
        gauge("dsv4_prompt_tokens_total", "counter", "Prompt tokens prefilled.", g(&self.prompt_tokens_total));
        gauge("dsv4_generated_tokens_total", "counter", "Tokens generated.", g(&self.generated_tokens_total));
        gauge("dsv4_engine_steps_total", "counter", "Forward steps run.", g(&self.steps_total));
        gauge(
            "dsv4_prefix_cache_hits_total",
            "counter",
            "Requests that restored a cached prefix.",
            g(&self.prefix_hits),
        );
        gauge(
            "dsv4_prefix_cache_misses_total",
            "counter",
            "Requests that found no cached prefix.",
            g(&self.prefix_misses),
        );
        gauge(
            "dsv4_prefix_cache_tokens_reused_total",
            "counter",
            "Prompt tokens restored instead of prefilled.",
            g(&self.prefix_tokens_reused),
        );
        gauge("dsv4_prefix_cache_bytes", "gauge", "Bytes of snapshots in memory.", g(&self.prefix_cache_bytes));
        gauge("dsv4_prefix_cache_entries", "gauge", "Snapshots in memory.", g(&self.prefix_cache_entries));
        gauge("dsv4_kv_disk_bytes", "gauge", "Bytes of snapshots on disk.", g(&self.disk_cache_bytes));
        gauge("dsv4_kv_disk_files", "gauge", "Snapshot files on disk.", g(&self.disk_cache_files));
        gauge("dsv4_kv_disk_writes_total", "counter", "Snapshot files written.", g(&self.disk_cache_writes));
        gauge(
            "dsv4_kv_disk_rejected_total",
            "counter",
            "Snapshot files ignored as invalid.",
            g(&self.disk_cache_rejected),
        );
        let up = self.started.elapsed().as_secs_f64().max(1e-9);
        gauge(
            "dsv4_generated_tokens_per_second",
            "gauge",
            "Generated tokens per second since start.",
            g(&self.generated_tokens_total) / up,
        );
        self.ttft.render("dsv4_time_to_first_token_seconds", "Time to first token.", &mut s);
        self.itl.render("dsv4_inter_token_latency_seconds", "Time between tokens of a sequence.", &mut s);
        s
    }
}
