//! A tensor + expert parallel group in one process: one [`Model`] per rank, each driven from its
//! own thread for every call, meeting the others in [`LocalComm`]'s collectives.
//!
//! Thread per rank (not process per rank) because the engine, scheduler and server are
//! single-process: a group looks like one model to them, and the ranks share nothing but the
//! collectives' buffers. Every rank runs the same calls in the same order, so their control flow
//! (and their errors) agree; a rank that panics leaves the others waiting at a barrier.

use crate::backend::Backend;
use crate::batch::Batch;
use crate::comm::LocalComm;
use crate::model::{Model, ModelError};
use dsv4_model::HostTensor;
use std::path::Path;

pub struct Group<B: Backend> {
    ranks: Vec<Model<B>>,
}

impl<B: Backend + 'static> Group<B>
where
    Model<B>: Send,
{
    /// Loads `world` ranks of `dir`, each its own share onto `backend(rank)`, in parallel.
    pub fn load(
        dir: &Path,
        world: usize,
        max_seqs: usize,
        backend: impl Fn(usize) -> B + Sync,
    ) -> Result<Self, ModelError> {
        Self::load_with(dir, world, max_seqs, backend, |_| {})
    }

    /// [`Group::load`] with `edit` applied to every tensor before it is cut and uploaded.
    pub fn load_with(
        dir: &Path,
        world: usize,
        max_seqs: usize,
        backend: impl Fn(usize) -> B + Sync,
        edit: impl Fn(&mut HostTensor) + Sync,
    ) -> Result<Self, ModelError> {
        let comms = LocalComm::group(world);
        let ranks = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    let (backend, edit) = (&backend, &edit);
                    s.spawn(move || Model::load_rank(backend(r), dir, max_seqs, false, edit, Box::new(c)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("a rank panicked while loading")).collect::<Vec<_>>()
        });
        Ok(Group { ranks: ranks.into_iter().collect::<Result<_, _>>()? })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s model (its weights are its share; `cfg` is the global configuration).
    pub fn rank(&self, r: usize) -> &Model<B> {
        &self.ranks[r]
    }

    /// `f` on every rank at once, each on its own thread; the results in rank order.
    fn each<R: Send>(&mut self, f: impl Fn(&mut Model<B>) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = self.ranks.iter_mut().map(|m| s.spawn(move || f(m))).collect();
            hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
        })
    }

    /// Takes the same free slot on every rank.
    pub fn alloc_seq(&mut self) -> Result<usize, ModelError> {
        let ids: Vec<_> = self.ranks.iter_mut().map(|m| m.alloc_seq()).collect::<Result<_, _>>()?;
        assert!(ids.iter().all(|&i| i == ids[0]), "ranks disagree on the slot: {ids:?}");
        Ok(ids[0])
    }

    pub fn free_seq(&mut self, seq: usize) {
        self.ranks.iter_mut().for_each(|m| m.free_seq(seq));
    }

    /// [`Model::forward`] on every rank; every rank ends with the same logits (the head's
    /// all-gather), which this checks.
    pub fn forward(&mut self, batch: &Batch, out_rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        same(self.each(|m| m.forward(batch, out_rows)))
    }

    /// [`Model::prefill_chunks`] on every rank.
    pub fn prefill_chunks(&mut self, seq: usize, tokens: &[u32], chunks: &[usize]) -> Result<Vec<f32>, ModelError> {
        same(self.each(|m| m.prefill_chunks(seq, tokens, chunks)))
    }
}

/// Rank 0's result, checked equal on every rank.
fn same(outs: Vec<Result<Vec<f32>, ModelError>>) -> Result<Vec<f32>, ModelError> {
    let mut outs = outs.into_iter();
    let first = outs.next().expect("a rank")?;
    for (r, o) in outs.enumerate() {
        assert!(o? == first, "rank {} ended with other logits than rank 0", r + 1);
    }
    Ok(first)
}
