//! bench.json: every figure of a run, written for re-plotting (`--replot`) and read back.

use crate::curves;
use crate::machine::Machine;
use crate::tables::median_ms;
use crate::Args;
use crate::LevelReport;
use crate::PoolSample;
use crate::PromptPoint;
use crate::TargetResult;
use crate::TransferReport;
use anyhow::Context;
use anyhow::Result;

/// Every figure of the run, for re-plotting or comparing runs.
pub(crate) fn report_json(
    args: &Args,
    machine: &Machine,
    loads: &[(String, String)],
    results: &[TargetResult],
    transfer: Option<&TransferReport>,
) -> serde_json::Value {
    use serde_json::json;
    let targets: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "concurrency": r.levels.iter().map(|l| json!({
                    "concurrency": l.concurrency,
                    "requests": l.requests,
                    "failed": l.failed,
                    "wall_s": l.wall,
                    "output_tokens": l.tokens,
                    "output_tok_s": l.tokens as f64 / l.wall,
                    "ttft_p50_ms": median_ms(&l.ttft),
                    "ttft_p99_ms": stats::percentile(&l.ttft, 99.0) * 1e3,
                    "itl_p50_ms": stats::percentile(&l.itl, 50.0) * 1e3,
                    "itl_p99_ms": stats::percentile(&l.itl, 99.0) * 1e3,
                })).collect::<Vec<_>>(),
                "prompt_tokens": r.prompts.iter().map(|p| json!({
                    "prompt_tokens": p.tokens,
                    "server_prompt_tokens": p.server_tokens,
                    "ttft_ms": p.ttft.iter().map(|t| t * 1e3).collect::<Vec<_>>(),
                    "ttft_p50_ms": median_ms(&p.ttft),
                    "decode_tok_s_p50": stats::median(&p.decode_tok_s),
                    "output_tokens": p.output_tokens,
                    "failed": p.failed,
                })).collect::<Vec<_>>(),
                "pool": thin_pool(&r.pool)
                    .into_iter()
                    .map(|s| json!([(s.t * 1e3).round() / 1e3, s.worker, s.used, s.total]))
                    .collect::<Vec<_>>(),
                "markers": r.markers,
            })
        })
        .collect();
    json!({
        "machine": { "cores": machine.cores, "cpu": machine.cpu },
        "load_average_1min": loads,
        "threads": args.model.threads(),
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests,
        "prompt_words": args.prompt_words,
        "prompt_requests": args.prompt_requests,
        "prompt_max_tokens": args.prompt_max_tokens,
        "seed": args.seed,
        "targets": targets,
        "transfer": transfer.map(|t| json!({
            "layout": {
                "layers": t.layout.layer_count,
                "kv_heads": t.layout.kv_head_count,
                "head_dim": t.layout.head_dim,
                "page_size_tokens": t.layout.page_size_tokens,
                "page_bytes": t.layout.page_bytes(),
            },
            "memcpy_gb_s": t.memcpy_gb_s,
            "socket_gb_s": t.socket_gb_s,
            "xxh3_gb_s": t.xxh3_gb_s,
            "points": points_json(&t.points),
            "shm_points": points_json(&t.shm_points),
        })),
    })
}

fn points_json(points: &[curves::TransferPoint]) -> Vec<serde_json::Value> {
    points
        .iter()
        .map(|p| {
            serde_json::json!({
                "tokens": p.tokens,
                "pages": p.pages,
                "bytes": p.bytes,
                "seconds": p.seconds,
                "pack_seconds": p.pack_seconds,
                "gb_s": p.gb_per_s(),
            })
        })
        .collect()
}

/// The pool samples a chart needs: per worker, the first and last, and those next to a change
/// (the middle of a run of equal values draws nothing its ends do not).
pub(crate) fn thin_pool(samples: &[PoolSample]) -> Vec<&PoolSample> {
    let mut by_worker: Vec<(&str, Vec<usize>)> = Vec::new();
    for (index, sample) in samples.iter().enumerate() {
        match by_worker.iter_mut().find(|(w, _)| *w == sample.worker) {
            Some((_, indices)) => indices.push(index),
            None => by_worker.push((&sample.worker, vec![index])),
        }
    }
    let same = |a: usize, b: usize| {
        samples[a].used == samples[b].used && samples[a].total == samples[b].total
    };
    let mut keep = vec![false; samples.len()];
    for (_, indices) in &by_worker {
        for (k, &index) in indices.iter().enumerate() {
            keep[index] = match (k.checked_sub(1), indices.get(k + 1)) {
                (Some(p), Some(&next)) => !(same(indices[p], index) && same(index, next)),
                _ => true,
            };
        }
    }
    samples
        .iter()
        .zip(keep)
        .filter_map(|(sample, keep)| keep.then_some(sample))
        .collect()
}

