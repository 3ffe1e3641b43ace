//! A fast encoder for byte-level BPE tokenizers (GPT-2 style: Qwen, Llama 3, SmolLM, ...),
//! giving exactly the ids and byte offsets of the `tokenizers` crate for the shapes it accepts.
//!
//! `tokenizers` spent ~95% of tokenize's time (measured: 735K tokens/s on one core on ShareGPT
//! with the Qwen3 tokenizer, against 22M tokens/s of template rendering). This encoder splits with the `regex` crate's automaton, emulating the one
//! lookahead of the known patterns (`\s+(?!\S)`: a run of spaces before a word leaves its last
//! space to the word), runs BPE merges by rank over bytes with a cache of words already seen,
//! and derives offsets from token byte lengths.
//!
//! It accepts only what it reproduces exactly: BPE without dropout or byte fallback, no
//! normalizer or NFC (text that is not already NFC goes to `tokenizers`), the known split
//! patterns (GPT-2's, Qwen2's, Llama 3's, optionally after single digits), added tokens without
//! strip or single-word flags, and ByteLevel offset trimming. Anything else returns `None` at
//! build time and the caller keeps `tokenizers`. The tests compare both on real text.

use std::sync::Mutex;

use aho_corasick::{AhoCorasick, MatchKind};
use regex::Regex;
use rustc_hash::FxHashMap;
use serde_json::Value as Json;

// The split patterns of GPT-2, Qwen2 and Llama 3; `gguf` maps llama.cpp's pre-tokenizer names
// to the same ones.
pub(crate) const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
pub(crate) const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LOOKAHEAD: &str = r"|\s+(?!\S)|\s+";

/// Words kept per cache before it is cleared (a cache holds a few MB at this size).
const CACHE_WORDS: usize = 200_000;

/// How text is cut into words before BPE.
struct Splitter {
    /// The pattern with `\s+(?!\S)|\s+` replaced by `\s+`.
    re: Regex,
    /// Whether the pattern has a `\s*[\r\n]+` branch, whose all-space matches end in a newline.
    newline_branch: bool,
    /// Split every numeric character off first (the `Digits` pre-tokenizer).
    digits: bool,
}

impl Splitter {
    fn new(pattern: &str, digits: bool) -> Option<Self> {
        if ![GPT2, QWEN2, LLAMA3].contains(&pattern) {
            return None;
        }
        let base = pattern.strip_suffix(LOOKAHEAD)?;
        Some(Self {
            re: Regex::new(&format!(r"{base}|\s+")).ok()?,
            newline_branch: pattern.contains(r"\s*[\r\n]+"),
            digits,
        })
    }

    /// Call `f` with the byte range of each word of `text` (offset by `base`).
    fn split(&self, text: &str, base: usize, f: &mut impl FnMut(usize, usize)) {
        if !self.digits {
            return self.split_regex(text, base, f);
        }
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                if start < i {
                    self.split_regex(&text[start..i], base + start, f);
                }
                f(base + i, base + i + c.len_utf8());
                start = i + c.len_utf8();
            }
        }
        if start < text.len() {
            self.split_regex(&text[start..], base + start, f);
        }
    }

    fn split_regex(&self, text: &str, base: usize, f: &mut impl FnMut(usize, usize)) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.re.find_at(text, pos) else {
                f(base + pos, base + text.len());
                return;
            };
            if m.start() > pos {
                // Text no branch matches stays a word of its own (`Isolated` keeps gaps).
                f(base + pos, base + m.start());
            }
            let mut end = m.end();
            let s = m.as_str();
            // `\s+(?!\S)`: a run of two or more spaces followed by a non-space gives its last
            // space to what follows. Only the `\s+` branch yields such a run (with a newline
            // branch, an all-space match that holds a newline came from that branch).
            if end < text.len()
                && s.chars().all(char::is_whitespace)
                && !(self.newline_branch && s.contains(['\r', '\n']))
                && s.chars().nth(1).is_some()
            {
                let next = text[end..].chars().next().expect("not at the end");
                if !next.is_whitespace() {
                    end -= s.chars().next_back().expect("non-empty").len_utf8();
                }
            }
            f(base + m.start(), base + end);
            pos = end;
        }
    }
}

/// Words up to this many symbols merge by scanning (see [`FastBpe::merge_short`]).
const SHORT_WORD: usize = 64;

