//! Launches of the kernels in `kernels.cu` (compiled to PTX by `build.rs`). A kernel launch is
//! FFI, hence `unsafe`, in one place ([`launch!`]); each op below is its inputs as views, its
//! outputs allocated for the kernel to write, and one launch with the kernel's arguments in
//! order, saying what it reads and writes.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, bail};

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

/// [`elementwise`] for a kernel that takes 16 bytes a thread where it can (`kernels.cu`'s
/// `load16`): a thread per vector. Where the kernel falls back to an element a thread, its
/// grid-stride loop covers the rest.
fn by_vectors<T>(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(16 / std::mem::size_of::<T>()))
}

/// A row kernel's 16-byte form (`kernels.cu`'s `*_vec`) over `rows` rows of `n` elements of
/// `T`, if every input's rows start 16-byte aligned (allocations are; a view's start may not
/// be) and a row is whole vectors: its launch and the threads a row takes (`per`, a power of
/// two: at most 32 share a block of 256 with other rows, more are a block a row).
fn row_vectors<T>(rows: usize, n: usize, inputs: &[&Layout]) -> Option<(LaunchConfig, u32)> {
    let size = std::mem::size_of::<T>();
    let per_vector = 16 / size;
    let aligned = inputs.iter().all(|l| (l.start_offset() * size) % 16 == 0);
    if !aligned || n % per_vector != 0 || n == 0 || rows == 0 {
        return None;
    }
    let per = (n / per_vector).next_power_of_two().min(1024);
    let (grid, block) = if per <= 32 {
        (rows.div_ceil(256 / per), 256)
    } else {
        (rows, per)
    };
    let config = LaunchConfig {
        grid_dim: (u32::try_from(grid).ok()?, 1, 1),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    Some((config, per as u32))
}

/// A grid-stride reduction: few enough blocks that their atomic adds are cheap.
fn reducing(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Run `$body` with `$t` the Rust type of the CUDA kernels' float type `$dtype` (f32 or bf16),
/// else fail naming `$what`.
macro_rules! by_type {
    ($dtype:expr, $what:expr, |$t:ident| $body:block) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            d => bail!(
                "{}: no CUDA kernel for {d:?} (f32 and bf16 have one)",
                $what
            ),
        }
    };
}

/// Launch kernel `$name` (its `$t` instance) on `$dev`'s stream with `$cfg` and the arguments
/// in the kernel's own order (`kernels.cu`). Each call site says what the launch reads and
/// writes; all of it is allocated (`fresh`) or bounds-checked (`view`, `rows`) there.
macro_rules! launch {
    ($dev:expr, $name:expr, $t:ty, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let f = kernel($dev, $name, <$t as candle_core::WithDType>::DTYPE)?;
        let stream = $dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the kernel reads and writes only the ranges its arguments cover (see the
        // call site), each a live allocation of the element type the kernel declares.
        unsafe { b.launch($cfg) }.w()?;
    }};
}

/// A tensor's storage and layout, as a kernel argument.
type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// A contiguous input's elements as a device view of `E`.
fn view<E: CudaDType + DeviceRepr>((s, l): Arg<'_>) -> Result<CudaView<'_, E>> {
    Ok(s.as_cuda_slice::<E>()?.slice(span(l)?))
}

/// `n` elements of `E` for a kernel to write: every launch below that takes one writes all of
/// it before anything reads it.
fn fresh<E: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<E>> {
    // SAFETY: uninitialised memory, written in full by the kernel it is handed to.
    Ok(unsafe { dev.alloc::<E>(n)? })
}

/// A kernel's output as a tensor's storage.
fn stored<E: CudaDType>(dev: &CudaDevice, out: CudaSlice<E>) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(out, dev.clone())
}

/// Softmax over each row of `s * scale + mask` (the mask's `nq` rows repeat over the heads).
pub fn masked_softmax(s: Arg<'_>, mask: Arg<'_>, scale: f32) -> Result<CudaStorage> {
    by_type!(s.0.dtype(), "masked-softmax", |T| {
        let dev = s.0.device();
        let (count, n) = rows(s.1);
        let (x, m) = (view::<T>(s)?, view::<T>(mask)?);
        let out = fresh::<T>(dev, count * n)?;
        let (n32, nq) = (n as u32, mask.1.dims()[0] as u32);
        // Reads count*n and nq*n elements, writes count*n.
        launch!(
            dev,
            "masked_softmax",
            T,
            per_row(count, n),
            [&x, &m, &out, &n32, &nq, &scale]
        );
        Ok(stored(dev, out))
    })
}

/// The softmax's input gradient from its output `p` and the output's gradient `dp`.
pub fn softmax_grad(p: Arg<'_>, dp: Arg<'_>, scale: f32) -> Result<CudaStorage> {
    by_type!(p.0.dtype(), "masked-softmax-grad", |T| {
        let dev = p.0.device();
        let (count, n) = rows(p.1);
        let (ps, dps) = (view::<T>(p)?, view::<T>(dp)?);
        let out = fresh::<T>(dev, count * n)?;
        let n32 = n as u32;
        // Reads and writes count*n elements of each.
        launch!(
            dev,
            "softmax_grad",
            T,
            per_row(count, n),
            [&ps, &dps, &out, &n32, &scale]
        );
        Ok(stored(dev, out))
    })
}

