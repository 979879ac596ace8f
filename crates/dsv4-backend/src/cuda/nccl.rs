//! [`Comm`] over NCCL for the CUDA backend: one process, one thread per GPU, each rank's
//! communicator bound to its backend's stream.
//!
//! Every collective is enqueued on the stream the forward's kernels run on, so nothing waits on
//! the host and the collectives are recorded into the step graphs with the rest of the forward
//! (NCCL ≥ 2.9 supports stream capture). libnccl is loaded at run time (cudarc's dynamic
//! loading): this builds without NCCL installed, and [`NcclComm::group`] says so where it is
//! missing.
//!
//! Not yet run on hardware: written and compiled without a GPU (see `docs/multi-gpu.md`).
//! `Model::load_group` with these communicators forms a multi-GPU group.

use super::{ck, CudaBackend, CudaTensor};
use crate::comm::{split, Comm};
use cudarc::driver::sys::{cuMemcpy2DAsync_v2, CUmemorytype, CUresult, CUDA_MEMCPY2D};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::{Comm as Nccl, ReduceOp};
use std::sync::{Arc, Mutex};

/// Why a group could not be formed.
#[derive(Debug, thiserror::Error)]
pub enum NcclInitError {
    #[error("libnccl could not be loaded (install NCCL 2.x, or run on one GPU without a communicator)")]
    NoLibrary,
    #[error("NCCL initialisation failed: {0}")]
    Init(String),
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    rank: usize,
    world: usize,
    comm: Mutex<Owned>,
}

/// The communicator handle, owned by one rank.
struct Owned(Nccl);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the `Mutex`
// around `Owned` serialises the calls, and the handle is destroyed once, by its owner's drop.
unsafe impl Send for Owned {}

impl NcclComm {
    /// One communicator per backend (rank `r` on `backends[r]`'s device and stream), all in
    /// this process (`ncclCommInitAll`).
    pub fn group(backends: &[&CudaBackend]) -> Result<Vec<NcclComm>, NcclInitError> {
        // SAFETY: only asks the loader whether libnccl can be opened.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(NcclInitError::NoLibrary);
        }
        let streams: Vec<Arc<cudarc::driver::CudaStream>> = backends.iter().map(|b| b.main_stream().clone()).collect();
        let world = streams.len();
        let comms = Nccl::from_devices(streams).map_err(|e| NcclInitError::Init(format!("{e:?}")))?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, c)| NcclComm { rank, world, comm: Mutex::new(Owned(c)) })
            .collect())
    }

    fn nccl<R>(&self, f: impl FnOnce(&Nccl) -> R) -> R {
        f(&self.comm.lock().expect("an NCCL call panicked").0)
    }
}

impl Comm<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce(&self, _b: &CudaBackend, x: &mut CudaTensor) {
        // NCCL's ring/tree order is fixed for a given communicator and size: deterministic from
        // run to run, though not rank 0, 1, 2, … as the in-process communicator sums.
        ck(self.nccl(|c| c.all_reduce_in_place(x.data_mut(), &ReduceOp::Sum)), "ncclAllReduce");
    }
    fn all_gather_cols(&self, b: &CudaBackend, x: CudaTensor, total: usize) -> CudaTensor {
        let (rows, cols) = (x.rows, x.cols);
        assert_eq!(cols, split(total, self.world, self.rank).len(), "all_gather_cols: rank {} width", self.rank);
        // NCCL gathers equal counts: every rank sends `rows · widest` values (its own
        // `rows · cols` first), then each rank's block is copied into its columns.
        let widest = (0..self.world).map(|r| split(total, self.world, r).len()).max().unwrap_or(0);
        let chunk = rows * widest;
        let mut send = b.alloc::<f32>(chunk);
        if rows * cols > 0 {
            let mut head = send.slice_mut(0..rows * cols);
            ck(b.stream().memcpy_dtod(&x.data, &mut head), "gather staging copy");
        }
        let mut recv = b.alloc::<f32>(chunk * self.world);
        ck(self.nccl(|c| c.all_gather(&send, &mut recv)), "ncclAllGather");
        let mut out = b.tensor(rows, total);
        let (src, _read) = recv.device_ptr(b.stream());
        let (dst, _write) = out.data.device_ptr_mut(b.stream());
        for r in 0..self.world {
            let part = split(total, self.world, r);
            if rows == 0 || part.is_empty() {
                continue;
            }
            let f = std::mem::size_of::<f32>();
            // Every field spelled out: CUmemorytype has no zero value, so a zeroed descriptor
            // is not a valid value of this type (Rust refuses `mem::zeroed` for it).
            let d = CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: src + (r * chunk * f) as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: part.len() * f,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst + (part.start * f) as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: total * f,
                WidthInBytes: part.len() * f,
                Height: rows,
            };
            // SAFETY: source rows `r·chunk + i·width .. + width` lie inside `recv` (rank r sent
            // `rows · width ≤ chunk` values) and destination columns `part` of each of `rows`
            // rows lie inside `out`; both buffers outlive the copy (stream-ordered frees).
            let res = unsafe { cuMemcpy2DAsync_v2(&d, b.stream().cu_stream()) };
            assert_eq!(res, CUresult::CUDA_SUCCESS, "cuMemcpy2DAsync (gather columns of rank {r})");
        }
        drop((_read, _write));
        out
    }
}
