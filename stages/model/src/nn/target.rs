//! The frozen target: a Llama- or Qwen3-family decoder (dense or mixture-of-experts MLPs; the
//! hybrids Qwen3.5 / Qwen3-Next, whose Gated DeltaNet layers are in [`super::deltanet`]) that
//! returns the outputs of chosen layers (the drafter's context) and lends the drafter its
//! embedding table and LM head. Loaded from
//! GGUF (quantized weights stay quantized) or a Hugging Face folder (safetensors), or built
//! with random weights at a real shape (for benchmarks and tests). Training calls
//! [`Target::tapped`], a fresh causal forward over one sequence; decoding calls
//! [`Target::extend`] with a [`KvCache`] the caller owns and crops.

use std::path::Path;

use candle_core::quantized::{QMatMul, gguf_file};
use candle_core::{DType, Device, Tensor};

use super::Result;
use super::deltanet::{DeltaNet, DeltaShape, DeltaState, Projections};
use super::fused::contiguous3;
use super::ops::Linear;

/// GGUF targets whose f32 weights would take less than this are dequantized at load.
const DENSE_BELOW_BYTES: usize = 1 << 30;

/// The target's dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    /// `llama` or `qwen3`.
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

/// candle's fused kernel (forward only: the target is frozen); f64 (tests) takes the composed path.
pub(super) fn fused_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() == DType::F64 {
        return super::ops::rms_norm(x, w, eps);
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
    /// Load a GGUF file (architectures `llama` and `qwen3`). Small targets are dequantized:
    /// dense f32 matmuls beat candle's quantized dot products on CPU, for training and for
    /// decoding alike (measured: 14 against 10-12 tokens/s decoding SmolLM2-135M, and the
    /// quantized path's results differ between one row and several, which breaks losslessness).
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self> {
        let mut file = std::fs::File::open(path)?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(path))?;
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if !matches!(arch.as_str(), "llama" | "qwen3" | "qwen3moe") {
            candle_core::bail!(
                "{}: architecture `{arch}`; the train stage's GGUF targets are `llama`, `qwen3` and `qwen3moe` (hybrids and other MoE targets load from Hugging Face folders)",
                path.display()
            );
        }
        let get = |k: &str| -> Result<&gguf_file::Value> {
            md.get(&format!("{arch}.{k}")).ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: no `{arch}.{k}`", path.display()))
            })
        };
        let hidden = get("embedding_length")?.to_u32()? as usize;
        let heads = get("attention.head_count")?.to_u32()? as usize;
        // Qwen3-MoE: each sparse layer routes a token to `expert_used_count` of `expert_count`
        // experts, their weights renormalised over those (llama.cpp's `qwen3moe` does so unless
        // the file says otherwise).
        let experts = match (get("expert_count"), get("expert_used_count")) {
            (Ok(count), Ok(used)) => Some((count.to_u32()? as usize, used.to_u32()? as usize)),
            _ if arch == "qwen3moe" => {
                candle_core::bail!(
                    "{}: a `qwen3moe` file without `{arch}.expert_count` and `{arch}.expert_used_count`",
                    path.display()
                )
            }
            _ => None,
        };
        let renormalise = get("expert_weights_norm")
            .and_then(|v| v.to_bool())
            .unwrap_or(true);
        let config = TargetConfig {
            // The Hugging Face `model_type` of the same model.
            family: if arch == "qwen3moe" {
                "qwen3_moe".into()
            } else {
                arch.clone()
            },
            hidden,
            layers: get("block_count")?.to_u32()? as usize,
            heads,
            kv_heads: get("attention.head_count_kv")?.to_u32()? as usize,
            head_dim: get("attention.key_length")
                .and_then(|v| v.to_u32())
                .map_or(hidden / heads, |v| v as usize),
            // A MoE file may have no dense layer, so no dense width.
            ffn: get("feed_forward_length").map_or(Ok(0), |v| v.to_u32())? as usize,
            vocab: 0,
            eps: f64::from(get("attention.layer_norm_rms_epsilon")?.to_f32()?),
            rope_theta: get("rope.freq_base")
                .and_then(|v| v.to_f32())
                .map_or(10_000.0, f64::from),
            qk_norm: arch.starts_with("qwen3"),
            context: get("context_length")
                .map_or(2048, |v| v.to_u32().map_or(2048, |c| c as usize)),
            hybrid: None,
        };
        // Small targets run faster as dense f32 (gemm) than through candle's quantized dot
        // products on CPU; large ones stay quantized.
        let f32_bytes: usize = content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count() * 4)
            .sum();
        let dequantize_all = f32_bytes < DENSE_BELOW_BYTES;
        // Each tensor read onto `on` (the experts go through the host to be cut apart).
        let mut tensor = |name: &str, on: &Device| content.tensor(&mut file, name, on);
        let embed_q = tensor("token_embd.weight", device)?;
        let embed = embed_q.dequantize(device)?;
        let lm_head = match tensor("output.weight", device) {
            Ok(t) => t.dequantize(device)?,
            Err(_) => embed.clone(),
        };
        drop(embed_q);
        let norm = tensor("output_norm.weight", device)?.dequantize(device)?;
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let mut q = |n: &str| -> Result<Linear> {
                let t = tensor(&format!("blk.{i}.{n}.weight"), device)?;
                if dequantize_all {
                    Ok(Linear::Dense(t.dequantize(device)?))
                } else {
                    Ok(Linear::Quantized(QMatMul::from_qtensor(t)?))
                }
            };
            let (wq, wk, wv, wo) = (q("attn_q")?, q("attn_k")?, q("attn_v")?, q("attn_output")?);
            // A sparse layer has a router; a dense one (Qwen3-MoE's `mlp_only_layers`) not.
            let router = format!("blk.{i}.ffn_gate_inp.weight");
            let mlp = match experts.filter(|_| content.tensor_infos.contains_key(&router)) {
                None => Mlp::dense(q("ffn_gate")?, q("ffn_up")?, q("ffn_down")?)?,
                Some((count, top_k)) => {
                    // Stacked per projection, `[experts, rows, cols]`: cut into one matrix per
                    // expert, each quantized as stored (or dense f32 for a small model).
                    let mut parts = Vec::with_capacity(3);
                    for n in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
                        let name = format!("blk.{i}.{n}.weight");
                        let stacked = tensor(&name, &Device::Cpu)?;
                        let mut per_expert = Vec::with_capacity(count);
                        for e in expert_slices(&stacked, count, device)
                            .map_err(|e| e.context(format!("{}: {name}", path.display())))?
                        {
                            per_expert.push(if dequantize_all {
                                Linear::Dense(e.dequantize(device)?)
                            } else {
                                Linear::Quantized(QMatMul::from_qtensor(e)?)
                            });
                        }
                        parts.push(per_expert);
                    }
                    let [gates, ups, downs] = <[Vec<Linear>; 3]>::try_from(parts)
                        .map_err(|_| candle_core::Error::Msg("three expert projections".into()))?;
                    Mlp::Experts(Moe {
                        router: Linear::Dense(tensor(&router, device)?.dequantize(device)?),
                        experts: gates
                            .into_iter()
                            .zip(ups)
                            .zip(downs)
                            .map(|((g, u), d)| (g, u, d))
                            .collect(),
                        top_k,
                        renormalise,
                        shared: None,
                    })
                }
            };
            let mut dense =
                |n: &str| tensor(&format!("blk.{i}.{n}.weight"), device)?.dequantize(device);
            layers.push(Layer {
                attn_norm: dense("attn_norm")?,
                mixer: Mixer::Attention(Attention::new(
                    wq,
                    wk,
                    wv,
                    wo,
                    if config.qk_norm {
                        Some(dense("attn_q_norm")?)
                    } else {
                        None
                    },
                    if config.qk_norm {
                        Some(dense("attn_k_norm")?)
                    } else {
                        None
                    },
                    false,
                )?),
                ffn_norm: dense("ffn_norm")?,
                mlp,
            });
        }
        let config = TargetConfig {
            vocab: embed.dim(0)?,
            ..config
        };
        Ok(Self {
            config,
            embed,
            lm_head,
            norm,
            layers,
            rope_interleaved: arch == "llama",
            dtype: DType::F32,
        })
    }

    /// Load a target from `path`: a `.gguf` file ([`Self::from_gguf`]) or a Hugging Face model
    /// folder, `config.json` with `model.safetensors` or sharded `model-*.safetensors`
    /// ([`Self::from_hf`]).
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        if path.is_dir() {
            Self::from_hf(path, device)
        } else {
            Self::from_gguf(path, device)
        }
    }

    /// Load a Hugging Face model folder (`model_type` `llama` or `qwen3`): weights in f32 on
    /// CPU, bf16 on a GPU (the dtype they are published in).
    pub fn from_hf(dir: &Path, device: &Device) -> Result<Self> {
        let config_path = dir.join("config.json");
        let msg = |m: String| candle_core::Error::Msg(format!("{}: {m}", config_path.display()));
        let shape = crate::shape::ModelShape::from_config_json(&config_path)
            .map_err(|e| msg(e.to_string()))?;
        let hybrid_family = is_hybrid_family(&shape.family);
        if !matches!(shape.family.as_str(), "llama" | "qwen3" | "qwen3_moe") && !hybrid_family {
            return Err(msg(format!(
                "model_type `{}`; targets are `llama`, `qwen3`, `qwen3_moe`, `qwen3_5` (and its MoE) and `qwen3_next` models",
                shape.family
            )));
        }
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path)?)
            .map_err(|e| msg(e.to_string()))?;
        let doc = doc
            .get("text_config")
            .filter(|v| v.is_object())
            .unwrap_or(&doc);
        let float = |k: &str| doc.get(k).and_then(serde_json::Value::as_f64);
        // Newer configs keep the rotary settings under `rope_parameters`.
        let rope = |k: &str| {
            doc.get("rope_parameters")
                .and_then(|r| r.get(k))
                .and_then(serde_json::Value::as_f64)
                .or_else(|| float(k))
        };
        // Mixture-of-experts MLPs: (experts, experts per token).
        let experts = match (
            // Qwen3-MoE's config names them `num_local_experts`.
            doc.get("num_experts")
                .or_else(|| doc.get("num_local_experts"))
                .and_then(serde_json::Value::as_u64),
            doc.get("num_experts_per_tok")
                .and_then(serde_json::Value::as_u64),
        ) {
            (Some(e), Some(k)) if e > 0 && k > 0 => Some((e as usize, k as usize)),
            _ => None,
        };
        // Qwen3-Next can keep some layers dense: those listed, or off the sparse step.
        let dense_layers: Vec<u64> = doc
            .get("mlp_only_layers")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        let sparse_step = doc
            .get("decoder_sparse_step")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(1)
            .max(1);
        let renormalise = doc
            .get("norm_topk_prob")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(true);
        let hybrid = if hybrid_family {
            Some(hybrid_shape(doc, &shape).map_err(msg)?)
        } else {
            None
        };
        let config = TargetConfig {
            family: shape.family.clone(),
            hidden: shape.hidden as usize,
            layers: shape.layers as usize,
            heads: shape.heads as usize,
            kv_heads: shape.kv_heads as usize,
            head_dim: shape.head_dim as usize,
            ffn: shape.ffn as usize,
            vocab: shape.vocab as usize,
            eps: float("rms_norm_eps").unwrap_or(1e-6),
            rope_theta: rope("rope_theta").unwrap_or(10_000.0),
            qk_norm: shape.family.starts_with("qwen3"),
            context: doc
                .get("max_position_embeddings")
                .and_then(serde_json::Value::as_u64)
                .map_or(2048, |c| c as usize),
            hybrid,
        };
        let dtype = if device.is_cuda() {
            DType::BF16
        } else {
            DType::F32
        };
        let mut weights = std::collections::HashMap::new();
        for file in safetensors_files(dir)? {
            let loaded = candle_core::safetensors::load(&file, device)
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", file.display())))?;
            weights.extend(loaded);
        }
        // A multimodal checkpoint (Qwen3.5's) keeps the text model under `language_model`.
        let prefix = if weights.contains_key("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let mut take = |name: &str| -> Result<Tensor> {
            weights
                .remove(name)
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{}: no tensor `{name}` in its safetensors files",
                        dir.display()
                    ))
                })?
                .to_dtype(dtype)
        };
        // Qwen3.5's RMSNorms scale by (1 + weight): stored here as the plain norm's weight.
        let centred = |t: Tensor| -> Result<Tensor> { if hybrid_family { t + 1.0 } else { Ok(t) } };
        let embed = take(&format!("{prefix}embed_tokens.weight"))?;
        let norm = centred(take(&format!("{prefix}norm.weight"))?)?;
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let name = |n: &str| format!("{prefix}layers.{i}.{n}");
            let mut w = |n: &str| take(&name(n));
            let linear = config.hybrid.as_ref().is_some_and(|h| h.linear[i]);
            let mixer = if linear {
                let h = config.hybrid.as_ref().expect("hybrid").delta.clone();
                let a_log = w("linear_attn.A_log")?.to_dtype(DType::F32)?;
                let (qkv, z, b, a) = if shape.family == "qwen3_next" {
                    next_projections(
                        &w("linear_attn.in_proj_qkvz.weight")?,
                        &w("linear_attn.in_proj_ba.weight")?,
                        &h,
                    )?
                } else {
                    (
                        w("linear_attn.in_proj_qkv.weight")?,
                        w("linear_attn.in_proj_z.weight")?,
                        w("linear_attn.in_proj_b.weight")?,
                        w("linear_attn.in_proj_a.weight")?,
                    )
                };
                Mixer::Delta(DeltaNet {
                    qkv: Linear::Dense(qkv),
                    z: Linear::Dense(z),
                    b: Linear::Dense(b),
                    a: Linear::Dense(a),
                    conv: w("linear_attn.conv1d.weight")?.reshape((h.conv_dim(), h.kernel))?,
                    dt_bias: w("linear_attn.dt_bias")?,
                    decay_rate: a_log.exp()?.neg()?,
                    norm: w("linear_attn.norm.weight")?,
                    out: Linear::Dense(w("linear_attn.out_proj.weight")?),
                    eps: config.eps,
                    shape: h,
                })
            } else {
                Mixer::Attention(Attention::new(
                    Linear::Dense(w("self_attn.q_proj.weight")?),
                    Linear::Dense(w("self_attn.k_proj.weight")?),
                    Linear::Dense(w("self_attn.v_proj.weight")?),
                    Linear::Dense(w("self_attn.o_proj.weight")?),
                    config
                        .qk_norm
                        .then(|| w("self_attn.q_norm.weight").and_then(centred))
                        .transpose()?,
                    config
                        .qk_norm
                        .then(|| w("self_attn.k_norm.weight").and_then(centred))
                        .transpose()?,
                    hybrid_family,
                )?)
            };
            let sparse = !dense_layers.contains(&(i as u64)) && (i as u64 + 1) % sparse_step == 0;
            let mlp = match experts.filter(|_| sparse) {
                None => Mlp::dense(
                    Linear::Dense(w("mlp.gate_proj.weight")?),
                    Linear::Dense(w("mlp.up_proj.weight")?),
                    Linear::Dense(w("mlp.down_proj.weight")?),
                )?,
                Some((count, top_k)) => {
                    // Checkpoints hold one tensor per expert (transformers fuses them at load).
                    let mut list = Vec::with_capacity(count);
                    for e in 0..count {
                        let mut x =
                            |n: &str| w(&format!("mlp.experts.{e}.{n}.weight")).map(Linear::Dense);
                        list.push((x("gate_proj")?, x("up_proj")?, x("down_proj")?));
                    }
                    // Qwen3-MoE has no shared expert.
                    let shared = match w("mlp.shared_expert_gate.weight") {
                        Ok(scale) => Some(SharedExpert {
                            gate: Linear::Dense(w("mlp.shared_expert.gate_proj.weight")?),
                            up: Linear::Dense(w("mlp.shared_expert.up_proj.weight")?),
                            down: Linear::Dense(w("mlp.shared_expert.down_proj.weight")?),
                            scale: Linear::Dense(scale),
                        }),
                        Err(_) => None,
                    };
                    Mlp::Experts(Moe {
                        router: Linear::Dense(w("mlp.gate.weight")?),
                        experts: list,
                        top_k,
                        renormalise,
                        shared,
                    })
                }
            };
            layers.push(Layer {
                mixer,
                mlp,
                attn_norm: centred(w("input_layernorm.weight")?)?,
                ffn_norm: centred(w("post_attention_layernorm.weight")?)?,
            });
        }
        // Tied models publish no `lm_head.weight`; some untied ones still omit it when equal.
        let lm_head = match take("lm_head.weight") {
            Ok(t) if !shape.tied_embeddings => t,
            _ => embed.clone(),
        };
        Ok(Self {
            config,
            embed,
            lm_head,
            norm,
            layers,
            rope_interleaved: false,
            dtype,
        })
    }

    /// Random weights (normal, std 0.02; norms at 1) at `config`'s shape, in `dtype`.
    pub fn random(config: TargetConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        if config.hybrid.is_some() {
            candle_core::bail!("random weights are for attention-only shapes");
        }
        let mut rng = super::drafter::Init::new(seed);
        let c = &config;
        let q_width = c.heads * c.head_dim;
        let kv_width = c.kv_heads * c.head_dim;
        // On a GPU the draws happen there (billions of them at a real shape): fast, but not the
        // same numbers as on CPU; CPU draws are the same on every machine.
        let mut w = |o: usize, i: usize| -> Result<Tensor> {
            if device.is_cuda() {
                Tensor::randn(0f32, 0.02, (o, i), device)?.to_dtype(dtype)
            } else {
                rng.normal(&[o, i], 0.02, dtype, device)
            }
        };
        let ones = |n: usize| Tensor::ones(n, dtype, device);
        let embed = w(c.vocab, c.hidden)?;
        let mut layers = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            layers.push(Layer {
                attn_norm: ones(c.hidden)?,
                mixer: Mixer::Attention(Attention::new(
                    Linear::Dense(w(q_width, c.hidden)?),
                    Linear::Dense(w(kv_width, c.hidden)?),
                    Linear::Dense(w(kv_width, c.hidden)?),
                    Linear::Dense(w(c.hidden, q_width)?),
                    if c.qk_norm {
                        Some(ones(c.head_dim)?)
                    } else {
                        None
                    },
                    if c.qk_norm {
                        Some(ones(c.head_dim)?)
                    } else {
                        None
                    },
                    false,
                )?),
                ffn_norm: ones(c.hidden)?,
                mlp: Mlp::dense(
                    Linear::Dense(w(c.ffn, c.hidden)?),
                    Linear::Dense(w(c.ffn, c.hidden)?),
                    Linear::Dense(w(c.hidden, c.ffn)?),
                )?,
            });
        }
        let lm_head = w(c.vocab, c.hidden)?;
        Ok(Self {
            norm: ones(c.hidden)?,
            config,
            embed,
            lm_head,
            layers,
            rope_interleaved: false,
            dtype,
        })
    }

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

