//! The frozen target: a Llama- or Qwen3-family decoder (dense or mixture-of-experts MLPs; the
//! hybrids Qwen3.5 / Qwen3-Next, whose Gated DeltaNet layers are in [`super::deltanet`]) that
//! returns the outputs of chosen layers (the drafter's context) and lends the drafter its
//! embedding table and LM head. Loaded from
//! GGUF (quantized weights stay quantized) or a Hugging Face folder (safetensors), or built
//! with random weights at a real shape (for benchmarks and tests). Training calls
//! [`Target::tapped`], a fresh causal forward over one sequence; decoding calls
//! [`Target::extend`] with a [`KvCache`] the caller owns and crops.
//!
//! Here the model and its forward passes; `load` builds one (GGUF, Hugging Face folder,
//! random), `cache` holds a decoding sequence's keys, values and Gated DeltaNet states.

use candle_core::{DType, Device, Tensor};

use super::Result;
use super::deltanet::{DeltaNet, DeltaShape, DeltaState, Projections};
use super::fused::contiguous3;
use super::ops::Linear;

mod cache;
mod load;

pub use cache::KvCache;
use cache::Slot;
pub use load::is_hybrid_family;

/// GGUF targets whose f32 weights would take less than this are dequantized at load.
const DENSE_BELOW_BYTES: usize = 1 << 30;

/// The target's dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    /// The Hugging Face `model_type`: `llama`, `qwen3`, `qwen3_moe`, or a hybrid's
    /// ([`is_hybrid_family`]).
    pub family: String,
    /// Hidden size H.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// Rows of the embedding table.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Qwen3's per-head RMSNorm on queries and keys.
    pub qk_norm: bool,
    /// The longest sequence it was trained for (GGUF `*.context_length`, config.json
    /// `max_position_embeddings`; 2048 when the file does not say).
    pub context: usize,
    /// A hybrid's layer types and linear-attention shape (Qwen3.5); `None` for attention-only
    /// targets.
    pub hybrid: Option<Hybrid>,
}

impl TargetConfig {
    /// Rotated dimensions of each attention head.
    pub fn rotary_dim(&self) -> usize {
        self.hybrid.as_ref().map_or(self.head_dim, |h| h.rotary_dim)
    }
}

/// What a hybrid target (Qwen3.5 / Qwen3.6: Gated DeltaNet and gated full attention) adds to
/// the dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct Hybrid {
    /// Per layer: Gated DeltaNet (`true`) or full attention.
    pub linear: Vec<bool>,
    /// The Gated DeltaNet layers' shape.
    pub delta: DeltaShape,
    /// Rotated dimensions of each attention head (the first ones; Qwen3.5 rotates a quarter).
    pub rotary_dim: usize,
}

pub(super) struct Layer {
    pub(super) attn_norm: Tensor,
    pub(super) mixer: Mixer,
    pub(super) ffn_norm: Tensor,
    pub(super) mlp: Mlp,
}

/// A layer's MLP.
pub(super) enum Mlp {
    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
        /// `gate` and `up` stacked `[2 ffn, H]` (they are its views): one matmul and the
        /// packed SwiGLU where two matmuls and the SwiGLU would run. Dense weights only.
        gate_up: Option<Linear>,
    },
    /// A mixture of experts.
    Experts(Moe),
}

impl Mlp {
    fn dense(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        let ([gate, up], gate_up) = stacked([gate, up])?;
        // The packed SwiGLU splits each row in halves: gate's and up's widths must match.
        let gate_up = gate_up.filter(|_| {
            matches!((&gate, &up), (Linear::Dense(g), Linear::Dense(u)) if g.dims() == u.dims())
        });
        Ok(Self::Dense {
            gate,
            up,
            down,
            gate_up,
        })
    }
}

/// Dense projections of one input stacked into one weight `[their outputs, H]`, each part
/// returned as a view of it in its place (no second copy): one matmul where there were `N`.
/// The parts as they are, and no stack, when any is quantized or their dtypes differ.
fn stacked<const N: usize>(parts: [Linear; N]) -> Result<([Linear; N], Option<Linear>)> {
    let weights: Vec<&Tensor> = parts
        .iter()
        .filter_map(|p| match p {
            Linear::Dense(w) => Some(w),
            Linear::Quantized(_) => None,
        })
        .collect();
    if weights.len() != N || weights.iter().any(|w| w.dtype() != weights[0].dtype()) {
        return Ok((parts, None));
    }
    let packed = Tensor::cat(&weights, 0)?;
    let mut views = Vec::with_capacity(N);
    let mut at = 0;
    for w in &weights {
        let rows = w.dim(0)?;
        views.push(Linear::Dense(packed.narrow(0, at, rows)?));
        at += rows;
    }
    let views = <[Linear; N]>::try_from(views)
        .map_err(|_| candle_core::Error::Msg("stacked: one view per part".into()))?;
    Ok((views, Some(Linear::Dense(packed))))
}

/// A mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): each token goes to its
/// `top_k` experts by the router's softmax, their outputs weighted by those probabilities
/// (renormalised over the k where the model says so), plus, where the model has one, the shared
/// expert scaled by `sigmoid(shared.scale(x))`.
pub(super) struct Moe {
    /// `[experts, H]`.
    pub(super) router: Linear,
    /// Per expert: gate, up, down.
    pub(super) experts: Vec<(Linear, Linear, Linear)>,
    pub(super) top_k: usize,
    /// Whether the top k probabilities are renormalised to sum to 1 (Qwen3.5-MoE always;
    /// Qwen3-MoE's and Qwen3-Next's `norm_topk_prob`).
    pub(super) renormalise: bool,
    /// The shared expert (Qwen3.5-MoE, Qwen3-Next; not Qwen3-MoE).
    pub(super) shared: Option<SharedExpert>,
}

