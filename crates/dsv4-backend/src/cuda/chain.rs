//! The chain bench (`dsv4 bench --synthetic kernels --tables chain`): what a kernel boundary
//! costs a decode step against a grid-wide barrier inside one launch. A one-row step is a chain
//! of ~20 dependent launches a layer, most of them latency-bound, and a persistent decode kernel
//! would trade each boundary for a barrier (PERF.md v46). The links do no work (`chain_link`:
//! one add a block), so a figure is the boundary's price alone: launched one by one, recorded
//! and replayed (PDL edges), recorded with a side branch's fork and join at every other link
//! (the edges a side branch adds, v46), and one launch of `chain_barrier`.

use super::launch::Kernel;
use super::{ck, CudaBackend};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, LaunchConfig};

/// Microseconds a link (one boundary) of each form, for links of `blocks` blocks of 256 threads.
#[derive(Clone, Copy, Debug)]
pub struct ChainTimes {
    pub blocks: usize,
    pub links: usize,
    /// Launched one by one on the stream (with PDL where it is on, `DSV4_PDL`).
    pub eager_us: f64,
    /// The same launches recorded as one graph and replayed.
    pub graph_us: f64,
    /// Recorded with every other link on the side stream: a fork before it and a join after it,
    /// so half the boundaries are event edges (a kernel a boundary, as `graph_us`).
    pub graph_join_us: f64,
    /// One launch of `blocks` blocks with a grid-wide barrier after each link.
    pub barrier_us: f64,
}

const THREADS: u32 = 256;

impl CudaBackend {
    /// [`ChainTimes`] of `links` links of `blocks` blocks (at most the SMs, so that the
    /// barrier's blocks are all resident), the median of 5 timed runs after a warm-up; an error
    /// where a form skipped a link on some block (the counts it leaves).
    pub fn chain_bench(&self, blocks: usize, links: usize) -> Result<ChainTimes, String> {
        let blocks = blocks.clamp(1, self.sm_count());
        let links = links.max(2);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut words = ck(self.main.alloc_zeros::<u32>(blocks), "alloc");
        let mut side_words = ck(self.main.alloc_zeros::<u32>(blocks), "alloc");
        let mut bar = ck(self.main.alloc_zeros::<u32>(2), "alloc");
        let link = |s: &cudarc::driver::CudaStream, w: &mut CudaSlice<u32>| {
            // SAFETY: the kernel takes one buffer of gridDim.x words; `w` holds `blocks`.
            ck(unsafe { s.kernel(&self.k.chain_link).arg(w).launch(cfg) }, "chain_link");
        };
        let time = |run: &mut dyn FnMut()| -> f64 {
            run();
            let mut ts: Vec<f64> = (0..5)
                .map(|_| {
                    let e0 = self.timing_event();
                    run();
                    let e1 = self.timing_event();
                    self.synchronize();
                    e0.elapsed_ms(&e1).unwrap_or(f32::NAN) as f64 * 1e3 / links as f64
                })
                .collect();
            ts.sort_by(f64::total_cmp);
            ts[2]
        };
        let eager_us = time(&mut || {
            for _ in 0..links {
                link(&self.main, &mut words);
            }
        });
        let record = |body: &mut dyn FnMut()| {
            ck(self.main.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin capture");
            body();
            let g = ck(self.main.end_capture(CUgraphInstantiate_flags(0)), "end capture").expect("a recorded chain");
            ck(g.upload(), "graph upload");
            g
        };
        let plain = record(&mut || {
            for _ in 0..links {
                link(&self.main, &mut words);
            }
        });
        let graph_us = time(&mut || ck(plain.launch(), "graph launch"));
        let joined = record(&mut || {
            for i in 0..links {
                if i % 2 == 0 {
                    link(&self.main, &mut words);
                } else {
                    ck(self.side.fork.record(&self.main), "fork");
                    ck(self.side.stream.wait(&self.side.fork), "fork wait");
                    link(&self.side.stream, &mut side_words);
                    ck(self.side.done.record(&self.side.stream), "done");
                    ck(self.main.wait(&self.side.done), "join");
                }
            }
        });
        let graph_join_us = time(&mut || ck(joined.launch(), "graph launch"));
        let n = links as i32;
        let barrier_us = time(&mut || {
            // SAFETY: `words` holds gridDim.x words, `bar` the count and generation (zeroed;
            // every launch leaves the count zero); every block is resident (blocks ≤ SMs).
            ck(
                unsafe { self.main.kernel(&self.k.chain_barrier).arg(&mut words).arg(&mut bar).arg(&n).launch(cfg) },
                "chain_barrier",
            );
        });
        // Every form ran every link on every block: 6 runs of each (a warm-up and 5 timed).
        let main_links = 6 * (3 * links + links.div_ceil(2)) as u32;
        let side_links = 6 * (links / 2) as u32;
        let got = ck(self.main.clone_dtoh(&words), "download");
        let side_got = ck(self.main.clone_dtoh(&side_words), "download");
        let count = ck(self.main.clone_dtoh(&bar), "download")[0];
        if got.iter().any(|&w| w != main_links) || side_got.iter().any(|&w| w != side_links) || count != 0 {
            return Err(format!(
                "chain of {links} links on {blocks} blocks: counts {:?} / {:?} (want {main_links} / {side_links}), \
                 barrier count {count} (want 0)",
                &got[..got.len().min(4)],
                &side_got[..side_got.len().min(4)]
            ));
        }
        Ok(ChainTimes { blocks, links, eager_us, graph_us, graph_join_us, barrier_us })
    }
}
