//! Inline SVG for the HTML report: the stage DAG, line charts (training and held-out
//! loss), grouped
//! horizontal bars (composition before and after a mix, tau per method). No scripts and no
//! external resources: the report is one file that renders anywhere.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::esc;

/// One DAG node.
pub struct Node<'a> {
    /// Stage id.
    pub id: &'a str,
    /// Stage kind.
    pub kind: &'a str,
    /// `ran`, `cached`, ...
    pub status: &'a str,
    /// Seconds in this run.
    pub seconds: f64,
    /// Upstream stage ids.
    pub inputs: Vec<&'a str>,
}

const NODE_W: f64 = 160.0;
const NODE_H: f64 = 44.0;
const GAP_X: f64 = 44.0;
const GAP_Y: f64 = 18.0;

fn status_colour(status: &str) -> &'static str {
    match status {
        "ran" => "#2e7d32",
        "resumed" => "#1565c0",
        "cached" => "#78909c",
        "failed" => "#c62828",
        _ => "#bdbdbd",
    }
}

/// The DAG, layered by the longest path from a source, edges upstream -> downstream.
pub fn dag(nodes: &[Node<'_>]) -> String {
    let index: BTreeMap<&str, usize> = nodes.iter().enumerate().map(|(i, n)| (n.id, i)).collect();
    // Nodes come in pipeline order, which is a topological order: one pass sets the layers.
    let mut layer = vec![0usize; nodes.len()];
    for _ in 0..nodes.len() {
        let mut moved = false;
        for (i, n) in nodes.iter().enumerate() {
            for up in &n.inputs {
                if let Some(&j) = index.get(up)
                    && layer[i] < layer[j] + 1
                {
                    layer[i] = layer[j] + 1;
                    moved = true;
                }
            }
        }
        if !moved {
            break;
        }
    }
    // Sources sit just before their first consumer (a prompt set for the last stage is drawn
    // beside its neighbours, not across the page).
    for (i, n) in nodes.iter().enumerate() {
        if !n.inputs.is_empty() {
            continue;
        }
        let first_use = nodes
            .iter()
            .enumerate()
            .filter(|(_, m)| m.inputs.contains(&n.id))
            .map(|(j, _)| layer[j])
            .min();
        if let Some(l) = first_use {
            layer[i] = l.saturating_sub(1);
        }
    }
    let mut row = vec![0usize; nodes.len()];
    let mut per_layer: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, &l) in layer.iter().enumerate() {
        let r = per_layer.entry(l).or_default();
        row[i] = *r;
        *r += 1;
    }
    let pos = |i: usize| {
        (
            10.0 + layer[i] as f64 * (NODE_W + GAP_X),
            10.0 + row[i] as f64 * (NODE_H + GAP_Y),
        )
    };
    let width = 20.0 + (per_layer.len() as f64) * (NODE_W + GAP_X) - GAP_X;
    let height =
        20.0 + per_layer.values().max().copied().unwrap_or(1) as f64 * (NODE_H + GAP_Y) - GAP_Y;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="dag" xmlns="http://www.w3.org/2000/svg" style="max-width:100%;height:auto" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" role="img" aria-label="stage graph">"#
    );
    for (i, n) in nodes.iter().enumerate() {
        for up in &n.inputs {
            let Some(&j) = index.get(up) else { continue };
            let ((x0, y0), (x1, y1)) = (pos(j), pos(i));
            let (ax, ay, bx, by) = (x0 + NODE_W, y0 + NODE_H / 2.0, x1, y1 + NODE_H / 2.0);
            let mid = f64::midpoint(ax, bx);
            let _ = write!(
                s,
                r##"<path d="M{ax:.1},{ay:.1} C{mid:.1},{ay:.1} {mid:.1},{by:.1} {bx:.1},{by:.1}" fill="none" stroke="#90a4ae" stroke-width="1.5"/>"##
            );
        }
    }
    for (i, n) in nodes.iter().enumerate() {
        let (x, y) = pos(i);
        let _ = write!(
            s,
            r##"<g><title>{id} ({kind}): {status}, {secs:.2} s</title><rect x="{x:.1}" y="{y:.1}" width="{NODE_W}" height="{NODE_H}" rx="6" fill="{fill}" /><text x="{tx:.1}" y="{ty1:.1}" fill="#fff" font-size="13" font-weight="600">{id}</text><text x="{tx:.1}" y="{ty2:.1}" fill="#fff" font-size="11">{kind} · {status} · {secs:.1} s</text></g>"##,
            id = esc(n.id),
            kind = esc(n.kind),
            status = esc(n.status),
            secs = n.seconds,
            fill = status_colour(n.status),
            tx = x + 8.0,
            ty1 = y + 18.0,
            ty2 = y + 35.0,
        );
    }
    s.push_str("</svg>");
    s
}

