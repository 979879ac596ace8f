//! A step's token choice per output row, made where the logits are: greedy argmax, or a seeded
//! draw under temperature, top-k, top-p and min-p (issue 11 item 5: only token ids cross to the
//! host). [`draw_row`] is the CPU twin of the CUDA kernel `draw_rows` (`cuda/kernels/draw.cu`)
//! and defines its arithmetic.
//!
//! The distribution is the engine's host sampler's (`dsv4_engine::Sampler`): weights
//! `exp((v − max) / T)`; top-k keeps the k best by (value, then lowest id); top-p the shortest
//! best-first prefix whose mass reaches `top_p`; min-p the tokens whose weight is at least
//! `min_p` times the best one's; the draw walks the kept tokens best-first (in id order when no
//! filter is set) until its uniform `u` times their mass is reached. What differs is the
//! arithmetic: `x = (v − max) · (1/T)` in f32, `exp(x)` by a degree-6 polynomial of `2^f` in
//! f32 ([`weight_of`]), and every weight an integer multiple of 2⁻⁴⁶ (`u64`), so every mass,
//! cut and walk is an integer sum, exact in any order. The CUDA kernel repeats those f32
//! operations in the same order, unfused, so it gives this twin's weights bit for bit and a
//! GPU block the same token whatever its reduction order (replayed steps the eager ones').
//!
//! Tolerance against the host sampler (f64, unrounded), for the same `u`: each weight is within
//! 2·10⁻⁶ of its f64 value relatively (the f32 `x`, its product with log₂e and the
//! polynomial: `weights_are_exp_within_two_millionths`) plus 2⁻⁴⁷ of the best token's (the rounding; tokens
//! more than 33·T below the maximum get weight 0, probability below 5·10⁻¹⁵ each), so a CDF
//! boundary moves by at most ~2·10⁻⁶ of the mass; the tokens differ only when `u` falls that
//! close to a boundary.

/// How one output row's token is chosen. `temperature == 0` is greedy (the other fields are
/// ignored); otherwise `u ∈ [0, 1)` is the row's uniform draw, taken by the caller from the
/// request's seeded generator (the one draw the host sampler would take).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: u32,
    /// In (0, 1]; 1 disables.
    pub top_p: f32,
    /// In [0, 1]; 0 disables.
    pub min_p: f32,
    pub u: f64,
}

impl Draw {
    pub const GREEDY: Draw = Draw { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0 };

    /// The `u32` words of one row's entry in the device's draw table (`draw.cu`'s layout):
    /// temperature, top_k, top_p, min_p (f32 bits), then `u`'s f64 bits, low word first.
    pub fn words(&self) -> [u32; DRAW_WORDS] {
        let u = self.u.to_bits();
        [self.temperature.to_bits(), self.top_k, self.top_p.to_bits(), self.min_p.to_bits(), u as u32, (u >> 32) as u32]
    }

