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
