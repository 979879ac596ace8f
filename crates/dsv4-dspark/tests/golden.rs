//! The drafter against DeepSeek's reference (`inference/model.py`, float64) on the tiny DSpark
//! golden model: every component of every teacher-forced block, plus an independent float64
//! re-implementation of the spec's formulas (Markov head, confidence head, the non-causal
//! DSparkAttention) as a second oracle.

mod common;

use common::{drafter, fixtures, maxabs, rel, rel64, Errors, Golden};
use dsv4_dspark::{ContextRing, Drafter, DsparkConfig};
use dsv4_model::{Config, DType, TensorStore};
use rand::SeedableRng;

const TOL: f64 = 1e-5;

/// Golden teacher-forced run over the blocks of `file`, with `main_hidden` rows as input.
fn teacher_forced(d: &Drafter, file: &str, main_hidden: &[f64], prompt_len: usize) -> (Errors, Vec<Vec<u32>>) {
    let g = Golden::open(file);
    let cfg = d.target_config().clone();
    let (v, dm, hd, win, gam, r, ns) =
        (cfg.vocab_size, cfg.hidden, cfg.head_dim, cfg.window, d.block_size(), d.config().markov_rank, d.n_stages());
    let hw = d.hidden_width();
    let mh: Vec<f32> = main_hidden.iter().map(|&x| x as f32).collect();
    let row = |p: usize| &mh[p * hw..(p + 1) * hw];
    let mut ring = d.new_ring();
    // Prefill: the reference writes the rows of the last min(L, W) prompt positions.
    let pre: Vec<(usize, &[f32])> = (prompt_len.saturating_sub(win)..prompt_len).map(|p| (p, row(p))).collect();
    d.commit(&mut ring, &pre).unwrap();
    let mut e = Errors::default();
    if g.store.contains("rings_after_prefill") {
        let gr = g.f64("rings_after_prefill");
        for s in 0..ns {
            e.add("rings_after_prefill", rel(ring.stage(s), &gr[s * win * hd..(s + 1) * win * hd]), TOL);
        }
    }
    let ps = g.i64("P");
    let (anchor, drafts, mprev) = (g.u32("anchor"), g.u32("drafts"), g.u32("markov_prev"));
    let ring_pos = g.i64("ring_pos");
    let (gmx, gring) = (g.f64("main_x"), g.f64("ring"));
    let (gstage, gattn, gh) = (g.f64("stage_out"), g.f64("attn_out"), g.f64("h_hc_head"));
    let (gbase, gadj, gbias, gemb) =
        (g.f64("base_logits"), g.f64("adj_logits"), g.f64("markov_bias"), g.f64("markov_embed"));
    let (gconf, gsig) = (g.f64("conf_raw"), g.f64("conf_sigmoid"));
    let forced = g.store.contains("prev_forced");
    let mut got_drafts = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    for (i, &p) in ps.iter().enumerate() {
        let p = p as usize;
        if p >= prompt_len {
            d.commit(&mut ring, &[(p, row(p))]).unwrap();
        }
        e.add("main_x", rel(&d.main_x(row(p)).unwrap(), &gmx[i * dm..(i + 1) * dm]), TOL);
        let tags: Vec<i64> = ring.tags().iter().map(|t| t.map_or(-1, |x| x as i64)).collect();
        assert_eq!(tags, ring_pos[i * win..(i + 1) * win], "{file} block {i}: ring positions");
        for s in 0..ns {
            for (slot, &tag) in tags.iter().enumerate() {
                if tag >= 0 {
                    let o = ((i * ns + s) * win + slot) * hd;
                    e.add("ring", rel(ring.row(s, slot), &gring[o..o + hd]), TOL);
                }
            }
        }
        let (dr, tr) = d.draft_traced(&ring, anchor[i], p + 1, 0.0, &mut rng).unwrap();
        let blk = |t: &[f64], w: usize| t[i * w..(i + 1) * w].to_vec();
        for s in 0..ns {
            let w = gam * 4 * dm;
            let gs = &gstage[(i * ns + s) * w..(i * ns + s + 1) * w];
            e.add(&format!("stage_out[{s}]"), rel(&tr.stage_out[s], gs), TOL);
            let w = gam * dm;
            e.add(&format!("attn_out[{s}]"), rel(&tr.attn_out[s], &gattn[(i * ns + s) * w..(i * ns + s + 1) * w]), TOL);
        }
        e.add("h_hc_head", rel(&tr.h, &blk(&gh, gam * dm)), TOL);
        e.add("base_logits", rel(&tr.base_logits, &blk(&gbase, gam * v)), TOL);
        e.add("markov_embed", rel(&tr.markov_embed, &blk(&gemb, gam * r)), TOL);
        e.add("markov_bias", rel(&tr.markov_bias, &blk(&gbias, gam * v)), TOL);
        e.add("adj_logits", rel(&dr.logits, &blk(&gadj, gam * v)), TOL);
        e.add("conf_raw (abs)", maxabs(&dr.conf_raw, &blk(&gconf, gam)), 1e-4);
        let sig: Vec<f32> = (0..gam).map(|k| dr.confidence(k)).collect();
        e.add("conf_sigmoid (abs)", maxabs(&sig, &blk(&gsig, gam)), 1e-5);
        assert_eq!(tr.markov_prev, mprev[i * gam..(i + 1) * gam], "{file} block {i}: Markov previous tokens");
        assert_eq!(dr.tokens, drafts[i * gam..(i + 1) * gam], "{file} block {i} (P={p}): drafted tokens");
        assert!(dr.q_probs.is_none());
        if forced {
            // Markov / confidence results for given previous tokens (the true stream).
            let (pf, gaf, gcf) = (g.u32("prev_forced"), g.f64("adj_logits_forced_prev"), g.f64("conf_raw_forced_prev"));
            for k in 0..gam {
                let prev = pf[i * gam + k];
                let z: Vec<f32> =
                    tr.base_logits[k * v..(k + 1) * v].iter().zip(d.markov_bias(prev)).map(|(a, b)| a + b).collect();
                let o = (i * gam + k) * v;
                e.add("adj_logits_forced_prev", rel(&z, &gaf[o..o + v]), TOL);
                let c = d.confidence_raw(&tr.h[k * dm..(k + 1) * dm], prev);
                e.add("conf_raw_forced_prev (abs)", (c as f64 - gcf[i * gam + k]).abs(), 1e-4);
            }
        }
        got_drafts.push(dr.tokens);
    }
    (e, got_drafts)
}

