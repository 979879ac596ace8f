//! Recorded steps (CUDA graphs) give bitwise the eager path's logits, ids (greedy and sampled
//! on the device, each sampled one the CPU twin's draw) and tapped stream means: prefill chunks, decode
//! steps of several sequences, speculative verify blocks with cut-backs, steps of 80 and 100
//! rows, a shape re-recorded after the compressed entries grew, and
//! hash-routed layers (looked up on the device). A NaN
//! planted in a weight is still named by stage. Built with `--features cuda`; prints
//! "skipping: no CUDA device" elsewhere.
#![cfg(feature = "cuda")]

mod common;
use common::{tokens, write_random};
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::draw::draw_row;
use dsv4_backend::{Batch, Draw, Model, Outputs, Row, StepOut, StepPlan};
use dsv4_model::synth::tiny_config;

/// Every forward of a script: prefill chunks for three sequences, 3-row decode steps long
/// enough that the compressed entries grow (a recorded shape is then recorded again), and
/// verify blocks of 1 + 2 rows per sequence cut back to the anchor plus one draft. Decode
/// steps alternate between logits and greedy ids and tap two layers' stream means (DSpark's
/// `main_hidden`), as the engine's steps do.
fn script(m: &mut Model<CudaBackend>, vocab: usize) -> Vec<StepOut> {
    let mut out = Vec::new();
    let seqs: Vec<usize> = (0..3).map(|_| m.alloc_seq().unwrap()).collect();
    let wrap = |logits| StepOut { logits, ..Default::default() };
    for (i, &s) in seqs.iter().enumerate() {
        let t = tokens(20, vocab, 5 + i as u64);
        out.push(wrap(m.forward(&Batch::chunk(s, 0, &t).unwrap(), &[19]).unwrap()));
    }
    let mut pos = [20usize; 3];
    let taps = [1usize, 3];
    for step in 0..70 {
        let rows: Vec<Row> =
            (0..3).map(|i| Row { seq: seqs[i], pos: pos[i], token: ((7 * step + 3 * i + 1) % vocab) as u32 }).collect();
        let batch = Batch::new(rows).unwrap();
        let outputs = Outputs { out_rows: &[0, 1, 2], taps: if step % 3 == 0 { &[] } else { &taps } };
        // Every row's logits, none, or the first row's only; every other step samples its
        // rows on the device (then with all logits back, each id is the CPU twin's draw).
        let logits = [3, 0, 1][step % 3];
        let draws = if step % 2 == 1 { sampled(step) } else { Vec::new() };
        let o = m.step(&StepPlan { batch: &batch, outputs, logits, draws: &draws }).unwrap();
        if logits == 3 {
            for (r, d) in draws.iter().enumerate() {
                assert_eq!(o.ids[r], draw_row(&o.logits[r * vocab..(r + 1) * vocab], d), "step {step} row {r}: {d:?}");
            }
        }
        out.push(o);
        pos.iter_mut().for_each(|p| *p += 1);
    }
    for round in 0..4 {
        let rows: Vec<Row> = (0..3)
            .flat_map(|i| (0..3).map(move |k| (i, k)))
            .map(|(i, k)| Row { seq: seqs[i], pos: pos[i] + k, token: ((11 * round + 5 * k + i) % vocab) as u32 })
            .collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let batch = Batch::new(rows).unwrap();
        out.push(
            m.step(&StepPlan {
                batch: &batch,
                outputs: Outputs { out_rows: &all, taps: &taps },
                logits: all.len(),
                draws: &[],
            })
            .unwrap(),
        );
        for i in 0..3 {
            m.truncate(seqs[i], pos[i] + 2).unwrap();
            pos[i] += 2;
        }
    }
    out
}

/// Three rows' seeded draws: top-p with temperature, no filter, top-k with min-p.
fn sampled(step: usize) -> Vec<Draw> {
    let u = |r: usize| ((step * 7919 + r * 104_729) % 1000) as f64 / 1000.0;
    vec![
        Draw { temperature: 0.8, top_k: 0, top_p: 0.9, min_p: 0.0, u: u(0) },
        Draw { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: u(1) },
        Draw { temperature: 0.7, top_k: 5, top_p: 1.0, min_p: 0.05, u: u(2) },
    ]
}

/// Steps past 64 rows (recorded up to 128), on five more sequences: prefill chunks of 100 rows
/// (one long segment), then verify blocks of 16 rows on all five sequences (80 rows of short
/// segments, a batch-16 verify of 1 + 4 rows), each cut back to the anchor plus three drafts.
/// A shape is recorded the second time it is seen, so each one runs eagerly, then recorded,
/// then replayed.
fn wide_script(m: &mut Model<CudaBackend>, vocab: usize) -> Vec<StepOut> {
    let mut out = Vec::new();
    let wrap = |logits| StepOut { logits, ..Default::default() };
    let seqs: Vec<usize> = (0..5).map(|_| m.alloc_seq().unwrap()).collect();
    let mut pos = [0usize; 5];
    for (i, &s) in seqs.iter().enumerate() {
        let t = tokens(100, vocab, 40 + i as u64);
        out.push(wrap(m.forward(&Batch::chunk(s, 0, &t).unwrap(), &[99]).unwrap()));
        pos[i] = 100;
    }
    for round in 0..3 {
        let rows: Vec<Row> = (0..5)
            .flat_map(|i| (0..16).map(move |k| (i, k)))
            .map(|(i, k)| Row { seq: seqs[i], pos: pos[i] + k, token: ((13 * round + 3 * k + i) % vocab) as u32 })
            .collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let batch = Batch::new(rows).unwrap();
        out.push(
            m.step(&StepPlan {
                batch: &batch,
                outputs: Outputs { out_rows: &all, taps: &[] },
                logits: all.len(),
                draws: &[],
            })
            .unwrap(),
        );
        for i in 0..5 {
            m.truncate(seqs[i], pos[i] + 4).unwrap();
            pos[i] += 4;
        }
    }
    for s in seqs {
        m.free_seq(s);
    }
    out
}

