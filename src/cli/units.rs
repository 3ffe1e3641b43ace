//! Sizes and durations as users type them on the command line (`estimate --max-storage 10TB`,
//! `copy --max-file-bytes 4M`, `estimate --budget 24h`): one reading of each unit for every
//! command.

/// A size in bytes: `4194304`, `500GB` and `10TB` (powers of 1000), `4MiB` and `2TiB` (powers
/// of 1024), and the single letters `4K`, `4M`, `1.5G` as `du` and `find -size` read them
/// (powers of 1024).
pub fn parse_bytes(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!("`{text}` is not a size: write a number with an optional unit, e.g. 4M or 10TB")
    })?;
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "PB" => 1e15,
        "K" | "KIB" => 1024.0,
        "M" | "MIB" => 1024f64.powi(2),
        "G" | "GIB" => 1024f64.powi(3),
        "T" | "TIB" => 1024f64.powi(4),
        "P" | "PIB" => 1024f64.powi(5),
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}` (use GB, TB, TiB, M, ...)"
            ));
        }
    };
    Ok(n * scale)
}

/// A duration in hours: `24h`, `90min`, `3days`.
pub fn parse_hours(text: &str) -> Result<f64, String> {
    humantime::parse_duration(text.trim())
        .map(|d| d.as_secs_f64() / 3600.0)
        .map_err(|e| format!("`{text}` is not a duration like `24h` or `3days`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_hours};

    #[test]
    fn sizes_and_durations_parse_as_written() {
        assert_eq!(parse_bytes("4194304"), Ok(4_194_304.0));
        assert_eq!(parse_bytes("4M"), Ok(f64::from(4 << 20)));
        assert_eq!(parse_bytes("4MiB"), Ok(f64::from(4 << 20)));
        assert_eq!(parse_bytes("4MB"), Ok(4e6));
        assert_eq!(parse_bytes("10TB"), Ok(1e13));
        assert_eq!(parse_bytes("1.5G"), Ok(f64::from(3 << 29)));
        assert_eq!(parse_bytes("512 KiB"), Ok(f64::from(512 << 10)));
        assert!(parse_bytes("4Q").unwrap_err().contains("unknown unit `Q`"));
        assert!(parse_bytes("M").unwrap_err().contains("not a size"));
        assert_eq!(parse_hours("90min"), Ok(1.5));
        assert!(parse_hours("soon").is_err());
    }
}
