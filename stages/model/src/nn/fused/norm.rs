//! RMSNorm and the rotate-half rotary embedding, with their gradients.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu, rows};

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension (`weight`: `[n]`).
/// Differentiable in both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let n = x.dim(candle_core::D::Minus1)?;
    if weight.dims() != [n] {
        bail!("rms_norm: weight {:?} for rows of {n}", weight.dims());
    }
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?.apply_op2(&weight, RmsNorm { eps })
}

/// [`rms_norm`]'s gradients in `x` and `weight` from its output's, `(dx, dw)` (`dw` in `x`'s
/// dtype, as `rms_norm` casts the weight): for a step whose backward is written out.
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    rms_norm_grads(&x.contiguous()?, &weight, dy, eps)
}

/// The gradients of `RmsNorm` over contiguous `x` and `w` (of one dtype).
fn rms_norm_grads(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let dy = dy.contiguous()?;
    let dx = x.apply_op3_no_bwd(w, &dy, &RmsNormGrad { eps })?;
    // dw = sum over rows of dy * x * rstd, in partial sums over ranges of rows (a column
    // reduction over every row, which candle's strided sum does slowly).
    let dw = x
        .apply_op2_no_bwd(&dy, &RmsNormWeightGrad { eps })?
        .sum(0)?
        .to_dtype(w.dtype())?;
    Ok((dx, dw))
}

/// A residual's sum `x + r` and its RMSNorm times `weight`, in one pass over the rows (a frozen
/// target's layers, where each residual add is followed by the next norm): `(sum, normed)`.
/// Forward only; `x`, `r` `[rows, n]` of one dtype.
pub fn add_rms_norm(x: &Tensor, r: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (count, n) = x.dims2()?;
    if r.dims() != [count, n] || r.dtype() != x.dtype() || weight.dims() != [n] {
        bail!(
            "add_rms_norm: x {:?} {:?}, r {:?} {:?}, weight {:?}",
            x.dims(),
            x.dtype(),
            r.dims(),
            r.dtype(),
            weight.dims()
        );
    }
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    let both = x
        .contiguous()?
        .apply_op3_no_bwd(&r.contiguous()?, &weight, &AddRmsNorm { eps })?
        .reshape((2, count, n))?;
    Ok((both.get(0)?, both.get(1)?))
}

fused_op! {
    /// A residual's sum and its RMSNorm, `[2 * rows * n]`: the sums, then the normed rows.
    AddRmsNorm { eps: f64 } = "add-rms-norm", inputs(x, r, w);
    cpu(op) => Ok((add_rms_norm_cpu(x, r, w, op.eps)?, (2 * x.1.shape().elem_count(),).into()));
    cuda(op) => Ok((
        super::cuda::add_rms_norm(x, r, w, op.eps as f32)?,
        (2 * x.1.shape().elem_count(),).into(),
    ));
}

/// The kernel's arithmetic: the sum rounded to `T`, its norm in f64.
fn add_rms_norm_cpu(x: CpuArg<'_>, r: CpuArg<'_>, w: CpuArg<'_>, eps: f64) -> Result<CpuStorage> {
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        (s3, l3): CpuArg<'_>,
        eps: f64,
    ) -> Result<CpuStorage> {
        let (x, r, w) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
        let n = w.len();
        let sums: Vec<T> = x
            .iter()
            .zip(r)
            .map(|(a, b)| T::from_f64(a.to_f64() + b.to_f64()))
            .collect();
        let normed: Vec<T> = sums
            .par_chunks(n)
            .flat_map_iter(|row| {
                let ms = row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / n as f64;
                let rs = 1.0 / (ms + eps).sqrt();
                row.iter()
                    .zip(w)
                    .map(move |(v, g)| T::from_f64(v.to_f64() * rs * g.to_f64()))
            })
            .collect();
        let mut out = sums;
        out.extend(normed);
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(x.0.dtype(), "add-rms-norm", go(x, r, w, eps))
}