/// A word cache; caches are pooled so parallel workers keep theirs across batches.
pub type Cache = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// The fast encoder.
pub struct FastBpe {
    /// Added tokens matched on the raw text first, then those matched after normalization.
    added: Vec<(AhoCorasick, Vec<u32>)>,
    nfc: bool,
    splitter: Splitter,
    /// The token of each byte; `None` for bytes the vocabulary lacks, which `tokenizers` drops
    /// (byte-level vocabularies without an unknown token omit bytes UTF-8 never uses).
    byte_ids: [Option<u32>; 256],
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// Byte length of every token's text.
    token_len: Vec<u32>,
    /// Whether a token is an added token (its text is not byte-level encoded).
    is_added: Vec<bool>,
    /// Bytes of every token's byte-level text (the "normalized" length `tokenizers` counts in).
    token_chars_len: Vec<u32>,
    /// Bytes of each byte's byte-level character.
    byte_char_len: [u8; 256],
    /// `ignore_merges`: a word that is itself a token is that token.
    whole_words: Option<FxHashMap<Box<[u8]>, u32>>,
    /// ByteLevel post-processing trims spaces from offsets (`trim_offsets`), and keeps one on
    /// the first token when it added a prefix space.
    trim: Option<bool>,
    pool: Mutex<Vec<Cache>>,
}

/// GPT-2's map from bytes to the printable characters byte-level vocabularies are written in.
fn bytes_to_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("valid")
        };
    }
    out
}

