//! DSpark speculative sampling at temperature > 0 is lossless through the model: a chi-square
//! test of the joint distribution of the first three generated tokens.
//!
//! A tiny random target (the spec §12.1 configuration: SWA, CSA ratio 4, HCA ratio 8, window 8)
//! with a vocabulary of 8 tokens, and a random 3-stage DSpark drafter (γ = 5) for it, on the CPU
//! backend. After a fixed prompt of 6 tokens the exact joint `P(t1, t2, t3)` at temperature 1
//! (top-k, top-p, min-p off) comes from 1 + 8 + 64 plain one-row forwards, through the engine's
//! own [`Sampler::probs`]. Then [`decode_speculative`] — the decode half of
//! `generate_speculative`: first token from the prompt logits, then rounds of sampled draft →
//! one verify forward over `[anchor, d0, d1]` → rejection sampling → `Model::truncate` (no
//! replay) → ring commit — generates 4 tokens per sample from a restored snapshot of the
//! prefilled prompt (target state and drafter ring), with a different seed per sample. Rounds
//! verify 2 drafts, then 1 after a rejection; the generated positions 6..9 cross the CSA and HCA
//! compression boundary at 8, so rollbacks cut compressed state. The counts of `(t1, t2, t3)`
//! over all samples go into Pearson's χ² against the exact joint (cells expected below 5 merged),
//! checked against the 0.999 quantile of χ²(dof) (Wilson–Hilferty).
//!
//! The harness is checked to reproduce `generate_speculative` token for token (8 seeds). Both
//! acceptances and rejections must occur, and the second draft slot must be verified.
//!
//! The same harness with the acceptance rule swapped through the `SpecConfig` test hook
//! (`sampled_acceptance`) must fail the same check by a wide margin (χ² above 3× the threshold):
//! "no residual" (accept with min(1, p/q), but on a rejection resample from the target row
//! instead of max(p − q, 0)) and "accept all".
//!
//! Measured (dev profile, x86-64; deterministic for a given build and machine, printed with
//! `--nocapture`):
//!
//! | run                  | samples | χ²       | dof | 0.999 threshold |
//! |----------------------|---------|----------|-----|-----------------|
//! | real rule            | 20,000  | 403.2    | 368 | 457.6           |
//! | broken: no residual  | 8,000   | 1,887.6  | 265 | 341.9           |
//! | broken: accept all   | 8,000   | 53,953.5 | 265 | 341.9           |
//! | real rule (one-off)  | 100,000 | 469.0    | 490 | 592.5           |
//!
//! Real rule: 29,448 rounds, 49,448 drafts verified, 40.1% accepted (slot 0: 51.0%, slot 1:
//! 23.9%). Both tests together take about 44 s of wall time on 2 shared cores (the samples are
//! split over up to 4 threads, each with its own model on a one-thread rayon pool; counts do not
//! depend on the split).

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Batch, Model, Snapshot};
use dsv4_dspark::drafter::sample;
use dsv4_dspark::{ContextRing, Drafter};
use dsv4_engine::generate::decode_speculative;
use dsv4_engine::speculative::{self, SampledAcceptance, SpecConfig, SpecSeq, SpecStats};
use dsv4_engine::{generate_speculative, GenerateOptions, Sampler, SamplingParams};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, random_dspark, tiny_config, SynthDType, SynthDspark};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

/// Vocabulary: small enough that the joint of three tokens has 512 cells.
const V: usize = 8;
const PROMPT: [u32; 6] = [3, 1, 4, 1, 5, 2];
/// Tokens counted (the joint's order) and generated per sample (one more: the first round then
/// verifies two drafts, as the limit is the remaining tokens minus the bonus).
const COUNTED: usize = 3;
const GENERATED: usize = 4;
const TEMPERATURE: f32 = 1.0;
const SAMPLES: usize = 20_000;
/// Samples of each broken rule (they fail by far with fewer).
const BROKEN_SAMPLES: usize = 8_000;

fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: TEMPERATURE, top_p: 1.0, top_k: 0, min_p: 0.0, seed }
}

