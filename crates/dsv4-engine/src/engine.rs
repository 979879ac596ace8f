//! The continuous-batching engine: one thread owns the model; requests are admitted and retired
//! between steps; each step is one forward over decode rows of running sequences plus prefill
//! chunks of new ones, under a token budget.

use crate::metrics::Metrics;
use crate::prefix_cache::{PrefixCache, PrefixCacheConfig};
use crate::sampler::{argmax_margin, Sampler};
use crate::sequence::{CancelToken, Event, FinishReason, Request, Sequence, TokenEvent};
use crate::snapshots::SnapshotWorker;
use crate::speculative::{Planned, SpecConfig, SpecSeq, Verdict};
use dsv4_backend::draw::DRAW_MAX_SAMPLED_COLS;
use dsv4_backend::{Backend, Batch, Draw, Model, Outputs, Row, Snapshot, StepPlan};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per step (decode rows + prefill chunks).
    pub token_budget: usize,
    /// Longest prefill chunk of one sequence in one step.
    pub prefill_chunk: usize,
    /// Requests allowed to wait for a slot before new ones are refused.
    pub max_waiting: usize,
    /// Longest sequence (prompt + max_tokens) accepted.
    pub max_context: usize,
    /// Reuse of earlier sequences' states (None: off).
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// DSpark speculative decoding (None: off): decoding sequences draft a block and verify it
    /// inside the step's batch.
    pub dspark: Option<SpecConfig>,
    /// Sample every sampled row on the host from its logits instead of where the logits are
    /// (the A/B of the device draws; the tokens agree but within ~2e-6 of a boundary). `spawn`
    /// turns it on for a vocabulary wider than the device draw samples (2^17 tokens).
    pub host_sampling: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            token_budget: 512,
            prefill_chunk: 256,
            max_waiting: 256,
            max_context: 65536,
            prefix_cache: None,
            dspark: None,
            host_sampling: false,
        }
    }
}

/// Why a request was refused at the door.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoTokens,
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context limit of {limit} tokens")]
    ContextTooLong { prompt: usize, max_tokens: usize, limit: usize },
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    BadToken { token: u32, vocab: usize },
    #[error("the server is at capacity ({waiting} requests waiting); retry later")]
    QueueFull { waiting: usize },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// A submitted request's stream of events and its cancel switch.
pub struct Submission {
    pub id: u64,
    pub events: UnboundedReceiver<Event>,
    pub cancel: CancelToken,
    /// Prompt tokens restored from the prefix cache, once the sequence is admitted.
    pub cached: Arc<std::sync::OnceLock<usize>>,
}

/// Cheap to clone; talks to the engine thread.
/// What the engine thread receives.
enum Msg {
    Seq(Box<Sequence>),
    /// Write the prefix cache to disk, answer, and stop.
    Shutdown(Sender<()>),
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Msg>,
    next_id: Arc<AtomicU64>,
    /// False once the engine thread has ended (stopped, or died of a panic outside a step).
    alive: Arc<AtomicBool>,
    /// Requests queued for a slot: counted when accepted, uncounted when the engine admits or
    /// drops them (the `queue_depth` gauge is only refreshed between steps).
    waiting: Arc<AtomicU64>,
    pub metrics: Arc<Metrics>,
    pub config: EngineConfig,
    pub vocab_size: usize,
    pub eos_ids: Vec<u32>,
}

impl EngineHandle {
    /// Checks a request and queues it; refusals are typed so the server can map them to 4xx/5xx.
    pub fn submit(&self, req: Request) -> Result<Submission, AdmitError> {
        let m = &self.metrics;
        let refuse = |e: AdmitError| {
            m.requests_rejected.fetch_add(1, Ordering::Relaxed);
            Err(e)
        };
        if req.prompt.is_empty() {
            return refuse(AdmitError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return refuse(AdmitError::NoTokens);
        }
        if let Some(&token) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return refuse(AdmitError::BadToken { token, vocab: self.vocab_size });
        }
        if req.prompt.len() + req.max_tokens > self.config.max_context {
            return refuse(AdmitError::ContextTooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit: self.config.max_context,
            });
        }
        let sampler = match Sampler::new(req.sampling.clone()) {
            Ok(s) => s,
            Err(e) => return refuse(AdmitError::Sampling(e.to_string())),
        };
        // Take a place in the queue atomically: concurrent submits never overshoot the limit.
        let max = self.config.max_waiting as u64;
        if let Err(waiting) =
            self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| (w < max).then_some(w + 1))
        {
            return refuse(AdmitError::QueueFull { waiting: waiting as usize });
        }
        let processor = req.logits.start(&req.prompt);
        let (etx, erx) = unbounded_channel();
        let cancel = CancelToken::default();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let seq = Sequence {
            id,
            req,
            sampler,
            slot: None,
            prefilled: 0,
            generated: Vec::new(),
            events: etx,
            cancel: cancel.clone(),
            arrived: Instant::now(),
            last_token_at: None,
            cached: 0,
            spec: None,
            admitted: Arc::new(std::sync::OnceLock::new()),
            processor,
        };
        let cached = seq.admitted.clone();
        m.queue_depth.fetch_add(1, Ordering::Relaxed);
        m.requests_total.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Msg::Seq(Box::new(seq))).is_err() {
            m.queue_depth.fetch_sub(1, Ordering::Relaxed);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(AdmitError::Stopped);
        }
        Ok(Submission { id, events: erx, cancel, cached })
    }

    /// Whether the engine thread still runs.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Persists the prefix cache and stops the engine; waits up to `timeout`.
    pub fn shutdown(&self, timeout: std::time::Duration) {
        let (tx, rx) = channel();
        if self.tx.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.recv_timeout(timeout);
        }
    }
}

