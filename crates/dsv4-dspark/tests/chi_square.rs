//! Lossless sampling: with temperature > 0, speculative rounds (draft from a proposal chain,
//! verify with `accept_sampled`) emit token sequences distributed exactly as sampling the target
//! step by step. A chi-square test over 40,000 two-token continuations on a 4-token vocabulary
//! accepts the real rule and rejects a deliberately broken one.

use dsv4_dspark::drafter::sample;
use dsv4_dspark::verify::accept_sampled;
use rand::{Rng, SeedableRng};

const V: usize = 4;

/// Target and draft "models": next-token distributions given the previous token.
fn target(prev: u32) -> [f32; V] {
    [[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1], [0.05, 0.6, 0.15, 0.2]][prev as usize]
}
fn draft(prev: u32) -> [f32; V] {
    [[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]][prev as usize]
}

/// A broken acceptance rule: after a rejection it resamples from the target instead of the
/// residual max(p − q, 0), which over-weights tokens the draft already proposes often.
fn accept_broken<R: Rng>(drafts: &[u32], q: &[f32], p: &[f32], rng: &mut R) -> (usize, u32) {
    let l = p.len() / V - 1;
    for (k, &d) in drafts.iter().enumerate().take(l) {
        let (a, b) = (p[k * V + d as usize] as f64, q[k * V + d as usize] as f64);
        if rng.gen::<f64>() < (a / b).min(1.0) {
            continue;
        }
        return (k, sample(&p[k * V..(k + 1) * V], rng) as u32);
    }
    (l, sample(&p[l * V..(l + 1) * V], rng) as u32)
}

/// The first two tokens after `anchor`, produced by speculative rounds with blocks of `l` drafts.
fn speculate<R: Rng>(anchor: u32, l: usize, broken: bool, rng: &mut R) -> (u32, u32) {
    let mut out: Vec<u32> = Vec::new();
    let mut last = anchor;
    while out.len() < 2 {
        let (mut drafts, mut q, mut p) = (Vec::new(), Vec::new(), Vec::new());
        let mut prev = last;
        p.extend_from_slice(&target(prev));
        for _ in 0..l {
            let qd = draft(prev);
            let d = sample(&qd, rng) as u32;
            q.extend_from_slice(&qd);
            drafts.push(d);
            p.extend_from_slice(&target(d));
            prev = d;
        }
        let (n, next) =
            if broken { accept_broken(&drafts, &q, &p, rng) } else { accept_sampled(&drafts, Some(&q), &p, V, rng) };
        out.extend_from_slice(&drafts[..n]);
        out.push(next);
        last = *out.last().expect("non-empty");
    }
    (out[0], out[1])
}

/// Chi-square statistic of the observed pair counts against the target chain.
fn chi_square(anchor: u32, l: usize, broken: bool, n: usize, seed: u64) -> f64 {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut counts = [[0usize; V]; V];
    for _ in 0..n {
        let (a, b) = speculate(anchor, l, broken, &mut rng);
        counts[a as usize][b as usize] += 1;
    }
    let mut chi = 0.0;
    for (a, row) in counts.iter().enumerate() {
        for (b, &o) in row.iter().enumerate() {
            let e = n as f64 * target(anchor)[a] as f64 * target(a as u32)[b] as f64;
            chi += (o as f64 - e) * (o as f64 - e) / e;
        }
    }
    chi
}

/// 15 degrees of freedom: the 0.1% critical value is 37.70.
const CRITICAL: f64 = 37.70;

#[test]
fn speculative_sampling_matches_the_target_distribution() {
    for (anchor, l) in [(0u32, 1usize), (1, 2), (2, 3), (3, 5)] {
        let chi = chi_square(anchor, l, false, 40_000, 11 + l as u64);
        println!("anchor {anchor}, {l} drafts: chi-square {chi:.1}");
        assert!(chi < CRITICAL, "anchor {anchor} l {l}: chi-square {chi}");
    }
}

#[test]
fn a_broken_acceptance_rule_fails_the_same_test() {
    for (anchor, l) in [(0u32, 1usize), (1, 2), (3, 5)] {
        let chi = chi_square(anchor, l, true, 40_000, 11 + l as u64);
        println!("broken rule, anchor {anchor}, {l} drafts: chi-square {chi:.1}");
        assert!(chi > CRITICAL, "the broken rule passed: anchor {anchor} l {l}: chi-square {chi}");
    }
}
