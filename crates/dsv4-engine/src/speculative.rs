//! DSpark speculative decoding: the one place where a round is decided. `generate`, the
//! continuous-batching engine and the tests all go through [`SpecSeq::plan`] (draft a block
//! after the anchor) and [`SpecSeq::finish`] (accept, cut the target back with
//! `Model::truncate` — accepted rows are never re-fed — and commit the surviving rows to the
//! drafter's context ring). The verify forward itself (`[anchor, d0..d(l-1)]`, alone or inside a
//! batch with other sequences' rows and prefill chunks) is the caller's, tapping the drafter's
//! layers over every row ([`SpecConfig::taps`] in the step's plan) so that committed rows can
//! be fed to the drafter.
//!
//! Lossless: at temperature 0 acceptance is greedy (the emitted stream is the plain greedy
//! stream). At temperature > 0 a round is one of two kinds. A target-only round
//! ([`Planned::target_only`], the engine's) verifies greedy drafts by drawing each verify row's
//! token from the target's own sampling distribution with the uniform of that token's position
//! ([`Sampler::uniform_at`]) and accepting a draft iff it equals the draw (spec dspark.md §6):
//! the emitted tokens are exactly a plain seeded run's, and the round needs only token ids.
//! Otherwise ([`generate_speculative`](crate::generate_speculative)) it is token-level
//! rejection sampling against the sequence's own sampling distribution ([`Sampler::probs`]:
//! temperature, top-k, top-p, min-p), with the draft's exact proposal distribution: the same
//! distribution as a plain run, not the same tokens.

use crate::sampler::{SampleError, Sampler};
use dsv4_backend::{Backend, Model, ModelError, Outputs, StepPlan, MAX_ROLLBACK};
use dsv4_dspark::verify::{accept_greedy, accept_greedy_ids, accept_sampled};
use dsv4_dspark::{ContextRing, Draft, DraftRequest, Drafter, DsparkError, Ring};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::any::Any;
use std::sync::Arc;

/// A sequence's proposer state beside its host [`ContextRing`]: opaque to the engine (a GPU
/// drafter keeps the ring rows on the device here).
pub type DeviceRing = Box<dyn Any + Send + Sync>;

/// One sequence's draft for [`Proposer::draft_many`].
pub struct DraftJob<'a> {
    pub ring: &'a ContextRing,
    pub dev: Option<&'a DeviceRing>,
    pub anchor: u32,
    pub anchor_pos: usize,
    pub temperature: f32,
    pub rng: &'a mut dyn RngCore,
}

