//! DeepSeek V4 model description: configuration (HF and official layouts), checkpoint storage
//! (safetensors with FP8/FP4), and the logical weight layout. No compute lives here.

pub mod config;
pub mod gguf;
pub mod gguf_config;
pub mod gguf_write;
pub mod packed;
pub mod quant;
pub mod shard;
pub mod store;
pub mod synth;
pub mod weights;

pub use config::{AttnKind, Config, ConfigError, LayerSpec, Layout, Yarn};
pub use packed::{Packed, PackedFormat};
pub use shard::{Part, Shard};
pub use store::{DType, LoadError, TensorInfo, TensorStore};
pub use weights::{
    load_weights, load_weights_from, load_weights_with, Checkpoint, Component, HostTensor, LoadOptions, MemoryStats,
    Source, Weights,
};
