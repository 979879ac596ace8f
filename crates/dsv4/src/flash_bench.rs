//! `dsv4 bench --backend cuda --synthetic flash --layers N`: full V4-Flash dimensions, N decoder
//! layers drawn on the device (no host copy of the weights), prefill and decode throughput,
//! per layer and extrapolated to the 43 layers of V4-Flash, and the memory bandwidth decode uses.

use crate::bench::BenchArgs;
use crate::cli_util::parse_list;
use anyhow::{bail, Context, Result};
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::synth::synth_weights;
use dsv4_backend::{Batch, Model, Row};
use dsv4_model::{AttnKind, Config, PackedFormat};
use std::time::Instant;

/// HBM bandwidth of the H200 as measured here (device-to-device copy, read + write).
const HBM_BYTES_PER_S: f64 = 4.3e12;
const FLASH_LAYERS: usize = 43;

/// Layer 0 (SWA) and layers 2.. of V4-Flash: SWA, CSA, HCA, CSA, HCA, ...; all 43 layers
/// as they are for `n >= 43`.
pub fn flash_layers(n: usize) -> Config {
    let mut c = Config::flash();
    if n >= c.layers.len() {
        return c;
    }
    let mut layers = vec![c.layers[0]];
    layers.extend(c.layers[2..].iter().copied().take(n.saturating_sub(1)));
    c.layers = layers;
    c
}

