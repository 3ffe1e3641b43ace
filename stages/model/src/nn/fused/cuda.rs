//! Launches of the kernels in `kernels.cu` (compiled to PTX by `build.rs`). A kernel launch is
//! FFI, hence `unsafe`; each states what it reads and writes, all of it allocated or checked here.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, WithDType, bail};

use super::{AdamStep, Result, rows, span};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

fn kernel(dev: &CudaDevice, name: &str, dtype: DType) -> Result<CudaFunction> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        d => bail!("{name}: no CUDA kernel for {d:?} (f32 and bf16 have one)"),
    };
    Ok(dev
        .get_or_load_custom_func(&format!("{name}_{suffix}"), "dflash_fused", PTX)?
        .into_cuda_function())
}

/// One block per row, as many threads as the row has elements up to 1024.
fn per_row(rows: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (n.next_multiple_of(32).clamp(32, 1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride loop over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride reduction: few enough blocks that their atomic adds are cheap.
fn reducing(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

macro_rules! by_type {
    ($dtype:expr, $what:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            d => bail!("{}: no CUDA kernel for {d:?} (f32 and bf16 have one)", $what),
        }
    };
}

pub fn masked_softmax(
    s: &CudaStorage,
    l: &Layout,
    mask: &CudaStorage,
    lm: &Layout,
    scale: f32,
) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        s: &CudaStorage,
        l: &Layout,
        mask: &CudaStorage,
        lm: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        let dev = s.device();
        let (count, n) = rows(l);
        let x = s.as_cuda_slice::<T>()?.slice(span(l)?);
        let m = mask.as_cuda_slice::<T>()?.slice(span(lm)?);
        let out = unsafe { dev.alloc::<T>(count * n)? };
        let (n32, nq) = (n as u32, lm.dims()[0] as u32);
        let f = kernel(dev, "masked_softmax", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&x).arg(&m).arg(&out).arg(&n32).arg(&nq).arg(&scale);
        // SAFETY: the kernel reads count*n and nq*n elements and writes count*n.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(s.dtype(), "masked-softmax", go(s, l, mask, lm, scale))
}

pub fn softmax_grad(
    p: &CudaStorage,
    lp: &Layout,
    dp: &CudaStorage,
    ldp: &Layout,
    scale: f32,
) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        p: &CudaStorage,
        lp: &Layout,
        dp: &CudaStorage,
        ldp: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        let dev = p.device();
        let (count, n) = rows(lp);
        let ps = p.as_cuda_slice::<T>()?.slice(span(lp)?);
        let dps = dp.as_cuda_slice::<T>()?.slice(span(ldp)?);
        let out = unsafe { dev.alloc::<T>(count * n)? };
        let n32 = n as u32;
        let f = kernel(dev, "softmax_grad", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&ps).arg(&dps).arg(&out).arg(&n32).arg(&scale);
        // SAFETY: reads and writes count*n elements of each.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(p.dtype(), "masked-softmax-grad", go(p, lp, dp, ldp, scale))
}

pub fn cross_entropy(
    z: &CudaStorage,
    lz: &Layout,
    y: &CudaStorage,
    ly: &Layout,
) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        z: &CudaStorage,
        lz: &Layout,
        y: &CudaStorage,
        ly: &Layout,
    ) -> Result<CudaStorage> {
        let dev = z.device();
        let (count, n) = rows(lz);
        let zs = z.as_cuda_slice::<T>()?.slice(span(lz)?);
        let ys = y.as_cuda_slice::<u32>()?.slice(span(ly)?);
        let out = unsafe { dev.alloc::<f32>(count)? };
        let n32 = n as u32;
        let f = kernel(dev, "cross_entropy", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&zs).arg(&ys).arg(&out).arg(&n32);
        // SAFETY: reads count*n logits and count labels (checked < n), writes count.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(z.dtype(), "cross-entropy", go(z, lz, y, ly))
}