/// What proposes drafts: the DSpark [`Drafter`], or a test double.
pub trait Proposer: Send + Sync {
    /// Target layers whose outputs are captured (`dspark_target_layer_ids`).
    fn layers(&self) -> &[usize];
    /// Largest block (γ).
    fn block_size(&self) -> usize;
    /// A fresh per-sequence context ring.
    fn new_ring(&self) -> ContextRing;
    /// Ingests committed rows `(position, captured hidden)`.
    fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError>;
    /// Drafts a block after `anchor` at `anchor_pos` (the ring holds `anchor_pos - 1`).
    fn draft(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError>;

    /// A fresh per-sequence device part (`None`: the host ring is the whole state).
    fn new_device_ring(&self) -> Option<DeviceRing> {
        None
    }
    /// [`Proposer::commit`] with the sequence's device part (where [`Self::new_device_ring`]
    /// gave one). The host ring's tags must stay the positions written.
    fn commit_with(
        &self,
        ring: &mut ContextRing,
        _dev: Option<&mut DeviceRing>,
        rows: &[(usize, &[f32])],
    ) -> Result<(), DsparkError> {
        self.commit(ring, rows)
    }
    /// [`Proposer::draft`] with the sequence's device part.
    fn draft_with(
        &self,
        ring: &ContextRing,
        _dev: Option<&DeviceRing>,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        self.draft(ring, anchor, anchor_pos, temperature, rng)
    }
    /// Drafts for several sequences (one engine step); by default one after the other.
    fn draft_many(&self, jobs: &mut [DraftJob<'_>]) -> Vec<Result<Draft, DsparkError>> {
        jobs.iter_mut()
            .map(|j| self.draft_with(j.ring, j.dev, j.anchor, j.anchor_pos, j.temperature, &mut *j.rng))
            .collect()
    }
}

impl Proposer for Drafter {
    fn layers(&self) -> &[usize] {
        &self.config().target_layer_ids
    }
    fn block_size(&self) -> usize {
        Drafter::block_size(self)
    }
    fn new_ring(&self) -> ContextRing {
        Drafter::new_ring(self)
    }
    fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        Drafter::commit(self, ring, rows)
    }
    fn draft(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        Drafter::draft(self, ring, anchor, anchor_pos, temperature, rng)
    }
}

/// A drafter whose rings live on its own backend (`Drafter<CudaBackend>`): a sequence's host
/// [`ContextRing`] carries only the slot tags (no rows), its [`DeviceRing`] holds the
/// `Ring<B::T>` with the rows. Drafts one sequence per call (the engine plans sequence by
/// sequence); [`Drafter::draft_batch`] drafts many in one forward.
pub struct DeviceProposer<B: Backend>(pub Drafter<B>);

impl<B: Backend> DeviceProposer<B>
where
    B::T: Send + Sync + 'static,
{
    fn device<'a>(&self, dev: Option<&'a DeviceRing>) -> Result<&'a Ring<B::T>, DsparkError> {
        dev.and_then(|d| d.downcast_ref::<Ring<B::T>>()).ok_or(DsparkError::RingShape)
    }
}

