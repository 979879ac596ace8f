//! Engine metrics, rendered in the Prometheus text format by [`Metrics::render`].

use dsv4_backend::StepPath;
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

/// DSpark counters: verify rounds, drafted/accepted/skipped drafts, accepted drafts per slot
/// and the tokens committed per round (acceptance length).
pub struct SpecMetrics {
    pub rounds: AtomicU64,
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    pub skipped: AtomicU64,
    /// Per draft slot `k` (0-based, up to 16): rounds that verified and that accepted slot `k`.
    pub pos_drafted: [AtomicU64; 16],
    pub pos_accepted: [AtomicU64; 16],
    pub acceptance_length: Histogram,
}

const ACCEPT_BOUNDS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 12.0, 17.0];

impl Default for SpecMetrics {
    fn default() -> Self {
        SpecMetrics {
            rounds: AtomicU64::new(0),
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            pos_drafted: std::array::from_fn(|_| AtomicU64::new(0)),
            pos_accepted: std::array::from_fn(|_| AtomicU64::new(0)),
            acceptance_length: Histogram::new(ACCEPT_BOUNDS),
        }
    }
}

impl SpecMetrics {
    /// Adds what a sequence's statistics gained between `before` and `after` (one round).
    pub fn record(&self, before: &crate::speculative::SpecStats, after: &crate::speculative::SpecStats) {
        let add = |c: &AtomicU64, a: u64, b: u64| {
            if b > a {
                c.fetch_add(b - a, Ordering::Relaxed);
            }
        };
        add(&self.rounds, before.rounds, after.rounds);
        add(&self.drafted, before.drafted, after.drafted);
        add(&self.accepted, before.accepted, after.accepted);
        add(&self.skipped, before.skipped, after.skipped);
        for k in 0..after.pos_drafted.len().min(16) {
            add(&self.pos_drafted[k], before.pos_drafted.get(k).copied().unwrap_or(0), after.pos_drafted[k]);
            add(&self.pos_accepted[k], before.pos_accepted.get(k).copied().unwrap_or(0), after.pos_accepted[k]);
        }
        if after.rounds > before.rounds {
            self.acceptance_length.observe(1.0 + (after.accepted - before.accepted) as f64);
        }
    }

    fn render(&self, out: &mut String) {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut put = |name: &str, kind: &str, help: &str, v: String| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{v}"));
        };
        put(
            "dsv4_dspark_rounds_total",
            "counter",
            "DSpark verify rounds.",
            format!("dsv4_dspark_rounds_total {}\n", g(&self.rounds)),
        );
        put(
            "dsv4_dspark_drafted_tokens_total",
            "counter",
            "Draft tokens verified.",
            format!("dsv4_dspark_drafted_tokens_total {}\n", g(&self.drafted)),
        );
        put(
            "dsv4_dspark_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            format!("dsv4_dspark_accepted_tokens_total {}\n", g(&self.accepted)),
        );
        put(
            "dsv4_dspark_skipped_drafts_total",
            "counter",
            "Decode steps of speculating sequences that did not draft (policy, load, budget).",
            format!("dsv4_dspark_skipped_drafts_total {}\n", g(&self.skipped)),
        );
        let rounds = g(&self.rounds);
        let avg = if rounds == 0 { 0.0 } else { 1.0 + g(&self.accepted) as f64 / rounds as f64 };
        put(
            "dsv4_dspark_acceptance_length_avg",
            "gauge",
            "Tokens committed per verify round (accepted drafts + 1), since start.",
            format!("dsv4_dspark_acceptance_length_avg {avg}\n"),
        );
        let mut d = String::new();
        let mut a = String::new();
        for k in 0..16 {
            let n = g(&self.pos_drafted[k]);
            if n == 0 {
                continue;
            }
            d.push_str(&format!("dsv4_dspark_position_drafted_total{{position=\"{k}\"}} {n}\n"));
            a.push_str(&format!(
                "dsv4_dspark_position_accepted_total{{position=\"{k}\"}} {}\n",
                g(&self.pos_accepted[k])
            ));
        }
        put("dsv4_dspark_position_drafted_total", "counter", "Rounds that verified draft slot `position`.", d);
        put("dsv4_dspark_position_accepted_total", "counter", "Rounds that accepted draft slot `position`.", a);
        self.acceptance_length.render(
            "dsv4_dspark_acceptance_length",
            "Tokens committed per DSpark verify round.",
            out,
        );
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
    /// Nanoseconds inside the model's step (the forward and what crosses back to the host).
    pub forward_ns: AtomicU64,
    /// Nanoseconds inside the engine's step: planning, the forward, sampling and emission.
    /// Their difference is what the engine adds to the device's time.
    pub step_ns: AtomicU64,
    /// Parts of the step outside the forward, so a gap between the two can be named: planning
    /// (the drafter included), prefix-cache snapshots (device state copied to the host) and
    /// their number. Restores at admission run between steps (`restore_ns`).
    pub plan_ns: AtomicU64,
    pub snapshot_ns: AtomicU64,
    pub snapshots_total: AtomicU64,
    /// Nanoseconds finishing snapshots off the engine thread (waiting for a device copy and
    /// building the host state: crate::snapshots), beside the steps rather than inside them.
    pub snapshot_background_ns: AtomicU64,
    pub restore_ns: AtomicU64,
    /// By how the model ran the step ([`StepPath`], in its order): steps, forward nanoseconds,
    /// rows and prefill rows. A served forward slower than the bench's is then named: steps
    /// that carry prompts (more rows) or steps that ran eagerly or were being recorded.
    pub path_steps: [AtomicU64; 3],
    pub path_ns: [AtomicU64; 3],
    pub path_rows: [AtomicU64; 3],
    pub path_prefill_rows: [AtomicU64; 3],
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
    pub spec: SpecMetrics,
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
            forward_ns: AtomicU64::new(0),
            step_ns: AtomicU64::new(0),
            plan_ns: AtomicU64::new(0),
            snapshot_ns: AtomicU64::new(0),
            snapshots_total: AtomicU64::new(0),
            snapshot_background_ns: AtomicU64::new(0),
            restore_ns: AtomicU64::new(0),
            path_steps: Default::default(),
            path_ns: Default::default(),
            path_rows: Default::default(),
            path_prefill_rows: Default::default(),
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
            spec: SpecMetrics::default(),
            started: std::time::Instant::now(),
        }
    }
}