/// A GGUF tensor of experts stacked `[experts, rows, cols]` (loaded on the CPU) as one
/// `[rows, cols]` tensor per expert on `device`, each in the stored type: an expert's bytes are
/// a contiguous run of whole blocks when its matrix fills whole blocks, which is checked.
fn expert_slices(
    stacked: &candle_core::quantized::QTensor,
    experts: usize,
    device: &Device,
) -> Result<Vec<candle_core::quantized::QTensor>> {
    use candle_core::quantized::{QStorage, QTensor};
    let (count, rows, cols) = stacked.shape().dims3()?;
    let dtype = stacked.dtype();
    if count != experts || (rows * cols) % dtype.block_size() != 0 {
        candle_core::bail!(
            "experts stacked as {:?} in {dtype:?} (blocks of {}), where {experts} experts of whole blocks were expected",
            stacked.shape().dims(),
            dtype.block_size()
        );
    }
    let bytes = stacked.data()?;
    let each = bytes.len() / count;
    (0..count)
        .map(|e| {
            let part = std::borrow::Cow::Borrowed(&bytes[e * each..(e + 1) * each]);
            QTensor::new(QStorage::from_data(part, device, dtype)?, (rows, cols))
        })
        .collect()
}

/// Model types of hybrid targets (Gated DeltaNet and gated attention): Qwen3.5's, in a
/// multimodal checkpoint (its `text_config`) or text-only.
pub fn is_hybrid_family(family: &str) -> bool {
    matches!(
        family,
        "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_next"
    )
}

