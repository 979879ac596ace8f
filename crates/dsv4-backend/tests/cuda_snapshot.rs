//! Snapshots on the GPU: a sequence's state saved to the host format and restored into another
//! slot continues exactly like the original; a CPU snapshot restored on the GPU continues like
//! the CPU (the prefix cache and the disk cache rely on both). Built with `--features cuda`;
//! prints "skipping: no CUDA device" elsewhere.
#![cfg(feature = "cuda")]

mod common;
use common::{fixtures_dir, gpu, rel_err, tokens};
use dsv4_backend::bf16::round_weight;
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Model, SeqState, Snapshot};

#[test]
fn cuda_snapshot_restore_continues_like_the_original() {
    let Some(b) = gpu() else { return };
    let dir = fixtures_dir().join("csa4_hca128_long");
    let mut m = Model::load(b, &dir, 3, false).unwrap();
    let toks = tokens(290, 97, 4);
    for cut in [1usize, 130, 203, 257] {
        let a = m.alloc_seq().unwrap();
        m.prefill_chunks(a, &toks[..cut], &[cut]).unwrap();
        let snap = m.snapshot(a).unwrap();
        // Through bytes too, as the disk cache stores it.
        let snap = Snapshot { len: snap.len, state: SeqState::from_bytes(&m.cfg, &snap.state.to_bytes()).unwrap() };
        let rest = &toks[cut..];
        let want = m.prefill_chunks(a, rest, &[rest.len()]).unwrap();
        let c = m.alloc_seq().unwrap();
        assert!(m.restore(c, &snap));
        let got = m.prefill_chunks(c, rest, &[rest.len()]).unwrap();
        let e = rel_err(&got, &want);
        println!("cut {cut}: restored vs original rel err {e:.2e}");
        assert!(e <= 1e-6, "cut {cut}: {e}");
        m.free_seq(a);
        m.free_seq(c);
    }
}

/// A deferred snapshot (`Model::snapshot_deferred`: the copy queued, finished later on another
/// thread) holds the state as of when it was begun: equal to the synchronous snapshot taken
/// then, although the sequence (and another one in the slot beside it) ran further steps, and a
/// new sequence took over its slot, before it was finished. Several are in flight at once, so
/// each owns its host buffer. A dropped one (never finished) releases its buffer safely. The
/// first cuts' snapshots find no page-locked staging buffer (copied through pageable memory);
/// `reserve_state` then page-locks the pool (one buffer a slot: 3), which cuts 203, 230 and 257
/// take; cut 280 finds none free, so its table goes up from a slab and its background half
/// waits until another half gives a buffer back; the synchronous snapshots taken meanwhile
/// (`want`) do not wait and copy through pageable memory. Every way runs.
#[test]
fn cuda_deferred_snapshot_is_the_state_when_begun() {
    let Some(b) = gpu() else { return };
    let dir = fixtures_dir().join("csa4_hca128_long");
    let mut m = Model::load(b, &dir, 3, false).unwrap();
    let toks = tokens(290, 97, 4);
    let other = tokens(200, 97, 5);
    let (a, o) = (m.alloc_seq().unwrap(), m.alloc_seq().unwrap());
    let mut pending = Vec::new();
    let mut at = 0;
    for cut in [1usize, 130, 203, 230, 257, 280] {
        if cut == 203 {
            m.reserve_state(300);
        }
        m.prefill_chunks(a, &toks[at..cut], &[cut - at]).unwrap();
        at = cut;
        let want = m.snapshot(a).unwrap();
        let p = m.snapshot_deferred(a).unwrap();
        assert!(!p.is_ready(), "the CUDA backend defers the copy");
        pending.push((cut, want, p));
        // Work queued behind the copy: the other slot's prefill rewrites rings and entries.
        m.prefill_chunks(o, &other[..50], &[50]).unwrap();
        m.free_seq(o);
        assert_eq!(m.alloc_seq().unwrap(), o);
    }
    // The sequence goes on, then its slot is freed and refilled with another prompt.
    m.prefill_chunks(a, &toks[at..], &[toks.len() - at]).unwrap();
    m.free_seq(a);
    assert_eq!(m.alloc_seq().unwrap(), a);
    m.prefill_chunks(a, &other, &[other.len()]).unwrap();
    drop(m.snapshot_deferred(a).unwrap());
    let threads: Vec<_> =
        pending.into_iter().map(|(cut, want, p)| std::thread::spawn(move || (cut, want, p.wait()))).collect();
    for t in threads {
        let (cut, want, got) = t.join().unwrap();
        assert_eq!(got.len, cut);
        assert!(got.state == want.state, "cut {cut}: the deferred snapshot differs from the one taken when it began");
    }
}

#[test]
fn cpu_snapshot_restored_on_the_gpu_continues_like_the_cpu() {
    let Some(b) = gpu() else { return };
    let dir = fixtures_dir().join("csa4_hca128_long");
    let mut g = Model::load(b, &dir, 1, false).unwrap();
    let mut c = Model::load_with(CpuBackend, &dir, 1, false, round_weight).unwrap();
    let toks = tokens(290, 97, 8);
    let cut = 213;
    let s = c.alloc_seq().unwrap();
    c.prefill_chunks(s, &toks[..cut], &[cut]).unwrap();
    let snap = c.snapshot(s).unwrap();
    let want = c.prefill_chunks(s, &toks[cut..], &[toks.len() - cut]).unwrap();
    let t = g.alloc_seq().unwrap();
    assert!(g.restore(t, &snap));
    let got = g.prefill_chunks(t, &toks[cut..], &[toks.len() - cut]).unwrap();
    let e = rel_err(&got, &want);
    println!("CPU snapshot on the GPU vs CPU: rel err {e:.2e}");
    assert!(e <= 1e-4, "{e}");
    // And back: the GPU state saved to the host continues on the CPU.
    let back = g.snapshot(t).unwrap();
    let mut c2 = Model::load_with(CpuBackend, &dir, 1, false, round_weight).unwrap();
    let u = c2.alloc_seq().unwrap();
    assert!(c2.restore(u, &back));
    let more = tokens(5, 97, 9);
    let x = c2.prefill_chunks(u, &more, &[5]).unwrap();
    let y = c.prefill_chunks(s, &more, &[5]).unwrap();
    let e = rel_err(&x, &y);
    println!("GPU snapshot on the CPU vs CPU: rel err {e:.2e}");
    assert!(e <= 1e-4, "{e}");
}
