//! The networks, in candle: the frozen target with hidden-state taps ([`target`]; the linear-
//! attention layers of hybrid targets in [`deltanet`]), the DFlash
//! drafter ([`drafter`]), the training objective ([`objective`]), the optimizer ([`optim`])
//! and speculative decoding ([`speculative`]). Everything the drafter's gradients flow through is
//! differentiable: candle ops ([`ops`]), and fused ops with backward passes of their own for
//! attention's softmax, the cross-entropy and AdamW ([`fused`]); candle's fused rms_norm / rope
//! kernels have no backward and are used only in the frozen target.

pub mod batch;
pub mod deltanet;
pub mod device;
pub mod dflash2;
pub mod drafter;
pub mod fused;
pub mod objective;
pub mod ops;
pub mod optim;
mod rope_cache;
pub mod speculative;
pub mod target;
pub mod written;

pub use drafter::{Drafter, DrafterConfig};
pub use objective::{Batch, StepMetrics};
pub use optim::{AdamW, Schedule};
pub use target::{Target, TargetConfig};

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    use candle_core::{DType, Device, Tensor};

    use super::target::{Target, TargetConfig};

    /// A tiny random attention-only target on the CPU in f32 (2 layers, 4 query heads over 2
    /// key/value heads of 8, a vocabulary of 50): Llama's shape, or Qwen3's with `qk_norm`.
    pub(crate) fn tiny_target(family: &str, qk_norm: bool, seed: u64) -> Target {
        let config = TargetConfig {
            family: family.into(),
            hidden: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            ffn: 48,
            vocab: 50,
            eps: 1e-6,
            rope_theta: 10_000.0,
            qk_norm,
            context: 128,
            hybrid: None,
        };
        Target::random(config, seed, DType::F32, &Device::Cpu).expect("a tiny target")
    }

    /// The largest absolute value of a tensor (in f64).
    pub(crate) fn max_abs(a: &Tensor) -> f64 {
        max_diff(a, &a.zeros_like().unwrap())
    }

    /// The largest absolute difference between two tensors of one shape (in f64).
    pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }
}

/// Errors of the networks: candle's, or a model file that is not what it should be.
pub type Result<T> = candle_core::Result<T>;