#[test]
fn teacher_forced_blocks_match_the_reference() {
    let d = drafter();
    assert_eq!(d.n_stages(), 3);
    let t = Golden::open("target_golden.safetensors");
    let (e, drafts) = teacher_forced(&d, "draft_golden.safetensors", &t.f64("main_hidden"), 41);
    e.check("draft_golden (34 blocks, P = 40..73), max relative error vs float64 reference");
    // The drafts' matching prefix against the greedy stream (tf_accept).
    let g = Golden::open("draft_golden.safetensors");
    let seq = t.u32("sequence_ids");
    for (i, (dr, &want)) in drafts.iter().zip(&g.i64("tf_accept")).enumerate() {
        let p = 40 + i;
        let n = dr.iter().enumerate().take_while(|&(k, &x)| seq.get(p + 2 + k) == Some(&x)).count();
        assert_eq!(n as i64, want, "tf_accept of block P={p}");
    }
}

/// Several sequences drafted in one batched forward (`draft_batch`) get what each gets alone
/// (`draft`), bit for bit on the CPU: tokens, the `Z` rows and the confidences, whose halves the
/// Markov loop forms over all slots at once and reassembles by (sequence, slot).
#[test]
fn batched_drafts_equal_each_sequence_alone() {
    use dsv4_dspark::DraftRequest;
    let d = drafter();
    let t = Golden::open("target_golden.safetensors");
    let mh: Vec<f32> = t.f64("main_hidden").iter().map(|&x| x as f32).collect();
    let (hw, win) = (d.hidden_width(), d.target_config().window);
    let ends = [41usize, 52, 63];
    let rings: Vec<ContextRing> = ends
        .iter()
        .map(|&end| {
            let mut ring = d.new_ring();
            let rows: Vec<(usize, &[f32])> =
                (end.saturating_sub(win)..end).map(|p| (p, &mh[p * hw..(p + 1) * hw])).collect();
            d.commit(&mut ring, &rows).unwrap();
            ring
        })
        .collect();
    let anchors = [5u32, 33, 71];
    let reqs: Vec<DraftRequest<_>> = rings
        .iter()
        .zip(ends.iter().zip(anchors))
        .map(|(ring, (&end, anchor))| DraftRequest { ring, anchor, anchor_pos: end })
        .collect();
    let batched = d.draft_batch(&reqs, true).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    for (i, (r, got)) in reqs.iter().zip(&batched).enumerate() {
        let want = d.draft(r.ring, r.anchor, r.anchor_pos, 0.0, &mut rng).unwrap();
        assert_eq!(got.tokens, want.tokens, "sequence {i}: tokens");
        assert_eq!(got.logits, want.logits, "sequence {i}: Z rows");
        assert_eq!(got.conf_raw, want.conf_raw, "sequence {i}: confidences");
        assert_eq!(got.conf_raw.len(), d.block_size());
    }
}