impl FastBpe {
    /// Build from a tokenizer's JSON (`Tokenizer::to_string`); `None` if its shape is not one
    /// this encoder reproduces exactly.
    pub fn from_json(spec: &Json) -> Option<Self> {
        let model = spec.get("model")?;
        if model.get("type")?.as_str()? != "BPE"
            || !model.get("dropout").is_none_or(Json::is_null)
            || model.get("byte_fallback").and_then(Json::as_bool) == Some(true)
            || !matches!(
                model.get("continuing_subword_prefix"),
                None | Some(Json::Null)
            ) && model["continuing_subword_prefix"].as_str() != Some("")
            || !matches!(model.get("end_of_word_suffix"), None | Some(Json::Null))
                && model["end_of_word_suffix"].as_str() != Some("")
        {
            return None;
        }
        let nfc = match spec.get("normalizer") {
            None | Some(Json::Null) => false,
            Some(n) if n.get("type")?.as_str()? == "NFC" => true,
            Some(_) => return None,
        };
        let splitter = Self::splitter(spec.get("pre_tokenizer")?)?;
        let trim = Self::trim(spec.get("post_processor").unwrap_or(&Json::Null))?;

        let chars = bytes_to_chars();
        // Byte-level characters all lie below U+0144.
        let mut char_byte = [None; 0x144];
        for (b, c) in chars.iter().enumerate() {
            char_byte[*c as usize] = Some(b as u8);
        }
        let to_bytes = |token: &str| -> Option<Vec<u8>> {
            token
                .chars()
                .map(|c| char_byte.get(c as usize).copied().flatten())
                .collect()
        };
        let vocab = model.get("vocab")?.as_object()?;
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        let mut token_len = Vec::new();
        let mut token_chars_len = Vec::new();
        for (token, id) in vocab {
            let id = u32::try_from(id.as_u64()?).ok()?;
            ids.insert(token.as_str(), id);
            let len = to_bytes(token).map_or(token.len(), |b| b.len());
            if token_len.len() <= id as usize {
                token_len.resize(id as usize + 1, 0);
            }
            token_len[id as usize] = len as u32;
            if token_chars_len.len() <= id as usize {
                token_chars_len.resize(id as usize + 1, 0);
            }
            token_chars_len[id as usize] = token.len() as u32;
        }
        let mut byte_char_len = [0u8; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_char_len[b] = c.len_utf8() as u8;
        }
        let mut byte_ids = [None; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_ids[b] = ids.get(c.to_string().as_str()).copied();
        }
        let unk = !matches!(model.get("unk_token"), None | Some(Json::Null));
        if unk && byte_ids.iter().any(Option::is_none) {
            return None;
        }
        let mut merges = FxHashMap::default();
        let mut joined = String::new();
        for (rank, m) in model.get("merges")?.as_array()?.iter().enumerate() {
            let (a, b) = match m {
                Json::String(s) => s.split_once(' ')?,
                Json::Array(p) if p.len() == 2 => (p[0].as_str()?, p[1].as_str()?),
                _ => return None,
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let result = ids.get(joined.as_str())?;
            merges.insert((*ids.get(a)?, *ids.get(b)?), (rank as u32, *result));
        }
        let whole_words =
            (model.get("ignore_merges").and_then(Json::as_bool) == Some(true)).then(|| {
                vocab
                    .iter()
                    .filter_map(|(t, id)| {
                        Some((to_bytes(t)?.into_boxed_slice(), id.as_u64()? as u32))
                    })
                    .collect()
            });

        let mut is_added = vec![false; token_len.len()];
        let mut raw = (Vec::new(), Vec::new());
        let mut normalized = (Vec::new(), Vec::new());
        for t in spec.get("added_tokens")?.as_array()? {
            let flag = |k: &str| t.get(k).and_then(Json::as_bool).unwrap_or(false);
            if flag("lstrip") || flag("rstrip") || flag("single_word") {
                return None;
            }
            let content = t.get("content")?.as_str()?.to_owned();
            let id = u32::try_from(t.get("id")?.as_u64()?).ok()?;
            if token_len.len() <= id as usize {
                token_len.resize(id as usize + 1, 0);
            }
            token_len[id as usize] = content.len() as u32;
            if is_added.len() <= id as usize {
                is_added.resize(id as usize + 1, false);
            }
            is_added[id as usize] = true;
            let side = if flag("normalized") {
                &mut normalized
            } else {
                &mut raw
            };
            side.0.push(content);
            side.1.push(id);
        }
        let mut added = Vec::new();
        for (patterns, ids) in [raw, normalized] {
            if !patterns.is_empty() {
                let ac = AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .ok()?;
                added.push((ac, ids));
            }
        }
        Some(Self {
            added,
            nfc,
            splitter,
            byte_ids,
            merges,
            token_len,
            is_added,
            token_chars_len,
            byte_char_len,
            whole_words,
            trim,
            pool: Mutex::new(Vec::new()),
        })
    }

    fn splitter(pre: &Json) -> Option<Splitter> {
        let byte_level = |p: &Json, regex: bool| {
            p.get("type").and_then(Json::as_str) == Some("ByteLevel")
                && p.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
                && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
        };
        if byte_level(pre, true) {
            return Splitter::new(GPT2, false);
        }
        let parts = pre.get("pretokenizers")?.as_array()?;
        match parts.as_slice() {
            [split, bl] if byte_level(bl, false) => {
                if split.get("type")?.as_str()? != "Split"
                    || split.get("behavior")?.as_str()? != "Isolated"
                    || split.get("invert").and_then(Json::as_bool) == Some(true)
                {
                    return None;
                }
                Splitter::new(split.get("pattern")?.get("Regex")?.as_str()?, false)
            }
            [digits, bl]
                if byte_level(bl, true)
                    && digits.get("type")?.as_str()? == "Digits"
                    && digits.get("individual_digits")?.as_bool()? =>
            {
                Splitter::new(GPT2, true)
            }
            _ => None,
        }
    }

    /// `Some(None)`: no trimming; `Some(Some(add_prefix_space))`: ByteLevel trimming.
    #[allow(clippy::option_option)]
    fn trim(post: &Json) -> Option<Option<bool>> {
        let one = |p: &Json| -> Option<Option<bool>> {
            match p.get("type")?.as_str()? {
                "ByteLevel" => Some(
                    (p.get("trim_offsets").and_then(Json::as_bool) == Some(true))
                        .then(|| p.get("add_prefix_space").and_then(Json::as_bool) == Some(true)),
                ),
                // Adds tokens only with `add_special_tokens`, which tokenize never asks for.
                "TemplateProcessing" => Some(None),
                _ => None,
            }
        };
        match post {
            Json::Null => Some(None),
            p if p.get("type").and_then(Json::as_str) == Some("Sequence") => {
                let mut out = None;
                for q in p.get("processors")?.as_array()? {
                    out = out.or(one(q)?);
                }
                Some(out)
            }
            p => one(p),
        }
    }

    /// A cache for one worker; give it back with [`FastBpe::put_cache`].
    pub fn take_cache(&self) -> Cache {
        self.pool
            .lock()
            .map(|mut p| p.pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Return a cache to the pool.
    pub fn put_cache(&self, cache: Cache) {
        if let Ok(mut p) = self.pool.lock() {
            p.push(cache);
        }
    }

    /// Ids and byte offsets of `text`, or `None` when only `tokenizers` gets it exactly (text
    /// that NFC would change).
    pub fn encode(&self, text: &str, cache: &mut Cache) -> Option<crate::encoder::Encoded> {
        if self.nfc
            && unicode_normalization::is_nfc_quick(text.chars())
                != unicode_normalization::IsNormalized::Yes
        {
            return None;
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut offsets = Vec::with_capacity(text.len() / 3);
        self.segments(text, 0, 0, &mut |seg: Segment| match seg {
            Segment::Added(id, s, e) => {
                ids.push(id);
                offsets.push((s, e));
            }
            Segment::Text(s, e) => {
                self.splitter.split(&text[s..e], s, &mut |ws, we| {
                    self.word(&text.as_bytes()[ws..we], ws, cache, &mut ids, &mut offsets);
                });
            }
        });
        // A token that splits a character covers that whole character: offsets are aligned to
        // characters, as `tokenizers` reports them even in byte mode.
        for o in &mut offsets {
            while !text.is_char_boundary(o.0) {
                o.0 -= 1;
            }
            while !text.is_char_boundary(o.1) {
                o.1 += 1;
            }
        }
        if let Some(add_prefix_space) = self.trim {
            self.trim_offsets(text, &ids, &mut offsets, add_prefix_space);
        }
        Some((ids, offsets))
    }

    /// Cut `text[s..]` at added tokens of automaton `level` and deeper.
    fn segments(&self, text: &str, base: usize, level: usize, f: &mut impl FnMut(Segment)) {
        let Some((ac, ids)) = self.added.get(level) else {
            if !text.is_empty() {
                f(Segment::Text(base, base + text.len()));
            }
            return;
        };
        let mut pos = 0;
        for m in ac.find_iter(text) {
            if m.start() > pos {
                self.segments(&text[pos..m.start()], base + pos, level + 1, f);
            }
            f(Segment::Added(
                ids[m.pattern().as_usize()],
                base + m.start(),
                base + m.end(),
            ));
            pos = m.end();
        }
        if pos < text.len() {
            self.segments(&text[pos..], base + pos, level + 1, f);
        }
    }

    fn word(
        &self,
        bytes: &[u8],
        base: usize,
        cache: &mut Cache,
        ids: &mut Vec<u32>,
        offsets: &mut Vec<(usize, usize)>,
    ) {
        let mut push = |toks: &[u32]| {
            let mut at = base;
            for &t in toks {
                let len = self.token_len[t as usize] as usize;
                ids.push(t);
                offsets.push((at, at + len));
                at += len;
            }
        };
        if let Some(toks) = cache.get(bytes) {
            return push(toks);
        }
        if bytes.iter().any(|&b| self.byte_ids[b as usize].is_none()) {
            return self.word_with_gaps(bytes, base, ids, offsets);
        }
        let toks: Box<[u32]> = match self.whole_words.as_ref().and_then(|w| w.get(bytes)) {
            Some(&id) => Box::new([id]),
            None => self.merge(bytes).into_boxed_slice(),
        };
        push(&toks);
        if cache.len() >= CACHE_WORDS {
            cache.clear();
        }
        cache.insert(bytes.into(), toks);
    }

    /// A word holding bytes the vocabulary lacks: they vanish, and offsets follow what
    /// `tokenizers` computes — positions in the byte-level text counted over the tokens that
    /// remain, mapped back to the characters of the original text.
    fn word_with_gaps(
        &self,
        bytes: &[u8],
        base: usize,
        ids: &mut Vec<u32>,
        offsets: &mut Vec<(usize, usize)>,
    ) {
        // For each byte-level byte: the original byte it came from.
        let mut origin = Vec::with_capacity(bytes.len() * 2);
        for (i, &b) in bytes.iter().enumerate() {
            origin.extend(std::iter::repeat_n(
                i,
                self.byte_char_len[b as usize] as usize,
            ));
        }
        let mut at = 0usize;
        for t in self.merge(bytes) {
            let len = self.token_chars_len[t as usize] as usize;
            let (first, last) = (origin[at], origin[(at + len).max(1) - 1]);
            ids.push(t);
            // Character alignment happens in `encode`.
            offsets.push((base + first, base + last + 1));
            at += len;
        }
    }

    /// BPE: merge the adjacent pair of lowest rank (the leftmost on ties) until none merges.
    /// Bytes without a token vanish; like `tokenizers`, offsets then run on from the word's
    /// start over the tokens that remain.
    fn merge(&self, bytes: &[u8]) -> Vec<u32> {
        let syms: Vec<u32> = bytes
            .iter()
            .filter_map(|&b| self.byte_ids[b as usize])
            .collect();
        if syms.len() <= SHORT_WORD {
            self.merge_short(syms)
        } else {
            self.merge_long(&syms)
        }
    }

    /// [`Self::merge`] by scanning every pair for each merge: quadratic, and the fastest for
    /// the short words text is made of.
    fn merge_short(&self, mut syms: Vec<u32>) -> Vec<u32> {
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&(rank, new)) = self.merges.get(&(syms[i], syms[i + 1]))
                    && best.is_none_or(|(r, _, _)| rank < r)
                {
                    best = Some((rank, i, new));
                }
            }
            let Some((_, i, new)) = best else {
                return syms;
            };
            syms[i] = new;
            syms.remove(i + 1);
        }
    }

    /// [`Self::merge`] in O(n log n) for long unbroken words (a 45K-character table rule):
    /// candidate pairs in a heap by (rank, position) — the order `tokenizers` merges in — over
    /// a linked list of symbols. A heap entry is one `u64` (rank above, left position below), so
    /// the heap of a 320K-symbol word stays a few MB and its sifts stay in cache; a popped entry
    /// is current when its left symbol is alive and still forms a pair of that rank (ranks are
    /// unique per pair), else it is skipped.
    fn merge_long(&self, syms: &[u32]) -> Vec<u32> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        const NONE: u32 = u32::MAX;
        let Ok(n) = u32::try_from(syms.len()) else {
            // Beyond 4G symbols in one word: correct, if slow.
            return self.merge_short(syms.to_vec());
        };
        let mut id = syms.to_vec();
        let mut next: Vec<u32> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut prev: Vec<u32> = (0..n).map(|i| i.checked_sub(1).unwrap_or(NONE)).collect();
        let mut alive = vec![true; n as usize];
        let rank_of = |id: &[u32], l: u32, r: u32| {
            self.merges
                .get(&(id[l as usize], id[r as usize]))
                .map(|&(rank, new)| (rank, new))
        };
        let entry = |rank: u32, l: u32| Reverse((u64::from(rank) << 32) | u64::from(l));
        let mut heap: BinaryHeap<Reverse<u64>> = (0..n.saturating_sub(1))
            .filter_map(|l| rank_of(&id, l, l + 1).map(|(rank, _)| entry(rank, l)))
            .collect();
        while let Some(Reverse(e)) = heap.pop() {
            let (rank, l) = ((e >> 32) as u32, e as u32);
            let r = next[l as usize];
            if !alive[l as usize] || r == NONE {
                continue;
            }
            let Some((now, new)) = rank_of(&id, l, r) else {
                continue;
            };
            if now != rank {
                continue;
            }
            id[l as usize] = new;
            alive[r as usize] = false;
            let after = next[r as usize];
            next[l as usize] = after;
            if after != NONE {
                prev[after as usize] = l;
                if let Some((rank, _)) = rank_of(&id, l, after) {
                    heap.push(entry(rank, l));
                }
            }
            let before = prev[l as usize];
            if before != NONE
                && let Some((rank, _)) = rank_of(&id, before, l)
            {
                heap.push(entry(rank, before));
            }
        }
        let mut out = Vec::new();
        let mut at = if n == 0 { NONE } else { 0 };
        while at != NONE {
            out.push(id[at as usize]);
            at = next[at as usize];
        }
        out
    }

