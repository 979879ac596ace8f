//! Rollback without replay on the GPU (the CUDA twin of `rollback.rs`): after a verify forward
//! over [anchor, d0..d(l-1)] and a cut back to the accepted prefix, the sequence continues like a
//! plain run to the same position and its state saved to the host equals the plain run's (in
//! canonical form), at every alignment against the CSA and HCA ratios, for every number of
//! accepted drafts. Built with `--features cuda`; prints "skipping: no CUDA device" elsewhere.
//!
//! Both sides run on the GPU in exact mode and feed their rows in the same chunks ([prefix],
//! [anchor + accepted drafts], then one token at a time), except that the speculative side's
//! verify batch also holds the rejected drafts. Logits and states are compared to [`TOL`] relative
//! (max |a − b| / max |b|): a cuBLAS product may round a row differently at another batch size
//! (measured on the H200: up to 1.1e-6 between chunkings [p, 3, 1, 1, 1] and [p + 3, 3] with no
//! rollback at all, ~8e-7 worst over the rollback cases), while a stale or missing row shows as
//! O(1). How many comparisons were bitwise equal is printed.
#![cfg(feature = "cuda")]

mod common;
use common::{fixtures_dir, gpu, rel_err, tokens, write_random};
use dsv4_backend::cpu::state::CompState;
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::{Batch, Model, SeqState, MAX_ROLLBACK};
use dsv4_model::synth::tiny_config;

/// Ten times the batch-size rounding noise measured on the H200 (see the module docs).
const TOL: f64 = 1e-5;

/// Max relative difference of two float slices of the same length (0 when both are empty).
fn diff(what: &str, a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if a.is_empty() || a == b {
        return 0.0;
    }
    // −∞ overlap rows (before any closed window) compare by equality above.
    let fin = |v: &f32| v.is_finite();
    assert!(a.iter().zip(b).all(|(x, y)| fin(x) == fin(y)), "{what}: nonfinite values differ");
    let (fa, fb): (Vec<f32>, Vec<f32>) = a.iter().zip(b).filter(|(x, _)| fin(x)).map(|(x, y)| (*x, *y)).unzip();
    if fb.iter().all(|v| *v == 0.0) {
        return if fa == fb { 0.0 } else { f64::INFINITY };
    }
    rel_err(&fa, &fb)
}

fn comp_diff(what: &str, a: &CompState, b: &CompState) -> f64 {
    assert_eq!(a.hist_start, b.hist_start, "{what}: history start");
    [
        diff(&format!("{what} open_u"), &a.open_u, &b.open_u),
        diff(&format!("{what} open_z"), &a.open_z, &b.open_z),
        diff(&format!("{what} prev_u"), &a.prev_u, &b.prev_u),
        diff(&format!("{what} prev_z"), &a.prev_z, &b.prev_z),
        diff(&format!("{what} entries"), &a.entries, &b.entries),
        diff(&format!("{what} hist_u"), &a.hist_u, &b.hist_u),
        diff(&format!("{what} hist_z"), &a.hist_z, &b.hist_z),
    ]
    .into_iter()
    .fold(0.0, f64::max)
}

/// Max relative difference over every buffer of two states of the same shape.
fn state_diff(a: &SeqState, b: &SeqState) -> f64 {
    assert_eq!(a.layers.len(), b.layers.len());
    let mut e = 0f64;
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        assert_eq!(x.ring_pos, y.ring_pos, "layer {i}: window positions");
        e = e.max(diff(&format!("layer {i} ring"), &x.ring, &y.ring));
        for (n, (c, d)) in [("comp", (&x.comp, &y.comp)), ("index", (&x.index, &y.index))] {
            match (c, d) {
                (Some(c), Some(d)) => e = e.max(comp_diff(&format!("layer {i} {n}"), c, d)),
                (None, None) => {}
                _ => panic!("layer {i} {n}: present on one side only"),
            }
        }
    }
    e
}

/// Counts of comparisons made and of those that were bitwise equal, and the worst difference.
#[derive(Default)]
struct Tally {
    cases: usize,
    logits_exact: usize,
    state_exact: usize,
    worst: f64,
}

