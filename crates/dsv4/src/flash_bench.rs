//! `dsv4 bench --backend cuda --synthetic flash --layers N`: full V4-Flash dimensions, N decoder
//! layers drawn on the device (no host copy of the weights), prefill and decode throughput,
//! per layer and extrapolated to the 43 layers of V4-Flash, and the memory bandwidth decode uses.

use crate::bench::BenchArgs;
use crate::cli_util::parse_list;
use anyhow::{bail, Context, Result};
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::synth::synth_weights;
use dsv4_backend::{Batch, Draw, Model, Outputs, Row, StepPath, StepPlan};
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
pub struct WeightBytes {
    embed: usize,
    routed: usize,
    other: usize,
}

/// The synthetic weight layouts: bf16, ds4's GGUF q2 (IQ2_XXS/Q2_K experts, Q8_0 dense) and
/// q4 (Q4_K experts), and the official FP8 + FP4 checkpoint's.
pub const SCHEMES: [&str; 4] = ["bf16", "q2", "q4", "official"];

pub fn check_scheme(scheme: &str, flag: &str) -> Result<()> {
    if !SCHEMES.contains(&scheme) {
        bail!("{flag} must be bf16, q2, q4 or official, not {scheme:?}");
    }
    Ok(())
}

/// Seconds of decode steps before each timed decode window (see the warm-up in [`run`]), and
/// the most steps that warm-up takes.
const DECODE_WARMUP_S: f64 = 0.3;
const WARMUP_MAX_STEPS: usize = 64;

