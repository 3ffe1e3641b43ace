//! The hardware an estimate is for (`--gpus 8xH200`) and the throughput assumptions that turn
//! work into time, each with where its number comes from. Users override any of them with
//! `--assume name=value`; dflash's own measurements replace them where a stored artifact has one.

use std::fmt;

use serde::Serialize;

/// One GPU model's published figures.
#[derive(Clone, Debug, Serialize)]
pub struct Gpu {
    /// Name as written in `--gpus`.
    pub name: &'static str,
    /// Dense bf16 tensor TFLOP/s.
    pub tflops: f64,
    /// Memory, GB (10^9 bytes).
    pub memory_gb: f64,
    /// Memory bandwidth, TB/s.
    pub bandwidth_tbs: f64,
    /// GPUs of one host talk over NVLink (else PCIe).
    pub nvlink: bool,
    /// A typical rental price, USD per GPU-hour (override with `--price`).
    pub price: f64,
}

/// Vendors' data-sheet figures; prices are rough on-demand cloud rates of 2026.
pub const GPUS: &[Gpu] = &[
    Gpu {
        name: "H200",
        tflops: 989.0,
        memory_gb: 141.0,
        bandwidth_tbs: 4.8,
        nvlink: true,
        price: 3.5,
    },
    Gpu {
        name: "H100",
        tflops: 989.0,
        memory_gb: 80.0,
        bandwidth_tbs: 3.35,
        nvlink: true,
        price: 2.5,
    },
    Gpu {
        name: "H100-PCIe",
        tflops: 756.0,
        memory_gb: 80.0,
        bandwidth_tbs: 2.0,
        nvlink: false,
        price: 2.2,
    },
    Gpu {
        name: "B200",
        tflops: 2250.0,
        memory_gb: 180.0,
        bandwidth_tbs: 8.0,
        nvlink: true,
        price: 5.0,
    },
    Gpu {
        name: "A100",
        tflops: 312.0,
        memory_gb: 80.0,
        bandwidth_tbs: 2.04,
        nvlink: true,
        price: 1.5,
    },
    Gpu {
        name: "L40S",
        tflops: 362.0,
        memory_gb: 48.0,
        bandwidth_tbs: 0.864,
        nvlink: false,
        price: 1.0,
    },
    Gpu {
        name: "RTX4090",
        tflops: 165.0,
        memory_gb: 24.0,
        bandwidth_tbs: 1.008,
        nvlink: false,
        price: 0.5,
    },
];

/// `--gpus`: how many of which GPU.
#[derive(Clone, Debug, Serialize)]
pub struct Hardware {
    /// GPUs on the host.
    pub count: u32,
    /// Which.
    pub gpu: Gpu,
}

impl Hardware {
    /// Parse `8xH200` (or `H200`, one GPU). Case-insensitive.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let (count, name) = match t.split_once(['x', 'X']) {
            Some((n, name)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
                (n.parse::<u32>().map_err(|e| e.to_string())?, name)
            }
            _ => (1, t),
        };
        if count == 0 {
            return Err(format!("`{text}` asks for no GPUs"));
        }
        let gpu = GPUS
            .iter()
            .find(|g| g.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let names: Vec<&str> = GPUS.iter().map(|g| g.name).collect();
                format!("unknown GPU `{name}`; dflash knows {}", names.join(", "))
            })?;
        Ok(Self {
            count,
            gpu: gpu.clone(),
        })
    }
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.count, self.gpu.name)
    }
}

/// One throughput assumption and where its value comes from.
#[derive(Clone, Debug, Serialize)]
pub struct Assumption {
    /// Its `--assume` name.
    pub name: &'static str,
    /// The value.
    pub value: f64,
    /// What it means, with its unit.
    pub meaning: &'static str,
    /// Where the value comes from.
    pub source: String,
}

/// The table of assumptions for one hardware choice.
#[derive(Clone, Debug, Serialize)]
pub struct Assumptions {
    /// In a fixed order (the table's).
    pub items: Vec<Assumption>,
}

/// Llama-3.1-8B, the model of the decode anchor below.
pub const DECODE_ANCHOR_PARAMS: f64 = 8.03e9;

