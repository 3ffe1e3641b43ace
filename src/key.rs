//! Content keys: a [`Fingerprint`] names every input to a stage's output; its [`Key`] is blake3
//! over a canonical encoding of it.
//!
//! # The encoding (key schema 1)
//! The hash input is the magic `dflash-key\0`, then the fingerprint's fields in this order:
//! `schema` (u32), `kind` (str), `kind_version` (u32), `params` (value), `inputs` (u64 count,
//! then per input: `name` (str), `digest` (32 raw bytes)), `pins` (u64 count, sorted by name, per
//! pin: `name` (str), `identity` (str)).
//! - integers are fixed-width little-endian; a str is its u64 byte length then its UTF-8 bytes;
//! - a value is a tag byte then: 0 null; 1 bool (1 byte); 2 signed int (i64); 3 unsigned int
//!   above i64::MAX (u64); 4 float (f64 bits, -0.0 written as 0.0); 5 str; 6 list (u64 count,
//!   items); 7 map (u64 count, entries sorted by key bytes, each key str then value).
//!
//! Never part of a key: paths, mtimes, hostnames, secrets, map iteration order, the stage id.
//! Bump [`KEY_SCHEMA`] when this encoding changes; golden tests pin known keys.

use std::fmt;

use dflash_stage_api::{Digest, Pin};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The version of the encoding below.
pub const KEY_SCHEMA: u32 = 1;

/// Every input to one stage's output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// [`KEY_SCHEMA`] when computed.
    pub schema: u32,
    /// The stage kind.
    pub kind: String,
    /// The kind's implementation version.
    pub kind_version: u32,
    /// Resolved params (defaults filled in).
    pub params: Value,
    /// Upstream artifacts by name, in pipeline order.
    pub inputs: Vec<FingerprintInput>,
    /// Pinned external sources.
    pub pins: Vec<Pin>,
}

/// One upstream artifact as a fingerprint sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FingerprintInput {
    /// The name the stage sees it by.
    pub name: String,
    /// Its content digest (not its key: equal content from a rerun keeps dependants valid).
    pub digest: Digest,
}

/// The content key of a stage's output. Distinct from [`Digest`] so the two can't be mixed up.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Key(pub Digest);

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.0.short(12))
    }
}

impl Fingerprint {
    /// The key: blake3 of the canonical encoding.
    pub fn key(&self) -> Key {
        let mut e = Encoder(blake3::Hasher::new());
        e.raw(b"dflash-key\0");
        e.u32(self.schema);
        e.str(&self.kind);
        e.u32(self.kind_version);
        e.value(&self.params);
        e.u64(self.inputs.len() as u64);
        for input in &self.inputs {
            e.str(&input.name);
            e.raw(input.digest.as_bytes());
        }
        let mut pins: Vec<&Pin> = self.pins.iter().collect();
        pins.sort_by(|a, b| a.name.cmp(&b.name));
        e.u64(pins.len() as u64);
        for pin in pins {
            e.str(&pin.name);
            e.str(&pin.identity);
        }
        Key(Digest::from(e.0.finalize()))
    }
}

/// Digest of an artifact's file list: blake3 over `dflash-artifact\0`, the u64 count, then per
/// file sorted by path: path (str), digest (32 bytes), size (u64). Same files, same digest.
pub fn artifact_digest(files: &[(String, Digest, u64)]) -> Digest {
    let mut sorted: Vec<&(String, Digest, u64)> = files.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut e = Encoder(blake3::Hasher::new());
    e.raw(b"dflash-artifact\0");
    e.u64(sorted.len() as u64);
    for (path, digest, size) in sorted {
        e.str(path);
        e.raw(digest.as_bytes());
        e.u64(*size);
    }
    Digest::from(e.0.finalize())
}

struct Encoder(blake3::Hasher);