/// Per row of logits `z`: logsumexp minus the label's logit, in f32.
pub fn cross_entropy(z: Arg<'_>, y: Arg<'_>) -> Result<CudaStorage> {
    by_type!(z.0.dtype(), "cross-entropy", |T| {
        let dev = z.0.device();
        let (count, n) = rows(z.1);
        let (zs, ys) = (view::<T>(z)?, view::<u32>(y)?);
        let out = fresh::<f32>(dev, count)?;
        let n32 = n as u32;
        // Reads count*n logits and count labels (checked < n), writes count.
        launch!(
            dev,
            "cross_entropy",
            T,
            per_row(count, n),
            [&zs, &ys, &out, &n32]
        );
        Ok(stored(dev, out))
    })
}

/// The cross-entropy's gradient in the logits, scaled per row by `g` (f32).
pub fn cross_entropy_grad(z: Arg<'_>, y: Arg<'_>, g: Arg<'_>) -> Result<CudaStorage> {
    by_type!(z.0.dtype(), "cross-entropy-grad", |T| {
        let dev = z.0.device();
        let (count, n) = rows(z.1);
        let (zs, ys, gs) = (view::<T>(z)?, view::<u32>(y)?, view::<f32>(g)?);
        let out = fresh::<T>(dev, count * n)?;
        let n32 = n as u32;
        // Reads count*n logits, count labels and gradients; writes count*n.
        launch!(
            dev,
            "cross_entropy_grad",
            T,
            per_row(count, n),
            [&zs, &ys, &gs, &out, &n32]
        );
        Ok(stored(dev, out))
    })
}

/// RMSNorm of each row of `x`, times `w`.
pub fn rms_norm(x: Arg<'_>, w: Arg<'_>, eps: f32) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "rms-norm", |T| {
        let dev = x.0.device();
        let (count, n) = rows(x.1);
        let (xs, ws) = (view::<T>(x)?, view::<T>(w)?);
        let out = fresh::<T>(dev, count * n)?;
        let n32 = n as u32;
        // Reads count*n and n elements, writes count*n.
        if let Some((cfg, per)) = row_vectors::<T>(count, n, &[x.1, w.1]) {
            launch!(
                dev,
                "rms_norm_vec",
                T,
                cfg,
                [&xs, &ws, &out, &count, &n32, &per, &eps]
            );
        } else {
            launch!(
                dev,
                "rms_norm",
                T,
                per_row(count, n),
                [&xs, &ws, &out, &n32, &eps]
            );
        }
        Ok(stored(dev, out))
    })
}

/// A residual's sum and its RMSNorm, `[2, count, n]`: the sums, then the normed rows.
pub fn add_rms_norm(x: Arg<'_>, r: Arg<'_>, w: Arg<'_>, eps: f32) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "add-rms-norm", |T| {
        let dev = x.0.device();
        let (count, n) = rows(x.1);
        let (xs, rs, ws) = (view::<T>(x)?, view::<T>(r)?, view::<T>(w)?);
        let out = fresh::<T>(dev, 2 * count * n)?;
        let n32 = n as u32;
        // Reads count*n elements of x and of r and n of w, writes 2*count*n.
        if let Some((cfg, per)) = row_vectors::<T>(count, n, &[x.1, r.1, w.1]) {
            launch!(
                dev,
                "add_rms_norm_vec",
                T,
                cfg,
                [&xs, &rs, &ws, &out, &count, &n32, &per, &eps]
            );
        } else {
            launch!(
                dev,
                "add_rms_norm",
                T,
                per_row(count, n),
                [&xs, &rs, &ws, &out, &count, &n32, &eps]
            );
        }
        Ok(stored(dev, out))
    })
}

/// RMSNorm's input gradient.
pub fn rms_norm_grad(x: Arg<'_>, w: Arg<'_>, dy: Arg<'_>, eps: f32) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "rms-norm-grad", |T| {
        let dev = x.0.device();
        let (count, n) = rows(x.1);
        let (xs, ws, dys) = (view::<T>(x)?, view::<T>(w)?, view::<T>(dy)?);
        let out = fresh::<T>(dev, count * n)?;
        let n32 = n as u32;
        // Reads count*n, n and count*n elements, writes count*n.
        if let Some((cfg, per)) = row_vectors::<T>(count, n, &[x.1, w.1, dy.1]) {
            launch!(
                dev,
                "rms_norm_grad_vec",
                T,
                cfg,
                [&xs, &ws, &dys, &out, &count, &n32, &per, &eps]
            );
        } else {
            launch!(
                dev,
                "rms_norm_grad",
                T,
                per_row(count, n),
                [&xs, &ws, &dys, &out, &n32, &eps]
            );
        }
        Ok(stored(dev, out))
    })
}

