//! Endpoint mode: benchmark running OpenAI-compatible servers (SGLang, vLLM, llama.cpp) on the
//! prompt sets, typically the same model with and without its speculative decoding. Each prompt
//! goes to every endpoint in turn, one request at a time (the papers' batch size 1), so the
//! latencies compare like for like; a multi-turn prompt (MT-Bench) asks each later user turn
//! after appending that endpoint's reply to the one before. Per set and endpoint: output tokens/s, latency per request
//! (mean, p50, p90), the speedup over the first endpoint, and the accept length where the
//! server reports it: SGLang's `spec_verify_ct` per response, or vLLM's speculative-decoding
//! counters on `/metrics` before and after the set.

use std::time::{Duration, Instant};

use dflash_stage_api::{StageContext, StageError};
use serde_json::{Map, Value, json};

use crate::Params;
use crate::sets::PromptSet;

/// One endpoint's figures on one set.
#[derive(Default)]
struct Totals {
    latencies: Vec<f64>,
    tokens: u64,
    /// Verification rounds the server reported per response (SGLang), summed.
    verify_rounds: u64,
    /// Tokens of the responses that reported rounds.
    tokens_with_rounds: u64,
}

/// The accept length from vLLM's counters: accepted draft tokens per draft, plus the bonus.
fn vllm_counters(text: &str) -> Option<(f64, f64)> {
    let counter = |name: &str| -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)
    };
    Some((
        counter("vllm:spec_decode_num_drafts")?,
        counter("vllm:spec_decode_num_accepted_tokens")?,
    ))
}

/// The verification rounds a response reports (SGLang's `spec_verify_ct`, wherever the server
/// version puts it).
fn verify_rounds(v: &Value) -> Option<u64> {
    [
        &v["meta_info"],
        &v["usage"],
        &v["sglext"],
        &v["sglext"]["speculative_decoding_stats"],
        &v["choices"][0]["meta_info"],
    ]
    .iter()
    .find_map(|o| o["spec_verify_ct"].as_u64())
    .filter(|&n| n > 0)
}

struct Server<'a> {
    name: &'a str,
    url: String,
}

impl Server<'_> {
    fn metrics_url(&self) -> String {
        format!("{}/metrics", self.url.trim_end_matches("/v1"))
    }
}

async fn metrics(http: &reqwest::Client, s: &Server<'_>) -> Option<(f64, f64)> {
    let r = http
        .get(s.metrics_url())
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    vllm_counters(&r.text().await.ok()?)
}

/// The model the first endpoint serves, for a bench without `model:`.
async fn served_model(http: &reqwest::Client, s: &Server<'_>) -> Result<String, StageError> {
    let v: Value = http
        .get(format!("{}/models", s.url))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| unreachable(s, &e))?
        .json()
        .await
        .map_err(|e| unreachable(s, &e))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| StageError::new(format!("endpoint `{}` lists no model", s.name)))
}

fn unreachable(s: &Server<'_>, e: &dyn std::fmt::Display) -> StageError {
    StageError::new(format!(
        "endpoint `{}` ({}): {e}",
        s.name,
        dflash_stage_api::remote::shown(&s.url)
    ))
    .with_help("start the server first; bench measures running servers and launches none")
}

