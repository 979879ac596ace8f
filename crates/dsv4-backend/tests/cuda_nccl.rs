//! A single-rank NCCL communicator on one GPU runs the real collective path (the all-reduces
//! after `wo_b` and the FFN, the head's all-gather, recorded into the step graphs) and gives
//! bitwise the plain run's logits, eager and replayed. Built with `--features cuda`; prints
//! "skipping: ..." without a device or without libnccl.
//!
//! Not yet run: written in a session without a GPU (docs/multi-gpu.md).
#![cfg(feature = "cuda")]

mod common;
use common::{tokens, write_random};
use dsv4_backend::cuda::nccl::NcclComm;
use dsv4_backend::cuda::CudaBackend;
use dsv4_backend::{Batch, Model, Row};
use dsv4_model::synth::tiny_config;

/// Prefill two sequences in chunks, then 40 two-row decode steps (recorded after the first).
fn script(m: &mut Model<CudaBackend>, vocab: usize) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let seqs: Vec<usize> = (0..2).map(|_| m.alloc_seq().unwrap()).collect();
    for (i, &s) in seqs.iter().enumerate() {
        let t = tokens(20, vocab, 7 + i as u64);
        out.push(m.prefill_chunks(s, &t, &[13, 7]).unwrap());
    }
    for step in 0..40 {
        let rows: Vec<Row> =
            (0..2).map(|i| Row { seq: seqs[i], pos: 20 + step, token: ((5 * step + i + 1) % vocab) as u32 }).collect();
        out.push(m.forward(&Batch::new(rows).unwrap(), &[0, 1]).unwrap());
    }
    out
}

fn check(graphs: bool) {
    let Some(a) = CudaBackend::exact_or_skip(false) else { return };
    let b = CudaBackend::new(0).unwrap();
    b.set_exact(true);
    let comm = match NcclComm::group(&[&b]) {
        Ok(mut c) => c.remove(0),
        Err(e) => {
            println!("skipping: {e}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 41);
    let mut plain = Model::load(a, dir.path(), 2, false).unwrap();
    let mut nccl = Model::load_rank(b, dir.path(), 2, false, |_| {}, Box::new(comm)).unwrap();
    plain.set_graphs(graphs);
    nccl.set_graphs(graphs);
    let want = script(&mut plain, cfg.vocab_size);
    let got = script(&mut nccl, cfg.vocab_size);
    if graphs {
        assert!(nccl.recorded_steps() >= 1, "the NCCL rank recorded no step");
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "forward {i}: the single-rank NCCL run differs from the plain one (graphs {graphs})");
    }
    println!("{} forwards bitwise equal through NCCL (graphs {graphs})", got.len());
}

#[test]
fn single_rank_nccl_equals_plain_eager() {
    check(false);
}

#[test]
fn single_rank_nccl_equals_plain_recorded() {
    check(true);
}
