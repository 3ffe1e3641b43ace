//! A Gated DeltaNet layer's short causal convolution and its SiLU, one pass: output row t,
//! channel c is `silu(sum_j w[c, j] * x[t + j, c])` over the carried-then-new inputs. Composed,
//! that was a cast of the inputs to f32, a multiply and an add per tap and the SiLU, each a pass
//! over `[tokens, channels]` (16,384 channels at Qwen3.5-27B's widths). Forward only: the
//! target is frozen.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu};

/// `silu(conv(x, w))` `[m - k + 1, c]` (f32) of the inputs `x` `[m, c]` (the `k - 1` carried
/// rows, then the new ones) and the depthwise kernel `w` `[c, k]`, in f32 arithmetic whatever
/// `x`'s float dtype (`w` is taken in it).
pub fn causal_conv_silu(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, c) = x.dims2()?;
    let (wc, k) = w.dims2()?;
    if wc != c || k == 0 || m < k {
        bail!(
            "causal_conv_silu: inputs {:?} and kernel {:?}",
            x.dims(),
            w.dims()
        );
    }
    let w = w.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?.apply_op2_no_bwd(&w, &CausalConvSilu { k })
}

fused_op! {
    /// `silu(sum_j w[:, j] * x[t + j])` per output row t, in f32.
    CausalConvSilu { k: usize } = "causal-conv-silu", inputs(x, w);
    cpu(op) => {
        let (m, c) = super::rows(x.1);
        Ok((conv_cpu(x, w, op.k)?, (m - op.k + 1, c).into()))
    };
    cuda(op) => {
        let (m, c) = super::rows(x.1);
        Ok((super::cuda::causal_conv_silu(x, w, op.k)?, (m - op.k + 1, c).into()))
    };
}

fn conv_cpu(x: CpuArg<'_>, w: CpuArg<'_>, k: usize) -> Result<CpuStorage> {
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        k: usize,
    ) -> Result<CpuStorage> {
        let (x, w) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        let (m, c) = super::rows(l1);
        let out: Vec<f32> = (0..(m - k + 1) * c)
            .into_par_iter()
            .map(|i| {
                let (t, ch) = (i / c, i % c);
                let a: f64 = (0..k)
                    .map(|j| w[ch * k + j].to_f64() * x[(t + j) * c + ch].to_f64())
                    .sum();
                (a / (1.0 + (-a).exp())) as f32
            })
            .collect();
        Ok(CpuStorage::F32(out))
    }
    by_float!(x.0.dtype(), "causal-conv-silu", go(x, w, k))
}
