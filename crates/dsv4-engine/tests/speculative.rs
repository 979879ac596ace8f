//! DSpark speculative decoding on the CPU tiny model (random target + random DSpark drafter, as
//! `dsv4 init-tiny` writes them): lossless greedy output, the target's full state after every
//! round equal to a plain run's (forced drafts: all correct, all wrong, first j correct, at every
//! alignment against the CSA and HCA ratios), and speculation inside continuous batching.

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Batch, Capture, Model};
use dsv4_dspark::{ContextRing, Draft, Drafter, DsparkError, HiddenCapture};
use dsv4_engine::speculative::{self, Planned, Proposer, SpecConfig, SpecSeq};
use dsv4_engine::{
    generate, generate_speculative, spawn, DeviceProposer, EngineConfig, Event, GenerateOptions, Request, Sampler,
    SamplingParams,
};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, random_dspark, tiny_config, SynthDType, SynthDspark};
use dsv4_model::Config;
use rand::RngCore;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

const V: usize = 97;

fn test_config() -> Config {
    let mut cfg = tiny_config(V);
    cfg.max_position = 4096;
    cfg
}

/// CSA ratio 4, HCA ratio 8, window 8 (the tiny model of spec §12.1) with a 3-stage drafter.
fn tiny_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let cfg = test_config();
    let ds = SynthDspark::for_config(&cfg);
    let mut json = cfg.to_hf_json();
    for (k, v) in ds.json_keys() {
        json[k] = v;
    }
    std::fs::write(d.path().join("config.json"), json.to_string()).unwrap();
    let mut t = random_checkpoint(&cfg, 5, SynthDType::F32);
    t.extend(random_dspark(&cfg, &ds, 5, SynthDType::F32));
    write_safetensors(&d.path().join("model.safetensors"), &t).unwrap();
    d
}

fn load(dir: &Path, n: usize) -> Model<CpuBackend> {
    Model::load(CpuBackend, dir, n, false).unwrap()
}

fn hca_ratio(cfg: &Config) -> usize {
    cfg.layers.iter().filter(|l| l.attn == dsv4_model::AttnKind::Hca).map(|l| l.ratio).max().unwrap()
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len).map(|k| ((k * 31 + i * 17 + k * k * 7) % (V - 1)) as u32).collect()
}

fn greedy_plain(m: &mut Model<CpuBackend>, p: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_new_tokens: n, stop_ids: &[], prefill_chunk: chunk };
    generate(m, p, &mut Sampler::greedy(), &opts).unwrap().tokens
}

#[test]
fn init_tiny_style_drafter_loads() {
    let dir = tiny_dir();
    let d = Drafter::load_dir(dir.path()).unwrap();
    assert_eq!((d.n_stages(), d.block_size()), (3, 5));
    assert_eq!(d.config().target_layer_ids, vec![3, 4, 5]);
}

/// The real (random) drafter: DSpark greedy = plain greedy, bitwise, for prompts of every
/// residue mod 4 (CSA) and mod 8 (HCA), every draft length and several prefill chunkings.
#[test]
fn dspark_greedy_equals_plain_greedy() {
    let dir = tiny_dir();
    let cfg = test_config();
    let hca = hca_ratio(&cfg);
    assert_eq!(hca, 8);
    let drafter: Arc<dyn Proposer> = Arc::new(Drafter::load_dir(dir.path()).unwrap());
    let mut m = load(dir.path(), 1);
    let mut residues = BTreeSet::new();
    let (mut rounds, mut accepted, mut n_prompts) = (0, 0, 0);
    for i in 0..56 {
        let len = 1 + i; // 1..=56: every residue mod 8 seven times
        residues.insert((len % 4, len % hca));
        let p = prompt(i, len);
        let chunk = [512, 3, 8, 5][i % 4];
        let want = greedy_plain(&mut m, &p, 20, 512);
        let mut sc = SpecConfig::new(drafter.clone());
        sc.max_draft = 1 + i % 5;
        let opts = GenerateOptions { max_new_tokens: 20, stop_ids: &[], prefill_chunk: chunk };
        let (g, st) = generate_speculative(&mut m, &p, &mut Sampler::greedy(), &opts, &sc).unwrap();
        assert_eq!(g.tokens, want, "prompt {i} (len {len}, max draft {})", sc.max_draft);
        assert!(st.rounds > 0);
        rounds += st.rounds;
        accepted += st.accepted;
        n_prompts += 1;
    }
    assert_eq!(residues.len(), 8);
    assert!(n_prompts >= 50);
    eprintln!(
        "{n_prompts} prompts, {rounds} rounds, {accepted} accepted drafts, acceptance length {:.3}",
        1.0 + accepted as f64 / rounds as f64
    );
}

