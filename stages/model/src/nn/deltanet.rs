//! Gated DeltaNet, the linear-attention layer of hybrid targets (Qwen3.5 / Qwen3.6: three of
//! every four layers), forward only (the target is frozen).
//!
//! Per token t: the layer's input goes through one projection into queries, keys and values, a
//! short causal depthwise convolution (kernel 4) over time and SiLU; queries and keys are
//! L2-normalised (queries also scaled by 1/sqrt(d_k)); each value head h keeps a state
//! `S_h [d_k, d_v]` updated by the gated delta rule
//!
//! ```text
//! S = exp(g_t) * S;   S = S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S
//! ```
//!
//! with the decay `g_t = -exp(A_log) * softplus(a_t + dt_bias)` and the write strength
//! `beta_t = sigmoid(b_t)` projected from the input too. The output is RMS-normed per head,
//! gated by `silu(z_t)` and projected back to the hidden size.
//!
//! Forms of the same recurrence:
//! - [`DeltaNet::forward`] over a whole sequence (prefill, training's target pass) takes it in
//!   chunks of 64 tokens: within a chunk the updates are folded into matmuls (the "UT
//!   transform": a unit lower-triangular system solved by forward substitution), and only the
//!   state crosses chunks, so the sequential part is `n / 64` steps, not `n`.
//! - [`DeltaNet::steps`] goes token by token and returns the state after every token: what a
//!   decoder needs to step, and to roll back to any position of a verified proposal.
//! - [`DeltaNet::tree`] steps a tree of tokens (tree verification): each node from its parent's
//!   state, its convolution over its own ancestors, so every root-to-node path gets exactly what
//!   [`DeltaNet::steps`] would give that path as a sequence.
//! - [`DeltaNet::step_batch_gated`] steps one token of each of a batch's sequences, their heads
//!   stacked as one (generation's decoding step).
//!
//! Each form also comes split at the projections ([`DeltaNet::project`], the `*_gated` forms,
//! [`DeltaNet::out`]), so a batch's rows go through the input and output projections together,
//! one matmul per weight, and only the recurrence is per sequence.
//!
//! The state is per layer, not per token: its memory does not grow with the context.

use candle_core::{D, DType, Device, Tensor};

use super::Result;
use super::fused;
use super::ops::Linear;

/// Tokens per chunk of [`DeltaNet::forward`].
const CHUNK: usize = 64;

/// A Gated DeltaNet layer's dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads.
    pub key_heads: usize,
    /// Value heads (a multiple of the key heads: each key head serves consecutive value heads).
    pub value_heads: usize,
    /// Per-head query/key width.
    pub key_dim: usize,
    /// Per-head value width.
    pub value_dim: usize,
    /// The convolution's kernel (taps over time).
    pub kernel: usize,
}

impl DeltaShape {
    /// Channels of the convolution: queries, keys and values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Floats of one sequence's state: the recurrence's and the convolution's.
    pub fn state_floats(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim + (self.kernel - 1) * self.conv_dim()
    }
}

/// A layer's weights.
pub struct DeltaNet {
    pub(super) shape: DeltaShape,
    /// `[conv_dim, H]`: queries, keys, values.
    pub(super) qkv: Linear,
    /// `[value_heads * value_dim, H]`: the output gate.
    pub(super) z: Linear,
    /// `[value_heads, H]`: the write strength before its sigmoid.
    pub(super) b: Linear,
    /// `[value_heads, H]`: the decay's input.
    pub(super) a: Linear,
    /// `[conv_dim, kernel]`.
    pub(super) conv: Tensor,
    /// `[value_heads]`.
    pub(super) dt_bias: Tensor,
    /// `-exp(A_log)`, `[value_heads]` (f32).
    pub(super) decay_rate: Tensor,
    /// The per-head output norm's weight `[value_dim]`.
    pub(super) norm: Tensor,
    /// `[H, value_heads * value_dim]`.
    pub(super) out: Linear,
    pub(super) eps: f64,
}

/// What a layer carries between calls for one sequence.
#[derive(Clone, Debug)]
pub struct DeltaState {
    /// The convolution's last `kernel - 1` inputs `[kernel - 1, conv_dim]`.
    pub conv: Tensor,
    /// The recurrence's state `[value_heads, key_dim, value_dim]` (f32).
    pub recurrent: Tensor,
}

/// The layer's input projections of some rows `[n, ..]`, in the input's dtype: made once for
/// every sequence of a batch (one matmul per weight, [`DeltaNet::project`]), then cut per
/// sequence ([`Projections::rows`]) for the recurrence, which is per sequence.
pub struct Projections {
    /// `[n, conv_dim]`: the convolution's input (queries, keys, values).
    qkv: Tensor,
    /// `[n, value_heads * value_dim]`: the output gate.
    z: Tensor,
    /// `[n, value_heads]`: the write strength and the decay's inputs.
    b: Tensor,
    a: Tensor,
}