impl<B: Backend> Proposer for DeviceProposer<B>
where
    B::T: Send + Sync + 'static,
{
    fn layers(&self) -> &[usize] {
        &self.0.config().target_layer_ids
    }
    fn block_size(&self) -> usize {
        self.0.block_size()
    }
    fn new_ring(&self) -> ContextRing {
        let c = self.0.target_config();
        ContextRing::new(0, c.window, c.head_dim)
    }
    fn new_device_ring(&self) -> Option<DeviceRing> {
        Some(Box::new(self.0.new_ring()))
    }
    /// Without the device part there is nowhere to write the rows.
    fn commit(&self, _ring: &mut ContextRing, _rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        Err(DsparkError::RingShape)
    }
    fn draft(
        &self,
        _ring: &ContextRing,
        _anchor: u32,
        _anchor_pos: usize,
        _temperature: f32,
        _rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        Err(DsparkError::RingShape)
    }
    fn commit_with(
        &self,
        ring: &mut ContextRing,
        dev: Option<&mut DeviceRing>,
        rows: &[(usize, &[f32])],
    ) -> Result<(), DsparkError> {
        let d = dev.and_then(|d| d.downcast_mut::<Ring<B::T>>()).ok_or(DsparkError::RingShape)?;
        self.0.commit(d, rows)?;
        for (p, _) in rows {
            ring.write(*p, &[]);
        }
        Ok(())
    }
    fn draft_with(
        &self,
        ring: &ContextRing,
        dev: Option<&DeviceRing>,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        let d = self.device(dev)?;
        debug_assert_eq!(d.tags(), ring.tags(), "host and device ring tags");
        self.0.draft(d, anchor, anchor_pos, temperature, rng)
    }
    /// Greedy jobs in one batched forward ([`Drafter::draft_batch`], without the `Z` rows:
    /// greedy verification reads only the tokens; a lone greedy job too, where
    /// [`Drafter::draft`] would bring `γ` rows of `vocab` logits to the host); sampled ones
    /// (their Markov loop samples on the host) one by one. A batch that fails is retried job by
    /// job, so one bad request cannot fail the others.
    fn draft_many(&self, jobs: &mut [DraftJob<'_>]) -> Vec<Result<Draft, DsparkError>> {
        let greedy: Vec<usize> =
            (0..jobs.len()).filter(|&i| jobs[i].temperature <= 0.0 || !jobs[i].temperature.is_finite()).collect();
        let mut out: Vec<Option<Result<Draft, DsparkError>>> = (0..jobs.len()).map(|_| None).collect();
        if !greedy.is_empty() {
            let reqs: Result<Vec<DraftRequest<B::T>>, DsparkError> = greedy
                .iter()
                .map(|&i| {
                    let ring = self.device(jobs[i].dev)?;
                    Ok(DraftRequest { ring, anchor: jobs[i].anchor, anchor_pos: jobs[i].anchor_pos })
                })
                .collect();
            if let Ok(drafts) = reqs.and_then(|r| self.0.draft_batch(&r, false)) {
                for (&i, d) in greedy.iter().zip(drafts) {
                    out[i] = Some(Ok(d));
                }
            }
        }
        out.into_iter()
            .zip(jobs.iter_mut())
            .map(|(o, j)| {
                o.unwrap_or_else(|| self.draft_with(j.ring, j.dev, j.anchor, j.anchor_pos, j.temperature, &mut *j.rng))
            })
            .collect()
    }
}

/// When to draft.
#[derive(Clone, Debug)]
pub struct SpecPolicy {
    /// Stop drafting for a sequence while it does not pay: the running acceptance predicts fewer
    /// tokens per verify round than a verify forward of `1+l` rows costs in 1-row decodes
    /// (`verify_cost`). Drafting is retried every `probe_every` skipped rounds.
    pub adaptive: bool,
    /// Cost of a verify forward of `1 + l` rows relative to a 1-row decode, per `l` (index `l`;
    /// index 0 is 1.0). Measure it on the backend ([`measure_verify_cost`]); the default
    /// assumes verify rows are free (a memory-bound GPU decode).
    pub verify_cost: Vec<f64>,
    pub probe_every: usize,
    /// Engine: no drafting while this many sequences or more are decoding in one step (the
    /// batch is already compute-bound); 0: never back off.
    pub max_decode_batch: usize,
}

impl Default for SpecPolicy {
    fn default() -> Self {
        SpecPolicy { adaptive: false, verify_cost: Vec::new(), probe_every: 16, max_decode_batch: 64 }
    }
}

/// The acceptance rule of sampled rounds: `(drafts, draft probs, target probs, vocab, rng)` →
/// `(drafts accepted, next token)`, as [`accept_sampled`].
pub type SampledAcceptance = fn(&[u32], Option<&[f32]>, &[f32], usize, &mut ChaCha8Rng) -> (usize, u32);

/// DSpark settings of a generation or an engine.
#[derive(Clone)]
pub struct SpecConfig {
    pub proposer: Arc<dyn Proposer>,
    /// Longest draft verified per round (`--dspark-max-draft`, at most γ).
    pub max_draft: usize,
    /// Use speculation for sequences sampled at temperature > 0. In the engine the rounds are
    /// target-only ([`Planned::target_only`]): a seeded request gives exactly its plain tokens.
    /// In [`generate_speculative`](crate::generate_speculative) they are rejection sampling:
    /// the same distribution, not the same tokens as a plain run with that seed. Off: those
    /// sequences decode plainly.
    pub sampled: bool,
    pub policy: SpecPolicy,
    /// Test hook: the rule of rounds at temperature > 0. Always [`accept_sampled`] outside tests;
    /// `tests/dspark_distribution.rs` swaps in broken rules to show that its χ² test catches them.
    #[doc(hidden)]
    pub sampled_acceptance: SampledAcceptance,
}

impl std::fmt::Debug for SpecConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecConfig")
            .field("block_size", &self.proposer.block_size())
            .field("max_draft", &self.max_draft)
            .field("sampled", &self.sampled)
            .field("policy", &self.policy)
            .finish()
    }
}