/// The checkpoint, the drafter and the prefilled prompt (target snapshot, drafter ring, last
/// logits).
struct Setup {
    dir: tempfile::TempDir,
    spec: SpecConfig,
    snap: Snapshot,
    ring: ContextRing,
    logits: Vec<f32>,
}

/// Runs `f` on a one-thread rayon pool: the CPU backend's parallel loops then run inline instead
/// of handing tiny matrices to other threads and sleeping on a latch (most of the time
/// otherwise, at this model size).
fn inline<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(f)
}

fn load(s: &Setup, slots: usize) -> (Model<CpuBackend>, usize) {
    let mut model = Model::load(CpuBackend, s.dir.path(), slots, false).unwrap();
    let slot = model.alloc_seq().unwrap();
    (model, slot)
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(V);
    cfg.max_position = 64;
    let ds = SynthDspark::for_config(&cfg);
    let mut json = cfg.to_hf_json();
    for (k, v) in ds.json_keys() {
        json[k] = v;
    }
    std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
    let mut t = random_checkpoint(&cfg, 11, SynthDType::F32);
    t.extend(random_dspark(&cfg, &ds, 11, SynthDType::F32));
    write_safetensors(&dir.path().join("model.safetensors"), &t).unwrap();
    let mut model = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let drafter = Drafter::load_dir(dir.path()).unwrap();
    let mut spec = SpecConfig::new(Arc::new(drafter));
    spec.sampled = true;
    // Prefill exactly as `generate_speculative` does (captured rows committed to the ring).
    let slot = model.alloc_seq().unwrap();
    let mut st = SpecSeq::new(&spec, 0);
    let logits = speculative::prefill(&spec, &mut st, &mut model, slot, 0, &PROMPT, 512).unwrap();
    let snap = model.snapshot(slot).unwrap();
    Setup { dir, spec, snap, ring: st.ring, logits }
}

/// The exact joint `P(t1, t2, t3)` of plain sampling (row-major, `V^3`), from plain forwards.
fn exact_joint(s: &Setup) -> Vec<f64> {
    let (mut model, slot) = load(s, 1);
    let sampler = Sampler::new(params(0)).unwrap();
    let probs = |l: &[f32]| -> Vec<f64> { sampler.probs(l).unwrap().iter().map(|&x| x as f64).collect() };
    let p1 = probs(&s.logits);
    let n = PROMPT.len();
    let mut joint = vec![0.0; V * V * V];
    for a in 0..V {
        assert!(model.restore(slot, &s.snap));
        let l2 = model.forward(&Batch::chunk(slot, n, &[a as u32]).unwrap(), &[0]).unwrap();
        let p2 = probs(&l2);
        let after_a = model.snapshot(slot).unwrap();
        for b in 0..V {
            assert!(model.restore(slot, &after_a));
            let l3 = model.forward(&Batch::chunk(slot, n + 1, &[b as u32]).unwrap(), &[0]).unwrap();
            for (c, p3) in probs(&l3).into_iter().enumerate() {
                joint[(a * V + b) * V + c] = p1[a] * p2[b] * p3;
            }
        }
    }
    let total: f64 = joint.iter().sum();
    assert!((total - 1.0).abs() < 1e-4, "the joint sums to {total}");
    joint
}