/// A test double that proposes chosen tokens: per round `(l, j)` from a schedule, the first `j`
/// of `l` drafts are the plain greedy continuation, the rest wrong. Its "ring" keeps the
/// captured rows themselves (one stage, `hidden_width` wide), so the test can check that exactly
/// the committed rows arrived.
struct Forced {
    layers: Vec<usize>,
    width: usize,
    /// The plain greedy stream (prompt + continuation) of the current prompt.
    stream: Mutex<Vec<u32>>,
    schedule: Mutex<Vec<(usize, usize)>>,
    round: Mutex<usize>,
    /// Every committed position, in order.
    commits: Mutex<Vec<usize>>,
}

impl Forced {
    fn current(&self) -> (usize, usize) {
        let s = self.schedule.lock().unwrap();
        s[*self.round.lock().unwrap() % s.len()]
    }
}

impl Proposer for Forced {
    fn layers(&self) -> &[usize] {
        &self.layers
    }
    fn block_size(&self) -> usize {
        5
    }
    fn new_ring(&self) -> ContextRing {
        ContextRing::new(1, 4096, self.width)
    }
    fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        for (p, h) in rows {
            ring.write(*p, &[h]);
            self.commits.lock().unwrap().push(*p);
        }
        Ok(())
    }
    fn draft(
        &self,
        _ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        _t: f32,
        _rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        let stream = self.stream.lock().unwrap();
        assert_eq!(stream[anchor_pos], anchor, "the anchor is the plain stream's token");
        let (l, j) = self.current();
        let tokens: Vec<u32> = (0..l)
            .map(|k| {
                let t = stream[anchor_pos + 1 + k];
                if k < j {
                    t
                } else {
                    (t + 1 + k as u32) % V as u32
                }
            })
            .collect();
        Ok(Draft { tokens, logits: Vec::new(), q_probs: None, conf_raw: Vec::new(), vocab: V })
    }
}

/// One plain forward with a capture: `main_hidden` of every row.
fn capture_all(m: &mut Model<CpuBackend>, toks: &[u32], layers: &[usize]) -> Vec<f32> {
    let s = m.alloc_seq().unwrap();
    let mut cap = HiddenCapture::new(layers, m.cfg.hc_mult, m.cfg.hidden);
    m.forward_with(&Batch::chunk(s, 0, toks).unwrap(), &[0], Some(&mut cap as &mut dyn Capture<CpuBackend>)).unwrap();
    m.free_seq(s);
    cap.finish().unwrap()
}