impl SpecConfig {
    pub fn new(proposer: Arc<dyn Proposer>) -> Self {
        let max_draft = proposer.block_size();
        SpecConfig {
            proposer,
            max_draft,
            sampled: false,
            policy: SpecPolicy::default(),
            sampled_acceptance: accept_sampled::<ChaCha8Rng>,
        }
    }

    /// The longest draft per round.
    pub fn max_len(&self) -> usize {
        self.max_draft.min(self.proposer.block_size()).min(MAX_ROLLBACK)
    }

    /// Whether a request with these parameters speculates.
    pub fn applies(&self, temperature: f32) -> bool {
        temperature == 0.0 || self.sampled
    }

    /// A capture for a forward whose rows feed the drafter.
    /// The target layers whose output stream means feed the drafter ([`StepPlan`]'s taps).
    pub fn taps(&self) -> &[usize] {
        self.proposer.layers()
    }

    /// Width of one captured row.
    pub fn hidden_width(&self, cfg: &dsv4_model::Config) -> usize {
        self.proposer.layers().len() * cfg.hidden
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Dspark(#[from] DsparkError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error("the forward tapped no drafter rows")]
    NoCapture,
    #[error(
        "a verify of {want} rows got {rows} token ids at temperature {t} (ids serve greedy and target-only rounds only)"
    )]
    Verdict { rows: usize, want: usize, t: f32 },
}

/// What a verify step brought back for [`SpecSeq::finish`]: the rows' logits, or (greedy and
/// target-only rounds) only their tokens: the argmax when greedy, else each row's draw with
/// [`Sampler::device_draw_at`] of the position after it.
#[derive(Clone, Copy, Debug)]
pub enum Verdict<'a> {
    Logits(&'a [f32]),
    Ids(&'a [u32]),
}

/// Acceptance statistics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify rounds (decode steps with a draft of at least one token).
    pub rounds: u64,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Decode steps that could have drafted but did not (policy, load, budget, no context).
    pub skipped: u64,
    /// Per draft slot `k`: rounds that verified slot `k` and rounds that accepted it.
    pub pos_drafted: Vec<u64>,
    pub pos_accepted: Vec<u64>,
}

impl SpecStats {
    /// Tokens committed per verify round (accepted drafts + the bonus), τ.
    pub fn acceptance_length(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            1.0 + self.accepted as f64 / self.rounds as f64
        }
    }

    /// Per slot `k`: P(slot k accepted | slot k verified).
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.pos_drafted
            .iter()
            .zip(&self.pos_accepted)
            .map(|(&d, &a)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect()
    }

    fn record(&mut self, l: usize, n: usize) {
        if l == 0 {
            return;
        }
        if self.pos_drafted.len() < l {
            self.pos_drafted.resize(l, 0);
            self.pos_accepted.resize(l, 0);
        }
        self.rounds += 1;
        self.drafted += l as u64;
        self.accepted += n as u64;
        (0..l).for_each(|k| self.pos_drafted[k] += 1);
        (0..n).for_each(|k| self.pos_accepted[k] += 1);
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_length": self.acceptance_length(),
            "per_position_acceptance": self.per_position_acceptance(),
            "skipped_drafts": self.skipped,
        })
    }
}

/// A planned round: the verify rows are `[anchor, drafts..]` at positions `anchor_pos..`.
#[derive(Clone, Debug)]
pub struct Planned {
    pub anchor: u32,
    pub anchor_pos: usize,
    pub drafts: Vec<u32>,
    /// The drafts' proposal distributions `[l, vocab]` (sampled drafting only).
    q: Option<Vec<f32>>,
    /// A target-only round at temperature > 0 (see [`Planned::target_only`]).
    target_only: bool,
}

