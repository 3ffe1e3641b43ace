//! Figures as people read them, shared by every kind's summaries and the runtime's tables.

/// A number rounded to a whole one, its thousands separated by commas: `13,070`, `-1,234`.
pub fn thousands(x: f64) -> String {
    let whole = format!("{:.0}", x.abs());
    let mut out = String::with_capacity(whole.len() + whole.len() / 3 + 1);
    if x.round() < 0.0 {
        out.push('-');
    }
    for (i, ch) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(999.5), "1,000");
        assert_eq!(thousands(13070.2), "13,070");
        assert_eq!(thousands(1234567.0), "1,234,567");
        assert_eq!(thousands(-1234.0), "-1,234");
        assert_eq!(thousands(-0.2), "0");
    }
}
