//! Attention's scale + mask + softmax over the last dimension, and its gradient.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{Result, cpu, rows};

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

struct MaskedSoftmax {
    scale: f64,
}

struct SoftmaxGrad {
    scale: f64,
}

fn softmax_cpu<T: WithDType>(x: &[T], mask: &[T], n: usize, nq: usize, scale: f64) -> CpuStorage {
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

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        let nq = l2.dims()[0];
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            n: usize,
            nq: usize,
            scale: f64,
        ) -> Result<CpuStorage> {
            Ok(softmax_cpu(
                cpu::<T>(s1, l1)?,
                cpu::<T>(s2, l2)?,
                n,
                nq,
                scale,
            ))
        }
        let out = by_float!(
            s1.dtype(),
            self.name(),
            go(s1, l1, s2, l2, n, nq, self.scale)
        )?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::masked_softmax(s1, l1, s2, l2, self.scale as f32)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        probs: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = probs.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad { scale: self.scale })?;
        Ok((Some(g), None))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "masked-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
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
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, s2, l2, n, self.scale))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::softmax_grad(s1, l1, s2, l2, self.scale as f32)?;
        Ok((out, l1.shape().clone()))
    }
}