/// Qwen3-Next's fused Gated DeltaNet projections, rows grouped per key head (`[q, k, v, z]` and
/// `[b, a]` for each), as Qwen3.5's separate ones (all queries, all keys, all values; z; b; a),
/// the layout [`DeltaNet`] reads.
fn next_projections(
    qkvz: &Tensor,
    ba: &Tensor,
    s: &DeltaShape,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let r = s.value_heads / s.key_heads;
    let (dk, vw) = (s.key_dim, r * s.value_dim);
    let group = 2 * dk + 2 * vw;
    let rows = |t: &Tensor, width: usize, offset: usize, count: usize| -> Result<Tensor> {
        let parts: Vec<Tensor> = (0..s.key_heads)
            .map(|g| t.narrow(0, g * width + offset, count))
            .collect::<Result<_>>()?;
        Tensor::cat(&parts, 0)
    };
    let qkv = Tensor::cat(
        &[
            rows(qkvz, group, 0, dk)?,
            rows(qkvz, group, dk, dk)?,
            rows(qkvz, group, 2 * dk, vw)?,
        ],
        0,
    )?;
    let z = rows(qkvz, group, 2 * dk + vw, vw)?;
    let b = rows(ba, 2 * r, 0, r)?;
    let a = rows(ba, 2 * r, r, r)?;
    Ok((qkv, z, b, a))
}