    /// ByteLevel's `trim_offsets`: offsets lose the spaces at either end of a token — in a
    /// byte-level token only the space byte reads as one (`Ġ`), in an added token any
    /// whitespace character, and each counts one byte, as in `tokenizers`.
    fn trim_offsets(
        &self,
        text: &str,
        ids: &[u32],
        offsets: &mut [(usize, usize)],
        add_prefix_space: bool,
    ) {
        for (i, (o, &id)) in offsets.iter_mut().zip(ids).enumerate() {
            let piece = &text[o.0..o.1];
            let (mut leading, trailing) = if self.is_added.get(id as usize) == Some(&true) {
                (
                    piece.chars().take_while(|c| c.is_whitespace()).count(),
                    piece
                        .chars()
                        .rev()
                        .take_while(|c| c.is_whitespace())
                        .count(),
                )
            } else {
                let b = piece.as_bytes();
                (
                    b.iter().take_while(|&&c| c == b' ').count(),
                    b.iter().rev().take_while(|&&c| c == b' ').count(),
                )
            };
            if leading > 0 {
                let first = i == 0 || o.0 == 0;
                if first && add_prefix_space && leading == 1 {
                    leading = 0;
                }
                o.0 = (o.0 + leading).min(o.1);
            }
            if trailing > 0 && o.1 >= trailing {
                o.1 = (o.1 - trailing).max(o.0);
            }
        }
    }
}

enum Segment {
    Added(u32, usize, usize),
    Text(usize, usize),
}
