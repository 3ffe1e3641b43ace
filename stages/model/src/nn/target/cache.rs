//! The target's decoding cache: per layer the keys and values of an attention layer or the
//! states of a Gated DeltaNet one, cropped back to the accepted prefix (or a tree's accepted
//! path) after each verification.

use candle_core::Tensor;

use super::*;

/// The target's keys and values for the positions decoded so far (speculative decoding crops
/// it back to the accepted prefix after each verification).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    /// Per layer: what it keeps.
    pub(super) layers: Vec<Option<Slot>>,
    pub(super) len: usize,
    /// The positions of the attention layers' keys and values that the cache holds, when a
    /// round cut it ([`Self::keep_path`], [`Self::truncate`]) since the last pass: applied by the
    /// next pass as it appends (`fused::keep_append`, one copy a tensor), so cutting costs no
    /// launch and the append no more than it did.
    pub(super) kept: Option<Kept>,
}

/// Positions kept of the attention layers' stored keys and values, and their upload (one for
/// all the layers of a pass).
#[derive(Clone, Debug)]
pub(super) struct Kept {
    pub(super) positions: Vec<u32>,
    pub(super) on_device: Option<Tensor>,
}

impl KvCache {
    /// What a layer's stored keys or values `past` become with `added` appended: the kept
    /// positions of `past` then `added`.
    pub(super) fn append(&mut self, past: &Tensor, added: &Tensor) -> Result<Tensor> {
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
        crate::nn::fused::keep_append(past, &at, added)
    }

    /// The positions held, as positions of what the layers store.
    pub(super) fn held(&self) -> Vec<u32> {
        match &self.kept {
            Some(k) => k.positions.clone(),
            None => (0..self.len as u32).collect(),
        }
    }
}

/// What one layer keeps of the positions decoded so far.
#[derive(Clone, Debug)]
pub(super) enum Slot {
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
