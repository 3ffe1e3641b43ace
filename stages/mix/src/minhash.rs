//! Near-duplicate signatures: MinHash by one-permutation hashing (one hash per shingle, the
//! minimum kept per bin) over word 3-grams, with empty bins filled from the next non-empty one
//! (densification), folded into LSH band hashes. Two texts share a band with probability
//! 1 - (1 - J^5)^6 for Jaccard similarity J: 0.17 at J = 0.5, 0.74 at J = 0.7, 0.99 at J = 0.9.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Bands per signature.
pub const BANDS: usize = 6;
const ROWS: usize = 5;
const BINS: usize = BANDS * ROWS;

/// The band hashes of a normalised text.
pub fn bands(normal: &str) -> [u64; BANDS] {
    let words: Vec<&str> = normal.split(' ').collect();
    let mut bins = [u64::MAX; BINS];
    let mut add = |h: u64| {
        let bin = (h % BINS as u64) as usize;
        let v = h / BINS as u64;
        if v < bins[bin] {
            bins[bin] = v;
        }
    };
    if words.len() < 3 {
        add(xxh3_64(normal.as_bytes()));
    } else {
        for w in words.windows(3) {
            // Hash the three words without joining them into a new string.
            let h = xxh3_64_with_seed(
                w[2].as_bytes(),
                xxh3_64_with_seed(w[1].as_bytes(), xxh3_64(w[0].as_bytes())),
            );
            add(h);
        }
    }
    // Densify: an empty bin borrows the next filled one (with its offset), so short texts still
    // compare sensibly.
    let filled: Vec<usize> = (0..BINS).filter(|&i| bins[i] != u64::MAX).collect();
    let mut dense = bins;
    for i in 0..BINS {
        if dense[i] == u64::MAX {
            let j = filled.iter().copied().find(|&j| j > i).unwrap_or(filled[0]);
            dense[i] = bins[j].wrapping_add((j + BINS - i) as u64);
        }
    }
    let mut out = [0u64; BANDS];
    for (b, o) in out.iter_mut().enumerate() {
        let mut bytes = [0u8; ROWS * 8];
        for r in 0..ROWS {
            bytes[r * 8..r * 8 + 8].copy_from_slice(&dense[b * ROWS + r].to_le_bytes());
        }
        *o = xxh3_64(&bytes);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares_band(a: &str, b: &str) -> bool {
        bands(a).iter().zip(bands(b)).any(|(x, y)| *x == y)
    }

    #[test]
    fn near_copies_collide_and_different_texts_do_not() {
        let base = "write a python function that returns the sum of the squares of the even numbers in a list and explain how it works step by step with an example";
        let near = "write a python function that returns the sum of the squares of the even numbers in a list and explain how it works step by step with examples";
        let other = "what is the capital of france and why did it become the capital instead of another city in the middle ages";
        assert!(shares_band(base, near));
        assert!(!shares_band(base, other));
        assert_eq!(bands(base), bands(base));
    }
}
