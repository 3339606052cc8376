//! The charts `--plot DIR` draws from the figures.

use crate::curves;
use crate::plot;
use crate::tables::median_ms;
use crate::tables::ttft_difference;
use crate::Axis;
use crate::Chart;
use crate::Legend;
use crate::Scale;
use crate::Series;
use crate::Style;
use crate::TargetResult;
use crate::TransferReport;
use anyhow::Result;
use std::path::Path;

/// Draws every chart the measurements allow; returns the file names written.
pub(crate) fn write_charts(
    dir: &Path,
    results: &[TargetResult],
    transfer: Option<&TransferReport>,
) -> Result<Vec<String>> {
    let mut charts: Vec<(String, Chart)> = Vec::new();
    let per_target = |f: &dyn Fn(&TargetResult) -> Vec<(f64, f64)>| -> Vec<Series> {
        results
            .iter()
            .map(|r| Series {
                name: r.name.clone(),
                points: f(r),
                style: Style::Measured,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let concurrency_axis = || Axis::new("concurrency (requests in flight)", Scale::Log).at_data();
    if results.iter().any(|r| !r.levels.is_empty()) {
        charts.push((
            "throughput_vs_concurrency.png".into(),
            Chart {
                title: "Output tokens/s vs concurrency".into(),
                x: concurrency_axis(),
                y: Axis::new("output tokens/s (all requests)", Scale::Linear),
                series: per_target(&|r| {
                    r.levels
                        .iter()
                        .map(|l| (l.concurrency as f64, l.tokens as f64 / l.wall))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
        charts.push((
            "ttft_vs_concurrency.png".into(),
            Chart {
                title: "Time to first token vs concurrency (median)".into(),
                x: concurrency_axis(),
                y: Axis::new("TTFT p50 (ms, log scale)", Scale::Log),
                series: per_target(&|r| {
                    r.levels
                        .iter()
                        .map(|l| (l.concurrency as f64, median_ms(&l.ttft)))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
    }
    if results.iter().any(|r| !r.prompts.is_empty()) {
        charts.push((
            "ttft_vs_prompt_tokens.png".into(),
            Chart {
                title: "Time to first token vs prompt length (one request at a time)".into(),
                x: Axis::new("prompt tokens (log scale)", Scale::Log).at_data(),
                y: Axis::new("TTFT p50 (ms, log scale)", Scale::Log),
                series: per_target(&|r| {
                    r.prompts
                        .iter()
                        .map(|p| (p.tokens as f64, median_ms(&p.ttft)))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
    }
    if let Some(report) = transfer {
        let tokens = |f: &dyn Fn(&curves::TransferPoint) -> f64| -> Vec<(f64, f64)> {
            report
                .points
                .iter()
                .map(|p| (p.tokens as f64, f(p)))
                .collect()
        };
        let shm_tokens = |f: &dyn Fn(&curves::TransferPoint) -> f64| -> Vec<(f64, f64)> {
            report
                .shm_points
                .iter()
                .map(|p| (p.tokens as f64, f(p)))
                .collect()
        };
        let mut series = vec![
            Series {
                name: "KV transfer, loopback TCP (measured)".into(),
                points: tokens(&|p| p.seconds * 1e3),
                style: Style::Measured,
            },
            Series {
                name: "KV transfer, shared memory (measured)".into(),
                points: shm_tokens(&|p| p.seconds * 1e3),
                style: Style::Measured,
            },
            Series {
                name: format!("memcpy of the same bytes ({:.1} GB/s)", report.memcpy_gb_s),
                points: tokens(&|p| p.bytes as f64 / report.memcpy_gb_s / 1e6),
                style: Style::Reference,
            },
            Series {
                name: format!("xxh3 of the same bytes ({:.1} GB/s)", report.xxh3_gb_s),
                points: tokens(&|p| p.bytes as f64 / report.xxh3_gb_s / 1e6),
                style: Style::Reference,
            },
        ];
        let difference = ttft_difference(results);
        if difference.iter().any(|(_, d)| *d > 0.0) {
            series.push(Series {
                name: "serve − unified TTFT (same prompt length)".into(),
                points: difference
                    .iter()
                    .filter(|(_, d)| *d > 0.0)
                    .map(|&(t, d)| (t as f64, d * 1e3))
                    .collect(),
                style: Style::Measured,
            });
        }
        charts.push((
            "transfer_time_vs_tokens.png".into(),
            Chart {
                title: "KV transfer time vs tokens transferred".into(),
                x: Axis::new("tokens of KV (log scale)", Scale::Log).at_data(),
                y: Axis::new("time (ms, log scale)", Scale::Log),
                series,
                markers: Vec::new(),
                legend: Legend::LowerRight,
            },
        ));
        let flat = |gb_s: f64| {
            let first = report.points.first().map_or(1.0, |p| p.tokens as f64);
            let last = report.points.last().map_or(1.0, |p| p.tokens as f64);
            vec![(first, gb_s), (last, gb_s)]
        };
        charts.push((
            "transfer_bandwidth_vs_tokens.png".into(),
            Chart {
                title: "KV transfer bandwidth vs tokens, beside memory bandwidth".into(),
                x: Axis::new("tokens of KV (log scale)", Scale::Log).at_data(),
                y: Axis::new("GB/s (10^9 bytes per second)", Scale::Linear),
                series: vec![
                    Series {
                        name: "KV transfer, loopback TCP (measured)".into(),
                        points: tokens(&|p| p.gb_per_s()),
                        style: Style::Measured,
                    },
                    Series {
                        name: "KV transfer, shared memory (measured)".into(),
                        points: shm_tokens(&|p| p.gb_per_s()),
                        style: Style::Measured,
                    },
                    Series {
                        name: "memcpy (physical limit)".into(),
                        points: flat(report.memcpy_gb_s),
                        style: Style::Reference,
                    },
                    Series {
                        name: "xxh3 (checksum)".into(),
                        points: flat(report.xxh3_gb_s),
                        style: Style::Reference,
                    },
                ],
                markers: Vec::new(),
                legend: Legend::MiddleRight,
            },
        ));
    }
    for result in results.iter().filter(|r| !r.pool.is_empty()) {
        let mut workers: Vec<&str> = Vec::new();
        for sample in &result.pool {
            if !workers.contains(&sample.worker.as_str()) {
                workers.push(&sample.worker);
            }
        }
        let mut series: Vec<Series> = workers
            .iter()
            .map(|worker| Series {
                name: format!("{worker}: pages used"),
                points: result
                    .pool
                    .iter()
                    .filter(|s| s.worker == *worker)
                    .map(|s| (s.t, s.used))
                    .collect(),
                style: Style::Trace,
            })
            .collect();
        let total = result.pool.iter().map(|s| s.total).fold(0.0, f64::max);
        let end = result.pool.last().map_or(1.0, |s| s.t);
        series.push(Series {
            name: format!("pool size ({total:.0} pages per worker)"),
            points: vec![(0.0, total), (end, total)],
            style: Style::Reference,
        });
        charts.push((
            format!("pool_occupancy_{}.png", result.name),
            Chart {
                title: format!(
                    "KV pool pages used over time: {} (c = concurrency, p = prompt tokens)",
                    result.name
                ),
                x: Axis::new("time since the target started (s)", Scale::Linear),
                y: Axis::new("KV pages used", Scale::Linear),
                series,
                markers: result.markers.clone(),
                legend: Legend::MiddleLeft,
            },
        ));
    }
    let mut written = Vec::new();
    for (file, chart) in charts {
        let path = dir.join(&file);
        plot::draw(&chart, &path, plot::SIZE)?;
        written.push(path.display().to_string());
    }
    Ok(written)
}