#[test]
fn forced_drafts_leave_the_target_state_of_a_plain_run_at_every_alignment() {
    let dir = tiny_dir();
    let cfg = test_config();
    let (window, hca) = (cfg.window, hca_ratio(&cfg));
    let layers = vec![3, 4, 5];
    let width = layers.len() * cfg.hidden;
    let mut schedule = Vec::new();
    for l in 1..=5 {
        for j in 0..=l {
            schedule.push((l, j));
        }
    }
    let n_sched = schedule.len(); // 20
    let forced = Arc::new(Forced {
        layers: layers.clone(),
        width,
        stream: Mutex::new(Vec::new()),
        schedule: Mutex::new(schedule),
        round: Mutex::new(0),
        commits: Mutex::new(Vec::new()),
    });
    let sc = SpecConfig::new(forced.clone());
    let mut m = load(dir.path(), 3);
    let mut seen = BTreeSet::new();
    let mut checked = 0;
    for i in 0..24 {
        let len = 9 + i; // every residue mod 8 three times
        let p = prompt(100 + i, len);
        let gen_n = 60;
        let plain = greedy_plain(&mut m, &p, gen_n + 8, 512);
        let mut stream = p.clone();
        stream.extend(&plain);
        *forced.stream.lock().unwrap() = stream.clone();
        forced.commits.lock().unwrap().clear();
        // Offset the schedule per prompt so every (l, j) meets every alignment.
        *forced.round.lock().unwrap() = i * 7;
        let slot = m.alloc_seq().unwrap();
        let mut st = SpecSeq::new(&sc, 0);
        let logits = speculative::prefill(&sc, &mut st, &mut m, slot, 0, &p, 4).unwrap();
        let mut sampler = Sampler::greedy();
        let mut out = vec![sampler.sample(&logits).unwrap()];
        // The plain reference advances token by token to the same length.
        let ref_slot = m.alloc_seq().unwrap();
        m.forward(&Batch::chunk(ref_slot, 0, &p).unwrap(), &[0]).unwrap();
        while out.len() < gen_n {
            let anchor_pos = m.seq_len(slot).unwrap();
            let (l, j) = forced.current();
            let r =
                speculative::round(&sc, &mut st, &mut m, slot, *out.last().unwrap(), 16, &mut sampler, &[]).unwrap();
            assert_eq!(r.accepted, j, "prompt {i}: round ({l}, {j}) at {anchor_pos}");
            *forced.round.lock().unwrap() += 1;
            seen.insert((anchor_pos % hca, l, j));
            out.extend(&r.tokens);
            let len_now = m.seq_len(slot).unwrap();
            assert_eq!(len_now, p.len() + out.len() - 1);
            while m.seq_len(ref_slot).unwrap() < len_now {
                let q = m.seq_len(ref_slot).unwrap();
                m.forward(&Batch::chunk(ref_slot, q, &stream[q..q + 1]).unwrap(), &[0]).unwrap();
            }
            let a = m.snapshot(slot).unwrap();
            let b = m.snapshot(ref_slot).unwrap();
            assert_eq!(a.len, b.len);
            assert!(
                a.state.canonical(a.len, window) == b.state.canonical(b.len, window),
                "prompt {i}: state differs after round ({l}, {j}) at anchor position {anchor_pos}"
            );
            checked += 1;
        }
        assert_eq!(out[..gen_n], plain[..gen_n], "prompt {i}: output = plain greedy");
        // Exactly the committed rows reached the drafter, once each, in order, and they are the
        // plain run's captured rows.
        let final_len = m.seq_len(slot).unwrap();
        let commits = forced.commits.lock().unwrap().clone();
        assert_eq!(commits, (0..final_len).collect::<Vec<_>>(), "prompt {i}: committed positions");
        let want = capture_all(&mut m, &stream[..final_len], &layers);
        for pos in final_len.saturating_sub(4096)..final_len {
            assert!(st.ring.holds(pos));
            let slot_row = st.ring.row(0, pos % 4096);
            assert_eq!(slot_row, &want[pos * width..(pos + 1) * width], "prompt {i}: ring row {pos}");
        }
        m.free_seq(slot);
        m.free_seq(ref_slot);
    }
    // Every (l, j) at every alignment against the HCA ratio (hence the CSA ratio 4).
    for a in 0..hca {
        for l in 1..=5 {
            for j in 0..=l {
                assert!(seen.contains(&(a, l, j)), "not covered: position {a} mod {hca}, l {l}, j {j}");
            }
        }
    }
    eprintln!("{checked} rounds checked against plain-run states, {} combinations (schedule {n_sched})", seen.len());
}

/// An oracle for the engine test: proposes the plain continuation of whichever prompt has this
/// `(anchor position, anchor, previous committed tokens)` key, correct for a varying prefix.
struct Oracle {
    layers: Vec<usize>,
    inner: Drafter,
    /// `(anchor_pos, anchor)` → the plain continuation after it.
    next: HashMap<(usize, u32), Vec<u32>>,
}

