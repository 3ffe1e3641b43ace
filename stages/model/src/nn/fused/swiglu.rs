//! SwiGLU's gate, `silu(g) * u`, and its gradients: one pass each instead of candle's sigmoid,
//! multiplications and their backward ops over `[rows, ffn]` (the MLP's widest tensors).

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType, bail,
};
use rayon::prelude::*;

use super::{Result, cpu};

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
    g.contiguous()?.apply_op2(&u.contiguous()?, Swiglu)
}

struct Swiglu;

/// The gradient of the gate input (`up: false`) or of the up input given the output's.
struct SwigluGrad {
    up: bool,
}

fn silu_parts(a: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-a).exp());
    (a * s, s)
}

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<CpuStorage> {
            let (g, u) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
            let out: Vec<T> = g
                .par_iter()
                .zip(u.par_iter())
                .map(|(g, u)| T::from_f64(silu_parts(g.to_f64()).0 * u.to_f64()))
                .collect();
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, s2, l2))?;
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
        Ok((super::cuda::swiglu((s1, l1), (s2, l2))?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _h: &Tensor,
        dh: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dh = dh.contiguous()?;
        let dg = g.apply_op3_no_bwd(u, &dh, &SwigluGrad { up: false })?;
        let du = g.apply_op3_no_bwd(u, &dh, &SwigluGrad { up: true })?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for SwigluGrad {
    fn name(&self) -> &'static str {
        "swiglu-grad"
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
        fn go<T: WithDType>(
            (s1, l1): (&CpuStorage, &Layout),
            (s2, l2): (&CpuStorage, &Layout),
            (s3, l3): (&CpuStorage, &Layout),
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
        let out = by_float!(
            s1.dtype(),
            self.name(),
            go((s1, l1), (s2, l2), (s3, l3), self.up)
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
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            super::cuda::swiglu_grad((s1, l1), (s2, l2), (s3, l3), i32::from(self.up))?,
            l1.shape().clone(),
        ))
    }
}