/// Random V4-Flash weights of `cfg` in the layout `scheme` ([`SCHEMES`]), drawn on the device,
/// and their bytes by part.
pub fn draw_weights(
    b: &CudaBackend,
    cfg: &Config,
    scheme: &str,
) -> (dsv4_model::Weights<dsv4_backend::cuda::CudaWeight>, WeightBytes) {
    let mut wb = WeightBytes::default();
    let w = synth_weights(cfg, 1, |name, shape, mean, std, seed| {
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
    (w, wb)
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
    check_scheme(scheme, "--weights")?;
    let reserve = parse_reserve(&a.reserve)?;
    let b = CudaBackend::new(0).context("starting the CUDA backend")?;
    b.set_exact(a.cuda_exact);
    let dev = b.device_name();
    // The side branches the steps run (DSV4_SIDE, DSV4_SIDE_ROWS), kept with the figures.
    let side = serde_json::json!({"mask": b.side_mask(), "rows": b.side_rows()});
    let total_mem = b.mem_total();
    let free0 = b.mem_free();
    let t0 = Instant::now();
    let (w, wb) = draw_weights(&b, &cfg, scheme);
    b.synchronize();
    let free1 = b.mem_free();
    eprintln!(
        "flash bench on {dev}: {} layers {kinds:?}, weights {scheme}, drawn on the device in {:.1} s: {:.2} GB          ({:.2} GB routed experts, {:.2} GB other, {:.2} GB embedding), {:.1} GB free; side branches {side}",
        cfg.n_layers(),
        t0.elapsed().as_secs_f64(),
        (free0 - free1) as f64 / 1e9,
        wb.routed as f64 / 1e9,
        wb.other as f64 / 1e9,
        wb.embed as f64 / 1e9,
        free1 as f64 / 1e9
    );
    let max_b = batches.iter().copied().max().unwrap_or(1).max(reserve.map_or(1, |r| r.0));
    // DSV4_PROFILE_PREFILL (below) prefills one more sequence beside the decode ones.
    let profile_slot = std::env::var_os("DSV4_PROFILE_PREFILL").is_some() as usize;
    let mut m = Model::new(b, cfg.clone(), w, max_b.max(1) + profile_slot);
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

    // Warm-up: kernels load, cuBLAS picks algorithms (skipped with --cold: the first context's
    // prefill is then a cold time to first token).
    if !a.cold {
        let s = m.alloc_seq()?;
        let t = toks(chunk.min(2048), 99, vocab);
        m.forward(&Batch::chunk(s, 0, &t)?, &[t.len() - 1])?;
        m.forward(&Batch::chunk(s, t.len(), &[1])?, &[0])?;
        m.free_seq(s);
    }

    for (ci, &ctx) in contexts.iter().enumerate() {
        let s = m.alloc_seq()?;
        let t = toks(ctx, ctx as u64, vocab);
        let t0 = Instant::now();
        let mut last = Vec::new();
        for (i, c) in t.chunks(chunk).enumerate() {
            last = m.forward(&Batch::chunk(s, i * chunk, c)?, &[c.len() - 1])?;
        }
        // The first token: the last row's greedy choice on the host (the logits came back).
        let first = last.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        let secs = t0.elapsed().as_secs_f64();
        if a.cold && ci == 0 {
            println!(
                "cold time to first token: {ctx} tokens in {secs:.3} s (token {}, no warm-up, {} layers)",
                first.0,
                cfg.n_layers()
            );
        }
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
    // With --decode-fill clone only the first sequence is prefilled; the rest restore its state.
    let prefilled = if a.decode_fill == "clone" { &seqs[..seqs.len().min(1)] } else { &seqs[..] };
    if dctx > 0 {
        let per = (chunk / dctx.min(chunk)).max(1);
        for group in prefilled.chunks(per) {
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
    if dctx > 0 && prefilled.len() < seqs.len() {
        let snap = m.snapshot(seqs[0]).context("snapshot of the prefilled decode sequence")?;
        for &s in &seqs[prefilled.len()..] {
            anyhow::ensure!(m.restore(s, &snap), "restoring decode sequence {s} from the first one's snapshot");
        }
        m.backend_and_cache().0.synchronize();
    }
    eprintln!(
        "decode: {max_b} sequences at context {dctx} ({} prefilled, the rest cloned) in {:.1} s; steps return {}",
        prefilled.len(),
        t0.elapsed().as_secs_f64(),
        match (a.step_logits, a.step_sample) {
            (true, _) => "every row's logits (--step-logits)",
            (false, true) => "ids drawn on the device at temperature 0.7, top-p 0.95 (--step-sample)",
            _ => "greedy ids",
        }
    );
    let mut pos = vec![dctx; max_b];
    let drafts = if a.verify_drafts.trim().is_empty() {
        if a.dspark_round {
            vec![1, 2, 3, 4]
        } else {
            Vec::new()
        }
    } else {
        parse_list(&a.verify_drafts).context("--verify-drafts")?
    };
    // `--decode-fusions 0,1`: each batch with the fusions off, then at their defaults (the
    // verify and DSpark rounds below run under the last setting).
    let fusions: Vec<Option<bool>> = if a.decode_fusions.trim().is_empty() {
        vec![None]
    } else {
        parse_list(&a.decode_fusions).context("--decode-fusions")?.into_iter().map(|v| Some(v != 0)).collect()
    };
    // Every position the timed steps will reach, reserved now (as `serve` reserves its context
    // limit): a state that grows inside a timed window reallocates every slot's entries and
    // re-records the step, 30–50 ms at 43 layers (v24: what the first window's penalty was).
    // Decode windows (warm-up and timed steps), verify rounds (up to four untimed, each l drafts
    // past the anchor), DSpark's measured rounds (τ = 2..4, three untimed and `steps` timed, τ
    // positions each), and the profiles' few steps.
    let steps = a.decode_tokens.max(1);
    let span = batches.len() * fusions.len() * (WARMUP_MAX_STEPS + steps)
        + batches.len() * drafts.len() * (steps + 4)
        + drafts.iter().copied().max().unwrap_or(0)
        + if a.dspark_round { batches.len() * 9 * (steps + 3) } else { 0 }
        + 64;
    m.reserve_state(dctx + span);
    m.backend_and_cache().0.synchronize();
    let reserved_generation = m.backend_and_cache().1.generation;
    for (&bs, &fused) in batches.iter().flat_map(|b| fusions.iter().map(move |f| (b, f))) {
        if let Some(on) = fused {
            m.backend.set_decode_fusions(on);
        }
        let tag = fused.map_or(String::new(), |on| format!(" (fusions {})", if on { "on" } else { "off" }));
        let step = |m: &mut Model<CudaBackend>, pos: &mut Vec<usize>| -> Result<()> {
            let rows: Vec<Row> = (0..bs)
                .map(|i| Row {
                    seq: seqs[i],
                    pos: pos[i],
                    token: ((streams[i][dctx] as usize + pos[i]) % vocab) as u32,
                })
                .collect();
            let all: Vec<usize> = (0..bs).collect();
            let batch = Batch::new(rows)?;
            let logits = if a.step_logits { all.len() } else { 0 };
            let draws: Vec<Draw> = if a.step_sample {
                // A uniform a row and position (the engine takes it from the request's seed).
                let u =
                    |i: usize| ((pos[i] as u64 * 2_654_435_761 + i as u64 * 40_503) % 1_000_003) as f64 / 1_000_003.0;
                (0..bs).map(|i| Draw { temperature: 0.7, top_p: 0.95, u: u(i), ..Draw::GREEDY }).collect()
            } else {
                Vec::new()
            };
            let outputs = Outputs { out_rows: &all, taps: &[] };
            let out = m.step(&StepPlan { batch: &batch, outputs, logits, draws: &draws })?;
            // As the engine does: the logits' pages serve the next step's download.
            m.recycle(out.logits);
            for p in pos.iter_mut().take(bs) {
                *p += 1;
            }
            Ok(())
        };
        // Warm-up: at least two steps (the graph's capture, the first replay) and 0.3 s of
        // steps in all. The first window of a process ran 10–40 % slow on the H200 (v24: batch 1
        // at 43 layers 10.2–12.9 ms in the first 16-step window, 9.3–9.6 after), mostly the
        // state's growth that the reservation above now keeps out.
        let warm = Instant::now();
        let mut n = 0;
        while n < 2 || (warm.elapsed().as_secs_f64() < DECODE_WARMUP_S && n < WARMUP_MAX_STEPS) {
            step(&mut m, &mut pos)?;
            n += 1;
        }
        let generation = m.backend_and_cache().1.generation;
        let t0 = Instant::now();
        for _ in 0..steps {
            step(&mut m, &mut pos)?;
        }
        let st = t0.elapsed().as_secs_f64() / steps as f64;
        if m.backend_and_cache().1.generation != generation {
            println!(
                "warning: decode batch {bs}: the state grew inside the timed window (a re-record is in the figure)"
            );
        }
        if std::env::var_os("DSV4_PROFILE_CAPTURE").is_some() {
            // One more step inside the profiler's capture range (`ncu --profile-from-start
            // off`, tools/device/profile.sh): the weight draw and the prefill stay out of it.
            m.backend.profiler_capture(true);
            step(&mut m, &mut pos)?;
            m.backend.profiler_capture(false);
        }
        let (wbytes, kvb) = decode_bytes(&cfg, &wb, bs, dctx);
        let frac = (wbytes + kvb) / st / HBM_BYTES_PER_S;
        let tps = bs as f64 / st;
        let tps43 = tps * nl / FLASH_LAYERS as f64;
        println!(
            "decode batch {bs:>3} at context {dctx}{tag}: {:8.3} ms/step  {tps:9.1} tok/s  {:7.3} ms/layer  -> {tps43:8.1} tok/s extrapolated to {FLASH_LAYERS} layers;  {:.2} GB weights + {:.3} GB KV per step = {:.1}% of {:.1} TB/s",
            st * 1e3,
            st * 1e3 / nl,
            wbytes / 1e9,
            kvb / 1e9,
            frac * 100.0,
            HBM_BYTES_PER_S / 1e12
        );
        // Issue 11 counts the kernels a decode layer launches: the recorded step's kernel nodes
        // (embedding, final norm, LM head and sampling included) over the layers.
        let kernels = m.recorded_kernels(bs, bs);
        if let Some(k) = kernels {
            println!(
                "decode batch {bs:>3}{tag}: the recorded step launches {k} kernels = {:.1} a layer",
                k as f64 / nl
            );
        }
        results.push(serde_json::json!({"kind": "decode", "batch": bs, "context": dctx, "ms_per_step": st * 1e3,
            "tokens_per_s": tps, "tokens_per_s_43_layers": tps43, "weight_bytes": wbytes, "kv_bytes": kvb,
            "hbm_fraction": frac, "step_kernels": kernels, "decode_fusions": fused,
            "step_logits": a.step_logits, "step_sample": a.step_sample}));
    }

    if std::env::var_os("DSV4_PROFILE").is_some() {
        profile_step(&mut m, &seqs[..1], &mut pos, vocab)?;
    }
    // `DSV4_PROFILE_PREFILL=N[,N…]`: the same stage timing over one prefill chunk of N tokens (a fresh
    // sequence), where issue 12's time goes.
    let chunks = std::env::var("DSV4_PROFILE_PREFILL").map(|v| parse_list(&v)).unwrap_or(Ok(Vec::new()));
    for n in chunks.context("DSV4_PROFILE_PREFILL")? {
        let s = m.alloc_seq()?;
        let t = toks(n.max(1), 4242, vocab);
        if std::env::var_os("DSV4_PROFILE_CAPTURE").is_some() {
            // The chunk's plain forward inside the profiler's capture (ncu per kernel,
            // tools/device/profile.sh with PREFILL=N), before the probed stage timing.
            m.backend.profiler_capture(true);
            m.forward(&Batch::chunk(s, 0, &t)?, &[t.len() - 1])?;
            m.backend.profiler_capture(false);
            m.free_seq(s);
            let s = m.alloc_seq()?;
            let rows: Vec<Row> = t.iter().enumerate().map(|(p, &token)| Row { seq: s, pos: p, token }).collect();
            profile_rows(&mut m, rows, &format!("one prefill chunk of {} tokens", t.len()))?;
            m.free_seq(s);
            continue;
        }
        let rows: Vec<Row> = t.iter().enumerate().map(|(p, &token)| Row { seq: s, pos: p, token }).collect();
        profile_rows(&mut m, rows, &format!("one prefill chunk of {} tokens", t.len()))?;
        m.free_seq(s);
    }

    // Speculative verify rounds (target side): each of the first B sequences feeds its anchor and
    // l drafts in one forward, then is cut back to the anchor (no replay). Each sequence's
    // tokens differ, as the decode steps' do: with cloned contexts, the same tokens in every
    // sequence would route every row of a position to the same experts. Compared with the plain
    // decode step above, `(l + 1) · t_decode / t_round` is the speedup when all l drafts are
    // accepted, before the drafter's own cost (the drafter does not run on the GPU yet).
    let decode_ms: Vec<(usize, f64)> = results
        .iter()
        .filter(|r| r["kind"] == "decode")
        .map(|r| (r["batch"].as_u64().unwrap_or(0) as usize, r["ms_per_step"].as_f64().unwrap_or(0.0)))
        .collect();
    for &bs in &batches {
        for &l in &drafts {
            let round = |m: &mut Model<CudaBackend>, pos: &mut Vec<usize>| -> Result<StepPath> {
                let rows: Vec<Row> = (0..bs)
                    .flat_map(|i| (0..=l).map(move |k| (i, k)))
                    .map(|(i, k)| Row {
                        seq: seqs[i],
                        pos: pos[i] + k,
                        token: ((streams[i][dctx] as usize + pos[i] + 7 * k) % vocab) as u32,
                    })
                    .collect();
                let all: Vec<usize> = (0..rows.len()).collect();
                let batch = Batch::new(rows)?;
                let logits = if a.step_logits { all.len() } else { 0 };
                let out = m.step(&StepPlan {
                    batch: &batch,
                    outputs: Outputs { out_rows: &all, taps: &[] },
                    logits,
                    draws: &[],
                })?;
                m.recycle(out.logits);
                for i in 0..bs {
                    m.truncate(seqs[i], pos[i] + 1)?;
                    pos[i] += 1;
                }
                Ok(out.path)
            };
            // Untimed rounds until one replays (a shape runs eagerly when first seen, is recorded
            // the second time): the recording stays out of the timed window.
            for _ in 0..3 {
                if round(&mut m, &mut pos)? == StepPath::Replayed {
                    break;
                }
            }
            if std::env::var("DSV4_PROFILE_VERIFY").is_ok_and(|v| v.trim() == l.to_string()) {
                // One replayed round inside the profiler's capture range (tools/device/profile.sh
                // with DSV4_PROFILE_VERIFY=l: the report's last forward is this round's).
                m.backend.profiler_capture(true);
                round(&mut m, &mut pos)?;
                m.backend.profiler_capture(false);
            }
            let mut paths = [0usize; 3];
            let t0 = Instant::now();
            for _ in 0..steps {
                let p = round(&mut m, &mut pos)?;
                paths[StepPath::ALL.iter().position(|&q| q == p).unwrap_or(0)] += 1;
            }
            let rt = t0.elapsed().as_secs_f64() / steps as f64 * 1e3;
            let dm = decode_ms.iter().rev().find(|d| d.0 == bs).map_or(f64::NAN, |d| d.1);
            let speedup = (l + 1) as f64 * dm / rt;
            let how: Vec<String> = StepPath::ALL
                .iter()
                .zip(paths)
                .filter(|&(_, n)| n > 0)
                .map(|(p, n)| format!("{n} {}", p.name()))
                .collect();
            println!(
                "verify batch {bs:>3}, {l} drafts: {rt:8.3} ms/round = {:.2}x a decode step; all {l} accepted -> {speedup:.2}x tokens/s (drafter cost not included); steps {}",
                rt / dm,
                how.join(", ")
            );
            results.push(serde_json::json!({"kind": "verify", "batch": bs, "drafts": l, "ms_per_round": rt,
                "decode_ms_per_step": dm, "speedup_all_accepted_no_draft_cost": speedup}));
        }
    }
    if a.dspark_round {
        let target = Target { m: &mut m, seqs: &seqs, pos: &mut pos };
        let scheme = if a.dspark_weights.is_empty() { &a.weights } else { &a.dspark_weights };
        check_scheme(scheme, "--dspark-weights")?;
        // A CUDA failure there (out of memory at a large batch: the drafter's 6–8 GB beside a
        // 32-layer target on an H100) panics inside the backend; the figures taken so far, and
        // the JSON line below, still come out.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dspark_round(&cfg, scheme, &batches, dctx, a.decode_tokens.max(1), target, &mut results)
        }));
        match r {
            Ok(r) => r?,
            Err(p) => {
                let msg = p.downcast_ref::<String>().map(String::as_str).or(p.downcast_ref::<&str>().copied());
                println!("dspark: stopped by a backend failure: {}", msg.unwrap_or("(no message)"));
            }
        }
    }
    if m.backend_and_cache().1.generation != reserved_generation {
        println!("warning: the state grew after the reservation for the timed steps (a figure may hold a re-record)");
    }
    println!(
        "{}",
        serde_json::json!({"device": dev, "layers": kinds, "weights": scheme, "memory": memory,
            "prefill_chunk": chunk, "side": side, "results": results})
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
    profile_rows(m, rows, &format!("one decode step of {} sequence(s)", seqs.len()))?;
    for p in pos.iter_mut().take(seqs.len()) {
        *p += 1;
    }
    Ok(())
}

/// One forward of `rows` (the last row's logits) with every stage timed (see [`profile_step`]).
fn profile_rows(m: &mut Model<CudaBackend>, rows: Vec<Row>, what: &str) -> Result<()> {
    let outs = if rows.len() > 1 { vec![rows.len() - 1] } else { (0..rows.len()).collect() };
    let mut t = StageTimer { marks: vec![("start", m.backend.timing_event(), Instant::now())] };
    let t0 = Instant::now();
    m.forward_with(&Batch::new(rows)?, &outs, Some(&mut t))?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
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
    println!("profile: {what}: {wall:.2} ms wall, {gpu_total:.2} ms GPU timeline");
    for (name, gpu, host, n) in agg {
        println!("  {name:<32} x{n:<3} GPU {gpu:8.3} ms   host {host:8.3} ms");
    }
    Ok(())
}

/// Median of `reps` timings of `f` (seconds).
fn time_median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut xs = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        xs.push(t0.elapsed().as_secs_f64());
    }
    xs.sort_by(f64::total_cmp);
    Ok(xs[xs.len() / 2])
}

/// The target model of the bench and its decode sequences (prefilled, at `pos`).
struct Target<'a> {
    m: &'a mut Model<CudaBackend>,
    seqs: &'a [usize],
    pos: &'a mut [usize],
}