impl Tally {
    fn add(&mut self, logits: f64, state: f64) {
        self.cases += 1;
        self.logits_exact += (logits == 0.0) as usize;
        self.state_exact += (state == 0.0) as usize;
        self.worst = self.worst.max(logits).max(state);
    }
    fn print(&self, name: &str) {
        println!(
            "{name}: {} cases, logits bitwise equal in {}, states bitwise equal in {}, worst rel diff {:.2e}",
            self.cases, self.logits_exact, self.state_exact, self.worst
        );
    }
}

/// One speculative round against a plain run, in slots of `m` that are freed afterwards (the
/// next case reuses them, stale rows and all): prefix `p`, verify [anchor + drafts] (true for the
/// first `j`), cut to `p + 1 + j`; then the two states and three more tokens' logits compared.
fn check_case(m: &mut Model<CudaBackend>, toks: &[u32], vocab: u32, p: usize, l: usize, j: usize, t: &mut Tally) {
    let mut drafts: Vec<u32> = toks[p + 1..p + 1 + l].to_vec();
    for (k, d) in drafts.iter_mut().enumerate().skip(j) {
        *d = (*d + 1 + k as u32) % vocab;
    }
    let window = m.cfg.window;
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, &toks[..p], &[p]).unwrap();
    let mut block = vec![toks[p]];
    block.extend(&drafts);
    m.forward(&Batch::chunk(s, p, &block).unwrap(), &[0]).unwrap();
    m.truncate(s, p + 1 + j).unwrap();
    let u = m.alloc_seq().unwrap();
    m.prefill_chunks(u, &toks[..p + 1 + j], &[p, 1 + j]).unwrap();
    let a = m.snapshot(s).unwrap();
    let b = m.snapshot(u).unwrap();
    assert_eq!(a.len, b.len);
    let se = state_diff(&a.state.canonical(a.len, window), &b.state.canonical(b.len, window));
    assert!(se <= TOL, "state differs after p={p} l={l} j={j}: {se:e}");
    let next = &toks[p + 1 + j..p + 4 + j];
    let x = m.prefill_chunks(s, next, &[1, 1, 1]).unwrap();
    let y = m.prefill_chunks(u, next, &[1, 1, 1]).unwrap();
    let le = if x == y { 0.0 } else { rel_err(&x, &y) };
    assert!(le <= TOL, "continuation differs after p={p} l={l} j={j}: {le:e}");
    t.add(le, se);
    m.free_seq(s);
    m.free_seq(u);
}

#[test]
fn cuda_cut_back_equals_plain_run_at_every_alignment() {
    let Some(b) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.layers[2].ratio = 16; // HCA 16: windows close inside and across verify blocks
    cfg.layers[4].ratio = 16;
    write_random(dir.path(), &cfg, 21);
    let mut m = Model::load(b, dir.path(), 2, false).unwrap();
    let toks = tokens(120, 97, 5);
    let mut t = Tally::default();
    for p in (30..50).chain([63, 64, 79, 80]) {
        for l in 1..=5usize {
            for j in 0..=l {
                check_case(&mut m, &toks, 97, p, l, j, &mut t);
            }
        }
    }
    // The longest rollback: anchor + MAX_ROLLBACK drafts, none accepted (window 8: the ring's
    // margin is all that holds the window).
    for p in [31, 40, 47, 64] {
        for j in [0, 1, MAX_ROLLBACK / 2, MAX_ROLLBACK] {
            check_case(&mut m, &toks, 97, p, MAX_ROLLBACK, j, &mut t);
        }
    }
    t.print("tiny (window 8, CSA 4, HCA 16)");
    assert!(t.cases > 400);
}

#[test]
fn cuda_cut_back_across_hca128_windows() {
    let Some(b) = gpu() else { return };
    let mut m = Model::load(b, &fixtures_dir().join("csa4_hca128_long"), 2, false).unwrap();
    let toks = tokens(290, 97, 6);
    let mut t = Tally::default();
    for p in [112, 120, 124, 125, 126, 127, 128, 129, 131, 250, 252, 253, 254, 255, 256, 257] {
        for l in 1..=5usize {
            for j in 0..=l {
                check_case(&mut m, &toks, 97, p, l, j, &mut t);
            }
        }
    }
    for p in [111, 126, 127, 128, 240, 255] {
        for j in [0, 1, MAX_ROLLBACK / 2, MAX_ROLLBACK] {
            check_case(&mut m, &toks, 97, p, MAX_ROLLBACK, j, &mut t);
        }
    }
    t.print("csa4_hca128_long (window 16)");
}