/// An expert every token goes through, scaled per token.
pub(super) struct SharedExpert {
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
    /// `[1, H]`: the scale's logit.
    pub(super) scale: Linear,
}

impl Moe {
    /// The routed experts' and the shared expert's output for rows `x` `[n, H]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let probs =
            candle_nn::ops::softmax_last_dim(&self.router.forward(x)?.to_dtype(DType::F32)?)?;
        // Routing on the host: per expert, its rows and their weights.
        let rows: Vec<Vec<f32>> = probs.to_vec2()?;
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (r, p) in rows.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            // Highest first; ties to the lower index, as a stable sort gives.
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &order[..self.top_k.min(order.len())];
            let sum: f32 = if self.renormalise {
                top.iter().map(|&e| p[e]).sum()
            } else {
                1.0
            };
            for &e in top {
                routed[e].0.push(r as u32);
                routed[e].1.push(p[e] / sum);
            }
        }
        let mut out = Tensor::zeros((n, x.dim(1)?), x.dtype(), x.device())?;
        for ((gate, up, down), (idx, w)) in self.experts.iter().zip(&routed) {
            if idx.is_empty() {
                continue;
            }
            let at = Tensor::new(idx.as_slice(), x.device())?;
            let y = super::ops::swiglu(&x.index_select(&at, 0)?, gate, up, down)?;
            let w = Tensor::new(w.as_slice(), x.device())?
                .to_dtype(x.dtype())?
                .unsqueeze(1)?;
            out = out.index_add(&at, &y.broadcast_mul(&w)?, 0)?;
        }
        let Some(s) = &self.shared else {
            return Ok(out);
        };
        let shared = super::ops::swiglu(x, &s.gate, &s.up, &s.down)?;
        let scale = candle_nn::ops::sigmoid(&s.scale.forward(x)?)?;
        out + shared.broadcast_mul(&scale)?
    }
}

impl Layer {
    /// The MLP's output for rows `h` (normed).
    pub(super) fn mlp(&self, h: &Tensor) -> Result<Tensor> {
        match &self.mlp {
            Mlp::Experts(moe) => moe.forward(h),
            Mlp::Dense {
                gate_up: Some(gu),
                down,
                ..
            } => down.forward(&super::fused::swiglu_packed(&gu.forward(h)?)?),
            Mlp::Dense { gate, up, down, .. } => super::ops::swiglu(h, gate, up, down),
        }
    }
}

/// How a layer mixes positions.
pub(super) enum Mixer {
    Attention(Attention),
    Delta(DeltaNet),
}

/// Causal self-attention's weights.
pub(super) struct Attention {
    /// Queries; a gated layer's hold each head's query then its output gate.
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    /// Qwen3.5's output gate: the output times sigmoid(gate) before `o`.
    pub(super) gated: bool,
    /// `q`, `k` and `v` stacked `[(heads + 2 kv_heads) * head_dim, H]`, which `q`, `k` and `v`
    /// are views of (no second copy of the weights): one matmul and one strided copy into heads
    /// where three of each would run (a decoding pass on a small target is launch-bound: on an
    /// H100 each launch costs about what SmolLM2's projection does). Dense, ungated layers only.
    pub(super) qkv: Option<Linear>,
}

impl Attention {
    /// The projections, `q`, `k` and `v` stacked into one weight when they are dense and the
    /// queries carry no gate (see [`Self::qkv`]).
    pub(super) fn new(
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        q_norm: Option<Tensor>,
        k_norm: Option<Tensor>,
        gated: bool,
    ) -> Result<Self> {
        // A gated layer's queries hold each head's gate too: not stacked.
        let ([q, k, v], qkv) = if gated {
            ([q, k, v], None)
        } else {
            stacked([q, k, v])?
        };
        Ok(Self {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            gated,
            qkv,
        })
    }
}

impl Layer {
    /// The attention weights, for code that decodes attention-only targets.
    pub(super) fn attention(&self) -> Result<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Ok(a),
            Mixer::Delta(_) => candle_core::bail!(
                "this path decodes attention-only targets; the target's Gated DeltaNet layers decode through `Target::extend`"
            ),
        }
    }
}

/// A loaded target.
pub struct Target {
    /// Its dimensions.
    pub config: TargetConfig,
    /// The embedding table `[vocab, H]` (dense, for lookups and for the drafter's block inputs).
    pub embed: Tensor,
    /// The LM head `[vocab, H]`, dense (the drafter's gradients flow through it; quantized
    /// matmuls have no backward). The embedding table when tied.
    pub lm_head: Tensor,
    /// The final norm's weight (not used by the drafter, which has its own).
    pub norm: Tensor,
    pub(super) layers: Vec<Layer>,
    /// GGUF Llama weights are permuted for interleaved RoPE; HF-layout weights use rotate-half.
    pub(super) rope_interleaved: bool,
    /// The dtype activations run in.
    pub dtype: DType,
}

/// A fused RMSNorm (forward only: the target is frozen): on a GPU this crate's kernel, which
/// gives a per-head norm's 128-wide rows 16 threads each where candle's gives each row a block;
/// on the CPU candle's, as it always ran; f64 (tests) takes the composed path.
pub(super) fn fused_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() == DType::F64 {
        return super::ops::rms_norm(x, w, eps);
    }
    if x.device().is_cuda() && !x.track_op() {
        return super::fused::rms_norm(x, w, eps);
    }
    candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)
}

/// A residual's sum `x + r` and its norm by `w`: on a GPU one kernel ([`super::fused::add_rms_norm`])
/// where the add and the norm would be two launches (a small target's layer is launch-bound), on
/// the CPU the two ops as they always ran (bit for bit).
fn add_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let fused = x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && x.rank() == 2
        && !x.track_op()
        && !r.track_op();
    if fused {
        return super::fused::add_rms_norm(x, r, w, eps);
    }
    let sum = (x + r)?;
    let normed = fused_norm(&sum, w, eps)?;
    Ok((sum, normed))
}