/// Whole DSpark rounds measured end to end on the bench's target (all of its layers, the
/// recorded-step path) with the drafter `d`, at forced acceptance length `tau`: draft a block
/// for each of the first `bs` sequences, verify `[anchor, d0..d(τ-2)]` in one step that taps
/// the drafter's layers, keep every row (all drafts accepted, the last row's argmax is the
/// bonus token), commit the τ tapped rows to the rings. Returns the median ms per round.
fn measured_rounds(
    t: &mut Target<'_>,
    d: &dsv4_dspark::Drafter<CudaBackend>,
    rings: &mut [dsv4_dspark::Ring<dsv4_backend::cuda::CudaTensor>],
    bs: usize,
    tau: usize,
    reps: usize,
    noise: &[f32],
) -> Result<f64> {
    use dsv4_backend::{Outputs, StepPlan};
    use dsv4_dspark::DraftRequest;
    let taps: Vec<usize> = d.config().target_layer_ids.clone();
    let (hw, win) = (d.hidden_width(), rings[0].window());
    // The rings hold the window before each sequence's position (noise rows).
    {
        let rows: Vec<Vec<(usize, &[f32])>> = (0..bs)
            .map(|i| {
                (t.pos[i].saturating_sub(win)..t.pos[i])
                    .map(|p| (p, &noise[(p % win) * hw..(p % win + 1) * hw]))
                    .collect()
            })
            .collect();
        let mut items: Vec<_> = rings[..bs].iter_mut().zip(&rows).map(|(r, x)| (r, x.as_slice())).collect();
        d.commit_batch(&mut items)?;
    }
    let mut anchors: Vec<u32> = (0..bs).map(|i| (1000 + 37 * i) as u32).collect();
    let mut round = || -> Result<()> {
        let reqs: Vec<DraftRequest<_>> = rings[..bs]
            .iter()
            .enumerate()
            .map(|(i, ring)| DraftRequest { ring, anchor: anchors[i], anchor_pos: t.pos[i] })
            .collect();
        let drafts = d.draft_batch(&reqs, false)?;
        drop(reqs);
        let rows: Vec<Row> = (0..bs)
            .flat_map(|i| {
                let toks: Vec<u32> =
                    std::iter::once(anchors[i]).chain(drafts[i].tokens[..tau - 1].iter().copied()).collect();
                let (seq, p0) = (t.seqs[i], t.pos[i]);
                toks.into_iter().enumerate().map(move |(k, token)| Row { seq, pos: p0 + k, token })
            })
            .collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let batch = Batch::new(rows)?;
        let out = t.m.step(&StepPlan {
            batch: &batch,
            outputs: Outputs { out_rows: &all, taps: &taps },
            logits: 0,
            draws: &[],
        })?;
        let committed: Vec<Vec<(usize, &[f32])>> = (0..bs)
            .map(|i| {
                (0..tau).map(|k| (t.pos[i] + k, &out.hidden[(i * tau + k) * hw..(i * tau + k + 1) * hw])).collect()
            })
            .collect();
        let mut items: Vec<_> = rings[..bs].iter_mut().zip(&committed).map(|(r, x)| (r, x.as_slice())).collect();
        d.commit_batch(&mut items)?;
        for (i, (a, p)) in anchors.iter_mut().zip(t.pos.iter_mut()).enumerate() {
            *a = out.ids[i * tau + tau - 1];
            *p += tau;
        }
        Ok(())
    };
    round()?;
    round()?;
    Ok(time_median(reps, round)? * 1e3)
}

