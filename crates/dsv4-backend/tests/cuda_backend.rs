//! The CUDA backend against the CPU oracle (built only with `--features cuda`; each test prints
//! "skipping: no CUDA device" and passes where no driver or device is present).
//!
//! Tolerance: max |cuda − cpu| / max |cpu| over the logits ≤ 1e-4. Both sides are f32; the GPU
//! sums in other orders (cuBLAS tiles, tree reductions, online softmax), so each op differs from
//! the CPU by a few ulp (~1e-7 relative) and a forward of a few layers compounds that to ~1e-6;
//! 1e-4 leaves two orders of margin while any indexing or state bug shows as O(1).
#![cfg(feature = "cuda")]

mod common;
use common::{rel_err, tokens, write_random};
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::cuda::{CudaBackend, CudaInitError};
use dsv4_backend::forward::{forward, RopeTables};
use dsv4_backend::{Backend, Batch, Capture, Model, Row, Stage};
use dsv4_model::synth::tiny_config;
use dsv4_model::{AttnKind, Config, LayerSpec, TensorStore};
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;

/// The kernels compile with NVRTC wherever NVRTC is found (no device needed).
#[test]
fn cuda_kernels_compile() {
    match dsv4_backend::cuda::compile_kernels() {
        Err(CudaInitError::NoLibrary(l)) => println!("skipping: no {l} library"),
        r => r.unwrap(),
    }
}

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ (CudaInitError::NoDriver | CudaInitError::NoDevice | CudaInitError::NoLibrary(_))) => {
            println!("skipping: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("CUDA backend failed to start: {e}"),
    }
}

/// The fixtures: `DSV4_FIXTURES`, else next to the run-time manifest dir (nextest's
/// `--workspace-remap` sets it), else where this test was built.
fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("DSV4_FIXTURES") {
        return d.into();
    }
    if let Ok(d) = std::env::var("CARGO_MANIFEST_DIR") {
        let p = Path::new(&d).join("../../tests/fixtures/hf");
        if p.exists() {
            return p;
        }
    }
    common::fixtures_dir()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}

fn random_chunks(t: usize, seed: u64, max: usize) -> Vec<usize> {
    let mut s = seed;
    let mut left = t;
    let mut v = Vec::new();
    while left > 0 {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let n = 1 + (s >> 33) as usize % left.min(max);
        v.push(n);
        left -= n;
    }
    v
}

/// Prefills `toks` in `chunks` on both models, then `steps` greedy decode steps (the CPU's
/// choice fed to both); returns the worst relative error of any forward's logits.
fn compare_run<B: Backend>(
    cpu: &mut Model<CpuBackend>,
    gpu: &mut Model<B>,
    toks: &[u32],
    chunks: &[usize],
    steps: usize,
) -> f64 {
    let (sc, sg) = (cpu.alloc_seq().unwrap(), gpu.alloc_seq().unwrap());
    let mut worst = 0f64;
    let mut off = 0;
    let mut last = Vec::new();
    for &n in chunks {
        let all: Vec<usize> = (0..n).collect();
        let a = cpu.forward(&Batch::chunk(sc, off, &toks[off..off + n]).unwrap(), &all).unwrap();
        let b = gpu.forward(&Batch::chunk(sg, off, &toks[off..off + n]).unwrap(), &all).unwrap();
        worst = worst.max(rel_err(&b, &a));
        off += n;
        let v = cpu.cfg.vocab_size;
        last = a[(n - 1) * v..].to_vec();
    }
    for i in 0..steps {
        let t = argmax(&last);
        let a = cpu.forward(&Batch::chunk(sc, toks.len() + i, &[t]).unwrap(), &[0]).unwrap();
        let b = gpu.forward(&Batch::chunk(sg, toks.len() + i, &[t]).unwrap(), &[0]).unwrap();
        worst = worst.max(rel_err(&b, &a));
        last = a;
    }
    cpu.free_seq(sc);
    gpu.free_seq(sg);
    worst
}

const FIXTURES: [&str; 4] = ["tiny_mixed", "csa4_hca128_long", "pro_like", "official_fp8"];