impl Proposer for Oracle {
    fn layers(&self) -> &[usize] {
        &self.layers
    }
    fn block_size(&self) -> usize {
        5
    }
    fn new_ring(&self) -> ContextRing {
        self.inner.new_ring()
    }
    fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        self.inner.commit(ring, rows)
    }
    fn draft(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        t: f32,
        rng: &mut dyn RngCore,
    ) -> Result<Draft, DsparkError> {
        // The real drafter runs (rings must hold context) and its tokens are then overridden.
        let mut d = self.inner.draft(ring, anchor, anchor_pos, t, rng)?;
        if let Some(next) = self.next.get(&(anchor_pos, anchor)) {
            let j = (anchor_pos * 7 + anchor as usize) % 6;
            for (k, tok) in d.tokens.iter_mut().enumerate() {
                if k < j && k < next.len() {
                    *tok = next[k];
                }
            }
        }
        Ok(d)
    }
}

fn engine_params(i: usize) -> SamplingParams {
    if i % 3 == 2 {
        SamplingParams { temperature: 0.8, top_p: 0.95, seed: i as u64, ..Default::default() }
    } else {
        SamplingParams::default()
    }
}

/// The oracle drafter's table: after each position `a` of request `i`'s prompt and output (the
/// token there), the rest of that request's stream.
fn continuations(outs: &[Vec<u32>]) -> HashMap<(usize, u32), Vec<u32>> {
    let mut next = HashMap::new();
    for (i, out) in outs.iter().enumerate() {
        let p = engine_prompt(i);
        let mut stream = p.clone();
        stream.extend(out);
        for a in p.len() - 1..stream.len() - 1 {
            next.insert((a, stream[a]), stream[a + 1..].to_vec());
        }
    }
    next
}

fn engine_prompt(i: usize) -> Vec<u32> {
    prompt(200 + i, 2 + i * 5 % 37)
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

#[test]
fn engine_with_dspark_gives_the_plain_tokens() {
    let dir = tiny_dir();
    let n = 18;
    let max_tokens = 24;
    let mut m = load(dir.path(), 1);
    let alone: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let mut s = Sampler::new(engine_params(i)).unwrap();
            let opts = GenerateOptions { max_new_tokens: max_tokens, stop_ids: &[], prefill_chunk: 512 };
            generate(&mut m, &engine_prompt(i), &mut s, &opts).unwrap().tokens
        })
        .collect();
    let next = continuations(&alone);
    let oracle = Oracle { layers: vec![3, 4, 5], inner: Drafter::load_dir(dir.path()).unwrap(), next };
    for (budget, chunk, real) in [(24, 9, false), (64, 16, false), (40, 7, true)] {
        let proposer: Arc<dyn Proposer> = if real {
            Arc::new(Drafter::load_dir(dir.path()).unwrap())
        } else {
            Arc::new(clone_oracle(&oracle, dir.path()))
        };
        let sc = SpecConfig::new(proposer);
        let cfg = EngineConfig { token_budget: budget, prefill_chunk: chunk, dspark: Some(sc), ..Default::default() };
        let h = spawn(load(dir.path(), 6), cfg, 6);
        let subs: Vec<_> =
            (0..n).map(|i| h.submit(Request::new(engine_prompt(i), engine_params(i), max_tokens)).unwrap()).collect();
        for (i, s) in subs.into_iter().enumerate() {
            assert_eq!(collect(s), alone[i], "request {i} (budget {budget}, chunk {chunk}, real drafter {real})");
        }
        let sm = &h.metrics.spec;
        let g = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let (r, d, a) = (g(&sm.rounds), g(&sm.drafted), g(&sm.accepted));
        eprintln!(
            "budget {budget} chunk {chunk} real {real}: {r} rounds, {d} drafted, {a} accepted, {} skipped, \
             acceptance length {:.3}",
            g(&sm.skipped),
            1.0 + a as f64 / r.max(1) as f64
        );
        assert!(r > 0);
        if !real {
            assert!(a > 0, "the oracle's drafts are accepted");
        }
        let text = h.metrics.render();
        assert!(text.contains("dsv4_dspark_acceptance_length_bucket"));
        assert!(text.contains("dsv4_dspark_position_accepted_total{position=\"0\"}"));
    }
}

