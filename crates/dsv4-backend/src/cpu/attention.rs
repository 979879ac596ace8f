//! Compressor, lightning indexer and core attention of the CPU backend (spec §5.4–§5.6, §9.2).

use super::linalg::{dot, rms_norm};
use super::state::{CompState, CpuCache};
use super::Tensor;
use crate::batch::Batch;
use dsv4_model::Config;
use rayon::prelude::*;

/// Interleaved RoPE on the last `2·freqs.len()` channels of one `head`-wide vector.
pub fn rope_vec(v: &mut [f32], pos: usize, freqs: &[f64], inverse: bool) {
    let r = 2 * freqs.len();
    let base = v.len() - r;
    for (i, f) in freqs.iter().enumerate() {
        let mut th = pos as f64 * f;
        if inverse {
            th = -th;
        }
        let (s, c) = (th.sin() as f32, th.cos() as f32);
        let (a, b) = (v[base + 2 * i], v[base + 2 * i + 1]);
        v[base + 2 * i] = a * c - b * s;
        v[base + 2 * i + 1] = a * s + b * c;
    }
}

/// Per-channel softmax over rows of `z` weighting rows of `u` (rows of width `head`).
fn pool(u: &[&[f32]], z: &[&[f32]], head: usize) -> Vec<f32> {
    let mut out = vec![0f32; head];
    for (k, o) in out.iter_mut().enumerate() {
        let m = z.iter().map(|r| r[k]).fold(f32::NEG_INFINITY, f32::max);
        let mut den = 0f32;
        let mut num = 0f32;
        for (zr, ur) in z.iter().zip(u) {
            let e = (zr[k] - m).exp();
            den += e;
            num += e * ur[k];
        }
        *o = num / den;
    }
    out
}

/// COMPRESSOR_FEED of spec §9.2 for one sequence's consecutive rows.
#[allow(clippy::too_many_arguments)]
pub fn compress_rows(
    st: &mut CompState,
    u: &[f32],
    z: &[f32],
    positions: impl Iterator<Item = usize>,
    ape: &[f32],
    norm: &[f32],
    freqs: &[f64],
    eps: f32,
) {
    let (m, d, w) = (st.ratio, st.head, st.width());
    for (i, p) in positions.enumerate() {
        debug_assert_eq!(st.n_open(), p % m, "compressor state does not continue at position {p}");
        let zr: Vec<f32> =
            z[i * w..(i + 1) * w].iter().zip(&ape[(p % m) * w..(p % m + 1) * w]).map(|(a, b)| a + b).collect();
        st.record(&u[i * w..(i + 1) * w], &zr);
        st.open_u.extend_from_slice(&u[i * w..(i + 1) * w]);
        st.open_z.extend_from_slice(&zr);
        if (p + 1) % m != 0 {
            continue;
        }
        let win = (p + 1) / m - 1;
        fn row(buf: &[f32], r: usize, lo: usize, w: usize, d: usize) -> &[f32] {
            &buf[r * w + lo..r * w + lo + d]
        }
        let pooled = if st.overlap {
            let mut ur: Vec<&[f32]> = (0..m).map(|r| &st.prev_u[r * d..(r + 1) * d]).collect();
            let mut zr: Vec<&[f32]> = (0..m).map(|r| &st.prev_z[r * d..(r + 1) * d]).collect();
            ur.extend((0..m).map(|r| row(&st.open_u, r, d, w, d)));
            zr.extend((0..m).map(|r| row(&st.open_z, r, d, w, d)));
            pool(&ur, &zr, d)
        } else {
            let ur: Vec<&[f32]> = (0..m).map(|r| row(&st.open_u, r, 0, w, d)).collect();
            let zr: Vec<&[f32]> = (0..m).map(|r| row(&st.open_z, r, 0, w, d)).collect();
            pool(&ur, &zr, d)
        };
        if st.overlap {
            // Keep the A-halves of this window for the next one.
            for r in 0..m {
                st.prev_u[r * d..(r + 1) * d].copy_from_slice(&st.open_u[r * w..r * w + d]);
                st.prev_z[r * d..(r + 1) * d].copy_from_slice(&st.open_z[r * w..r * w + d]);
            }
        }
        let mut c = rms_norm(&pooled, d, Some(norm), eps);
        rope_vec(&mut c, win * m, freqs, false);
        st.entries.extend_from_slice(&c);
        st.open_u.clear();
        st.open_z.clear();
    }
}

