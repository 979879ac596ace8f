//! Prefix-cache snapshots finished off the engine thread. A device backend queues a snapshot's
//! copy behind the step that produced the state ([`dsv4_backend::Model::snapshot_deferred`]);
//! waiting for it and building the host state here instead of inside the step let the next step
//! run meanwhile (a synchronous snapshot cost a served 43-layer step 9–20 ms, PERF.md v31).
//! The engine collects the finished ones between steps and caches them.

use dsv4_backend::{PendingSnapshot, Snapshot};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

/// A finished snapshot with what the engine needs to cache it.
pub struct Finished {
    /// The prompt prefix the state holds.
    pub tokens: Vec<u32>,
    /// Also write it to the disk cache now (interval snapshots of long prompts).
    pub persist: bool,
    /// `None` when finishing it panicked (a backend error): nothing to cache.
    pub snap: Option<Snapshot>,
    /// Time spent waiting for the copy and building the state, off the engine thread.
    pub took: Duration,
}

/// Pending snapshots, each finished on a thread of its own.
pub struct SnapshotWorker {
    tx: Sender<Finished>,
    rx: Receiver<Finished>,
    outstanding: usize,
}

impl Default for SnapshotWorker {
    fn default() -> Self {
        let (tx, rx) = channel();
        SnapshotWorker { tx, rx, outstanding: 0 }
    }
}

impl SnapshotWorker {
    /// Finishes `pending` on another thread.
    pub fn submit(&mut self, tokens: Vec<u32>, persist: bool, pending: PendingSnapshot) {
        let tx = self.tx.clone();
        self.outstanding += 1;
        let spawned = std::thread::Builder::new().name("dsv4-snapshot".into()).spawn(move || {
            let t0 = Instant::now();
            let snap = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pending.wait()));
            if let Err(p) = &snap {
                let msg = p.downcast_ref::<&str>().copied().or(p.downcast_ref::<String>().map(String::as_str));
                tracing::error!("a prefix-cache snapshot failed: {}", msg.unwrap_or("non-string panic"));
            }
            let _ = tx.send(Finished { tokens, persist, snap: snap.ok(), took: t0.elapsed() });
        });
        if let Err(e) = spawned {
            // No thread: nothing will arrive for it (the pending copy is dropped, which waits
            // for it to land before its buffer is released).
            tracing::warn!("no thread for a prefix-cache snapshot ({e}); it is dropped");
            self.outstanding -= 1;
        }
    }

    /// Snapshots not yet collected.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// The snapshots finished so far, without waiting.
    pub fn collect(&mut self) -> Vec<Finished> {
        let mut done = Vec::new();
        while let Ok(f) = self.rx.try_recv() {
            self.outstanding -= 1;
            done.push(f);
        }
        done
    }

    /// Every outstanding snapshot, waiting for those still running.
    pub fn collect_all(&mut self) -> Vec<Finished> {
        let mut done = self.collect();
        while self.outstanding > 0 {
            // The worker keeps a sender, so this only ends by a thread's message.
            let f = self.rx.recv().expect("the worker holds a sender");
            self.outstanding -= 1;
            done.push(f);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_backend::{SavedState, SeqState};
    use std::sync::mpsc::Receiver;

    /// A pending snapshot whose copy lands when `gate` (if any) says so, or fails.
    fn pending(len: usize, gate: Option<Receiver<()>>, fail: bool) -> PendingSnapshot {
        let cfg = dsv4_model::synth::tiny_config(64);
        PendingSnapshot {
            len,
            state: SavedState::Pending(Box::new(move || {
                if let Some(g) = gate {
                    g.recv().expect("the test opens the gate");
                }
                assert!(!fail, "a failing copy");
                SeqState::new(&cfg)
            })),
        }
    }

    /// Snapshots finish off the caller's thread, `collect` returns only the finished ones, and
    /// `collect_all` waits for the rest; one whose finishing panics comes back without a state
    /// instead of being lost (the engine's wait would otherwise never end).
    #[test]
    fn snapshots_finish_in_the_background() {
        let mut w = SnapshotWorker::default();
        let (open, gate) = channel();
        w.submit(vec![1, 2, 3], false, pending(3, None, false));
        w.submit(vec![4, 5], true, pending(2, Some(gate), false));
        w.submit(vec![6], false, pending(1, None, true));
        assert_eq!(w.outstanding(), 3);
        // The two ungated ones arrive while the gated one cannot.
        let mut early = Vec::new();
        while early.len() < 2 {
            early.extend(w.collect());
            std::thread::yield_now();
        }
        assert_eq!(early.len(), 2);
        assert_eq!(w.outstanding(), 1);
        assert!(early.iter().all(|f| f.tokens != [4, 5]), "the gated snapshot cannot be done yet");
        open.send(()).unwrap();
        let rest = w.collect_all();
        assert_eq!(rest.len(), 1);
        assert_eq!(w.outstanding(), 0);
        let all: Vec<_> = early.into_iter().chain(rest).collect();
        let by = |t: &[u32]| all.iter().find(|f| f.tokens == t).expect("every snapshot comes back");
        assert_eq!(by(&[1, 2, 3]).snap.as_ref().map(|s| s.len), Some(3));
        assert!(by(&[4, 5]).persist && by(&[4, 5]).snap.as_ref().map(|s| s.len) == Some(2));
        assert!(by(&[6]).snap.is_none(), "a failed snapshot has no state");
        assert!(w.collect_all().is_empty());
    }
}
