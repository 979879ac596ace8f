//! The CPU backend: f32 everywhere, the oracle every other backend is checked against.

pub mod attention;
pub mod dspark;
pub mod linalg;
pub mod state;

use crate::backend::{Backend, CompSlot};
use crate::batch::Batch;
use dsv4_model::weights::{Compressor, Expert, Hc};
use dsv4_model::{Config, HostTensor, LoadError};
use linalg::{matmul_t, rms_norm, sigmoid};
use rayon::prelude::*;
use state::CpuCache;

/// A row-major f32 matrix (1-D weights are one row).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols);
        Tensor { rows, cols, data }
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// Expert choice of every row: `k` expert ids and weights per row.
pub struct Route {
    pub k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

#[derive(Default)]
pub struct CpuBackend;

fn sqrt_softplus(z: f32) -> f32 {
    let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
    sp.sqrt()
}

fn swiglu_rows(x: &Tensor, e: &Expert<Tensor>, limit: f32) -> Tensor {
    let g = matmul_t(&x.data, x.rows, x.cols, &e.w1.data, e.w1.rows);
    let u = matmul_t(&x.data, x.rows, x.cols, &e.w3.data, e.w3.rows);
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            g * sigmoid(g) * u
        })
        .collect();
    let inter = e.w1.rows;
    Tensor::new(x.rows, e.w2.rows, matmul_t(&h, x.rows, inter, &e.w2.data, e.w2.rows))
}

/// mHC mixing coefficients of one row: `ρ · (fn · x̄)`.
fn hc_mixes(x: &Tensor, f: &Tensor, eps: f32) -> Vec<f32> {
    let mut m = matmul_t(&x.data, x.rows, x.cols, &f.data, f.rows);
    for (i, mr) in m.chunks_mut(f.rows).enumerate() {
        let r = x.row(i);
        let rho = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / r.len() as f32 + eps).sqrt();
        mr.iter_mut().for_each(|v| *v *= rho);
    }
    m
}

