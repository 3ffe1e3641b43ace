//! The estimate as a terminal table: one row per stage with each figure's basis mark, totals,
//! the critical path, alternatives side by side, warnings, and the assumptions used.

use std::fmt::Write as _;

use dflash_stage_api::thousands;

use super::{Estimate, Figure, Resource};

/// Bytes in decimal units (storage is sold in TB, not TiB).
pub fn bytes(n: f64) -> String {
    scaled(n, &["B", "KB", "MB", "GB", "TB", "PB", "EB"], 1000.0)
}

/// A count in K/M/B/T.
pub fn count(n: f64) -> String {
    if n.abs() < 1000.0 {
        return format!("{}", n.round());
    }
    scaled(n, &["", "K", "M", "B", "T", "P"], 1000.0)
}

/// Hours as the unit that reads best: seconds, minutes, hours or days.
pub fn hours(h: f64) -> String {
    if !h.is_finite() {
        return "-".into();
    }
    let s = h * 3600.0;
    if s < 1.0 {
        "<1 s".into()
    } else if s < 90.0 {
        format!("{s:.0} s")
    } else if h < 1.5 {
        format!("{:.0} min", s / 60.0)
    } else if h < 72.0 {
        format!("{h:.1} h")
    } else {
        format!("{:.1} d", h / 24.0)
    }
}

fn scaled(n: f64, units: &[&str], step: f64) -> String {
    let mut v = n;
    let mut i = 0;
    while v.abs() >= step && i + 1 < units.len() {
        v /= step;
        i += 1;
    }
    let digits = if i == 0 || v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {}", units[i]).trim_end().to_owned()
}

fn money(usd: f64) -> String {
    if usd == 0.0 {
        "-".into()
    } else if usd < 100.0 {
        format!("${usd:.2}")
    } else {
        format!("${}", thousands(usd.round()))
    }
}

fn gpu_hours(h: f64) -> String {
    if h == 0.0 {
        "-".into()
    } else if h < 10.0 {
        format!("{h:.2}")
    } else {
        thousands(h.round())
    }
}

/// A figure with its basis mark, or `-`.
fn marked(f: Option<Figure>, fmt: fn(f64) -> String) -> String {
    f.map_or_else(
        || "-".into(),
        |f| format!("{} {}", fmt(f.value), f.basis.mark()),
    )
}

/// Align columns: those in `right` to the right (numbers), the others to the left.
fn table(rows: &[Vec<String>], right: &[usize]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            let w = widths[c];
            if c > 0 {
                line.push_str("  ");
            }
            if !right.contains(&c) {
                let _ = write!(line, "{cell:<w$}");
            } else {
                let _ = write!(line, "{cell:>w$}");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The estimate as text for a terminal.
pub fn render(e: &Estimate) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "estimate for `{}` on {} at ${:.2}/GPU-hour\n",
        e.pipeline, e.hardware, e.price
    );
    let mut rows = vec![
        [
            "stage", "kind", "state", "rows", "tokens", "storage", "runs on", "GPU-h", "wall",
            "cost",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for s in &e.stages {
        let runs_on = match s.resource {
            Resource::Gpu => format!("{} GPU", s.gpus),
            Resource::Cpu => "CPU".into(),
            Resource::Network => "network".into(),
            Resource::Unknown => "?".into(),
        };
        rows.push(vec![
            s.id.clone(),
            s.kind.clone(),
            s.state.clone(),
            marked(s.rows, count),
            marked(s.tokens, count),
            marked(s.storage_bytes, bytes),
            runs_on,
            gpu_hours(s.gpu_hours),
            s.wall_hours.map_or_else(
                || "?".into(),
                |w| if w == 0.0 { "-".into() } else { hours(w) },
            ),
            money(s.cost),
        ]);
    }
    let t = &e.totals;
    rows.push(vec![
        "total to run".into(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        bytes(t.storage_bytes),
        String::new(),
        gpu_hours(t.gpu_hours),
        hours(t.wall_hours),
        money(t.cost),
    ]);
    out.push_str(&table(&rows, &[3, 4, 5, 7, 8, 9]));
    out.push_str("marks: m measured, d declared (expect:), p param, u from upstream, a assumed\n");
    if t.stored_bytes > 0.0 {
        let _ = writeln!(
            out,
            "already stored by done stages: {}",
            bytes(t.stored_bytes)
        );
    }
    let _ = writeln!(
        out,
        "critical path: {} ({})",
        e.critical_path.join(" -> "),
        hours(t.wall_hours)
    );

    let noted: Vec<_> = e.stages.iter().filter(|s| !s.notes.is_empty()).collect();
    if !noted.is_empty() {
        out.push_str("\nhow each stage was sized:\n");
        for s in noted {
            for n in &s.notes {
                let _ = writeln!(out, "  {}: {n}", s.id);
            }
        }
    }

    for a in &e.alternatives {
        let _ = writeln!(out, "\n{} — {}:", a.stage, a.question);
        let mut rows = vec![
            ["", "choice", "storage", "GPU-h", "wall", "cost", "note"]
                .map(String::from)
                .to_vec(),
        ];
        for c in &a.choices {
            rows.push(vec![
                if c.chosen { "*".into() } else { String::new() },
                c.label.clone(),
                if c.storage_bytes == 0.0 {
                    "-".into()
                } else {
                    bytes(c.storage_bytes)
                },
                gpu_hours(c.gpu_hours),
                hours(c.wall_hours),
                money(c.gpu_hours * e.price),
                c.note.clone(),
            ]);
        }
        for line in table(&rows, &[2, 3, 4, 5]).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    if e.alternatives
        .iter()
        .any(|a| a.choices.iter().any(|c| c.chosen))
    {
        out.push_str("  (* what the pipeline does as written)\n");
    }

    if !e.warnings.is_empty() {
        out.push_str("\nwarnings:\n");
        for w in &e.warnings {
            let _ = writeln!(out, "  ! {w}");
        }
    }

    out.push_str("\nassumptions (override with --assume NAME=VALUE):\n");
    let rows: Vec<Vec<String>> = e
        .assumptions
        .items
        .iter()
        .map(|a| {
            vec![
                a.name.to_owned(),
                if a.value.fract() == 0.0 && a.value >= 1000.0 {
                    thousands(a.value)
                } else {
                    format!("{}", a.value)
                },
                a.source.clone(),
            ]
        })
        .collect();
    for line in table(&rows, &[1]).lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_read_well() {
        assert_eq!(bytes(92.4e12), "92.4 TB");
        assert_eq!(bytes(812.0), "812 B");
        assert_eq!(bytes(1.5e9), "1.50 GB");
        assert_eq!(count(902_000.0), "902 K");
        assert_eq!(count(1.64e9), "1.64 B");
        assert_eq!(count(12.0), "12");
        assert_eq!(hours(17.0), "17.0 h");
        assert_eq!(hours(0.25), "15 min");
        assert_eq!(hours(100.0), "4.2 d");
        assert_eq!(money(1234.4), "$1,234");
        assert_eq!(thousands(1_000_000.0), "1,000,000");
    }
}
