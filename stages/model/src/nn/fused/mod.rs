//! Fused ops with backward passes of their own, for the hot spots of a training step.
//!
//! Composed from candle ops, attention's softmax over `[heads, blocks x B, context + blocks x B]`
//! scores and the cross-entropy over `[rows, vocab]` logits each write and keep several
//! f32 intermediates of that size, and candle's backward adds a zero-filled buffer and an add
//! per intermediate: on an H200 that, not the matmuls, was most of the step. Here each is one
//! kernel forward and one backward that keeps only what the gradient needs (the probabilities;
//! the logits). AdamW's update is in-place kernels instead of a dozen allocating ones (on a GPU
//! one, over the gradient, both moments and the parameter);
//! SwiGLU's gate and RMSNorm's weight gradient are single passes too. Attention on a GPU is
//! flash attention ([`flash`]).
//!
//! Every op has a CPU implementation (used by CPU training and by the tests, which check it
//! against the composed ops and finite differences) and, with the `cuda` feature, CUDA kernels
//! (`kernels.cu`) for f32 and bf16; arithmetic is f32 on the GPU and f64 on the CPU. The
//! elementwise and row kernels move 16 bytes a thread where their operands are aligned and their
//! rows whole vectors (`load16`, `store16`; the `*_vec` row kernels), else an element a thread.
//!
//! | op | computes | CPU | CUDA | backward |
//! |---|---|---|---|---|
//! | `CrossEntropy` (`loss.rs`) | per row, logsumexp minus the label's logit | yes | `cross_entropy` | `CrossEntropyGrad` |
//! | `head_cross_entropy` (`head.rs`) | the LM head's matmul, cross-entropy and top-k in chunks of rows (logits never whole) | yes (composed) | `head_rows`: loss, argmax and gradient in one kernel (`DFLASH_HEAD_ROWS=separate`: the three kernels) | the rows' gradient, computed in the forward |
//! | `RmsNorm` (`norm.rs`) | RMSNorm times its weight | yes | `rms_norm` | `RmsNormGrad`, `RmsNormWeightGrad` |
//! | `Rope` (`norm.rs`) | rotate-half rotary embedding | yes | `rope` | itself, inverted |
//! | `MaskedSoftmax` (`softmax.rs`) | `softmax(scores * scale + mask)` | yes | `masked_softmax` | `SoftmaxGrad` |
//! | `Swiglu` (`swiglu.rs`) | `silu(g) * u` | yes | `swiglu` | `SwigluGrad` (gate, up) |
//! | `SumSquares`, `Moment`, `AdamStep` (`adamw.rs`) | gradient norm, AdamW in place | yes | `sum_squares`, `moment`, `adam_apply`; on a GPU `adamw_fused` in one launch | none |
//! | `adamw_update_master` (`adamw.rs`) | AdamW of f32 master weights from a bf16 gradient, writing the weights' bf16 copy (the written-out step's) | yes (cast, update, cast) | `adamw_master_bf16` | none |
//! | `SwigluPacked` (`swiglu.rs`) | `silu(g) * u` over rows `[g \| u]` (the frozen target's stacked gate and up) | yes | `swiglu_packed` | none (the target is frozen) |
//! | `AddRmsNorm` (`norm.rs`) | a residual's sum and the next RMSNorm, `[2, rows, n]` (the frozen target's layers on a GPU) | yes | `add_rms_norm` | none (the target is frozen) |
//! | `KeepAppend` (`copy.rs`) | a decoding cache's kept positions, then the next pass's keys or values | yes | `keep_append` | none (decoding) |
//! | `GatherRows` (`gather.rs`) | rows of a table by index (DFlash 2's codebooks) | yes | `gather_rows` | `ScatterAddRows` (atomic adds) |
//! | `TopK` (`topk.rs`) | the `k` largest entries' indices per row (DFlash 2's candidates) | yes | `top_k` | none (indices) |
//! | `CausalConvSilu` (`conv.rs`) | a Gated DeltaNet layer's causal depthwise convolution and SiLU, f32 out | yes | `causal_conv_silu` | none (the target is frozen) |
//! | `DeltaScan` (`scan.rs`) | the chunked Gated DeltaNet's pass over its chunks (the state carried across); checked, off the forward's path: 4.7 ms on an H100 where the matmuls per chunk take 2.9 | yes (the reference) | `delta_scan` | none (the target is frozen) |
//! | `Add` (`add.rs`) | `a + b`, contiguous operands of one shape (the written-out step's residuals and gradient sums) | yes (candle's add where it runs) | `add`, 16 bytes a thread | none (written-out step) |
//! | `StridedCopy3` (`copy.rs`) | a 3-D view (transposed, narrowed) made contiguous, its strides kernel arguments (candle uploads them before each copy) | yes | `strided_copy3` | none (decoding) |
//! | `ChunkDecay` (`scan.rs`) | each chunk's `[L, L]` decay matrix from its cumulative log-decays (the chunked Gated DeltaNet) | yes (the reference; the CPU path keeps the composed ops) | `chunk_decay` | none (the target is frozen) |
//! | `UnitLowerInverse` (`scan.rs`) | `(I + A)^-1` per 64 x 64 strictly lower A (the chunked Gated DeltaNet's WY inverse), forward substitution in shared memory | yes (the reference; the CPU path keeps the squarings) | `unit_lower_inverse` | none (the target is frozen) |
//! | `ScaleByHead` (`scan.rs`) | each head's elements times its scale (the Gated DeltaNet state times its chunk's decay, without a broadcast) | yes | `scale_by_head` | none (the target is frozen) |
//! | flash attention ([`flash`]) | causal and block attention | no (composed ops) | `flash.cu`, bf16 | its own kernels |
//! | `AttentionNode`, `LinearNode` (`nodes.rs`) | untracked forward, written-out backward | yes | yes | written out |
//!
//! **Adding an op**: its maths as a CPU function (`fn(inputs: CpuArg, ..) -> CpuStorage`), its
//! kernel in `kernels.cu` with a launch in `cuda.rs` (inputs as `view`s, outputs `fresh`, one
//! `launch!` with the kernel's arguments in order), and one `fused_op!` declaration tying them
//! to candle with its backward; then its test in `tests.rs` against the composed ops and
//! finite differences.

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