/// The device-ring proposer (rings on the drafter's own backend, here the CPU's) drafts every
/// greedy job in the batched forward, a lone one included (no `Z` rows come back), and its
/// Markov loop keeps each slot's ids on the backend: the engine's tokens stay the plain greedy
/// ones, for one request alone and for several together.
#[test]
fn device_proposer_gives_the_plain_tokens_alone_and_batched() {
    let dir = tiny_dir();
    let max_tokens = 20;
    let mut m = load(dir.path(), 1);
    for n in [1, 3] {
        let alone: Vec<Vec<u32>> = (0..n).map(|i| greedy_plain(&mut m, &engine_prompt(i), max_tokens, 512)).collect();
        let drafter = Drafter::load_dir_on(CpuBackend, dir.path()).unwrap();
        let proposer: Arc<dyn Proposer> = Arc::new(DeviceProposer(drafter));
        let cfg = EngineConfig { dspark: Some(SpecConfig::new(proposer)), ..Default::default() };
        let h = spawn(load(dir.path(), 4), cfg, 4);
        let subs: Vec<_> = (0..n)
            .map(|i| h.submit(Request::new(engine_prompt(i), SamplingParams::default(), max_tokens)).unwrap())
            .collect();
        for (i, s) in subs.into_iter().enumerate() {
            assert_eq!(collect(s), alone[i], "request {i} of {n}");
        }
        let rounds = h.metrics.spec.rounds.load(std::sync::atomic::Ordering::Relaxed);
        assert!(rounds > 0, "{n} requests: no DSpark round ran");
    }
}

fn clone_oracle(o: &Oracle, dir: &Path) -> Oracle {
    Oracle { layers: o.layers.clone(), inner: Drafter::load_dir(dir).unwrap(), next: o.next.clone() }
}

/// A stop token inside an accepted block ends the output there and leaves the state one token
/// short of the output, as plain decoding does.
#[test]
fn stop_inside_an_accepted_block_cuts_there() {
    let dir = tiny_dir();
    let mut m = load(dir.path(), 2);
    let p = prompt(7, 13);
    let plain = greedy_plain(&mut m, &p, 20, 512);
    let stop = plain[5];
    let cut = plain.iter().position(|&t| t == stop).unwrap();
    let mut stream = p.clone();
    stream.extend(&plain);
    let forced = Arc::new(Forced {
        layers: vec![3, 4, 5],
        width: 3 * 64,
        stream: Mutex::new(stream),
        schedule: Mutex::new(vec![(5, 5)]),
        round: Mutex::new(0),
        commits: Mutex::new(Vec::new()),
    });
    let sc = SpecConfig::new(forced);
    let opts = GenerateOptions { max_new_tokens: 20, stop_ids: &[stop], prefill_chunk: 512 };
    let (g, _) = generate_speculative(&mut m, &p, &mut Sampler::greedy(), &opts, &sc).unwrap();
    assert_eq!(g.tokens, plain[..=cut].to_vec());
    // The engine path: the state length matches the output (prefix-cache save asserts it).
    let slot = m.alloc_seq().unwrap();
    let mut st = SpecSeq::new(&sc, 0);
    let logits = speculative::prefill(&sc, &mut st, &mut m, slot, 0, &p, 512).unwrap();
    let first = Sampler::greedy().sample(&logits).unwrap();
    let plan = Planned::forced(first, p.len(), plain[1..6].to_vec());
    let r = speculative::round_with(&sc, &mut st, &mut m, slot, &plan, &mut Sampler::greedy(), &[stop]).unwrap();
    assert_eq!(*r.tokens.last().unwrap(), stop);
    assert_eq!(m.seq_len(slot).unwrap(), p.len() + r.tokens.len());
}

fn sampled_params(i: usize) -> SamplingParams {
    let seed = 1000 + i as u64 * 7919;
    match i % 3 {
        0 => SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..Default::default() },
        1 => SamplingParams { temperature: 1.0, top_k: 20, seed, ..Default::default() },
        _ => SamplingParams { temperature: 0.6, min_p: 0.05, seed, ..Default::default() },
    }
}

