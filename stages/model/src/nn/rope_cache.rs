//! The rotary embedding's cos and sin tables, made once per device and shape and then served by
//! row: a table's row depends on its position alone, so the rows for any list of positions are
//! the rows `0..=max` of one table, gathered. A training step at the shape asks for the
//! target's 3,072 positions, the drafter's context's and its 8,192 block rows; computed on the
//! host each time (an f64 `powf`, `cos` and `sin` per element) that was ~57 ms of host work a
//! step on this 2-core machine (12 ms for 3,072 positions of 128-wide heads, 33-38 for 8,192),
//! with the device idle whenever the host was behind (between phases, after a sync). The values
//! are those of the direct computation, bit for bit
//! (`rows_for_any_positions_are_the_direct_tables`).

use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};

use super::Result;

/// One cached table: rows `0..rows` for a head size, base and dtype, on one device.
struct Table {
    head_dim: usize,
    theta: u64,
    dtype: DType,
    device: Device,
    rows: usize,
    cos: Tensor,
    sin: Tensor,
}

static TABLES: Mutex<Vec<Table>> = Mutex::new(Vec::new());

/// Cos and sin tables of the rotary embedding for `positions`: `[n, head_dim / 2]` each, as
/// [`direct`] computes them (re-exported as `ops::rope_tables`).
pub fn tables(
    positions: &[u32],
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let n = positions.len();
    let Some(&last) = positions.iter().max() else {
        return direct(positions, head_dim, theta, dtype, device);
    };
    let (cos, sin) = table(last as usize + 1, head_dim, theta, dtype, device)?;
    // Positions 0, 1, ..., n - 1 (the target's and the context's): the table's first rows.
    if positions.iter().enumerate().all(|(i, &p)| p as usize == i) {
        return Ok((cos.narrow(0, 0, n)?, sin.narrow(0, 0, n)?));
    }
    let index = Tensor::from_slice(positions, n, device)?;
    Ok((cos.index_select(&index, 0)?, sin.index_select(&index, 0)?))
}

/// The table with at least `rows` rows for these parameters on `device`: the cached one, or a
/// new one of the next power of two rows (so a growing context rebuilds it rarely).
fn table(
    rows: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut cached = TABLES.lock().unwrap_or_else(PoisonError::into_inner);
    let same = |t: &Table| {
        t.head_dim == head_dim
            && t.theta == theta.to_bits()
            && t.dtype == dtype
            && t.device.same_device(device)
    };
    if let Some(t) = cached.iter().find(|t| same(t) && t.rows >= rows) {
        return Ok((t.cos.clone(), t.sin.clone()));
    }
    let made = rows.next_power_of_two().max(64);
    let all: Vec<u32> = (0..made as u32).collect();
    let (cos, sin) = direct(&all, head_dim, theta, dtype, device)?;
    cached.retain(|t| !same(t));
    cached.push(Table {
        head_dim,
        theta: theta.to_bits(),
        dtype,
        device: device.clone(),
        rows: made,
        cos: cos.clone(),
        sin: sin.clone(),
    });
    Ok((cos, sin))
}

/// The tables computed on the host for each position, in f64, then rounded to f32 and cast to
/// `dtype`: what every row of a cached table holds.
fn direct(
    positions: &[u32],
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    // The same expression per column as per element: hoisting it changes no value.
    let freqs: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &freq in &freqs {
            let angle = f64::from(p) * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let n = positions.len();
    Ok((
        Tensor::from_vec(cos, (n, half), device)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, (n, half), device)?.to_dtype(dtype)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any list of positions (in order, out of order, repeated, past an earlier table's end,
    /// empty) gets exactly the rows the direct computation makes, in every dtype.
    #[test]
    fn rows_for_any_positions_are_the_direct_tables() {
        let cpu = Device::Cpu;
        let lists: [&[u32]; 6] = [
            &[0, 1, 2, 3, 4],
            &[7, 3, 3, 0, 40],
            &[100, 101, 102],
            &[0, 1, 2],
            &[5000, 2],
            &[],
        ];
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            for head_dim in [8, 64] {
                for positions in lists {
                    let (c, s) = tables(positions, head_dim, 10_000.0, dtype, &cpu).unwrap();
                    let (dc, ds) = direct(positions, head_dim, 10_000.0, dtype, &cpu).unwrap();
                    assert_eq!(c.dims(), dc.dims());
                    let bits = |t: &Tensor| {
                        t.to_dtype(DType::F64)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f64>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&c), bits(&dc), "cos {positions:?} {dtype:?}");
                    assert_eq!(bits(&s), bits(&ds), "sin {positions:?} {dtype:?}");
                }
            }
        }
    }
}