/// Rotary embedding of `x` (`[.., n, d]`) by the `cos` / `sin` tables; `sign` -1 undoes it.
pub fn rope(x: Arg<'_>, cos: Arg<'_>, sin: Arg<'_>, sign: f32) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "rope", |T| {
        let dev = x.0.device();
        let dims = x.1.dims();
        let (n, d) = (dims[dims.len() - 2] as u32, dims[dims.len() - 1] as u32);
        let total = x.1.shape().elem_count();
        let (xs, cs, ss) = (view::<T>(x)?, view::<T>(cos)?, view::<T>(sin)?);
        let out = fresh::<T>(dev, total)?;
        // Reads `total` elements and two n*d/2 tables, writes `total` (a thread a pair of
        // vectors where it can: half as many threads as by_vectors gives).
        launch!(
            dev,
            "rope",
            T,
            by_vectors::<T>(total.div_ceil(2)),
            [&xs, &cs, &ss, &out, &total, &n, &d, &sign]
        );
        Ok(stored(dev, out))
    })
}

/// The sum of the squares of `x`'s elements, one f32.
pub fn sum_squares(x: Arg<'_>) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "sum-squares", |T| {
        let dev = x.0.device();
        let n = x.1.shape().elem_count();
        let xs = view::<T>(x)?;
        let out = dev.alloc_zeros::<f32>(1)?;
        // Reads n elements, adds into one.
        launch!(dev, "sum_squares", T, reducing(n), [&xs, &n, &out]);
        Ok(stored(dev, out))
    })
}

/// An AdamW moment, in place: `m = beta * m + scale * g` (`g * g` when `squared`).
pub fn moment(
    m: &mut CudaStorage,
    lm: &Layout,
    g: Arg<'_>,
    beta: f32,
    scale: f32,
    squared: bool,
) -> Result<()> {
    let squared = i32::from(squared);
    by_type!(g.0.dtype(), "adamw-moment", |T| {
        let dev = g.0.device().clone();
        let r = span(lm)?;
        let n = r.len();
        if span(g.1)?.len() != n {
            bail!("adamw-moment: gradient and moment sizes differ");
        }
        let gs = view::<T>(g)?;
        let mut ms = m.as_cuda_slice_mut::<f32>()?.slice_mut(r);
        // n elements of each.
        launch!(
            &dev,
            "moment",
            T,
            elementwise(n),
            [&mut ms, &gs, &n, &beta, &scale, &squared]
        );
        Ok(())
    })
}

/// AdamW's update of the parameters `p`, in place, from both moments.
pub fn adam_apply(
    p: &mut CudaStorage,
    lp: &Layout,
    m: Arg<'_>,
    v: Arg<'_>,
    s: &AdamStep,
) -> Result<()> {
    by_type!(p.dtype(), "adamw-apply", |T| {
        let dev = m.0.device().clone();
        let r = span(lp)?;
        let n = r.len();
        if span(m.1)?.len() != n || span(v.1)?.len() != n {
            bail!("adamw-apply: parameter and moment sizes differ");
        }
        let (ms, vs) = (view::<f32>(m)?, view::<f32>(v)?);
        let mut ps = p.as_cuda_slice_mut::<T>()?.slice_mut(r);
        let (lr, decay) = (s.lr as f32, s.weight_decay as f32);
        let (c1, c2, eps) = (s.corrections.0 as f32, s.corrections.1 as f32, s.eps as f32);
        // n elements of each.
        launch!(
            &dev,
            "adam_apply",
            T,
            elementwise(n),
            [&mut ps, &ms, &vs, &n, &lr, &decay, &c1, &c2, &eps]
        );
        Ok(())
    })
}

/// AdamW's whole step for one parameter in one launch ([`super::adamw_update`] on a GPU): `p`
/// (the parameter, its dtype `T`), `m` and `v` (f32) updated in place from the gradient `g`
/// (`T`, contiguous), where the CPU's three in-place ops read the gradient twice and the moments
/// twice. Three tensors written by one kernel is past what candle's in-place ops take (one
/// output, two inputs), so this launches on the tensors' device buffers directly.
pub fn adamw_fused(
    p: &candle_core::Tensor,
    g: &candle_core::Tensor,
    m: &candle_core::Tensor,
    v: &candle_core::Tensor,
    s: &AdamStep,
) -> Result<()> {
    if g.dtype() != p.dtype() {
        bail!(
            "adamw-fused: a {:?} parameter with a {:?} gradient",
            p.dtype(),
            g.dtype()
        );
    }
    adamw_launch(p, g, m, v, None, s)
}

/// [`adamw_fused`] for f32 master weights `p` and the step's bf16 gradient `g`, writing the
/// updated weights' bf16 copy into `low` too (`adamw_master_bf16`).
pub fn adamw_master(
    p: &candle_core::Tensor,
    g: &candle_core::Tensor,
    m: &candle_core::Tensor,
    v: &candle_core::Tensor,
    low: &candle_core::Tensor,
    s: &AdamStep,
) -> Result<()> {
    if (p.dtype(), g.dtype(), low.dtype()) != (DType::F32, DType::BF16, DType::BF16) {
        bail!(
            "adamw-master: a {:?} parameter, {:?} gradient and {:?} copy (f32, bf16, bf16 run here)",
            p.dtype(),
            g.dtype(),
            low.dtype()
        );
    }
    adamw_launch(p, g, m, v, Some(low), s)
}