fn toks(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Device bytes of the synthetic weights: the embedding (only gathered rows are read), the
/// routed experts, and everything else (read once per decode step).
#[derive(Default)]
struct WeightBytes {
    embed: usize,
    routed: usize,
    other: usize,
}

/// Bytes one decode step reads: every weight the batch touches once (routed experts in the
/// expected share of distinct experts under uniform routing), plus the KV it attends.
fn decode_bytes(cfg: &Config, wb: &WeightBytes, batch: usize, ctx: usize) -> (f64, f64) {
    let (hd, ne, k) = (cfg.head_dim, cfg.n_routed_experts, cfg.n_experts_per_tok);
    let distinct = ne as f64 * (1.0 - (1.0 - k as f64 / ne as f64).powi(batch as i32));
    let w = wb.other as f64 + wb.routed as f64 * distinct / ne as f64;
    let mut kv = 0.0;
    for spec in &cfg.layers {
        // KV read per sequence (f32 state): window ring, compressed entries.
        let win = ctx.min(cfg.window) * hd;
        let comp = match spec.attn {
            AttnKind::Swa => 0,
            AttnKind::Hca => ctx / spec.ratio * hd,
            AttnKind::Csa => ctx / spec.ratio * cfg.index_head_dim + (ctx / spec.ratio).min(cfg.index_topk) * hd,
        };
        kv += batch as f64 * (win + comp) as f64 * 4.0;
    }
    (w, kv)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.layers == 0 {
        bail!("--layers must be at least 1");
    }
    let contexts = parse_list(&a.contexts).context("--contexts")?;
    let batches = parse_list(&a.decode_batches).context("--decode-batches")?;
    let cfg = flash_layers(a.layers);
    let kinds: Vec<String> = cfg.layers.iter().map(|l| format!("{:?}", l.attn)).collect();
    let scheme = a.weights.as_str();
    if !["bf16", "q2", "q4", "official"].contains(&scheme) {
        bail!("--weights must be bf16, q2, q4 or official, not {scheme:?}");
    }
    let reserve = parse_reserve(&a.reserve)?;
    let b = CudaBackend::new(0).context("starting the CUDA backend")?;
    let dev = b.device_name();
    let total_mem = b.mem_total();
    let free0 = b.mem_free();
    let t0 = Instant::now();
    let mut wb = WeightBytes::default();
    let w = synth_weights(&cfg, 1, |name, shape, mean, std, seed| {
        let w = match packed_format(scheme, name, shape) {
            Some(f) => b.upload_random_packed(f, shape[0], shape[1], std, seed),
            None => b.upload_random(name, shape, mean, std, seed),
        };
        let n = w.bytes();
        if name.starts_with("embed") {
            wb.embed += n;
        } else if name.contains(".ffn.experts.") {
            wb.routed += n;
        } else {
            wb.other += n;
        }
        w
    });
    b.synchronize();
    let free1 = b.mem_free();
    eprintln!(
        "flash bench on {dev}: {} layers {kinds:?}, weights {scheme}, drawn on the device in {:.1} s: {:.2} GB          ({:.2} GB routed experts, {:.2} GB other, {:.2} GB embedding), {:.1} GB free",
        cfg.n_layers(),
        t0.elapsed().as_secs_f64(),
        (free0 - free1) as f64 / 1e9,
        wb.routed as f64 / 1e9,
        wb.other as f64 / 1e9,
        wb.embed as f64 / 1e9,
        free1 as f64 / 1e9
    );
    let max_b = batches.iter().copied().max().unwrap_or(1).max(reserve.map_or(1, |r| r.0));
    let mut m = Model::new(b, cfg.clone(), w, max_b.max(1));
    let mut memory = serde_json::Value::Null;
    if let Some((seqs, tokens)) = reserve {
        let (b, cache) = m.backend_and_cache();
        cache.reserve_tokens(b, tokens);
        b.synchronize();
        let free2 = b.mem_free();
        let used = total_mem - free2;
        eprintln!(
            "memory: state for {max_b} sequence slots with room for {tokens} tokens each: {:.2} GB; device memory in use              {:.2} GB of {:.2} GB ({:.2} GiB)",
            (free1 - free2) as f64 / 1e9,
            used as f64 / 1e9,
            total_mem as f64 / 1e9,
            used as f64 / (1u64 << 30) as f64
        );
        memory = serde_json::json!({"sequences": seqs, "tokens": tokens, "state_bytes": free1 - free2,
            "device_bytes_in_use": used, "weight_bytes": free0 - free1});
    }
    let vocab = cfg.vocab_size;
    let chunk = a.prefill_chunk.max(1);
    let nl = cfg.n_layers() as f64;
    let mut results = Vec::new();

    // Warm-up: kernels load, cuBLAS picks algorithms.
    {
        let s = m.alloc_seq()?;
        let t = toks(chunk.min(2048), 99, vocab);
        m.forward(&Batch::chunk(s, 0, &t)?, &[t.len() - 1])?;
        m.forward(&Batch::chunk(s, t.len(), &[1])?, &[0])?;
        m.free_seq(s);
    }

    for &ctx in &contexts {
        let s = m.alloc_seq()?;
        let t = toks(ctx, ctx as u64, vocab);
        let t0 = Instant::now();
        for (i, c) in t.chunks(chunk).enumerate() {
            m.forward(&Batch::chunk(s, i * chunk, c)?, &[c.len() - 1])?;
        }
        let secs = t0.elapsed().as_secs_f64();
        m.free_seq(s);
        let tps = ctx as f64 / secs;
        let tps43 = tps * nl / FLASH_LAYERS as f64;
        println!(
            "prefill {ctx:>6} tokens (chunks of {chunk}): {secs:8.3} s  {tps:10.0} tok/s with {} layers  {:8.2} ms/layer per 1K tokens  -> {tps43:8.0} tok/s extrapolated to {FLASH_LAYERS} layers",
            cfg.n_layers(),
            secs / nl * 1000.0 / (ctx as f64 / 1000.0)
        );
        results.push(serde_json::json!({"kind": "prefill", "context": ctx, "chunk": chunk, "secs": secs,
            "tokens_per_s": tps, "tokens_per_s_43_layers": tps43}));
    }

    // Decode: max_b sequences prefilled to --decode-context (several per forward), then steps
    // with the first B sequences in one batch.
    let dctx = a.decode_context;
    let seqs: Vec<usize> = (0..max_b).map(|_| m.alloc_seq()).collect::<Result<_, _>>()?;
    let streams: Vec<Vec<u32>> = seqs.iter().map(|&s| toks(dctx + 1, 1000 + s as u64, vocab)).collect();
    let t0 = Instant::now();
    if dctx > 0 {
        let per = (chunk / dctx.min(chunk)).max(1);
        for group in seqs.chunks(per) {
            let mut off = 0;
            while off < dctx {
                let n = (dctx - off).min(chunk);
                let rows: Vec<Row> = group
                    .iter()
                    .flat_map(|&s| (off..off + n).map(move |p| (s, p)))
                    .map(|(s, p)| Row { seq: s, pos: p, token: streams[s][p] })
                    .collect();
                let last = rows.len() - 1;
                m.forward(&Batch::new(rows)?, &[last])?;
                off += n;
            }
        }
    }
    eprintln!("decode: {max_b} sequences prefilled to {dctx} in {:.1} s", t0.elapsed().as_secs_f64());
    let mut pos = vec![dctx; max_b];
    for &bs in &batches {
        let steps = a.decode_tokens.max(1);
        let step = |m: &mut Model<CudaBackend>, pos: &mut Vec<usize>| -> Result<()> {
            let rows: Vec<Row> = (0..bs)
                .map(|i| Row {
                    seq: seqs[i],
                    pos: pos[i],
                    token: ((streams[i][dctx] as usize + pos[i]) % vocab) as u32,
                })
                .collect();
            let all: Vec<usize> = (0..bs).collect();
            m.forward(&Batch::new(rows)?, &all)?;
            for p in pos.iter_mut().take(bs) {
                *p += 1;
            }
            Ok(())
        };
        step(&mut m, &mut pos)?;
        step(&mut m, &mut pos)?;
        let t0 = Instant::now();
        for _ in 0..steps {
            step(&mut m, &mut pos)?;
        }
        let st = t0.elapsed().as_secs_f64() / steps as f64;
        let (wbytes, kvb) = decode_bytes(&cfg, &wb, bs, dctx);
        let frac = (wbytes + kvb) / st / HBM_BYTES_PER_S;
        let tps = bs as f64 / st;
        let tps43 = tps * nl / FLASH_LAYERS as f64;
        println!(
            "decode batch {bs:>3} at context {dctx}: {:8.3} ms/step  {tps:9.1} tok/s  {:7.3} ms/layer  -> {tps43:8.1} tok/s extrapolated to {FLASH_LAYERS} layers;  {:.2} GB weights + {:.3} GB KV per step = {:.1}% of {:.1} TB/s",
            st * 1e3,
            st * 1e3 / nl,
            wbytes / 1e9,
            kvb / 1e9,
            frac * 100.0,
            HBM_BYTES_PER_S / 1e12
        );
        results.push(serde_json::json!({"kind": "decode", "batch": bs, "context": dctx, "ms_per_step": st * 1e3,
            "tokens_per_s": tps, "tokens_per_s_43_layers": tps43, "weight_bytes": wbytes, "kv_bytes": kvb,
            "hbm_fraction": frac}));
    }

    if std::env::var_os("DSV4_PROFILE").is_some() {
        profile_step(&mut m, &seqs[..1], &mut pos, vocab)?;
    }

    // Speculative verify rounds (target side): each of the first B sequences feeds its anchor and
    // l drafts in one forward, then is cut back to the anchor (no replay). Compared with the plain
    // decode step above, `(l + 1) · t_decode / t_round` is the speedup when all l drafts are
    // accepted, before the drafter's own cost (the drafter does not run on the GPU yet).
    let drafts = if a.verify_drafts.trim().is_empty() {
        Vec::new()
    } else {
        parse_list(&a.verify_drafts).context("--verify-drafts")?
    };
    let decode_ms: Vec<(usize, f64)> = results
        .iter()
        .filter(|r| r["kind"] == "decode")
        .map(|r| (r["batch"].as_u64().unwrap_or(0) as usize, r["ms_per_step"].as_f64().unwrap_or(0.0)))
        .collect();
    for &bs in &batches {
        for &l in &drafts {
            let round = |m: &mut Model<CudaBackend>, pos: &mut Vec<usize>| -> Result<()> {
                let rows: Vec<Row> = (0..bs)
                    .flat_map(|i| (0..=l).map(move |k| (i, k)))
                    .map(|(i, k)| Row { seq: seqs[i], pos: pos[i] + k, token: ((pos[i] + 7 * k) % vocab) as u32 })
                    .collect();
                let all: Vec<usize> = (0..rows.len()).collect();
                m.forward(&Batch::new(rows)?, &all)?;
                for i in 0..bs {
                    m.truncate(seqs[i], pos[i] + 1)?;
                    pos[i] += 1;
                }
                Ok(())
            };
            round(&mut m, &mut pos)?;
            let steps = a.decode_tokens.max(1);
            let t0 = Instant::now();
            for _ in 0..steps {
                round(&mut m, &mut pos)?;
            }
            let rt = t0.elapsed().as_secs_f64() / steps as f64 * 1e3;
            let dm = decode_ms.iter().find(|d| d.0 == bs).map_or(f64::NAN, |d| d.1);
            let speedup = (l + 1) as f64 * dm / rt;
            println!(
                "verify batch {bs:>3}, {l} drafts: {rt:8.3} ms/round = {:.2}x a decode step; all {l} accepted -> {speedup:.2}x tokens/s (drafter cost not included)",
                rt / dm
            );
            results.push(serde_json::json!({"kind": "verify", "batch": bs, "drafts": l, "ms_per_round": rt,
                "decode_ms_per_step": dm, "speedup_all_accepted_no_draft_cost": speedup}));
        }
    }
    println!(
        "{}",
        serde_json::json!({"device": dev, "layers": kinds, "weights": scheme, "memory": memory,
            "prefill_chunk": chunk, "results": results})
    );
    Ok(())
}

/// `SEQSxTOKENS` of `--reserve`.
fn parse_reserve(s: &str) -> Result<Option<(usize, usize)>> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    let (a, b) = s.split_once('x').context("--reserve takes SEQSxTOKENS, e.g. 4x32768")?;
    Ok(Some((a.trim().parse().context("--reserve sequences")?, b.trim().parse().context("--reserve tokens")?)))
}