impl Target {
    /// The dense weights by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`, ...), for
    /// reference implementations to load; quantized layers are left out.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            ("model.embed_tokens.weight".to_owned(), self.embed.clone()),
            ("lm_head.weight".to_owned(), self.lm_head.clone()),
            ("model.norm.weight".to_owned(), self.norm.clone()),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            let p = |n: &str| format!("model.layers.{i}.{n}.weight");
            let dense = |x: &Linear| match x {
                Linear::Dense(w) => Some(w.clone()),
                Linear::Quantized(_) => None,
            };
            out.push((p("input_layernorm"), l.attn_norm.clone()));
            out.push((p("post_attention_layernorm"), l.ffn_norm.clone()));
            // Hybrids' layers are not written back (nothing reads them in this layout).
            let (Ok(a), Mlp::Dense { gate, up, down, .. }) = (l.attention(), &l.mlp) else {
                continue;
            };
            for (n, x) in [
                ("self_attn.q_proj", &a.q),
                ("self_attn.k_proj", &a.k),
                ("self_attn.v_proj", &a.v),
                ("self_attn.o_proj", &a.o),
                ("mlp.gate_proj", gate),
                ("mlp.up_proj", up),
                ("mlp.down_proj", down),
            ] {
                if let Some(w) = dense(x) {
                    out.push((p(n), w));
                }
            }
            if let (Some(q), Some(k)) = (&a.q_norm, &a.k_norm) {
                out.push((p("self_attn.q_norm"), q.clone()));
                out.push((p("self_attn.k_norm"), k.clone()));
            }
        }
        out
    }

    /// The same target on `device` (dense weights only: quantized layers cannot move).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let mv = |t: &Tensor| t.to_device(device);
        let lin = |l: &Linear| match l {
            Linear::Dense(w) => Ok(Linear::Dense(w.to_device(device)?)),
            Linear::Quantized(_) => {
                candle_core::bail!("quantized layers cannot move between devices")
            }
        };
        let opt = |t: &Option<Tensor>| t.as_ref().map(mv).transpose();
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mixer = match &l.mixer {
                    Mixer::Attention(a) => Mixer::Attention(Attention::new(
                        lin(&a.q)?,
                        lin(&a.k)?,
                        lin(&a.v)?,
                        lin(&a.o)?,
                        opt(&a.q_norm)?,
                        opt(&a.k_norm)?,
                        a.gated,
                    )?),
                    Mixer::Delta(d) => Mixer::Delta(DeltaNet {
                        shape: d.shape.clone(),
                        qkv: lin(&d.qkv)?,
                        z: lin(&d.z)?,
                        b: lin(&d.b)?,
                        a: lin(&d.a)?,
                        conv: mv(&d.conv)?,
                        dt_bias: mv(&d.dt_bias)?,
                        decay_rate: mv(&d.decay_rate)?,
                        norm: mv(&d.norm)?,
                        out: lin(&d.out)?,
                        eps: d.eps,
                    }),
                };
                let mlp = match &l.mlp {
                    Mlp::Dense { gate, up, down, .. } => {
                        Mlp::dense(lin(gate)?, lin(up)?, lin(down)?)?
                    }
                    Mlp::Experts(m) => Mlp::Experts(Moe {
                        router: lin(&m.router)?,
                        experts: m
                            .experts
                            .iter()
                            .map(|(g, u, d)| Ok((lin(g)?, lin(u)?, lin(d)?)))
                            .collect::<Result<_>>()?,
                        top_k: m.top_k,
                        renormalise: m.renormalise,
                        shared: m
                            .shared
                            .as_ref()
                            .map(|s| -> Result<SharedExpert> {
                                Ok(SharedExpert {
                                    gate: lin(&s.gate)?,
                                    up: lin(&s.up)?,
                                    down: lin(&s.down)?,
                                    scale: lin(&s.scale)?,
                                })
                            })
                            .transpose()?,
                    }),
                };
                Ok(Layer {
                    attn_norm: mv(&l.attn_norm)?,
                    mixer,
                    mlp,
                    ffn_norm: mv(&l.ffn_norm)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: self.config.clone(),
            embed: mv(&self.embed)?,
            lm_head: mv(&self.lm_head)?,
            norm: mv(&self.norm)?,
            layers,
            rope_interleaved: self.rope_interleaved,
            dtype: self.dtype,
        })
    }

    /// Embeddings of `ids`: `[n, H]`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed.index_select(ids, 0)?.to_dtype(self.dtype)
    }

    /// Free the weights of the layers past `taps`' last: a caller that only taps (training:
    /// [`Self::tapped`], [`Self::embed`], the LM head) never runs them, and at Qwen3-8B with the
    /// spread taps of a 5-layer drafter they are 2 of 36 layers, 0.77 GB of bf16. Decoding
    /// passes and taps past the kept layers are errors afterwards; `config` keeps the model's
    /// depth (what its taps and metadata are reckoned in).
    pub fn keep_layers_for(&mut self, taps: &[usize]) {
        let upto = taps.iter().max().map_or(0, |&l| l + 1);
        self.layers.truncate(upto);
    }

    /// The outputs of decoder layers `taps` (0-based) for one sequence, concatenated along
    /// features: `[n, taps.len() * H]`. Layers past the last tap are not run.
    pub fn tapped(&self, ids: &[u32], taps: &[usize]) -> Result<Tensor> {
        let last = *taps.iter().max().unwrap_or(&0);
        let (_, tapped) = self.layers_forward(ids, None, taps, last + 1)?;
        tapped.ok_or_else(|| candle_core::Error::Msg("no taps asked for".into()))
    }

    /// [`Self::tapped`] for several sequences in one pass: their rows stacked, so every matmul,
    /// norm and MLP runs once for all of them (attention stays per sequence). On a GPU a small
    /// target's step is bound by kernel launches, and this launches them once per micro-batch,
    /// not once per sequence. One tensor per sequence, in order.
    pub fn tapped_batch(&self, seqs: &[&[u32]], taps: &[usize]) -> Result<Vec<Tensor>> {
        let tapped = self.tapped_stacked(seqs, taps)?;
        let mut at = 0;
        seqs.iter()
            .map(|ids| {
                let t = tapped.narrow(0, at, ids.len());
                at += ids.len();
                t
            })
            .collect()
    }

    /// [`Self::tapped_batch`] as one tensor: the sequences' rows one after another, the layout
    /// [`super::objective::loss_packed`] takes.
    pub fn tapped_stacked(&self, seqs: &[&[u32]], taps: &[usize]) -> Result<Tensor> {
        let last = *taps.iter().max().unwrap_or(&0);
        let mut stacked: Vec<Seq<'_>> = seqs
            .iter()
            .map(|ids| Seq {
                ids,
                cache: None,
                parents: None,
            })
            .collect();
        let (_, tapped) = self.run_layers(&mut stacked, taps, last + 1)?;
        tapped.ok_or_else(|| candle_core::Error::Msg("no taps asked for".into()))
    }

    /// Each Gated DeltaNet layer's chunked forward over `x` `[n, H]` from a fresh state, in its
    /// phases ([`DeltaNet::forward_phases`]): per such layer, its index and each phase's
    /// seconds, the median of `repeats` after a warm-up (`train_probe target --phases`).
    pub fn delta_phases(
        &self,
        x: &Tensor,
        repeats: usize,
    ) -> Result<Vec<(usize, Vec<(&'static str, f64)>)>> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let Mixer::Delta(d) = &layer.mixer else {
                continue;
            };
            let state = d.empty_state(x.dtype(), x.device())?;
            d.forward_phases(x, &state)?;
            let runs: Vec<Vec<(&'static str, f64)>> = (0..repeats.max(1))
                .map(|_| d.forward_phases(x, &state))
                .collect::<Result<_>>()?;
            let phases = (0..runs[0].len())
                .map(|p| {
                    let mut t: Vec<f64> = runs.iter().map(|r| r[p].1).collect();
                    t.sort_by(f64::total_cmp);
                    (runs[0][p].0, t[t.len() / 2])
                })
                .collect();
            out.push((i, phases));
        }
        Ok(out)
    }

    /// Extend `cache` by `ids` (at the positions after what it holds) and return the next-token
    /// logits at every new position, `[n, vocab]` (f32), and the taps' outputs there when
    /// `taps` is not empty. The caller crops the cache to what it keeps ([`KvCache::truncate`]).
    pub fn extend(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        taps: &[usize],
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (x, tapped) = self.layers_forward(ids, Some(cache), taps, self.config.layers)?;
        let h = fused_norm(&x, &self.norm, self.config.eps)?;
        let logits =
            Linear::Dense(self.lm_head.to_dtype(DType::F32)?).forward(&h.to_dtype(DType::F32)?)?;
        Ok((logits, tapped))
    }

    /// [`Self::extend`] for several sequences in one pass, each after its own cache (`caches[i]`
    /// for `seqs[i]`, appended to): their rows stacked, so every projection, norm and MLP runs
    /// once for all of them, attention and Gated DeltaNet layers per sequence. Only each
    /// sequence's next-token logits after its last id, `[seqs, vocab]` (f32, through `lm_head`,
    /// the head in f32): what batched generation needs.
    pub fn extend_last(
        &self,
        seqs: &[&[u32]],
        caches: &mut [KvCache],
        lm_head: &Linear,
    ) -> Result<Tensor> {
        if seqs.len() != caches.len() || seqs.iter().any(|s| s.is_empty()) {
            candle_core::bail!(
                "{} sequences (none may be empty) for {} caches",
                seqs.len(),
                caches.len()
            );
        }
        let mut stacked: Vec<Seq<'_>> = seqs
            .iter()
            .zip(caches.iter_mut())
            .map(|(ids, cache)| Seq {
                ids,
                cache: Some(cache),
                parents: None,
            })
            .collect();
        let (x, _) = self.run_layers(&mut stacked, &[], self.config.layers)?;
        let mut at = 0;
        let last: Vec<u32> = seqs
            .iter()
            .map(|ids| {
                at += ids.len();
                (at - 1) as u32
            })
            .collect();
        let x = x.index_select(&Tensor::new(last.as_slice(), x.device())?, 0)?;
        let h = fused_norm(&x, &self.norm, self.config.eps)?;
        lm_head.forward(&h.to_dtype(DType::F32)?)
    }

    /// [`Self::extend`] for a tree of tokens (`parents[i]` before `i`; node 0 the root, the
    /// round's first token): every node sees the cache and its own ancestors, at the position
    /// of its depth; a hybrid's Gated DeltaNet layers step each node from its parent's state
    /// ([`DeltaNet::tree`]). The caller keeps the accepted path with [`KvCache::keep_path`].
    pub fn extend_tree(
        &self,
        ids: &[u32],
        parents: &[usize],
        cache: &mut KvCache,
        taps: &[usize],
    ) -> Result<(Tensor, Option<Tensor>)> {
        if ids.len() != parents.len() || ids.is_empty() {
            candle_core::bail!(
                "a tree of {} tokens with {} parents",
                ids.len(),
                parents.len()
            );
        }
        let (x, tapped) = self.run_layers(
            &mut [Seq {
                ids,
                cache: Some(cache),
                parents: Some(parents),
            }],
            taps,
            self.config.layers,
        )?;
        let h = fused_norm(&x, &self.norm, self.config.eps)?;
        let logits =
            Linear::Dense(self.lm_head.to_dtype(DType::F32)?).forward(&h.to_dtype(DType::F32)?)?;
        Ok((logits, tapped))
    }

    /// Run the first `upto` layers over `ids`, after what `cache` holds (if any), appending
    /// their keys and values to it; the last layer's output and the taps' outputs in the order
    /// asked.
    fn layers_forward(
        &self,
        ids: &[u32],
        cache: Option<&mut KvCache>,
        taps: &[usize],
        upto: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.run_layers(
            &mut [Seq {
                ids,
                cache,
                parents: None,
            }],
            taps,
            upto,
        )
    }

    /// [`Self::layers_forward`] over several sequences, their rows stacked in order.
    fn run_layers(
        &self,
        seqs: &mut [Seq<'_>],
        taps: &[usize],
        upto: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let device = self.embed.device();
        let c = &self.config;
        if let Some(bad) = taps.iter().find(|&&t| t >= c.layers) {
            candle_core::bail!("tap {bad} is past the target's {} layers", c.layers);
        }
        if upto > self.layers.len() {
            candle_core::bail!(
                "this pass runs {upto} of the target's layers, but only the first {} are kept (`keep_layers_for`)",
                self.layers.len()
            );
        }
        let flash =
            super::fused::flash::supports(device, self.dtype, c.head_dim, c.heads, c.kv_heads);
        let rotary = c.rotary_dim();
        // Per sequence: its rows' offset, count and past, its position tables and mask.
        let mut rows = Vec::with_capacity(seqs.len());
        let mut all_ids = Vec::new();
        for s in seqs.iter_mut() {
            let (n, past) = (s.ids.len(), s.cache.as_ref().map_or(0, |c| c.len()));
            if let Some(cache) = s.cache.as_mut() {
                cache.layers.resize(c.layers, None);
            }
            // A tree's nodes sit at their depth after the past; a sequence's tokens in a row.
            let positions: Vec<u32> = match s.parents {
                Some(parents) => depths(parents)?
                    .into_iter()
                    .map(|d| (past + d) as u32)
                    .collect(),
                None => (past as u32..(past + n) as u32).collect(),
            };
            let (cos, sin) =
                super::ops::rope_tables(&positions, rotary, c.rope_theta, self.dtype, device)?;
            // Flash attention needs no mask; the composed path shares one across layers.
            let mask = match s.parents {
                Some(parents) => Some(tree_mask_after(past, parents, self.dtype, device)?),
                None if flash => None,
                None => Some(causal_mask_after(past, n, self.dtype, device)?),
            };
            rows.push((all_ids.len(), n, past, cos, sin, mask));
            all_ids.extend_from_slice(s.ids);
        }
        let mut x = self.embed(&Tensor::new(all_ids.as_slice(), device)?)?;
        let mut out = std::collections::BTreeMap::new();
        // Each residual add and the norm after it in one (`add_norm`): the next layer's input
        // norm comes out of this layer's last add.
        let mut normed: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate().take(upto) {
            let h = match normed.take() {
                Some(h) => h,
                None => fused_norm(&x, &layer.attn_norm, c.eps)?,
            };
            let mixed = match &layer.mixer {
                Mixer::Attention(a) => self.attend(a, i, &h, seqs, &rows, rotary)?,
                // The projections of every sequence's rows in one matmul each, and the output
                // projection likewise; the recurrence between them per sequence, or, where
                // each of several sequences brings one token (a batch's decoding step), as one
                // stack of their heads.
                Mixer::Delta(d) => {
                    let p = d.project(&h)?;
                    let gated = if seqs.len() > 1
                        && seqs
                            .iter()
                            .all(|s| s.ids.len() == 1 && s.parents.is_none() && s.cache.is_some())
                    {
                        delta_step_batch(d, i, &p, seqs)?
                    } else {
                        let mut outs = Vec::with_capacity(seqs.len());
                        for (s, (at, n, ..)) in seqs.iter_mut().zip(&rows) {
                            outs.push(delta_layer(d, i, &p.rows(*at, *n)?, s)?);
                        }
                        if outs.len() == 1 {
                            outs.pop().expect("one")
                        } else {
                            Tensor::cat(&outs, 0)?
                        }
                    };
                    d.out(&gated)?
                }
            };
            let (sum, h) = add_norm(&x, &mixed, &layer.ffn_norm, c.eps)?;
            let m = layer.mlp(&h)?;
            x = match self.layers.get(i + 1).filter(|_| i + 1 < upto) {
                Some(next) => {
                    let (sum, h) = add_norm(&sum, &m, &next.attn_norm, c.eps)?;
                    normed = Some(h);
                    sum
                }
                None => (sum + m)?,
            };
            if taps.contains(&i) {
                out.insert(i, x.clone());
            }
        }
        for (s, (_, n, ..)) in seqs.iter_mut().zip(&rows) {
            if let Some(cache) = s.cache.as_mut() {
                cache.len += n;
                // Every attention layer applied the cut as it appended.
                cache.kept = None;
            }
        }
        let tapped = if taps.is_empty() {
            None
        } else {
            // In the order the taps were asked for.
            let ordered: Vec<&Tensor> = taps.iter().map(|t| &out[t]).collect();
            Some(Tensor::cat(&ordered, 1)?)
        };
        Ok((x, tapped))
    }

    /// Layer `i`'s causal self-attention over every sequence's rows of `h` (stacked), each after
    /// its cache (appended to): the output before the residual, `[rows, H]`.
    fn attend(
        &self,
        a: &Attention,
        i: usize,
        h: &Tensor,
        seqs: &mut [Seq<'_>],
        rows: &[SeqRows],
        rotary: usize,
    ) -> Result<Tensor> {
        let c = &self.config;
        // One matmul over the stacked weight where there is one, three otherwise.
        let projected = match &a.qkv {
            Some(qkv) => Projected::Stacked(qkv.forward(h)?),
            None => Projected::Apart(a.q.forward(h)?, a.k.forward(h)?, a.v.forward(h)?),
        };
        let mut attended = Vec::with_capacity(seqs.len());
        for (s, (at, n, past, cos, sin, mask)) in seqs.iter_mut().zip(rows) {
            let (at, n) = (*at, *n);
            // Into heads `[count, n, head_dim]`: a strided copy when n > 1, in one launch
            // with its strides as arguments on a GPU (`fused::contiguous3`).
            let heads = |t: &Tensor, count: usize| -> Result<Tensor> {
                contiguous3(
                    &t.narrow(0, at, n)?
                        .reshape((n, count, c.head_dim))?
                        .transpose(0, 1)?,
                )
            };
            // With the projections stacked, the queries' and keys' heads side by side, `[heads +
            // kv, n, d]`: rotated in one launch where no per-head norm comes first.
            let mut joined = None;
            let (mut q, gate, mut k, mut v) = match &projected {
                // All heads in one copy, `[heads + 2 kv, n, d]`; q, k and v are its slices.
                Projected::Stacked(all) => {
                    let all = heads(all, c.heads + 2 * c.kv_heads)?;
                    joined = Some(all.narrow(0, 0, c.heads + c.kv_heads)?);
                    (
                        all.narrow(0, 0, c.heads)?,
                        None,
                        all.narrow(0, c.heads, c.kv_heads)?,
                        all.narrow(0, c.heads + c.kv_heads, c.kv_heads)?,
                    )
                }
                // A gated layer's projection holds each head's query, then its gate.
                Projected::Apart(q_all, k_all, v_all) if a.gated => {
                    let both = q_all
                        .narrow(0, at, n)?
                        .reshape((n, c.heads, 2 * c.head_dim))?;
                    let q = contiguous3(&both.narrow(2, 0, c.head_dim)?.transpose(0, 1)?)?;
                    let gate = both
                        .narrow(2, c.head_dim, c.head_dim)?
                        .reshape((n, c.heads * c.head_dim))?;
                    (
                        q,
                        Some(gate),
                        heads(k_all, c.kv_heads)?,
                        heads(v_all, c.kv_heads)?,
                    )
                }
                Projected::Apart(q_all, k_all, v_all) => (
                    heads(q_all, c.heads)?,
                    None,
                    heads(k_all, c.kv_heads)?,
                    heads(v_all, c.kv_heads)?,
                ),
            };
            if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
                q = fused_norm(&q, qn, c.eps)?;
                k = fused_norm(&k, kn, c.eps)?;
                joined = None;
            }
            let rope_all = |t: &Tensor| -> Result<Tensor> {
                if t.dtype() == DType::F64 && !self.rope_interleaved {
                    return super::ops::rope(t, cos, sin);
                }
                let t = t.unsqueeze(0)?.contiguous()?;
                let r = if self.rope_interleaved {
                    candle_nn::rotary_emb::rope_i(&t, cos, sin)?
                } else {
                    candle_nn::rotary_emb::rope(&t, cos, sin)?
                };
                r.squeeze(0)
            };
            // Partial rotary (Qwen3.5): the first `rotary` dimensions turn, the rest pass.
            let rope = |t: &Tensor| -> Result<Tensor> {
                if rotary == c.head_dim {
                    return rope_all(t);
                }
                let turned = rope_all(&contiguous3(&t.narrow(2, 0, rotary)?)?)?;
                let passed = contiguous3(&t.narrow(2, rotary, c.head_dim - rotary)?)?;
                Tensor::cat(&[&turned, &passed], 2)
            };
            let (q, mut k) = match joined {
                Some(qk) => {
                    let turned = rope(&qk)?;
                    (
                        turned.narrow(0, 0, c.heads)?,
                        turned.narrow(0, c.heads, c.kv_heads)?,
                    )
                }
                None => (rope(&q)?, rope(&k)?),
            };
            if let Some(cache) = s.cache.as_mut() {
                if let Some(Slot::Kv(pk, pv)) = cache.layers[i].take() {
                    k = cache.append(&pk, &k)?;
                    v = cache.append(&pv, &v)?;
                }
                cache.layers[i] = Some(Slot::Kv(k.clone(), v.clone()));
            }
            let o = super::ops::causal_attention(&q, &k, &v, *past, mask.as_ref())?;
            let o = contiguous3(&o.transpose(0, 1)?)?.reshape((n, c.heads * c.head_dim))?;
            attended.push(match gate {
                Some(g) => (o * candle_nn::ops::sigmoid(&g)?)?,
                None => o,
            });
        }
        let o = if attended.len() == 1 {
            attended.pop().expect("one")
        } else {
            Tensor::cat(&attended, 0)?
        };
        a.o.forward(&o)
    }
}