    /// Whether the draw walks best-first (a filter is set) rather than in id order.
    fn sorted(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The filter mixes (temperature, top-k, top-p, min-p) the draw's checks sweep (here, against the
/// host sampler, and on the GPU): greedy, no filter, each filter alone and mixed, top-k of one
/// and past a small row, a tiny temperature, and at T 0.05 top-k counts that reach past every
/// token within 33·T of the best (the device's value bins).
pub const CHECKED_MIXES: [(f32, u32, f32, f32); 13] = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 40, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (1.3, 0, 0.999, 0.0),
    (0.8, 0, 1.0, 0.05),
    (0.9, 300, 0.95, 0.01),
    (2.0, 0, 0.5, 0.1),
    (0.6, 1, 1.0, 0.0),
    (0.6, 5000, 1.0, 0.0),
    (0.05, 300, 1.0, 0.0),
    (0.05, 20, 0.9, 0.0),
    (1e-30, 0, 1.0, 0.0),
];

/// `u32` words a row takes in the device's draw table.
pub const DRAW_WORDS: usize = 6;

/// The widest row the device draws: its histograms sum a weight's 12-bit limbs in `u32`s.
pub const DRAW_MAX_COLS: usize = 1 << 20;

/// One unit of weight: the best token weighs `2^46` (a vocabulary's sum stays below 2⁶³).
const ONE: f64 = (1u64 << 46) as f64;

/// The widest row the device *samples* (T > 0): a flat row of `V` tokens sums to `V · 2^46`,
/// below 2⁶³ only up to 2¹⁷ tokens (V4's 129,280 fit). Wider vocabularies sample on the host
/// (the engine switches `host_sampling` on); greedy rows sum nothing and take up to
/// [`DRAW_MAX_COLS`].
pub const DRAW_MAX_SAMPLED_COLS: usize = 1 << 17;

/// The total order of `f32` (Rust's `total_cmp`) as an unsigned key: a larger key is a larger
/// value.
pub fn key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// `x = (v − m) · inv_t` in f32 (`inv_t = 1 / T` in f32; 0 where `v == m`): the token's
/// log-weight, the same roundings on the device.
pub fn log_weight(v: f32, m: f32, inv_t: f32) -> f32 {
    let d = v - m;
    // The best token is 0 even where 1/T overflows to infinity (0 · ∞ would be NaN).
    if d == 0.0 {
        0.0
    } else {
        d * inv_t
    }
}

/// Coefficients of `2^f` on `[−½, ½]` (the Taylor series of `e^{f·ln 2}`, degree 6: within
/// ~1.2·10⁻⁷ relative), highest first.
const EXP2_POLY: [f32; 7] = [1.540_353e-4, 1.333_355_8e-3, 9.618_129e-3, 5.550_411e-2, 2.402_265e-1, 6.931_472e-1, 1.0];

/// `exp(x)` for `x ≤ 0` in units of 2⁻⁴⁶ (`x` from [`log_weight`]), rounded half up; 0 below
/// −33 (and for NaN). f32 operations in a fixed order, none fused (the device compiles draw.cu
/// with `--fmad=false`), then integer shifts: the CUDA kernel computes the same bits. Against
/// the f64 `exp` it is within 2·10⁻⁶ relative (see the module doc's tolerance).
pub fn weight_of(x: f32) -> u64 {
    if x.is_nan() || x < -33.0 {
        return 0;
    }
    let t = x * std::f32::consts::LOG2_E;
    let n = t.round_ties_even();
    let f = t - n;
    let mut p = EXP2_POLY[0];
    for &c in &EXP2_POLY[1..] {
        p = p * f + c;
    }
    // p = m24 · 2^(e − 23) with m24 the 24-bit significand: the weight m24 · 2^(e − 23 + n + 46).
    let b = p.to_bits();
    let m24 = ((b & 0x7f_ffff) | 0x80_0000) as u64;
    let shift = ((b >> 23) & 0xff) as i32 - 127 - 23 + n as i32 + 46;
    if shift >= 0 {
        m24 << shift
    } else if shift > -40 {
        (m24 + (1 << (-shift - 1))) >> -shift
    } else {
        0
    }
}

/// A token's weight: [`weight_of`] its [`log_weight`].
pub fn weight(v: f32, m: f32, inv_t: f32) -> u64 {
    weight_of(log_weight(v, m, inv_t))
}

/// The first index of the largest value (NaN never wins; a row of NaN gives 0): the greedy
/// choice, as the device's argmax makes it.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) && !v.is_nan() {
            best = Some((i, v));
        }
    }
    best.map_or(0, |b| b.0 as u32)
}

/// The token of `row` under `d` (see the module doc for the arithmetic the device repeats).
pub fn draw_row(row: &[f32], d: &Draw) -> u32 {
    let best = argmax(row);
    let m = row.get(best as usize).copied().unwrap_or(0.0);
    if d.temperature <= 0.0 || row.is_empty() || !m.is_finite() {
        return best;
    }
    let inv_t = 1.0 / d.temperature;
    let w = |v: f32| weight(v, m, inv_t);
    if !d.sorted() {
        let total: u64 = row.iter().map(|&v| w(v)).sum();
        let r = target(d.u, total);
        let mut acc = 0u64;
        for (i, &v) in row.iter().enumerate() {
            acc += w(v);
            if acc >= r {
                return i as u32;
            }
        }
        return best;
    }
    // Best first: by value (total order), then lowest id.
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| key(row[b as usize]).cmp(&key(row[a as usize])).then(a.cmp(&b)));
    let k = if d.top_k > 0 { (d.top_k as usize).min(row.len()) } else { row.len() };
    let kept = &order[..k];
    let total: u64 = kept.iter().map(|&i| w(row[i as usize])).sum();
    let mut keep = k;
    if d.top_p < 1.0 {
        let p = (d.top_p as f64 * total as f64).ceil() as u64;
        let mut acc = 0u64;
        let cut = kept.iter().position(|&i| {
            acc += w(row[i as usize]);
            acc >= p
        });
        keep = cut.map_or(k, |j| j + 1);
    }
    let floor = min_p_floor(d.min_p);
    let kept = &kept[..keep];
    let mass: u64 = kept.iter().map(|&i| w(row[i as usize])).filter(|&x| x >= floor).sum();
    let r = target(d.u, mass);
    let mut acc = 0u64;
    for &i in kept {
        let x = w(row[i as usize]);
        if x >= floor {
            acc += x;
            if acc >= r {
                return i;
            }
        }
    }
    best
}

/// The weight below which min-p drops a token (0: min-p off).
pub fn min_p_floor(min_p: f32) -> u64 {
    if min_p > 0.0 {
        (min_p as f64 * ONE).ceil() as u64
    } else {
        0
    }
}