/// The rotate-half ("neox", Hugging Face) rotary embedding of `x` `[.., n, d]` by `cos`, `sin`
/// `[n, d / 2]`. Differentiable in `x`: the gradient is the inverse rotation.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let (n, half) = cos.dims2()?;
    if dims.len() < 2 || dims[dims.len() - 2..] != [n, 2 * half] || sin.dims() != [n, half] {
        bail!(
            "rope: x {dims:?} with tables {:?} / {:?}",
            cos.dims(),
            sin.dims()
        );
    }
    let (cos, sin) = (
        cos.to_dtype(x.dtype())?.contiguous()?,
        sin.to_dtype(x.dtype())?.contiguous()?,
    );
    x.contiguous()?.apply_op3(&cos, &sin, Rope { sign: 1.0 })
}

/// [`rope`]'s gradient in `x` from its output's: the inverse rotation.
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (
        cos.to_dtype(dy.dtype())?.contiguous()?,
        sin.to_dtype(dy.dtype())?.contiguous()?,
    );
    dy.contiguous()?
        .apply_op3_no_bwd(&cos, &sin, &Rope { sign: -1.0 })
}

fused_op! {
    /// RMSNorm over the last dimension, times the weight.
    RmsNorm { eps: f64 } = "rms-norm", inputs(x, w);
    cpu(op) => Ok((rms_norm_cpu(x, w, op.eps)?, x.1.shape().clone()));
    cuda(op) => Ok((super::cuda::rms_norm(x, w, op.eps as f32)?, x.1.shape().clone()));
    bwd(op, _y, dy) => {
        let (dx, dw) = rms_norm_grads(x, w, dy, op.eps)?;
        Ok((Some(dx), Some(dw)))
    };
}

fused_op! {
    /// RMSNorm's weight gradient from `x` and `dy` as `[ranges, n]` partial sums over ranges of
    /// rows, in the wide dtype ([`crate::nn::ops::wide`]); their sum over ranges is the gradient.
    RmsNormWeightGrad { eps: f64 } = "rms-norm-weight-grad", inputs(x, dy);
    cpu(op) => rms_norm_dw_cpu(x, dy, op.eps);
    cuda(op) => {
        let (partial, ranges) = super::cuda::rms_norm_dw(x, dy, op.eps as f32)?;
        Ok((partial, Shape::from((ranges, rows(x.1).1))))
    };
}

fused_op! {
    /// RMSNorm's input gradient.
    RmsNormGrad { eps: f64 } = "rms-norm-grad", inputs(x, w, dy);
    cpu(op) => Ok((rms_norm_grad_cpu(x, w, dy, op.eps)?, x.1.shape().clone()));
    cuda(op) => Ok((
        super::cuda::rms_norm_grad(x, w, dy, op.eps as f32)?,
        x.1.shape().clone(),
    ));
}

fused_op! {
    /// The rotate-half rotary embedding; `sign` -1 is the inverse rotation (its gradient).
    Rope { sign: f64 } = "rope", inputs(x, cos, sin);
    cpu(op) => Ok((rope_cpu(x, cos, sin, op.sign)?, x.1.shape().clone()));
    cuda(op) => Ok((super::cuda::rope(x, cos, sin, op.sign as f32)?, x.1.shape().clone()));
    bwd(op, _y, dy) => {
        let back = Rope { sign: -op.sign };
        Ok((Some(dy.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?), None, None))
    };
}

/// Rows per partial sum on CPU: fixed, so the sums' order (and the result) never varies.
const CPU_ROWS_PER_RANGE: usize = 64;

/// `1 / sqrt(mean(x^2) + eps)` of a row, in f64.
fn rstd<T: WithDType>(x: &[T], eps: f64) -> f64 {
    let ms = x.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / x.len() as f64;
    1.0 / (ms + eps).sqrt()
}

