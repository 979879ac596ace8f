//! Tensor + expert parallel forward (issue #15, the CPU acceptance point): the same forward over
//! 2 and 4 in-process ranks ([`dsv4_backend::comm::LocalComm`], one thread each, every rank
//! loading only its share) gives the unsharded logits on the HF fixtures, prefill and greedy
//! decode alike; one rank is bitwise the plain path. The group is driven as one [`Model`]
//! ([`Model::load_group`]: rank 0 mirrors every call to the other ranks' threads).

mod common;
use common::*;
use dsv4_backend::comm::LocalComm;
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Batch, Model, ModelError};
use dsv4_model::{Config, Shard, TensorStore};

const FIXTURES: [&str; 4] = ["tiny_mixed", "csa4_hca128_long", "pro_like", "official_fp8"];

/// Sharding changes no operation, only how f32 sums are grouped: the `wo_b` and shared-expert
/// `w2` products and the routed-expert sum become W partial sums added in rank order. Each such
/// regrouping moves a sum by a few ulps of its magnitude; six layers of mHC mixing,
/// normalisation and softmax carry that to the logits. We allow max |Δ logit| ≤ 64 · ε_f32 ·
/// max |logit| (≈ 7.6e-6 relative): about ten times what reordering produces on these
/// fixtures (printed; 4e-7 to 8e-7, i.e. 3–7 ε), and far below a real sharding bug (a missing
/// or doubled partial, a wrong head group or expert range), which moves logits by O(1). The
/// fixtures' router and indexer gaps (≥ 1e-4 relative) and greedy margins (≥ 4e-3) are far
/// wider, so the same experts, entries and tokens are chosen.
const TOL: f64 = 64.0 * f32::EPSILON as f64;
/// Decode steps after the prefill in the greedy check.
const STEPS: usize = 8;