/// Many speculative rounds in a row (each one's rejected rows left in the rings for the next to
/// overwrite) end where a plain run does.
#[test]
fn cuda_chained_rounds_equal_plain_run() {
    let Some(b) = gpu() else { return };
    let mut m = Model::load(b, &fixtures_dir().join("csa4_hca128_long"), 2, false).unwrap();
    let window = m.cfg.window;
    let toks = tokens(320, 97, 7);
    let s = m.alloc_seq().unwrap();
    let mut len = 100;
    m.prefill_chunks(s, &toks[..len], &[len]).unwrap();
    let mut rng = 12345u64;
    let mut rounds = 0;
    while len < 270 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let l = 1 + (rng >> 33) as usize % MAX_ROLLBACK;
        let j = (rng >> 45) as usize % (l + 1);
        let mut block = toks[len..len + 1 + l].to_vec();
        for (k, d) in block.iter_mut().enumerate().skip(1 + j) {
            *d = (*d + k as u32) % 97;
        }
        m.forward(&Batch::chunk(s, len, &block).unwrap(), &[0]).unwrap();
        len += 1 + j;
        m.truncate(s, len).unwrap();
        rounds += 1;
    }
    let u = m.alloc_seq().unwrap();
    m.prefill_chunks(u, &toks[..len], &[len]).unwrap();
    let a = m.snapshot(s).unwrap();
    let c = m.snapshot(u).unwrap();
    let se = state_diff(&a.state.canonical(len, window), &c.state.canonical(len, window));
    let next = &toks[len..len + 8];
    let x = m.prefill_chunks(s, next, &[8]).unwrap();
    let y = m.prefill_chunks(u, next, &[8]).unwrap();
    let le = rel_err(&x, &y);
    println!("{rounds} chained rounds to {len}: state rel diff {se:.2e}, logits rel diff {le:.2e}");
    assert!(se <= TOL && le <= TOL, "{se:e} {le:e}");
}

#[test]
fn cuda_cutting_back_too_far_is_an_error() {
    let Some(b) = gpu() else { return };
    let mut m = Model::load(b, &fixtures_dir().join("csa4_hca128_long"), 2, false).unwrap();
    let toks = tokens(100, 97, 1);
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, &toks[..60], &[60]).unwrap();
    let e = m.truncate(s, 60 - MAX_ROLLBACK - 1).unwrap_err().to_string();
    assert!(e.contains("rolled back"), "{e}");
    assert!(m.truncate(s, 61).is_err());
    m.truncate(s, 60 - MAX_ROLLBACK).unwrap();
    // The rows written past the length still count: 44 → 60 (written) → 44 → 45 → 43 would need
    // rows the second pass overwrote.
    m.prefill_chunks(s, &toks[44..60], &[16]).unwrap();
    m.truncate(s, 44).unwrap();
    m.prefill_chunks(s, &toks[44..45], &[1]).unwrap();
    let e = m.truncate(s, 43).unwrap_err().to_string();
    assert!(e.contains("rolled back"), "{e}");
    m.truncate(s, 44).unwrap();
    // A restored slot cannot go below the snapshot's length (its earlier rows were never
    // uploaded), but rolls back above it.
    let snap = m.snapshot(s).unwrap();
    let u = m.alloc_seq().unwrap();
    assert!(m.restore(u, &snap));
    assert!(m.truncate(u, 43).is_err());
    m.prefill_chunks(u, &toks[44..50], &[6]).unwrap();
    m.truncate(u, 44).unwrap();
    let x = m.prefill_chunks(u, &toks[44..47], &[3]).unwrap();
    let y = m.prefill_chunks(s, &toks[44..47], &[3]).unwrap();
    let e = rel_err(&x, &y);
    assert!(e <= TOL, "restored, fed and cut back vs original: {e:e}");
}