pub fn cross_entropy_grad(
    z: &CudaStorage,
    lz: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        z: &CudaStorage,
        lz: &Layout,
        y: &CudaStorage,
        ly: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> Result<CudaStorage> {
        let dev = z.device();
        let (count, n) = rows(lz);
        let zs = z.as_cuda_slice::<T>()?.slice(span(lz)?);
        let ys = y.as_cuda_slice::<u32>()?.slice(span(ly)?);
        let gs = g.as_cuda_slice::<f32>()?.slice(span(lg)?);
        let out = unsafe { dev.alloc::<T>(count * n)? };
        let n32 = n as u32;
        let f = kernel(dev, "cross_entropy_grad", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&zs).arg(&ys).arg(&gs).arg(&out).arg(&n32);
        // SAFETY: reads count*n logits, count labels and gradients; writes count*n.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(z.dtype(), "cross-entropy-grad", go(z, lz, y, ly, g, lg))
}

pub fn rms_norm(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        eps: f32,
    ) -> Result<CudaStorage> {
        let dev = x.device();
        let (count, n) = rows(lx);
        let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
        let ws = w.as_cuda_slice::<T>()?.slice(span(lw)?);
        let out = unsafe { dev.alloc::<T>(count * n)? };
        let n32 = n as u32;
        let f = kernel(dev, "rms_norm", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&xs).arg(&ws).arg(&out).arg(&n32).arg(&eps);
        // SAFETY: reads count*n and n elements, writes count*n.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(x.dtype(), "rms-norm", go(x, lx, w, lw, eps))
}

type Arg<'a> = (&'a CudaStorage, &'a Layout);

pub fn rms_norm_grad(x: Arg<'_>, w: Arg<'_>, dy: Arg<'_>, eps: f32) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        (x, lx): Arg<'_>,
        (w, lw): Arg<'_>,
        (dy, ldy): Arg<'_>,
        eps: f32,
    ) -> Result<CudaStorage> {
        let dev = x.device();
        let (count, n) = rows(lx);
        let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
        let ws = w.as_cuda_slice::<T>()?.slice(span(lw)?);
        let dys = dy.as_cuda_slice::<T>()?.slice(span(ldy)?);
        let out = unsafe { dev.alloc::<T>(count * n)? };
        let n32 = n as u32;
        let f = kernel(dev, "rms_norm_grad", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&xs).arg(&ws).arg(&dys).arg(&out).arg(&n32).arg(&eps);
        // SAFETY: reads count*n, n and count*n elements, writes count*n.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(x.0.dtype(), "rms-norm-grad", go(x, w, dy, eps))
}

pub fn rope(x: Arg<'_>, cos: Arg<'_>, sin: Arg<'_>, sign: f32) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        (x, lx): Arg<'_>,
        (c, lc): Arg<'_>,
        (s, ls): Arg<'_>,
        sign: f32,
    ) -> Result<CudaStorage> {
        let dev = x.device();
        let dims = lx.dims();
        let (n, d) = (dims[dims.len() - 2] as u32, dims[dims.len() - 1] as u32);
        let total = lx.shape().elem_count();
        let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
        let cs = c.as_cuda_slice::<T>()?.slice(span(lc)?);
        let ss = s.as_cuda_slice::<T>()?.slice(span(ls)?);
        let out = unsafe { dev.alloc::<T>(total)? };
        let f = kernel(dev, "rope", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&xs)
            .arg(&cs)
            .arg(&ss)
            .arg(&out)
            .arg(&total)
            .arg(&n)
            .arg(&d)
            .arg(&sign);
        // SAFETY: reads `total` elements and two n*d/2 tables, writes `total`.
        unsafe { b.launch(elementwise(total)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(x.0.dtype(), "rope", go(x, cos, sin, sign))
}

pub fn sum_squares(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        x: &CudaStorage,
        lx: &Layout,
    ) -> Result<CudaStorage> {
        let dev = x.device();
        let n = lx.shape().elem_count();
        let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
        let out = dev.alloc_zeros::<f32>(1)?;
        let f = kernel(dev, "sum_squares", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&xs).arg(&n).arg(&out);
        // SAFETY: reads n elements, adds into one.
        unsafe { b.launch(reducing(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(x.dtype(), "sum-squares", go(x, lx))
}

pub fn moment(
    m: &mut CudaStorage,
    lm: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    beta: f32,
    scale: f32,
    squared: bool,
) -> Result<()> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        m: &mut CudaStorage,
        lm: &Layout,
        g: &CudaStorage,
        lg: &Layout,
        beta: f32,
        scale: f32,
        squared: i32,
    ) -> Result<()> {
        let dev = g.device().clone();
        let r = span(lm)?;
        let n = r.len();
        if span(lg)?.len() != n {
            bail!("adamw-moment: gradient and moment sizes differ");
        }
        let gs = g.as_cuda_slice::<T>()?.slice(span(lg)?);
        let mut ms = m.as_cuda_slice_mut::<f32>()?.slice_mut(r);
        let f = kernel(&dev, "moment", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut ms)
            .arg(&gs)
            .arg(&n)
            .arg(&beta)
            .arg(&scale)
            .arg(&squared);
        // SAFETY: n elements of each.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(())
    }
    let squared = i32::from(squared);
    by_type!(
        g.dtype(),
        "adamw-moment",
        go(m, lm, g, lg, beta, scale, squared)
    )
}

pub fn adam_apply(
    p: &mut CudaStorage,
    lp: &Layout,
    m: &CudaStorage,
    lm: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    s: &AdamStep,
) -> Result<()> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        p: &mut CudaStorage,
        lp: &Layout,
        m: &CudaStorage,
        lm: &Layout,
        v: &CudaStorage,
        lv: &Layout,
        s: &AdamStep,
    ) -> Result<()> {
        let dev = m.device().clone();
        let r = span(lp)?;
        let n = r.len();
        if span(lm)?.len() != n || span(lv)?.len() != n {
            bail!("adamw-apply: parameter and moment sizes differ");
        }
        let ms = m.as_cuda_slice::<f32>()?.slice(span(lm)?);
        let vs = v.as_cuda_slice::<f32>()?.slice(span(lv)?);
        let mut ps = p.as_cuda_slice_mut::<T>()?.slice_mut(r);
        let (lr, decay) = (s.lr as f32, s.weight_decay as f32);
        let (c1, c2, eps) = (s.corrections.0 as f32, s.corrections.1 as f32, s.eps as f32);
        let f = kernel(&dev, "adam_apply", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut ps)
            .arg(&ms)
            .arg(&vs)
            .arg(&n)
            .arg(&lr)
            .arg(&decay);
        b.arg(&c1).arg(&c2).arg(&eps);
        // SAFETY: n elements of each.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(())
    }
    by_type!(p.dtype(), "adamw-apply", go(p, lp, m, lm, v, lv, s))
}

/// Let the device's memory pool keep what is freed (its release threshold at the maximum, as
/// PyTorch's caching allocator does) and stop candle tracking each buffer with two CUDA events:
/// a step allocates thousands of buffers, and by default the pool returns freed memory to the
/// driver at every synchronisation, so each step mapped its memory again.
pub fn prepare(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: FFI on the device's own default pool; `threshold` outlives the call.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&raw mut pool, cu_device)
            .result()
            .w()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut threshold).cast(),
        )
        .result()
        .w()?;
        // SAFETY: dflash runs every op on the device's one stream, so no buffer is used on
        // another stream before it is ready or freed while one still reads it.
        dev.disable_event_tracking();
    }
    Ok(())
}