impl Projections {
    /// Rows `at..at + n`.
    pub fn rows(&self, at: usize, n: usize) -> Result<Self> {
        Ok(Self {
            qkv: self.qkv.narrow(0, at, n)?,
            z: self.z.narrow(0, at, n)?,
            b: self.b.narrow(0, at, n)?,
            a: self.a.narrow(0, at, n)?,
        })
    }

    /// Its rows.
    pub fn len(&self) -> Result<usize> {
        self.qkv.dim(0)
    }

    /// The input's dtype.
    pub fn dtype(&self) -> DType {
        self.qkv.dtype()
    }

    /// Where its rows lie.
    pub fn device(&self) -> &Device {
        self.qkv.device()
    }
}

/// How [`DeltaNet::gates`] lays out its per-head quantities: one sequence's heads first
/// (`[value_heads, n, d]`, the chunked form's and the stepping loop's layout), or each row an
/// independent sequence (`[n * value_heads, 1, d]`: one step of a batch, whose rows' heads are
/// stepped as one stack of `n * value_heads` heads).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    HeadsFirst,
    Rows,
}

/// The per-token quantities of a call, f32, heads first: queries and keys `[value_heads, n,
/// key_dim]` (normalised, queries scaled, key heads repeated per value head), values `[value_heads,
/// n, value_dim]`, `g` and `beta` `[value_heads, n]`; and the gate `z` `[n, value_heads, value_dim]`.
/// (In [`Layout::Rows`] the first two dims are `[n * value_heads, 1]` instead.)
struct Mixed {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    z: Tensor,
}

fn softplus(x: &Tensor) -> Result<Tensor> {
    // max(x, 0) + log(1 + exp(-|x|)): no overflow for large x.
    let relu = x.relu()?;
    let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    relu + tail
}

/// `x / sqrt(sum(x^2) + 1e-6)` over the last dimension, times `scale`: one fused RMSNorm pass
/// (the sum is `d` times the mean, so this is RMSNorm with eps `1e-6 / d` and every weight
/// `scale / sqrt(d)`), where composed it was five.
fn l2_normalise(x: &Tensor, scale: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let weight = Tensor::full((scale / (d as f64).sqrt()) as f32, d, x.device())?;
    fused::rms_norm(x, &weight, 1e-6 / d as f64)
}

impl DeltaNet {
    /// A fresh state (zeros) for one sequence.
    pub fn empty_state(&self, dtype: DType, device: &Device) -> Result<DeltaState> {
        let s = &self.shape;
        Ok(DeltaState {
            conv: Tensor::zeros((s.kernel - 1, s.conv_dim()), dtype, device)?,
            recurrent: Tensor::zeros((s.value_heads, s.key_dim, s.value_dim), DType::F32, device)?,
        })
    }

    /// The input projections of `x` `[n, H]`, one matmul per weight for all its rows.
    pub fn project(&self, x: &Tensor) -> Result<Projections> {
        Ok(Projections {
            qkv: self.qkv.forward(x)?,
            z: self.z.forward(x)?,
            b: self.b.forward(x)?,
            a: self.a.forward(x)?,
        })
    }

    /// Convolution and gates of one sequence's projected rows `p` after `state`: its tokens
    /// (`windows` `None`), or a tree's nodes, `windows` then holding each node's convolution
    /// inputs (`kernel` rows of the carried-then-new inputs, oldest first: [`tree_windows`]).
    /// Also the carried-then-new convolution inputs `[kernel - 1 + n, conv_dim]`, from which
    /// the states after the call take theirs.
    fn mix(
        &self,
        p: &Projections,
        state: &DeltaState,
        windows: Option<&[u32]>,
    ) -> Result<(Mixed, Tensor)> {
        let s = &self.shape;
        let n = p.len()?;
        let conv_inputs = Tensor::cat(&[&state.conv.to_dtype(p.dtype())?, &p.qkv], 0)?;
        let conv = match windows {
            // Depthwise and causal: output t is the sum over the kernel's taps j of
            // w[:, j] * input[t + j] in the carried-then-new sequence, then SiLU; one fused
            // pass in f32 (a cast, a multiply and an add per tap, and the SiLU composed).
            None => fused::causal_conv_silu(&conv_inputs, &self.conv)?,
            // A node's taps read its own window: its ancestors, then the carried inputs.
            Some(windows) => {
                let windows =
                    conv_inputs.index_select(&Tensor::new(windows, p.qkv.device())?, 0)?;
                self.convolve_windows(&windows.reshape((n, s.kernel, s.conv_dim()))?)?
            }
        };
        Ok((self.gates(p, &conv, Layout::HeadsFirst)?, conv_inputs))
    }

