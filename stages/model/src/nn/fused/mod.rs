//! Fused ops with backward passes of their own, for the hot spots of a training step.
//!
//! Composed from candle ops, attention's softmax over `[heads, blocks x B, context + blocks x B]`
//! scores and the cross-entropy over `[rows, vocab]` logits each write and keep several
//! f32 intermediates of that size, and candle's backward adds a zero-filled buffer and an add
//! per intermediate: on an H200 that, not the matmuls, was most of the step. Here each is one
//! kernel forward and one backward that keeps only what the gradient needs (the probabilities;
//! the logits). AdamW's update is two in-place kernels instead of a dozen allocating ones;
//! SwiGLU's gate and RMSNorm's weight gradient are single passes too. Attention on a GPU is
//! flash attention ([`flash`]).
//!
//! Every op has a CPU implementation (used by CPU training and by the tests, which check it
//! against the composed ops and finite differences) and, with the `cuda` feature, CUDA kernels
//! (`kernels.cu`) for f32 and bf16; arithmetic is f32 on the GPU and f64 on the CPU.

use candle_core::{CpuStorage, Layout, WithDType};

use super::Result;

/// The contiguous elements of a CPU tensor.
fn cpu<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: a non-contiguous input".into()))?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The range of a contiguous tensor's elements in its storage.
fn span(l: &Layout) -> Result<std::ops::Range<usize>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: a non-contiguous input".into()))?;
    Ok(a..b)
}

/// The last dimension and the count of rows before it.
fn rows(l: &Layout) -> (usize, usize) {
    let n = l.dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / n.max(1), n)
}

/// Run `$f::<T>` for the float dtype `$dtype`, else fail naming `$what`.
macro_rules! by_float {
    ($dtype:expr, $what:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            d => bail!("{}: {d:?} is not a float type", $what),
        }
    };
}

mod adamw;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
pub mod flash;
mod loss;
mod nodes;
mod norm;
mod softmax;
mod swiglu;
#[cfg(test)]
mod tests;

pub use adamw::{AdamStep, adamw_update, sum_squares};

/// Set a device up for training and decoding before anything is allocated on it: on a GPU, the
/// memory pool keeps freed memory for reuse and buffers are not tracked with events (one
/// stream); nothing on CPU.
pub fn prepare_device(device: &candle_core::Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        return cuda::prepare(dev);
    }
    let _ = device;
    Ok(())
}
pub use loss::cross_entropy;
pub use nodes::linear;
pub(crate) use nodes::{Saved, attention_node};
pub use norm::{rms_norm, rope};
pub use softmax::{masked_softmax, softmax_grad};
pub use swiglu::swiglu;