/// The draw's position in a kept mass: the first token whose running sum reaches it, so
/// `1 ≤ r ≤ mass` and a token of weight 0 is never drawn.
pub fn target(u: f64, mass: u64) -> u64 {
    (((u * mass as f64).floor() as u64).saturating_add(1)).min(mass)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn keys_follow_the_total_order() {
        let vals = [f32::NEG_INFINITY, -3.5, -1.0, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{} {}", w[0], w[1]);
            assert_eq!(w[0].total_cmp(&w[1]), key(w[0]).cmp(&key(w[1])));
        }
    }

    #[test]
    fn greedy_and_tiny_temperatures_take_the_first_maximum() {
        let row = [0.5f32, 3.0, -2.0, 3.0, 1.0];
        assert_eq!(draw_row(&row, &Draw::GREEDY), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        for t in [1e-40f32, 1e-20, f32::MIN_POSITIVE] {
            for u in [0.0, 0.3, 0.999_999] {
                let d = Draw { temperature: t, u, ..Draw::GREEDY };
                // Two maxima share the mass: the walk in id order meets 1 first, then 3.
                let got = draw_row(&row, &d);
                assert_eq!(got, if u < 0.5 { 1 } else { 3 }, "t {t} u {u}");
                let d = Draw { top_k: 2, ..d };
                assert!([1, 3].contains(&draw_row(&row, &d)));
            }
        }
    }

    /// The filters keep what they say: over many `u`, top-k draws only the k best, min-p only
    /// tokens above its floor, top-p only the shortest best prefix reaching its mass; and the
    /// frequencies follow the weights.
    #[test]
    fn draws_stay_inside_the_filters_and_follow_the_weights() {
        let mut rnd = lcg(11);
        let row: Vec<f32> = (0..300).map(|_| (rnd() * 8.0 - 4.0) as f32).collect();
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let t = 0.9f64;
        let m = row[order[0]];
        let p: Vec<f64> = row.iter().map(|&v| ((v as f64 - m as f64) / t).exp()).collect();
        let sum: f64 = p.iter().sum();
        // top-p 0.8: the shortest prefix reaching 0.8 of the mass.
        let mut acc = 0.0;
        let nucleus = order.iter().position(|&i| {
            acc += p[i] / sum;
            acc >= 0.8
        });
        let nucleus = &order[..nucleus.unwrap() + 1];
        let n = 20_000;
        let mut counts = vec![0usize; row.len()];
        for j in 0..n {
            let u = (j as f64 + 0.5) / n as f64;
            let base = Draw { temperature: t as f32, top_k: 0, top_p: 1.0, min_p: 0.0, u };
            let tk = draw_row(&row, &Draw { top_k: 7, ..base }) as usize;
            assert!(order[..7].contains(&tk));
            let mp = draw_row(&row, &Draw { min_p: 0.3, ..base }) as usize;
            assert!(p[mp] >= 0.3 - 1e-12, "min-p drew weight {}", p[mp]);
            let tp = draw_row(&row, &Draw { top_p: 0.8, ..base }) as usize;
            assert!(nucleus.contains(&tp));
            counts[draw_row(&row, &base) as usize] += 1;
        }
        // u on a grid: each token's count is its mass · n within the grid's rounding.
        for (i, &c) in counts.iter().enumerate() {
            assert!((c as f64 - p[i] / sum * n as f64).abs() <= 1.5, "token {i}: {c} vs {}", p[i] / sum * n as f64);
        }
    }

    /// The f32 weights against f64 `exp`: within 2·10⁻⁶ relative plus the 2⁻⁴⁷ rounding, the best
    /// token exactly 2⁴⁶, nothing below −33 (nor NaN), and never increasing as `x` falls.
    #[test]
    fn weights_are_exp_within_two_millionths() {
        assert_eq!(weight_of(0.0), 1 << 46);
        assert_eq!(weight_of(-33.000_004), 0);
        assert_eq!(weight_of(f32::NAN), 0);
        assert_eq!(weight_of(f32::NEG_INFINITY), 0);
        let mut prev = u64::MAX;
        let mut worst = 0f64;
        for i in 0..=3_300_000u32 {
            let x = -(i as f32) * 1e-5;
            let w = weight_of(x);
            assert!(w <= prev, "weight rises at x = {x}");
            prev = w;
            let e = (x as f64).exp();
            let err = (w as f64 / ONE - e).abs();
            assert!(err <= 2e-6 * e + 0.5 / ONE, "x = {x}: {} vs {e}", w as f64 / ONE);
            if e > 1e-6 {
                worst = worst.max(err / e);
            }
        }
        assert!(worst > 0.0 && worst < 2e-6, "worst relative error {worst:e}");
        println!("worst relative error {worst:e} (weights above 10⁻⁶)");
    }

    #[test]
    fn the_draw_target_stays_in_the_mass() {
        assert_eq!(target(0.0, 10), 1);
        assert_eq!(target(0.999_999_999, 10), 10);
        // Past 2⁵³ the product rounds: still inside the mass.
        let big = (1u64 << 63) - 1;
        assert!((1..=big).contains(&target(0.999_999_999_999_999_9, big)));
        assert_eq!(target(0.999_999_999_999_999_9, 1 << 40), 1 << 40);
        assert_eq!(Draw::GREEDY.words()[0], 0);
        let d = Draw { temperature: 0.5, top_k: 3, top_p: 0.9, min_p: 0.1, u: 0.25 };
        let w = d.words();
        assert_eq!(f64::from_bits(w[4] as u64 | (w[5] as u64) << 32), 0.25);
    }
}