    /// The depthwise convolution of each row's window `[n, kernel, conv_dim]` (oldest first),
    /// then SiLU: `[n, conv_dim]` (f32).
    fn convolve_windows(&self, windows: &Tensor) -> Result<Tensor> {
        let w = self.conv.to_dtype(DType::F32)?;
        let conv = windows
            .to_dtype(DType::F32)?
            .broadcast_mul(&w.t()?.unsqueeze(0)?)?
            .sum(1)?;
        candle_nn::ops::silu(&conv)
    }

    /// Queries, keys, values, decays and write strengths from the convolution's output `conv`
    /// `[n, conv_dim]` (f32) and the projections `p`, laid out as `layout` says.
    fn gates(&self, p: &Projections, conv: &Tensor, layout: Layout) -> Result<Mixed> {
        let s = &self.shape;
        let n = p.len()?;
        let kw = s.key_heads * s.key_dim;
        let repeat = s.value_heads / s.key_heads;
        // [n, value_heads, d] in the layout asked: heads first, or rows of independent heads.
        let arrange = |t: Tensor, d: usize| -> Result<Tensor> {
            match layout {
                Layout::HeadsFirst => t.transpose(0, 1)?.contiguous(),
                Layout::Rows => t.contiguous()?.reshape((n * s.value_heads, 1, d)),
            }
        };
        // [n, value_heads] gates: `[value_heads, n]` or `[n * value_heads, 1]`.
        let arrange_gate = |t: Tensor| -> Result<Tensor> {
            match layout {
                Layout::HeadsFirst => t.t()?.contiguous(),
                Layout::Rows => t.reshape((n * s.value_heads, 1)),
            }
        };
        // [n, key_heads, key_dim] -> [n, value_heads, key_dim], each key head repeated for the
        // value heads it serves.
        let repeated = |t: Tensor| -> Result<Tensor> {
            arrange(
                t.reshape((n, s.key_heads, 1, s.key_dim))?
                    .broadcast_as((n, s.key_heads, repeat, s.key_dim))?
                    .reshape((n, s.value_heads, s.key_dim))?,
                s.key_dim,
            )
        };
        // Queries scaled by 1 / sqrt(key_dim) as they are normalised.
        let q = l2_normalise(
            &conv
                .narrow(1, 0, kw)?
                .reshape((n, s.key_heads, s.key_dim))?,
            1.0 / (s.key_dim as f64).sqrt(),
        )?;
        let k = l2_normalise(
            &conv
                .narrow(1, kw, kw)?
                .reshape((n, s.key_heads, s.key_dim))?,
            1.0,
        )?;
        let v = arrange(
            conv.narrow(1, 2 * kw, s.value_heads * s.value_dim)?
                .reshape((n, s.value_heads, s.value_dim))?,
            s.value_dim,
        )?;
        let beta = arrange_gate(candle_nn::ops::sigmoid(&p.b.to_dtype(DType::F32)?)?)?;
        let a =
            p.a.to_dtype(DType::F32)?
                .broadcast_add(&self.dt_bias.to_dtype(DType::F32)?)?;
        let g = arrange_gate(softplus(&a)?.broadcast_mul(&self.decay_rate)?)?;
        let z = p.z.reshape((n, s.value_heads, s.value_dim))?;
        Ok(Mixed {
            q: repeated(q)?,
            k: repeated(k)?,
            v,
            g,
            beta,
            z,
        })
    }

    /// The gated norm of the recurrence's output `o` `[n, value_heads, value_dim]` (f32, rows
    /// first) with the gate `z` `[n, value_heads, value_dim]`: `[n, value_heads * value_dim]`
    /// in `dtype`, what the output projection ([`Self::out`]) takes.
    fn gated(&self, o: &Tensor, z: &Tensor, dtype: DType) -> Result<Tensor> {
        let s = &self.shape;
        let n = o.dim(0)?;
        // RMSNorm per head, then gated by silu(z): two fused passes (`silu(z) * normed` is
        // SwiGLU's gate), where composed it was nine.
        let normed = fused::rms_norm(&o.contiguous()?, &self.norm.to_dtype(DType::F32)?, self.eps)?;
        let gated = fused::swiglu(&z.to_dtype(DType::F32)?, &normed)?;
        gated
            .reshape((n, s.value_heads * s.value_dim))?
            .to_dtype(dtype)
    }

    /// The output projection of gated rows (the recurrence's output, RMS-normed per head and
    /// gated by `silu(z)`; a batch's sequences' rows stacked, one matmul for all): `[n, H]`.
    pub fn out(&self, gated: &Tensor) -> Result<Tensor> {
        self.out.forward(gated)
    }

    /// The convolution's carried inputs after the first `t` new tokens of `conv_inputs`.
    fn conv_after(&self, conv_inputs: &Tensor, t: usize) -> Result<Tensor> {
        conv_inputs.narrow(0, t, self.shape.kernel - 1)
    }