#[test]
fn cuda_fixtures_match_cpu() {
    if gpu().is_none() {
        return;
    }
    let root = fixtures_dir();
    assert!(root.exists(), "fixtures not found at {}", root.display());
    for name in FIXTURES {
        let dir = root.join(name);
        let st = TensorStore::open(&dir.join("expected.safetensors")).unwrap();
        let ids: Vec<u32> = st.i64("input_ids").unwrap().into_iter().map(|x| x as u32).collect();
        let t = ids.len();
        let mut cpu = Model::load(CpuBackend, &dir, 1, false).unwrap();
        let mut gpu = Model::load(gpu().unwrap(), &dir, 1, false).unwrap();
        let splits = [
            vec![t],
            std::iter::once(13).chain(std::iter::repeat_n(1, t - 13)).collect::<Vec<_>>(),
            random_chunks(t, 11, 37),
        ];
        for (i, sp) in splits.iter().enumerate() {
            let err = compare_run(&mut cpu, &mut gpu, &ids, sp, 16);
            println!("{name}: T={t} split {i} (+16 greedy steps): rel err {err:.2e}");
            assert!(err <= TOL, "{name} chunks {sp:?}: rel err {err}");
        }
    }
}

/// Real head shapes (hidden 1024, head_dim 512, rope 64, window 128, CSA 4 / HCA 128), an active
/// indexer (top 8) and every layer type; small elsewhere so the CPU oracle stays quick.
fn real_shapes() -> Config {
    let mut c = tiny_config(512);
    c.hidden = 1024;
    c.n_heads = 4;
    c.head_dim = 512;
    c.rope_dim = 64;
    c.q_lora_rank = 256;
    c.o_groups = 2;
    c.o_lora_rank = 128;
    c.window = 128;
    c.index_n_heads = 4;
    c.index_head_dim = 128;
    c.index_topk = 8;
    c.n_routed_experts = 8;
    c.n_experts_per_tok = 2;
    c.moe_inter = 128;
    c.swiglu_limit = 10.0;
    c.yarn = Some(dsv4_model::config::Yarn {
        factor: 16.0,
        original_max_position: 65536.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    });
    c.layers = vec![
        LayerSpec { attn: AttnKind::Swa, ratio: 0, hash_moe: true },
        LayerSpec { attn: AttnKind::Csa, ratio: 4, hash_moe: true },
        LayerSpec { attn: AttnKind::Hca, ratio: 128, hash_moe: false },
        LayerSpec { attn: AttnKind::Csa, ratio: 4, hash_moe: false },
    ];
    c
}

fn real_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random(dir.path(), &real_shapes(), 42);
    dir
}

#[test]
fn cuda_real_shapes_match_cpu() {
    if gpu().is_none() {
        return;
    }
    let dir = real_model_dir();
    let mut cpu = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let mut gpu = Model::load(gpu().unwrap(), dir.path(), 1, false).unwrap();
    let vocab = cpu.cfg.vocab_size;
    let mut worst = 0f64;
    let lens: Vec<usize> = (1..=40).chain([64, 129, 255, 300, 513, 600]).collect();
    for (i, &len) in lens.iter().enumerate() {
        let toks = tokens(len, vocab, 1000 + i as u64);
        let chunks = random_chunks(len, 77 + i as u64, 200);
        let err = compare_run(&mut cpu, &mut gpu, &toks, &chunks, 16);
        if len > 40 || len % 10 == 0 {
            println!("len {len} chunks {chunks:?}: rel err {err:.2e}");
        }
        assert!(err <= TOL, "len {len} chunks {chunks:?}: rel err {err}");
        worst = worst.max(err);
    }
    println!("real shapes: worst rel err {worst:.2e} over {} lengths", lens.len());
}

/// Several sequences in batches of mixed prefill chunks and decode rows, queued back to back
/// without any synchronisation; all logits are read back at the end and compared.
#[test]
fn cuda_batches_back_to_back_match_cpu() {
    let Some(b) = gpu() else { return };
    let dir = real_model_dir();
    let cfg = Config::from_dir(dir.path()).unwrap();
    let store = TensorStore::open(dir.path()).unwrap();
    let w = dsv4_model::load_weights(&store, &cfg, false, |t| b.upload(t)).unwrap();
    let rope = RopeTables::new(&cfg);
    let nseq = 4;
    let mut cache = b.new_cache(&cfg, nseq);
    let mut cpu = Model::load(CpuBackend, dir.path(), nseq, false).unwrap();
    for s in 0..nseq {
        b.reset_seq(&mut cache, s);
        assert_eq!(cpu.alloc_seq().unwrap(), s);
    }
    let mut len = vec![0usize; nseq];
    let streams: Vec<Vec<u32>> = (0..nseq).map(|s| tokens(400, cfg.vocab_size, 500 + s as u64)).collect();
    let mut rng = 12345u64;
    let mut next = |m: usize| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) as usize % m
    };
    let mut pending = Vec::new();
    let mut want = Vec::new();
    for _ in 0..24 {
        let mut rows = Vec::new();
        for s in 0..nseq {
            let n = match next(4) {
                0 => 0,
                1 => 1,
                _ => 1 + next(60),
            };
            let n = n.min(400 - len[s]);
            rows.extend((0..n).map(|i| Row { seq: s, pos: len[s] + i, token: streams[s][len[s] + i] }));
            len[s] += n;
        }
        if rows.is_empty() {
            continue;
        }
        let batch = Batch::new(rows).unwrap();
        let all: Vec<usize> = (0..batch.len()).collect();
        pending.push(forward(&b, &cfg, &w, &rope, &mut cache, &batch, &all, None));
        want.push(cpu.forward(&batch, &all).unwrap());
    }
    let mut worst = 0f64;
    for (i, (t, a)) in pending.iter().zip(&want).enumerate() {
        let got = b.to_host(t);
        let err = rel_err(&got, a);
        assert!(err <= TOL, "batch {i}: rel err {err}");
        worst = worst.max(err);
    }
    println!("{} batches, sequence lengths {len:?}: worst rel err {worst:.2e}", pending.len());
}