/// A hybrid's layer types, Gated DeltaNet shape and rotary width from its (text) config.
fn hybrid_shape(
    doc: &serde_json::Value,
    shape: &crate::shape::ModelShape,
) -> std::result::Result<Hybrid, String> {
    let int = |k: &str| {
        doc.get(k)
            .and_then(serde_json::Value::as_u64)
            .map(|v| v as usize)
    };
    let need = |k: &str| {
        int(k)
            .filter(|&v| v > 0)
            .ok_or(format!("no positive integer `{k}`"))
    };
    let layers = shape.layers as usize;
    let linear: Vec<bool> = match doc.get("layer_types").and_then(serde_json::Value::as_array) {
        Some(types) => {
            let kinds: Vec<bool> = types
                .iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(format!(
                        "layer type {other:?}; expected `linear_attention` or `full_attention`"
                    )),
                })
                .collect::<std::result::Result<_, _>>()?;
            if kinds.len() != layers {
                return Err(format!("{} layer_types for {layers} layers", kinds.len()));
            }
            kinds
        }
        // The published default: every `full_attention_interval`-th layer is full attention.
        None => {
            let every = int("full_attention_interval").unwrap_or(4).max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let delta = DeltaShape {
        key_heads: need("linear_num_key_heads")?,
        value_heads: need("linear_num_value_heads")?,
        key_dim: need("linear_key_head_dim")?,
        value_dim: need("linear_value_head_dim")?,
        kernel: int("linear_conv_kernel_dim").unwrap_or(4),
    };
    if delta.value_heads % delta.key_heads != 0 || delta.kernel < 1 {
        return Err(format!(
            "linear attention with {} key heads for {} value heads and a kernel of {}",
            delta.key_heads, delta.value_heads, delta.kernel
        ));
    }
    let factor = doc
        .get("rope_parameters")
        .and_then(|r| r.get("partial_rotary_factor"))
        .or_else(|| doc.get("partial_rotary_factor"))
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.25);
    let head_dim = shape.head_dim as usize;
    let rotary_dim = ((head_dim as f64 * factor) as usize).clamp(2, head_dim) & !1;
    Ok(Hybrid {
        linear,
        delta,
        rotary_dim,
    })
}