/// The figures the charts need, back from `report_json`'s output (`--replot`). Concurrency
/// levels keep only their median TTFT (all a chart shows).
pub(crate) fn results_from_json(
    json: &serde_json::Value,
) -> Result<(Vec<TargetResult>, Option<TransferReport>)> {
    let number = |value: &serde_json::Value, key: &str| -> Result<f64> {
        value[key]
            .as_f64()
            .with_context(|| format!("missing number '{key}'"))
    };
    let list = |value: &serde_json::Value, key: &str| -> Vec<serde_json::Value> {
        value[key].as_array().cloned().unwrap_or_default()
    };
    let mut results = Vec::new();
    for target in list(json, "targets") {
        let mut levels = Vec::new();
        for level in list(&target, "concurrency") {
            levels.push(LevelReport {
                concurrency: number(&level, "concurrency")? as usize,
                requests: number(&level, "requests")? as usize,
                failed: number(&level, "failed")? as usize,
                wall: number(&level, "wall_s")?,
                tokens: number(&level, "output_tokens")? as usize,
                // null when every request of the level failed (NaN is not JSON).
                ttft: vec![level["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN) / 1e3],
                itl: Vec::new(),
            });
        }
        let mut prompts = Vec::new();
        for point in list(&target, "prompt_tokens") {
            prompts.push(PromptPoint {
                tokens: number(&point, "prompt_tokens")? as usize,
                server_tokens: point["server_prompt_tokens"].as_u64().map(|n| n as usize),
                ttft: list(&point, "ttft_ms")
                    .iter()
                    .filter_map(serde_json::Value::as_f64)
                    .map(|ms| ms / 1e3)
                    .collect(),
                decode_tok_s: Vec::new(),
                output_tokens: Vec::new(),
                failed: number(&point, "failed")? as usize,
            });
        }
        let pool = list(&target, "pool")
            .iter()
            .filter_map(|sample| {
                Some(PoolSample {
                    t: sample[0].as_f64()?,
                    worker: sample[1].as_str()?.to_string(),
                    used: sample[2].as_f64()?,
                    total: sample[3].as_f64()?,
                })
            })
            .collect();
        let markers = list(&target, "markers")
            .iter()
            .filter_map(|m| Some((m[0].as_f64()?, m[1].as_str()?.to_string())))
            .collect();
        results.push(TargetResult {
            name: target["name"]
                .as_str()
                .context("a target without a name")?
                .into(),
            levels,
            prompts,
            pool,
            markers,
        });
    }
    let transfer = match &json["transfer"] {
        serde_json::Value::Null => None,
        transfer => {
            let layout = &transfer["layout"];
            let points_of = |key: &str| -> Result<Vec<curves::TransferPoint>> {
                let mut points = Vec::new();
                for point in list(transfer, key) {
                    points.push(curves::TransferPoint {
                        tokens: number(&point, "tokens")? as usize,
                        pages: number(&point, "pages")? as usize,
                        bytes: number(&point, "bytes")? as usize,
                        seconds: number(&point, "seconds")?,
                        pack_seconds: number(&point, "pack_seconds")?,
                    });
                }
                Ok(points)
            };
            let points = points_of("points")?;
            // Reports written before the one-sided transport existed have none.
            let shm_points = points_of("shm_points")?;
            Some(TransferReport {
                layout: kv::KvLayout {
                    layer_count: number(layout, "layers")? as usize,
                    kv_head_count: number(layout, "kv_heads")? as usize,
                    head_dim: number(layout, "head_dim")? as usize,
                    page_size_tokens: number(layout, "page_size_tokens")? as usize,
                },
                points,
                shm_points,
                memcpy_gb_s: number(transfer, "memcpy_gb_s")?,
                // Reports written before the socket baseline existed have none.
                socket_gb_s: number(transfer, "socket_gb_s").unwrap_or(f64::NAN),
                xxh3_gb_s: number(transfer, "xxh3_gb_s")?,
            })
        }
    };
    Ok((results, transfer))
}