impl Encoder {
    fn raw(&mut self, b: &[u8]) {
        self.0.update(b);
    }
    fn u32(&mut self, v: u32) {
        self.raw(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.raw(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.raw(s.as_bytes());
    }
    fn value(&mut self, v: &Value) {
        match v {
            Value::Null => self.raw(&[0]),
            Value::Bool(b) => self.raw(&[1, u8::from(*b)]),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    self.raw(&[2]);
                    self.raw(&i.to_le_bytes());
                } else if let Some(u) = n.as_u64() {
                    self.raw(&[3]);
                    self.u64(u);
                } else {
                    let f = n.as_f64().unwrap_or(0.0);
                    let f = if f == 0.0 { 0.0 } else { f };
                    self.raw(&[4]);
                    self.raw(&f.to_bits().to_le_bytes());
                }
            }
            Value::String(s) => {
                self.raw(&[5]);
                self.str(s);
            }
            Value::Array(items) => {
                self.raw(&[6]);
                self.u64(items.len() as u64);
                for item in items {
                    self.value(item);
                }
            }
            Value::Object(map) => {
                self.raw(&[7]);
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                self.u64(entries.len() as u64);
                for (k, item) in entries {
                    self.str(k);
                    self.value(item);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fp(params: Value) -> Fingerprint {
        Fingerprint {
            schema: KEY_SCHEMA,
            kind: "command".into(),
            kind_version: 1,
            params,
            inputs: vec![FingerprintInput {
                name: "a".into(),
                digest: Digest::of(b"a"),
            }],
            pins: vec![Pin {
                name: "file:x".into(),
                identity: "00".into(),
            }],
        }
    }

    /// Golden: changing this value means every user's cache is invalidated. Bump KEY_SCHEMA.
    #[test]
    fn golden_key() {
        let k = fp(json!({"run": "echo hi", "env": {}, "n": 3, "t": 0.5})).key();
        assert_eq!(
            k.to_string(),
            "514135f2e6ed31ae7bf9e3cb37b7fbbdb4d3aa9f25fb9339bec8f14f27fb9873"
        );
    }

    #[test]
    fn map_order_does_not_matter() {
        let a = fp(serde_json::from_str(r#"{"x":1,"y":2}"#).unwrap());
        let b = fp(serde_json::from_str(r#"{"y":2,"x":1}"#).unwrap());
        assert_eq!(a.key(), b.key());
    }

    #[test]
    fn every_field_matters() {
        let base = fp(json!({"x": 1}));
        let mut other = base.clone();
        other.kind_version = 2;
        assert_ne!(base.key(), other.key());
        let mut other = base.clone();
        other.inputs[0].digest = Digest::of(b"b");
        assert_ne!(base.key(), other.key());
        let mut other = base.clone();
        other.pins[0].identity = "01".into();
        assert_ne!(base.key(), other.key());
        assert_ne!(base.key(), fp(json!({"x": 2})).key());
        assert_ne!(fp(json!({"x": "1"})).key(), fp(json!({"x": 1})).key());
        assert_ne!(
            fp(json!({"x": ["ab"]})).key(),
            fp(json!({"x": ["a", "b"]})).key()
        );
    }

    #[test]
    fn artifact_digest_ignores_order() {
        let a = ("a".to_owned(), Digest::of(b"1"), 1);
        let b = ("b".to_owned(), Digest::of(b"2"), 1);
        assert_eq!(
            artifact_digest(&[a.clone(), b.clone()]),
            artifact_digest(&[b, a])
        );
    }

    proptest::proptest! {
        /// Insertion order never changes a key; only content does.
        #[test]
        fn key_ignores_insertion_order(entries in proptest::collection::btree_map("[a-z]{1,6}", -1000i64..1000, 0..8)) {
            let forward: serde_json::Map<String, Value> = entries.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
            let backward: serde_json::Map<String, Value> = entries.iter().rev().map(|(k, v)| (k.clone(), json!(v))).collect();
            proptest::prop_assert_eq!(fp(Value::Object(forward)).key(), fp(Value::Object(backward)).key());
        }

        /// Length prefixes keep different splits of the same characters apart.
        #[test]
        fn splits_of_a_string_list_never_collide(a in "[a-z]{0,8}", b in "[a-z]{0,8}") {
            let joined = format!("{a}{b}");
            proptest::prop_assume!(!a.is_empty() && !b.is_empty());
            proptest::prop_assert_ne!(fp(json!({"x": [a, b]})).key(), fp(json!({"x": [joined]})).key());
        }
    }
}