/// A model folder's safetensors files: those its `model.safetensors.index.json` names, else
/// `model.safetensors`.
fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", index.display())))?;
        let mut files: Vec<&str> = doc
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .map(|m| m.values().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default();
        files.sort_unstable();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    candle_core::bail!(
        "{}: neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )
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

/// The target's keys and values for the positions decoded so far (speculative decoding crops
/// it back to the accepted prefix after each verification).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    /// Per layer: what it keeps.
    layers: Vec<Option<Slot>>,
    len: usize,
    /// The positions of the attention layers' keys and values that the cache holds, when a
    /// round cut it ([`Self::keep_path`], [`Self::truncate`]) since the last pass: applied by the
    /// next pass as it appends (`fused::keep_append`, one copy a tensor), so cutting costs no
    /// launch and the append no more than it did.
    kept: Option<Kept>,
}

/// Positions kept of the attention layers' stored keys and values, and their upload (one for
/// all the layers of a pass).
#[derive(Clone, Debug)]
struct Kept {
    positions: Vec<u32>,
    on_device: Option<Tensor>,
}

impl KvCache {
    /// What a layer's stored keys or values `past` become with `added` appended: the kept
    /// positions of `past` then `added`.
    fn append(&mut self, past: &Tensor, added: &Tensor) -> Result<Tensor> {
        let Some(kept) = self.kept.as_mut() else {
            return Tensor::cat(&[past, added], 1);
        };
        let at = match &kept.on_device {
            Some(t) => t.clone(),
            None => kept
                .on_device
                .insert(Tensor::new(kept.positions.as_slice(), past.device())?)
                .clone(),
        };
        super::fused::keep_append(past, &at, added)
    }

    /// The positions held, as positions of what the layers store.
    fn held(&self) -> Vec<u32> {
        match &self.kept {
            Some(k) => k.positions.clone(),
            None => (0..self.len as u32).collect(),
        }
    }
}

/// What one layer keeps of the positions decoded so far.
#[derive(Clone, Debug)]
enum Slot {
    /// Attention: `[kv_heads, len, head_dim]` keys and values.
    Kv(Tensor, Tensor),
    /// Gated DeltaNet: the state at the positions it can be cropped to (ascending; the last at
    /// the cache's length). It holds no per-token history, so only these.
    Delta(Vec<(usize, DeltaState)>),
    /// Gated DeltaNet after a tree pass from `past`: the state before it and after each node,
    /// until [`KvCache::keep_path`] turns one root-down path of them into [`Slot::Delta`].
    DeltaTree {
        past: usize,
        before: DeltaState,
        nodes: Vec<DeltaState>,
    },
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// After a tree pass that started at `past`: keep the first `past` positions and then the
    /// tree nodes `path` (indices into the pass, in order: the root, then each node's child),
    /// dropping the other branches.
    pub fn keep_path(&mut self, past: usize, path: &[usize]) -> Result<()> {
        let n = self.len.saturating_sub(past);
        if path.iter().any(|&i| i >= n) {
            candle_core::bail!("a path through nodes {path:?} of a pass of {n}");
        }
        let keep: Vec<usize> = (0..past).chain(path.iter().map(|&i| past + i)).collect();
        let held = self.held();
        for slot in self.layers.iter_mut().flatten() {
            match slot {
                Slot::Kv(..) => {}
                Slot::DeltaTree {
                    past: from,
                    before,
                    nodes,
                } => {
                    if *from != past {
                        candle_core::bail!(
                            "a tree pass from position {from} cut as if from {past}"
                        );
                    }
                    // The path's j-th node sits at `past + j`; its state is the one after it.
                    let kept = std::iter::once((past, before.clone()))
                        .chain(
                            path.iter()
                                .enumerate()
                                .map(|(j, &node)| (past + j + 1, nodes[node].clone())),
                        )
                        .collect();
                    *slot = Slot::Delta(kept);
                }
                Slot::Delta(_) => {
                    candle_core::bail!("a Gated DeltaNet layer's last pass was not a tree")
                }
            }
        }
        // The attention layers' keys and values are cut by the next pass as it appends.
        self.kept = Some(Kept {
            positions: keep.iter().map(|&j| held[j]).collect(),
            on_device: None,
        });
        self.len = keep.len();
        Ok(())
    }

    /// Keep the first `len` positions (a hybrid's only back to the start of the last pass).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        let mut held = self.held();
        held.truncate(len);
        for slot in self.layers.iter_mut().flatten() {
            match slot {
                Slot::Kv(..) => {}
                Slot::DeltaTree { .. } => candle_core::bail!(
                    "the last pass was a tree: keep one path of it (`keep_path`), then crop"
                ),
                Slot::Delta(kept) => {
                    kept.retain(|(at, _)| *at <= len);
                    if kept.last().is_none_or(|(at, _)| *at != len) {
                        candle_core::bail!(
                            "a Gated DeltaNet layer's state at position {len} was not kept (a pass keeps every position's only when it is at most {STEPPED_UP_TO} tokens)"
                        );
                    }
                }
            }
        }
        // The attention layers' keys and values are cut by the next pass as it appends.
        self.kept = Some(Kept {
            positions: held,
            on_device: None,
        });
        self.len = len;
        Ok(())
    }
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