/// The packed format `--weights` gives a tensor (`None`: bf16 or f32 as the backend stores it).
fn packed_format(scheme: &str, name: &str, shape: &[usize]) -> Option<PackedFormat> {
    if name.starts_with("embed") || !dsv4_backend::bf16::is_bf16_weight(name, shape) {
        return None;
    }
    let routed = name.contains(".ffn.experts.");
    let side = name.contains(".compressor.") || name.contains(".indexer.");
    let f = match scheme {
        "q2" if routed && name.ends_with(".w2.weight") => PackedFormat::Q2_K,
        "q2" if routed => PackedFormat::IQ2_XXS,
        "q4" if routed => PackedFormat::Q4_K,
        "q2" | "q4" if side => return None,
        "q2" | "q4" => PackedFormat::Q8_0,
        "official" if routed => PackedFormat::Fp4,
        "official" if name == "head.weight" => return None,
        "official" => PackedFormat::Fp8,
        _ => return None,
    };
    dsv4_backend::bf16::keeps_packed(name, shape, f).then_some(f)
}

/// Marks every named stage of a forward with a timing event and the host clock.
struct StageTimer {
    marks: Vec<(&'static str, dsv4_backend::cuda::TimingEvent, Instant)>,
}

impl dsv4_backend::Capture<CudaBackend> for StageTimer {
    fn capture(&mut self, b: &CudaBackend, stage: dsv4_backend::Stage, _t: &dsv4_backend::cuda::CudaTensor) {
        self.marks.push((stage.name, b.timing_event(), Instant::now()));
    }
}

/// `DSV4_PROFILE=1`: one decode step of `seqs` with every stage timed on the GPU timeline (the
/// time from the previous stage's end) and on the host (time to queue its work), summed over
/// layers. GPU time well above host time means the kernels are slow; the reverse, launches.
fn profile_step(m: &mut Model<CudaBackend>, seqs: &[usize], pos: &mut [usize], vocab: usize) -> Result<()> {
    let rows: Vec<Row> =
        seqs.iter().enumerate().map(|(i, &s)| Row { seq: s, pos: pos[i], token: (pos[i] % vocab) as u32 }).collect();
    let all: Vec<usize> = (0..rows.len()).collect();
    let mut t = StageTimer { marks: vec![("start", m.backend.timing_event(), Instant::now())] };
    let t0 = Instant::now();
    m.forward_with(&Batch::new(rows)?, &all, Some(&mut t))?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    for p in pos.iter_mut().take(seqs.len()) {
        *p += 1;
    }
    let mut agg: Vec<(&str, f64, f64, usize)> = Vec::new();
    for w in t.marks.windows(2) {
        let gpu = w[0].1.elapsed_ms(&w[1].1).unwrap_or(f32::NAN) as f64;
        let host = (w[1].2 - w[0].2).as_secs_f64() * 1e3;
        match agg.iter_mut().find(|a| a.0 == w[1].0) {
            Some(a) => {
                a.1 += gpu;
                a.2 += host;
                a.3 += 1;
            }
            None => agg.push((w[1].0, gpu, host, 1)),
        }
    }
    agg.sort_by(|a, b| b.1.total_cmp(&a.1));
    let gpu_total: f64 = agg.iter().map(|a| a.1).sum();
    println!(
        "profile: one decode step of {} sequence(s): {wall:.2} ms wall, {gpu_total:.2} ms GPU timeline",
        seqs.len()
    );
    for (name, gpu, host, n) in agg {
        println!("  {name:<32} x{n:<3} GPU {gpu:8.3} ms   host {host:8.3} ms");
    }
    Ok(())
}
