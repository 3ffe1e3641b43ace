//! AdamW with decoupled weight decay (PyTorch's semantics), global-norm gradient clipping and
//! the warmup + cosine schedule. The moments are plain named tensors, so a checkpoint holds the
//! optimizer exactly and a resumed run continues bit for bit.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor, Var};

use super::{Result, fused};

/// Learning rate by optimizer step.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// All steps.
    pub total: u64,
    /// Cosine decay to 0 after warmup (else constant).
    pub cosine: bool,
}

impl Schedule {
    /// The rate for step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        if !self.cosine || self.total <= self.warmup {
            return self.peak;
        }
        let progress = (step - self.warmup) as f64 / (self.total - self.warmup) as f64;
        self.peak * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
    }
}

/// AdamW state.
pub struct AdamW {
    /// Betas.
    pub betas: (f64, f64),
    /// Epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Steps taken.
    pub step: u64,
    m: BTreeMap<String, Tensor>,
    v: BTreeMap<String, Tensor>,
}

impl AdamW {
    /// Zero moments for `vars`, in f32 (each its own storage: the update writes them in place).
    pub fn new(vars: &BTreeMap<String, Var>, weight_decay: f64) -> Result<Self> {
        Self::with_moments(vars, weight_decay, DType::F32)
    }

    /// Zero moments for `vars` in `dtype`: f32, or bf16 for half their memory (stepped in f32,
    /// stored back by stochastic rounding: [`fused::round_stochastic`]; on a GPU in
    /// [`Self::step_keeping`]'s master update, elsewhere on the host).
    pub fn with_moments(
        vars: &BTreeMap<String, Var>,
        weight_decay: f64,
        dtype: DType,
    ) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            candle_core::bail!("AdamW's moments are f32 or bf16, not {dtype:?}");
        }
        let zeros = |v: &Var| Tensor::zeros(v.shape(), dtype, v.device());
        Ok(Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: vars
                .iter()
                .map(|(k, v)| Ok((k.clone(), zeros(v)?)))
                .collect::<Result<_>>()?,
            v: vars
                .iter()
                .map(|(k, v)| Ok((k.clone(), zeros(v)?)))
                .collect::<Result<_>>()?,
        })
    }

    /// One update with gradients already summed over the step; returns the gradients' global
    /// norm before clipping to `clip` (no clipping when `clip <= 0`). Parameters and moments
    /// are updated in place by [`fused::adamw_update`]; the norm costs one device sync.
    pub fn step(
        &mut self,
        vars: &BTreeMap<String, Var>,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        clip: f64,
    ) -> Result<f64> {
        self.step_keeping(vars, grads, lr, clip, None)
    }

    /// [`Self::step`], also keeping `copies` (the weights in the step's compute dtype, by name:
    /// [`super::written::ComputeWeights`]) the updated weights' casts, in place: on a GPU the
    /// update of f32 master weights from bf16 gradients writes them as it goes
    /// ([`fused::adamw_update_master`]).
    pub fn step_keeping(
        &mut self,
        vars: &BTreeMap<String, Var>,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        clip: f64,
        copies: Option<&BTreeMap<String, Tensor>>,
    ) -> Result<f64> {
        let mut gs: Vec<(&String, &Var, Tensor)> = Vec::with_capacity(vars.len());
        let mut squares = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            // A parameter the loss did not reach has a zero gradient (its moments still decay).
            let g = match grads.get(name) {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like()?,
            };
            squares.push(fused::sum_squares(&g)?);
            gs.push((name, var, g));
        }
        let norm = if squares.is_empty() {
            0.0
        } else {
            f64::from(Tensor::cat(&squares, 0)?.sum_all()?.to_scalar::<f32>()?).sqrt()
        };
        let clip_scale = if clip > 0.0 && norm > clip {
            clip / (norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let (b1, b2) = self.betas;
        let t = self.step as i32;
        let step = fused::AdamStep {
            lr,
            weight_decay: self.weight_decay,
            betas: self.betas,
            corrections: (1.0 - b1.powi(t), 1.0 - b2.powi(t)),
            eps: self.eps,
            clip_scale,
            rounding_seed: 0,
        };
        for (ordinal, (name, var, g)) in gs.into_iter().enumerate() {
            let (p, m, v) = (var.as_tensor(), &self.m[name], &self.v[name]);
            // bf16 moments' rounding: coins of their own for each step and parameter.
            let step = fused::AdamStep {
                rounding_seed: fused::coin(
                    (self.step as u32).wrapping_mul(0x9e37_79b9) ^ ordinal as u32,
                ),
                ..step.clone()
            };
            match copies.and_then(|c| c.get(name)) {
                Some(low) => fused::adamw_update_master(p, &g, m, v, low, &step)?,
                None => fused::adamw_update(p, &g.to_dtype(p.dtype())?, m, v, &step)?,
            }
        }
        Ok(norm)
    }

    /// The moments as named tensors (`m.NAME`, `v.NAME`): copies, since the next step writes
    /// the optimizer's own in place.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (prefix, moments) in [("m", &self.m), ("v", &self.v)] {
            for (k, t) in moments {
                out.insert(format!("{prefix}.{k}"), t.copy()?);
            }
        }
        Ok(out)
    }

    /// Restore moments saved by [`Self::tensors`] after `step` steps (copied: the updates write
    /// them in place, and the caller's tensors stay as they were).
    pub fn restore(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (k, slot) in self.m.iter_mut() {
            *slot = tensors
                .get(&format!("m.{k}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks `m.{k}`")))?
                .to_dtype(slot.dtype())?
                .copy()?;
        }
        for (k, slot) in self.v.iter_mut() {
            *slot = tensors
                .get(&format!("v.{k}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks `v.{k}`")))?
                .to_dtype(slot.dtype())?
                .copy()?;
        }
        self.step = step;
        Ok(())
    }
}
