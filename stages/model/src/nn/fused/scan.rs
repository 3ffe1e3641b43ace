//! The chunked Gated DeltaNet's pass over its chunks, one kernel: the state carried from chunk
//! to chunk is the only sequential part of the chunked form, and composed it was a loop of a
//! few launches per chunk (a 2,048-token prefill: 32 chunks, ~200 launches a layer). Here each
//! block of threads keeps a tile of one head's state in shared memory and walks the chunks.
//!
//! Per head and chunk c, with the state S (`[dk, dv]`) before it:
//! `v_new = values - k_decayed @ S`; the chunk's output `q_decayed @ S + intra @ v_new`; then
//! `S = S * decay + k_tail @ v_new` (`deltanet.rs` derives each operand). Forward only.
//!
//! The operands travel packed, so the op has three inputs: `rows` `[chunks, heads, L, dv + 2 dk
//! + L]` (each chunk's `values | k_decayed | q_decayed | intra`), `tails` `[chunks, heads, dk, L +
//! 1]` (`k_tail`, then the chunk's decay in the last column), and the state before the first
//! chunk `[heads, dk, dv]`. The output `[heads, chunks L + dk, dv]` holds every chunk's rows,
//! then the state after the last chunk.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu};

/// Sizes of a pass: chunks, heads, chunk length, key and value widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanShape {
    pub chunks: usize,
    pub heads: usize,
    pub chunk: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The pass over the chunks (module docs): the chunks' outputs `[heads, chunks L, dv]` and the
/// state after the last chunk `[heads, dk, dv]`, f32.
pub fn delta_scan(rows: &Tensor, tails: &Tensor, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let shape = checked(rows, tails, state)?;
    let out = rows.contiguous()?.apply_op3_no_bwd(
        &tails.contiguous()?,
        &state.contiguous()?,
        &DeltaScan { shape },
    )?;
    let rows_out = shape.chunks * shape.chunk;
    Ok((
        out.narrow(1, 0, rows_out)?,
        out.narrow(1, rows_out, shape.dk)?,
    ))
}

/// The chunks' operands, heads first: `values`, `k_decayed`, `q_decayed` `[heads, chunks, L, d]`,
/// `intra` `[heads, chunks, L, L]`, `k_tail` `[heads, chunks, L, dk]` (used transposed), f32;
/// and `decay` `[chunks, heads]`, contiguous. Views are fine for the matmuls' operands: each
/// chunk's slice is read through its strides. `values` is best chunk-major underneath (its
/// slices contiguous), since a subtraction reads it: on a GPU, candle's elementwise op on a view
/// (or a broadcast) first copies its layout from pageable host memory, which the driver may
/// serialise with the queued work, so the loop over the chunks has none.
pub struct ChunkOperands {
    /// Each chunk's new values before the state's part is taken off.
    pub values: Tensor,
    /// What multiplies the state to give the state's part of the values.
    pub k_decayed: Tensor,
    /// The queries decayed from each chunk's start.
    pub q_decayed: Tensor,
    /// The masked, decayed query-key products within each chunk.
    pub intra: Tensor,
    /// The keys decayed to each chunk's end.
    pub k_tail: Tensor,
    /// The decay over each whole chunk.
    pub decay: Tensor,
}

impl ChunkOperands {
    /// Packed for [`delta_scan`] (module docs: `rows`, `tails`).
    pub fn packed(&self) -> Result<(Tensor, Tensor)> {
        let by_chunk = |t: &Tensor| t.transpose(0, 1)?.contiguous();
        let rows = by_chunk(&Tensor::cat(
            &[&self.values, &self.k_decayed, &self.q_decayed, &self.intra],
            3,
        )?)?;
        let (heads, chunks, _, dk) = self.k_tail.dims4()?;
        let decays = self
            .decay
            .t()?
            .reshape((heads, chunks, 1, 1))?
            .broadcast_as((heads, chunks, dk, 1))?;
        let tails = by_chunk(&Tensor::cat(&[&self.k_tail.transpose(2, 3)?, &decays], 3)?)?;
        Ok((rows, tails))
    }

