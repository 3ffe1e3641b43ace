//! Flash attention on NVIDIA GPUs (`flash.cu`): the frozen target's causal attention and the
//! drafter's block attention without ever writing a score matrix.
//!
//! Written out, the scores are the largest tensors of a training step: the target's
//! `[32, 3072, 3072]` per layer, the drafter's `[32, blocks x 16, context + 16]` per layer, each
//! with copies for the mask, the softmax and the backward pass. These kernels keep a running
//! softmax in registers instead, skip the key tiles a row cannot see (half the target's keys,
//! and on average half of the context for a block), and save only each row's log-sum-exp for
//! the backward pass, which recomputes the probabilities.
//!
//! They take bf16 operands on a CUDA device with head widths of 64 or 128, blocks of 16 rows
//! and at most 8 query heads per key/value head ([`supports`]); everything else (CPU, f32, f64,
//! other shapes) takes the composed path in [`super::super::ops`], which the tests check against
//! finite differences. `bench/flash_reference.py` checks these kernels against PyTorch's
//! autograd in f64 on the GPU and times them against SDPA; `train_probe fused` checks them
//! against the composed path.

use candle_core::{DType, Device, Tensor};

use super::Result;

/// Query rows per kernel tile, which is also the only block size block mode takes.
pub const ROWS: usize = 16;

/// Whether the flash kernels take attention over these operands.
pub fn supports(
    device: &Device,
    dtype: DType,
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && dtype == DType::BF16
        && matches!(head_dim, 64 | 128)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && (1..=8).contains(&(heads / kv_heads))
}

/// Causal attention, forward only (the frozen target): `q` `[heads, n, d]` at positions
/// `past..past + n`; `k`, `v` `[kv_heads, past + n, d]`; row i sees keys `0..=past + i`.
pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> Result<Tensor> {
    cuda::causal(q, k, v, past)
}

/// The operands of a block attention as the kernels take them: queries `[heads, m, d]`, the
/// context's keys and values `[kv_heads, s, d]`, the blocks' own `[kv_heads, m, d]`, and per
/// block of 16 rows the count of context rows it sees (`u32`, on the device). (Read only by the
/// CUDA launches.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct BlockOperands<'a> {
    pub q: &'a Tensor,
    pub ck: &'a Tensor,
    pub cv: &'a Tensor,
    pub bk: &'a Tensor,
    pub bv: &'a Tensor,
    pub seen: &'a Tensor,
}

/// Block attention's output `[heads, m, d]` and each row's log-sum-exp `[heads, m]` (f32, base
/// 2, what [`block_backward`] needs).
pub(crate) fn block_forward(x: &BlockOperands<'_>) -> Result<(Tensor, Tensor)> {
    cuda::block_forward(x)
}

/// The gradients of q, the context's k and v and the blocks' k and v, from the output's.
pub(crate) fn block_backward(
    x: &BlockOperands<'_>,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
) -> Result<[Tensor; 5]> {
    cuda::block_backward(x, out, lse, d_out)
}

/// Without the `cuda` feature there is nothing to launch; [`supports`] is false, so these are
/// reached only by a caller that did not ask it.
#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::Tensor;

    use super::{BlockOperands, Result};

    fn unavailable<T>() -> Result<T> {
        candle_core::bail!("flash attention needs a build with the `cuda` feature")
    }

    pub fn causal(_: &Tensor, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        unavailable()
    }

    pub fn block_forward(_: &BlockOperands<'_>) -> Result<(Tensor, Tensor)> {
        unavailable()
    }

    pub fn block_backward(
        _: &BlockOperands<'_>,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<[Tensor; 5]> {
        unavailable()
    }
}