fn prompt(name: &str) -> Vec<u32> {
    let st = TensorStore::open(&fixtures_dir().join(name).join("expected.safetensors")).unwrap();
    st.i64("input_ids").unwrap().into_iter().map(|x| x as u32).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

/// Prefill logits at every position, then `STEPS` greedy decode steps: (prefill, tokens, step logits).
trait Runner {
    fn alloc(&mut self) -> usize;
    fn fwd(&mut self, b: &Batch, out: &[usize]) -> Vec<f32>;
    fn run(&mut self, ids: &[u32], vocab: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let s = self.alloc();
        let all: Vec<usize> = (0..ids.len()).collect();
        let pre = self.fwd(&Batch::chunk(s, 0, ids).unwrap(), &all);
        let mut last = pre[(ids.len() - 1) * vocab..].to_vec();
        let (mut toks, mut steps) = (Vec::new(), Vec::new());
        for i in 0..STEPS {
            let t = argmax(&last);
            toks.push(t);
            last = self.fwd(&Batch::chunk(s, ids.len() + i, &[t]).unwrap(), &[0]);
            steps.extend_from_slice(&last);
        }
        (pre, toks, steps)
    }
}

impl Runner for Model<CpuBackend> {
    fn alloc(&mut self) -> usize {
        self.alloc_seq().unwrap()
    }
    fn fwd(&mut self, b: &Batch, out: &[usize]) -> Vec<f32> {
        self.forward(b, out).unwrap()
    }
}

/// `world` in-process CPU ranks of `name`, as one model.
fn group(name: &str, world: usize, max_seqs: usize) -> Result<Model<CpuBackend>, ModelError> {
    let backends = (0..world).map(|_| CpuBackend).collect();
    Model::load_group(backends, LocalComm::boxed(world), &fixtures_dir().join(name), max_seqs, false)
}

#[test]
fn sharded_forward_matches_unsharded_on_hf_fixtures() {
    let mut ran_at_4 = Vec::new();
    for name in FIXTURES {
        let dir = fixtures_dir().join(name);
        let cfg = Config::from_dir(&dir).unwrap();
        let ids = prompt(name);
        let v = cfg.vocab_size;
        let want = load(&dir, 1).run(&ids, v);
        for world in [2, 4] {
            if let Err(e) = Shard::new(0, world).check(&cfg) {
                println!("{name}: {world} ranks skipped: {e}");
                continue;
            }
            let got = group(name, world, 1).unwrap().run(&ids, v);
            let pre = rel_err(&got.0, &want.0);
            let dec = rel_err(&got.2, &want.2);
            println!("{name}: {world} ranks: prefill rel err {pre:.2e}, decode {dec:.2e} (tol {TOL:.2e})");
            assert!(pre <= TOL, "{name} at {world} ranks: prefill max |Δ| / max |logit| = {pre:.3e} > {TOL:.3e}");
            assert!(dec <= TOL, "{name} at {world} ranks: decode max |Δ| / max |logit| = {dec:.3e} > {TOL:.3e}");
            assert_eq!(got.1, want.1, "{name} at {world} ranks: greedy tokens differ");
            if world == 4 {
                ran_at_4.push(name);
            }
        }
    }
    // pro_like (8 heads in 4 groups, 12 experts, shared rows 16) splits over 4; the others
    // have 2 head groups and split over 2 only.
    assert!(ran_at_4.contains(&"pro_like"), "no fixture ran at 4 ranks: {ran_at_4:?}");
}

/// A group of one (the in-process communicator, through the host) is bitwise the plain model.
#[test]
fn one_rank_is_bitwise_the_plain_path() {
    for name in ["tiny_mixed", "pro_like"] {
        let dir = fixtures_dir().join(name);
        let ids = prompt(name);
        let v = Config::from_dir(&dir).unwrap().vocab_size;
        let want = load(&dir, 1).run(&ids, v);
        let got = group(name, 1, 1).unwrap().run(&ids, v);
        assert!(got == want, "{name}: one rank differs from the plain path");
    }
}

/// Chunked prefill through the sharded path equals the sharded single-chunk prefill within
/// the same tolerance (compressor windows and the window ring are replicated per rank).
#[test]
fn sharded_chunked_prefill_matches() {
    let dir = fixtures_dir().join("pro_like");
    let ids = prompt("pro_like");
    let mut plain = load(&dir, 1);
    let s = plain.alloc_seq().unwrap();
    let want = plain.prefill_chunks(s, &ids, &[ids.len()]).unwrap();
    let mut g = group("pro_like", 4, 1).unwrap();
    let s = g.alloc_seq().unwrap();
    let got = g.prefill_chunks(s, &ids, &[13, 1, 7, ids.len() - 21]).unwrap();
    let err = rel_err(&got, &want);
    assert!(err <= TOL, "chunked sharded prefill: {err:.3e}");
}

/// Each rank holds only its share: a quarter of the routed experts and of the query heads.
#[test]
fn ranks_hold_their_share() {
    let dir = fixtures_dir().join("pro_like");
    for (r, c) in LocalComm::group(4).into_iter().enumerate() {
        let m = Model::load_rank(CpuBackend, &dir, 1, false, |_| {}, Box::new(c)).unwrap();
        let l = &m.weights.layers[3];
        assert_eq!((l.ffn.experts.len(), l.ffn.expert0), (3, 3 * r));
        assert_eq!(l.attn.sinks.cols, 2);
        assert_eq!((l.attn.wq_b.rows, l.attn.wo_b.cols), (2 * 32, 16));
        assert_eq!((l.ffn.shared.w1.rows, l.ffn.shared.w2.cols), (4, 4));
        let vocab = Shard::new(r, 4).vocab_of(&m.cfg, r);
        assert_eq!(m.weights.head.rows, vocab.len());
    }
}

/// A world that does not divide the head groups is refused, naming the tensor and its shape.
#[test]
fn indivisible_world_names_the_tensor() {
    let Err(e) = group("tiny_mixed", 4, 1) else { panic!("tiny_mixed split over 4 ranks") };
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Load(_)), "{msg}");
    assert!(msg.contains("layers.0.attn.wo_a.weight") && msg.contains("[32, 64]") && msg.contains("4 ranks"), "{msg}");
}

/// Rollback, snapshots and restores reach every rank: after cutting a sequence back and
/// replaying, and in a slot restored from a snapshot, the group continues bitwise as before.
#[test]
fn rollback_and_restore_reach_every_rank() {
    let ids = prompt("pro_like");
    let mut m = group("pro_like", 4, 2).unwrap();
    let v = m.cfg.vocab_size;
    let s = m.alloc_seq().unwrap();
    let first = m.prefill_chunks(s, &ids[..30], &[30]).unwrap();
    m.truncate(s, 20).unwrap();
    let again = m.prefill_chunks(s, &ids[20..30], &[10]).unwrap();
    assert!(again == first[20 * v..], "replay after rollback differs");
    let snap = m.snapshot(s).unwrap();
    let next = m.forward(&Batch::chunk(s, 30, &ids[30..31]).unwrap(), &[0]).unwrap();
    let t = m.alloc_seq().unwrap();
    assert!(m.restore(t, &snap));
    let restored = m.forward(&Batch::chunk(t, 30, &ids[30..31]).unwrap(), &[0]).unwrap();
    assert!(restored == next, "the restored slot continues differently");
    m.free_seq(s);
    m.free_seq(t);
    assert_eq!(m.alloc_seq().unwrap(), s, "freeing reached every rank");
}