/// Benchmark `p.endpoints` on `sets`; the results by set, as the in-process mode shapes them.
pub fn run(
    ctx: &StageContext<'_>,
    p: &Params,
    sets: &[(PromptSet, Vec<Vec<Value>>)],
) -> Result<Map<String, Value>, StageError> {
    let servers: Vec<Server<'_>> = p
        .endpoints
        .iter()
        .map(|(name, url)| Server {
            name,
            url: url
                .as_str()
                .unwrap_or_default()
                .trim_end_matches('/')
                .to_owned(),
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| StageError::new(format!("cannot start the HTTP runtime: {e}")))?;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| StageError::new(format!("cannot build the HTTP client: {e}")))?;
    rt.block_on(async {
        let model = match &p.model {
            Some(m) => m.clone(),
            None => served_model(&http, &servers[0]).await?,
        };
        let total: u64 = sets
            .iter()
            .map(|(s, _)| s.prompts.len() as u64)
            .sum::<u64>()
            * servers.len() as u64;
        let mut finished = 0;
        let mut results = Map::new();
        for (set, conversations) in sets {
            let mut totals: Vec<Totals> = servers.iter().map(|_| Totals::default()).collect();
            let mut before = Vec::new();
            for s in &servers {
                before.push(metrics(&http, s).await);
            }
            for (i, (first, prompt)) in conversations.iter().zip(&set.prompts).enumerate() {
                for (s, t) in servers.iter().zip(&mut totals) {
                    // Each later user turn follows this server's own reply to the one before.
                    let mut messages = first.clone();
                    for turn in 0..=prompt.later.len() {
                        if ctx.cancel.is_cancelled() {
                            return Err(StageError::cancelled());
                        }
                        if turn > 0 {
                            messages.push(json!({"role": "user", "content": prompt.later[turn - 1]}));
                        }
                        let body = json!({"model": model, "messages": messages,
                            "max_tokens": p.max_new_tokens, "temperature": p.temperature,
                            "seed": p.seed, "chat_template_kwargs": p.template_kwargs});
                        let started = Instant::now();
                        let r = http
                            .post(format!("{}/chat/completions", s.url))
                            .timeout(Duration::from_secs(1800))
                            .json(&body)
                            .send()
                            .await
                            .map_err(|e| unreachable(s, &e))?;
                        let status = r.status();
                        let v: Value = r.json().await.map_err(|e| unreachable(s, &e))?;
                        let latency = started.elapsed().as_secs_f64();
                        if !status.is_success() {
                            let why: String = v.to_string().chars().take(300).collect();
                            return Err(StageError::new(format!(
                                "endpoint `{}` refused prompt {} of `{}` (turn {}): HTTP {status}: {why}",
                                s.name,
                                i,
                                set.name,
                                turn + 1
                            )));
                        }
                        let tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        t.latencies.push(latency);
                        t.tokens += tokens;
                        if let Some(r) = verify_rounds(&v) {
                            t.verify_rounds += r;
                            t.tokens_with_rounds += tokens;
                        }
                        let reply = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
                        messages.push(json!({"role": "assistant", "content": reply}));
                    }
                    finished += 1;
                    ctx.progress.set(
                        finished,
                        Some(total),
                        &format!(
                            "{}: prompt {}/{} on {}",
                            set.name,
                            i + 1,
                            set.prompts.len(),
                            s.name
                        ),
                    );
                }
            }
            let mut by_server = Map::new();
            let mut reference_tps = None;
            for ((s, t), before) in servers.iter().zip(&totals).zip(before) {
                let seconds: f64 = t.latencies.iter().sum();
                let tps = t.tokens as f64 / seconds.max(1e-9);
                let reference = *reference_tps.get_or_insert(tps);
                let mut sorted = t.latencies.clone();
                sorted.sort_by(f64::total_cmp);
                let pct = |q: f64| {
                    sorted
                        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
                        .copied()
                        .unwrap_or(0.0)
                };
                let after = metrics(&http, s).await;
                let tau = if t.verify_rounds > 0 {
                    Some(t.tokens_with_rounds as f64 / t.verify_rounds as f64)
                } else {
                    match (before, after) {
                        (Some((d0, a0)), Some((d1, a1))) if d1 > d0 => {
                            Some(1.0 + (a1 - a0) / (d1 - d0))
                        }
                        _ => None,
                    }
                };
                by_server.insert(
                    s.name.to_owned(),
                    json!({"prompts": set.prompts.len(), "requests": t.latencies.len(), "output_tokens": t.tokens,
                        "seconds": seconds, "tokens_per_second": tps,
                        "speedup": tps / reference.max(1e-9),
                        "latency_mean": seconds / t.latencies.len().max(1) as f64,
                        "latency_p50": pct(0.5), "latency_p90": pct(0.9),
                        "tau": tau, "acceptance": []}),
                );
            }
            results.insert(
                set.name.clone(),
                json!({"prompts": set.prompts.len(), "skipped": set.skipped,
                    "template_kwargs": set.template_kwargs, "methods": by_server}),
            );
        }
        Ok(results)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_counters_are_summed_over_label_sets() {
        let text = "# HELP vllm:spec_decode_num_drafts_total Drafts\n\
            vllm:spec_decode_num_drafts_total{model_name=\"m\",engine=\"0\"} 10.0\n\
            vllm:spec_decode_num_drafts_total{model_name=\"m\",engine=\"1\"} 30.0\n\
            vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 100.0\n";
        assert_eq!(vllm_counters(text), Some((40.0, 100.0)));
        assert_eq!(vllm_counters("other_metric 1\n"), None);
    }

    #[test]
    fn sglang_rounds_are_found_where_the_server_puts_them() {
        assert_eq!(
            verify_rounds(&json!({"meta_info": {"spec_verify_ct": 7}})),
            Some(7)
        );
        assert_eq!(
            verify_rounds(
                &json!({"sglext": {"speculative_decoding_stats": {"spec_verify_ct": 3}}})
            ),
            Some(3)
        );
        assert_eq!(
            verify_rounds(&json!({"usage": {"completion_tokens": 5}})),
            None
        );
    }
}
