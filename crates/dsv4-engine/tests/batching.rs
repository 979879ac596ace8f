//! Continuous batching: sequences interleaved in one engine produce exactly the tokens they
//! produce alone; cancelled sequences free their slots; bad requests are refused with a type.

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::Model;
use dsv4_engine::{
    generate, spawn, AdmitError, EngineConfig, Event, FinishReason, GenerateOptions, Metrics, Request, Sampler,
    SamplingParams,
};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, tiny_config, SynthDType};
use std::path::Path;

fn tiny_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.max_position = 4096;
    std::fs::write(d.path().join("config.json"), cfg.to_hf_json().to_string()).unwrap();
    write_safetensors(&d.path().join("model.safetensors"), &random_checkpoint(&cfg, 5, SynthDType::F32)).unwrap();
    d
}

fn load(dir: &Path, n: usize) -> Model<CpuBackend> {
    Model::load(CpuBackend, dir, n, false).unwrap()
}

fn prompt(i: usize) -> Vec<u32> {
    (0..(3 + i * 7 % 40)).map(|k| ((k * 31 + i * 17) % 97) as u32).collect()
}

fn params(i: usize) -> SamplingParams {
    if i.is_multiple_of(2) {
        SamplingParams::default()
    } else {
        SamplingParams { temperature: 0.8, top_p: 0.95, seed: i as u64, ..Default::default() }
    }
}