    /// Unpacked from [`delta_scan`]'s operands.
    pub fn unpacked(rows: &Tensor, tails: &Tensor, s: ScanShape) -> Result<Self> {
        let ScanShape {
            chunk: l, dk, dv, ..
        } = s;
        // Each part chunk-major and contiguous, seen heads first.
        let part = |t: &Tensor, from: usize, width: usize| {
            t.narrow(3, from, width)?.contiguous()?.transpose(0, 1)
        };
        Ok(Self {
            values: part(rows, 0, dv)?,
            k_decayed: part(rows, dv, dk)?,
            q_decayed: part(rows, dv + dk, dk)?,
            intra: part(rows, dv + 2 * dk, l)?,
            k_tail: part(tails, 0, l)?.transpose(2, 3)?,
            decay: tails
                .narrow(2, 0, 1)?
                .narrow(3, l, 1)?
                .contiguous()?
                .reshape((s.chunks, s.heads))?,
        })
    }
}

/// The pass as candle matmuls, a few per chunk, on operands as [`ChunkOperands`] holds them:
/// what the forward runs on every device (on an H100 they beat the one-kernel walk), the same
/// outputs as [`delta_scan`].
pub fn delta_scan_chunks(ops: &ChunkOperands, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let chunks = ops.values.dim(1)?;
    let at = |t: &Tensor, c: usize| t.narrow(1, c, 1)?.squeeze(1);
    let mut st = state.clone();
    let mut outs = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let v_new = (at(&ops.values, c)? - at(&ops.k_decayed, c)?.matmul(&st)?)?;
        outs.push((at(&ops.q_decayed, c)?.matmul(&st)? + at(&ops.intra, c)?.matmul(&v_new)?)?);
        st =
            (scale_by_head(&st, &ops.decay.get(c)?)? + at(&ops.k_tail, c)?.t()?.matmul(&v_new)?)?;
    }
    Ok((Tensor::cat(&outs, 1)?, st))
}

/// `x` `[heads, ...]` with each head's elements times its entry of `s` `[heads]`: on a GPU one
/// launch without a broadcast (see [`ChunkOperands`]), elsewhere candle's broadcast product (the
/// same products).
pub fn scale_by_head(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    if !x.device().is_cuda() {
        let mut shape = vec![1; x.rank()];
        shape[0] = s.elem_count();
        return x.broadcast_mul(&s.reshape(shape)?);
    }
    scale_by_head_kernel(x, s)
}

/// [`scale_by_head`]'s op on any device (the CPU form is the kernel's arithmetic): what the
/// tests and the GPU check (`train_probe fused`) hold to the broadcast product.
pub fn scale_by_head_kernel(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    let heads = x.dim(0)?;
    if s.dims() != [heads] || s.dtype() != x.dtype() {
        bail!(
            "scale_by_head: x {:?} ({:?}) by s {:?} ({:?})",
            x.dims(),
            x.dtype(),
            s.dims(),
            s.dtype()
        );
    }
    x.contiguous()?
        .apply_op2_no_bwd(&s.contiguous()?, &ScaleByHead {})
}

fused_op! {
    /// Each head's elements times its scale.
    ScaleByHead {} = "scale-by-head", inputs(x, s);
    cpu(_op) => Ok((scale_by_head_cpu(x, s)?, x.1.shape().clone()));
    cuda(_op) => Ok((super::cuda::scale_by_head(x, s)?, x.1.shape().clone()));
}