/// Sinkhorn normalisation of an `n×n` matrix after a row softmax (spec §4.4).
pub fn sinkhorn(a: &[f32], n: usize, iters: usize, eps: f32) -> Vec<f32> {
    let mut c = vec![0f32; n * n];
    for j in 0..n {
        let row = &a[j * n..(j + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
        for k in 0..n {
            c[j * n + k] = (row[k] - m).exp() / s + eps;
        }
    }
    let col_norm = |c: &mut [f32]| {
        for k in 0..n {
            let s: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + eps;
            (0..n).for_each(|j| c[j * n + k] /= s);
        }
    };
    col_norm(&mut c);
    for _ in 1..iters {
        for j in 0..n {
            let s: f32 = c[j * n..(j + 1) * n].iter().sum::<f32>() + eps;
            c[j * n..(j + 1) * n].iter_mut().for_each(|v| *v /= s);
        }
        col_norm(&mut c);
    }
    c
}

impl Backend for CpuBackend {
    type W = Tensor;
    type T = Tensor;
    type Cache = CpuCache;
    type Rows = Batch;
    type Ids = Vec<u32>;
    type Sel = Vec<Vec<u32>>;
    type Route = Route;
    type Graph = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    /// Packed tensors are accepted and dequantised here (so `round_weight` can tell which
    /// values a GPU holds exactly).
    fn keeps_packed(&self) -> bool {
        true
    }

    fn upload(&self, mut t: HostTensor) -> Result<Tensor, LoadError> {
        t.dequantize();
        let (rows, cols) = match t.shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            other => return Err(LoadError::Value { name: t.name, msg: format!("unexpected rank {}", other.len()) }),
        };
        Ok(Tensor::new(rows, cols, t.data))
    }

    fn new_cache(&self, cfg: &Config, max_seqs: usize) -> CpuCache {
        CpuCache::new(cfg, max_seqs)
    }

    fn reset_seq(&self, cache: &mut CpuCache, seq: usize) {
        cache.reset(seq);
    }

    fn save_seq(&self, cache: &CpuCache, _cfg: &Config, seq: usize, _len: usize) -> Option<state::SeqState> {
        Some(cache.seq(seq).clone())
    }

    fn truncate_seq(&self, cache: &mut CpuCache, seq: usize, have: usize, len: usize) -> Result<(), String> {
        let window = cache.window();
        cache.seq_mut(seq).truncate(have, len, window).map_err(|e| e.to_string())
    }

    fn load_seq(&self, cache: &mut CpuCache, _cfg: &Config, seq: usize, st: &state::SeqState, _len: usize) -> bool {
        *cache.seq_mut(seq) = st.clone();
        true
    }

    fn rows(&self, batch: &Batch) -> Batch {
        batch.clone()
    }

    fn shape(&self, t: &Tensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn to_host(&self, t: &Tensor) -> Vec<f32> {
        t.data.clone()
    }

    fn embed(&self, table: &Tensor, rows: &Batch) -> Tensor {
        let d = table.cols;
        let data = rows.rows.iter().flat_map(|r| table.row(r.token as usize).iter().copied()).collect();
        Tensor::new(rows.len(), d, data)
    }

    fn matmul(&self, x: &Tensor, w: &Tensor) -> Tensor {
        assert_eq!(x.cols, w.cols, "matmul: input width {} vs weight [{}, {}]", x.cols, w.rows, w.cols);
        Tensor::new(x.rows, w.rows, matmul_t(&x.data, x.rows, x.cols, &w.data, w.rows))
    }

    fn grouped_matmul(&self, x: &Tensor, w: &Tensor, groups: usize) -> Tensor {
        let inw = x.cols / groups;
        let r = w.rows / groups;
        assert_eq!(w.cols, inw);
        let mut out = vec![0f32; x.rows * groups * r];
        for g in 0..groups {
            let xg: Vec<f32> = (0..x.rows).flat_map(|i| x.row(i)[g * inw..(g + 1) * inw].iter().copied()).collect();
            let y = matmul_t(&xg, x.rows, inw, &w.data[g * r * inw..(g + 1) * r * inw], r);
            for i in 0..x.rows {
                out[i * groups * r + g * r..i * groups * r + (g + 1) * r].copy_from_slice(&y[i * r..(i + 1) * r]);
            }
        }
        Tensor::new(x.rows, groups * r, out)
    }

    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, group: usize, eps: f32) -> Tensor {
        Tensor::new(x.rows, x.cols, rms_norm(&x.data, group, w.map(|w| w.data.as_slice()), eps))
    }

    fn rope(&self, x: &mut Tensor, rows: &Batch, freqs: &[f64], head: usize, inverse: bool) {
        let cols = x.cols;
        x.data.par_chunks_mut(cols).zip(&rows.rows).for_each(|(r, row)| {
            for h in r.chunks_mut(head) {
                attention::rope_vec(h, row.pos, freqs, inverse);
            }
        });
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Tensor {
        assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        Tensor::new(a.rows, a.cols, a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect())
    }

    fn select_rows(&self, x: &Tensor, rows: &[usize]) -> Tensor {
        Tensor::new(rows.len(), x.cols, rows.iter().flat_map(|&r| x.row(r).iter().copied()).collect())
    }

    fn hc_expand(&self, x: &Tensor, n: usize) -> Tensor {
        let data = (0..x.rows).flat_map(|i| (0..n).flat_map(move |_| x.row(i).iter().copied())).collect();
        Tensor::new(x.rows, n * x.cols, data)
    }

    fn empty(&self, rows: usize, cols: usize) -> Tensor {
        Tensor::new(rows, cols, vec![0.0; rows * cols])
    }

    fn stream_mean_into(&self, out: &mut Tensor, col: usize, x: &Tensor, n: usize) {
        let d = x.cols / n;
        assert!(x.cols == n * d && out.rows == x.rows && col + d <= out.cols, "stream_mean_into shape");
        for r in 0..x.rows {
            let o = &mut out.data[r * out.cols + col..r * out.cols + col + d];
            o.fill(0.0);
            for s in 0..n {
                o.iter_mut().zip(&x.row(r)[s * d..(s + 1) * d]).for_each(|(a, b)| *a += b);
            }
            o.iter_mut().for_each(|a| *a /= n as f32);
        }
    }

    fn hc_pre(&self, x: &Tensor, hc: &Hc<Tensor>, cfg: &Config) -> (Tensor, Tensor, Tensor) {
        let (n, d) = (cfg.hc_mult, cfg.hidden);
        let mix = cfg.hc_mix();
        let m = hc_mixes(x, &hc.fn_, cfg.rms_eps);
        let (base, scale) = (&hc.base.data, &hc.scale.data);
        let mut y = vec![0f32; x.rows * d];
        let mut post = vec![0f32; x.rows * n];
        let mut comb = vec![0f32; x.rows * n * n];
        for i in 0..x.rows {
            let mi = &m[i * mix..(i + 1) * mix];
            let pre: Vec<f32> = (0..n).map(|j| sigmoid(mi[j] * scale[0] + base[j]) + cfg.hc_eps).collect();
            for j in 0..n {
                post[i * n + j] = 2.0 * sigmoid(mi[n + j] * scale[1] + base[n + j]);
            }
            let a: Vec<f32> = (0..n * n).map(|j| mi[2 * n + j] * scale[2] + base[2 * n + j]).collect();
            comb[i * n * n..(i + 1) * n * n].copy_from_slice(&sinkhorn(&a, n, cfg.hc_sinkhorn_iters, cfg.hc_eps));
            let xr = x.row(i);
            let yr = &mut y[i * d..(i + 1) * d];
            for (s, p) in pre.iter().enumerate() {
                for (a, b) in yr.iter_mut().zip(&xr[s * d..(s + 1) * d]) {
                    *a += p * b;
                }
            }
        }
        (Tensor::new(x.rows, d, y), Tensor::new(x.rows, n, post), Tensor::new(x.rows, n * n, comb))
    }

    fn hc_post(&self, f: &Tensor, x: &Tensor, post: &Tensor, comb: &Tensor) -> Tensor {
        let (n, d) = (post.cols, f.cols);
        let mut out = vec![0f32; x.rows * n * d];
        out.par_chunks_mut(n * d).enumerate().for_each(|(i, o)| {
            let (fr, xr, pr, cr) = (f.row(i), x.row(i), post.row(i), comb.row(i));
            for j in 0..n {
                let oj = &mut o[j * d..(j + 1) * d];
                for (a, b) in oj.iter_mut().zip(fr) {
                    *a = pr[j] * b;
                }
                for s in 0..n {
                    let c = cr[s * n + j];
                    for (a, b) in oj.iter_mut().zip(&xr[s * d..(s + 1) * d]) {
                        *a += c * b;
                    }
                }
            }
        });
        Tensor::new(x.rows, n * d, out)
    }

    fn hc_head(&self, x: &Tensor, hc: &Hc<Tensor>, cfg: &Config) -> Tensor {
        let (n, d) = (cfg.hc_mult, cfg.hidden);
        let m = hc_mixes(x, &hc.fn_, cfg.rms_eps);
        let mut y = vec![0f32; x.rows * d];
        for i in 0..x.rows {
            let xr = x.row(i);
            for s in 0..n {
                let p = sigmoid(m[i * n + s] * hc.scale.data[0] + hc.base.data[s]) + cfg.hc_eps;
                for (a, b) in y[i * d..(i + 1) * d].iter_mut().zip(&xr[s * d..(s + 1) * d]) {
                    *a += p * b;
                }
            }
        }
        Tensor::new(x.rows, d, y)
    }

    fn compress(
        &self,
        cache: &mut CpuCache,
        layer: usize,
        slot: CompSlot,
        u: &Tensor,
        z: &Tensor,
        comp: &Compressor<Tensor>,
        rows: &Batch,
        freqs: &[f64],
        cfg: &Config,
    ) {
        for seg in &rows.segments {
            let ls = cache.layer_mut(seg.seq, layer);
            let st = match slot {
                CompSlot::Kv => ls.comp.as_mut(),
                CompSlot::Index => ls.index.as_mut(),
            }
            .expect("compressor state missing for this layer");
            let w = u.cols;
            let r = seg.start * w..(seg.start + seg.len) * w;
            attention::compress_rows(
                st,
                &u.data[r.clone()],
                &z.data[r],
                seg.pos0..seg.pos0 + seg.len,
                &comp.ape.data,
                &comp.norm.data,
                freqs,
                cfg.rms_eps,
            );
        }
    }

    fn index_select(
        &self,
        cache: &CpuCache,
        layer: usize,
        qi: &Tensor,
        w: &Tensor,
        rows: &Batch,
        cfg: &Config,
    ) -> Vec<Vec<u32>> {
        attention::index_select(cache, layer, qi, w, rows, cfg)
    }

    fn attention(
        &self,
        cache: &mut CpuCache,
        layer: usize,
        q: &Tensor,
        kv: &Tensor,
        sel: Option<&Vec<Vec<u32>>>,
        sinks: &Tensor,
        rows: &Batch,
        freqs: &[f64],
        cfg: &Config,
    ) -> Tensor {
        let mut o = attention::attend(cache, layer, q, kv, sel, &sinks.data, rows, cfg);
        self.rope(&mut o, rows, freqs, cfg.head_dim, true);
        o
    }

    fn route(&self, logits: &Tensor, bias: Option<&Tensor>, hash: Option<(&[u32], &Batch)>, cfg: &Config) -> Route {
        let (e, k) = (logits.cols, cfg.n_experts_per_tok);
        let mut ids = Vec::with_capacity(logits.rows * k);
        let mut weights = Vec::with_capacity(logits.rows * k);
        for i in 0..logits.rows {
            let s: Vec<f32> = logits.row(i).iter().map(|&z| sqrt_softplus(z)).collect();
            let chosen: Vec<u32> = match hash {
                Some((t, rows)) => {
                    let tok = rows.rows[i].token as usize;
                    t[tok * k..(tok + 1) * k].to_vec()
                }
                None => {
                    let b = &bias.expect("learned routing needs a bias").data;
                    let mut order: Vec<u32> = (0..e as u32).collect();
                    // Highest biased score first; ties go to the lower expert id.
                    order.sort_by(|&a, &c| {
                        (s[c as usize] + b[c as usize]).total_cmp(&(s[a as usize] + b[a as usize])).then(a.cmp(&c))
                    });
                    order.truncate(k);
                    order
                }
            };
            let sum: f32 = chosen.iter().map(|&c| s[c as usize]).sum();
            for &c in &chosen {
                let w = if cfg.norm_topk_prob { s[c as usize] / sum } else { s[c as usize] };
                weights.push(w * cfg.routed_scale);
            }
            ids.extend(chosen);
        }
        Route { k, ids, weights }
    }

    fn moe(&self, x: &Tensor, route: &Route, experts: &[Expert<Tensor>], first: usize, limit: f32) -> Tensor {
        let k = route.k;
        // Rows per expert, then one matmul per used expert; results land in (row, slot) order so
        // each row sums its experts in its own routing order, whatever the batch holds.
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        let held: Vec<bool> =
            route.ids.iter().map(|&e| (first..first + experts.len()).contains(&(e as usize))).collect();
        for (slot, &e) in route.ids.iter().enumerate() {
            if held[slot] {
                by_expert[e as usize - first].push(slot);
            }
        }
        let results: Vec<(Vec<usize>, Tensor)> = by_expert
            .into_par_iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(e, slots)| {
                let xe = Tensor::new(
                    slots.len(),
                    x.cols,
                    slots.iter().flat_map(|&s| x.row(s / k).iter().copied()).collect(),
                );
                let y = swiglu_rows(&xe, &experts[e], limit);
                (slots, y)
            })
            .collect();
        let d = x.cols;
        let mut per_slot = vec![0f32; route.ids.len() * d];
        for (slots, y) in results {
            for (i, s) in slots.into_iter().enumerate() {
                per_slot[s * d..(s + 1) * d].copy_from_slice(y.row(i));
            }
        }
        let mut out = vec![0f32; x.rows * d];
        for r in 0..x.rows {
            let o = &mut out[r * d..(r + 1) * d];
            for j in (0..k).filter(|j| held[r * k + j]) {
                let w = route.weights[r * k + j];
                for (a, b) in o.iter_mut().zip(&per_slot[(r * k + j) * d..(r * k + j + 1) * d]) {
                    *a += w * b;
                }
            }
        }
        Tensor::new(x.rows, d, out)
    }

    fn swiglu(&self, x: &Tensor, e: &Expert<Tensor>, limit: f32) -> Tensor {
        swiglu_rows(x, e, limit)
    }

    fn expert_parallel(&self) -> bool {
        true
    }

    fn reset_probes(&self, cache: &mut CpuCache) {
        cache.probes.clear();
    }

    fn probe_finite(&self, cache: &mut CpuCache, t: &Tensor, slot: usize) {
        if cache.probes.len() <= slot {
            cache.probes.resize(slot + 1, None);
        }
        let bad = t.data.iter().position(|v| !v.is_finite()).map(|i| i / t.cols.max(1));
        cache.probes[slot] = bad;
    }

    fn read_probes(&self, cache: &CpuCache, n: usize) -> Vec<Option<usize>> {
        (0..n).map(|i| cache.probes.get(i).copied().flatten()).collect()
    }

    fn to_device(&self, rows: usize, cols: usize, data: &[f32]) -> Tensor {
        Tensor::new(rows, cols, data.to_vec())
    }

    fn scatter_rows(&self, dst: &mut Tensor, src: &Tensor, dst_rows: &[usize]) {
        assert_eq!((src.rows, src.cols), (dst_rows.len(), dst.cols), "scatter_rows shape");
        for (i, &r) in dst_rows.iter().enumerate() {
            dst.data[r * dst.cols..(r + 1) * dst.cols].copy_from_slice(src.row(i));
        }
    }

    fn block_attention(
        &self,
        q: &Tensor,
        kb: &Tensor,
        rings: &[&Tensor],
        slots: &[Vec<usize>],
        sinks: &Tensor,
        heads: usize,
    ) -> Tensor {
        dspark::grouped_block_attention(q, kb, rings, slots, sinks, heads)
    }

    fn argmax_rows(&self, x: &Tensor) -> Vec<u32> {
        (0..x.rows).map(|i| dspark::argmax(x.row(i)) as u32).collect()
    }

    fn argmax_ids(&self, x: &Tensor) -> Vec<u32> {
        self.argmax_rows(x)
    }

    fn upload_ids(&self, ids: &[u32]) -> Vec<u32> {
        ids.to_vec()
    }

    fn embed_ids(&self, table: &Tensor, ids: &Vec<u32>) -> Tensor {
        Tensor::new(ids.len(), table.cols, ids.iter().flat_map(|&t| table.row(t as usize).iter().copied()).collect())
    }

    fn ids_to_host(&self, ids: &Vec<u32>) -> Vec<u32> {
        ids.clone()
    }

    fn concat_ids(&self, parts: &[&Vec<u32>]) -> Vec<u32> {
        parts.iter().flat_map(|p| p.iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_columns_sum_to_one() {
        let a = [0.3, -1.2, 2.0, 0.1, 0.5, 0.5, -0.7, 1.1, 3.0, -2.0, 0.0, 0.4, 1.0, 1.0, -1.0, 0.2];
        let c = sinkhorn(&a, 4, 20, 1e-6);
        for k in 0..4 {
            let s: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            assert!((s - 1.0).abs() < 1e-5, "column {k} sums to {s}");
        }
        for j in 0..4 {
            let s: f32 = c[j * 4..j * 4 + 4].iter().sum();
            assert!((s - 1.0).abs() < 1e-3, "row {j} sums to {s}");
        }
    }

    #[test]
    fn rope_inverse_undoes_rope_and_pairs_are_interleaved() {
        let freqs = [1.0, 0.1];
        let mut v = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let orig = v.clone();
        attention::rope_vec(&mut v, 7, &freqs, false);
        assert_eq!(&v[..2], &orig[..2], "nope channels untouched");
        // pair 0 = channels (2, 3) rotated by 7 rad
        let (s, c) = (7f32.sin(), 7f32.cos());
        assert!((v[2] - (3.0 * c - 4.0 * s)).abs() < 1e-5 && (v[3] - (3.0 * s + 4.0 * c)).abs() < 1e-5);
        attention::rope_vec(&mut v, 7, &freqs, true);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn hc_post_uses_columns_of_comb() {
        let b = CpuBackend;
        // n = 2, d = 1: X' [j] = post[j] f + sum_i comb[i][j] X[i]
        let f = Tensor::new(1, 1, vec![10.0]);
        let x = Tensor::new(1, 2, vec![1.0, 2.0]);
        let post = Tensor::new(1, 2, vec![0.5, 1.0]);
        let comb = Tensor::new(1, 4, vec![0.1, 0.2, 0.3, 0.4]); // comb[0][1] = 0.2, comb[1][0] = 0.3
        let out = b.hc_post(&f, &x, &post, &comb);
        assert!((out.data[0] - (5.0 + 0.1 + 0.6)).abs() < 1e-6);
        assert!((out.data[1] - (10.0 + 0.2 + 0.8)).abs() < 1e-6);
    }
}