/// Runs `n` sampled requests (every third with logprobs, so their verify rows bring logits and
/// ids; request `i` stopping at `stops[i]`) through `cfg`'s engine at once; returns each one's
/// tokens and the engine's DSpark (rounds, drafted, accepted).
fn run_sampled(
    dir: &Path,
    cfg: EngineConfig,
    n: usize,
    max_tokens: usize,
    stops: &[Vec<u32>],
) -> (Vec<Vec<u32>>, (u64, u64, u64)) {
    let h = spawn(load(dir, 6), cfg, 6);
    let subs: Vec<_> = (0..n)
        .map(|i| {
            h.submit(Request {
                prompt: engine_prompt(i),
                sampling: sampled_params(i),
                max_tokens,
                stop_ids: stops[i].clone(),
                top_logprobs: (i % 3 == 1).then_some(2),
                snapshot_at: vec![],
                logits: Default::default(),
            })
            .unwrap()
        })
        .collect();
    let out = subs.into_iter().map(collect).collect();
    let sm = &h.metrics.spec;
    let g = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    (out, (g(&sm.rounds), g(&sm.drafted), g(&sm.accepted)))
}

/// Sampled requests speculate target-only in the engine (greedy drafts, each verify row drawn
/// with the uniform of its token's position): their tokens are exactly those of the same seeded
/// requests in an engine without DSpark, and of `generate`, whatever the batching, the drafts
/// (an oracle whose drafts are partly right, so rounds accept and reject; the real random
/// drafter) and where the draws are made (device twin or host).
#[test]
fn engine_with_sampled_dspark_gives_the_plain_seeded_tokens() {
    let dir = tiny_dir();
    let (n, max_tokens) = (15, 24);
    let plain_cfg = EngineConfig { token_budget: 48, prefill_chunk: 16, ..Default::default() };
    let (plain, none) = run_sampled(dir.path(), plain_cfg, n, max_tokens, &vec![vec![]; n]);
    assert_eq!(none, (0, 0, 0));
    // Every fourth request stops at its plain run's 12th token (inside a verify block when
    // speculating): its output is the plain one cut there.
    let stops: Vec<Vec<u32>> = (0..n).map(|i| if i % 4 == 3 { vec![plain[i][11]] } else { vec![] }).collect();
    let want: Vec<Vec<u32>> = plain
        .iter()
        .zip(&stops)
        .map(|(p, s)| match p.iter().position(|t| s.contains(t)) {
            Some(c) => p[..=c].to_vec(),
            None => p.clone(),
        })
        .collect();
    // `generate` draws the same tokens one at a time.
    let mut m = load(dir.path(), 1);
    for (i, want) in plain.iter().enumerate() {
        let mut s = Sampler::new(sampled_params(i)).unwrap();
        let opts = GenerateOptions { max_new_tokens: max_tokens, stop_ids: &[], prefill_chunk: 512 };
        assert_eq!(&generate(&mut m, &engine_prompt(i), &mut s, &opts).unwrap().tokens, want, "request {i}");
    }
    // The runs differ by seed: the test is not one of a constant stream.
    assert!(plain.iter().collect::<BTreeSet<_>>().len() == n);
    let next = continuations(&plain);
    let oracle = Oracle { layers: vec![3, 4, 5], inner: Drafter::load_dir(dir.path()).unwrap(), next };
    let mut oracle_accepted = 0;
    for (budget, chunk, real, host) in [(24, 9, false, false), (64, 16, false, true), (40, 7, true, false)] {
        let proposer: Arc<dyn Proposer> = if real {
            Arc::new(Drafter::load_dir(dir.path()).unwrap())
        } else {
            Arc::new(clone_oracle(&oracle, dir.path()))
        };
        let mut sc = SpecConfig::new(proposer);
        sc.sampled = true;
        let cfg = EngineConfig {
            token_budget: budget,
            prefill_chunk: chunk,
            dspark: Some(sc),
            host_sampling: host,
            ..Default::default()
        };
        let (got, (r, d, a)) = run_sampled(dir.path(), cfg, n, max_tokens, &stops);
        eprintln!("budget {budget} chunk {chunk} real {real} host {host}: {r} rounds, {d} drafted, {a} accepted");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "request {i} (budget {budget}, chunk {chunk}, real drafter {real}, host {host})");
        }
        assert!(r > 0 && d > 0, "sampled requests speculate");
        if !real {
            assert!(a > 0, "the oracle's drafts are accepted");
            assert!(a < d, "and some are rejected");
            oracle_accepted += a;
        }
    }
    assert!(oracle_accepted >= 20, "{oracle_accepted} drafts accepted");
}
