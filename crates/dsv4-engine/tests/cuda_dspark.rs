//! The DSpark drafter on the GPU against the CPU drafter, and DSpark greedy decoding with a GPU
//! target and GPU drafter against plain greedy decoding. Skips (passes with a message) where no
//! CUDA device is present.
//!
//! Tolerances: drafted tokens equal; the Markov-corrected logits `Z` of every block within 1e-4
//! of the CPU's (max |Δ| / max |Z_cpu| over the block), raw confidences within 1e-4 absolute,
//! ring rows within 1e-4 relative. The GPU runs in exact mode (f32 activations into every
//! product), so the only differences are summation orders.
#![cfg(feature = "cuda")]

use dsv4_backend::cpu::Tensor;
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::{Backend, Model};
use dsv4_dspark::weights::DrafterWeights;
use dsv4_dspark::{Draft, DraftRequest, Drafter, DsparkConfig};
use dsv4_engine::{
    generate, generate_speculative, spawn, DeviceProposer, EngineConfig, Event, GenerateOptions, Proposer, Request,
    Sampler, SamplingParams, SpecConfig,
};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, random_dspark, tiny_config, SynthDType, SynthDspark};
use dsv4_model::{Config, TensorStore};
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TOL: f64 = 1e-4;

fn gpu(f32_weights: bool) -> Option<CudaBackend> {
    CudaBackend::exact_or_skip(f32_weights)
}

/// The DSpark golden fixtures: `DSV4_DSPARK_FIXTURES`, else the dsv4-dspark crate's.
fn fixtures() -> PathBuf {
    if let Ok(d) = std::env::var("DSV4_DSPARK_FIXTURES") {
        return d.into();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../dsv4-dspark/tests/fixtures")
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs())) / scale
}

fn maxabs(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()))
}

/// Worst errors seen.
#[derive(Default, Debug)]
struct Worst {
    logits: f64,
    conf: f64,
    ring: f64,
    blocks: usize,
}

impl Worst {
    fn draft(&mut self, what: &str, g: &Draft, c: &Draft) {
        assert_eq!(g.tokens, c.tokens, "{what}: drafted tokens");
        let e = rel(&g.logits, &c.logits);
        assert!(e <= TOL, "{what}: logits rel err {e:.3e}");
        let ec = maxabs(&g.conf_raw, &c.conf_raw);
        assert!(ec <= TOL, "{what}: conf_raw abs err {ec:.3e}");
        self.logits = self.logits.max(e);
        self.conf = self.conf.max(ec);
        self.blocks += 1;
    }
}

fn ring_err<B: Backend>(gd: &Drafter<B>, g: &dsv4_dspark::Ring<B::T>, c: &dsv4_dspark::ContextRing) -> f64 {
    assert_eq!(g.tags(), c.tags(), "ring tags");
    let mut e = 0f64;
    for s in 0..c.n_stages() {
        let gh = gd.backend().to_host(g.stage_tensor(s));
        for (slot, t) in c.tags().iter().enumerate() {
            if t.is_some() {
                let w = c.width();
                e = e.max(rel(&gh[slot * w..(slot + 1) * w], c.row(s, slot)));
            }
        }
    }
    e
}

fn f64s(store: &TensorStore, name: &str) -> Vec<f32> {
    store.raw(name).unwrap().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32).collect()
}