fn rms_norm_cpu((s1, l1): CpuArg<'_>, (s2, l2): CpuArg<'_>, eps: f64) -> Result<CpuStorage> {
    let (_, n) = rows(l1);
    fn go<T: WithDType>(
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        n: usize,
        eps: f64,
    ) -> Result<CpuStorage> {
        let (x, w) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        let mut out = vec![T::from_f64(0.0); x.len()];
        out.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .for_each(|(y, x)| {
                let r = rstd(x, eps);
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = T::from_f64(x.to_f64() * r * w.to_f64());
                }
            });
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(s1.dtype(), "rms-norm", go(s1, l1, s2, l2, n, eps))
}

fn rms_norm_dw_cpu(
    (s1, l1): CpuArg<'_>,
    (s2, l2): CpuArg<'_>,
    eps: f64,
) -> Result<(CpuStorage, Shape)> {
    let (_, n) = rows(l1);
    fn go<T: WithDType>(
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        n: usize,
        eps: f64,
    ) -> Result<Vec<f64>> {
        let (x, dy) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        let parts: Vec<Vec<f64>> = x
            .par_chunks(n * CPU_ROWS_PER_RANGE)
            .zip(dy.par_chunks(n * CPU_ROWS_PER_RANGE))
            .map(|(x, dy)| {
                let mut acc = vec![0.0; n];
                for (x, dy) in x.chunks(n).zip(dy.chunks(n)) {
                    let r = rstd(x, eps);
                    for (a, (x, dy)) in acc.iter_mut().zip(x.iter().zip(dy)) {
                        *a += dy.to_f64() * x.to_f64() * r;
                    }
                }
                acc
            })
            .collect();
        Ok(parts.concat())
    }
    let flat = by_float!(
        s1.dtype(),
        "rms-norm-weight-grad",
        go(s1, l1, s2, l2, n, eps)
    )?;
    let ranges = flat.len() / n.max(1);
    let out = if s1.dtype() == DType::F64 {
        CpuStorage::F64(flat)
    } else {
        CpuStorage::F32(flat.into_iter().map(|v| v as f32).collect())
    };
    Ok((out, Shape::from((ranges, n))))
}

fn rms_norm_grad_cpu(x: CpuArg<'_>, w: CpuArg<'_>, dy: CpuArg<'_>, eps: f64) -> Result<CpuStorage> {
    let (_, n) = rows(x.1);
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        (s3, l3): CpuArg<'_>,
        n: usize,
        eps: f64,
    ) -> Result<CpuStorage> {
        let (x, w, dy) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
        let mut out = vec![T::from_f64(0.0); x.len()];
        out.par_chunks_mut(n)
            .zip(x.par_chunks(n).zip(dy.par_chunks(n)))
            .for_each(|(dx, (x, dy))| {
                let r = rstd(x, eps);
                let dot: f64 = (0..n)
                    .map(|j| dy[j].to_f64() * w[j].to_f64() * x[j].to_f64())
                    .sum();
                let c = dot / n as f64 * r * r * r;
                for (j, dx) in dx.iter_mut().enumerate() {
                    *dx = T::from_f64(r * dy[j].to_f64() * w[j].to_f64() - x[j].to_f64() * c);
                }
            });
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(x.0.dtype(), "rms-norm-grad", go(x, w, dy, n, eps))
}

fn rope_cpu(x: CpuArg<'_>, cos: CpuArg<'_>, sin: CpuArg<'_>, sign: f64) -> Result<CpuStorage> {
    let dims = x.1.dims();
    let (n, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        (s3, l3): CpuArg<'_>,
        n: usize,
        d: usize,
        sign: f64,
    ) -> Result<CpuStorage> {
        let (x, cos, sin) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
        let half = d / 2;
        let mut out = vec![T::from_f64(0.0); x.len()];
        out.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .enumerate()
            .for_each(|(row, (y, x))| {
                let t = row % n;
                for k in 0..half {
                    let c = cos[t * half + k].to_f64();
                    let s = sign * sin[t * half + k].to_f64();
                    let (a, b) = (x[k].to_f64(), x[k + half].to_f64());
                    y[k] = T::from_f64(a * c - b * s);
                    y[k + half] = T::from_f64(b * c + a * s);
                }
            });
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(x.0.dtype(), "rope", go(x, cos, sin, n, d, sign))
}