pub fn swiglu(g: Arg<'_>, u: Arg<'_>) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        (g, lg): Arg<'_>,
        (u, lu): Arg<'_>,
    ) -> Result<CudaStorage> {
        let dev = g.device();
        let n = lg.shape().elem_count();
        let gs = g.as_cuda_slice::<T>()?.slice(span(lg)?);
        let us = u.as_cuda_slice::<T>()?.slice(span(lu)?);
        let out = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(dev, "swiglu", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&gs).arg(&us).arg(&out).arg(&n);
        // SAFETY: reads n elements of each input, writes n.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(g.0.dtype(), "swiglu", go(g, u))
}

pub fn swiglu_grad(g: Arg<'_>, u: Arg<'_>, dh: Arg<'_>, which: i32) -> Result<CudaStorage> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        (g, lg): Arg<'_>,
        (u, lu): Arg<'_>,
        (dh, ldh): Arg<'_>,
        which: i32,
    ) -> Result<CudaStorage> {
        let dev = g.device();
        let n = lg.shape().elem_count();
        let gs = g.as_cuda_slice::<T>()?.slice(span(lg)?);
        let us = u.as_cuda_slice::<T>()?.slice(span(lu)?);
        let ds = dh.as_cuda_slice::<T>()?.slice(span(ldh)?);
        let out = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(dev, "swiglu_grad", T::DTYPE)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&gs).arg(&us).arg(&ds).arg(&out).arg(&n).arg(&which);
        // SAFETY: reads n elements of each input, writes n.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_type!(g.0.dtype(), "swiglu-grad", go(g, u, dh, which))
}

/// RMSNorm's weight gradient as `[chunks, n]` f32 partial sums over ranges of rows (the caller
/// adds them up): each row's rstd first, then a thread per column and range of rows.
pub fn rms_norm_dw(x: Arg<'_>, dy: Arg<'_>, eps: f32) -> Result<(CudaStorage, usize)> {
    fn go<T: CudaDType + DeviceRepr + WithDType>(
        (x, lx): Arg<'_>,
        (dy, ldy): Arg<'_>,
        eps: f32,
    ) -> Result<(CudaStorage, usize)> {
        let dev = x.device();
        let (count, n) = rows(lx);
        let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
        let dys = dy.as_cuda_slice::<T>()?.slice(span(ldy)?);
        let rstd = unsafe { dev.alloc::<f32>(count)? };
        // Enough ranges to fill the GPU when rows are narrow, a few dozen rows each.
        let per_chunk = count.div_ceil(512).max(64).min(count.max(1));
        let chunks = count.div_ceil(per_chunk).max(1);
        let partial = unsafe { dev.alloc::<f32>(chunks * n)? };
        let (n32, rows32, per32) = (n as u32, count as u32, per_chunk as u32);
        let stream = dev.cuda_stream();
        let f = kernel(dev, "rms_rstd", T::DTYPE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xs).arg(&rstd).arg(&n32).arg(&eps);
        // SAFETY: reads count*n elements, writes count.
        unsafe { b.launch(per_row(count, n)) }.w()?;
        let f = kernel(dev, "rms_norm_dw", T::DTYPE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xs)
            .arg(&dys)
            .arg(&rstd)
            .arg(&partial)
            .arg(&rows32)
            .arg(&n32)
            .arg(&per32);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads count*n of x and dy and count of rstd; writes chunks*n.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(partial, dev.clone()), chunks))
    }
    by_type!(x.0.dtype(), "rms-norm-dw", go(x, dy, eps))
}