impl Planned {
    /// The verify rows' tokens.
    pub fn tokens(&self) -> Vec<u32> {
        std::iter::once(self.anchor).chain(self.drafts.iter().copied()).collect()
    }
    pub fn rows(&self) -> usize {
        1 + self.drafts.len()
    }

    /// A block with chosen drafts (greedy verification; tests).
    pub fn forced(anchor: u32, anchor_pos: usize, drafts: Vec<u32>) -> Self {
        Planned { anchor, anchor_pos, drafts, q: None, target_only: false }
    }

    /// The round verified target-only (spec dspark.md §6): verify row `k` (input position
    /// `anchor_pos + k`) draws its token `y_k` from the target's sampling distribution with
    /// [`Sampler::uniform_at`]`(anchor_pos + k + 1)`; draft `k` is accepted iff it equals `y_k`,
    /// the first mismatch (or the last row) emits `y_k`. Each emitted token at position `q` is
    /// then the token a plain seeded run draws at `q` from the same logits. Lossless for any
    /// drafts; drafts' proposal distributions are not used (drafting should be greedy).
    pub fn target_only(mut self) -> Self {
        self.q = None;
        self.target_only = true;
        self
    }

    pub fn is_target_only(&self) -> bool {
        self.target_only
    }

    /// Position of the token that verify row `k`'s draw gives.
    pub fn drawn_pos(&self, k: usize) -> usize {
        self.anchor_pos + k + 1
    }
}

/// What a finished round emits.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundResult {
    /// Accepted drafts then the bonus/correction token, cut after the first stop id.
    pub tokens: Vec<u32>,
    /// Drafts accepted by the target (before any stop cut).
    pub accepted: usize,
}

/// Per-sequence speculative state: the drafter's context ring, the drafting RNG (sampled
/// drafting), statistics and the policy's running acceptance.
pub struct SpecSeq {
    pub ring: ContextRing,
    /// The proposer's device part of the ring ([`Proposer::new_device_ring`]).
    pub dev: Option<DeviceRing>,
    rng: ChaCha8Rng,
    pub stats: SpecStats,
    /// Exponential average of accepted drafts per round.
    ewma: f64,
    /// Rounds skipped by the policy since the last draft.
    idle: usize,
}

