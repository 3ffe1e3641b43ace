//! Attention's scale + mask + softmax over the last dimension, and its gradient.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu, rows};

/// `softmax(scores * scale + mask)` over the last dimension. `scores`: `[.., nq, nk]`;
/// `mask`: additive `[nq, nk]` (0 or -inf), the same for every leading index. A row masked
/// everywhere gives zeros. Differentiable in `scores`.
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    let (nq, nk) = mask.dims2()?;
    if dims.len() < 2 || dims[dims.len() - 2..] != [nq, nk] {
        bail!("masked_softmax: scores {dims:?} do not end in the mask's [{nq}, {nk}]");
    }
    let mask = mask.to_dtype(scores.dtype())?.contiguous()?;
    scores
        .contiguous()?
        .apply_op2(&mask, MaskedSoftmax { scale })
}

/// `scale * p * (dp - sum(dp * p))` per row: the gradient of the scores of a
/// [`masked_softmax`] given its output `p` and the output's gradient `dp` (not tracked).
pub fn softmax_grad(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    p.contiguous()?
        .apply_op2_no_bwd(&dp.contiguous()?, &SoftmaxGrad { scale })
}

fused_op! {
    /// `softmax(scores * scale + mask)` per row.
    MaskedSoftmax { scale: f64 } = "masked-softmax", inputs(scores, mask);
    cpu(op) => Ok((masked_softmax_cpu(scores, mask, op.scale)?, scores.1.shape().clone()));
    cuda(op) => Ok((
        super::cuda::masked_softmax(scores, mask, op.scale as f32)?,
        scores.1.shape().clone(),
    ));
    bwd(op, probs, grad) => {
        let g = probs.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad { scale: op.scale })?;
        Ok((Some(g), None))
    };
}

fused_op! {
    /// The softmax's input gradient from its output and the output's gradient.
    SoftmaxGrad { scale: f64 } = "masked-softmax-grad", inputs(p, dp);
    cpu(op) => Ok((softmax_grad_cpu(p, dp, op.scale)?, p.1.shape().clone()));
    cuda(op) => Ok((super::cuda::softmax_grad(p, dp, op.scale as f32)?, p.1.shape().clone()));
}

fn softmax_rows<T: WithDType>(x: &[T], mask: &[T], n: usize, nq: usize, scale: f64) -> CpuStorage {
    let mut out = vec![T::from_f64(0.0); x.len()];
    out.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .enumerate()
        .for_each(|(r, (y, x))| {
            let m = &mask[(r % nq) * n..(r % nq + 1) * n];
            let z = |j: usize| x[j].to_f64() * scale + m[j].to_f64();
            let max = (0..n).map(z).fold(f64::NEG_INFINITY, f64::max);
            if max == f64::NEG_INFINITY {
                return;
            }
            let sum: f64 = (0..n).map(|j| (z(j) - max).exp()).sum();
            for (j, y) in y.iter_mut().enumerate() {
                *y = T::from_f64((z(j) - max).exp() / sum);
            }
        });
    T::to_cpu_storage_owned(out)
}

fn masked_softmax_cpu(
    (s1, l1): CpuArg<'_>,
    (s2, l2): CpuArg<'_>,
    scale: f64,
) -> Result<CpuStorage> {
    let (_, n) = rows(l1);
    let nq = l2.dims()[0];
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        n: usize,
        nq: usize,
        scale: f64,
    ) -> Result<CpuStorage> {
        Ok(softmax_rows(
            cpu::<T>(s1, l1)?,
            cpu::<T>(s2, l2)?,
            n,
            nq,
            scale,
        ))
    }
    by_float!(
        s1.dtype(),
        "masked-softmax",
        go((s1, l1), (s2, l2), n, nq, scale)
    )
}

fn softmax_grad_cpu((s1, l1): CpuArg<'_>, (s2, l2): CpuArg<'_>, scale: f64) -> Result<CpuStorage> {
    let (_, n) = rows(l1);
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        n: usize,
        scale: f64,
    ) -> Result<CpuStorage> {
        let (p, dp) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        let mut out = vec![T::from_f64(0.0); p.len()];
        out.par_chunks_mut(n)
            .zip(p.par_chunks(n).zip(dp.par_chunks(n)))
            .for_each(|(ds, (p, dp))| {
                let dot: f64 = p.iter().zip(dp).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                for ((ds, p), dp) in ds.iter_mut().zip(p).zip(dp) {
                    *ds = T::from_f64(scale * p.to_f64() * (dp.to_f64() - dot));
                }
            });
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(
        s1.dtype(),
        "masked-softmax-grad",
        go((s1, l1), (s2, l2), n, scale)
    )
}