fn collect(mut sub: dsv4_engine::Submission) -> (Vec<u32>, FinishReason) {
    let mut toks = Vec::new();
    loop {
        match sub.events.blocking_recv().expect("engine dropped the stream") {
            Event::Token(t) => toks.push(t.id),
            Event::Done { reason, .. } => return (toks, reason),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

#[test]
fn parallel_requests_equal_their_sequential_runs() {
    let dir = tiny_dir();
    let n = 16;
    // Sequential reference: each request alone through `generate`.
    let mut m = load(dir.path(), 1);
    let alone: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let mut s = Sampler::new(params(i)).unwrap();
            let opts = GenerateOptions { max_new_tokens: 12, stop_ids: &[], prefill_chunk: 512 };
            generate(&mut m, &prompt(i), &mut s, &opts).unwrap().tokens
        })
        .collect();
    // All at once, with a small budget so prefill chunks interleave with other sequences' decode;
    // the rows drawn where the logits are (the CPU twin of the device draw), then on the host.
    for host_sampling in [false, true] {
        let cfg = EngineConfig { token_budget: 24, prefill_chunk: 9, host_sampling, ..Default::default() };
        let h = spawn(load(dir.path(), 6), cfg, 6);
        check_parallel(&h, &alone, n);
    }
}

fn check_parallel(h: &dsv4_engine::EngineHandle, alone: &[Vec<u32>], n: usize) {
    let subs: Vec<_> = (0..n).map(|i| h.submit(Request::new(prompt(i), params(i), 12)).unwrap()).collect();
    for (i, s) in subs.into_iter().enumerate() {
        let (toks, reason) = collect(s);
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(toks, alone[i], "request {i}");
    }
    assert_eq!(Metrics::get(&h.metrics.generated_tokens_total), 12 * n as u64);
    // The step timers: the forward runs inside the engine step, so it cannot take longer. The
    // last step adds its step time after it has sent the tokens read above: read the timers
    // once the idle engine has stopped moving them (at most 5 s).
    let step_ns = || Metrics::get(&h.metrics.step_ns);
    let t0 = std::time::Instant::now();
    loop {
        let before = step_ns();
        std::thread::sleep(std::time::Duration::from_millis(20));
        if step_ns() == before || t0.elapsed() > std::time::Duration::from_secs(5) {
            break;
        }
    }
    let (fwd, step) = (Metrics::get(&h.metrics.forward_ns), step_ns());
    assert!(Metrics::get(&h.metrics.steps_total) > 0 && fwd > 0 && fwd <= step, "forward {fwd} ns, step {step} ns");
    // Planning and snapshots are parts of the step outside the forward.
    let (plan, snap) = (Metrics::get(&h.metrics.plan_ns), Metrics::get(&h.metrics.snapshot_ns));
    assert!(fwd + plan + snap <= step, "forward {fwd} + plan {plan} + snapshots {snap} ns > step {step} ns");
    let text = h.metrics.render();
    for name in ["forward", "step", "plan", "snapshot", "restore"] {
        assert!(text.contains(&format!("dsv4_engine_{name}_seconds_total ")), "{name} timer not rendered");
    }
    assert!(text.contains("dsv4_engine_snapshots_total "));
}

#[test]
fn cancelled_and_dropped_requests_free_their_slots() {
    let dir = tiny_dir();
    let h = spawn(load(dir.path(), 2), EngineConfig::default(), 2);
    let req = |max| Request {
        prompt: prompt(1),
        sampling: SamplingParams::default(),
        max_tokens: max,
        stop_ids: vec![],
        top_logprobs: Some(3),
        snapshot_at: vec![],
        logits: Default::default(),
    };
    let a = h.submit(req(4000)).unwrap();
    let mut b = h.submit(req(4000)).unwrap();
    // Both hold the two slots; a third waits.
    let c = h.submit(req(5)).unwrap();
    match b.events.blocking_recv().unwrap() {
        Event::Token(t) => {
            assert!(t.logprob.unwrap() <= 0.0);
            assert_eq!(t.top.len(), 3);
            assert!(t.top[0].1 >= t.top[1].1);
        }
        other => panic!("{other:?}"),
    }
    drop(a); // client disconnect
    b.cancel.cancel(); // explicit cancel
    let (toks, reason) = collect(c);
    assert_eq!((toks.len(), reason), (5, FinishReason::Length));
    loop {
        if let Event::Done { reason, .. } = b.events.blocking_recv().unwrap() {
            assert_eq!(reason, FinishReason::Cancelled);
            break;
        }
    }
    // The engine publishes gauges after each step; give it a moment to go idle.
    for _ in 0..200 {
        if Metrics::get(&h.metrics.running) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(Metrics::get(&h.metrics.running), 0);
    assert_eq!(Metrics::get(&h.metrics.queue_depth), 0);
}

#[test]
fn bad_requests_get_typed_refusals() {
    let dir = tiny_dir();
    let cfg = EngineConfig { max_context: 64, max_waiting: 1, ..Default::default() };
    let h = spawn(load(dir.path(), 1), cfg, 1);
    let base = Request::new(vec![1, 2, 3], SamplingParams::default(), 4);
    let with = |f: &dyn Fn(&mut Request)| {
        let mut r = base.clone();
        f(&mut r);
        h.submit(r).err()
    };
    assert_eq!(with(&|r| r.prompt.clear()), Some(AdmitError::EmptyPrompt));
    assert_eq!(with(&|r| r.max_tokens = 0), Some(AdmitError::NoTokens));
    assert!(matches!(with(&|r| r.prompt = vec![5; 70]), Some(AdmitError::ContextTooLong { .. })));
    assert!(matches!(with(&|r| r.prompt = vec![1, 500]), Some(AdmitError::BadToken { token: 500, .. })));
    assert!(matches!(with(&|r| r.sampling.top_p = 2.0), Some(AdmitError::Sampling(_))));
    // Stop ids end the sequence with reason Stop, including the stop token.
    let first = collect(h.submit(base.clone()).unwrap()).0[0];
    let (toks, reason) = collect(h.submit(Request { stop_ids: vec![first], ..base.clone() }).unwrap());
    assert_eq!((toks, reason), (vec![first], FinishReason::Stop));
}

/// A vocabulary past the device draw's 2^17 sampled tokens (its u64 weight sums would overflow
/// on a flat row) samples on the host, and still serves sampled requests; V4's 129,280 does not.
#[test]
fn vocabularies_past_the_device_draw_sample_on_the_host() {
    use dsv4_backend::draw::DRAW_MAX_SAMPLED_COLS;
    for (vocab, host) in [(129_280, false), (DRAW_MAX_SAMPLED_COLS + 1, true)] {
        let d = tempfile::tempdir().unwrap();
        let cfg = tiny_config(vocab);
        std::fs::write(d.path().join("config.json"), cfg.to_hf_json().to_string()).unwrap();
        write_safetensors(&d.path().join("model.safetensors"), &random_checkpoint(&cfg, 5, SynthDType::F32)).unwrap();
        let h = spawn(load(d.path(), 1), EngineConfig::default(), 1);
        assert_eq!(h.config.host_sampling, host, "vocabulary {vocab}");
        let params = SamplingParams { temperature: 0.8, top_p: 0.95, seed: 3, ..Default::default() };
        let req = Request::new(vec![1, 2, 3], params, 3);
        let sub = h.submit(req).unwrap();
        let (toks, _) = collect(sub);
        assert_eq!(toks.len(), 3);
        assert!(toks.iter().all(|&t| (t as usize) < vocab));
    }
}