/// Lightning-indexer top-k: for each row, the indices of the selected visible entries, ordered
/// by score (descending), ties broken by the lower entry index.
pub fn index_select(
    cache: &CpuCache,
    layer: usize,
    qi: &Tensor,
    wts: &Tensor,
    batch: &Batch,
    cfg: &Config,
) -> Vec<Vec<u32>> {
    let (nh, hd) = (cfg.index_n_heads, cfg.index_head_dim);
    let (qs, ws) = ((hd as f32).powf(-0.5), (nh as f32).powf(-0.5));
    batch
        .rows
        .par_iter()
        .enumerate()
        .map(|(t, row)| {
            let st = cache.layer(row.seq, layer).index.as_ref().expect("CSA layer without indexer state");
            let vis = (row.pos + 1) / st.ratio;
            let k = cfg.index_topk.min(vis);
            if k == 0 {
                return Vec::new();
            }
            let q = qi.row(t);
            let w = wts.row(t);
            let mut scored: Vec<(f32, u32)> = (0..vis)
                .map(|s| {
                    let kv = st.entry(s);
                    let mut acc = 0f32;
                    for h in 0..nh {
                        let v = dot(&q[h * hd..(h + 1) * hd], kv).max(0.0) * qs;
                        acc += w[h] * ws * v;
                    }
                    (acc, s as u32)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            scored.truncate(k);
            scored.into_iter().map(|(_, s)| s).collect()
        })
        .collect()
}

/// Sink-softmax attention of every row over its window rows and compressed entries; afterwards
/// the chunk's KV rows are written into the window ring.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    cache: &mut CpuCache,
    layer: usize,
    q: &Tensor,
    kv: &Tensor,
    sel: Option<&Vec<Vec<u32>>>,
    sinks: &[f32],
    batch: &Batch,
    cfg: &Config,
) -> Tensor {
    let (h, d, win) = (cfg.n_heads, cfg.head_dim, cfg.window);
    let scale = (d as f32).powf(-0.5);
    let seg_of: Vec<usize> =
        batch.segments.iter().enumerate().flat_map(|(i, s)| std::iter::repeat_n(i, s.len)).collect();
    let cache_ro: &CpuCache = cache;
    let out: Vec<Vec<f32>> = batch
        .rows
        .par_iter()
        .enumerate()
        .map(|(t, row)| {
            let seg = batch.segments[seg_of[t]];
            let ls = cache_ro.layer(row.seq, layer);
            let p = row.pos;
            let lo = (p + 1).saturating_sub(win);
            let mut keys: Vec<&[f32]> = Vec::new();
            // Window rows from before this chunk (ring), then from the chunk itself.
            for pp in lo..seg.pos0.min(p + 1) {
                let slot = pp % ls.cap();
                assert_eq!(ls.ring_pos[slot], pp, "window ring lost position {pp}");
                keys.push(&ls.ring[slot * d..(slot + 1) * d]);
            }
            for pp in lo.max(seg.pos0)..=p {
                keys.push(kv.row(seg.start + pp - seg.pos0));
            }
            if let Some(c) = &ls.comp {
                match sel {
                    Some(sel) => keys.extend(sel[t].iter().map(|&s| c.entry(s as usize))),
                    None => keys.extend((0..(p + 1) / c.ratio).map(|s| c.entry(s))),
                }
            }
            let qr = q.row(t);
            let mut o = vec![0f32; h * d];
            let mut sc = vec![0f32; keys.len()];
            for hh in 0..h {
                let qh = &qr[hh * d..(hh + 1) * d];
                for (s, k) in sc.iter_mut().zip(&keys) {
                    *s = dot(qh, k) * scale;
                }
                let m = sc.iter().copied().fold(sinks[hh], f32::max);
                let mut den = (sinks[hh] - m).exp();
                for s in sc.iter_mut() {
                    *s = (*s - m).exp();
                    den += *s;
                }
                let oh = &mut o[hh * d..(hh + 1) * d];
                for (s, k) in sc.iter().zip(&keys) {
                    let pw = s / den;
                    for (a, b) in oh.iter_mut().zip(k.iter()) {
                        *a += pw * b;
                    }
                }
            }
            o
        })
        .collect();
    for seg in &batch.segments {
        let ls = cache.layer_mut(seg.seq, layer);
        let cap = ls.cap();
        for i in seg.len.saturating_sub(cap)..seg.len {
            let p = seg.pos0 + i;
            let slot = p % cap;
            ls.ring[slot * d..(slot + 1) * d].copy_from_slice(kv.row(seg.start + i));
            ls.ring_pos[slot] = p;
        }
    }
    Tensor { rows: batch.len(), cols: h * d, data: out.concat() }
}