    /// The layer over `x` `[n, H]` after `state` (a fresh sequence: [`Self::empty_state`]), in
    /// chunks (module docs); the output `[n, H]` and the state after the last token. The pass
    /// over the chunks is a few matmuls per chunk on every device: on an H100 at Qwen3.5-27B's
    /// widths over 2,048 tokens they took 2.9 ms where the one-kernel walk
    /// ([`fused::delta_scan`], one block per head and 32 value columns) took 4.7
    /// (`train_probe fused`), so the kernel stays a checked alternative, not the path.
    pub fn forward(&self, x: &Tensor, state: &DeltaState) -> Result<(Tensor, DeltaState)> {
        let (gated, next) = self.forward_gated(&self.project(x)?, state)?;
        Ok((self.out(&gated)?, next))
    }

    /// [`Self::forward`] from projected rows, up to the output projection (the gated rows
    /// [`Self::out`] takes).
    pub fn forward_gated(
        &self,
        p: &Projections,
        state: &DeltaState,
    ) -> Result<(Tensor, DeltaState)> {
        self.chunked(p, state, false, &mut |_| Ok(()))
    }

    /// [`Self::forward`], the pass over the chunks fused or as matmuls per chunk; `lap` is told
    /// as each phase ends (mixing, preparing the chunks' operands, the pass over them, the gated
    /// norm with the output projection).
    fn chunked(
        &self,
        p: &Projections,
        state: &DeltaState,
        fused_scan: bool,
        lap: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<(Tensor, DeltaState)> {
        let n = p.len()?;
        let (m, conv_inputs) = self.mix(p, state, None)?;
        lap("mix")?;
        let operands = self.prepare(&m, n)?;
        lap("prepare")?;
        let (o, state_s) = if fused_scan {
            let (rows, tails) = operands.packed()?;
            fused::delta_scan(&rows, &tails, &state.recurrent)?
        } else {
            fused::delta_scan_chunks(&operands, &state.recurrent)?
        };
        lap("scan")?;
        let state_s = state_s.contiguous()?;
        let o = o.narrow(1, 0, n)?.transpose(0, 1)?;
        let gated = self.gated(&o, &m.z, p.dtype())?;
        lap("finish")?;
        let next = DeltaState {
            conv: self.conv_after(&conv_inputs, n)?,
            recurrent: state_s,
        };
        Ok((gated, next))
    }

    /// [`Self::forward`]'s phases over `x` from `state`, each timed with the device
    /// synchronised after it: mixing (the projections, convolution and norms), preparing the
    /// chunks' operands, the pass over the chunks, and the gated norm with the output
    /// projection; seconds each (`train_probe target --phases`, to aim a kernel).
    pub fn forward_phases(
        &self,
        x: &Tensor,
        state: &DeltaState,
    ) -> Result<Vec<(&'static str, f64)>> {
        let device = x.device();
        let mut times = Vec::with_capacity(4);
        device.synchronize()?;
        let mut clock = std::time::Instant::now();
        let p = self.project(x)?;
        let (gated, _) = self.chunked(&p, state, false, &mut |phase| {
            device.synchronize()?;
            times.push((phase, clock.elapsed().as_secs_f64()));
            clock = std::time::Instant::now();
            Ok(())
        })?;
        // The output projection belongs to the last phase.
        self.out(&gated)?;
        device.synchronize()?;
        if let Some((_, last)) = times.last_mut() {
            *last += clock.elapsed().as_secs_f64();
        }
        Ok(times)
    }

    /// The chunks' operands for the pass over them, heads first ([`fused::ChunkOperands`]),
    /// computed where they lie: no packing, no strided copies but `values`' (each chunk's
    /// slice of the matmuls' operands is read through its strides).
    fn prepare(&self, m: &Mixed, n: usize) -> Result<fused::ChunkOperands> {
        let s = &self.shape;
        let chunks = n.div_ceil(CHUNK);
        let padded = chunks * CHUNK;
        let heads = s.value_heads;
        // Zero padding at the end: beta 0 writes nothing, g 0 decays nothing, and the padded
        // rows' outputs are dropped.
        let pad = |t: &Tensor| -> Result<Tensor> {
            if padded == n {
                return Ok(t.clone());
            }
            t.pad_with_zeros(1, 0, padded - n)
        };
        let blocks = |t: &Tensor, d: usize| pad(t)?.reshape((heads, chunks, CHUNK, d));
        let (q, k, v) = (
            blocks(&m.q, s.key_dim)?,
            blocks(&m.k, s.key_dim)?,
            blocks(&m.v, s.value_dim)?,
        );
        let beta = pad(&m.beta)?.reshape((heads, chunks, CHUNK, 1))?;
        let g = pad(&m.g)?.reshape((heads, chunks, CHUNK))?;
        let cum = g.cumsum(D::Minus1)?;
        // decay[i, j] = exp(cum_i - cum_j) for j <= i (else 0): what S loses between j and i
        // (on a GPU one kernel).
        let decay = fused::chunk_decay(&cum)?;
        let k_beta = k.broadcast_mul(&beta)?;
        let v_beta = v.broadcast_mul(&beta)?;
        // `k` transposed as a view: the matmuls read it through its strides.
        let kt = k.transpose(D::Minus1, D::Minus2)?;
        // Its strictly lower triangle is A (what `unit_lower_inverse` reads).
        let a = (k_beta.matmul(&kt)? * &decay)?;
        let cum_exp = cum.exp()?.unsqueeze(D::Minus1)?;
        // (I + A) X = [v_beta | k_beta * exp(cum)], A strictly lower triangular, so nilpotent
        // (A^CHUNK = 0) and (I + A)^-1 = sum of (-A)^j = (I - A)(I + A^2)(I + A^4)...: on the
        // CPU five squarings and five products of 64 x 64 matrices for every chunk and head at
        // once, where forward substitution as composed ops took 64 dependent row steps; on a
        // GPU forward substitution as one kernel, per chunk and head in shared memory
        // (`fused::unit_lower_inverse`).
        let inverse = fused::unit_lower_inverse(&a)?;
        // The two right-hand sides solved apart: each result whole, not a part of a wider one.
        // `values` chunk-major underneath, since the pass subtracts from each chunk's slice.
        let values = inverse
            .matmul(&v_beta)?
            .transpose(0, 1)?
            .contiguous()?
            .transpose(0, 1)?;
        let k_decayed = inverse.matmul(&k_beta.broadcast_mul(&cum_exp)?)?;
        let q_decayed = q.broadcast_mul(&cum_exp)?;
        let intra = (q.matmul(&kt)? * &decay)?;
        let last = cum.narrow(2, CHUNK - 1, 1)?;
        let k_tail = k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?.unsqueeze(D::Minus1)?)?;
        Ok(fused::ChunkOperands {
            values,
            k_decayed,
            q_decayed,
            intra,
            k_tail,
            // Chunk-major, so each chunk's decays are one contiguous row.
            decay: last.exp()?.squeeze(2)?.t()?.contiguous()?,
        })
    }

