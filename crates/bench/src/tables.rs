//! The report as text tables on stdout.

use crate::Args;
use crate::TargetResult;
use crate::TransferReport;

pub(crate) fn print_table(results: &[TargetResult], args: &Args) {
    let peer = results.iter().find(|r| r.name == "llama-cpp");
    println!(
        "\n{} requests per level (at least 2 × the level), max_tokens {}, prompts {} words, \
         seed {}, {} threads\n",
        args.requests,
        args.max_tokens,
        args.prompt_words,
        args.seed,
        args.model.threads()
    );
    println!(
        "| server | concurrency | output tok/s | vs llama-cpp | TTFT p50 ms | TTFT p99 ms | \
         ITL p50 ms | ITL p99 ms | tokens/request | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for TargetResult {
        name,
        levels: reports,
        ..
    } in results
    {
        for report in reports {
            let rate = report.tokens as f64 / report.wall;
            let ratio = peer
                .and_then(|p| {
                    p.levels
                        .iter()
                        .find(|l| l.concurrency == report.concurrency)
                })
                .map(|l| rate / (l.tokens as f64 / l.wall))
                .map_or("-".to_string(), |r| format!("{r:.2}×"));
            let ttft = report.ttft.clone();
            let itl = report.itl.clone();
            println!(
                "| {name} | {} | {rate:.1} | {ratio} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {} |",
                report.concurrency,
                stats::percentile(&ttft, 50.0) * 1e3,
                stats::percentile(&ttft, 99.0) * 1e3,
                stats::percentile(&itl, 50.0) * 1e3,
                stats::percentile(&itl, 99.0) * 1e3,
                report.tokens as f64 / (report.requests - report.failed).max(1) as f64,
                report.failed,
            );
        }
    }
}

pub(crate) fn median_ms(values: &[f64]) -> f64 {
    stats::median(values) * 1e3
}

pub(crate) fn print_prompt_table(results: &[TargetResult], args: &Args) {
    let peer = results.iter().find(|r| r.name == "llama-cpp");
    println!(
        "\nprompt-length sweep: {} requests per point, one at a time, max_tokens {}, greedy; \
         prompt tokens counted by the model's tokenizer\n",
        args.prompt_requests, args.prompt_max_tokens
    );
    println!(
        "| prompt tokens | server | TTFT p50 ms | prompt tok/s (tokens / TTFT) | llama-cpp TTFT / \
         this | decode tok/s p50 | tokens out (mean) | usage.prompt_tokens | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let lengths: Vec<usize> = results
        .iter()
        .flat_map(|r| r.prompts.iter().map(|p| p.tokens))
        .fold(Vec::new(), |mut seen, n| {
            if !seen.contains(&n) {
                seen.push(n);
            }
            seen
        });
    for tokens in lengths {
        for result in results {
            let Some(point) = result.prompts.iter().find(|p| p.tokens == tokens) else {
                continue;
            };
            let ttft = median_ms(&point.ttft);
            let ratio = peer
                .and_then(|p| p.prompts.iter().find(|q| q.tokens == tokens))
                .map(|q| median_ms(&q.ttft) / ttft)
                .filter(|r| r.is_finite())
                .map_or("-".to_string(), |r| format!("{r:.2}×"));
            let figure = |value: f64, digits: usize| {
                if value.is_finite() {
                    format!("{value:.digits$}")
                } else {
                    "-".to_string()
                }
            };
            let out =
                point.output_tokens.iter().sum::<usize>() as f64 / point.output_tokens.len() as f64;
            println!(
                "| {tokens} | {} | {} | {} | {ratio} | {} | {} | {} | {} |",
                result.name,
                figure(ttft, 0),
                figure(tokens as f64 / (ttft / 1e3), 0),
                figure(stats::median(&point.decode_tok_s), 1),
                figure(out, 1),
                point
                    .server_tokens
                    .map_or("-".to_string(), |n| n.to_string()),
                point.failed,
            );
        }
    }
}

/// serve's TTFT minus unified's at each prompt length both measured: the cost of
/// disaggregation (transfer, its verification, the extra hop), as the client sees it.
pub(crate) fn ttft_difference(results: &[TargetResult]) -> Vec<(usize, f64)> {
    let find = |name: &str| results.iter().find(|r| r.name == name);
    let (Some(serve), Some(unified)) = (find("serve"), find("unified")) else {
        return Vec::new();
    };
    serve
        .prompts
        .iter()
        .filter_map(|s| {
            let u = unified.prompts.iter().find(|u| u.tokens == s.tokens)?;
            Some((s.tokens, (median_ms(&s.ttft) - median_ms(&u.ttft)) / 1e3))
        })
        .filter(|(_, d)| d.is_finite())
        .collect()
}

pub(crate) fn print_transfer_table(report: &TransferReport, results: &[TargetResult]) {
    let layout = report.layout;
    println!(
        "\nKV transfer over loopback TCP, in process: {} layers × {} kv heads × {} dims, f16, \
         {} tokens per page ({} bytes); timed from packing to the receiver's verified seal\n\
         memcpy {:.2} GB/s, page hash (XXH3) {:.2} GB/s, loopback socket copy {:.2} GB/s (best of 5 over \
         256 MiB, same run)\n",
        layout.layer_count,
        layout.kv_head_count,
        layout.head_dim,
        layout.page_size_tokens,
        layout.page_bytes(),
        report.memcpy_gb_s,
        report.xxh3_gb_s,
        report.socket_gb_s
    );
    let difference = ttft_difference(results);
    println!(
        "| tokens | pages | MB | transfer ms | GB/s | of memcpy | of socket copy | sender packing ms | \
         memcpy ms (same bytes) | serve − unified TTFT ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for point in &report.points {
        let memcpy_ms = point.bytes as f64 / report.memcpy_gb_s / 1e6;
        let measured = difference
            .iter()
            .find(|(tokens, _)| *tokens == point.tokens)
            .map_or("-".to_string(), |(_, d)| format!("{:.0}", d * 1e3));
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.2} | {:.0}% | {:.0}% | {:.2} | {:.2} | {measured} |",
            point.tokens,
            point.pages,
            point.bytes as f64 / 1e6,
            point.seconds * 1e3,
            point.gb_per_s(),
            point.gb_per_s() / report.memcpy_gb_s * 100.0,
            point.gb_per_s() / report.socket_gb_s * 100.0,
            point.pack_seconds * 1e3,
            memcpy_ms,
        );
    }
    if report.shm_points.is_empty() {
        return;
    }
    println!(
        "\nKV transfer one-sided through shared memory (serve's default): pages copied into the \
         receiver's memfd pool, control frames over a Unix socket; same layout and timing\n"
    );
    println!("| tokens | pages | MB | transfer ms | GB/s | of memcpy | sender packing ms | memcpy ms (same bytes) |");
    println!("|---|---|---|---|---|---|---|---|");
    for point in &report.shm_points {
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.2} | {:.0}% | {:.2} | {:.2} |",
            point.tokens,
            point.pages,
            point.bytes as f64 / 1e6,
            point.seconds * 1e3,
            point.gb_per_s(),
            point.gb_per_s() / report.memcpy_gb_s * 100.0,
            point.pack_seconds * 1e3,
            point.bytes as f64 / report.memcpy_gb_s / 1e6,
        );
    }
}
