//! Rollback without replay: after a verify forward over [anchor, d0..d(l-1)] and a cut back to
//! the accepted prefix, the sequence's state equals a plain run's to the same position, at every
//! alignment against the CSA and HCA ratios, for every number of accepted drafts.

mod common;
use common::*;
use dsv4_backend::{Batch, MAX_ROLLBACK};
use dsv4_model::synth::tiny_config;

#[test]
fn cut_back_state_equals_plain_run_at_every_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.layers[2].ratio = 16; // HCA 16: windows close inside and across verify blocks
    cfg.layers[4].ratio = 16;
    write_random(dir.path(), &cfg, 21);
    let toks = tokens(120, 97, 5);
    let window = cfg.window;
    let mut checked = 0;
    for p in (30..50).chain([63, 64, 79, 80]) {
        for l in 1..=5usize {
            for j in 0..=l {
                // Speculative: prefix, then one verify batch of anchor + l drafts (drafts are the
                // true continuation for the first j, then wrong tokens), then the cut.
                let mut drafts: Vec<u32> = toks[p + 1..p + 1 + l].to_vec();
                for (k, d) in drafts.iter_mut().enumerate().skip(j) {
                    *d = (*d + 1 + k as u32) % 97;
                }
                let mut m = load(dir.path(), 1);
                let s = m.alloc_seq().unwrap();
                m.prefill_chunks(s, &toks[..p], &[p]).unwrap();
                let mut block = vec![toks[p]];
                block.extend(&drafts);
                m.forward(&Batch::chunk(s, p, &block).unwrap(), &[0]).unwrap();
                m.truncate(s, p + 1 + j).unwrap();
                // Plain run to the same position.
                let mut plain = load(dir.path(), 1);
                let t = plain.alloc_seq().unwrap();
                plain.prefill_chunks(t, &toks[..p + 1 + j], &[p + 1 + j]).unwrap();
                let a = m.snapshot(s).unwrap();
                let b = plain.snapshot(t).unwrap();
                assert_eq!(a.len, b.len);
                assert!(
                    a.state.canonical(a.len, window) == b.state.canonical(b.len, window),
                    "state differs after p={p} l={l} j={j}"
                );
                // And both continue identically.
                let next = &toks[p + 1 + j..p + 4 + j];
                let x = m.prefill_chunks(s, next, &[1, 1, 1]).unwrap();
                let y = plain.prefill_chunks(t, next, &[3]).unwrap();
                assert_eq!(x, y, "continuation differs after p={p} l={l} j={j}");
                checked += 1;
            }
        }
    }
    assert!(checked > 400);
}

#[test]
fn cutting_back_too_far_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 2);
    let toks = tokens(60, 97, 1);
    let mut m = load(dir.path(), 1);
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, &toks, &[60]).unwrap();
    let e = m.truncate(s, 60 - MAX_ROLLBACK - 1).unwrap_err().to_string();
    assert!(e.contains("rolled back"), "{e}");
    assert!(m.truncate(s, 61).is_err());
    m.truncate(s, 60 - MAX_ROLLBACK).unwrap();
}