#[test]
fn ring_not_yet_full_blocks_match_the_reference() {
    let d = drafter();
    let g = Golden::open("draft_short_golden.safetensors");
    let (e, _) = teacher_forced(&d, "draft_short_golden.safetensors", &g.f64("main_hidden"), 5);
    e.check("draft_short_golden (8 blocks, P = 4..11: ring filling, full, wrapping)");
}

// ---------------------------------------------------------------------------------------------
// Independent float64 oracle, written from spec §3.3–§3.6.

struct W64(TensorStore);

impl W64 {
    fn open() -> Self {
        W64(TensorStore::open(&fixtures().join("weights.safetensors")).unwrap())
    }
    fn t(&self, name: &str) -> Vec<f64> {
        let info = self.0.info(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(info.dtype, DType::F64);
        self.0.raw(name).unwrap().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
    }
}

/// `y = W x` with `W` row-major `[out, in]`.
fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rmsnorm(x: &[f64], w: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().enumerate().map(|(i, v)| v * r * w.map_or(1.0, |w| w[i])).collect()
}

/// Interleaved RoPE on the last `rd` dims, theta 1e4 (draft stages: no YaRN).
fn rope(v: &mut [f64], pos: usize, rd: usize, inverse: bool) {
    let base = v.len() - rd;
    for i in 0..rd / 2 {
        let f = 10000f64.powf(-(2.0 * i as f64) / rd as f64);
        let th = pos as f64 * f * if inverse { -1.0 } else { 1.0 };
        let (a, b) = (v[base + 2 * i], v[base + 2 * i + 1]);
        v[base + 2 * i] = a * th.cos() - b * th.sin();
        v[base + 2 * i + 1] = a * th.sin() + b * th.cos();
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The spec's Markov head: `e = W1[prev]`, `bias = W2 · e`.
fn markov(w: &W64, prev: u32) -> (Vec<f64>, Vec<f64>) {
    let w1 = w.t("mtp.2.markov_head.markov_w1.weight");
    let w2 = w.t("mtp.2.markov_head.markov_w2.weight");
    let r = 8;
    let e = w1[prev as usize * r..(prev as usize + 1) * r].to_vec();
    let bias = mv(&w2, &e);
    (e, bias)
}

/// The confidence head's raw logit: `w · [h ; e]`.
fn confidence(w: &W64, h: &[f64], e: &[f64]) -> f64 {
    let wc = w.t("mtp.2.confidence_head.proj.weight");
    h.iter().chain(e).zip(&wc).map(|(a, b)| a * b).sum()
}

/// `y = Σ_i pre_i X[i]` of hc_pre (only the pre weights matter for the attention input).
fn hc_pre_y(w: &W64, s: usize, x: &[f64], d: usize) -> Vec<f64> {
    let (f, scale, base) = (
        w.t(&format!("mtp.{s}.hc_attn_fn")),
        w.t(&format!("mtp.{s}.hc_attn_scale")),
        w.t(&format!("mtp.{s}.hc_attn_base")),
    );
    let rho = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + 1e-6).sqrt();
    let mix: Vec<f64> = mv(&f, x).into_iter().map(|m| m * rho).collect();
    let mut y = vec![0.0; d];
    for i in 0..4 {
        let pre = sigmoid(mix[i] * scale[0] + base[i]) + 1e-6;
        for j in 0..d {
            y[j] += pre * x[i * d + j];
        }
    }
    y
}

/// DSparkAttention of stage `s` (spec §3.5) for block rows `a [γ][d]` at `positions`, over the
/// context `ring` rows; `causal` only to show that the mask matters.
fn dspark_attention(
    w: &W64,
    s: usize,
    a: &[Vec<f64>],
    ring: &[Vec<f64>],
    positions: &[usize],
    causal: bool,
) -> Vec<f64> {
    let (h, hd, rd, groups, olr) = (4, 32, 8, 2, 16);
    let p = |n: &str| w.t(&format!("mtp.{s}.attn.{n}"));
    let (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sinks) = (
        p("wq_a.weight"),
        p("q_norm.weight"),
        p("wq_b.weight"),
        p("wkv.weight"),
        p("kv_norm.weight"),
        p("wo_a.weight"),
        p("wo_b.weight"),
        p("attn_sink"),
    );
    let mut qs = Vec::new();
    let mut keys: Vec<Vec<f64>> = ring.to_vec();
    for (k, ak) in a.iter().enumerate() {
        let qa = rmsnorm(&mv(&wq_a, ak), Some(&q_norm), 1e-6);
        let qb = mv(&wq_b, &qa);
        let mut q = Vec::new();
        for hh in 0..h {
            let mut qh = rmsnorm(&qb[hh * hd..(hh + 1) * hd], None, 1e-6);
            rope(&mut qh, positions[k], rd, false);
            q.push(qh);
        }
        qs.push(q);
        let mut kb = rmsnorm(&mv(&wkv, ak), Some(&kv_norm), 1e-6);
        rope(&mut kb, positions[k], rd, false);
        keys.push(kb);
    }
    let nr = ring.len();
    let mut out = Vec::new();
    for (k, q) in qs.iter().enumerate() {
        let visible = if causal { nr + k + 1 } else { keys.len() };
        let mut o = Vec::new();
        for hh in 0..h {
            let sc: Vec<f64> = keys[..visible]
                .iter()
                .map(|kv| q[hh].iter().zip(kv).map(|(x, y)| x * y).sum::<f64>() / (hd as f64).sqrt())
                .collect();
            let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let den: f64 = sc.iter().map(|x| (x - m).exp()).sum::<f64>() + (sinks[hh] - m).exp();
            let mut oh = vec![0.0; hd];
            for (x, kv) in sc.iter().zip(&keys) {
                let pw = (x - m).exp() / den;
                oh.iter_mut().zip(kv).for_each(|(a, b)| *a += pw * b);
            }
            rope(&mut oh, positions[k], rd, true);
            o.extend(oh);
        }
        // wo_a per group over that group's heads, then wo_b.
        let gw = h * hd / groups;
        let mut z = Vec::new();
        for g in 0..groups {
            z.extend(mv(&wo_a[g * olr * gw..(g + 1) * olr * gw], &o[g * gw..(g + 1) * gw]));
        }
        out.extend(mv(&wo_b, &z));
    }
    out
}

#[test]
fn float64_oracle_markov_and_confidence() {
    let d = drafter();
    let w = W64::open();
    let g = Golden::open("draft_golden.safetensors");
    let (v, dm, gam) = (97, 64, 5);
    let mut e = Errors::default();
    // Whole tables.
    let (gball, geall) = (g.f64("markov_bias_all"), g.f64("markov_embed_all"));
    for p in 0..v as u32 {
        let (emb, bias) = markov(&w, p);
        let pr = p as usize;
        e.add("oracle markov_bias_all", rel64(&bias, &gball[pr * v..(pr + 1) * v]), 1e-12);
        e.add("oracle markov_embed_all", rel64(&emb, &geall[pr * 8..(pr + 1) * 8]), 1e-12);
        e.add("f32 markov_bias vs oracle", rel(&d.markov_bias(p), &bias), TOL);
    }
    // Per block and slot, from the golden base logits and head hidden.
    let (gbase, gh, gadj, gconf) = (g.f64("base_logits"), g.f64("h_hc_head"), g.f64("adj_logits"), g.f64("conf_raw"));
    let (mprev, pf) = (g.u32("markov_prev"), g.u32("prev_forced"));
    let (gaf, gcf) = (g.f64("adj_logits_forced_prev"), g.f64("conf_raw_forced_prev"));
    for i in 0..34 {
        for k in 0..gam {
            let j = i * gam + k;
            let h = &gh[j * dm..(j + 1) * dm];
            for (prev, want_z, want_c, tag) in
                [(mprev[j], &gadj, &gconf, "drafted prev"), (pf[j], &gaf, &gcf, "forced prev")]
            {
                let (emb, bias) = markov(&w, prev);
                let z: Vec<f64> = gbase[j * v..(j + 1) * v].iter().zip(&bias).map(|(a, b)| a + b).collect();
                e.add(&format!("oracle adj_logits ({tag})"), rel64(&z, &want_z[j * v..(j + 1) * v]), 1e-12);
                let c = confidence(&w, h, &emb);
                e.add(&format!("oracle conf_raw ({tag}, abs)"), (c - want_c[j]).abs(), 1e-12);
                let h32: Vec<f32> = h.iter().map(|&x| x as f32).collect();
                e.add("f32 conf_raw vs oracle (abs)", (d.confidence_raw(&h32, prev) as f64 - c).abs(), 1e-5);
            }
        }
    }
    e.check("float64 oracle: Markov and confidence heads");
}

#[test]
fn float64_oracle_noncausal_block_attention() {
    let d = drafter();
    let w = W64::open();
    let t = Golden::open("target_golden.safetensors");
    let g = Golden::open("draft_golden.safetensors");
    let (dm, hd, win, gam, ns) = (64, 32, 8, 5, 3);
    let embed = w.t("embed.weight");
    let (gstage, gattn, gring, ring_pos) = (g.f64("stage_out"), g.f64("attn_out"), g.f64("ring"), g.i64("ring_pos"));
    let (ps, anchor) = (g.i64("P"), g.u32("anchor"));
    let mh: Vec<f32> = t.f64("main_hidden").iter().map(|&x| x as f32).collect();
    let hw = d.hidden_width();
    let mut ring = d.new_ring();
    let pre: Vec<(usize, &[f32])> = (33..41).map(|p| (p, &mh[p * hw..(p + 1) * hw])).collect();
    d.commit(&mut ring, &pre).unwrap();
    let mut e = Errors::default();
    let mut causal_gap = f64::INFINITY;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    for (i, &p) in ps.iter().enumerate() {
        let p = p as usize;
        if p > 40 {
            d.commit(&mut ring, &[(p, &mh[p * hw..(p + 1) * hw])]).unwrap();
        }
        let (_, tr) = d.draft_traced(&ring, anchor[i], p + 1, 0.0, &mut rng).unwrap();
        let positions: Vec<usize> = (p + 1..p + 1 + gam).collect();
        for s in 0..ns {
            // Stage input: the embedded block broadcast to 4 streams, or the previous stage's output.
            let x: Vec<Vec<f64>> = (0..gam)
                .map(|k| {
                    if s == 0 {
                        let tok = if k == 0 { anchor[i] as usize } else { 96 };
                        (0..4).flat_map(|_| embed[tok * dm..(tok + 1) * dm].iter().copied()).collect()
                    } else {
                        let o = (((i * ns + s - 1) * gam) + k) * 4 * dm;
                        gstage[o..o + 4 * dm].to_vec()
                    }
                })
                .collect();
            let an = w.t(&format!("mtp.{s}.attn_norm.weight"));
            let a: Vec<Vec<f64>> = x.iter().map(|xk| rmsnorm(&hc_pre_y(&w, s, xk, dm), Some(&an), 1e-6)).collect();
            let ctx: Vec<Vec<f64>> = (0..win)
                .filter(|&sl| ring_pos[i * win + sl] >= 0)
                .map(|sl| {
                    let o = ((i * ns + s) * win + sl) * hd;
                    gring[o..o + hd].to_vec()
                })
                .collect();
            let want = &gattn[(i * ns + s) * gam * dm..(i * ns + s + 1) * gam * dm];
            let o = dspark_attention(&w, s, &a, &ctx, &positions, false);
            e.add("oracle attn_out vs reference", rel64(&o, want), 1e-12);
            e.add("f32 attn_out vs oracle", rel(&tr.attn_out[s], &o), TOL);
            let oc = dspark_attention(&w, s, &a, &ctx, &positions, true);
            causal_gap = causal_gap.min(rel64(&oc, want));
        }
    }
    e.check("float64 oracle: non-causal DSparkAttention (all stages, all 34 blocks)");
    eprintln!("  a causal mask would miss the reference by >= {causal_gap:.3e} (relative)");
    assert!(causal_gap > 1e-3, "the test does not distinguish causal from non-causal attention");
}

// ---------------------------------------------------------------------------------------------
// Configuration, loading and errors.

#[test]
fn official_config_with_three_mtp_stages_is_accepted() {
    let text = std::fs::read_to_string(fixtures().join("config_official.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cfg = Config::from_json(&v).unwrap();
    assert_eq!((cfg.n_layers(), cfg.n_mtp_layers), (6, 3));
    let dc = DsparkConfig::from_json(&v, cfg.n_layers(), cfg.vocab_size).unwrap().unwrap();
    assert_eq!(dc, DsparkConfig { block_size: 5, noise_token_id: 96, target_layer_ids: vec![3, 4, 5], markov_rank: 8 });
    let mut bad = v.clone();
    bad["dspark_target_layer_ids"] = serde_json::json!([3, 4, 6]);
    let err = DsparkConfig::from_json(&bad, 6, 97).unwrap_err().to_string();
    assert!(err.contains("dspark_target_layer_ids") && err.contains('6'), "{err}");
    bad["dspark_block_size"] = 0.into();
    assert!(DsparkConfig::from_json(&bad, 6, 97).unwrap().is_none());
}

/// All fixture tensors, with `edit` applied, written as a new checkpoint directory.
fn edited_checkpoint(edit: impl Fn(&str, &mut Vec<usize>, &mut Vec<u8>) -> bool) -> tempfile::TempDir {
    let src = TensorStore::open(&fixtures().join("weights.safetensors")).unwrap();
    let mut ts = Vec::new();
    for n in src.names() {
        let info = src.info(n).unwrap();
        let (mut shape, mut bytes) = (info.shape.clone(), src.raw(n).unwrap().to_vec());
        if edit(n, &mut shape, &mut bytes) {
            ts.push((n.to_string(), info.dtype, shape, bytes));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join("config_official.json"), dir.path().join("config.json")).unwrap();
    dsv4_model::store::write_safetensors(&dir.path().join("w.safetensors"), &ts).unwrap();
    dir
}

#[test]
fn wrong_shapes_and_serial_mtp_are_refused_with_clear_errors() {
    // A wrong shape names the tensor.
    let dir = edited_checkpoint(|n, shape, bytes| {
        if n == "mtp.1.attn.wkv.weight" {
            shape[0] -= 1;
            bytes.truncate(shape[0] * shape[1] * 8);
        }
        true
    });
    let err = Drafter::load_dir(dir.path()).err().unwrap().to_string();
    assert!(err.contains("mtp.1.attn.wkv.weight") && err.contains("[32, 64]"), "{err}");
    // A missing head tensor names the tensor.
    let dir = edited_checkpoint(|n, _, _| n != "mtp.2.confidence_head.proj.weight");
    let err = Drafter::load_dir(dir.path()).err().unwrap().to_string();
    assert!(err.contains("mtp.2.confidence_head.proj.weight"), "{err}");
    // V4's original serial MTP: a single `mtp.0` with e_proj/h_proj and no main_proj.
    let dir = edited_checkpoint(|n, _, _| {
        !(n.starts_with("mtp.1.") || n.starts_with("mtp.2.") || n.starts_with("mtp.0.main_"))
    });
    let mut extra = Vec::new();
    for (n, shape) in [("mtp.0.e_proj.weight", vec![64usize, 64]), ("mtp.0.h_proj.weight", vec![64, 64])] {
        extra.push((n.to_string(), DType::F32, shape, vec![0u8; 64 * 64 * 4]));
    }
    dsv4_model::store::write_safetensors(&dir.path().join("serial.safetensors"), &extra).unwrap();
    let err = Drafter::load_dir(dir.path()).err().unwrap().to_string();
    assert!(err.contains("serial MTP") && err.contains("main_proj"), "{err}");
    // A target-only checkpoint.
    let dir = edited_checkpoint(|n, _, _| !n.starts_with("mtp."));
    let err = Drafter::load_dir(dir.path()).err().unwrap().to_string();
    assert!(err.contains("no `mtp.*` tensors"), "{err}");
}

#[test]
fn drafting_needs_the_context_row_and_valid_inputs() {
    let d = drafter();
    let t = Golden::open("target_golden.safetensors");
    let mh: Vec<f32> = t.f64("main_hidden").iter().map(|&x| x as f32).collect();
    let hw = d.hidden_width();
    let mut ring = d.new_ring();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let err = d.draft(&ring, 11, 41, 0.0, &mut rng).unwrap_err().to_string();
    assert!(err.contains("position 40"), "{err}");
    d.commit(&mut ring, &[(40, &mh[40 * hw..41 * hw])]).unwrap();
    assert!(d.draft(&ring, 11, 41, 0.0, &mut rng).is_ok());
    assert!(d.draft(&ring, 97, 41, 0.0, &mut rng).unwrap_err().to_string().contains("vocabulary"));
    assert!(d.commit(&mut ring, &[(41, &mh[..10])]).unwrap_err().to_string().contains("192"));
    // Truncation forgets rows at and beyond the new length.
    d.commit(&mut ring, &[(41, &mh[41 * hw..42 * hw])]).unwrap();
    ring.truncate(41);
    assert!(!ring.holds(41) && ring.holds(40));
    assert!(d.draft(&ring, 4, 42, 0.0, &mut rng).is_err());
}

#[test]
fn a_ring_with_holes_masks_them_and_full_context_is_order_free() {
    // Writing the prompt rows one by one or all at once gives the same ring; a hole (skipped
    // write) is masked, not read stale.
    let d = drafter();
    let t = Golden::open("target_golden.safetensors");
    let mh: Vec<f32> = t.f64("main_hidden").iter().map(|&x| x as f32).collect();
    let hw = d.hidden_width();
    let rows: Vec<(usize, &[f32])> = (0..41).map(|p| (p, &mh[p * hw..(p + 1) * hw])).collect();
    let mut a = d.new_ring();
    d.commit(&mut a, &rows).unwrap();
    let mut b = d.new_ring();
    for r in &rows {
        d.commit(&mut b, std::slice::from_ref(r)).unwrap();
    }
    assert_eq!(a, b);
    let mut holes: ContextRing = d.new_ring();
    d.commit(&mut holes, &rows[..36]).unwrap();
    d.commit(&mut holes, &rows[37..]).unwrap();
    assert_eq!(holes.visible(40).len(), 7);
    assert!(!holes.visible(40).contains(&(36 % 8)));
}

#[test]
fn sampled_drafts_return_their_distributions() {
    let d = drafter();
    let t = Golden::open("target_golden.safetensors");
    let mh: Vec<f32> = t.f64("main_hidden").iter().map(|&x| x as f32).collect();
    let hw = d.hidden_width();
    let mut ring = d.new_ring();
    let rows: Vec<(usize, &[f32])> = (33..41).map(|p| (p, &mh[p * hw..(p + 1) * hw])).collect();
    d.commit(&mut ring, &rows).unwrap();
    let v = 97;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let greedy = d.draft(&ring, 11, 41, 0.0, &mut rng).unwrap();
    let a = d.draft(&ring, 11, 41, 0.8, &mut rand::rngs::StdRng::seed_from_u64(5)).unwrap();
    let b = d.draft(&ring, 11, 41, 0.8, &mut rand::rngs::StdRng::seed_from_u64(5)).unwrap();
    assert_eq!(a, b, "same seed, same draft");
    for k in 0..5 {
        let q = a.q(k).unwrap();
        assert!((q.iter().map(|&x| x as f64).sum::<f64>() - 1.0).abs() < 1e-5);
        assert!(q[a.tokens[k] as usize] > 0.0);
        // q_k = softmax(Z_k / T) of the logits conditioned on the sampled previous token.
        let z = &a.logits[k * v..(k + 1) * v];
        let m = z.iter().copied().fold(f32::MIN, f32::max);
        let s: f64 = z.iter().map(|&x| (((x - m) / 0.8) as f64).exp()).sum();
        for (qi, zi) in q.iter().zip(z) {
            assert!((*qi as f64 - (((zi - m) / 0.8) as f64).exp() / s).abs() < 1e-6);
        }
    }
    // Slot 0 does not depend on the sampling; a tiny temperature reproduces greedy.
    assert_eq!(a.logits[..v], greedy.logits[..v]);
    let cold = d.draft(&ring, 11, 41, 1e-4, &mut rng).unwrap();
    assert_eq!(cold.tokens, greedy.tokens);
    // Over many seeds, the first draft token follows q_0.
    let n = 4000;
    let mut hist = vec![0usize; v];
    for seed in 0..n {
        let dr = d.draft(&ring, 11, 41, 1.5, &mut rand::rngs::StdRng::seed_from_u64(seed)).unwrap();
        hist[dr.tokens[0] as usize] += 1;
    }
    let q0 = d.draft(&ring, 11, 41, 1.5, &mut rng).unwrap().q(0).unwrap().to_vec();
    let tv: f64 = hist.iter().zip(&q0).map(|(&h, &q)| (h as f64 / n as f64 - q as f64).abs()).sum::<f64>() / 2.0;
    assert!(tv < 0.08, "TV {tv}");
}