/// Golden tiny drafter (DeepSeek's reference weights and teacher-forced context rows): the GPU
/// drafter (f32 weights) drafts what the CPU drafter drafts, block by block, alone and batched.
#[test]
fn golden_drafter_gpu_equals_cpu() {
    let Some(b) = gpu(true) else { return };
    let fx = fixtures();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fx.join("config_official.json"), dir.path().join("config.json")).unwrap();
    std::fs::copy(fx.join("weights.safetensors"), dir.path().join("weights.safetensors")).unwrap();
    let cpu = Drafter::load_dir(dir.path()).unwrap();
    let gd = Drafter::load_dir_on(b, dir.path()).unwrap();
    let t = TensorStore::open(&fx.join("target_golden.safetensors")).unwrap();
    let g = TensorStore::open(&fx.join("draft_golden.safetensors")).unwrap();
    let mh = f64s(&t, "main_hidden");
    let hw = cpu.hidden_width();
    let row = |p: usize| &mh[p * hw..(p + 1) * hw];
    let (ps, anchors) = (g.i64("P").unwrap(), g.i64("anchor").unwrap());
    let win = cpu.target_config().window;
    let prompt = 41;
    let pre: Vec<(usize, &[f32])> = (prompt - win.min(prompt)..prompt).map(|p| (p, row(p))).collect();
    let (mut cr, mut gr) = (cpu.new_ring(), gd.new_ring());
    cpu.commit(&mut cr, &pre).unwrap();
    gd.commit(&mut gr, &pre).unwrap();
    let mut w = Worst::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    for (&p, &a) in ps.iter().zip(&anchors) {
        let p = p as usize;
        if p >= prompt {
            cpu.commit(&mut cr, &[(p, row(p))]).unwrap();
            gd.commit(&mut gr, &[(p, row(p))]).unwrap();
        }
        w.ring = w.ring.max(ring_err(&gd, &gr, &cr));
        let c = cpu.draft(&cr, a as u32, p + 1, 0.0, &mut rng).unwrap();
        let gg = gd.draft(&gr, a as u32, p + 1, 0.0, &mut rng).unwrap();
        w.draft(&format!("golden block P={p}"), &gg, &c);
        let gb = gd.draft_batch(&[DraftRequest { ring: &gr, anchor: a as u32, anchor_pos: p + 1 }], true).unwrap();
        w.draft(&format!("golden block P={p} (batched)"), &gb[0], &c);
    }
    assert!(w.ring <= TOL, "ring rows rel err {:.3e}", w.ring);
    println!("golden drafter, GPU (f32 weights) vs CPU: {w:?}");
}