/// A line chart of one or more series on shared axes (e.g. training loss and held-out loss by
/// step); with more than one series, a legend names them. Empty series are left out.
pub fn lines(series: &[(&str, &[(f64, f64)])], x_label: &str, y_label: &str) -> String {
    lines_over(series, x_label, y_label, false)
}

/// [`lines`] with the y axis from zero: for rates, whose changes read honestly only against
/// zero.
pub fn lines_from_zero(series: &[(&str, &[(f64, f64)])], x_label: &str, y_label: &str) -> String {
    lines_over(series, x_label, y_label, true)
}

/// An axis's two labels: whole numbers where the axis reaches 100, else three decimals.
fn axis(lo: f64, hi: f64) -> (String, String) {
    if lo.abs().max(hi.abs()) >= 100.0 {
        (format!("{lo:.0}"), format!("{hi:.0}"))
    } else {
        (format!("{lo:.3}"), format!("{hi:.3}"))
    }
}

fn lines_over(
    series: &[(&str, &[(f64, f64)])],
    x_label: &str,
    y_label: &str,
    from_zero: bool,
) -> String {
    let (w, h, pad) = (640.0, 240.0, 48.0);
    let colours = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a"];
    let shown: Vec<&(&str, &[(f64, f64)])> = series.iter().filter(|s| !s.1.is_empty()).collect();
    if shown.is_empty() {
        return String::new();
    }
    let all = || shown.iter().flat_map(|s| s.1.iter());
    let (x0, x1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(p.0), b.max(p.0))
    });
    let (y0, y1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(p.1), b.max(p.1))
    });
    let y0 = if from_zero { y0.min(0.0) } else { y0 };
    let y_labels = axis(y0, y1);
    let sx = |x: f64| pad + (x - x0) / (x1 - x0).max(1e-12) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0).max(1e-12) * (h - 2.0 * pad);
    let mut plots = String::new();
    for (i, (name, points)) in shown.iter().enumerate() {
        let colour = colours[i % colours.len()];
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            plots,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{}"/>"#,
            path.join(" ")
        );
        // A series of a few points (an evaluation every N steps) gets its points marked.
        if points.len() <= 32 {
            for &(x, y) in *points {
                let _ = write!(
                    plots,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{colour}"/>"#,
                    sx(x),
                    sy(y)
                );
            }
        }
        if shown.len() > 1 {
            let lx = w - pad - 150.0;
            let ly = pad - 30.0 + 14.0 * i as f64;
            let _ = write!(
                plots,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{}" font-size="11">{}</text>"#,
                lx + 16.0,
                lx + 20.0,
                ly + 4.0,
                esc(name)
            );
        }
    }
    format!(
        r##"<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{yl} by {xl}"><line x1="{pad}" y1="{b}" x2="{r}" y2="{b}" stroke="#555"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{b}" stroke="#555"/>{plots}<text x="{pad}" y="{xt}" font-size="11">{x0}</text><text x="{r}" y="{xt}" font-size="11" text-anchor="end">{x1}</text><text x="{yt}" y="{b}" font-size="11" text-anchor="end">{y0l}</text><text x="{yt}" y="{pad}" font-size="11" text-anchor="end">{y1l}</text><text x="{cx}" y="{xl_y}" font-size="12" text-anchor="middle">{xl}</text><text x="12" y="{cy}" font-size="12" transform="rotate(-90 12 {cy})" text-anchor="middle">{yl}</text></svg>"##,
        b = h - pad,
        r = w - pad,
        y0l = y_labels.0,
        y1l = y_labels.1,
        xt = h - pad + 14.0,
        yt = pad - 4.0,
        cx = w / 2.0,
        cy = h / 2.0,
        xl_y = h - 8.0,
        xl = esc(x_label),
        yl = esc(y_label),
    )
}

