//! The cross-entropy over the vocabulary, per row, and its gradient.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType, bail,
};
use rayon::prelude::*;

use super::{Result, cpu, rows};

/// Per row of `logits` `[m, vocab]`: `logsumexp(row) - row[label]`, `[m]` in f32 (f64 for f64
/// logits). Differentiable in `logits`.
pub fn cross_entropy(logits: &Tensor, labels: &[u32]) -> Result<Tensor> {
    let (m, vocab) = logits.dims2()?;
    if labels.len() != m {
        bail!("cross_entropy: {m} rows of logits, {} labels", labels.len());
    }
    if let Some(bad) = labels.iter().find(|&&y| y as usize >= vocab) {
        bail!("cross_entropy: label {bad} is past the vocabulary of {vocab}");
    }
    let labels = Tensor::new(labels, logits.device())?;
    logits.contiguous()?.apply_op2(&labels, CrossEntropy)
}

struct CrossEntropy;

struct CrossEntropyGrad;

/// The dtype cross-entropy losses come out in.
fn loss_dtype(logits: DType) -> DType {
    if logits == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The log-sum-exp of a row, in f64.
fn lse<T: WithDType>(z: &[T]) -> f64 {
    let max = z
        .iter()
        .map(|v| v.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    max + z.iter().map(|v| (v.to_f64() - max).exp()).sum::<f64>().ln()
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n) = rows(l1);
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            labels: &[u32],
            n: usize,
        ) -> Result<Vec<f64>> {
            let z = cpu::<T>(s1, l1)?;
            Ok(z.par_chunks(n)
                .zip(labels.par_iter())
                .map(|(z, &y)| lse(z) - z[y as usize].to_f64())
                .collect())
        }
        let labels = cpu::<u32>(s2, l2)?;
        let nll = by_float!(s1.dtype(), self.name(), go(s1, l1, labels, n))?;
        let out = match loss_dtype(s1.dtype()) {
            DType::F64 => CpuStorage::F64(nll),
            _ => CpuStorage::F32(nll.into_iter().map(|v| v as f32).collect()),
        };
        Ok((out, Shape::from(m)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, _) = rows(l1);
        Ok((super::cuda::cross_entropy(s1, l1, s2, l2)?, Shape::from(m)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(loss_dtype(logits.dtype()))?.contiguous()?;
        let g = logits.apply_op3_no_bwd(labels, &grad, &CrossEntropyGrad)?;
        Ok((Some(g), None))
    }
}

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            labels: &[u32],
            g: &[f64],
            n: usize,
        ) -> Result<CpuStorage> {
            let z = cpu::<T>(s1, l1)?;
            let mut out = vec![T::from_f64(0.0); z.len()];
            out.par_chunks_mut(n)
                .zip(z.par_chunks(n))
                .zip(labels.par_iter().zip(g.par_iter()))
                .for_each(|((dz, z), (&y, &g))| {
                    let lse = lse(z);
                    for (j, (dz, z)) in dz.iter_mut().zip(z).enumerate() {
                        let onehot = if j == y as usize { 1.0 } else { 0.0 };
                        *dz = T::from_f64(g * ((z.to_f64() - lse).exp() - onehot));
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        let labels = cpu::<u32>(s2, l2)?;
        let g: Vec<f64> = match s3 {
            CpuStorage::F64(_) => cpu::<f64>(s3, l3)?.to_vec(),
            _ => cpu::<f32>(s3, l3)?.iter().map(|&v| f64::from(v)).collect(),
        };
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, labels, &g, n))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            super::cuda::cross_entropy_grad(s1, l1, s2, l2, s3, l3)?,
            l1.shape().clone(),
        ))
    }
}