/// A stand-in engine for tests of the layers above: every request streams `script` (stopping
/// after a stop id, or at `max_tokens`), whatever its prompt. No model is involved.
pub fn scripted(vocab_size: usize, eos_ids: Vec<u32>, script: Vec<u32>) -> EngineHandle {
    let (tx, rx) = channel::<Msg>();
    let metrics = Arc::new(Metrics::default());
    let alive = Arc::new(AtomicBool::new(true));
    let waiting = Arc::new(AtomicU64::new(0));
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        alive: alive.clone(),
        waiting: waiting.clone(),
        metrics: metrics.clone(),
        vocab_size,
        eos_ids,
        config: EngineConfig::default(),
    };
    std::thread::spawn(move || {
        let _alive = AliveGuard(alive);
        while let Ok(m) = rx.recv() {
            let s = match m {
                Msg::Seq(s) => s,
                Msg::Shutdown(r) => {
                    let _ = r.send(());
                    return;
                }
            };
            metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            waiting.fetch_sub(1, Ordering::AcqRel);
            let _ = s.admitted.set(0);
            let mut n = 0;
            let mut reason = FinishReason::Length;
            for &id in script.iter().take(s.req.max_tokens) {
                n += 1;
                let _ = s.events.send(Event::Token(TokenEvent { id, logprob: None, top: Vec::new() }));
                if s.req.stop_ids.contains(&id) {
                    reason = FinishReason::Stop;
                    break;
                }
            }
            if n < s.req.max_tokens && reason == FinishReason::Length {
                reason = FinishReason::Stop;
            }
            let _ = s.events.send(Event::Done {
                reason,
                prompt_tokens: s.req.prompt.len(),
                completion_tokens: n,
                cached_tokens: 0,
            });
        }
    });
    handle
}

/// Starts the engine thread; it runs until every handle is dropped.
pub fn spawn<B>(model: Model<B>, mut config: EngineConfig, max_seqs: usize) -> EngineHandle
where
    B: Backend + 'static,
    Model<B>: Send,
{
    // Positions beyond the model's limit would fail in the forward: refuse them at the door.
    config.max_context = config.max_context.min(model.cfg.max_position);
    // The device draw's weight sums hold 2^17 tokens a row: a wider vocabulary samples on the host.
    let vocab = model.cfg.vocab_size;
    if !config.host_sampling && vocab > DRAW_MAX_SAMPLED_COLS {
        tracing::info!(
            vocab,
            "sampling on the host: the device draw samples rows of at most {DRAW_MAX_SAMPLED_COLS} tokens"
        );
        config.host_sampling = true;
    }
    let (tx, rx) = channel();
    let metrics = Arc::new(Metrics::default());
    metrics.pool_capacity.store(max_seqs as u64, Ordering::Relaxed);
    let prefix = config.prefix_cache.clone().map(|pc| PrefixCache::new(pc, &model.cfg));
    let alive = Arc::new(AtomicBool::new(true));
    let queued = Arc::new(AtomicU64::new(0));
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        alive: alive.clone(),
        waiting: queued.clone(),
        metrics: metrics.clone(),
        vocab_size: model.cfg.vocab_size,
        eos_ids: model.cfg.eos_token_ids.clone(),
        config: config.clone(),
    };
    std::thread::Builder::new()
        .name("dsv4-engine".into())
        .spawn(move || {
            let _alive = AliveGuard(alive);
            let waiting = VecDeque::new();
            let snapshots = SnapshotWorker::default();
            Engine { model, config, rx, waiting, running: Vec::new(), metrics, prefix, queued, max_seqs, snapshots }
                .run()
        })
        .expect("spawning the engine thread");
    handle
}

/// Marks the engine dead when its thread ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The message of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into())
}

struct Engine<B: Backend> {
    model: Model<B>,
    config: EngineConfig,
    prefix: Option<PrefixCache>,
    rx: Receiver<Msg>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    metrics: Arc<Metrics>,
    /// The handle's count of queued requests (see [`EngineHandle::submit`]).
    queued: Arc<AtomicU64>,
    max_seqs: usize,
    /// Prefix-cache snapshots being finished off this thread.
    snapshots: SnapshotWorker,
}