struct CopyAll {
    n: usize,
    sum: f64,
}

impl<B: Backend> Capture<B> for CopyAll {
    fn capture(&mut self, backend: &B, _stage: Stage, t: &B::T) {
        let v = backend.to_host(t);
        self.n += 1;
        self.sum += v.iter().map(|x| *x as f64).sum::<f64>();
    }
}

/// Copying every stage to the host (a synchronisation after each) leaves the logits bitwise equal.
#[test]
fn cuda_capture_is_invariant() {
    if gpu().is_none() {
        return;
    }
    let dir = real_model_dir();
    let toks = tokens(300, 512, 9);
    let chunks = [100, 1, 57, 142];
    let run = |cap: bool| {
        let mut m = Model::load(gpu().unwrap(), dir.path(), 1, false).unwrap();
        let s = m.alloc_seq().unwrap();
        let mut c = CopyAll { n: 0, sum: 0.0 };
        let mut out = Vec::new();
        let mut off = 0;
        for &n in &chunks {
            let all: Vec<usize> = (0..n).collect();
            let batch = Batch::chunk(s, off, &toks[off..off + n]).unwrap();
            let cap: Option<&mut dyn Capture<CudaBackend>> = if cap { Some(&mut c) } else { None };
            out.extend(m.forward_with(&batch, &all, cap).unwrap());
            off += n;
        }
        (out, c.n)
    };
    let (plain, _) = run(false);
    let (captured, n) = run(true);
    assert!(n > 50, "only {n} stages captured");
    assert!(plain == captured, "capture changed the logits");
    println!("{n} stages captured; logits bitwise equal");
}

struct Record(Vec<(String, Vec<f32>)>);

impl<B: Backend> Capture<B> for Record {
    fn capture(&mut self, backend: &B, stage: Stage, t: &B::T) {
        self.0.push((stage.to_string(), backend.to_host(t)));
    }
}

/// Every captured stage of a chunked prefill, CUDA vs CPU (names the first stage that is off).
#[test]
fn cuda_stages_match_cpu() {
    if gpu().is_none() {
        return;
    }
    let dir = real_model_dir();
    let toks = tokens(300, 512, 9);
    let chunks = [100, 1, 57, 142];
    let mut cpu = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let mut gpu = Model::load(gpu().unwrap(), dir.path(), 1, false).unwrap();
    let (sc, sg) = (cpu.alloc_seq().unwrap(), gpu.alloc_seq().unwrap());
    let mut off = 0;
    let mut worst = 0f64;
    for &n in &chunks {
        let all: Vec<usize> = (0..n).collect();
        let (mut rc, mut rg) = (Record(Vec::new()), Record(Vec::new()));
        cpu.forward_with(&Batch::chunk(sc, off, &toks[off..off + n]).unwrap(), &all, Some(&mut rc)).unwrap();
        gpu.forward_with(&Batch::chunk(sg, off, &toks[off..off + n]).unwrap(), &all, Some(&mut rg)).unwrap();
        assert_eq!(rc.0.len(), rg.0.len());
        for ((name, a), (_, b)) in rc.0.iter().zip(&rg.0) {
            let err = rel_err(b, a);
            assert!(err <= TOL, "chunk at {off}: stage {name}: rel err {err}");
            worst = worst.max(err);
        }
        off += n;
    }
    println!("all stages of 4 chunks: worst rel err {worst:.2e}");
}