/// A normal-ish deterministic generator for synthetic host weights.
struct Lcg(u64);
impl Lcg {
    fn normal(&mut self) -> f32 {
        let mut u = || {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (a, b) = (u(), u());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
}

/// The synthetic drafter's settings for `cfg` (`rank`: another Markov rank than its own).
fn tiny_dspark(cfg: &Config, rank: Option<usize>) -> DsparkConfig {
    let ds = SynthDspark::for_config(cfg);
    DsparkConfig {
        block_size: ds.block_size,
        noise_token_id: ds.noise_token_id,
        target_layer_ids: ds.target_layer_ids.clone(),
        markov_rank: rank.unwrap_or(ds.markov_rank),
    }
}

fn random_weights(cfg: &Config, dcfg: &DsparkConfig, seed: u64) -> DrafterWeights {
    let mut r = Lcg(seed);
    DrafterWeights::walk(cfg, dcfg, 3, |s| -> Result<Tensor, ()> {
        let n: usize = s.shape.iter().product();
        let (rows, cols) = if s.shape.len() == 2 { (s.shape[0], s.shape[1]) } else { (1, s.shape[0]) };
        Ok(Tensor::new(rows, cols, (0..n).map(|_| s.mean + s.std * r.normal()).collect()))
    })
    .unwrap()
}

/// Fast mode's greedy drafts through the fused Markov slot (`markov_argmax`: a rank of 32, so the
/// fused kernel applies) give the tokens of the same drafts through the slot's separate ops
/// (`draft_batch` with the logits asked for takes them), for several sequences at once and one
/// alone.
#[test]
fn fused_markov_drafts_equal_the_ops() {
    let Some(b) = gpu(false) else { return };
    b.set_exact(false);
    b.set_markov_fused(true);
    let cfg = tiny_config(97);
    let dcfg = tiny_dspark(&cfg, Some(32));
    let gd = Drafter::upload(b, cfg.clone(), dcfg.clone(), random_weights(&cfg, &dcfg, 17)).unwrap();
    let hw = gd.hidden_width();
    let mut r = Lcg(5);
    let hidden: Vec<f32> = (0..40 * hw).map(|_| r.normal()).collect();
    let lens = [3usize, 8, 11, 25];
    let mut grs: Vec<_> = lens.iter().map(|_| gd.new_ring()).collect();
    let rows: Vec<Vec<(usize, &[f32])>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| (0..l).map(|p| (p, &hidden[(p + i) * hw..(p + i + 1) * hw])).collect())
        .collect();
    let mut items: Vec<_> = grs.iter_mut().zip(&rows).map(|(g, rs)| (g, rs.as_slice())).collect();
    gd.commit_batch(&mut items).unwrap();
    for take in [lens.len(), 1] {
        let reqs: Vec<DraftRequest<_>> = grs
            .iter()
            .zip(&lens)
            .take(take)
            .enumerate()
            .map(|(i, (ring, &l))| DraftRequest { ring, anchor: (i * 31 % 96) as u32, anchor_pos: l })
            .collect();
        let launches = gd.backend().markov_fused_launches();
        let fused = gd.draft_batch(&reqs, false).unwrap();
        assert!(gd.backend().markov_fused_launches() > launches, "{take} sequences: the fused Markov slots ran");
        let ops = gd.draft_batch(&reqs, true).unwrap();
        for (i, (f, o)) in fused.iter().zip(&ops).enumerate() {
            assert_eq!(f.tokens, o.tokens, "{take} sequences, sequence {i}: fused Markov slots against the ops");
            assert_eq!(f.conf_raw, o.conf_raw, "{take} sequences, sequence {i}: confidences");
        }
    }
    println!("fused Markov drafts (fast mode, rank 32) equal the ops' drafts");
}

/// A random tiny drafter (3 stages, window 8, vocab 97) with bf16 weights on the GPU against the
/// CPU drafter on the same bf16-rounded weights: single drafts across the ring's fill and wrap,
/// then one batched draft of several sequences with rings of different lengths, and batched
/// commits.
#[test]
fn random_drafter_gpu_equals_cpu_single_and_batched() {
    let Some(b) = gpu(false) else { return };
    let cfg = tiny_config(97);
    let dcfg = tiny_dspark(&cfg, None);
    let cpu = Drafter::from_weights(cfg.clone(), dcfg.clone(), random_weights(&cfg, &dcfg, 7).round_bf16(&cfg, &dcfg));
    let gd = Drafter::upload(b, cfg.clone(), dcfg.clone(), random_weights(&cfg, &dcfg, 7)).unwrap();
    let hw = cpu.hidden_width();
    let mut r = Lcg(99);
    let hidden: Vec<f32> = (0..40 * hw).map(|_| r.normal()).collect();
    let row = |p: usize| &hidden[p * hw..(p + 1) * hw];
    let mut w = Worst::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (mut cr, mut gr) = (cpu.new_ring(), gd.new_ring());
    for p in 0..30 {
        cpu.commit(&mut cr, &[(p, row(p))]).unwrap();
        gd.commit(&mut gr, &[(p, row(p))]).unwrap();
        w.ring = w.ring.max(ring_err(&gd, &gr, &cr));
        let a = (p * 13 % 96) as u32;
        let c = cpu.draft(&cr, a, p + 1, 0.0, &mut rng).unwrap();
        let g = gd.draft(&gr, a, p + 1, 0.0, &mut rng).unwrap();
        w.draft(&format!("random block P={p}"), &g, &c);
    }
    // Several sequences: rings filled to different lengths with one batched commit each step.
    let lens = [3usize, 8, 11, 25];
    let mut crs: Vec<_> = lens.iter().map(|_| cpu.new_ring()).collect();
    let mut grs: Vec<_> = lens.iter().map(|_| gd.new_ring()).collect();
    let rows: Vec<Vec<(usize, &[f32])>> =
        lens.iter().enumerate().map(|(i, &l)| (0..l).map(|p| (p, row(p + i))).collect()).collect();
    for (cr, rs) in crs.iter_mut().zip(&rows) {
        cpu.commit(cr, rs).unwrap();
    }
    let mut items: Vec<_> = grs.iter_mut().zip(&rows).map(|(g, rs)| (g, rs.as_slice())).collect();
    gd.commit_batch(&mut items).unwrap();
    for (g, c) in grs.iter().zip(&crs) {
        w.ring = w.ring.max(ring_err(&gd, g, c));
    }
    let reqs: Vec<DraftRequest<_>> = grs
        .iter()
        .zip(&lens)
        .enumerate()
        .map(|(i, (ring, &l))| DraftRequest { ring, anchor: (i * 29 % 96) as u32, anchor_pos: l })
        .collect();
    let batched = gd.draft_batch(&reqs, true).unwrap();
    for (i, (g, (c, &l))) in batched.iter().zip(crs.iter().zip(&lens)).enumerate() {
        let want = cpu.draft(c, (i * 29 % 96) as u32, l, 0.0, &mut rng).unwrap();
        w.draft(&format!("batched sequence {i} (P={})", l - 1), g, &want);
    }
    // Sampled drafting (the Markov loop samples on the host from the downloaded rows): same
    // seed, same tokens, distributions within the tolerance.
    let mut q_err = 0f64;
    for (i, (g, c)) in grs.iter().zip(&crs).enumerate() {
        let (a, pos) = ((i * 7 % 96) as u32, lens[i]);
        let mut r1 = rand::rngs::StdRng::seed_from_u64(40 + i as u64);
        let mut r2 = rand::rngs::StdRng::seed_from_u64(40 + i as u64);
        let dc = cpu.draft(c, a, pos, 0.8, &mut r1).unwrap();
        let dg = gd.draft(g, a, pos, 0.8, &mut r2).unwrap();
        w.draft(&format!("sampled sequence {i}"), &dg, &dc);
        q_err = q_err.max(rel(dg.q_probs.as_ref().unwrap(), dc.q_probs.as_ref().unwrap()));
    }
    assert!(q_err <= TOL, "sampled q rel err {q_err:.3e}");
    assert!(w.ring <= TOL, "ring rows rel err {:.3e}", w.ring);
    println!("random tiny drafter, GPU (bf16, exact) vs CPU (bf16-rounded): {w:?}, sampled q {q_err:.2e}");
}

/// A tiny target with a 3-stage random drafter, written to a temporary checkpoint.
fn tiny_dir() -> tempfile::TempDir {
    let mut cfg = tiny_config(97);
    cfg.max_position = 4096;
    let ds = SynthDspark::for_config(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let mut json = cfg.to_hf_json();
    for (k, v) in ds.json_keys() {
        json[k] = v;
    }
    std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
    let mut t = random_checkpoint(&cfg, 5, SynthDType::F32);
    t.extend(random_dspark(&cfg, &ds, 5, SynthDType::F32));
    write_safetensors(&dir.path().join("model.safetensors"), &t).unwrap();
    dir
}

/// GPU target + GPU drafter: DSpark greedy output equals plain greedy output.
#[test]
fn dspark_greedy_on_gpu_equals_plain_greedy() {
    let Some(b) = gpu(false) else { return };
    let dir = tiny_dir();
    let mut m = Model::load(b, dir.path(), 1, false).unwrap();
    let gb = gpu(false).unwrap();
    let drafter: Arc<dyn Proposer> = Arc::new(DeviceProposer(Drafter::load_dir_on(gb, dir.path()).unwrap()));
    let (mut rounds, mut accepted) = (0, 0);
    for i in 0..12usize {
        let len = 1 + 3 * i;
        let p: Vec<u32> = (0..len).map(|k| ((k * 31 + i * 17 + k * k * 7) % 96) as u32).collect();
        let opts = GenerateOptions { max_new_tokens: 24, stop_ids: &[], prefill_chunk: [512, 3, 8][i % 3] };
        let want = generate(&mut m, &p, &mut Sampler::greedy(), &opts).unwrap().tokens;
        let mut sc = SpecConfig::new(drafter.clone());
        sc.max_draft = 1 + i % 5;
        let (g, st) = generate_speculative(&mut m, &p, &mut Sampler::greedy(), &opts, &sc).unwrap();
        assert_eq!(g.tokens, want, "prompt {i} (len {len}, max draft {})", sc.max_draft);
        assert!(st.rounds > 0, "prompt {i}: no draft was verified");
        rounds += st.rounds;
        accepted += st.accepted;
    }
    println!("GPU DSpark greedy = plain greedy on 12 prompts: {rounds} rounds, {accepted} accepted drafts");
    // Sampled speculation (rejection sampling with GPU drafts) is reproducible from the seed.
    let p: Vec<u32> = (0..9).map(|k| (k * 11 % 96) as u32).collect();
    let opts = GenerateOptions { max_new_tokens: 16, stop_ids: &[], prefill_chunk: 512 };
    let mut sc = SpecConfig::new(drafter.clone());
    sc.sampled = true;
    let params = SamplingParams { temperature: 0.8, top_k: 40, seed: 5, ..Default::default() };
    let run = |m: &mut Model<CudaBackend>| {
        generate_speculative(m, &p, &mut Sampler::new(params.clone()).unwrap(), &opts, &sc).unwrap()
    };
    let ((a, sa), (b, _)) = (run(&mut m), run(&mut m));
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.tokens.len(), 16);
    assert!(sa.rounds > 0);
}

fn collect(mut sub: dsv4_engine::Submission) -> Vec<u32> {
    let mut toks = Vec::new();
    loop {
        match sub.events.blocking_recv().expect("engine dropped the stream") {
            Event::Token(t) => toks.push(t.id),
            Event::Done { .. } => return toks,
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

/// The continuous-batching engine on the GPU with the GPU drafter (greedy sequences of a step
/// drafted in one batched forward): every request gets the tokens of a plain single-sequence
/// run (greedy and sampled requests; sampled ones speculate target-only, the server's setting).
#[test]
fn engine_with_gpu_drafter_gives_the_plain_tokens() {
    let Some(b) = gpu(false) else { return };
    let dir = tiny_dir();
    let (n, max_tokens) = (10, 20);
    let params = |i: usize| {
        if i % 4 == 3 {
            SamplingParams { temperature: 0.8, top_p: 0.95, seed: i as u64, ..Default::default() }
        } else {
            SamplingParams::default()
        }
    };
    let prompt =
        |i: usize| -> Vec<u32> { (0..2 + i * 5 % 23).map(|k| ((k * 31 + i * 17 + k * k * 7) % 96) as u32).collect() };
    let mut m = Model::load(b, dir.path(), 1, false).unwrap();
    let alone: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let mut s = Sampler::new(params(i)).unwrap();
            let opts = GenerateOptions { max_new_tokens: max_tokens, stop_ids: &[], prefill_chunk: 512 };
            generate(&mut m, &prompt(i), &mut s, &opts).unwrap().tokens
        })
        .collect();
    drop(m);
    let proposer: Arc<dyn Proposer> =
        Arc::new(DeviceProposer(Drafter::load_dir_on(gpu(false).unwrap(), dir.path()).unwrap()));
    let mut sc = SpecConfig::new(proposer);
    sc.sampled = true;
    let cfg = EngineConfig { token_budget: 48, prefill_chunk: 8, dspark: Some(sc), ..Default::default() };
    let h = spawn(Model::load(gpu(false).unwrap(), dir.path(), n, false).unwrap(), cfg, n);
    let subs: Vec<_> = (0..n).map(|i| h.submit(Request::new(prompt(i), params(i), max_tokens)).unwrap()).collect();
    for (i, s) in subs.into_iter().enumerate() {
        assert_eq!(collect(s), alone[i], "request {i}");
    }
    let g = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let sm = &h.metrics.spec;
    assert!(g(&sm.rounds) > 0, "no draft was verified");
    println!(
        "GPU engine with the GPU drafter = plain runs on {n} requests: {} rounds, {} drafted, {} accepted",
        g(&sm.rounds),
        g(&sm.drafted),
        g(&sm.accepted)
    );
}
