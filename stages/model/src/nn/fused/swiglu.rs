//! SwiGLU's gate, `silu(g) * u`, and its gradients: one pass each instead of candle's sigmoid,
//! multiplications and their backward ops over `[rows, ffn]` (the MLP's widest tensors).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu};

/// `silu(g) * u` elementwise (`g`, `u` of one shape). Differentiable in both.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dims() != u.dims() || g.dtype() != u.dtype() {
        bail!(
            "swiglu: gate {:?} {:?} and up {:?} {:?}",
            g.dims(),
            g.dtype(),
            u.dims(),
            u.dtype()
        );
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, Swiglu {})
}

/// [`swiglu`]'s gradients in the gate and up rows (contiguous, of one shape) from its
/// output's: `(dg, du)`.
pub fn swiglu_backward(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor)> {
    let dh = dh.contiguous()?;
    let dg = g.apply_op3_no_bwd(u, &dh, &SwigluGrad { up: false })?;
    let du = g.apply_op3_no_bwd(u, &dh, &SwigluGrad { up: true })?;
    Ok((dg, du))
}

fused_op! {
    /// `silu(g) * u` elementwise.
    Swiglu {} = "swiglu", inputs(g, u);
    cpu(_op) => Ok((swiglu_cpu(g, u)?, g.1.shape().clone()));
    cuda(_op) => Ok((super::cuda::swiglu(g, u)?, g.1.shape().clone()));
    bwd(_op, _h, dh) => {
        let (dg, du) = swiglu_backward(g, u, dh)?;
        Ok((Some(dg), Some(du)))
    };
}

/// `silu(g) * u` for rows `gu` `[rows, 2f]` that hold the gate's `f` outputs then the up
/// projection's (one matmul over the two weights stacked, a frozen target's MLP): `[rows, f]`.
/// Forward only.
pub fn swiglu_packed(gu: &Tensor) -> Result<Tensor> {
    let (rows, both) = gu.dims2()?;
    if both % 2 != 0 {
        bail!("swiglu-packed: rows of {both}, not a gate and an up half");
    }
    gu.contiguous()?
        .apply_op1_no_bwd(&SwigluPacked { f: both / 2 })?
        .reshape((rows, both / 2))
}

fused_op! {
    /// `silu(g) * u` over rows `[g | u]`.
    SwigluPacked { f: usize } = "swiglu-packed", inputs(gu);
    cpu(op) => Ok((swiglu_packed_cpu(gu, op.f)?, (gu.1.shape().elem_count() / 2,).into()));
    cuda(op) => Ok((
        super::cuda::swiglu_packed(gu, op.f)?,
        (gu.1.shape().elem_count() / 2,).into(),
    ));
}

fn swiglu_packed_cpu(gu: CpuArg<'_>, f: usize) -> Result<CpuStorage> {
    fn go<T: WithDType>((s, l): CpuArg<'_>, f: usize) -> Result<CpuStorage> {
        let gu = cpu::<T>(s, l)?;
        let out: Vec<T> = gu
            .par_chunks(2 * f)
            .flat_map_iter(|row| {
                let (g, u) = row.split_at(f);
                g.iter()
                    .zip(u)
                    .map(|(g, u)| T::from_f64(silu_parts(g.to_f64()).0 * u.to_f64()))
            })
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(gu.0.dtype(), "swiglu-packed", go(gu, f))
}

fused_op! {
    /// The gradient of the gate input (`up: false`) or of the up input, given the output's.
    SwigluGrad { up: bool } = "swiglu-grad", inputs(g, u, dh);
    cpu(op) => Ok((swiglu_grad_cpu(g, u, dh, op.up)?, g.1.shape().clone()));
    cuda(op) => Ok((
        super::cuda::swiglu_grad(g, u, dh, i32::from(op.up))?,
        g.1.shape().clone(),
    ));
}

fn silu_parts(a: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-a).exp());
    (a * s, s)
}

fn swiglu_cpu(g: CpuArg<'_>, u: CpuArg<'_>) -> Result<CpuStorage> {
    fn go<T: WithDType>((s1, l1): CpuArg<'_>, (s2, l2): CpuArg<'_>) -> Result<CpuStorage> {
        let (g, u) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        let out: Vec<T> = g
            .par_iter()
            .zip(u.par_iter())
            .map(|(g, u)| T::from_f64(silu_parts(g.to_f64()).0 * u.to_f64()))
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(g.0.dtype(), "swiglu", go(g, u))
}

fn swiglu_grad_cpu(g: CpuArg<'_>, u: CpuArg<'_>, dh: CpuArg<'_>, up: bool) -> Result<CpuStorage> {
    fn go<T: WithDType>(
        (s1, l1): CpuArg<'_>,
        (s2, l2): CpuArg<'_>,
        (s3, l3): CpuArg<'_>,
        up: bool,
    ) -> Result<CpuStorage> {
        let (g, u, dh) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
        let out: Vec<T> = (0..g.len())
            .into_par_iter()
            .map(|i| {
                let a = g[i].to_f64();
                let (silu, s) = silu_parts(a);
                let d = dh[i].to_f64();
                T::from_f64(if up {
                    d * silu
                } else {
                    d * u[i].to_f64() * s * (1.0 + a * (1.0 - s))
                })
            })
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(g.0.dtype(), "swiglu-grad", go(g, u, dh, up))
}
