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

/// The same pass from the same operands as candle matmuls, a few per chunk: what CPU runs (its
/// matmuls beat the reference form's loops there), and what the kernel is timed against.
pub fn delta_scan_matmuls(
    rows: &Tensor,
    tails: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let ScanShape {
        chunks,
        chunk: l,
        dk,
        dv,
        ..
    } = checked(rows, tails, state)?;
    let part = |t: &Tensor, dim: usize, from: usize, width: usize| {
        t.narrow(dim, from, width)?.contiguous()
    };
    let (values, k_decayed) = (part(rows, 3, 0, dv)?, part(rows, 3, dv, dk)?);
    let (q_decayed, intra) = (part(rows, 3, dv + dk, dk)?, part(rows, 3, dv + 2 * dk, l)?);
    let k_tail = part(tails, 3, 0, l)?;
    let decay = part(&tails.narrow(2, 0, 1)?, 3, l, 1)?;
    let mut st = state.clone();
    let mut outs = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let v_new = (values.get(c)? - k_decayed.get(c)?.matmul(&st)?)?;
        outs.push((q_decayed.get(c)?.matmul(&st)? + intra.get(c)?.matmul(&v_new)?)?);
        st = (st.broadcast_mul(&decay.get(c)?)? + k_tail.get(c)?.matmul(&v_new)?)?;
    }
    Ok((Tensor::cat(&outs, 1)?, st))
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