/// Declare a fused op: its struct (the op's settings) and candle's `CustomOp1/2/3` for it, from
/// the parts that are the op's own, so adding one is its maths, its kernels and its test:
///
/// ```ignore
/// fused_op! {
///     /// What it computes.
///     RmsNorm { eps: f64 } = "rms-norm", inputs(x, w);
///     cpu(op) => norm_cpu(op, x, w),            // x, w: (&CpuStorage, &Layout)
///     cuda(op) => norm_cuda(op, x, w),          // x, w: (&CudaStorage, &Layout)
///     bwd(op, y, dy) => { ... Ok((Some(dx), Some(dw))) }   // x, w: &Tensor (optional)
/// }
/// ```
///
/// `cpu` and `cuda` return the output's storage and shape; `bwd` (absent: no gradient) gets the
/// inputs, the output and its gradient, and returns the inputs' gradients. The CUDA arm is
/// compiled only with the `cuda` feature.
macro_rules! fused_op {
    (@struct $(#[$m:meta])* $op:ident { $($f:ident: $t:ty),* }) => {
        $(#[$m])*
        pub(crate) struct $op {
            $(pub(crate) $f: $t,)*
        }
    };
    (
        $(#[$m:meta])* $op:ident { $($f:ident: $t:ty),* $(,)? } = $name:literal, inputs($a:ident);
        cpu($c:ident) => $cpu:expr;
        cuda($g:ident) => $cuda:expr;
        $(bwd($b:ident, $out:ident, $grad:ident) => $bwd:expr;)?
    ) => {
        fused_op!(@struct $(#[$m])* $op { $($f: $t),* });
        impl candle_core::CustomOp1 for $op {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                s1: &candle_core::CpuStorage,
                l1: &candle_core::Layout,
            ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
                let ($c, $a) = (self, (s1, l1));
                $cpu
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                s1: &candle_core::CudaStorage,
                l1: &candle_core::Layout,
            ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
                let ($g, $a) = (self, (s1, l1));
                $cuda
            }
            $(
                #[allow(unused_variables)]
                fn bwd(
                    &self,
                    $a: &candle_core::Tensor,
                    $out: &candle_core::Tensor,
                    $grad: &candle_core::Tensor,
                ) -> Result<Option<candle_core::Tensor>> {
                    let $b = self;
                    $bwd
                }
            )?
        }
    };
    (
        $(#[$m:meta])* $op:ident { $($f:ident: $t:ty),* $(,)? } = $name:literal, inputs($a1:ident, $a2:ident);
        cpu($c:ident) => $cpu:expr;
        cuda($g:ident) => $cuda:expr;
        $(bwd($b:ident, $out:ident, $grad:ident) => $bwd:expr;)?
    ) => {
        fused_op!(@struct $(#[$m])* $op { $($f: $t),* });
        impl candle_core::CustomOp2 for $op {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                s1: &candle_core::CpuStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CpuStorage,
                l2: &candle_core::Layout,
            ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
                let ($c, $a1, $a2) = (self, (s1, l1), (s2, l2));
                $cpu
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                s1: &candle_core::CudaStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CudaStorage,
                l2: &candle_core::Layout,
            ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
                let ($g, $a1, $a2) = (self, (s1, l1), (s2, l2));
                $cuda
            }
            $(
                #[allow(unused_variables)]
                fn bwd(
                    &self,
                    $a1: &candle_core::Tensor,
                    $a2: &candle_core::Tensor,
                    $out: &candle_core::Tensor,
                    $grad: &candle_core::Tensor,
                ) -> Result<(Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
                    let $b = self;
                    $bwd
                }
            )?
        }
    };
    (
        $(#[$m:meta])* $op:ident { $($f:ident: $t:ty),* $(,)? } = $name:literal, inputs($a1:ident, $a2:ident, $a3:ident);
        cpu($c:ident) => $cpu:expr;
        cuda($g:ident) => $cuda:expr;
        $(bwd($b:ident, $out:ident, $grad:ident) => $bwd:expr;)?
    ) => {
        fused_op!(@struct $(#[$m])* $op { $($f: $t),* });
        impl candle_core::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                s1: &candle_core::CpuStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CpuStorage,
                l2: &candle_core::Layout,
                s3: &candle_core::CpuStorage,
                l3: &candle_core::Layout,
            ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
                let ($c, $a1, $a2, $a3) = (self, (s1, l1), (s2, l2), (s3, l3));
                $cpu
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                s1: &candle_core::CudaStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CudaStorage,
                l2: &candle_core::Layout,
                s3: &candle_core::CudaStorage,
                l3: &candle_core::Layout,
            ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
                let ($g, $a1, $a2, $a3) = (self, (s1, l1), (s2, l2), (s3, l3));
                $cuda
            }
            $(
                #[allow(clippy::type_complexity, unused_variables)]
                fn bwd(
                    &self,
                    $a1: &candle_core::Tensor,
                    $a2: &candle_core::Tensor,
                    $a3: &candle_core::Tensor,
                    $out: &candle_core::Tensor,
                    $grad: &candle_core::Tensor,
                ) -> Result<(
                    Option<candle_core::Tensor>,
                    Option<candle_core::Tensor>,
                    Option<candle_core::Tensor>,
                )> {
                    let $b = self;
                    $bwd
                }
            )?
        }
    };
}

/// A CPU tensor's storage and layout, as an op's input.
type CpuArg<'a> = (&'a CpuStorage, &'a Layout);

mod adamw;
mod add;
mod conv;
mod copy;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
pub mod flash;
mod gather;
mod head;
mod loss;
mod nodes;
mod norm;
mod scan;
mod softmax;
mod swiglu;
#[cfg(test)]
mod tests;
mod topk;

pub use adamw::{AdamStep, adamw_update, adamw_update_master, coin, round_stochastic, sum_squares};
pub use add::add;
pub use conv::causal_conv_silu;
pub use copy::{contiguous3, keep_append, strided_copy3};
pub use scan::{
    ChunkOperands, chunk_decay, chunk_decay_composed, chunk_decay_kernel, delta_scan,
    delta_scan_chunks, delta_scan_matmuls, lower_triangle, scale_by_head, scale_by_head_kernel,
    unit_lower_inverse, unit_lower_inverse_kernel, unit_lower_inverse_squarings,
};

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
/// The most memory the device's pool has handed out since the last call (bytes; every tensor
/// candle allocates comes from it: not the CUDA context, cuBLAS's workspace or kernels), and
/// the count starts again from what is in use now. `None` off a GPU.
pub fn pool_peak_bytes(device: &candle_core::Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        return cuda::pool_peak_bytes(dev).map(Some);
    }
    let _ = device;
    Ok(None)
}

pub use gather::gather_rows;
pub use head::{HeadLoss, head_cross_entropy, head_cross_entropy_rows, head_rows_in_place};
pub use loss::cross_entropy;
pub use nodes::linear;
pub(crate) use nodes::{Saved, attention_node};
pub use norm::{add_rms_norm, rms_norm, rms_norm_backward, rope, rope_backward};
pub use softmax::{masked_softmax, softmax_grad};
pub use swiglu::{swiglu, swiglu_backward, swiglu_packed};
pub use topk::{MAX_K as TOP_K_MAX, top_k};