/// The launch of `adamw_fused_T` (no `low`) or `adamw_master_bf16` (with it).
fn adamw_launch(
    p: &candle_core::Tensor,
    g: &candle_core::Tensor,
    m: &candle_core::Tensor,
    v: &candle_core::Tensor,
    low: Option<&candle_core::Tensor>,
    s: &AdamStep,
) -> Result<()> {
    use candle_core::Storage;
    let bf16_moments = (m.dtype(), v.dtype()) == (DType::BF16, DType::BF16);
    if !bf16_moments && (m.dtype(), v.dtype()) != (DType::F32, DType::F32) {
        bail!(
            "adamw: {:?} / {:?} moments (both f32 or both bf16 run here)",
            m.dtype(),
            v.dtype()
        );
    }
    // Distinct allocations (the optimizer's moments and copies are its own, the gradient the
    // backward pass's), so the kernel's writes to p, m, v and low alias nothing it reads
    // elsewhere.
    let (ps, pl) = p.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let (ms, ml) = m.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let low = low.map(|t| t.storage_and_layout());
    let (Storage::Cuda(ps), Storage::Cuda(gs), Storage::Cuda(ms), Storage::Cuda(vs)) =
        (&*ps, &*gs, &*ms, &*vs)
    else {
        bail!(
            "adamw: the parameter, gradient and moments are on {:?}, {:?}, {:?}, {:?}, not all on the GPU",
            p.device(),
            g.device(),
            m.device(),
            v.device()
        );
    };
    let (rp, rg, rm, rv) = (span(pl)?, span(gl)?, span(ml)?, span(vl)?);
    let n = rp.len();
    if rg.len() != n || rm.len() != n || rv.len() != n {
        bail!("adamw: parameter, gradient and moment sizes differ");
    }
    let dev = ps.device().clone();
    let (b1, b2, scale) = (s.betas.0 as f32, s.betas.1 as f32, s.clip_scale as f32);
    let (lr, decay) = (s.lr as f32, s.weight_decay as f32);
    let (c1, c2, eps) = (s.corrections.0 as f32, s.corrections.1 as f32, s.eps as f32);
    if let Some((ls, ll)) = &low {
        let Storage::Cuda(ls) = &**ls else {
            bail!("adamw-master: the bf16 copy is not on the GPU");
        };
        let rl = span(ll)?;
        if rl.len() != n {
            bail!("adamw-master: the copy's size differs from the parameter's");
        }
        let pv = ps.as_cuda_slice::<f32>()?.slice(rp);
        let gv = gs.as_cuda_slice::<half::bf16>()?.slice(rg);
        let lv = ls.as_cuda_slice::<half::bf16>()?.slice(rl);
        if bf16_moments {
            let mv = ms.as_cuda_slice::<half::bf16>()?.slice(rm);
            let vv = vs.as_cuda_slice::<half::bf16>()?.slice(rv);
            let (seed_m, seed_v) = super::adamw::moment_seeds(s.rounding_seed);
            // Reads n elements of p, g, m and v; writes n of p, m, v and low (each within its
            // view: the spans checked above); eight a thread where all are 16-byte aligned.
            launch!(
                &dev,
                "adamw_master_sr",
                half::bf16,
                by_vectors::<half::bf16>(n),
                [
                    &pv, &gv, &mv, &vv, &lv, &n, &b1, &b2, &scale, &lr, &decay, &c1, &c2, &eps,
                    &seed_m, &seed_v
                ]
            );
            return Ok(());
        }
        let mv = ms.as_cuda_slice::<f32>()?.slice(rm);
        let vv = vs.as_cuda_slice::<f32>()?.slice(rv);
        // Reads n elements of p, g, m and v; writes n of p, m, v and low (each within its view:
        // the spans checked above).
        // Eight elements a thread where every operand is 16-byte aligned and n whole vectors,
        // else the same threads loop over the elements.
        launch!(
            &dev,
            "adamw_master",
            half::bf16,
            by_vectors::<half::bf16>(n),
            [
                &pv, &gv, &mv, &vv, &lv, &n, &b1, &b2, &scale, &lr, &decay, &c1, &c2, &eps
            ]
        );
        return Ok(());
    }
    if bf16_moments {
        let mv = ms.as_cuda_slice::<half::bf16>()?.slice(rm);
        let vv = vs.as_cuda_slice::<half::bf16>()?.slice(rv);
        let (seed_m, seed_v) = super::adamw::moment_seeds(s.rounding_seed);
        return by_type!(p.dtype(), "adamw-sr", |T| {
            let pv = ps.as_cuda_slice::<T>()?.slice(rp);
            let gv = gs.as_cuda_slice::<T>()?.slice(rg);
            // Reads n elements of each of p, g, m and v; writes n of p, m and v (each within
            // its view: the spans checked above).
            launch!(
                &dev,
                "adamw_sr",
                T,
                elementwise(n),
                [
                    &pv, &gv, &mv, &vv, &n, &b1, &b2, &scale, &lr, &decay, &c1, &c2, &eps, &seed_m,
                    &seed_v
                ]
            );
            Ok(())
        });
    }
    let mv = ms.as_cuda_slice::<f32>()?.slice(rm);
    let vv = vs.as_cuda_slice::<f32>()?.slice(rv);
    by_type!(p.dtype(), "adamw-fused", |T| {
        let pv = ps.as_cuda_slice::<T>()?.slice(rp);
        let gv = gs.as_cuda_slice::<T>()?.slice(rg);
        // Reads n elements of each of p, g, m and v; writes n of p, m and v (each within its
        // view: the spans checked above).
        launch!(
            &dev,
            "adamw_fused",
            T,
            elementwise(n),
            [
                &pv, &gv, &mv, &vv, &n, &b1, &b2, &scale, &lr, &decay, &c1, &c2, &eps
            ]
        );
        Ok(())
    })
}