fn scale_by_head_cpu(x: CpuArg<'_>, s: CpuArg<'_>) -> Result<CpuStorage> {
    fn go<T: candle_core::WithDType>(x: CpuArg<'_>, s: CpuArg<'_>) -> Result<CpuStorage> {
        let (x, s) = (cpu::<T>(x.0, x.1)?, cpu::<T>(s.0, s.1)?);
        let per = (x.len() / s.len().max(1)).max(1);
        let out: Vec<T> = x
            .chunks(per)
            .zip(s)
            .flat_map(|(row, &k)| row.iter().map(move |&v| v * k))
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(x.0.dtype(), "scale-by-head", go(x, s))
}

/// The chunked Gated DeltaNet's decays: each row of the cumulative log-decays `cum` (`[.., l]`,
/// f32) as the `[l, l]` matrix `exp(cum_i - cum_j)` for `j <= i`, 0 above the diagonal (what the
/// state loses between positions j and i). On a GPU one kernel; on the CPU the composed ops as
/// they always ran (the difference clamped at 0 before `exp`, then masked), bit for bit.
pub fn chunk_decay(cum: &Tensor) -> Result<Tensor> {
    if cum.device().is_cuda() {
        return chunk_decay_kernel(cum);
    }
    chunk_decay_composed(cum)
}

/// [`chunk_decay`] as composed candle ops, on any device: the CPU's path, and what the GPU
/// check (`train_probe fused`) holds the kernel to.
pub fn chunk_decay_composed(cum: &Tensor) -> Result<Tensor> {
    let l = cum.dim(candle_core::D::Minus1)?;
    let lower = lower_triangle(l, false, cum.dtype(), cum.device())?;
    let diff = cum
        .unsqueeze(candle_core::D::Minus1)?
        .broadcast_sub(&cum.unsqueeze(candle_core::D::Minus2)?)?;
    // Above the diagonal the difference is >= 0 and may overflow exp: clamp, then mask.
    diff.minimum(0f32)?.exp()?.broadcast_mul(&lower)
}

/// An `[n, n]` mask of ones on and below the diagonal (`strict`: below it only), zeros above,
/// built on `device`.
pub fn lower_triangle(
    n: usize,
    strict: bool,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let rows = Tensor::arange(0u32, n as u32, device)?.reshape((n, 1))?;
    let cols = Tensor::arange(0u32, n as u32, device)?.reshape((1, n))?;
    let keep = if strict {
        cols.broadcast_lt(&rows)?
    } else {
        cols.broadcast_le(&rows)?
    };
    keep.to_dtype(dtype)
}

/// [`chunk_decay`]'s op on any device (the CPU form is the kernel's arithmetic, in f64).
pub fn chunk_decay_kernel(cum: &Tensor) -> Result<Tensor> {
    let l = cum.dim(candle_core::D::Minus1)?;
    cum.contiguous()?.apply_op1_no_bwd(&ChunkDecay { l })
}

fused_op! {
    /// Each row of cumulative log-decays as its lower-triangular decay matrix.
    ChunkDecay { l: usize } = "chunk-decay", inputs(cum);
    cpu(op) => {
        let mut dims = cum.1.dims().to_vec();
        dims.push(op.l);
        Ok((chunk_decay_cpu(cum, op.l)?, dims.into()))
    };
    cuda(op) => {
        let mut dims = cum.1.dims().to_vec();
        dims.push(op.l);
        Ok((super::cuda::chunk_decay(cum, op.l)?, dims.into()))
    };
}

fn chunk_decay_cpu(cum: CpuArg<'_>, l: usize) -> Result<CpuStorage> {
    fn go<T: candle_core::WithDType>(cum: CpuArg<'_>, l: usize) -> Result<CpuStorage> {
        let cum = cpu::<T>(cum.0, cum.1)?;
        let out: Vec<T> = cum
            .chunks(l)
            .flat_map(|row| {
                (0..l * l).map(move |e| {
                    let (i, j) = (e / l, e % l);
                    T::from_f64(if j <= i {
                        (row[i].to_f64() - row[j].to_f64()).min(0.0).exp()
                    } else {
                        0.0
                    })
                })
            })
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(cum.0.dtype(), "chunk-decay", go(cum, l))
}

/// `(I + A)^-1` for each of the last two dimensions' `[n, n]` matrices of `a` (f32; only its
/// strictly lower triangle counts): the chunked Gated DeltaNet's WY inverse. On a GPU one
/// kernel (forward substitution in shared memory, `n` at most 64, reading only the strictly
/// lower triangle); on the CPU `a` masked to its strictly lower triangle, then the composed
/// squarings as they always ran, `(I - A)(I + A^2)(I + A^4)...` (A is nilpotent), bit for bit.
pub fn unit_lower_inverse(a: &Tensor) -> Result<Tensor> {
    let n = a.dim(candle_core::D::Minus1)?;
    if a.device().is_cuda() && n <= 64 {
        return unit_lower_inverse_kernel(a);
    }
    unit_lower_inverse_squarings(a)
}

/// [`unit_lower_inverse`] by the squarings, on any device: the CPU's path, and what the GPU
/// check (`train_probe fused`) holds the kernel to.
pub fn unit_lower_inverse_squarings(a: &Tensor) -> Result<Tensor> {
    let n = a.dim(candle_core::D::Minus1)?;
    let a = a.broadcast_mul(&lower_triangle(n, true, a.dtype(), a.device())?)?;
    let mut power = a.neg()?;
    let mut inverse = power.broadcast_add(&Tensor::eye(n, a.dtype(), a.device())?)?;
    let mut span = 2;
    while span < n {
        power = power.matmul(&power)?;
        inverse = (&inverse + inverse.matmul(&power)?)?;
        span *= 2;
    }
    Ok(inverse)
}

/// [`unit_lower_inverse`]'s op on any device (the CPU form is the kernel's forward
/// substitution, in f64): what the tests and the GPU check hold to the squarings.
pub fn unit_lower_inverse_kernel(a: &Tensor) -> Result<Tensor> {
    let n = a.dim(candle_core::D::Minus1)?;
    if a.dim(candle_core::D::Minus2)? != n {
        bail!("unit_lower_inverse: {:?} is not square matrices", a.dims());
    }
    a.contiguous()?.apply_op1_no_bwd(&UnitLowerInverse { n })
}

fused_op! {
    /// `(I + A)^-1` per `[n, n]` matrix, A strictly lower triangular.
    UnitLowerInverse { n: usize } = "unit-lower-inverse", inputs(a);
    cpu(op) => Ok((unit_lower_inverse_cpu(a, op.n)?, a.1.shape().clone()));
    cuda(op) => Ok((super::cuda::unit_lower_inverse(a, op.n)?, a.1.shape().clone()));
}

fn unit_lower_inverse_cpu(a: CpuArg<'_>, n: usize) -> Result<CpuStorage> {
    fn go<T: candle_core::WithDType>(a: CpuArg<'_>, n: usize) -> Result<CpuStorage> {
        let a = cpu::<T>(a.0, a.1)?;
        let out: Vec<T> = a
            .par_chunks(n * n)
            .flat_map_iter(|m| {
                let mut x = vec![0f64; n * n];
                for i in 0..n {
                    for c in 0..=i {
                        let mut s = if i == c { 1.0 } else { 0.0 };
                        for j in c..i {
                            s -= m[i * n + j].to_f64() * x[j * n + c];
                        }
                        x[i * n + c] = s;
                    }
                }
                x.into_iter().map(T::from_f64)
            })
            .collect();
        Ok(T::to_cpu_storage_owned(out))
    }
    by_float!(a.0.dtype(), "unit-lower-inverse", go(a, n))
}

/// [`delta_scan_chunks`] from [`delta_scan`]'s packed operands: what the kernel is timed and
/// checked against.
pub fn delta_scan_matmuls(
    rows: &Tensor,
    tails: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let shape = checked(rows, tails, state)?;
    delta_scan_chunks(&ChunkOperands::unpacked(rows, tails, shape)?, state)
}

/// The pass's sizes, once the operands are seen to fit each other (f32).
fn checked(rows: &Tensor, tails: &Tensor, state: &Tensor) -> Result<ScanShape> {
    let (chunks, heads, chunk, width) = rows.dims4()?;
    let (heads_s, dk, dv) = state.dims3()?;
    if heads_s != heads
        || width != dv + 2 * dk + chunk
        || tails.dims() != [chunks, heads, dk, chunk + 1]
        || [rows.dtype(), tails.dtype(), state.dtype()] != [DType::F32; 3]
    {
        bail!(
            "delta_scan: rows {:?}, tails {:?}, state {:?} (f32) do not fit",
            rows.dims(),
            tails.dims(),
            state.dims()
        );
    }
    Ok(ScanShape {
        chunks,
        heads,
        chunk,
        dk,
        dv,
    })
}

fused_op! {
    /// The chunks' outputs, then the final state (module docs).
    DeltaScan { shape: ScanShape } = "delta-scan", inputs(rows, tails, state);
    cpu(op) => {
        let s = op.shape;
        Ok((scan_cpu(rows, tails, state, s)?, (s.heads, s.chunks * s.chunk + s.dk, s.dv).into()))
    };
    cuda(op) => {
        let s = op.shape;
        Ok((
            super::cuda::delta_scan(rows, tails, state, s)?,
            (s.heads, s.chunks * s.chunk + s.dk, s.dv).into(),
        ))
    };
}

/// The CPU form, in f64, one head per task: the reference the CUDA kernel is checked against.
fn scan_cpu(
    rows: CpuArg<'_>,
    tails: CpuArg<'_>,
    state: CpuArg<'_>,
    s: ScanShape,
) -> Result<CpuStorage> {
    let (p, t, s0) = (
        cpu::<f32>(rows.0, rows.1)?,
        cpu::<f32>(tails.0, tails.1)?,
        cpu::<f32>(state.0, state.1)?,
    );
    let ScanShape {
        chunks,
        heads,
        chunk: l,
        dk,
        dv,
    } = s;
    let w = dv + 2 * dk + l;
    let per_head = (chunks * l + dk) * dv;
    let out: Vec<f32> = (0..heads)
        .into_par_iter()
        .flat_map_iter(|h| {
            let mut st: Vec<f64> = s0[h * dk * dv..(h + 1) * dk * dv]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mut o = vec![0f32; per_head];
            let mut v_new = vec![0f64; l * dv];
            for c in 0..chunks {
                let base = (c * heads + h) * l * w;
                let at = |i: usize, col: usize| f64::from(p[base + i * w + col]);
                for i in 0..l {
                    for j in 0..dv {
                        let a: f64 = (0..dk).map(|d| at(i, dv + d) * st[d * dv + j]).sum();
                        v_new[i * dv + j] = at(i, j) - a;
                    }
                }
                for i in 0..l {
                    for j in 0..dv {
                        let a: f64 = (0..dk).map(|d| at(i, dv + dk + d) * st[d * dv + j]).sum();
                        let b: f64 = (0..l)
                            .map(|m| at(i, dv + 2 * dk + m) * v_new[m * dv + j])
                            .sum();
                        o[(c * l + i) * dv + j] = (a + b) as f32;
                    }
                }
                let tb = (c * heads + h) * dk * (l + 1);
                let decay = f64::from(t[tb + l]);
                for d in 0..dk {
                    for j in 0..dv {
                        let a: f64 = (0..l)
                            .map(|m| f64::from(t[tb + d * (l + 1) + m]) * v_new[m * dv + j])
                            .sum();
                        st[d * dv + j] = st[d * dv + j] * decay + a;
                    }
                }
            }
            for (k, v) in st.iter().enumerate() {
                o[chunks * l * dv + k] = *v as f32;
            }
            o.into_iter()
        })
        .collect();
    Ok(CpuStorage::F32(out))
}