/// What a step computed (its [`StepOut::path`], how it ran, is what the tests vary).
fn values(o: &StepOut) -> (&[f32], &[u32], &[f32]) {
    (&o.logits, &o.ids, &o.hidden)
}

fn check(exact: bool) {
    let Some(a) = CudaBackend::exact_or_skip(false) else { return };
    a.set_exact(exact);
    let b = CudaBackend::new(0).unwrap();
    b.set_exact(exact);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 33);
    let mut eager = Model::load(a, dir.path(), 8, false).unwrap();
    eager.set_graphs(false);
    let mut graphs = Model::load(b, dir.path(), 8, false).unwrap();
    graphs.set_graphs(true);
    let mut want = script(&mut eager, cfg.vocab_size);
    let mut got = script(&mut graphs, cfg.vocab_size);
    assert!(graphs.recorded_steps() >= 3, "only {} step shapes were recorded", graphs.recorded_steps());
    assert_eq!(eager.recorded_steps(), 0);
    // The recorded step's kernel launches (what `dsv4 bench` reports a layer): at least one a layer.
    let k = graphs.recorded_kernels(3, 3).expect("the 3-row decode step recorded, its kernels counted");
    assert!(k >= cfg.n_layers(), "{k} kernels in a step of {} layers", cfg.n_layers());
    println!("the 3-row recorded step launches {k} kernels ({} layers)", cfg.n_layers());
    want.extend(wide_script(&mut eager, cfg.vocab_size));
    got.extend(wide_script(&mut graphs, cfg.vocab_size));
    // Both record: the grouped experts serve them without a host synchronisation (the tiny
    // model's experts, d 64, do not fit the tensor-core tiles).
    let wide = [(100, 1), (80, 80)].map(|(r, o)| graphs.recorded_kernels(r, o).is_some());
    assert_eq!(wide, [true; 2], "steps of 100 and 80 rows recorded (exact mode {exact})");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            values(g) == values(w),
            "forward {i}: the replayed step's logits, ids or taps differ from the eager ones (exact mode {exact})"
        );
    }
    println!("{} forwards bitwise equal, {} shapes recorded (exact mode {exact})", got.len(), graphs.recorded_steps());
}

#[test]
fn replayed_steps_equal_eager_exact() {
    check(true);
}

#[test]
fn replayed_steps_equal_eager_fast() {
    check(false);
}

#[test]
fn nonfinite_in_a_replayed_step_is_named() {
    let Some(b) = CudaBackend::exact_or_skip(false) else { return };
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 34);
    // A NaN in layer 3's KV projection (as in `nonfinite.rs`): the first nonfinite stage is
    // that layer's `attn.kv`, which the replayed step only sees in its logits.
    let mut m = Model::load_with(b, dir.path(), 1, false, |t| {
        if t.name == "layers.3.attn.wkv.weight" {
            let i = t.data.len() / 3;
            t.data[i] = f32::NAN;
        }
    })
    .unwrap();
    m.set_graphs(true);
    let s = m.alloc_seq().unwrap();
    // Eager (first sighting of the shape), then recorded and replayed: both name the stage.
    let e1 = m.forward(&Batch::chunk(s, 0, &[3]).unwrap(), &[0]).unwrap_err();
    m.free_seq(s);
    let s = m.alloc_seq().unwrap();
    let e2 = m.forward(&Batch::chunk(s, 0, &[3]).unwrap(), &[0]).unwrap_err();
    assert_eq!(m.recorded_steps(), 1, "the second 1-row step was recorded");
    assert_eq!(e1.to_string(), e2.to_string());
    assert_eq!(e2.stage().unwrap().to_string(), "layers.3.attn.kv", "{e2}");
}

/// A state reserved up front (`Model::reserve_state`, what `serve` does for its context limit)
/// does not grow in the steps up to that length, so no recorded step is recorded again for it;
/// the logits are bitwise those of a state that grew as it went (the script's compressed entries
/// grow several times without the reservation).
#[test]
fn a_reserved_state_does_not_grow() {
    let Some(a) = CudaBackend::exact_or_skip(false) else { return };
    let b = CudaBackend::new(0).unwrap();
    a.set_exact(true);
    b.set_exact(true);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 35);
    let mut grown = Model::load(a, dir.path(), 3, false).unwrap();
    let mut reserved = Model::load(b, dir.path(), 3, false).unwrap();
    grown.set_graphs(true);
    reserved.set_graphs(true);
    // The script reaches position 100 at most.
    reserved.reserve_state(128);
    let (g0, r0) = (grown.backend_and_cache().1.generation, reserved.backend_and_cache().1.generation);
    let want = script(&mut grown, cfg.vocab_size);
    let got = script(&mut reserved, cfg.vocab_size);
    assert!(grown.backend_and_cache().1.generation > g0, "the unreserved state never grew: the test tests nothing");
    assert_eq!(reserved.backend_and_cache().1.generation, r0, "the reserved state grew");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(values(g) == values(w), "forward {i}: the reserved state's outputs differ from the grown one's");
    }
}