    /// The layer over `x` `[n, H]` after `state`, token by token; the output `[n, H]` and the
    /// state after every token (entry t: after token t).
    pub fn steps(&self, x: &Tensor, state: &DeltaState) -> Result<(Tensor, Vec<DeltaState>)> {
        let (gated, states) = self.steps_gated(&self.project(x)?, state)?;
        Ok((self.out(&gated)?, states))
    }

    /// [`Self::steps`] from projected rows, up to the output projection.
    pub fn steps_gated(
        &self,
        p: &Projections,
        state: &DeltaState,
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let n = p.len()?;
        let (m, conv_inputs) = self.mix(p, state, None)?;
        let mut s = state.recurrent.clone();
        let mut outs = Vec::with_capacity(n);
        let mut states = Vec::with_capacity(n);
        for t in 0..n {
            let o;
            (o, s) = step(&s, &m, t)?;
            outs.push(o);
            states.push(DeltaState {
                conv: self.conv_after(&conv_inputs, t + 1)?,
                recurrent: s.clone(),
            });
        }
        let o = Tensor::cat(&outs, 1)?.transpose(0, 1)?;
        Ok((self.gated(&o, &m.z, p.dtype())?, states))
    }

    /// One token for each of a batch's sequences: row b of the projected rows `p` `[batch, ..]`
    /// after `states[b]`. The rows' heads are stepped as one stack of `batch * value_heads`
    /// heads (their states stacked, one copy), so a batch's step is the few launches of one
    /// sequence's, not that many per sequence; the convolution reads each row's carried inputs
    /// and its own. The gated rows `[batch, ..]` (as [`Self::steps_gated`] gives each alone) and
    /// the state after each row (views into the batch's stacked state).
    pub fn step_batch_gated(
        &self,
        p: &Projections,
        states: &[&DeltaState],
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let sh = &self.shape;
        let batch = p.len()?;
        if states.len() != batch {
            candle_core::bail!("{batch} rows for {} Gated DeltaNet states", states.len());
        }
        // [batch, kernel, conv_dim]: each row's carried inputs, then its own.
        let carried: Vec<Tensor> = states
            .iter()
            .map(|st| st.conv.to_dtype(p.dtype()))
            .collect::<Result<_>>()?;
        let windows = Tensor::cat(&[&Tensor::stack(&carried, 0)?, &p.qkv.unsqueeze(1)?], 1)?;
        let conv = self.convolve_windows(&windows)?;
        let m = self.gates(p, &conv, Layout::Rows)?;
        let recurrent: Vec<&Tensor> = states.iter().map(|st| &st.recurrent).collect();
        let stacked = Tensor::stack(&recurrent, 0)?.reshape((
            batch * sh.value_heads,
            sh.key_dim,
            sh.value_dim,
        ))?;
        let (o, after) = step(&stacked, &m, 0)?;
        let after = after.reshape((batch, sh.value_heads, sh.key_dim, sh.value_dim))?;
        let next = (0..batch)
            .map(|b| {
                Ok(DeltaState {
                    conv: windows.get(b)?.narrow(0, 1, sh.kernel - 1)?,
                    recurrent: after.get(b)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let o = o.reshape((batch, sh.value_heads, sh.value_dim))?;
        Ok((self.gated(&o, &m.z, p.dtype())?, next))
    }

    /// The layer over a tree of tokens `x` `[n, H]` after `state` (`parents[i] < i` for every
    /// node but the root, node 0, which follows `state`): each node is stepped from its parent's
    /// state and convolves its own ancestors' inputs. The output `[n, H]` and the state after
    /// every node: node i's are what [`Self::steps`] gives at the end of the root-to-i path.
    pub fn tree(
        &self,
        x: &Tensor,
        parents: &[usize],
        state: &DeltaState,
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let (gated, states) = self.tree_gated(&self.project(x)?, parents, state)?;
        Ok((self.out(&gated)?, states))
    }

    /// [`Self::tree`] from projected rows, up to the output projection.
    pub fn tree_gated(
        &self,
        p: &Projections,
        parents: &[usize],
        state: &DeltaState,
    ) -> Result<(Tensor, Vec<DeltaState>)> {
        let n = p.len()?;
        if parents.len() != n {
            candle_core::bail!("a tree of {n} nodes with {} parents", parents.len());
        }
        if let Some(i) = (1..n).find(|&i| parents[i] >= i) {
            candle_core::bail!(
                "tree node {i}'s parent {} does not come before it",
                parents[i]
            );
        }
        let kernel = self.shape.kernel;
        let windows = tree_windows(parents, kernel);
        let (m, conv_inputs) = self.mix(p, state, Some(&windows))?;
        let mut recurrent: Vec<Tensor> = Vec::with_capacity(n);
        let mut outs = Vec::with_capacity(n);
        for t in 0..n {
            let before = if t == 0 {
                &state.recurrent
            } else {
                &recurrent[parents[t]]
            };
            let (o, s) = step(before, &m, t)?;
            outs.push(o);
            recurrent.push(s);
        }
        let device = conv_inputs.device();
        let states = recurrent
            .into_iter()
            .enumerate()
            .map(|(t, recurrent)| {
                // What the node's children convolve before their own input: its window's last
                // `kernel - 1` rows.
                let kept = Tensor::new(&windows[t * kernel + 1..(t + 1) * kernel], device)?;
                Ok(DeltaState {
                    conv: conv_inputs.index_select(&kept, 0)?,
                    recurrent,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let o = Tensor::cat(&outs, 1)?.transpose(0, 1)?;
        Ok((self.gated(&o, &m.z, p.dtype())?, states))
    }
}

/// One token of the gated delta rule: row `t` of `m` after the recurrent state `s`; its output
/// `[heads, 1, value_dim]` and the state after it.
fn step(s: &Tensor, m: &Mixed, t: usize) -> Result<(Tensor, Tensor)> {
    let at = |x: &Tensor| x.narrow(1, t, 1)?.contiguous();
    // [heads, 1, d] rows of token t.
    let (q, k, v) = (at(&m.q)?, at(&m.k)?, at(&m.v)?);
    let g = at(&m.g)?.exp()?.unsqueeze(2)?;
    let beta = at(&m.beta)?.unsqueeze(2)?;
    let s = s.broadcast_mul(&g)?;
    let remembered = k.matmul(&s)?;
    let delta = (v - remembered)?.broadcast_mul(&beta)?;
    let s = (s + k.transpose(1, 2)?.contiguous()?.matmul(&delta)?)?;
    Ok((q.matmul(&s)?, s))
}

/// Each tree node's convolution window, `kernel` rows per node (oldest first) into the
/// carried-then-new inputs (`kernel - 1` carried rows, then one per node): its ancestors up
/// to the root, then as many carried rows as the window still needs. For a chain (`parents[i]
/// = i - 1`) node t's window is rows t..t + kernel, as [`DeltaNet::steps`] convolves.
fn tree_windows(parents: &[usize], kernel: usize) -> Vec<u32> {
    let carried = kernel - 1;
    let mut out = vec![0u32; parents.len() * kernel];
    for (i, window) in out.chunks_mut(kernel).enumerate() {
        let mut node = Some(i);
        let mut next_carried = carried;
        for slot in window.iter_mut().rev() {
            match node {
                Some(at) => {
                    *slot = (carried + at) as u32;
                    node = (at > 0).then(|| parents[at]);
                }
                None => {
                    // At most `kernel - 1` of these: the node itself took one slot.
                    next_carried -= 1;
                    *slot = next_carried as u32;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(seed: u64) -> DeltaNet {
        let mut init = super::super::drafter::Init::new(seed);
        let shape = DeltaShape {
            key_heads: 2,
            value_heads: 4,
            key_dim: 8,
            value_dim: 6,
            kernel: 4,
        };
        let h = 16;
        let cpu = Device::Cpu;
        let mut w =
            |o: usize, i: usize, std: f64| init.normal(&[o, i], std, DType::F32, &cpu).unwrap();
        let conv = shape.conv_dim();
        DeltaNet {
            qkv: Linear::Dense(w(conv, h, 0.3)),
            z: Linear::Dense(w(24, h, 0.3)),
            b: Linear::Dense(w(4, h, 0.3)),
            a: Linear::Dense(w(4, h, 0.3)),
            conv: w(conv, 4, 0.5),
            dt_bias: w(1, 4, 0.5).flatten_all().unwrap(),
            decay_rate: (w(1, 4, 0.5).flatten_all().unwrap().exp().unwrap() * -1.0).unwrap(),
            norm: (w(1, 6, 0.1).flatten_all().unwrap() + 1.0).unwrap(),
            out: Linear::Dense(w(h, 24, 0.3)),
            eps: 1e-6,
            shape,
        }
    }

    use crate::nn::testing::max_diff;

    /// A batch's step (each row one token of its own sequence, after its own state) gives each
    /// row what stepping its sequence alone gives, output and state, from states that differ.
    #[test]
    fn a_batch_step_is_each_sequence_stepped_alone() {
        let d = layer(5);
        let cpu = Device::Cpu;
        let mut init = super::super::drafter::Init::new(11);
        let fresh = d.empty_state(DType::F32, &cpu).unwrap();
        // Three sequences with histories of 0, 2 and 9 tokens.
        let states: Vec<DeltaState> = [0usize, 2, 9]
            .iter()
            .map(|&n| match n {
                0 => fresh.clone(),
                n => {
                    let x = init.normal(&[n, 16], 1.0, DType::F32, &cpu).unwrap();
                    d.steps(&x, &fresh).unwrap().1.pop().unwrap()
                }
            })
            .collect();
        let x = init.normal(&[3, 16], 1.0, DType::F32, &cpu).unwrap();
        let p = d.project(&x).unwrap();
        let refs: Vec<&DeltaState> = states.iter().collect();
        let (gated, after) = d.step_batch_gated(&p, &refs).unwrap();
        let batched = d.out(&gated).unwrap();
        for (b, state) in states.iter().enumerate() {
            let (alone, next) = d.steps(&x.narrow(0, b, 1).unwrap(), state).unwrap();
            let row = batched.narrow(0, b, 1).unwrap();
            assert!(
                max_diff(&row, &alone) < 1e-5,
                "row {b}: {}",
                max_diff(&row, &alone)
            );
            assert!(max_diff(&after[b].recurrent, &next[0].recurrent) < 1e-6);
            assert_eq!(max_diff(&after[b].conv, &next[0].conv), 0.0);
        }
        assert!(d.step_batch_gated(&p, &refs[..2]).is_err());
    }

    /// The chunked form equals the token-by-token one, over several chunks and a ragged end, from
    /// a fresh state and from a carried one; and a sequence cut in two and resumed from the
    /// first half's state gives the same outputs and state as in one call.
    #[test]
    fn chunks_steps_and_resumed_calls_agree() {
        let d = layer(3);
        let cpu = Device::Cpu;
        let x = super::super::drafter::Init::new(9)
            .normal(&[150, 16], 1.0, DType::F32, &cpu)
            .unwrap();
        let fresh = d.empty_state(DType::F32, &cpu).unwrap();
        let (chunked, end) = d.forward(&x, &fresh).unwrap();
        let (stepped, states) = d.steps(&x, &fresh).unwrap();
        assert!(
            max_diff(&chunked, &stepped) < 1e-4,
            "{}",
            max_diff(&chunked, &stepped)
        );
        let last = states.last().unwrap();
        assert!(max_diff(&end.recurrent, &last.recurrent) < 1e-4);
        assert!(max_diff(&end.conv, &last.conv) == 0.0);
        // Resumed: 70 tokens, then 80 from their state (chunked), and 5 more stepped.
        let (first, mid) = d.forward(&x.narrow(0, 0, 70).unwrap(), &fresh).unwrap();
        let (second, _) = d.forward(&x.narrow(0, 70, 80).unwrap(), &mid).unwrap();
        let joined = Tensor::cat(&[&first, &second], 0).unwrap();
        assert!(
            max_diff(&joined, &chunked) < 1e-4,
            "{}",
            max_diff(&joined, &chunked)
        );
        let (tail, _) = d.steps(&x.narrow(0, 70, 5).unwrap(), &mid).unwrap();
        assert!(max_diff(&tail, &chunked.narrow(0, 70, 5).unwrap()) < 1e-4);
        // The state after token t of a stepped call is where a call for the rest resumes.
        let (rest, _) = d.steps(&x.narrow(0, 3, 4).unwrap(), &states[2]).unwrap();
        assert!(max_diff(&rest, &stepped.narrow(0, 3, 4).unwrap()) < 1e-5);
    }

    /// The fused pass over the chunks (the reference form of the GPU's kernel, with the
    /// operands packed as `forward` packs them on a GPU) gives the matmuls per chunk's outputs
    /// and state: one chunk, a ragged end, several chunks, from a fresh and a carried state.
    #[test]
    fn the_fused_pass_over_chunks_is_the_matmuls_per_chunk() {
        let d = layer(7);
        let cpu = Device::Cpu;
        let x = super::super::drafter::Init::new(11)
            .normal(&[200, 16], 1.0, DType::F32, &cpu)
            .unwrap();
        let fresh = d.empty_state(DType::F32, &cpu).unwrap();
        let (_, carried) = d.forward(&x.narrow(0, 150, 50).unwrap(), &fresh).unwrap();
        for state in [&fresh, &carried] {
            for n in [1, 64, 70, 150] {
                let p = d.project(&x.narrow(0, 0, n).unwrap()).unwrap();
                let (want, want_state) = d.chunked(&p, state, false, &mut |_| Ok(())).unwrap();
                let (got, got_state) = d.chunked(&p, state, true, &mut |_| Ok(())).unwrap();
                assert_eq!(got.dims(), want.dims());
                assert!(
                    max_diff(&got, &want) < 1e-5,
                    "{n}: {}",
                    max_diff(&got, &want)
                );
                let diff = max_diff(&got_state.recurrent, &want_state.recurrent);
                assert!(diff < 1e-5, "{n}: state {diff}");
                assert!(max_diff(&got_state.conv, &want_state.conv) == 0.0);
            }
        }
    }

    /// A tree's every node gets what stepping its root-to-node path as a sequence gives: the
    /// output row and the state after it (the convolution's carried inputs too), after a
    /// carried state whose convolution rows the shallow nodes still read; a chain-shaped tree is
    /// `steps`.
    #[test]
    fn a_tree_steps_each_node_from_its_parent() {
        let d = layer(5);
        let cpu = Device::Cpu;
        let mut init = super::super::drafter::Init::new(13);
        let prefix = init.normal(&[6, 16], 1.0, DType::F32, &cpu).unwrap();
        let fresh = d.empty_state(DType::F32, &cpu).unwrap();
        let (_, state) = d.forward(&prefix, &fresh).unwrap();
        // Root 0; two branches under it, one of them forking again; a path 4 deep (past the
        // kernel's reach into the carried rows).
        let parents = [0usize, 0, 1, 1, 0, 4, 5, 5, 2, 6];
        let x = init
            .normal(&[parents.len(), 16], 1.0, DType::F32, &cpu)
            .unwrap();
        let (out, states) = d.tree(&x, &parents, &state).unwrap();
        for i in 0..parents.len() {
            let mut path = vec![i];
            while *path.last().unwrap() != 0 {
                path.push(parents[*path.last().unwrap()]);
            }
            path.reverse();
            let rows = Tensor::new(
                path.iter()
                    .map(|&p| p as u32)
                    .collect::<Vec<_>>()
                    .as_slice(),
                &cpu,
            )
            .unwrap();
            let (stepped, along) = d.steps(&x.index_select(&rows, 0).unwrap(), &state).unwrap();
            let want = stepped.narrow(0, path.len() - 1, 1).unwrap();
            let got = out.narrow(0, i, 1).unwrap();
            assert!(
                max_diff(&got, &want) < 1e-5,
                "node {i}: {}",
                max_diff(&got, &want)
            );
            let end = along.last().unwrap();
            assert!(
                max_diff(&states[i].recurrent, &end.recurrent) < 1e-5,
                "node {i}"
            );
            // The same rows up to the projection's rounding over another batch of rows.
            assert!(
                max_diff(&states[i].conv, &end.conv) < 1e-6,
                "node {i}'s window"
            );
        }
        let chain: Vec<usize> = (0..parents.len()).map(|i| i.saturating_sub(1)).collect();
        let (treed, _) = d.tree(&x, &chain, &state).unwrap();
        let (stepped, _) = d.steps(&x, &state).unwrap();
        assert!(max_diff(&treed, &stepped) < 1e-5);
        let e = d
            .tree(&x, &[0, 0, 3, 1, 0, 4, 5, 5, 2, 6], &state)
            .unwrap_err();
        assert!(e.to_string().contains("node 2's parent 3"), "{e}");
    }
}