/// Let the device's memory pool keep what is freed (its release threshold at the maximum, as
/// PyTorch's caching allocator does) and stop candle tracking each buffer with two CUDA events:
/// a step allocates thousands of buffers, and by default the pool returns freed memory to the
/// driver at every synchronisation, so each step mapped its memory again.
pub fn prepare(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(dev)?;
    let mut threshold = u64::MAX;
    // SAFETY: FFI on the device's own default pool; `threshold` outlives the call.
    unsafe {
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

/// The device's default memory pool (where candle's stream-ordered allocations come from).
fn default_pool(
    dev: &CudaDevice,
) -> Result<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: FFI writing the device's default pool into `pool`, which outlives the call.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&raw mut pool, cu_device)
            .result()
            .w()?;
    }
    Ok(pool)
}

/// [`super::pool_peak_bytes`]: the default pool's used-memory high-water mark, then reset.
pub fn pool_peak_bytes(dev: &CudaDevice) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(dev)?;
    let mut high = 0u64;
    let mut zero = 0u64;
    // SAFETY: FFI on the device's own default pool; `high` and `zero` outlive the calls (the
    // attribute is a cuuint64_t; setting the high-water mark takes only 0).
    unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&raw mut high).cast(),
        )
        .result()
        .w()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&raw mut zero).cast(),
        )
        .result()
        .w()?;
    }
    Ok(high)
}

