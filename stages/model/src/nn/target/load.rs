//! Building a [`Target`]: from a GGUF file (quantized weights stay quantized where the model
//! is large), from a Hugging Face folder (config.json and safetensors, the hybrids' and
//! mixture-of-experts layouts included), or with random weights at a real shape.

use std::path::Path;

use candle_core::quantized::{QMatMul, gguf_file};
use candle_core::{DType, Device, Tensor};

use super::*;

impl Target {
    /// Load a GGUF file (architectures `llama`, `qwen3` and `qwen3moe`). Small targets are dequantized:
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
        let mut rng = crate::nn::drafter::Init::new(seed);
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