impl SpecSeq {
    pub fn new(cfg: &SpecConfig, seed: u64) -> Self {
        SpecSeq {
            ring: cfg.proposer.new_ring(),
            dev: cfg.proposer.new_device_ring(),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0xD5_9A4C),
            stats: SpecStats::default(),
            ewma: cfg.max_len() as f64,
            idle: 0,
        }
    }

    /// Commits `rows` consecutive captured rows starting at position `pos0` (a prefill chunk, or
    /// any rows that are now part of the sequence). Rows that the chunk's own later rows would
    /// overwrite in the ring are skipped.
    pub fn commit(&mut self, cfg: &SpecConfig, pos0: usize, hidden: &[f32], width: usize) -> Result<(), SpecError> {
        let n = hidden.len() / width;
        let skip = n.saturating_sub(self.ring.window());
        let rows: Vec<(usize, &[f32])> = (skip..n).map(|i| (pos0 + i, &hidden[i * width..(i + 1) * width])).collect();
        cfg.proposer.commit_with(&mut self.ring, self.dev.as_mut(), &rows)?;
        Ok(())
    }

    /// How long a draft the policy allows (before budget limits).
    fn policy_len(&mut self, cfg: &SpecConfig) -> usize {
        let l = cfg.max_len();
        let p = &cfg.policy;
        if !p.adaptive || l == 0 {
            return l;
        }
        // Expected committed tokens of a round of length k with per-slot acceptance a (from the
        // running mean of accepted drafts), against its cost in 1-row decodes.
        let a = (self.ewma / l as f64).clamp(0.0, 0.999);
        let best = (1..=l)
            .map(|k| {
                let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
                let cost = p.verify_cost.get(k).copied().unwrap_or(1.0).max(1.0);
                (k, tokens / cost)
            })
            .fold((0, 1.0), |b, x| if x.1 > b.1 { x } else { b });
        if best.0 > 0 {
            return best.0;
        }
        self.idle += 1;
        if p.probe_every > 0 && self.idle >= p.probe_every {
            self.idle = 0;
            return l;
        }
        0
    }

    /// Drafts the next round's block after `anchor` (at `anchor_pos`), at most `limit` tokens
    /// (the caller's budget: remaining tokens to generate minus one, batch room, 0 to skip).
    /// An empty draft is a plain decode step (its row is still committed by [`Self::finish`]).
    pub fn plan(
        &mut self,
        cfg: &SpecConfig,
        anchor: u32,
        anchor_pos: usize,
        limit: usize,
        sampler: &Sampler,
    ) -> Result<Planned, SpecError> {
        let l = self.plan_len(cfg, anchor_pos, limit, sampler);
        if l == 0 {
            return Ok(Planned::forced(anchor, anchor_pos, Vec::new()));
        }
        let t = sampler.params.temperature;
        let d = cfg.proposer.draft_with(&self.ring, self.dev.as_ref(), anchor, anchor_pos, t, &mut self.rng)?;
        Ok(Self::planned(anchor, anchor_pos, l, t, d))
    }

    /// The first half of [`Self::plan`]: how many drafts this round verifies (0: a plain decode
    /// step; a round that could have drafted but does not counts as skipped).
    pub fn plan_len(&mut self, cfg: &SpecConfig, anchor_pos: usize, limit: usize, sampler: &Sampler) -> usize {
        if !cfg.applies(sampler.params.temperature) {
            return 0;
        }
        let l = self.policy_len(cfg).min(limit);
        if l == 0 || anchor_pos == 0 || !self.ring.holds(anchor_pos - 1) {
            self.stats.skipped += 1;
            return 0;
        }
        l
    }

    /// The draft job of this sequence (for [`Proposer::draft_many`]).
    pub fn job(&mut self, anchor: u32, anchor_pos: usize, temperature: f32) -> DraftJob<'_> {
        DraftJob { ring: &self.ring, dev: self.dev.as_ref(), anchor, anchor_pos, temperature, rng: &mut self.rng }
    }

    /// The second half of [`Self::plan`]: the round of a draft, cut to `l` tokens.
    pub fn planned(anchor: u32, anchor_pos: usize, l: usize, temperature: f32, d: Draft) -> Planned {
        let drafts = d.tokens[..l.min(d.tokens.len())].to_vec();
        let q = if temperature > 0.0 { d.q_probs.map(|q| q[..drafts.len() * d.vocab].to_vec()) } else { None };
        Planned { anchor, anchor_pos, drafts, q, target_only: false }
    }

    /// Finishes a round after the verify forward: `verdict` holds the `1+l` verify rows' logits
    /// `[1+l, vocab]` (or, at temperature 0 and in target-only rounds, only their tokens),
    /// `hidden` their tapped rows. Accepts (greedy; target-only, from the rows' tokens or their
    /// draws with [`Sampler::sample_at`]; or rejection sampling at temperature > 0, where a
    /// round without drafts samples exactly as plain decoding does), cuts the target back to
    /// `anchor_pos + tokens.len()` tokens, and commits the anchor and accepted rows to the
    /// ring. Emitted tokens stop after the first of `stop_ids`.
    #[allow(clippy::too_many_arguments)]
    pub fn finish<B: Backend>(
        &mut self,
        cfg: &SpecConfig,
        model: &mut Model<B>,
        slot: usize,
        plan: &Planned,
        verdict: Verdict<'_>,
        hidden: &[f32],
        sampler: &mut Sampler,
        stop_ids: &[u32],
    ) -> Result<RoundResult, SpecError> {
        let vocab = model.cfg.vocab_size;
        let l = plan.drafts.len();
        let logits = match verdict {
            Verdict::Ids(ids) if (sampler.params.temperature == 0.0 || plan.target_only) && ids.len() == l + 1 => {
                // The step checked its logits for nonfinite values on the backend (and drew
                // target-only rows with `device_draw_at` of their positions).
                let (n, bonus) = accept_greedy_ids(&plan.drafts, ids);
                return self.settle(cfg, model, slot, plan, n, bonus, hidden, stop_ids);
            }
            Verdict::Ids(ids) => {
                return Err(SpecError::Verdict { rows: ids.len(), want: l + 1, t: sampler.params.temperature })
            }
            Verdict::Logits(x) => x,
        };
        debug_assert_eq!(logits.len(), (l + 1) * vocab);
        let (n, bonus) = if plan.target_only && sampler.params.temperature != 0.0 {
            let mut ids = Vec::with_capacity(l + 1);
            for (k, row) in logits.chunks(vocab).enumerate() {
                ids.push(sampler.sample_at(row, plan.drawn_pos(k))?);
            }
            accept_greedy_ids(&plan.drafts, &ids)
        } else if l == 0 {
            (0, sampler.sample(&logits[..vocab])?)
        } else if sampler.params.temperature == 0.0 {
            if let Some(index) = logits.iter().position(|v| !v.is_finite()) {
                return Err(SampleError::NonFinite { index: index % vocab }.into());
            }
            accept_greedy(&plan.drafts, logits, vocab)
        } else {
            let mut probs = Vec::with_capacity(logits.len());
            for row in logits.chunks(vocab) {
                probs.extend(sampler.probs(row)?);
            }
            (cfg.sampled_acceptance)(&plan.drafts, plan.q.as_deref(), &probs, vocab, sampler.rng_mut())
        };
        self.settle(cfg, model, slot, plan, n, bonus, hidden, stop_ids)
    }

    /// The round's outcome (`n` drafts accepted, then `bonus`): statistics, the target cut back
    /// to the emitted tokens, their tapped rows committed to the drafter.
    #[allow(clippy::too_many_arguments)]
    fn settle<B: Backend>(
        &mut self,
        cfg: &SpecConfig,
        model: &mut Model<B>,
        slot: usize,
        plan: &Planned,
        n: usize,
        bonus: u32,
        hidden: &[f32],
        stop_ids: &[u32],
    ) -> Result<RoundResult, SpecError> {
        let l = plan.drafts.len();
        self.stats.record(l, n);
        if l > 0 {
            self.ewma = 0.8 * self.ewma + 0.2 * n as f64;
            self.idle = 0;
        }
        let mut tokens: Vec<u32> = plan.drafts[..n].iter().copied().chain([bonus]).collect();
        if let Some(i) = tokens.iter().position(|t| stop_ids.contains(t)) {
            tokens.truncate(i + 1);
        }
        // The state keeps the anchor and the drafts that precede the last emitted token.
        let keep = plan.anchor_pos + tokens.len();
        if model.seq_len(slot) != Some(keep) {
            model.truncate(slot, keep)?;
        }
        let width = cfg.hidden_width(&model.cfg);
        if hidden.len() < tokens.len() * width {
            return Err(SpecError::NoCapture);
        }
        self.commit(cfg, plan.anchor_pos, &hidden[..tokens.len() * width], width)?;
        Ok(RoundResult { tokens, accepted: n })
    }
}