/// Where logits rows of the step go.
struct Out {
    seq: usize,
    /// The row completes the prompt (first token) rather than continuing decode.
    first: bool,
    /// First batch row of the sequence's decode/verify rows (the captured hidden rows).
    row0: usize,
    /// A speculative round: the verify rows `[anchor, d..]` (one logits row each).
    plan: Option<Planned>,
}

/// A prefill chunk of the step (its captured rows go to the drafter ring).
struct Chunk {
    seq: usize,
    row0: usize,
    pos0: usize,
    len: usize,
}

impl<B: Backend> Engine<B> {
    fn run(mut self) {
        loop {
            // Block only when idle (every snapshot cached first); otherwise take whatever has
            // arrived.
            if self.waiting.is_empty() && self.running.is_empty() {
                self.collect_snapshots(true);
                match self.rx.recv() {
                    Ok(m) => {
                        if self.receive(m) {
                            return;
                        }
                    }
                    Err(_) => return self.stop(None),
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(m) => {
                        if self.receive(m) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.waiting.is_empty() && self.running.is_empty() {
                            return self.stop(None);
                        }
                        break;
                    }
                }
            }
            // A panic inside a step (a backend bug, a state that does not fit) fails the
            // requests of that step; the engine goes on with the others.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.collect_snapshots(false);
                self.drop_cancelled();
                self.admit();
                self.step();
            }));
            if let Err(p) = r {
                self.recover(&panic_message(p.as_ref()));
            }
            self.publish();
        }
    }

    /// After a panic: every running sequence's state is suspect, so they all fail (with a clear
    /// error, not a dropped stream) and every slot is freed; waiting requests stay queued.
    fn recover(&mut self, msg: &str) {
        tracing::error!("engine step panicked: {msg}; failing its {} running requests", self.running.len());
        for s in std::mem::take(&mut self.running) {
            let _ = s.events.send(Event::Error("internal error in the engine; the request was aborted".into()));
        }
        for slot in 0..self.max_seqs {
            self.model.free_seq(slot);
        }
    }

    /// Handles one message; true when the engine must stop.
    fn receive(&mut self, m: Msg) -> bool {
        match m {
            Msg::Seq(s) => {
                self.waiting.push_back(*s);
                false
            }
            Msg::Shutdown(reply) => {
                self.stop(Some(reply));
                true
            }
        }
    }

    fn stop(&mut self, reply: Option<Sender<()>>) {
        self.collect_snapshots(true);
        if let Some(pc) = &mut self.prefix {
            pc.persist_all();
        }
        self.publish();
        if let Some(r) = reply {
            let _ = r.send(());
        }
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.queue_depth.store(self.waiting.len() as u64, Ordering::Relaxed);
        m.running.store(self.running.len() as u64, Ordering::Relaxed);
        if let Some(pc) = &self.prefix {
            m.prefix_cache_bytes.store(pc.memory_bytes() as u64, Ordering::Relaxed);
            m.prefix_cache_entries.store(pc.len() as u64, Ordering::Relaxed);
            if let Some(d) = &pc.disk {
                m.disk_cache_bytes.store(d.bytes(), Ordering::Relaxed);
                m.disk_cache_files.store(d.files() as u64, Ordering::Relaxed);
                m.disk_cache_writes.store(d.writes, Ordering::Relaxed);
                m.disk_cache_rejected.store(d.rejected, Ordering::Relaxed);
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancel.is_cancelled() || self.waiting[i].events.is_closed() {
                let s = self.waiting.remove(i).expect("index in range");
                self.queued.fetch_sub(1, Ordering::AcqRel);
                self.finish(s, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancel.is_cancelled() || self.running[i].events.is_closed() {
                let s = self.running.remove(i);
                self.finish(s, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
    }

    fn admit(&mut self) {
        while !self.waiting.is_empty() {
            match self.model.alloc_seq() {
                Ok(slot) => {
                    let mut s = self.waiting.pop_front().expect("not empty");
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    s.slot = Some(slot);
                    if let Some(sc) = &self.config.dspark {
                        // Rows with a host pass (grammar, penalties) decode plainly.
                        if sc.applies(s.sampler.params.temperature) && s.processor.is_none() {
                            s.spec = Some(SpecSeq::new(sc, s.sampler.params.seed));
                        }
                    }
                    if let Some(pc) = &mut self.prefix {
                        let t0 = Instant::now();
                        let restored = pc.lookup(&s.req.prompt).filter(|hit| self.model.restore(slot, &hit.snap));
                        self.metrics.restore_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        match restored {
                            Some(hit) => {
                                s.prefilled = hit.len;
                                s.cached = hit.len;
                                self.metrics.prefix_hits.fetch_add(1, Ordering::Relaxed);
                                self.metrics.prefix_tokens_reused.fetch_add(hit.len as u64, Ordering::Relaxed);
                            }
                            _ => {
                                self.metrics.prefix_misses.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    let _ = s.admitted.set(s.cached);
                    self.running.push(s);
                }
                Err(_) => break, // pool full: wait for a slot to be freed
            }
        }
    }

    /// Frees the sequence's slot and tells the client.
    fn finish(&mut self, s: Sequence, reason: FinishReason) {
        if let Some(slot) = s.slot {
            // The state holds the prompt and every generated token but the last: a later turn
            // that repeats them (an agent resending the conversation) starts from here.
            if reason != FinishReason::Cancelled && s.generated.len() > 1 && s.prefill_done() {
                let mut toks = s.req.prompt.clone();
                toks.extend_from_slice(&s.generated[..s.generated.len() - 1]);
                self.save_prefix(slot, &toks, false);
            }
            self.model.free_seq(slot);
        }
        if reason == FinishReason::Cancelled {
            self.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
        }
        let _ = s.events.send(Event::Done {
            reason,
            prompt_tokens: s.req.prompt.len(),
            completion_tokens: s.generated.len(),
            cached_tokens: s.cached,
        });
    }

    fn fail(&mut self, s: Sequence, msg: String) {
        tracing::error!(id = s.id, "{msg}");
        if let Some(slot) = s.slot {
            self.model.free_seq(slot);
        }
        let _ = s.events.send(Event::Error(msg));
    }

    /// Where the sequence's prefill should pause for a snapshot: the positions the request asked
    /// for (e.g. before a chat prompt's trailing thinking marker, which the next turn renders
    /// differently) and multiples of the cache interval.
    fn next_snapshot_point(&self, s: &Sequence) -> Option<usize> {
        let pc = self.prefix.as_ref()?;
        let after = s.prefilled;
        let end = s.req.prompt.len();
        let mut best = s.req.snapshot_at.iter().copied().filter(|&p| p > after && p < end).min();
        if pc.interval() > 0 {
            let k = (after / pc.interval() + 1) * pc.interval();
            if k < end {
                best = Some(best.map_or(k, |b| b.min(k)));
            }
        }
        best
    }

    fn is_snapshot_point(&self, s: &Sequence, p: usize) -> bool {
        let Some(pc) = &self.prefix else { return false };
        p == s.req.prompt.len()
            || s.req.snapshot_at.contains(&p)
            || (pc.interval() > 0 && p.is_multiple_of(pc.interval()))
    }

    /// Caches the slot's state under `tokens`; `persist` also writes it to the disk cache now
    /// (interval snapshots of long prompts, so a crash mid-prefill loses little). A device
    /// backend's copy is only queued here (behind the step that produced the state) and
    /// finished off this thread; the engine caches it between later steps
    /// ([`Engine::collect_snapshots`]).
    fn save_prefix(&mut self, slot: usize, tokens: &[u32], persist: bool) {
        if self.prefix.is_none() {
            return;
        }
        let t0 = Instant::now();
        if let Some(p) = self.model.snapshot_deferred(slot) {
            debug_assert_eq!(p.len, tokens.len());
            if p.is_ready() {
                self.cache_snapshot(tokens, persist, p.wait());
            } else {
                self.snapshots.submit(tokens.to_vec(), persist, p);
            }
        }
        self.metrics.snapshot_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.metrics.snapshots_total.fetch_add(1, Ordering::Relaxed);
    }

    fn cache_snapshot(&mut self, tokens: &[u32], persist: bool, snap: Snapshot) {
        if let Some(pc) = &mut self.prefix {
            if persist {
                pc.persist(tokens, &snap);
            }
            pc.insert(tokens, snap);
        }
    }

    /// Caches the snapshots finished off the engine thread: those done so far, or with `wait`
    /// every outstanding one (before the engine idles or stops, so none is left behind).
    fn collect_snapshots(&mut self, wait: bool) {
        if self.snapshots.outstanding() == 0 {
            return;
        }
        let done = if wait { self.snapshots.collect_all() } else { self.snapshots.collect() };
        for f in done {
            self.metrics.snapshot_background_ns.fetch_add(f.took.as_nanos() as u64, Ordering::Relaxed);
            if let Some(snap) = f.snap {
                self.cache_snapshot(&f.tokens, f.persist, snap);
            }
        }
    }

    /// Builds one batch: the decode rows of each running sequence that has a token to feed (with
    /// DSpark, its anchor plus a drafted block), then prefill chunks in arrival order while the
    /// budget lasts. The drafter runs here, only for sequences past their prompt.
    fn plan(&mut self) -> (Vec<Row>, Vec<usize>, Vec<Out>, Vec<Chunk>) {
        let (mut rows, mut out_rows, mut outs, mut chunks) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut budget = self.config.token_budget.max(1);
        let decoding = self.running.iter().filter(|s| s.prefill_done() && !s.generated.is_empty()).count().min(budget);
        // Draft tokens may use what one row per decoding sequence leaves of the budget.
        let mut draft_room = budget - decoding;
        let max_pos = self.model.cfg.max_position;
        // Pass 1: which sequences decode this step and how many drafts each verifies (their
        // budget is reserved in order). Pass 2 drafts them all in one proposer call (a GPU
        // drafter runs the greedy ones as one batched forward).
        let mut decode: Vec<(usize, u32, usize, usize, usize)> = Vec::new(); // (seq, token, slot, pos, l)
        let mut speculating = Vec::new(); // whether the sequence has a DSpark state
        for i in 0..self.running.len() {
            let s = &mut self.running[i];
            if !(s.prefill_done() && !s.generated.is_empty() && budget > 0) {
                continue;
            }
            let token = *s.generated.last().expect("non-empty");
            let (slot, pos) = (s.slot.expect("admitted"), s.len());
            let mut l = 0;
            let spec = matches!((&self.config.dspark, s.spec.as_ref()), (Some(_), Some(_)));
            if let (Some(sc), Some(st)) = (&self.config.dspark, s.spec.as_mut()) {
                let backoff = sc.policy.max_decode_batch > 0 && decoding >= sc.policy.max_decode_batch;
                let remaining = s.req.max_tokens - s.generated.len();
                let limit = if backoff {
                    0
                } else {
                    draft_room.min(remaining.saturating_sub(1)).min(max_pos.saturating_sub(pos + 1))
                };
                let before = st.stats.clone();
                l = st.plan_len(sc, pos, limit, &s.sampler);
                self.metrics.spec.record(&before, &st.stats);
            }
            draft_room -= l;
            budget -= 1 + l;
            decode.push((i, token, slot, pos, l));
            speculating.push(spec);
        }
        let mut drafted: Vec<Option<Result<dsv4_dspark::Draft, dsv4_dspark::DsparkError>>> =
            decode.iter().map(|_| None).collect();
        if let Some(sc) = &self.config.dspark {
            let want: Vec<bool> = decode.iter().map(|d| d.4 > 0).collect();
            let mut jobs = Vec::new();
            let mut wi = want.iter();
            for (i, s) in self.running.iter_mut().enumerate() {
                let Some(&(_, token, _, pos, _)) = decode.iter().find(|d| d.0 == i) else { continue };
                if !*wi.next().expect("one flag per decoding sequence") {
                    continue;
                }
                // Greedy drafts at every temperature: sampled sequences verify target-only
                // (their drafts' distributions are not needed; the drafter batches greedy jobs).
                jobs.push(s.spec.as_mut().expect("drafting needs a DSpark state").job(token, pos, 0.0));
            }
            let mut results = sc.proposer.draft_many(&mut jobs).into_iter();
            drop(jobs);
            for (k, w) in want.iter().enumerate() {
                if *w {
                    drafted[k] = results.next();
                }
            }
        }
        for (k, &(i, token, slot, pos, l)) in decode.iter().enumerate() {
            let s = &self.running[i];
            let row0 = rows.len();
            let plan = if !speculating[k] {
                None
            } else if l == 0 {
                Some(Planned::forced(token, pos, Vec::new()))
            } else {
                match drafted[k].take().expect("a draft per job") {
                    Ok(d) => Some(SpecSeq::planned(token, pos, l, 0.0, d)),
                    Err(e) => {
                        // Decode plainly this step (the row still enters the ring).
                        tracing::warn!(id = s.id, "drafting failed, decoding plainly: {e}");
                        Some(Planned::forced(token, pos, Vec::new()))
                    }
                }
            };
            // Sampled rounds verify target-only: every verify row draws the token of its next
            // position as a plain run would, so the tokens are the plain run's.
            let sampled = s.sampler.params.temperature != 0.0;
            let plan = plan.map(|p| if sampled { p.target_only() } else { p });
            match plan {
                Some(p) => {
                    for (k, &t) in p.tokens().iter().enumerate() {
                        out_rows.push(rows.len());
                        rows.push(Row { seq: slot, pos: pos + k, token: t });
                    }
                    outs.push(Out { seq: i, first: false, row0, plan: Some(p) });
                }
                None => {
                    out_rows.push(rows.len());
                    rows.push(Row { seq: slot, pos, token });
                    outs.push(Out { seq: i, first: false, row0, plan: None });
                }
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if s.prefill_done() {
                continue;
            }
            let mut n = (s.req.prompt.len() - s.prefilled).min(budget).min(self.config.prefill_chunk.max(1));
            if let Some(p) = self.next_snapshot_point(s) {
                n = n.min(p - s.prefilled);
            }
            let row0 = rows.len();
            for k in 0..n {
                let p = s.prefilled + k;
                rows.push(Row { seq: s.slot.expect("admitted"), pos: p, token: s.req.prompt[p] });
            }
            chunks.push(Chunk { seq: i, row0, pos0: s.prefilled, len: n });
            budget -= n;
            if s.prefilled + n == s.req.prompt.len() {
                out_rows.push(rows.len() - 1);
                outs.push(Out { seq: i, first: true, row0: rows.len() - 1, plan: None });
            }
        }
        (rows, out_rows, outs, chunks)
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        self.step_inner();
        self.metrics.step_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn step_inner(&mut self) {
        let t_plan = Instant::now();
        let (rows, out_rows, outs, chunks) = self.plan();
        self.metrics.plan_ns.fetch_add(t_plan.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if rows.is_empty() {
            return;
        }
        // Account the prefill rows now: they enter the state whatever the outcome.
        let mut fed = vec![0usize; self.running.len()];
        for c in &chunks {
            fed[c.seq] += c.len;
        }
        let taps: Vec<usize> = self.config.dspark.as_ref().map(|sc| sc.taps().to_vec()).unwrap_or_default();
        let (out_rows, outs, logits) = self.logits_first(out_rows, outs);
        let draws = self.draws(&outs, out_rows.len());
        let rows_n = rows.len();
        let t_fwd = Instant::now();
        let result = Batch::new(rows).map_err(|e| e.to_string()).and_then(|b| {
            let outputs = Outputs { out_rows: &out_rows, taps: &taps };
            let plan = StepPlan { batch: &b, outputs, logits, draws: &draws };
            self.model.step(&plan).map_err(|e| e.to_string())
        });
        let fwd_ns = t_fwd.elapsed().as_nanos() as u64;
        self.metrics.forward_ns.fetch_add(fwd_ns, Ordering::Relaxed);
        self.metrics.steps_total.fetch_add(1, Ordering::Relaxed);
        let out = match result {
            Ok(o) => {
                let prefill = chunks.iter().map(|c| c.len).sum::<usize>();
                self.metrics.record_path(o.path, fwd_ns, rows_n, prefill);
                o
            }
            Err(e) => {
                // A failed forward leaves the batch's states unusable: fail those sequences only.
                let ids: Vec<usize> =
                    (0..self.running.len()).filter(|&i| fed[i] > 0 || outs.iter().any(|o| o.seq == i)).collect();
                for i in ids.into_iter().rev() {
                    let s = self.running.remove(i);
                    self.fail(s, format!("forward failed: {e}"));
                }
                return;
            }
        };
        let (hidden, logits) = (out.hidden, out.logits);
        let width = self.config.dspark.as_ref().map_or(0, |sc| sc.hidden_width(&self.model.cfg));
        let mut done: Vec<(usize, Result<FinishReason, String>)> = Vec::new();
        // Prefill rows enter the drafter rings.
        if let Some(sc) = &self.config.dspark {
            for c in &chunks {
                if let Some(st) = self.running[c.seq].spec.as_mut() {
                    let h = hidden.get(c.row0 * width..(c.row0 + c.len) * width).unwrap_or(&[]);
                    if let Err(e) = st.commit(sc, c.pos0, h, width) {
                        tracing::warn!("DSpark ring commit failed, speculation off for the sequence: {e}");
                        self.running[c.seq].spec = None;
                    }
                }
            }
        }
        for (i, n) in fed.iter().enumerate() {
            self.running[i].prefilled += n;
            self.metrics.prompt_tokens_total.fetch_add(*n as u64, Ordering::Relaxed);
            let p = self.running[i].prefilled;
            log_prefill_progress(&self.running[i], *n);
            if *n > 0 && self.is_snapshot_point(&self.running[i], p) {
                let (slot, toks) = (self.running[i].slot.expect("admitted"), self.running[i].req.prompt[..p].to_vec());
                let interval = self.prefix.as_ref().map_or(0, |pc| pc.interval());
                self.save_prefix(slot, &toks, interval > 0 && p.is_multiple_of(interval));
            }
        }
        let vocab = self.model.cfg.vocab_size;
        let mut drawn = if self.config.host_sampling {
            self.draw_plain_rows(&outs, &logits, vocab)
        } else {
            outs.iter().map(|_| None).collect()
        };
        let mut k = 0; // output row
        for (oi, o) in outs.into_iter().enumerate() {
            let nrows = o.plan.as_ref().map_or(1, |p| p.rows());
            let l = logits.get(k * vocab..(k + nrows) * vocab).unwrap_or(&[]);
            let ids = out.ids.get(k..k + nrows).unwrap_or(&[]);
            k += nrows;
            let s = &mut self.running[o.seq];
            let on_device = draws_on_device(self.config.host_sampling, s, &o);
            // Decode rows of a speculating sequence: accept, cut back, commit (speculative.rs).
            let emitted: Result<Vec<u32>, String> = match (&o.plan, s.spec.as_mut(), &self.config.dspark) {
                (Some(plan), Some(st), Some(sc)) => {
                    let h = hidden.get(o.row0 * width..(o.row0 + nrows) * width).unwrap_or(&[]);
                    let before = st.stats.clone();
                    let slot = s.slot.expect("admitted");
                    // Rows drawn on the device give their tokens (their logits may be here too,
                    // for logprobs); rows drawn on the host give their logits.
                    let verdict = if on_device || l.is_empty() { Verdict::Ids(ids) } else { Verdict::Logits(l) };
                    let r = st.finish(sc, &mut self.model, slot, plan, verdict, h, &mut s.sampler, &s.req.stop_ids);
                    self.metrics.spec.record(&before, &st.stats);
                    r.map(|r| r.tokens).map_err(|e| e.to_string())
                }
                // Greedy and plainly sampled rows: the token the step chose by the row's draw.
                _ if l.is_empty() || on_device => {
                    ids.first().map(|&t| vec![t]).ok_or_else(|| "the step returned no token id".to_string())
                }
                _ => match drawn[oi].take() {
                    Some(r) => r.map(|t| vec![t]),
                    None => {
                        let pos = next_pos(s);
                        sample_row(&mut s.sampler, s.processor.as_mut(), l, pos).map(|t| vec![t])
                    }
                },
            };
            let emitted = match emitted {
                Ok(t) => t,
                Err(e) => {
                    done.push((o.seq, Err(e)));
                    continue;
                }
            };
            for (j, &tok) in emitted.iter().enumerate() {
                let now = Instant::now();
                if o.first {
                    self.metrics.ttft.observe(now.duration_since(s.arrived).as_secs_f64());
                } else if let Some(prev) = s.last_token_at {
                    self.metrics.itl.observe(now.duration_since(prev).as_secs_f64());
                }
                s.last_token_at = Some(now);
                s.generated.push(tok);
                self.metrics.generated_tokens_total.fetch_add(1, Ordering::Relaxed);
                let (logprob, top) = match s.req.top_logprobs {
                    Some(n) => logprobs(&l[j * vocab..(j + 1) * vocab], tok, n),
                    None => (None, Vec::new()),
                };
                if s.events.send(Event::Token(TokenEvent { id: tok, logprob, top })).is_err() {
                    done.push((o.seq, Ok(FinishReason::Cancelled)));
                    break;
                } else if s.req.stop_ids.contains(&tok) {
                    done.push((o.seq, Ok(FinishReason::Stop)));
                    break;
                } else if s.generated.len() >= s.req.max_tokens {
                    done.push((o.seq, Ok(FinishReason::Length)));
                    break;
                }
            }
        }
        // The logits' pages serve the next step's download (a fresh vector of more than 64
        // rows' logits is mapped and faulted in anew: PERF.md v36).
        self.model.recycle(logits);
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, r) in done {
            let s = self.running.remove(i);
            match r {
                Ok(reason) => self.finish(s, reason),
                Err(msg) => self.fail(s, msg),
            }
        }
    }
}

impl<B: Backend> Engine<B> {
    /// The step's outputs reordered so that those whose rows need their logits on the host (a
    /// host pass, logprobs, sampling; plain or speculative) come first, with their output rows,
    /// and how many output rows those are: only their logits cross to the host, the greedy
    /// rows' argmax comes back as ids (64 rows of V4's logits are 33 MB a step). The order
    /// within each kind is kept.
    fn logits_first(&self, out_rows: Vec<usize>, outs: Vec<Out>) -> (Vec<usize>, Vec<Out>, usize) {
        let host = self.config.host_sampling;
        let needs = |o: &Out| {
            let s = &self.running[o.seq];
            let sampled = s.sampler.params.temperature != 0.0;
            let drawn = o.plan.as_ref().is_none_or(|p| p.is_target_only());
            s.processor.is_some() || s.req.top_logprobs.is_some() || (sampled && (host || !drawn))
        };
        let mut at = 0;
        let mut groups: Vec<(bool, Out, std::ops::Range<usize>)> = Vec::with_capacity(outs.len());
        for o in outs {
            let n = o.plan.as_ref().map_or(1, |p| p.rows());
            groups.push((needs(&o), o, at..at + n));
            at += n;
        }
        groups.sort_by_key(|g| !g.0);
        let logits = groups.iter().filter(|g| g.0).map(|g| g.2.len()).sum();
        let rows = groups.iter().flat_map(|g| out_rows[g.2.clone()].iter().copied()).collect();
        (rows, groups.into_iter().map(|g| g.1).collect(), logits)
    }

    /// With [`EngineConfig::host_sampling`], the tokens of the step's plain sampled rows (no
    /// speculative round, no host pass) drawn on the host from their logits, in parallel, each
    /// with the uniform of its token's position ([`Sampler::sample_at`]): the draws a
    /// sequential loop makes. A draw over V4's vocabulary costs ~1 ms (BENCHMARKS.md), which
    /// at 64 rows a step was the engine thread's largest cost. `None`: the row is not one.
    fn draw_plain_rows(&self, outs: &[Out], logits: &[f32], vocab: usize) -> Vec<Option<Result<u32, String>>> {
        use rayon::prelude::*;
        let mut drawn: Vec<Option<Result<u32, String>>> = outs.iter().map(|_| None).collect();
        if logits.is_empty() {
            return drawn;
        }
        // Each out's first output row, and the outs that draw plainly: (out, sequence, row).
        let mut row = 0;
        let mut plain: Vec<(usize, usize, usize)> = Vec::new();
        for (i, o) in outs.iter().enumerate() {
            let s = &self.running[o.seq];
            if o.plan.is_none() && s.processor.is_none() && s.sampler.params.temperature != 0.0 {
                plain.push((i, o.seq, row));
            }
            row += o.plan.as_ref().map_or(1, |p| p.rows());
        }
        if plain.len() < 2 {
            return drawn;
        }
        plain.sort_by_key(|p| p.1);
        let mut jobs: Vec<(usize, &Sampler, usize, &[f32])> = Vec::with_capacity(plain.len());
        let mut next = plain.iter().peekable();
        // A sequence has one out a step; a second one would be drawn by the sequential loop.
        for (si, s) in self.running.iter().enumerate() {
            if let Some(&&(oi, _, r)) = next.peek().filter(|p| p.1 == si) {
                jobs.push((oi, &s.sampler, next_pos(s), &logits[r * vocab..(r + 1) * vocab]));
                next.next();
            }
            while next.peek().is_some_and(|p| p.1 == si) {
                next.next();
            }
        }
        let res: Vec<(usize, Result<u32, String>)> =
            jobs.into_par_iter().map(|(oi, s, pos, l)| (oi, s.sample_at(l, pos).map_err(|e| e.to_string()))).collect();
        for (oi, r) in res {
            drawn[oi] = Some(r);
        }
        drawn
    }

    /// Each output row's draw, in the order of `outs`: a sampled row without a host pass (a
    /// plain row, or a verify row of a target-only round) is drawn on the device with the
    /// uniform of the position of the token it gives ([`Sampler::device_draw_at`]); every
    /// other row is greedy there, and the host samples it from its logits where it must. A draw over
    /// V4's vocabulary cost the engine's thread ~1 ms a row on the host (BENCHMARKS.md "Host
    /// sampler"), and its logits 0.5 MB a row of copy.
    fn draws(&self, outs: &[Out], out_rows: usize) -> Vec<Draw> {
        let mut draws = Vec::with_capacity(out_rows);
        for o in outs {
            let s = &self.running[o.seq];
            if draws_on_device(self.config.host_sampling, s, o) {
                match &o.plan {
                    Some(p) => draws.extend((0..p.rows()).map(|k| s.sampler.device_draw_at(p.drawn_pos(k)))),
                    None => draws.push(s.sampler.device_draw_at(next_pos(s))),
                }
            } else {
                draws.extend(std::iter::repeat_n(Draw::GREEDY, o.plan.as_ref().map_or(1, |p| p.rows())));
            }
        }
        draws
    }
}

/// Whether `o`'s tokens are drawn on the device: a plain row or a target-only round's verify
/// rows of a sampled request without a host pass (bias, penalties, grammar), unless the engine
/// samples on the host. Logprobs still bring the rows' logits, for the host to read.
fn draws_on_device(host_sampling: bool, s: &Sequence, o: &Out) -> bool {
    let drawn = o.plan.as_ref().is_none_or(|p| p.is_target_only());
    !host_sampling && drawn && s.processor.is_none() && s.sampler.params.temperature != 0.0
}

/// Position of the token a sequence's next output row gives (the row after the prompt's last
/// or after the last generated token): the position whose uniform draws it.
fn next_pos(s: &Sequence) -> usize {
    s.req.prompt.len() + s.generated.len()
}

/// Long prompts report their prefill every [`PREFILL_LOG_EVERY`] tokens (and when done), so an
/// operator sees a 100K-token prompt progress rather than a silent server.
const PREFILL_LOG_EVERY: usize = 8192;

fn log_prefill_progress(s: &Sequence, fed: usize) {
    let (p, total) = (s.prefilled, s.req.prompt.len());
    if fed == 0 || total - s.cached < PREFILL_LOG_EVERY {
        return;
    }
    if p / PREFILL_LOG_EVERY != (p - fed) / PREFILL_LOG_EVERY || p == total {
        let secs = s.arrived.elapsed().as_secs_f64();
        tracing::info!(id = s.id, "prefill {p}/{total} tokens ({} cached), {secs:.1}s", s.cached);
    }
}

/// Samples the row of the token at position `pos`: with that position's uniform, or through
/// the request's host pass (bias, penalties, grammar) when it has one (from the sampler's
/// sequential stream).
fn sample_row(
    sampler: &mut Sampler,
    processor: Option<&mut crate::logits::RowProcessor>,
    l: &[f32],
    pos: usize,
) -> Result<u32, String> {
    let Some(p) = processor else { return sampler.sample_at(l, pos).map_err(|e| e.to_string()) };
    let mut row = l.to_vec();
    p.apply(&mut row).map_err(|e| e.to_string())?;
    let t = sampler.sample(&row).map_err(|e| e.to_string())?;
    p.accept(t).map_err(|e| e.to_string())?;
    Ok(t)
}

/// Log-softmax of the raw logits: the sampled token's logprob and the `n` best alternatives.
fn logprobs(l: &[f32], tok: u32, n: usize) -> (Option<f32>, Vec<(u32, f32)>) {
    let (best, _) = argmax_margin(l);
    let m = l[best as usize];
    let lse = m + l.iter().map(|v| ((v - m) as f64).exp()).sum::<f64>().ln() as f32;
    let mut idx: Vec<u32> = (0..l.len() as u32).collect();
    let n = n.min(l.len());
    if n > 0 {
        idx.select_nth_unstable_by(n - 1, |a, b| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b)));
    }
    let mut top: Vec<(u32, f32)> = idx[..n].iter().map(|&i| (i, l[i as usize] - lse)).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    (Some(l[tok as usize] - lse), top)
}