/// An attention layer's projections of a pass's rows: stacked (`Attention::qkv`) or apart.
enum Projected {
    Stacked(Tensor),
    Apart(Tensor, Tensor, Tensor),
}

/// One sequence's rows of a pass: offset, count, past, rotary tables, mask.
type SeqRows = (usize, usize, usize, Tensor, Tensor, Option<Tensor>);

/// Calls of at most this many tokens keep a Gated DeltaNet layer's state after every token (a
/// verification pass, which the caller crops to the accepted prefix); longer ones run the
/// chunked form and keep only the state at the end (a prefill).
const STEPPED_UP_TO: usize = 16;

/// Layer `i`'s Gated DeltaNet over one sequence's projected rows `p`, after its cache's state (a
/// fresh one without a cache, or an empty cache), recording the states the cache can be cropped
/// to; the gated rows, before the output projection.
fn delta_layer(d: &DeltaNet, i: usize, p: &Projections, s: &mut Seq<'_>) -> Result<Tensor> {
    let n = p.len()?;
    let Some(cache) = s.cache.as_mut() else {
        let fresh = d.empty_state(p.dtype(), p.device())?;
        return Ok(d.forward_gated(p, &fresh)?.0);
    };
    let past = cache.len;
    let before = delta_state_before(d, i, cache, p)?;
    if let Some(parents) = s.parents {
        let (out, nodes) = d.tree_gated(p, parents, &before)?;
        cache.layers[i] = Some(Slot::DeltaTree {
            past,
            before,
            nodes,
        });
        return Ok(out);
    }
    let (out, kept) = if n <= STEPPED_UP_TO {
        let (out, states) = d.steps_gated(p, &before)?;
        let kept = std::iter::once((past, before))
            .chain(
                states
                    .into_iter()
                    .enumerate()
                    .map(|(t, st)| (past + t + 1, st)),
            )
            .collect();
        (out, kept)
    } else {
        let (out, end) = d.forward_gated(p, &before)?;
        (out, vec![(past, before), (past + n, end)])
    };
    cache.layers[i] = Some(Slot::Delta(kept));
    Ok(out)
}

