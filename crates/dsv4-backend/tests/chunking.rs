//! Equivalences on random models: any chunking of a prompt gives the same logits, and sequences
//! are independent of each other (back to back and batched together).

mod common;
use common::*;
use dsv4_model::synth::tiny_config;

fn run_chunks(dir: &std::path::Path, toks: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut m = load(dir, 1);
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, toks, chunks).unwrap()
}

#[test]
fn chunking_invariance_tiny() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(97);
    write_random(dir.path(), &cfg, 7);
    let toks = tokens(41, 97, 1);
    let full = run_chunks(dir.path(), &toks, &[41]);
    let mut splits: Vec<Vec<usize>> =
        vec![vec![1; 41], [13].into_iter().chain(std::iter::repeat_n(1, 28)).collect(), vec![6, 7, 3, 9, 16]];
    let mut s = 99u64;
    for _ in 0..3 {
        let mut left = 41;
        let mut v = Vec::new();
        while left > 0 {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            let n = 1 + (s >> 40) as usize % left.min(11);
            v.push(n);
            left -= n;
        }
        splits.push(v);
    }
    for sp in splits {
        let got = run_chunks(dir.path(), &toks, &sp);
        // Every op is per row with a fixed summation order, so chunking changes no bit.
        assert_eq!(got, full, "chunks {sp:?}: rel err {}", rel_err(&got, &full));
    }
}

/// A snapshot taken at any position (not only window boundaries), serialised and restored into
/// a fresh sequence of another model instance, continues bitwise like the original.
#[test]
fn snapshot_restore_continues_bitwise() {
    use dsv4_backend::{SeqState, Snapshot};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.layers[2].ratio = 128; // CSA 4 and HCA 128 together
    cfg.layers[4].ratio = 128;
    write_random(dir.path(), &cfg, 9);
    let toks = tokens(300, 97, 3);
    for cut in [1usize, 5, 131, 257] {
        let mut a = load(dir.path(), 2);
        let s = a.alloc_seq().unwrap();
        a.prefill_chunks(s, &toks[..cut], &[cut]).unwrap();
        let snap = a.snapshot(s).unwrap();
        let want = a.prefill_chunks(s, &toks[cut..], &[toks.len() - cut]).unwrap();
        // Through bytes, as the disk cache stores it.
        let bytes = snap.state.to_bytes();
        let back = Snapshot { len: snap.len, state: SeqState::from_bytes(&a.cfg, &bytes).unwrap() };
        assert_eq!(back, snap);
        let mut b = load(dir.path(), 2);
        let _other = b.alloc_seq().unwrap();
        let t = b.alloc_seq().unwrap();
        assert!(b.restore(t, &back));
        assert_eq!(b.seq_len(t), Some(cut));
        let got = b.prefill_chunks(t, &toks[cut..], &[toks.len() - cut]).unwrap();
        assert_eq!(got, want, "cut at {cut}");
        // Truncated bytes are refused, never half-loaded.
        assert!(SeqState::from_bytes(&a.cfg, &bytes[..bytes.len() - 3]).is_err());
    }
}
