//! A 3-D view (a transpose or a narrowing of a 3-D tensor) made contiguous in one launch.
//!
//! candle copies a non-contiguous layout with a kernel that reads the layout's dims and strides
//! from device memory, uploaded from the host before every such copy. In a decoding round that
//! is a host-to-device transfer per reshape (the queries, keys and values into heads and the
//! heads back, in each layer) where the kernel itself moves a few kilobytes. Here the dims and
//! strides are the kernel's arguments. The copy is exact, so every device gives candle's values.
//! Also [`keep_append`]: a decoding cache cut to what a round kept and the next pass's keys or
//! values appended, in one copy.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Tensor, WithDType, bail};

use super::{CpuArg, Result, cpu};

/// `t` contiguous. A 3-D f32 or bf16 view on a GPU takes one launch with its strides as
/// arguments; anything else (CPU, other ranks or dtypes, empty, already contiguous, a tensor in a
/// graph) goes through candle.
pub fn contiguous3(t: &Tensor) -> Result<Tensor> {
    let kernel = t.device().is_cuda()
        && t.rank() == 3
        && matches!(t.dtype(), DType::F32 | DType::BF16)
        && t.elem_count() > 0
        && !t.is_contiguous()
        && !t.track_op();
    if !kernel {
        return t.contiguous();
    }
    t.apply_op1_no_bwd(&StridedCopy3 {})
}

fused_op! {
    /// A 3-D view copied into a contiguous tensor.
    StridedCopy3 {} = "strided-copy3", inputs(x);
    cpu(_op) => Ok((strided_copy3_cpu(x.0, x.1)?, x.1.shape().clone()));
    cuda(_op) => Ok((super::cuda::strided_copy3(x)?, x.1.shape().clone()));
}

/// The CPU form, the kernel's index arithmetic element for element (what the tests check
/// against candle's own copy).
fn strided_copy3_cpu(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    fn go<T: WithDType>(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
        let src = s.as_slice::<T>()?;
        let (&[d0, d1, d2], &[s0, s1, s2]) = (l.dims(), l.stride()) else {
            bail!("strided-copy3: a {}-D view", l.dims().len());
        };
        let mut out = Vec::with_capacity(d0 * d1 * d2);
        for i in 0..d0 * d1 * d2 {
            let (c, b, a) = (i % d2, (i / d2) % d1, i / (d1 * d2));
            let at = l.start_offset() + a * s0 + b * s1 + c * s2;
            out.push(*src.get(at).ok_or_else(|| {
                candle_core::Error::Msg(format!("strided-copy3: element {at} past the storage"))
            })?);
        }
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(s.dtype(), "strided-copy3", go(s, l))
}

/// The op itself on any device (no fallback): what the tests and the GPU check (`train_probe
/// fused`) hold to candle's copy.
pub fn strided_copy3(t: &Tensor) -> Result<Tensor> {
    t.apply_op1_no_bwd(&StridedCopy3 {})
}

/// `past` `[h, len, d]`'s positions `keep` (a u32 vector, in its order), then `added` `[h, n,
/// d]`: `[h, keep.len() + n, d]`. A decoding cache cut to what a round kept (a tree's accepted
/// path, or a prefix) with the next pass's keys or values appended, in one copy where a gather
/// (or, on a GPU, a copy of the prefix) and a concatenation ran. Forward only.
pub fn keep_append(past: &Tensor, keep: &Tensor, added: &Tensor) -> Result<Tensor> {
    let (h, _, d) = past.dims3()?;
    let (h2, _, d2) = added.dims3()?;
    if h != h2 || d != d2 || past.dtype() != added.dtype() {
        bail!(
            "keep-append: past {:?} {:?} and added {:?} {:?}",
            past.dims(),
            past.dtype(),
            added.dims(),
            added.dtype()
        );
    }
    if keep.dtype() != DType::U32 || keep.rank() != 1 {
        bail!(
            "keep-append: positions must be a u32 vector, got {:?} {:?}",
            keep.dtype(),
            keep.dims()
        );
    }
    past.contiguous()?
        .apply_op3_no_bwd(&keep.contiguous()?, &added.contiguous()?, &KeepAppend {})
}

fused_op! {
    /// Positions of a cache kept, then new ones appended.
    KeepAppend {} = "keep-append", inputs(past, keep, added);
    cpu(_op) => keep_append_cpu(past, keep, added);
    cuda(_op) => {
        let shape = kept_shape(past.1, keep.1, added.1);
        Ok((super::cuda::keep_append(past, keep, added)?, shape))
    };
}

/// `[h, kept + n, d]`.
fn kept_shape(past: &Layout, keep: &Layout, added: &Layout) -> candle_core::Shape {
    let (p, a) = (past.dims(), added.dims());
    (p[0], keep.shape().elem_count() + a[1], p[2]).into()
}

fn keep_append_cpu(
    past: CpuArg<'_>,
    keep: CpuArg<'_>,
    added: CpuArg<'_>,
) -> Result<(CpuStorage, candle_core::Shape)> {
    fn go<T: WithDType>(past: CpuArg<'_>, keep: &[u32], added: CpuArg<'_>) -> Result<CpuStorage> {
        let (p, a) = (cpu::<T>(past.0, past.1)?, cpu::<T>(added.0, added.1)?);
        let (&[h, len, d], &[_, n, _]) = (past.1.dims(), added.1.dims()) else {
            bail!("keep-append: not 3-D");
        };
        let mut out = Vec::with_capacity(h * (keep.len() + n) * d);
        for head in 0..h {
            for &at in keep {
                if at as usize >= len {
                    bail!("keep-append: position {at} is past the cache's {len}");
                }
                let from = (head * len + at as usize) * d;
                out.extend_from_slice(&p[from..from + d]);
            }
            out.extend_from_slice(&a[head * n * d..(head + 1) * n * d]);
        }
        Ok(T::to_cpu_storage_owned(out))
    }
    let shape = kept_shape(past.1, keep.1, added.1);
    let ids = cpu::<u32>(keep.0, keep.1)?;
    Ok((
        by_float!(past.0.dtype(), "keep-append", go(past, ids, added))?,
        shape,
    ))
}