/// The `k` largest entries' indices (u32) of each row of `z`, largest first.
pub fn top_k(z: Arg<'_>, k: usize) -> Result<CudaStorage> {
    by_type!(z.0.dtype(), "top-k", |T| {
        let dev = z.0.device();
        let (count, n) = rows(z.1);
        let zs = view::<T>(z)?;
        let out = fresh::<u32>(dev, count * k)?;
        let (n32, k32) = (n as u32, k as u32);
        // One block of 256 threads per row (the kernel's reduction wants a power of two).
        let cfg = LaunchConfig {
            grid_dim: (count as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Reads count*n elements, writes count*k indices (k <= n, checked by the caller).
        launch!(dev, "top_k", T, cfg, [&zs, &out, &n32, &k32]);
        Ok(stored(dev, out))
    })
}

/// The LM head's rows (`head_rows_T`): for logits `z` `[count, n]` (contiguous, its own
/// storage: it is overwritten) and `labels` `[count]` (`u32`, each < n), each row's
/// cross-entropy into `nll` `[count]` (f32) and argmax into `top` `[count, 1]` (`u32`), then
/// `softmax - onehot` in place of the logits. Several outputs and one written in place, past what
/// candle's custom ops take, so this launches on the tensors' device buffers directly.
pub fn head_rows(
    z: &candle_core::Tensor,
    labels: &candle_core::Tensor,
    nll: &candle_core::Tensor,
    top: &candle_core::Tensor,
) -> Result<()> {
    use candle_core::Storage;
    let (count, n) = z.dims2()?;
    if labels.dims() != [count]
        || nll.dims() != [count]
        || top.dims() != [count, 1]
        || (labels.dtype(), nll.dtype(), top.dtype()) != (DType::U32, DType::F32, DType::U32)
    {
        bail!(
            "head-rows: logits {:?}, labels {:?} {:?}, nll {:?} {:?}, top {:?} {:?}",
            z.dims(),
            labels.dims(),
            labels.dtype(),
            nll.dims(),
            nll.dtype(),
            top.dims(),
            top.dtype()
        );
    }
    let (zs, zl) = z.storage_and_layout();
    let (ys, yl) = labels.storage_and_layout();
    let (ns, nl) = nll.storage_and_layout();
    let (ts, tl) = top.storage_and_layout();
    let (Storage::Cuda(zs), Storage::Cuda(ys), Storage::Cuda(ns), Storage::Cuda(ts)) =
        (&*zs, &*ys, &*ns, &*ts)
    else {
        bail!("head-rows: the logits, labels and outputs are not all on the GPU");
    };
    let (rz, ry, rn, rt) = (span(zl)?, span(yl)?, span(nl)?, span(tl)?);
    if rz.len() != count * n || ry.len() != count || rn.len() != count || rt.len() != count {
        bail!("head-rows: non-contiguous operands");
    }
    let dev = zs.device().clone();
    let yv = ys.as_cuda_slice::<u32>()?.slice(ry);
    let nv = ns.as_cuda_slice::<f32>()?.slice(rn);
    let tv = ts.as_cuda_slice::<u32>()?.slice(rt);
    let n32 = n as u32;
    by_type!(z.dtype(), "head-rows", |T| {
        let zv = zs.as_cuda_slice::<T>()?.slice(rz);
        // Reads count*n logits and count labels (< n, checked by the caller); writes count*n
        // gradients over them and count losses and indices.
        launch!(
            &dev,
            "head_rows",
            T,
            per_row(count, n),
            [&zv, &yv, &nv, &tv, &n32]
        );
        Ok(())
    })
}

/// Rows `ids` of `table` `[rows, r]`.
pub fn gather_rows(table: Arg<'_>, ids: Arg<'_>) -> Result<CudaStorage> {
    by_type!(table.0.dtype(), "gather-rows", |T| {
        let dev = table.0.device();
        let (count, r) = rows(table.1);
        let n = ids.1.shape().elem_count();
        let (ts, is) = (view::<T>(table)?, view::<u32>(ids)?);
        let out = fresh::<T>(dev, n * r)?;
        let (r32, count32) = (r as u32, count as u32);
        // Reads n ids and, for each below `count`, its table row; writes all n*r.
        launch!(
            dev,
            "gather_rows",
            T,
            elementwise(n * r),
            [&ts, &is, &out, &n, &r32, &count32]
        );
        Ok(stored(dev, out))
    })
}

/// `past` `[h, len, d]`'s positions `keep` (u32, each below `len`: the caller's), then `added`
/// `[h, n, d]`: `[h, kept + n, d]`.
pub fn keep_append(past: Arg<'_>, keep: Arg<'_>, added: Arg<'_>) -> Result<CudaStorage> {
    by_type!(past.0.dtype(), "keep-append", |T| {
        let dev = past.0.device();
        let (&[h, len, d], &[h2, n, d2]) = (past.1.dims(), added.1.dims()) else {
            bail!(
                "keep-append: {:?} and {:?}, not 3-D",
                past.1.dims(),
                added.1.dims()
            );
        };
        if h != h2 || d != d2 {
            bail!("keep-append: heads {h} / {h2}, width {d} / {d2}");
        }
        let kept = keep.1.shape().elem_count();
        let total = h * (kept + n) * d;
        let (ps, ks, adds) = (view::<T>(past)?, view::<u32>(keep)?, view::<T>(added)?);
        let out = fresh::<T>(dev, total)?;
        let (len32, kept32, n32, d32) = (len as u32, kept as u32, n as u32, d as u32);
        // Reads kept ids, h*kept*d elements of past (rows below len) and all of added; writes
        // all of out.
        launch!(
            dev,
            "keep_append",
            T,
            elementwise(total),
            [&ps, &ks, &adds, &out, &total, &len32, &kept32, &n32, &d32]
        );
        Ok(stored(dev, out))
    })
}

/// A `[count, r]` table of zeros with each row of `grad` `[n, r]` added at its id.
pub fn scatter_add_rows(grad: Arg<'_>, ids: Arg<'_>, count: usize) -> Result<CudaStorage> {
    by_type!(grad.0.dtype(), "scatter-add-rows", |T| {
        let dev = grad.0.device();
        let (n, r) = rows(grad.1);
        let (gs, is) = (view::<T>(grad)?, view::<u32>(ids)?);
        let out = dev.alloc_zeros::<T>(count * r)?;
        let (r32, count32) = (r as u32, count as u32);
        // Reads n*r gradients and n ids, adds into count*r (an id past `count` adds nothing).
        launch!(
            dev,
            "scatter_add_rows",
            T,
            elementwise(n * r),
            [&gs, &is, &out, &n, &r32, &count32]
        );
        Ok(stored(dev, out))
    })
}

/// SwiGLU's product `silu(g) * u`.
pub fn swiglu(g: Arg<'_>, u: Arg<'_>) -> Result<CudaStorage> {
    by_type!(g.0.dtype(), "swiglu", |T| {
        let dev = g.0.device();
        let n = g.1.shape().elem_count();
        let (gs, us) = (view::<T>(g)?, view::<T>(u)?);
        let out = fresh::<T>(dev, n)?;
        // Reads n elements of each input, writes n.
        launch!(dev, "swiglu", T, by_vectors::<T>(n), [&gs, &us, &out, &n]);
        Ok(stored(dev, out))
    })
}

/// `a + b`, contiguous operands of one shape (`add.rs`).
pub fn add(a: Arg<'_>, b: Arg<'_>) -> Result<CudaStorage> {
    by_type!(a.0.dtype(), "add", |T| {
        let dev = a.0.device();
        let n = a.1.shape().elem_count();
        if b.1.shape().elem_count() != n {
            bail!("add: {:?} and {:?}", a.1.dims(), b.1.dims());
        }
        let (av, bv) = (view::<T>(a)?, view::<T>(b)?);
        let out = fresh::<T>(dev, n)?;
        // Reads n elements of each, writes n.
        launch!(dev, "add", T, by_vectors::<T>(n), [&av, &bv, &out, &n]);
        Ok(stored(dev, out))
    })
}

/// SwiGLU over rows holding the gate's `f` outputs then the up projection's: `[rows, f]` out.
pub fn swiglu_packed(gu: Arg<'_>, f: usize) -> Result<CudaStorage> {
    by_type!(gu.0.dtype(), "swiglu-packed", |T| {
        let dev = gu.0.device();
        let n = gu.1.shape().elem_count() / 2;
        let src = view::<T>(gu)?;
        let out = fresh::<T>(dev, n)?;
        let f32_ = f as u32;
        // Reads 2n elements, writes n.
        launch!(
            dev,
            "swiglu_packed",
            T,
            by_vectors::<T>(n),
            [&src, &out, &n, &f32_]
        );
        Ok(stored(dev, out))
    })
}

/// A Gated DeltaNet layer's causal convolution and SiLU (`conv.rs`), f32 out.
pub fn causal_conv_silu(x: Arg<'_>, w: Arg<'_>, k: usize) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "causal-conv-silu", |T| {
        let dev = x.0.device();
        let (m, c) = rows(x.1);
        let n = (m - k + 1) * c;
        let (xs, ws) = (view::<T>(x)?, view::<T>(w)?);
        let out = fresh::<f32>(dev, n)?;
        let (c32, k32) = (c as u32, k as u32);
        // Reads m*c inputs (each k times, from cache) and c*k weights, writes n outputs.
        launch!(
            dev,
            "causal_conv_silu",
            T,
            elementwise(n),
            [&xs, &ws, &out, &n, &c32, &k32]
        );
        Ok(stored(dev, out))
    })
}

