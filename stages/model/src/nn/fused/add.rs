//! The sum of two tensors of one shape, for the written-out step's residuals and gradient sums.
//!
//! candle's add on a GPU moves one element a thread through its strided-index kernel: at the
//! drafter's `[8192, 4096]` bf16 rows that was 0.1 ms an add where the bytes take 0.06, sixty
//! times a step. Here a GPU adds contiguous operands sixteen bytes a thread (`kernels.cu`'s
//! `add`); anything else (the CPU, other dtypes, views) is candle's add, bit for bit
//! (`train_probe fused`'s `add_*` holds the kernel to candle's add on the GPU: equal).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};

use super::{CpuArg, Result, cpu};

/// `a + b` (same shape and dtype).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let kernel = a.device().is_cuda()
        && a.dims() == b.dims()
        && a.dtype() == b.dtype()
        && matches!(a.dtype(), DType::F32 | DType::BF16)
        && a.is_contiguous()
        && b.is_contiguous()
        && a.elem_count() > 0
        && !a.track_op()
        && !b.track_op();
    if !kernel {
        return a + b;
    }
    a.apply_op2_no_bwd(b, &Add {})
}

fused_op! {
    /// `a + b` elementwise, contiguous operands of one shape.
    Add {} = "add", inputs(a, b);
    cpu(_op) => Ok((add_cpu(a, b)?, a.1.shape().clone()));
    cuda(_op) => Ok((super::cuda::add(a, b)?, a.1.shape().clone()));
}

/// The op's CPU form (what [`add`] never reaches on a CPU, which adds through candle; kept so
/// the op is whole on every device).
fn add_cpu(a: CpuArg<'_>, b: CpuArg<'_>) -> Result<CpuStorage> {
    fn go<T: WithDType>((s1, l1): CpuArg<'_>, (s2, l2): CpuArg<'_>) -> Result<CpuStorage> {
        let (a, b) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
        if a.len() != b.len() {
            bail!("add: {} and {} elements", a.len(), b.len());
        }
        let out: Vec<T> = a.iter().zip(b).map(|(&x, &y)| x + y).collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(a.0.dtype(), "add", go(a, b))
}
