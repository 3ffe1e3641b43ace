//! Text to token ids and byte offsets: the fast byte-level BPE path (`bpe`) where it applies,
//! `tokenizers` otherwise. Both give the same result; the tests hold them to it.

use tokenizers::Tokenizer;

use crate::bpe::{Cache, FastBpe};

/// Encodes rendered text.
pub struct Encoder {
    hf: Tokenizer,
    fast: Option<FastBpe>,
}

/// Ids and byte offsets.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

impl Encoder {
    /// Wrap `tokenizer`, building the fast path when its shape allows (`fast = true`).
    pub fn new(tokenizer: Tokenizer, fast: bool) -> Self {
        let fast = fast
            .then(|| {
                let spec = serde_json::from_str(&tokenizer.to_string(false).ok()?).ok()?;
                FastBpe::from_json(&spec)
            })
            .flatten();
        Self {
            hf: tokenizer,
            fast,
        }
    }

    /// Wrap `tokenizer` with a fast path built beforehand (see `model::load`).
    pub fn from_parts(tokenizer: Tokenizer, fast: Option<FastBpe>) -> Self {
        Self {
            hf: tokenizer,
            fast,
        }
    }

    /// Whether the fast path is in use.
    pub fn is_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// The `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.hf
    }

    /// A word cache for one worker (see [`Encoder::put_cache`]).
    pub fn take_cache(&self) -> Cache {
        self.fast
            .as_ref()
            .map(FastBpe::take_cache)
            .unwrap_or_default()
    }

    /// Give a cache back for the next worker.
    pub fn put_cache(&self, cache: Cache) {
        if let Some(f) = &self.fast {
            f.put_cache(cache);
        }
    }

    /// Encode `text` without adding special tokens (templates write their own).
    pub fn encode(&self, text: &str, cache: &mut Cache) -> Result<Encoded, String> {
        if let Some(out) = self.fast.as_ref().and_then(|f| f.encode(text, cache)) {
            return Ok(out);
        }
        let e = self.hf.encode(text, false).map_err(|e| e.to_string())?;
        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
    }
}