/// `--dspark-round`: a synthetic V4-Flash DSpark drafter on the GPU (its own backend on the same
/// device, weights drawn there), per decode batch: one batched draft (3 stages over B·γ rows,
/// the LM head, the γ-step Markov loop with a device argmax), the commit of 1 + n captured rows
/// per sequence into the device rings, and the round cost against the plain decode step and
/// the verify forwards timed above. The target side (decode step, verify) is extrapolated to
/// the 43 layers of V4-Flash by scaling its time by 43 / layers (as the throughput lines above
/// do); the drafter is timed as is (it has its 3 full stages). Then whole rounds are measured on
/// the target itself ([`measured_rounds`]: draft, verify with the taps, commit), with no
/// extrapolation when the bench runs all 43 layers.
#[allow(clippy::too_many_arguments)]
fn dspark_round(
    cfg: &Config,
    scheme: &str,
    batches: &[usize],
    dctx: usize,
    reps: usize,
    target: Target<'_>,
    results: &mut Vec<serde_json::Value>,
) -> Result<()> {
    use dsv4_dspark::weights::DrafterWeights;
    use dsv4_dspark::{DraftRequest, Drafter, DsparkConfig};
    let db = CudaBackend::new(0).context("starting the drafter's CUDA backend")?;
    let nl = cfg.n_layers();
    let dcfg = DsparkConfig {
        block_size: 5,
        noise_token_id: 128799,
        target_layer_ids: (nl.saturating_sub(3)..nl).collect(),
        markov_rank: 256,
    };
    let free0 = db.mem_free();
    let t0 = Instant::now();
    let mut seed = 7_000_000u64;
    // In the layout `scheme`, by the target's rule (`packed_format`: the stages' experts, their
    // attention projections and the head packed as the target's are).
    let w = DrafterWeights::walk(cfg, &dcfg, 3, |s| -> Result<_> {
        seed += 1;
        Ok(match packed_format(scheme, &s.name, s.shape) {
            Some(f) => db.upload_random_packed(f, s.shape[0], s.shape[1], s.std, seed),
            None => db.upload_random(&s.name, s.shape, s.mean, s.std, seed),
        })
    })?;
    db.synchronize();
    let free1 = db.mem_free();
    let d = Drafter::new(db, cfg.clone(), dcfg.clone(), w);
    eprintln!(
        "dspark: synthetic V4-Flash drafter (3 stages, γ = {}, Markov rank {}, weights {scheme}) drawn on the device in {:.1} s, {:.1} GB",
        dcfg.block_size,
        dcfg.markov_rank,
        t0.elapsed().as_secs_f64(),
        (free0 - free1) as f64 / 1e9
    );
    let (hw, win) = (d.hidden_width(), cfg.window);
    // Captured rows: host noise of the scale of an mHC mean.
    let mut s = 0x5EEDu64;
    let hidden: Vec<f32> = (0..win * hw)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect();
    let row = |i: usize| &hidden[(i % win) * hw..(i % win + 1) * hw];
    let p0 = dctx.max(win); // the last committed position
    let decode = |bs: usize| {
        results.iter().rev().find(|r| r["kind"] == "decode" && r["batch"] == bs).and_then(|r| r["ms_per_step"].as_f64())
    };
    let verify = |bs: usize, l: usize| {
        results
            .iter()
            .find(|r| r["kind"] == "verify" && r["batch"] == bs && r["drafts"] == l)
            .and_then(|r| r["ms_per_round"].as_f64())
    };
    let scale = FLASH_LAYERS as f64 / nl as f64;
    let mut out = Vec::new();
    let mut target = target;
    let target_seqs = target.seqs.len();
    for &bs in batches {
        let mut rings: Vec<_> = (0..bs).map(|_| d.new_ring()).collect();
        {
            let rows: Vec<Vec<(usize, &[f32])>> =
                (0..bs).map(|i| (p0 + 1 - win..=p0).map(|p| (p, row(p + i))).collect()).collect();
            let mut items: Vec<_> = rings.iter_mut().zip(&rows).map(|(r, x)| (r, x.as_slice())).collect();
            d.commit_batch(&mut items)?;
        }
        let reqs: Vec<DraftRequest<_>> = rings
            .iter()
            .enumerate()
            .map(|(i, ring)| DraftRequest { ring, anchor: (1000 + 37 * i) as u32, anchor_pos: p0 + 1 })
            .collect();
        let t_draft = time_median(reps, || {
            d.draft_batch(&reqs, false)?;
            Ok(())
        })? * 1e3;
        let t_block = time_median(reps, || {
            d.block_only(&reqs)?;
            Ok(())
        })? * 1e3;
        if std::env::var_os("DSV4_PROFILE_DRAFT").is_some() {
            // One more draft inside the profiler's capture (ncu `--profile-from-start off`,
            // tools/device/ncu_draft.sh): its kernels' times against the draft's wall time above
            // say how much of a draft is launches and waits rather than kernels.
            d.backend().profiler_capture(true);
            d.draft_batch(&reqs, false)?;
            d.backend().profiler_capture(false);
        }
        drop(reqs);
        // Committing n + 1 rows per sequence (the anchor and n accepted drafts), rewriting the
        // ring's last slots.
        let mut t_commit = vec![0.0; 6];
        for (n1, t) in t_commit.iter_mut().enumerate().skip(1) {
            let rows: Vec<Vec<(usize, &[f32])>> =
                (0..bs).map(|i| (p0 + 1 - n1..=p0).map(|p| (p, row(p + i))).collect()).collect();
            *t = time_median(reps, || {
                let mut items: Vec<_> = rings.iter_mut().zip(&rows).map(|(r, x)| (r, x.as_slice())).collect();
                d.commit_batch(&mut items)?;
                d.backend().synchronize();
                Ok(())
            })? * 1e3;
        }
        let Some(dm) = decode(bs) else {
            println!("dspark round batch {bs}: no decode step timed for this batch");
            continue;
        };
        println!(
            "dspark batch {bs:>3}: draft {t_draft:8.3} ms (stages + LM head {t_block:.3} ms, Markov loop {:.3} ms; {:.2}x a {nl}-layer decode step, {:.2}x a 43-layer one); commit of 1/3/5 rows per sequence {:.3}/{:.3}/{:.3} ms",
            t_draft - t_block,
            t_draft / dm,
            t_draft / (dm * scale),
            t_commit[1],
            t_commit[3],
            t_commit[5]
        );
        for l in 1..=4usize {
            let Some(vm) = verify(bs, l) else { continue };
            // All l drafts accepted: l + 1 tokens, l + 1 rows committed.
            let round = t_draft + vm + t_commit[l + 1];
            let round43 = t_draft + vm * scale + t_commit[l + 1];
            println!(
                "dspark batch {bs:>3}, verify 1+{l}: round {round:8.3} ms = {:.2}x decode ({nl} layers); 43 layers: draft {t_draft:.3} + verify {:.3} + commit {:.3} = {round43:.3} ms = {:.2}x a {:.3} ms decode step",
                round / dm,
                vm * scale,
                t_commit[l + 1],
                round43 / (dm * scale),
                dm * scale
            );
            out.push(serde_json::json!({"kind": "dspark_round", "batch": bs, "drafts": l, "draft_ms": t_draft,
                "commit_ms": t_commit[l + 1], "verify_ms": vm, "decode_ms": dm, "round_ms": round,
                "round_decode_steps": round / dm, "verify_ms_43": vm * scale, "decode_ms_43": dm * scale,
                "round_decode_steps_43": round43 / (dm * scale)}));
        }
        // Forced acceptance lengths τ (tokens emitted per round, the bonus included): the verify
        // is cut to τ - 1 drafts (ideal confidence truncation), or always 4 (fixed length).
        for (tau, &commit) in t_commit.iter().enumerate().take(5).skip(2) {
            let mut line = format!("dspark batch {bs:>3}, acceptance length {tau}:");
            for (name, l) in [("verify 1+(τ-1)", tau - 1), ("verify 1+4", 4)] {
                let Some(vm) = verify(bs, l) else { continue };
                let cost = t_draft + vm + commit;
                let cost43 = t_draft + vm * scale + commit;
                let sp = tau as f64 / (cost / dm);
                let sp43 = tau as f64 / (cost43 / (dm * scale));
                line += &format!("  {name}: {sp:.2}x ({nl} layers), {sp43:.2}x (43 layers)");
                out.push(serde_json::json!({"kind": "dspark_speedup", "batch": bs, "acceptance_length": tau,
                    "verify_drafts": l, "speedup": sp, "speedup_43": sp43, "round_ms": cost, "round_ms_43": cost43}));
            }
            println!("{line} tokens/s vs plain decode");
        }
        out.push(serde_json::json!({"kind": "dspark_draft", "batch": bs, "draft_ms": t_draft, "block_ms": t_block,
            "commit_ms": t_commit}));
        // Measured: whole rounds on the bench's target (its own layers, not extrapolated).
        if bs <= target_seqs {
            let mut line = format!("dspark batch {bs:>3}, measured rounds on the {nl}-layer target:");
            for tau in 2..=4usize {
                let rt = measured_rounds(&mut target, &d, &mut rings, bs, tau, reps, &hidden)?;
                let sp = tau as f64 * dm / rt;
                line += &format!("  τ = {tau}: {rt:.3} ms/round = {sp:.2}x tokens/s");
                out.push(serde_json::json!({"kind": "dspark_measured", "batch": bs, "acceptance_length": tau,
                    "round_ms": rt, "decode_ms": dm, "speedup": sp}));
            }
            println!("{line} vs plain decode");
        }
    }
    results.extend(out);
    Ok(())
}