/// Grouped horizontal bars: per label, one bar per series (values in the series' own unit;
/// bars scale to the largest value; a NaN is a value that series lacks, drawn as a dash).
pub fn bars(
    labels: &[String],
    series: &[(&str, Vec<f64>)],
    format: &dyn Fn(f64) -> String,
) -> String {
    let colours = [
        "#90a4ae", "#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f",
    ];
    let bar_h = 14.0;
    let group_h = bar_h * series.len() as f64 + 10.0;
    let (label_w, plot_w) = (150.0, 420.0);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-12);
    let legend_h = 20.0;
    let h = legend_h + labels.len() as f64 * group_h + 4.0;
    let w = label_w + plot_w + 80.0;
    let mut s = format!(
        r#"<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="bar chart">"#
    );
    for (k, (name, _)) in series.iter().enumerate() {
        let x = label_w + k as f64 * 110.0;
        let _ = write!(
            s,
            r#"<rect x="{x}" y="4" width="10" height="10" fill="{c}"/><text x="{tx}" y="13" font-size="11">{n}</text>"#,
            c = colours[k % colours.len()],
            tx = x + 14.0,
            n = esc(name)
        );
    }
    for (i, label) in labels.iter().enumerate() {
        let gy = legend_h + i as f64 * group_h;
        let _ = write!(
            s,
            r#"<text x="{lx}" y="{ty}" font-size="12" text-anchor="end">{l}</text>"#,
            lx = label_w - 6.0,
            ty = gy + group_h / 2.0 + 2.0,
            l = esc(label)
        );
        for (k, (_, values)) in series.iter().enumerate() {
            let v = values.get(i).copied().unwrap_or(f64::NAN);
            let y = gy + k as f64 * bar_h;
            if !v.is_finite() {
                // A value one series lacks (a method only one run had): no bar, a dash, so
                // that it does not read as a measured zero.
                let _ = write!(
                    s,
                    r#"<text x="{tx:.1}" y="{ty:.1}" font-size="10">-</text>"#,
                    tx = label_w + 4.0,
                    ty = y + bar_h - 4.0
                );
                continue;
            }
            let bw = v / max * plot_w;
            let _ = write!(
                s,
                r#"<rect x="{label_w}" y="{y:.1}" width="{bw:.1}" height="{bh}" fill="{c}"/><text x="{tx:.1}" y="{ty:.1}" font-size="10">{t}</text>"#,
                bh = bar_h - 2.0,
                c = colours[k % colours.len()],
                tx = label_w + bw + 4.0,
                ty = y + bar_h - 4.0,
                t = esc(&format(v))
            );
        }
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A method only one of two runs benched: its other bar is a dash, not a bar at "0.00".
    #[test]
    fn a_value_a_series_lacks_is_a_dash_not_a_zero_bar() {
        let labels = ["gsm8k drafter2".to_owned()];
        let series = [("this run", vec![1.7]), ("that run", vec![f64::NAN])];
        let svg = bars(&labels, &series, &|v| format!("{v:.2}"));
        assert!(svg.contains(">1.70</text>"), "{svg}");
        assert!(svg.contains(">-</text>"), "{svg}");
        assert!(!svg.contains("0.00") && !svg.contains("NaN"), "{svg}");
        // The legend's two swatches and the one bar.
        assert_eq!(svg.matches("<rect").count(), 3, "{svg}");
    }
}
