//! The bench's table for the terminal: one row per set and method.

use std::fmt::Write as _;

use serde_json::Value;

/// Acceptance is shown for the first few block positions; `results.json` has all of them.
const SHOWN_POSITIONS: usize = 4;

/// The table of `results` (by set, then method), warnings first.
pub fn table(results: &serde_json::Map<String, Value>, warnings: &[String]) -> String {
    let mut out = String::new();
    for w in warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    // As wide as the longest method's name (`drafter+tree+lookup`, a drafter's own name).
    let w = results
        .values()
        .filter_map(|v| v["methods"].as_object())
        .flat_map(|m| m.keys().map(String::len))
        .max()
        .unwrap_or(0)
        .max(16);
    let _ = writeln!(
        out,
        "{:<14} {:<w$} {:>7} {:>6} {:>8} {:>8}  {:<24} {:<10} {}",
        "set",
        "method",
        "prompts",
        "tau",
        "tok/s",
        "speedup",
        "accepted at k=1..",
        "identical",
        "ms/round (propose + verify)"
    );
    for (set, v) in results {
        let Some(methods) = v["methods"].as_object() else {
            continue;
        };
        for (i, (name, r)) in methods.iter().enumerate() {
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            let acceptance: Vec<String> = r["acceptance"]
                .as_array()
                .into_iter()
                .flatten()
                .take(SHOWN_POSITIONS)
                .map(|a| format!("{:.2}", a.as_f64().unwrap_or(0.0)))
                .collect();
            let acceptance = match (r["latency_p50"].as_f64(), r["latency_p90"].as_f64()) {
                // Endpoint mode: latency per request where acceptance is not known.
                (Some(p50), Some(p90)) if acceptance.is_empty() => {
                    vec![format!("latency p50 {p50:.2}s p90 {p90:.2}s")]
                }
                _ => acceptance,
            };
            let tau = r["tau"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |t| format!("{t:.2}"));
            let identical = match (r["identical"].as_u64(), r["prompts"].as_u64()) {
                (Some(s), Some(n)) => format!("{s}/{n}"),
                _ => "-".into(),
            };
            let per_round = match (
                r["propose_ms_per_round"].as_f64(),
                r["verify_ms_per_round"].as_f64(),
            ) {
                (Some(p), Some(v)) => format!("{p:.1} + {v:.1}"),
                _ => "-".into(),
            };
            // Where the method's rounds would match the target's own step.
            let per_round = match r["break_even_tau"].as_f64() {
                Some(b) if i > 0 => format!("{per_round}, pays above tau {b:.2}"),
                _ => per_round,
            };
            let _ = writeln!(
                out,
                "{:<14} {:<w$} {:>7} {tau:>6} {:>8.1} {:>7.2}x  {:<24} {identical:<10} {per_round}",
                if i == 0 { set.as_str() } else { "" },
                name,
                r["prompts"].as_u64().unwrap_or(0),
                f("tokens_per_second"),
                f("speedup"),
                if acceptance.is_empty() {
                    "-".into()
                } else {
                    acceptance.join(" ")
                },
            );
        }
    }
    out.trim_end().to_owned()
}