/// The chunked Gated DeltaNet's pass over its chunks (`scan.rs`): a block per head and tile of
/// 32 value columns, 256 threads, the state's tile and the chunk's new values in shared memory.
pub fn delta_scan(
    rows: Arg<'_>,
    tails: Arg<'_>,
    state: Arg<'_>,
    s: super::scan::ScanShape,
) -> Result<CudaStorage> {
    by_type!(rows.0.dtype(), "delta-scan", |T| {
        let dev = rows.0.device();
        let (rs, ts, ss) = (view::<T>(rows)?, view::<T>(tails)?, view::<T>(state)?);
        let out = fresh::<T>(dev, s.heads * (s.chunks * s.chunk + s.dk) * s.dv)?;
        let cfg = LaunchConfig {
            grid_dim: (s.heads as u32, s.dv.div_ceil(32) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((s.dk + s.chunk) * 32 * 4) as u32,
        };
        let (c, h, l, dk, dv) = (
            s.chunks as u32,
            s.heads as u32,
            s.chunk as u32,
            s.dk as u32,
            s.dv as u32,
        );
        // Reads the packed rows and tails once per tile and the state once; writes every
        // chunk's rows and the final state: all of `out`.
        launch!(
            dev,
            "delta_scan",
            T,
            cfg,
            [&rs, &ts, &ss, &out, &c, &h, &l, &dk, &dv]
        );
        Ok(stored(dev, out))
    })
}

/// SwiGLU's gradient in its gate (`which` 0) or its up projection (1).
pub fn swiglu_grad(g: Arg<'_>, u: Arg<'_>, dh: Arg<'_>, which: i32) -> Result<CudaStorage> {
    by_type!(g.0.dtype(), "swiglu-grad", |T| {
        let dev = g.0.device();
        let n = g.1.shape().elem_count();
        let (gs, us, ds) = (view::<T>(g)?, view::<T>(u)?, view::<T>(dh)?);
        let out = fresh::<T>(dev, n)?;
        // Reads n elements of each input, writes n.
        launch!(
            dev,
            "swiglu_grad",
            T,
            by_vectors::<T>(n),
            [&gs, &us, &ds, &out, &n, &which]
        );
        Ok(stored(dev, out))
    })
}

/// RMSNorm's weight gradient as `[chunks, n]` f32 partial sums over ranges of rows (the caller
/// adds them up): each row's rstd first, then a thread per column and range of rows.
pub fn rms_norm_dw(x: Arg<'_>, dy: Arg<'_>, eps: f32) -> Result<(CudaStorage, usize)> {
    by_type!(x.0.dtype(), "rms-norm-dw", |T| {
        let dev = x.0.device();
        let (count, n) = rows(x.1);
        let (xs, dys) = (view::<T>(x)?, view::<T>(dy)?);
        let rstd = fresh::<f32>(dev, count)?;
        // Enough ranges to fill the GPU when rows are narrow, a few dozen rows each.
        let per_chunk = count.div_ceil(512).max(64).min(count.max(1));
        let chunks = count.div_ceil(per_chunk).max(1);
        let partial = fresh::<f32>(dev, chunks * n)?;
        let (n32, rows32, per32) = (n as u32, count as u32, per_chunk as u32);
        // Reads count*n elements, writes count.
        launch!(
            dev,
            "rms_rstd",
            T,
            per_row(count, n),
            [&xs, &rstd, &n32, &eps]
        );
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Reads count*n of x and dy and count of rstd; writes chunks*n.
        launch!(
            dev,
            "rms_norm_dw",
            T,
            cfg,
            [&xs, &dys, &rstd, &partial, &rows32, &n32, &per32]
        );
        Ok((stored(dev, partial), chunks))
    })
}

/// A 3-D view `src` (any strides, any start) copied into a contiguous `[d0, d1, d2]`.
pub fn strided_copy3(src: Arg<'_>) -> Result<CudaStorage> {
    by_type!(src.0.dtype(), "strided-copy3", |T| {
        let dev = src.0.device();
        let l = src.1;
        let (&[d0, d1, d2], &[s0, s1, s2]) = (l.dims(), l.stride()) else {
            bail!("strided-copy3: a {}-D view", l.dims().len());
        };
        let n = d0 * d1 * d2;
        // The view's furthest element, so the kernel's reads stay inside the slice below.
        let reach = l.start_offset()
            + [(d0, s0), (d1, s1), (d2, s2)]
                .iter()
                .map(|&(d, s)| d.saturating_sub(1) * s)
                .sum::<usize>();
        let whole = src.0.as_cuda_slice::<T>()?;
        if n == 0 {
            bail!("strided-copy3: an empty view");
        }
        if reach >= whole.len() {
            bail!(
                "strided-copy3: a view past its storage ({reach} of {})",
                whole.len()
            );
        }
        let from = whole.slice(l.start_offset()..reach + 1);
        let out = fresh::<T>(dev, n)?;
        let (d1_32, d2_32) = (d1 as u32, d2 as u32);
        // Reads the view's n elements (all within `from`), writes all n.
        launch!(
            dev,
            "strided_copy3",
            T,
            by_vectors::<T>(n),
            [&from, &out, &n, &d1_32, &d2_32, &s0, &s1, &s2]
        );
        Ok(stored(dev, out))
    })
}

/// Each head's `per` elements of `x` times that head's entry of `s`.
/// Each row of `cum` (`[.., l]`) as its `[l, l]` decay matrix (see `kernels.cu`).
pub fn chunk_decay(cum: Arg<'_>, l: usize) -> Result<CudaStorage> {
    by_type!(cum.0.dtype(), "chunk-decay", |T| {
        let dev = cum.0.device();
        let total = cum.1.shape().elem_count() * l;
        let src = view::<T>(cum)?;
        let out = fresh::<T>(dev, total)?;
        let l32 = l as u32;
        // Reads every cumulative sum (each l times), writes every element of out.
        launch!(
            dev,
            "chunk_decay",
            T,
            elementwise(total),
            [&src, &out, &total, &l32]
        );
        Ok(stored(dev, out))
    })
}

/// `(I + A)^-1` for each `[n, n]` matrix of `a` (strictly lower triangular), one block of `n`
/// threads each, both matrices in shared memory.
pub fn unit_lower_inverse(a: Arg<'_>, n: usize) -> Result<CudaStorage> {
    by_type!(a.0.dtype(), "unit-lower-inverse", |T| {
        let dev = a.0.device();
        let total = a.1.shape().elem_count();
        let matrices = total / (n * n).max(1);
        if n == 0 || n > 64 || matrices * n * n != total {
            bail!(
                "unit-lower-inverse: {total} elements are not whole {n} x {n} matrices of at most 64"
            );
        }
        let src = view::<T>(a)?;
        let out = fresh::<T>(dev, total)?;
        let n32 = n as u32;
        let cfg = LaunchConfig {
            grid_dim: (matrices as u32, 1, 1),
            block_dim: (n32, 1, 1),
            shared_mem_bytes: (2 * n * n * std::mem::size_of::<f32>()) as u32,
        };
        // Reads the strictly lower part of every matrix, writes every element of out.
        launch!(dev, "unit_lower_inverse", T, cfg, [&src, &out, &n32]);
        Ok(stored(dev, out))
    })
}

pub fn scale_by_head(x: Arg<'_>, s: Arg<'_>) -> Result<CudaStorage> {
    by_type!(x.0.dtype(), "scale-by-head", |T| {
        let dev = x.0.device();
        let n = x.1.shape().elem_count();
        let heads = s.1.shape().elem_count();
        let per = n / heads.max(1);
        let (xs, ss) = (view::<T>(x)?, view::<T>(s)?);
        let out = fresh::<T>(dev, n)?;
        // Reads n elements and `heads` scales, writes n.
        launch!(
            dev,
            "scale_by_head",
            T,
            elementwise(n),
            [&xs, &ss, &out, &n, &per]
        );
        Ok(stored(dev, out))
    })
}