/// Layer `i`'s Gated DeltaNet over a batch's decoding step: one token for each sequence (rows of
/// `p`), every one with a cache; their heads stepped as one stack
/// ([`DeltaNet::step_batch_gated`]). Each cache keeps the states before and after its token, as
/// [`delta_layer`] would.
fn delta_step_batch(
    d: &DeltaNet,
    i: usize,
    p: &Projections,
    seqs: &mut [Seq<'_>],
) -> Result<Tensor> {
    let mut before = Vec::with_capacity(seqs.len());
    for s in seqs.iter_mut() {
        let cache = s.cache.as_mut().expect("the caller checked every cache");
        before.push((cache.len, delta_state_before(d, i, cache, p)?));
    }
    let states: Vec<&DeltaState> = before.iter().map(|(_, st)| st).collect();
    let (out, after) = d.step_batch_gated(p, &states)?;
    for ((s, (past, st)), next) in seqs.iter_mut().zip(before).zip(after) {
        let cache = s.cache.as_mut().expect("the caller checked every cache");
        cache.layers[i] = Some(Slot::Delta(vec![(past, st), (past + 1, next)]));
    }
    Ok(out)
}

/// The state layer `i` of `cache` holds at its end (taken out of it; a fresh one for an empty
/// cache), or why there is none.
fn delta_state_before(
    d: &DeltaNet,
    i: usize,
    cache: &mut KvCache,
    p: &Projections,
) -> Result<DeltaState> {
    let past = cache.len;
    Ok(match cache.layers[i].take() {
        Some(Slot::Delta(mut kept)) => match kept.pop() {
            Some((at, state)) if at == past => state,
            _ => candle_core::bail!("layer {i}: no Gated DeltaNet state at position {past}"),
        },
        Some(Slot::Kv(..)) => {
            candle_core::bail!("layer {i}: a key/value slot in a Gated DeltaNet layer")
        }
        Some(Slot::DeltaTree { .. }) => candle_core::bail!(
            "layer {i}: the last pass was a tree; keep one path of it (`KvCache::keep_path`) before extending"
        ),
        None if past == 0 => d.empty_state(p.dtype(), p.device())?,
        None => candle_core::bail!("layer {i}: no Gated DeltaNet state at position {past}"),
    })
}

/// One sequence of a forward pass: its new tokens and, when decoding, its cache; a tree's
/// tokens come with each one's parent (the root's is `usize::MAX`).
struct Seq<'a> {
    ids: &'a [u32],
    cache: Option<&'a mut KvCache>,
    parents: Option<&'a [usize]>,
}