/// Runs one sequence's round in its own forward (single-sequence generation and tests): plan,
/// verify `[anchor, d..]` with a capture, finish.
#[allow(clippy::too_many_arguments)]
pub fn round<B: Backend>(
    cfg: &SpecConfig,
    spec: &mut SpecSeq,
    model: &mut Model<B>,
    slot: usize,
    anchor: u32,
    limit: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
) -> Result<RoundResult, SpecError> {
    let pos = model.seq_len(slot).ok_or(ModelError::from(dsv4_backend::BatchError::NoSequence { seq: slot }))?;
    let plan = spec.plan(cfg, anchor, pos, limit, sampler)?;
    round_with(cfg, spec, model, slot, &plan, sampler, stop_ids)
}

/// [`round`] with an already planned block (tests force drafts this way).
pub fn round_with<B: Backend>(
    cfg: &SpecConfig,
    spec: &mut SpecSeq,
    model: &mut Model<B>,
    slot: usize,
    plan: &Planned,
    sampler: &mut Sampler,
    stop_ids: &[u32],
) -> Result<RoundResult, SpecError> {
    let batch = dsv4_backend::Batch::chunk(slot, plan.anchor_pos, &plan.tokens()).map_err(ModelError::from)?;
    let all: Vec<usize> = (0..plan.rows()).collect();
    let greedy = sampler.params.temperature == 0.0;
    let outputs = Outputs { out_rows: &all, taps: cfg.taps() };
    let out =
        model.step(&StepPlan { batch: &batch, outputs, logits: if greedy { 0 } else { all.len() }, draws: &[] })?;
    let verdict = if greedy { Verdict::Ids(&out.ids) } else { Verdict::Logits(&out.logits) };
    spec.finish(cfg, model, slot, plan, verdict, &out.hidden, sampler, stop_ids)
}