/// Counts of `(t1, t2, t3)` over `n` speculative generations with seeds `seed0..seed0 + n`, and
/// the summed acceptance statistics. The samples are split over a few threads, each with its own
/// model; every sample depends on its seed only, so the result does not depend on the split.
fn speculative_counts(s: &Setup, rule: SampledAcceptance, n: usize, seed0: u64) -> (Vec<u64>, SpecStats) {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).clamp(1, 4);
    let parts: Vec<(Vec<u64>, SpecStats)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|w| {
                let seeds = seed0 + (w * n / threads) as u64..seed0 + ((w + 1) * n / threads) as u64;
                sc.spawn(move || inline(|| counts_for(s, rule, seeds)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut counts = vec![0u64; V * V * V];
    let mut stats = SpecStats::default();
    for (c, a) in parts {
        counts.iter_mut().zip(c).for_each(|(x, y)| *x += y);
        add_stats(&mut stats, &a);
    }
    (counts, stats)
}

fn add_stats(into: &mut SpecStats, a: &SpecStats) {
    into.rounds += a.rounds;
    into.drafted += a.drafted;
    into.accepted += a.accepted;
    into.skipped += a.skipped;
    if into.pos_drafted.len() < a.pos_drafted.len() {
        into.pos_drafted.resize(a.pos_drafted.len(), 0);
        into.pos_accepted.resize(a.pos_drafted.len(), 0);
    }
    for k in 0..a.pos_drafted.len() {
        into.pos_drafted[k] += a.pos_drafted[k];
        into.pos_accepted[k] += a.pos_accepted[k];
    }
}

/// One thread's share of [`speculative_counts`].
fn counts_for(s: &Setup, rule: SampledAcceptance, seeds: std::ops::Range<u64>) -> (Vec<u64>, SpecStats) {
    let (mut model, slot) = load(s, 1);
    let mut spec = s.spec.clone();
    spec.sampled_acceptance = rule;
    let mut counts = vec![0u64; V * V * V];
    let mut stats = SpecStats::default();
    for seed in seeds {
        let (tokens, st) = sample_once(s, &spec, &mut model, slot, seed);
        let t = &tokens[..COUNTED];
        counts[(t[0] as usize * V + t[1] as usize) * V + t[2] as usize] += 1;
        add_stats(&mut stats, &st);
    }
    (counts, stats)
}

/// One speculative generation of [`GENERATED`] tokens with `seed`, from the prefilled prompt:
/// what `generate_speculative` does after its prefill.
fn sample_once(
    s: &Setup,
    spec: &SpecConfig,
    model: &mut Model<CpuBackend>,
    slot: usize,
    seed: u64,
) -> (Vec<u32>, SpecStats) {
    let opts = GenerateOptions { max_new_tokens: GENERATED, stop_ids: &[], prefill_chunk: 512 };
    assert!(model.restore(slot, &s.snap));
    let mut sampler = Sampler::new(params(seed)).unwrap();
    let mut st = SpecSeq::new(spec, seed);
    st.ring = s.ring.clone();
    let (tokens, _) =
        decode_speculative(model, slot, PROMPT.len(), &s.logits, &mut st, &mut sampler, &opts, spec).unwrap();
    assert_eq!(tokens.len(), GENERATED);
    (tokens, st.stats)
}

/// Pearson's χ² and its degrees of freedom; cells expected below 5 are pooled into one (and that
/// pool into the smallest other cell while it is still below 5).
fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pool = (0.0, 0.0);
    for (&o, &q) in counts.iter().zip(p) {
        let e = q * n as f64;
        if e < 5.0 {
            pool.0 += o as f64;
            pool.1 += e;
        } else {
            cells.push((o as f64, e));
        }
    }
    if pool.1 > 0.0 || pool.0 > 0.0 {
        if pool.1 < 5.0 {
            let i = (0..cells.len()).min_by(|&a, &b| cells[a].1.total_cmp(&cells[b].1)).unwrap();
            cells[i].0 += pool.0;
            cells[i].1 += pool.1;
        } else {
            cells.push(pool);
        }
    }
    let chi = cells.iter().map(|&(o, e)| (o - e) * (o - e) / e).sum();
    (chi, cells.len() - 1)
}

/// The 0.999 quantile of χ²(k), Wilson–Hilferty: `k (1 − 2/(9k) + z √(2/(9k)))³`.
fn chi2_q999(k: usize) -> f64 {
    let z = 3.090_232_306;
    let k = k as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Broken: accept with min(1, p/q), but resample a rejected slot from the target row itself
/// instead of the residual max(p − q, 0).
fn accept_no_residual(
    drafts: &[u32],
    q: Option<&[f32]>,
    p: &[f32],
    vocab: usize,
    rng: &mut ChaCha8Rng,
) -> (usize, u32) {
    let q = q.expect("sampled drafting gives its distributions");
    let l = p.len() / vocab - 1;
    for (k, &d) in drafts.iter().enumerate().take(l) {
        let (a, b) = (p[k * vocab + d as usize] as f64, q[k * vocab + d as usize] as f64);
        if rng.gen::<f64>() < (a / b).min(1.0) {
            continue;
        }
        return (k, sample(&p[k * vocab..(k + 1) * vocab], rng) as u32);
    }
    (l, sample(&p[l * vocab..(l + 1) * vocab], rng) as u32)
}

/// Broken: every draft is accepted; the bonus comes from the last row.
fn accept_all(drafts: &[u32], _q: Option<&[f32]>, p: &[f32], vocab: usize, rng: &mut ChaCha8Rng) -> (usize, u32) {
    let l = (p.len() / vocab - 1).min(drafts.len());
    (l, sample(&p[l * vocab..(l + 1) * vocab], rng) as u32)
}

fn rate(a: u64, d: u64) -> f64 {
    a as f64 / d.max(1) as f64
}

#[test]
fn dspark_sampling_is_lossless_through_the_model() {
    let t0 = std::time::Instant::now();
    let s = inline(setup);
    let exact = inline(|| exact_joint(&s));
    // The harness (restored snapshot + `decode_speculative`) is `generate_speculative`, sample for
    // sample.
    inline(|| {
        let (mut model, slot) = load(&s, 2);
        for seed in 1..9 {
            let (got, _) = sample_once(&s, &s.spec, &mut model, slot, seed);
            let opts = GenerateOptions { max_new_tokens: GENERATED, stop_ids: &[], prefill_chunk: 512 };
            let mut sampler = Sampler::new(params(seed)).unwrap();
            let (g, _) = generate_speculative(&mut model, &PROMPT, &mut sampler, &opts, &s.spec).unwrap();
            assert_eq!(got, g.tokens, "seed {seed}");
        }
    });
    let (counts, st) = speculative_counts(&s, dsv4_dspark::verify::accept_sampled::<ChaCha8Rng>, SAMPLES, 1);
    let (chi, dof) = chi_square(&counts, &exact);
    let thr = chi2_q999(dof);
    let per_pos: Vec<String> = st.per_position_acceptance().iter().map(|a| format!("{a:.3}")).collect();
    eprintln!(
        "real rule: {SAMPLES} samples, chi-square {chi:.1}, dof {dof}, 0.999 threshold {thr:.1}; {} rounds, \
         {} drafted, {} accepted (rate {:.3}, per slot {per_pos:?}), {:.1} s",
        st.rounds,
        st.drafted,
        st.accepted,
        rate(st.accepted, st.drafted),
        t0.elapsed().as_secs_f64()
    );
    assert!(st.accepted > 0 && st.accepted < st.drafted, "both acceptances and rejections: {st:?}");
    assert!(st.pos_drafted.len() == 2 && st.pos_accepted[1] > 0, "second draft slots verified and accepted: {st:?}");
    assert!(chi < thr, "chi-square {chi:.1} >= {thr:.1} (dof {dof}): speculative sampling is not lossless");
}

#[test]
fn broken_acceptance_rules_fail_the_same_test() {
    let t0 = std::time::Instant::now();
    let s = inline(setup);
    let exact = inline(|| exact_joint(&s));
    let rules: [(&str, SampledAcceptance); 2] = [("no residual", accept_no_residual), ("accept all", accept_all)];
    for (name, rule) in rules {
        let (counts, st) = speculative_counts(&s, rule, BROKEN_SAMPLES, 1);
        let (chi, dof) = chi_square(&counts, &exact);
        let thr = chi2_q999(dof);
        eprintln!(
            "broken rule \"{name}\": {BROKEN_SAMPLES} samples, chi-square {chi:.1}, dof {dof}, 0.999 threshold {thr:.1}; \
             acceptance {:.3}, {:.1} s",
            rate(st.accepted, st.drafted),
            t0.elapsed().as_secs_f64()
        );
        assert!(chi > 3.0 * thr, "the broken rule \"{name}\" passed: chi-square {chi:.1}, threshold {thr:.1}");
    }
}