/// Each tree node's depth (the root's 0); parents come before their children.
fn depths(parents: &[usize]) -> Result<Vec<usize>> {
    let mut depth = Vec::with_capacity(parents.len());
    for (i, &p) in parents.iter().enumerate() {
        depth.push(match i {
            0 => 0,
            _ if p < i => depth[p] + 1,
            _ => candle_core::bail!("tree node {i}'s parent {p} does not come before it"),
        });
    }
    Ok(depth)
}

/// `[n, past + n]` for a tree's nodes: each sees the past and its own ancestors and itself.
fn tree_mask_after(
    past: usize,
    parents: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n = parents.len();
    let mut v = vec![f32::NEG_INFINITY; n * (past + n)];
    for i in 0..n {
        let row = &mut v[i * (past + n)..(i + 1) * (past + n)];
        row[..past].fill(0.0);
        let mut at = i;
        loop {
            row[past + at] = 0.0;
            if at == 0 {
                break;
            }
            at = parents[at];
        }
    }
    Tensor::from_vec(v, (n, past + n), device)?.to_dtype(dtype)
}

/// `[n, past + n]`: row i (at position past + i) sees keys 0..=past + i.
fn causal_mask_after(past: usize, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    // Built where it is used: a 3,072-token training sequence's mask is 9.4M entries, which
    // would otherwise be filled on the host and copied over every step.
    let w = past + n;
    let rows = Tensor::arange(past as u32, w as u32, device)?.reshape((n, 1))?;
    let cols = Tensor::arange(0u32, w as u32, device)?.reshape((1, w))?;
    let open = cols.broadcast_le(&rows)?;
    let zeros = Tensor::zeros((n, w), dtype, device)?;
    let closed = Tensor::full(f32::NEG_INFINITY, (n, w), device)?.to_dtype(dtype)?;
    open.where_cond(&zeros, &closed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stacked projections (`Attention::qkv`: one matmul, one copy into heads, one rotation of
    /// queries and keys together; the MLP's `gate_up` and the packed SwiGLU) give what the ones
    /// apart give, over a prefill, a few tokens after it and a tree, with and without Qwen3's
    /// per-head norms.
    #[test]
    fn stacked_projections_pass_what_separate_ones_do() {
        for qk_norm in [false, true] {
            let family = if qk_norm { "qwen3" } else { "llama" };
            let stacked = crate::nn::testing::tiny_target(family, qk_norm, 5);
            let mut apart = crate::nn::testing::tiny_target(family, qk_norm, 5);
            for l in &mut apart.layers {
                if let Mixer::Attention(a) = &mut l.mixer {
                    assert!(a.qkv.take().is_some(), "a dense layer is stacked");
                }
                if let Mlp::Dense { gate_up, .. } = &mut l.mlp {
                    assert!(gate_up.take().is_some(), "a dense MLP is stacked");
                }
            }
            let run = |t: &Target| -> Vec<Vec<f32>> {
                let mut cache = KvCache::default();
                let (a, _) = t.extend(&[3, 9, 4, 17, 8, 2], &mut cache, &[0]).unwrap();
                let (b, taps) = t.extend(&[11, 5, 7], &mut cache, &[1]).unwrap();
                let (c, _) = t
                    .extend_tree(&[6, 1, 13, 2], &[usize::MAX, 0, 0, 1], &mut cache, &[0])
                    .unwrap();
                [a, b, taps.unwrap(), c]
                    .iter()
                    .map(|x| x.flatten_all().unwrap().to_vec1().unwrap())
                    .collect()
            };
            for (x, y) in run(&stacked).iter().zip(run(&apart)) {
                let worst = x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "qk_norm {qk_norm}: {worst}");
            }
        }
    }

    /// Dropping the layers past the last tap changes no tap (the same values exactly), and a
    /// pass that would run a dropped layer is an error, not a shorter pass.
    #[test]
    fn taps_survive_dropping_the_layers_past_them() {
        // Two layers: tap the first, keep it alone.
        let full = crate::nn::testing::tiny_target("qwen3", true, 5);
        let mut kept = crate::nn::testing::tiny_target("qwen3", true, 5);
        let (ids, taps) = ([3u32, 9, 4, 17, 8, 2], [0usize]);
        kept.keep_layers_for(&taps);
        assert_eq!((full.layers.len(), kept.layers.len()), (2, 1));
        let values = |t: &Target| -> Vec<f32> {
            let x = t.tapped(&ids, &taps).unwrap();
            x.flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(values(&full), values(&kept));
        let past = kept.tapped(&ids, &[1]).unwrap_err().to_string();
        assert!(past.contains("only the first 1 are kept"), "{past}");
        let mut cache = KvCache::default();
        assert!(kept.extend(&[1, 2], &mut cache, &[]).is_err());
    }

    /// The routed experts against the definition: every expert on every token, weighted by
    /// the router's softmax kept at each token's top k and renormalised; plus the gated shared
    /// expert.
    #[test]
    fn experts_route_each_token_to_its_top_k() {
        let cpu = Device::Cpu;
        let mut init = super::super::drafter::Init::new(11);
        let (h, ffn, experts, k, n) = (8, 6, 5, 2, 7);
        let mut w = |o: usize, i: usize| init.normal(&[o, i], 0.5, DType::F64, &cpu).unwrap();
        let dense = |t: Tensor| Linear::Dense(t);
        let list: Vec<(Linear, Linear, Linear)> = (0..experts)
            .map(|_| (dense(w(ffn, h)), dense(w(ffn, h)), dense(w(h, ffn))))
            .collect();
        let layer = Layer {
            attn_norm: Tensor::ones(h, DType::F64, &cpu).unwrap(),
            mixer: Mixer::Attention(
                Attention::new(
                    dense(w(h, h)),
                    dense(w(h, h)),
                    dense(w(h, h)),
                    dense(w(h, h)),
                    None,
                    None,
                    false,
                )
                .unwrap(),
            ),
            ffn_norm: Tensor::ones(h, DType::F64, &cpu).unwrap(),
            mlp: Mlp::Experts(Moe {
                router: dense(w(experts, h)),
                experts: list,
                top_k: k,
                renormalise: true,
                shared: Some(SharedExpert {
                    gate: dense(w(ffn, h)),
                    up: dense(w(ffn, h)),
                    down: dense(w(h, ffn)),
                    scale: dense(w(1, h)),
                }),
            }),
        };
        let x = w(n, h);
        let got: Vec<Vec<f64>> = layer.mlp(&x).unwrap().to_vec2().unwrap();
        let Mlp::Experts(moe) = &layer.mlp else {
            unreachable!("built above")
        };
        let s = moe.shared.as_ref().unwrap();
        let probs: Vec<Vec<f64>> =
            candle_nn::ops::softmax_last_dim(&moe.router.forward(&x).unwrap())
                .unwrap()
                .to_vec2()
                .unwrap();
        let outs: Vec<Vec<Vec<f64>>> = moe
            .experts
            .iter()
            .map(|(g, u, d)| {
                super::super::ops::swiglu(&x, g, u, d)
                    .unwrap()
                    .to_vec2()
                    .unwrap()
            })
            .collect();
        let shared: Vec<Vec<f64>> = super::super::ops::swiglu(&x, &s.gate, &s.up, &s.down)
            .unwrap()
            .to_vec2()
            .unwrap();
        let gate: Vec<Vec<f64>> = s.scale.forward(&x).unwrap().to_vec2().unwrap();
        for r in 0..n {
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| probs[r][b].total_cmp(&probs[r][a]));
            let top = &order[..k];
            let sum: f64 = top.iter().map(|&e| probs[r][e]).sum();
            let s = 1.0 / (1.0 + (-gate[r][0]).exp());
            for c in 0..h {
                let want: f64 = top
                    .iter()
                    .map(|&e| probs[r][e] / sum * outs[e][r][c])
                    .sum::<f64>()
                    + s * shared[r][c];
                // The routing weights are f32.
                assert!(
                    (got[r][c] - want).abs() < 1e-6,
                    "row {r} col {c}: {} vs {want}",
                    got[r][c]
                );
            }
        }
    }
}