/// Prefills `tokens` from position `pos0` in chunks with a capture and commits every row.
/// Returns the logits of the last row.
pub fn prefill<B: Backend>(
    cfg: &SpecConfig,
    spec: &mut SpecSeq,
    model: &mut Model<B>,
    slot: usize,
    pos0: usize,
    tokens: &[u32],
    chunk: usize,
) -> Result<Vec<f32>, SpecError> {
    let width = cfg.hidden_width(&model.cfg);
    let mut logits = Vec::new();
    for (i, c) in tokens.chunks(chunk.max(1)).enumerate() {
        let p = pos0 + i * chunk.max(1);
        let batch = dsv4_backend::Batch::chunk(slot, p, c).map_err(ModelError::from)?;
        let outputs = Outputs { out_rows: &[c.len() - 1], taps: cfg.taps() };
        let out = model.step(&StepPlan { batch: &batch, outputs, logits: 1, draws: &[] })?;
        let hidden = out.hidden;
        logits = out.logits;
        spec.commit(cfg, p, &hidden, width)?;
    }
    Ok(logits)
}

/// Cost of a verify forward of `1 + l` rows relative to a 1-row decode, for `l = 0..=max_l`,
/// measured on `model` with a scratch sequence (median of `reps`). Needs a free slot.
pub fn measure_verify_cost<B: Backend>(
    model: &mut Model<B>,
    max_l: usize,
    reps: usize,
) -> Result<Vec<f64>, ModelError> {
    let slot = model.alloc_seq()?;
    let ctx: Vec<u32> = (0..32u32).map(|i| i % model.cfg.vocab_size as u32).collect();
    let result = (|| -> Result<Vec<f64>, ModelError> {
        model.forward(&dsv4_backend::Batch::chunk(slot, 0, &ctx)?, &[ctx.len() - 1])?;
        let mut t = Vec::new();
        for l in 0..=max_l {
            let mut xs = Vec::new();
            for _ in 0..reps.max(1) {
                let rows: Vec<u32> = ctx[..=l].to_vec();
                let all: Vec<usize> = (0..=l).collect();
                let t0 = std::time::Instant::now();
                model.forward(&dsv4_backend::Batch::chunk(slot, ctx.len(), &rows)?, &all)?;
                xs.push(t0.elapsed().as_secs_f64());
                model.truncate(slot, ctx.len())?;
            }
            xs.sort_by(f64::total_cmp);
            t.push(xs[xs.len() / 2]);
        }
        Ok(t.iter().map(|x| x / t[0].max(1e-12)).collect())
    })();
    model.free_seq(slot);
    result
}
