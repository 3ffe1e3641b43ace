//! AdamW with decoupled weight decay (PyTorch's semantics), global-norm gradient clipping and
//! the warmup + cosine schedule. The moments are plain named tensors, so a checkpoint holds the
//! optimizer exactly and a resumed run continues bit for bit.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor, Var};

use super::Result;

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
    /// Zero moments for `vars`, in f32.
    pub fn new(vars: &BTreeMap<String, Var>, weight_decay: f64) -> Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like()?.to_dtype(DType::F32);
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
    /// norm before clipping to `clip` (no clipping when `clip <= 0`).
    pub fn step(
        &mut self,
        vars: &BTreeMap<String, Var>,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        clip: f64,
    ) -> Result<f64> {
        let mut sq = 0.0f64;
        let mut gs: Vec<(&String, &Var, Tensor)> = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let g = match grads.get(name) {
                Some(g) => g.to_dtype(DType::F32)?,
                None => var.as_tensor().zeros_like()?.to_dtype(DType::F32)?,
            };
            sq += g
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            gs.push((name, var, g));
        }
        let norm = sq.sqrt();
        let scale = if clip > 0.0 && norm > clip {
            clip / (norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let (b1, b2) = self.betas;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (name, var, g) in gs {
            let g = (g * scale)?;
            let m = ((&self.m[name] * b1)? + (&g * (1.0 - b1))?)?;
            let v = ((&self.v[name] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let p = var.as_tensor().to_dtype(DType::F32)?;
            let p = (&p * (1.0 - lr * self.weight_decay))?;
            let update = ((&m / c1)? / ((&v / c2)?.sqrt()? + self.eps)?)?;
            let p = (p - (update * lr)?)?;
            var.set(&p.to_dtype(var.dtype())?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(norm)
    }

    /// The moments as named tensors (`m.NAME`, `v.NAME`).
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (k, t) in &self.m {
            out.insert(format!("m.{k}"), t.clone());
        }
        for (k, t) in &self.v {
            out.insert(format!("v.{k}"), t.clone());
        }
        out
    }

    /// Restore moments saved by [`Self::tensors`] after `step` steps.
    pub fn restore(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (k, slot) in self.m.iter_mut() {
            *slot = tensors
                .get(&format!("m.{k}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks `m.{k}`")))?
                .clone();
        }
        for (k, slot) in self.v.iter_mut() {
            *slot = tensors
                .get(&format!("v.{k}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks `v.{k}`")))?
                .clone();
        }
        self.step = step;
        Ok(())
    }
}