impl Assumptions {
    /// Defaults for `hw`, from published figures (../shared/DFLASH.md) scaled to this GPU.
    pub fn defaults(hw: &Hardware) -> Self {
        let g = &hw.gpu;
        // Decode at large batch is bound by memory bandwidth: scale the H100 anchor by it.
        let decode = 5_800.0 * g.bandwidth_tbs / 3.35;
        let tp = if g.nvlink { 0.9 } else { 0.7 };
        let items = vec![
            Assumption {
                name: "decode_tokens_per_s",
                value: decode.round(),
                meaning: "output tokens/s one GPU server sustains for an 8B model (scaled by 8B / parameters)",
                source: format!(
                    "DFLASH.md: vLLM, Llama-3.1-8B, one H100, ~5,800 tokens/s; x{:.2} memory bandwidth of the {}",
                    g.bandwidth_tbs / 3.35,
                    g.name
                ),
            },
            Assumption {
                name: "prefill_mfu",
                value: 0.45,
                meaning: "share of peak bf16 FLOP/s a target forward (prefill) reaches",
                source: "DFLASH.md: Qwen3-8B target forward, 29.8K tokens/s eager on one H200"
                    .into(),
            },
            Assumption {
                name: "train_mfu",
                value: 0.51,
                meaning: "share of peak bf16 FLOP/s an online training step reaches",
                source: "measured: dflash's own step at the Qwen3-8B shape (3,072 tokens, 512 anchors x 16, 5 layers), 235.0 ms on one H100, which this model counts as 118.7 TFLOP (README \"On the GPU\"; PyTorch eager's was 35%, DFLASH.md)"
                    .into(),
            },
            Assumption {
                name: "tp_efficiency",
                value: tp,
                meaning: "per-GPU throughput kept each time tensor parallelism doubles",
                source: format!(
                    "assumed for {} ({})",
                    if g.nvlink { "NVLink" } else { "PCIe" },
                    g.name
                ),
            },
            Assumption {
                name: "cpu_decode_tokens_per_s",
                value: 80.0,
                meaning: "output tokens/s of the in-process candle backend on this machine for a 135M model",
                source: "measured: the quickstart's `generate`, 2,042 tokens in 25.6 s on 2 cores, loading included (`.ci/run`, 2026-12-07)"
                    .into(),
            },
            Assumption {
                name: "gpu_candle_decode_tokens_per_s",
                value: (5_556.0 * g.bandwidth_tbs / 3.35).round(),
                meaning: "output tokens/s of the in-process candle backend on one GPU for a 135M model, batched (scaled by 135M / parameters)",
                source: format!(
                    "measured: pipelines/smollm2.yaml on one H100, 643,872 tokens in 115.9 s at batch 512, waves kept full (README); x{:.2} memory bandwidth of the {}",
                    g.bandwidth_tbs / 3.35,
                    g.name
                ),
            },
            Assumption {
                name: "train_launch_s_per_layer",
                value: 0.000_27,
                meaning: "seconds a training step spends per sequence and layer pass (target layers forward, drafter layers x3) on kernel launches and small ops, besides its block rows' (below); a step takes the longer of these and its FLOPs",
                source: "fitted: pipelines/smollm2.yaml's sweep on one H100, 6 trainings of 200 steps of 16 sequences (1 / 3 / 5 drafter layers, blocks of 8 and 16: 14.8-24.3 ms per sequence, each fitted within 0.3 ms) (README \"The fourth run\")".into(),
            },
            Assumption {
                name: "train_head_s_per_row",
                value: 0.000_001,
                meaning: "seconds a training step spends per sequence and block row (anchors x block size) in the LM head, its loss and their small ops, when bound by launches and small ops",
                source: "fitted: the same sweep (blocks of 8 trained in 0.77x the time of 16) (README \"The fourth run\")".into(),
            },
            Assumption {
                name: "train_layer_s_per_row",
                value: 0.000_000_4,
                meaning: "seconds a training step spends per sequence, block row and drafter layer (forward and backward), when bound by launches and small ops",
                source: "fitted: the same sweep (each drafter layer added ~2.4 ms per sequence at 256 anchors x 16) (README \"The fourth run\")".into(),
            },
            Assumption {
                name: "train_dflash2_step_ratio",
                value: 1.7,
                meaning: "a DFlash 2 training step (`head: dflash2`), in DFlash steps at the same shape",
                source: "measured: pipelines/smollm2.yaml on one H100, 300 steps of 16 sequences in 213.2 s (DFlash 2) against 124.9 s (DFlash), both with loading and export (README)".into(),
            },
            Assumption {
                name: "decode_step_s_per_layer",
                value: 0.000_18,
                meaning: "seconds one in-process decoding step (one token, batch 1) spends per target layer on a GPU",
                source: "measured: pipelines/smollm2.yaml's bench, 4.4-5.5 ms per step of the 30-layer target on one H100 (README \"The tenth run\"), 5.6-5.7 ms on one H200 (\"The eleventh run\": launch-bound, so no faster for the H200's bandwidth)".into(),
            },
            Assumption {
                name: "bench_verify_step_ratio",
                value: 1.1,
                meaning: "a verification round of a few tokens, in target steps (prompt lookup's round)",
                source: "measured: the same bench, prompt lookup's rounds 4.8-5.9 ms against 4.4-5.5 ms per step (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_drafter_round_ratio",
                value: 1.4,
                meaning: "a drafter's round (its pass and the verification), in target steps",
                source: "measured: the same bench, a 3-layer drafter's chain round 6.7-7.5 ms (proposing 1.4-1.6) against 4.8-5.5 ms per step (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_tree_round_ratio",
                value: 1.8,
                meaning: "a drafter's round verified as a tree (its pass and a 128-node target pass, prompt lookup's paths in it or not), in target steps",
                source: "measured: the same bench, tree rounds of 128 nodes 8.3-9.8 ms against 4.4-5.5 ms per step (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_tau_ngram",
                value: 2.1,
                meaning: "tokens prompt lookup commits a round (tau); 1 bounds the bench's time from above",
                source: "measured: pipelines/smollm2.yaml's bench, 2.07 / 2.10 / 2.78 on HumanEval / GSM8K / MT-Bench, 2.18 over all 164 HumanEval prompts (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_tau_chain",
                value: 2.2,
                meaning: "tokens a drafter's chain round commits (tau); the story's trained drafter; 1 for one not yet trained, and bounds the time from above",
                source: "measured: the story's 5,600-step drafter, 2.19 / 2.43 / 2.73 (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_tau_tree",
                value: 3.4,
                meaning: "tokens a drafter's tree round commits (tau); the story's trained drafter",
                source: "measured: the story's 5,600-step drafter, the tree 3.38 / 3.73 / 3.89 (README \"The tenth run\")".into(),
            },
            Assumption {
                name: "bench_tau_tree_lookup",
                value: 4.3,
                meaning: "tokens a drafter's tree round with prompt lookup's paths grafted on commits (tau); the story's trained drafter",
                source: "measured: the story's 5,600-step drafter over all of HumanEval / GSM8K / MT-Bench on one H200, 4.49 / 4.14 / 4.46 (README \"The eleventh run\")".into(),
            },
            Assumption {
                name: "bench_answer_fraction",
                value: 0.77,
                meaning: "the share of `max_new_tokens` a bench's answers take before they stop; 1 bounds the time from above",
                source: "measured: the story's full sets at 256 tokens on one H200, 83,422 tokens over 424 turns (HumanEval 66%, GSM8K 83%, MT-Bench 84%) (README \"The eleventh run\")".into(),
            },
            Assumption {
                name: "tokenize_tokens_per_s",
                value: 3_279_000.0,
                meaning: "tokens/s `tokenize` sustains per CPU core, loading included",
                source: "measured: bench/tokenizer_speed.py on one core (README)".into(),
            },
            Assumption {
                name: "cpu_cores",
                value: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
                meaning: "CPU cores for CPU stages",
                source: "this machine".into(),
            },
            Assumption {
                name: "bytes_per_text_token",
                value: 4.0,
                meaning: "bytes of stored text per token (Arrow conversations)",
                source: "assumed: ~4 characters per BPE token of English and code".into(),
            },
        ];
        Self { items }
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> f64 {
        self.items
            .iter()
            .find(|a| a.name == name)
            .map_or(f64::NAN, |a| a.value)
    }

    /// Replace `name`'s value, saying where the new one comes from.
    pub fn set(&mut self, name: &str, value: f64, source: String) -> Result<(), String> {
        match self.items.iter_mut().find(|a| a.name == name) {
            Some(a) => {
                a.value = value;
                a.source = source;
                Ok(())
            }
            None => {
                let names: Vec<&str> = self.items.iter().map(|a| a.name).collect();
                Err(format!(
                    "no assumption `{name}`; there are {}",
                    names.join(", ")
                ))
            }
        }
    }

    /// Apply `--assume name=value`.
    pub fn apply(&mut self, text: &str) -> Result<(), String> {
        let (name, value) = text
            .split_once('=')
            .ok_or_else(|| format!("`{text}` is not `name=value`"))?;
        let v: f64 = value
            .trim()
            .replace('_', "")
            .parse()
            .map_err(|_| format!("`{value}` in `{text}` is not a number"))?;
        if !v.is_finite() || v <= 0.0 {
            return Err(format!("`{text}`: the value must be a positive number"));
        }
        self.set(name.trim(), v, "--assume".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_parse_with_and_without_a_count() {
        let h = Hardware::parse("8xH200").unwrap();
        assert_eq!((h.count, h.gpu.name), (8, "H200"));
        assert_eq!(Hardware::parse("l40s").unwrap().count, 1);
        assert!(Hardware::parse("8xV9000").unwrap_err().contains("H200"));
        assert!(Hardware::parse("0xH200").is_err());
    }

    #[test]
    fn overrides_are_checked() {
        let mut a = Assumptions::defaults(&Hardware::parse("H200").unwrap());
        a.apply("train_mfu=0.5").unwrap();
        assert!((a.get("train_mfu") - 0.5).abs() < 1e-12);
        assert!(a.apply("trian_mfu=0.5").unwrap_err().contains("train_mfu"));
        assert!(a.apply("train_mfu=-1").is_err());
        assert!(a.apply("train_mfu").is_err());
    }
}
