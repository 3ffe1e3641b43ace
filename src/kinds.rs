//! The registry of stage kinds: the one place that wires the stage crates into the runtime.

use std::collections::BTreeMap;
use std::sync::Arc;

use dflash_stage_api::StageKind;

/// Stage kinds by name.
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<&'static str, Arc<dyn StageKind>>,
}

impl Registry {
    /// The kinds that ship with dflash.
    pub fn builtin() -> Self {
        let mut r = Self::default();
        r.add(Arc::new(dflash_stage_command::CommandKind));
        r.add(Arc::new(dflash_stage_download::DownloadKind));
        r.add(Arc::new(dflash_stage_mix::MixKind));
        r.add(Arc::new(dflash_stage_tokenize::TokenizeKind));
        r.add(Arc::new(dflash_stage_generate::GenerateKind));
        r.add(Arc::new(dflash_stage_train::TrainKind));
        r.add(Arc::new(dflash_stage_bench::BenchKind));
        r
    }

    /// Register a kind (replacing one of the same name).
    pub fn add(&mut self, kind: Arc<dyn StageKind>) {
        self.kinds.insert(kind.name(), kind);
    }

    /// Look a kind up by name.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn StageKind>> {
        self.kinds.get(name)
    }

    /// Every kind's name, sorted.
    pub fn names(&self) -> Vec<&'static str> {
        self.kinds.keys().copied().collect()
    }
}