impl Metrics {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// Counts one model step that ran by `path` in `ns`, with `rows` rows of which `prefill`
    /// were prompt rows.
    pub fn record_path(&self, path: StepPath, ns: u64, rows: usize, prefill: usize) {
        let i = StepPath::ALL.iter().position(|&p| p == path).expect("every path is listed");
        self.path_steps[i].fetch_add(1, Ordering::Relaxed);
        self.path_ns[i].fetch_add(ns, Ordering::Relaxed);
        self.path_rows[i].fetch_add(rows as u64, Ordering::Relaxed);
        self.path_prefill_rows[i].fetch_add(prefill as u64, Ordering::Relaxed);
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
            "dsv4_engine_forward_seconds_total",
            "counter",
            "Time inside the model's forward steps.",
            g(&self.forward_ns) / 1e9,
        );
        gauge(
            "dsv4_engine_step_seconds_total",
            "counter",
            "Time inside engine steps (planning, forward, sampling, emission).",
            g(&self.step_ns) / 1e9,
        );
        gauge(
            "dsv4_engine_plan_seconds_total",
            "counter",
            "Time planning steps (inside engine steps; the drafter included).",
            g(&self.plan_ns) / 1e9,
        );
        gauge(
            "dsv4_engine_snapshot_seconds_total",
            "counter",
            "Time saving prefix-cache snapshots (inside engine steps).",
            g(&self.snapshot_ns) / 1e9,
        );
        gauge("dsv4_engine_snapshots_total", "counter", "Prefix-cache snapshots saved.", g(&self.snapshots_total));
        gauge(
            "dsv4_engine_snapshot_background_seconds_total",
            "counter",
            "Time finishing prefix-cache snapshots off the engine thread (beside the steps).",
            g(&self.snapshot_background_ns) / 1e9,
        );
        gauge(
            "dsv4_engine_restore_seconds_total",
            "counter",
            "Time restoring cached prefixes at admission (between engine steps).",
            g(&self.restore_ns) / 1e9,
        );
        let labelled: [(&str, &str, &[AtomicU64; 3], f64); 4] = [
            ("dsv4_engine_path_steps_total", "Model steps by how they ran.", &self.path_steps, 1.0),
            ("dsv4_engine_path_forward_seconds_total", "Forward time by how steps ran.", &self.path_ns, 1e-9),
            ("dsv4_engine_path_rows_total", "Rows of the steps by how they ran.", &self.path_rows, 1.0),
            (
                "dsv4_engine_path_prefill_rows_total",
                "Prompt rows of the steps by how they ran.",
                &self.path_prefill_rows,
                1.0,
            ),
        ];
        for (name, help, vals, scale) in labelled {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
            for (p, v) in StepPath::ALL.iter().zip(vals) {
                s.push_str(&format!("{name}{{path=\"{}\"}} {}\n", p.name(), g(v) * scale));
            }
        }
        let mut gauge = |name: &str, kind: &str, help: &str, v: f64| {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
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
        self.spec.render(&mut s);
        s
    }
}
