//! Rows of a table picked by index (an embedding lookup), with a backward that adds each
//! gradient row into its table row in parallel.
//!
//! candle's `index_select` backward is `index_add`, whose CUDA kernel gives each of the table's
//! columns one thread that walks every index in turn: DFlash 2's codebooks (`[vocab, rank]`,
//! looked up by every candidate of every drafted position, hundreds of thousands of indices a
//! step) got 64 threads each walking all of them. Here the backward is one thread per (index,
//! column), adding with atomics (on CPU one pass in index order, summed in f64).

use super::{CpuArg, Result, cpu, rows};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};

/// Rows `ids` of `table` `[rows, width]`: `[ids.len(), width]`. Differentiable in `table`; a
/// row picked several times gets the sum of its gradients. An index past the table is an error
/// on CPU; on a GPU (where checking would copy the indices back every step) its row reads as
/// zeros and takes no gradient.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    table.dims2()?;
    if ids.dtype() != DType::U32 || ids.rank() != 1 {
        bail!(
            "gather_rows: ids must be a u32 vector, got {:?} {:?}",
            ids.dtype(),
            ids.dims()
        );
    }
    table
        .contiguous()?
        .apply_op2(&ids.contiguous()?, GatherRows {})
}

fused_op! {
    /// Rows of `table` by `ids`.
    GatherRows {} = "gather-rows", inputs(table, ids);
    cpu(_op) => {
        let (_, width) = rows(table.1);
        let n = ids.1.shape().elem_count();
        Ok((gather_cpu(table, ids)?, (n, width).into()))
    };
    cuda(_op) => {
        let (_, width) = rows(table.1);
        let n = ids.1.shape().elem_count();
        Ok((super::cuda::gather_rows(table, ids)?, (n, width).into()))
    };
    bwd(_op, _out, grad) => {
        let (count, _) = table.dims2()?;
        let grad = grad.to_dtype(table.dtype())?.contiguous()?;
        let g = grad.apply_op2_no_bwd(ids, &ScatterAddRows { rows: count })?;
        Ok((Some(g), None))
    };
}

fused_op! {
    /// A `[rows, width]` table of zeros with each row of `grad` added at its index.
    ScatterAddRows { rows: usize } = "scatter-add-rows", inputs(grad, ids);
    cpu(op) => {
        let (_, width) = rows(grad.1);
        Ok((scatter_add_cpu(grad, ids, op.rows)?, (op.rows, width).into()))
    };
    cuda(op) => {
        let (_, width) = rows(grad.1);
        Ok((super::cuda::scatter_add_rows(grad, ids, op.rows)?, (op.rows, width).into()))
    };
}

fn gather_cpu(table: CpuArg<'_>, ids: CpuArg<'_>) -> Result<CpuStorage> {
    fn go<T: WithDType>((s, l): CpuArg<'_>, ids: &[u32]) -> Result<CpuStorage> {
        let t = cpu::<T>(s, l)?;
        let (count, width) = rows(l);
        let mut out = Vec::with_capacity(ids.len() * width);
        for &i in ids {
            if i as usize >= count {
                bail!("gather_rows: index {i} is past the table's {count} rows");
            }
            out.extend_from_slice(&t[i as usize * width..(i as usize + 1) * width]);
        }
        Ok(T::to_cpu_storage_owned(out))
    }
    let ids = cpu::<u32>(ids.0, ids.1)?;
    by_float!(table.0.dtype(), "gather-rows", go(table, ids))
}

fn scatter_add_cpu(grad: CpuArg<'_>, ids: CpuArg<'_>, count: usize) -> Result<CpuStorage> {
    fn go<T: WithDType>((s, l): CpuArg<'_>, ids: &[u32], count: usize) -> Result<CpuStorage> {
        let g = cpu::<T>(s, l)?;
        let (_, width) = rows(l);
        // Summed in f64, in index order, per column: the same bytes whatever the threads.
        let mut acc = vec![0f64; count * width];
        for (j, &i) in ids.iter().enumerate() {
            let (dst, src) = (i as usize * width, j * width);
            for c in 0..width {
                acc[dst + c] += g[src + c].to_f64();
            }
        }
        Ok(T::to_cpu_storage_owned(
            acc.into_iter().map(T::from_f64).collect(),
        ))
    }
    let ids = cpu::<u32>(ids.0, ids.1)?;
    by_float!(grad.0.dtype(), "scatter-add-rows", go(grad, ids, count))
}