/// Kernel launches. A launch is FFI, hence `unsafe`; each states what it reads and writes, all
/// of it allocated or checked here.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda {
    use candle_core::cuda_backend::WrapErr;
    use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor, bail};
    use half::bf16;

    use super::{BlockOperands, ROWS, Result};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
    /// Keys per tile of the dK/dV kernel (its grid walks key tiles).
    const KEY_TILE: usize = 64;

    /// How many ranges the dK/dV pass splits the row tiles into: about 64 tiles each (blocks of
    /// threads that walk the same amount of work), at most 8 (the partial sums' memory).
    fn row_chunks(row_tiles: usize) -> usize {
        row_tiles.div_ceil(64).clamp(1, 8)
    }

    /// The dynamic shared memory `flash_dkv_pipelined` takes for this group and head size: the
    /// key tile's keys and values, two buffers of a row tile's q and dout for every head of
    /// the group, two of their lse and delta (flash.cu says why).
    fn dkv_pipelined_smem(group: usize, d: usize) -> usize {
        let ld = d + 8;
        2 * KEY_TILE * ld * 2 + 2 * 2 * group * ROWS * ld * 2 + 2 * 2 * group * ROWS * 4
    }

    /// Keys a block of `flash_dkv_tiled` takes, and the most heads a group may have for it.
    const TILED_KEY_TILE: usize = 128;
    const TILED_MAX_GROUP: usize = 4;

    /// `flash_dkv_tiled`'s dynamic shared memory (the layout flash.cu's comment gives).
    fn dkv_tiled_smem(group: usize, d: usize) -> usize {
        let (ld, pld) = (d + 8, TILED_MAX_GROUP * ROWS + 8);
        (2 * TILED_KEY_TILE * ld + 2 * 2 * group * ROWS * ld + 2 * TILED_KEY_TILE * pld) * 2
            + 2 * 2 * group * ROWS * 4
    }

    /// `flash_dkv_wg`'s dynamic shared memory: up to 1,023 bytes to align, the two warpgroups'
    /// key and value tiles and two buffers of a row tile's queries and output gradients (eight
    /// swizzled tiles of 64 x d), two buffers of its 64 lse and 64 delta.
    fn dkv_wg_smem(d: usize) -> usize {
        1024 + 8 * 64 * d * 2 + 2 * 2 * 64 * 4
    }

    /// How the dK/dV pass runs (`DFLASH_FLASH_DKV=staged|pipelined|tiled|wg` picks one, to time
    /// one against another).
    enum Dkv {
        /// `flash_dkv` (static shared memory, the fallback): every key tile, k1's and k2's.
        Staged(CudaFunction),
        /// `flash_dkv_pipelined` and its dynamic shared memory: the same sums bit for bit
        /// (checked on an H100 by `flash_reference.py check`), 18% faster at the Qwen3-8B shape
        /// (3.38 ms against 4.10). Groups of more than four heads.
        Pipelined(CudaFunction, u32),
        /// `flash_dkv_tiled` over k1 (tiles of 128 keys, 8 warps; its shared memory) then
        /// `flash_dkv_own` over k2 (the pipelined kernel's k2 blocks; its shared memory):
        /// FlashAttention-2's tiling, 19% faster than the pipelined kernel at the Qwen3-8B
        /// shape on an H100 (2.53 ms against 3.12; `flash_reference.py check` holds it to
        /// autograd). The default for groups of at most four heads. `DFLASH_FLASH_DKV=wg` puts
        /// `flash_dkv_wg` in the tiled kernel's place (the same grid and operands, on `wgmma`:
        /// groups of four heads, sm_90a builds), written without a GPU to run it: opt-in until
        /// `flash_reference.py dkvwg` holds it.
        Tiled(CudaFunction, u32, CudaFunction, u32),
    }

    /// The dK/dV pass's kernels where the device lets a block have their shared memory,
    /// else the staged kernel.
    fn dkv_kernels(dev: &CudaDevice, group: usize, d: usize) -> Result<Dkv> {
        static ASKED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let asked = ASKED.get_or_init(|| std::env::var("DFLASH_FLASH_DKV").ok());
        let want_tiled = asked.as_deref().is_none_or(|v| v == "tiled" || v == "wg");
        let (piped, tiled) = (dkv_pipelined_smem(group, d), dkv_tiled_smem(group, d));
        if asked.as_deref() == Some("staged") {
            return Ok(Dkv::Staged(kernel(dev, "flash_dkv", d)?));
        }
        let Some(pipelined) = with_smem(dev, "flash_dkv_pipelined", d, piped)? else {
            return Ok(Dkv::Staged(kernel(dev, "flash_dkv", d)?));
        };
        if asked.as_deref() == Some("wg") && group == 4 && cfg!(dflash_wgmma_ptx) {
            let bytes = dkv_wg_smem(d);
            if let (Some(f), Some(own)) = (
                with_smem(dev, "flash_dkv_wg", d, bytes)?,
                with_smem(dev, "flash_dkv_own", d, piped)?,
            ) {
                return Ok(Dkv::Tiled(f, bytes as u32, own, piped as u32));
            }
        }
        if want_tiled && group <= TILED_MAX_GROUP {
            if let (Some(f), Some(own)) = (
                with_smem(dev, "flash_dkv_tiled", d, tiled)?,
                with_smem(dev, "flash_dkv_own", d, piped)?,
            ) {
                return Ok(Dkv::Tiled(f, tiled as u32, own, piped as u32));
            }
        }
        Ok(Dkv::Pipelined(pipelined, piped as u32))
    }

    /// The dQ kernel, the query rows a block takes and its dynamic shared memory:
    /// `flash_dq_tall` (32 rows a warp, queries and output gradients in shared memory: 1.56 ms
    /// against 2.04 at the Qwen3-8B shape on an H100) where the device lets a block have its
    /// shared memory, else (or given `DFLASH_FLASH_DQ=narrow`) `flash_dq` (16 rows a warp).
    /// `DFLASH_FLASH_DQ=wg`: `flash_dq_wg` (on `wgmma`, groups of four heads, sm_90a builds),
    /// written without a GPU to run it: opt-in until `flash_reference.py dqwg` holds it.
    fn dq_kernel(dev: &CudaDevice, group: usize, d: usize) -> Result<(CudaFunction, usize, u32)> {
        static ASKED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let asked = ASKED.get_or_init(|| std::env::var("DFLASH_FLASH_DQ").unwrap_or_default());
        if asked == "wg" && group == 4 && cfg!(dflash_wgmma_ptx) {
            // flash.cu's flash_dq_wg: up to 1,023 bytes to align, two key and two value tiles
            // of 64 x d.
            let bytes = 1024 + 4 * 64 * d * 2;
            if let Some(f) = with_smem(dev, "flash_dq_wg", d, bytes)? {
                return Ok((f, ROWS, bytes as u32));
            }
        }
        let tall = asked != "narrow";
        // flash_dq_tall's layout (flash.cu): two tiles of 32 keys and values, every head's 32
        // rows of q and of dout.
        let bytes = (2 * 2 * 32 + 2 * group * 2 * ROWS) * (d + 8) * 2;
        if tall {
            if let Some(f) = with_smem(dev, "flash_dq_tall", d, bytes)? {
                return Ok((f, 2 * ROWS, bytes as u32));
            }
        }
        Ok((kernel(dev, "flash_dq", d)?, ROWS, 0))
    }

    /// The forward kernels (flash.cu), by what `DFLASH_FLASH_FORWARD` calls them.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Forward {
        /// `flash_forward`: 16 query rows a warp, two tiles of 32 keys in static shared memory.
        Narrow,
        /// `flash_forward_wide`: tiles of 64 keys (half the barriers and softmax rescales a
        /// key, in twice the shared memory).
        Wide,
        /// `flash_forward_tall`: 32 query rows a warp (each key fragment feeds twice the
        /// products, each staged tile twice the rows), queries in shared memory.
        Tall,
        /// `flash_forward_wg`: the scores by Hopper's warpgroup MMA (`wgmma`, keys read once for
        /// the four heads of a group), causal mode and groups of four heads only, sm_90a builds
        /// (flash.cu says why). Held to autograd by `flash_reference.py wg`; 0.41 ms against
        /// the wide kernel's 0.45 at the Qwen3-8B shape (H100): `WgValues` is faster still.
        Wg,
        /// `flash_forward_wgv`: `Wg` with the values' product on `wgmma` too (value tiles
        /// swizzled, read N-major). Same limits; held to autograd by `flash_reference.py wgv`;
        /// 0.35 ms against the wide kernel's 0.45 (H100): the causal default where it can run.
        /// In block mode `flash_forward_wgv_block` (the context, then the block's own keys as
        /// one more tile), written without a GPU to run it: only where asked
        /// (`DFLASH_FLASH_FORWARD=wgv`) until `flash_reference.py wgv` holds it.
        WgValues,
    }

    impl Forward {
        /// The kernel for causal mode (`causal`) or block mode: as timed at the Qwen3-8B shape
        /// on an H100 (`flash_reference.py speed`, `wg`, `wgv`, each held to autograd), for the
        /// target's causal attention the values-on-wgmma kernel where it can run (0.35 ms
        /// against the wide one's 0.45), else the wide kernel (0.46 ms against the narrow one's
        /// 0.49 and the tall one's 0.51); the narrow one for the drafter's block attention (0.99
        /// against 1.07 and 1.06: its rows see short contexts, where wide tiles waste keys).
        /// `DFLASH_FLASH_FORWARD=narrow|wide|tall|wg|wgv` picks one for both (to time one
        /// against another).
        fn chosen(causal: bool) -> Forward {
            static ASKED: std::sync::OnceLock<Option<Forward>> = std::sync::OnceLock::new();
            let asked =
                ASKED.get_or_init(|| match std::env::var("DFLASH_FLASH_FORWARD").as_deref() {
                    Ok("narrow") => Some(Forward::Narrow),
                    Ok("wide") => Some(Forward::Wide),
                    Ok("tall") => Some(Forward::Tall),
                    Ok("wg") => Some(Forward::Wg),
                    Ok("wgv") => Some(Forward::WgValues),
                    _ => None,
                });
            asked.unwrap_or(Forward::chosen_default(causal))
        }

        /// What runs unasked: the values-on-wgmma kernel for causal mode (the wide one where
        /// it cannot: [`Self::or_fallback`]), the narrow one for block mode.
        fn chosen_default(causal: bool) -> Forward {
            if causal {
                Forward::WgValues
            } else {
                Forward::Narrow
            }
        }

        /// `self`, or where it is a `wgmma` kernel that cannot run here (a group not of four
        /// heads, a build whose flash PTX is not sm_90a, `Wg` in block mode) the kernel of its
        /// mode that can: the wide one for causal mode, the narrow one for block mode.
        fn or_fallback(self, causal: bool, group: usize) -> Forward {
            let runs = match self {
                Forward::Wg => causal,
                Forward::WgValues => true,
                _ => return self,
            };
            if !(runs && group == 4 && cfg!(dflash_wgmma_ptx)) {
                if causal {
                    Forward::Wide
                } else {
                    Forward::Narrow
                }
            } else {
                self
            }
        }

        fn name(self, causal: bool) -> &'static str {
            match self {
                Forward::Narrow => "flash_forward",
                Forward::Wide => "flash_forward_wide",
                Forward::Tall => "flash_forward_tall",
                Forward::Wg => "flash_forward_wg",
                Forward::WgValues if causal => "flash_forward_wgv",
                Forward::WgValues => "flash_forward_wgv_block",
            }
        }

        /// Query rows a block of threads takes (the grid's x walks them).
        fn rows(self) -> usize {
            match self {
                Forward::Tall => 2 * ROWS,
                Forward::Narrow | Forward::Wide | Forward::Wg | Forward::WgValues => ROWS,
            }
        }

        /// Dynamic shared memory (flash.cu's `ForwardSmem`, and the tall kernel's layout).
        fn smem(self, group: usize, d: usize) -> usize {
            let ld = d + 8;
            match self {
                Forward::Narrow => 0,
                Forward::Wide => 2 * 2 * 64 * ld * 2,
                Forward::Tall => (2 * 2 * 32 + group * 2 * ROWS) * ld * 2,
                // Up to 1,023 bytes to align the swizzled key tiles to 1,024, then two key
                // tiles of 64 x d and two value tiles of 64 x (d + 8).
                Forward::Wg => 1024 + 2 * 64 * d * 2 + 2 * 64 * ld * 2,
                // The same with the value tiles swizzled as the keys (no padding).
                Forward::WgValues => 1024 + 4 * 64 * d * 2,
            }
        }
    }

    /// The forward kernel to launch, the query rows a block takes and its dynamic shared
    /// memory ([`Forward::chosen`]).
    fn forward_kernel(
        dev: &CudaDevice,
        causal: bool,
        group: usize,
        d: usize,
    ) -> Result<(CudaFunction, usize, u32)> {
        let which = Forward::chosen(causal).or_fallback(causal, group);
        if which != Forward::Narrow {
            let bytes = which.smem(group, d);
            if let Some(f) = with_smem(dev, which.name(causal), d, bytes)? {
                return Ok((f, which.rows(), bytes as u32));
            }
        }
        // The narrow kernel: also where a large group's shared memory is past the device's.
        Ok((kernel(dev, Forward::Narrow.name(causal), d)?, ROWS, 0))
    }

    /// `name`'s kernel for head size `d`, opted in to `bytes` of dynamic shared memory (past
    /// the 48 KB a launch may ask for unasked); `None` where the device lets a block have less.
    fn with_smem(
        dev: &CudaDevice,
        name: &str,
        d: usize,
        bytes: usize,
    ) -> Result<Option<CudaFunction>> {
        use candle_core::cuda_backend::cudarc::driver::sys::{
            CUdevice_attribute, CUfunction_attribute,
        };
        let most = dev
            .cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .w()?;
        if bytes > most.max(0) as usize {
            return Ok(None);
        }
        let f = kernel(dev, name, d)?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .w()?;
        Ok(Some(f))
    }

    fn kernel(dev: &CudaDevice, name: &str, d: usize) -> Result<CudaFunction> {
        Ok(dev
            .get_or_load_custom_func(&format!("{name}_d{d}"), "dflash_flash", PTX)?
            .into_cuda_function())
    }

    /// A contiguous bf16 operand whose first element is 16-byte aligned (the kernels read rows
    /// as 16-byte vectors).
    fn operand(t: &Tensor) -> Result<Tensor> {
        if t.dtype() != DType::BF16 {
            bail!("flash attention: a {:?} operand (bf16 only)", t.dtype());
        }
        let t = t.contiguous()?;
        if t.layout().start_offset() % 8 == 0 {
            Ok(t)
        } else {
            t.copy()
        }
    }

    fn fresh(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
        Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
    }

    /// Run `f` with the device slices of `tensors` (contiguous, checked by [`operand`]).
    macro_rules! with_slices {
        ([$($t:ident : $ty:ty),*], $body:block) => {{
            $(
                let $t = $t.storage_and_layout();
                let $t = match (&*$t.0, $t.1) {
                    (Storage::Cuda(s), l) => {
                        let (a, b) = l.contiguous_offsets().ok_or_else(|| {
                            candle_core::Error::Msg("flash attention: a strided operand".into())
                        })?;
                        s.as_cuda_slice::<$ty>()?.slice(a..b)
                    }
                    _ => bail!("flash attention: an operand is not on the GPU"),
                };
            )*
            $body
        }};
    }

    fn device_of(t: &Tensor) -> Result<CudaDevice> {
        match t.device() {
            candle_core::Device::Cuda(d) => Ok(d.clone()),
            _ => bail!("flash attention: an operand is not on the GPU"),
        }
    }

    fn scales(d: usize) -> (f32, f32) {
        let scale = 1.0 / (d as f64).sqrt();
        (scale as f32, (scale * std::f64::consts::LOG2_E) as f32)
    }

    pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> Result<Tensor> {
        let (q, k, v) = (operand(q)?, operand(k)?, operand(v)?);
        let (heads, n, d) = q.dims3()?;
        let (kv, s1, _) = k.dims3()?;
        if s1 != past + n || v.dims() != k.dims() || k.dim(2)? != d {
            bail!(
                "causal attention: q {:?}, k {:?}, v {:?} after {past}",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        let dev = device_of(&q)?;
        let out = unsafe { dev.alloc::<bf16>(heads * n * d)? };
        let lse = unsafe { dev.alloc::<f32>(heads * n)? };
        let (group, m32, s32, past32) = (heads / kv, n as i32, s1 as i32, past as i32);
        let (g32, (_, scale2)) = (group as i32, scales(d));
        let (f, rows, smem) = forward_kernel(&dev, true, group, d)?;
        with_slices!([q: bf16, k: bf16, v: bf16], {
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            // k2, v2 and hi are not read in causal mode: any valid pointer will do.
            b.arg(&q).arg(&k).arg(&v).arg(&k).arg(&v).arg(&q);
            b.arg(&out).arg(&lse).arg(&m32).arg(&s32).arg(&g32).arg(&past32).arg(&scale2);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(rows) as u32, kv as u32, 1),
                block_dim: (32 * group as u32, 1, 1),
                shared_mem_bytes: smem,
            };
            // SAFETY: reads heads*n*d of q and kv*s1*d of k and v; writes heads*n*d and heads*n.
            unsafe { b.launch(cfg) }.w()?;
        });
        Ok(fresh(CudaStorage::wrap_cuda_slice(out, dev), (heads, n, d)))
    }

    struct Dims {
        heads: usize,
        kv: usize,
        m: usize,
        s: usize,
        d: usize,
    }

    fn dims(x: &BlockOperands<'_>) -> Result<Dims> {
        let (heads, m, d) = x.q.dims3()?;
        let (kv, s, _) = x.ck.dims3()?;
        let ok = x.cv.dims() == x.ck.dims()
            && x.bk.dims() == [kv, m, d]
            && x.bv.dims() == [kv, m, d]
            && x.ck.dim(2)? == d
            && m % ROWS == 0
            && x.seen.dims() == [m / ROWS]
            && x.seen.dtype() == DType::U32;
        if !ok {
            bail!(
                "block attention: q {:?}, context k/v {:?}, block k/v {:?}, seen {:?}",
                x.q.dims(),
                x.ck.dims(),
                x.bk.dims(),
                x.seen.dims()
            );
        }
        Ok(Dims { heads, kv, m, s, d })
    }

    /// The checked shapes, and the operands as the kernels read them (q, ck, cv, bk, bv, seen).
    fn prepared(x: &BlockOperands<'_>) -> Result<(Dims, [Tensor; 6])> {
        let dims = dims(x)?;
        let [q, ck, cv, bk, bv] = [x.q, x.ck, x.cv, x.bk, x.bv].map(operand);
        Ok((dims, [q?, ck?, cv?, bk?, bv?, x.seen.contiguous()?]))
    }

    pub fn block_forward(x: &BlockOperands<'_>) -> Result<(Tensor, Tensor)> {
        let (Dims { heads, kv, m, s, d }, [q, ck, cv, bk, bv, seen]) = prepared(x)?;
        let dev = device_of(&q)?;
        let out = unsafe { dev.alloc::<bf16>(heads * m * d)? };
        let lse = unsafe { dev.alloc::<f32>(heads * m)? };
        let group = heads / kv;
        let (m32, s32, g32, past, (_, scale2)) =
            (m as i32, s as i32, group as i32, -1i32, scales(d));
        let (f, rows, smem) = forward_kernel(&dev, false, group, d)?;
        with_slices!([q: bf16, ck: bf16, cv: bf16, bk: bf16, bv: bf16, seen: u32], {
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&q).arg(&ck).arg(&cv).arg(&bk).arg(&bv).arg(&seen);
            b.arg(&out).arg(&lse).arg(&m32).arg(&s32).arg(&g32).arg(&past).arg(&scale2);
            let cfg = LaunchConfig {
                grid_dim: (m.div_ceil(rows) as u32, kv as u32, 1),
                block_dim: (32 * group as u32, 1, 1),
                shared_mem_bytes: smem,
            };
            // SAFETY: reads heads*m*d of q, kv*s*d of ck/cv, kv*m*d of bk/bv, m/16 of seen
            // (each at most s, checked by the caller); writes heads*m*d and heads*m.
            unsafe { b.launch(cfg) }.w()?;
        });
        Ok((
            fresh(
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                (heads, m, d),
            ),
            fresh(CudaStorage::wrap_cuda_slice(lse, dev), (heads, m)),
        ))
    }

    pub fn block_backward(
        x: &BlockOperands<'_>,
        out: &Tensor,
        lse: &Tensor,
        d_out: &Tensor,
    ) -> Result<[Tensor; 5]> {
        let (Dims { heads, kv, m, s, d }, [q, ck, cv, bk, bv, seen]) = prepared(x)?;
        let (out, d_out, lse) = (operand(out)?, operand(d_out)?, lse.contiguous()?);
        let dev = device_of(&q)?;
        let delta = unsafe { dev.alloc::<f32>(heads * m)? };
        let dq = unsafe { dev.alloc::<bf16>(heads * m * d)? };
        let (dck, dcv) = unsafe {
            (
                dev.alloc::<bf16>(kv * s * d)?,
                dev.alloc::<bf16>(kv * s * d)?,
            )
        };
        let chunks = row_chunks(m / ROWS);
        let (part_k, part_v) = unsafe {
            (
                dev.alloc::<f32>(chunks * kv * s * d)?,
                dev.alloc::<f32>(chunks * kv * s * d)?,
            )
        };
        let (dbk, dbv) = unsafe {
            (
                dev.alloc::<bf16>(kv * m * d)?,
                dev.alloc::<bf16>(kv * m * d)?,
            )
        };
        let group = heads / kv;
        let (m32, s32, g32, (scale, scale2)) = (m as i32, s as i32, group as i32, scales(d));
        let (fq, dq_rows, dq_smem) = dq_kernel(&dev, group, d)?;
        let dkv = dkv_kernels(&dev, group, d)?;
        let fsum = dev
            .get_or_load_custom_func("flash_dkv_sum", "dflash_flash", PTX)?
            .into_cuda_function();
        with_slices!([q: bf16, ck: bf16, cv: bf16, bk: bf16, bv: bf16, seen: u32, out: bf16, d_out: bf16, lse: f32], {
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&fq);
            b.arg(&q).arg(&ck).arg(&cv).arg(&bk).arg(&bv).arg(&seen);
            b.arg(&out).arg(&d_out).arg(&lse).arg(&delta).arg(&dq);
            b.arg(&m32).arg(&s32).arg(&g32).arg(&scale2).arg(&scale);
            let cfg = LaunchConfig {
                grid_dim: (m.div_ceil(dq_rows) as u32, kv as u32, 1),
                block_dim: (32 * group as u32, 1, 1),
                shared_mem_bytes: dq_smem,
            };
            // SAFETY: reads the forward's operands, out, d_out (heads*m*d) and lse (heads*m);
            // writes delta (heads*m) and dq (heads*m*d).
            unsafe { b.launch(cfg) }.w()?;
            // The dK/dV kernels: (kernel, grid, threads, shared memory) each, one launch or two.
            let (k1_tiles, all_tiles) = (s.div_ceil(KEY_TILE), s.div_ceil(KEY_TILE) + m.div_ceil(KEY_TILE));
            let launches = match &dkv {
                Dkv::Staged(f) => vec![(f, (all_tiles, chunks), 128, 0)],
                Dkv::Pipelined(f, bytes) => vec![(f, (all_tiles, chunks), 128, *bytes)],
                Dkv::Tiled(f, bytes, own, own_bytes) => vec![
                    (f, (s.div_ceil(TILED_KEY_TILE), chunks), 256, *bytes),
                    (own, (all_tiles - k1_tiles, 1), 128, *own_bytes),
                ],
            };
            for (f, (x, z), threads, bytes) in launches {
                let tiled = threads == 256;
                let mut b = stream.launch_builder(f);
                b.arg(&q).arg(&ck).arg(&cv);
                if !tiled {
                    b.arg(&bk).arg(&bv);
                }
                b.arg(&seen).arg(&d_out).arg(&lse).arg(&delta).arg(&part_k).arg(&part_v);
                if !tiled {
                    b.arg(&dbk).arg(&dbv);
                }
                b.arg(&m32).arg(&s32).arg(&g32).arg(&scale2).arg(&scale);
                let cfg = LaunchConfig {
                    grid_dim: (x as u32, kv as u32, z as u32),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: bytes,
                };
                // SAFETY: reads as above plus delta; writes chunks*kv*s*d of part_k/part_v
                // (every chunk writes all of its k1 keys: the staged and pipelined kernels'
                // k1 blocks, or the tiled kernel's) and kv*m*d of dbk/dbv (their k2 blocks,
                // or flash_dkv_own's).
                unsafe { b.launch(cfg) }.w()?;
            }
            let n = kv * s * d;
            let chunks32 = chunks as i32;
            let mut b = stream.launch_builder(&fsum);
            b.arg(&part_k).arg(&part_v).arg(&dck).arg(&dcv).arg(&n).arg(&chunks32);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: reads chunks*n of each part, writes n of dck and dcv.
            unsafe { b.launch(cfg) }.w()?;
        });
        let t = |s: candle_core::cuda_backend::cudarc::driver::CudaSlice<bf16>,
                 shape: (usize, usize, usize)| {
            fresh(CudaStorage::wrap_cuda_slice(s, dev.clone()), shape)
        };
        Ok([
            t(dq, (heads, m, d)),
            t(dck, (kv, s, d)),
            t(dcv, (kv, s, d)),
            t(dbk, (kv, m, d)),
            t(dbv, (kv, m, d)),
        ])
    }
}
