//! Collectives between the ranks of a tensor + expert parallel group.
//!
//! The forward ([`crate::forward`]) meets the other ranks three times: after attention's output
//! projection and after the FFN (an all-reduce sum of the `[rows, hidden]` partials), and at the
//! LM head (an all-gather of each rank's vocabulary columns). [`Single`] is the world of one:
//! every collective is the identity, so the single-device path is bitwise what it was.
//! [`LocalComm`] is the in-process communicator the CPU tests shard with: one thread per rank,
//! ranks meet at a barrier, and the sum runs in rank order (0, 1, 2, …) on every rank, so all
//! ranks hold bitwise the same result and reruns are deterministic.

use crate::backend::Backend;
use std::sync::{Arc, Barrier, Mutex};

pub trait Comm<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Replaces `x` (`[rows, cols]`, the same shape on every rank) by the sum over ranks.
    fn all_reduce(&self, b: &B, x: &mut B::T);
    /// Every rank's `[rows, cols_r]` side by side in rank order: `[rows, total]`, where rank
    /// `r` holds columns `⌊r·total/W⌋..⌊(r+1)·total/W⌋` ([`split`]; widths may differ by one).
    fn all_gather_cols(&self, b: &B, x: B::T, total: usize) -> B::T;
    /// Whether the collectives may be recorded into a backend's step graph (a host round trip
    /// cannot).
    fn recordable(&self) -> bool {
        true
    }
}

/// The world of one rank: no collective does anything.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl<B: Backend> Comm<B> for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, _b: &B, _x: &mut B::T) {}
    fn all_gather_cols(&self, _b: &B, x: B::T, _total: usize) -> B::T {
        x
    }
}

/// Rank `rank`'s part `⌊rank·n/world⌋..⌊(rank+1)·n/world⌋` of `n` columns (as
/// [`dsv4_model::Shard::vocab_of`] splits the LM head).
pub fn split(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    rank * n / world..(rank + 1) * n / world
}

/// What the ranks of a [`LocalComm`] group share.
struct Meeting {
    barrier: Barrier,
    /// Each rank's contribution to the current collective: `(cols, data)`.
    slots: Mutex<Vec<(usize, Vec<f32>)>>,
}

/// An in-process communicator over host memory: works with any backend through
/// [`Backend::to_host`]/[`Backend::to_device`] (so it synchronises and is not recordable). Every
/// rank must run the same collectives in the same order, each from its own thread.
pub struct LocalComm {
    rank: usize,
    world: usize,
    meet: Arc<Meeting>,
}

impl LocalComm {
    /// The `world` ranks of one group, rank `r` at index `r`.
    pub fn group(world: usize) -> Vec<LocalComm> {
        assert!(world > 0, "a group needs a rank");
        let meet = Arc::new(Meeting { barrier: Barrier::new(world), slots: Mutex::new(vec![(0, Vec::new()); world]) });
        (0..world).map(|rank| LocalComm { rank, world, meet: meet.clone() }).collect()
    }

    /// [`LocalComm::group`] as trait objects (for [`crate::Model::load_group`]).
    pub fn boxed<B: Backend>(world: usize) -> Vec<Box<dyn Comm<B>>> {
        Self::group(world).into_iter().map(|c| Box::new(c) as Box<dyn Comm<B>>).collect()
    }

    /// Posts this rank's data, waits for all, reads with `f`, and waits again so no rank posts
    /// the next collective's data before every rank has read this one's.
    fn exchange<R>(&self, cols: usize, data: Vec<f32>, f: impl FnOnce(&[(usize, Vec<f32>)]) -> R) -> R {
        self.meet.slots.lock().expect("a rank panicked")[self.rank] = (cols, data);
        self.meet.barrier.wait();
        let r = f(&self.meet.slots.lock().expect("a rank panicked"));
        self.meet.barrier.wait();
        r
    }
}

impl<B: Backend> Comm<B> for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce(&self, b: &B, x: &mut B::T) {
        let (rows, cols) = b.shape(x);
        let sum = self.exchange(cols, b.to_host(x), |all| {
            let mut s = all[0].1.clone();
            for (c, d) in &all[1..] {
                assert_eq!((*c, d.len()), (cols, s.len()), "all_reduce: ranks disagree on the shape");
                s.iter_mut().zip(d).for_each(|(a, v)| *a += v);
            }
            s
        });
        *x = b.to_device(rows, cols, &sum);
    }
    fn all_gather_cols(&self, b: &B, x: B::T, total: usize) -> B::T {
        let (rows, cols) = b.shape(&x);
        assert_eq!(cols, split(total, self.world, self.rank).len(), "all_gather_cols: rank {} width", self.rank);
        let (width, out) = self.exchange(cols, b.to_host(&x), |all| {
            let width: usize = all.iter().map(|(c, _)| c).sum();
            let mut out = Vec::with_capacity(rows * width);
            for i in 0..rows {
                for (c, d) in all {
                    assert_eq!(d.len(), rows * c, "all_gather_cols: ranks disagree on the rows");
                    out.extend_from_slice(&d[i * c..(i + 1) * c]);
                }
            }
            (width, out)
        });
        b.to_device(rows, width, &out)
    }
    fn recordable(&self) -> bool {
        false
    }
}
