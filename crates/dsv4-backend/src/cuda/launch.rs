//! Kernel launches with programmatic dependent launch (PDL, Hopper).
//!
//! A decode step is ~1,700 small dependent kernels; between two of them the GPU drains one grid,
//! flushes it and only then schedules the next. With PDL (`cuLaunchKernelEx` with
//! `PROGRAMMATIC_STREAM_SERIALIZATION`, kept by stream capture as a programmatic graph edge) the
//! next grid's blocks are scheduled while the current one runs and wait in `griddepcontrol.wait`
//! (`pdl_enter` in `common.cuh`, the first statement of every kernel here) until it has completed
//! and its writes are visible. Every block waits before it touches memory, so the chain stays
//! transitive and no kernel reads or overwrites what an earlier one still uses.
//! `DSV4_PDL=0` launches without the attribute (the A/B switch; `pdl_enter` is then a no-op).
//!
//! [`Kernel::kernel`] is a drop-in for cudarc's `launch_builder`: the same `arg` / `launch`
//! chain, each argument copied into an 8-byte slot when it is pushed (a larger by-value struct
//! through [`Launch::arg_struct`]).

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DriverError, LaunchConfig,
};
use std::sync::OnceLock;

/// Most arguments a kernel here takes (`attention` has 27; `tests/kernel_sources.rs` checks
/// every kernel's parameter count against this).
const MAX_ARGS: usize = 32;

/// Whether launches carry the PDL attribute (`DSV4_PDL`, on unless `0`).
pub(crate) fn pdl_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_PDL").map(|v| v != "0").unwrap_or(true))
}

/// A kernel launch being built: the function, its stream and its argument values.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    slots: [u64; MAX_ARGS],
    /// Parameters passed by address instead of through a slot (structs wider than 8 bytes).
    structs: [Option<&'a [u8]>; MAX_ARGS],
    n: usize,
}

/// A `#[repr(C)]` value a kernel takes by value as one parameter, laid out as its C struct.
///
/// # Safety
/// The type must be `#[repr(C)]`, `Copy`, hold no padding bytes the kernel reads, and match
/// the kernel parameter's C layout field for field.
pub(crate) unsafe trait KernelStruct: Copy {}

/// `stream.kernel(f)`: starts a [`Launch`] of `f` on the stream.
pub(crate) trait Kernel {
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a>;
}

impl Kernel for CudaStream {
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch { stream: self, func, slots: [0; MAX_ARGS], structs: [None; MAX_ARGS], n: 0 }
    }
}

/// A value a kernel parameter takes: its bytes, at most 8, in the slot's low bytes.
pub(crate) trait KernelArg {
    fn word(self, stream: &CudaStream) -> u64;
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for &$t {
            fn word(self, _: &CudaStream) -> u64 {
                let mut w = [0u8; 8];
                let b = self.to_ne_bytes();
                w[..b.len()].copy_from_slice(&b);
                u64::from_ne_bytes(w)
            }
        }
    )*};
}
scalar_arg!(i32, u32, i64, u64, f32);

impl<T> KernelArg for &CudaSlice<T> {
    fn word(self, stream: &CudaStream) -> u64 {
        // Event tracking is off (CudaBackend::new), so the guard records nothing.
        self.device_ptr(stream).0
    }
}

impl<T> KernelArg for &mut CudaSlice<T> {
    fn word(self, stream: &CudaStream) -> u64 {
        self.device_ptr_mut(stream).0
    }
}

impl<T> KernelArg for &CudaView<'_, T> {
    fn word(self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<'a> Launch<'a> {
    /// Pushes the next kernel argument (in the kernel's parameter order).
    pub(crate) fn arg<A: KernelArg>(&mut self, a: A) -> &mut Self {
        assert!(self.n < MAX_ARGS, "a kernel launch takes at most {MAX_ARGS} arguments");
        self.slots[self.n] = a.word(self.stream);
        self.n += 1;
        self
    }

    /// Pushes a by-value struct parameter (its bytes are read when the kernel is queued).
    /// A packed product's weight and shape arguments in the order every product kernel takes
    /// them after its activations: codes, heads, then n, k, m, ldx and rows a group as i32.
    pub(crate) fn product_args(
        &mut self,
        codes: &CudaSlice<u8>,
        heads: &CudaSlice<u8>,
        shape: [usize; 5],
    ) -> &mut Self {
        self.arg(codes).arg(heads);
        for v in shape {
            self.arg(&(v as i32));
        }
        self
    }

    pub(crate) fn arg_struct<S: KernelStruct>(&mut self, s: &'a S) -> &mut Self {
        assert!(self.n < MAX_ARGS, "a kernel launch takes at most {MAX_ARGS} arguments");
        // SAFETY: `S` is plain `#[repr(C)]` data (KernelStruct's contract); the slice covers
        // exactly its bytes and lives as long as the launch being built.
        let bytes = unsafe { std::slice::from_raw_parts(s as *const S as *const u8, std::mem::size_of::<S>()) };
        self.structs[self.n] = Some(bytes);
        self.n += 1;
        self
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// buffer must stay allocated until the kernel has run (stream-ordered frees do).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: [*mut std::ffi::c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
        for (i, (p, s)) in params.iter_mut().zip(self.slots.iter_mut()).take(self.n).enumerate() {
            *p = match self.structs[i] {
                Some(b) => b.as_ptr() as *mut std::ffi::c_void,
                None => s as *mut u64 as *mut std::ffi::c_void,
            };
        }
        // SAFETY: an all-zero CUlaunchAttribute is a valid value of the C struct (a union of
        // plain integers); the one field the driver reads for this id is set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl_on()),
        };
        // SAFETY: `params` points at `self.n` live slots or structs, one a parameter, each
        // holding the parameter's bytes (the caller vouches for their types); the driver only
        // reads through the pointers; `config` and `attr` outlive
        // the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
    }
}
