//! Unit tests of the report: pool thinning, JSON round trip, table figures.

use crate::report_json::thin_pool;
use crate::tables::median_ms;

use super::*;

#[test]
fn pool_thinning_keeps_every_step() {
    let sample = |t: f64, worker: &str, used: f64| PoolSample {
        t,
        worker: worker.into(),
        used,
        total: 8.0,
    };
    let samples = [
        sample(0.0, "a", 1.0),
        sample(0.0, "b", 5.0),
        sample(0.1, "a", 1.0),
        sample(0.2, "a", 1.0),
        sample(0.2, "b", 5.0),
        sample(0.3, "a", 3.0),
        sample(0.3, "b", 5.0),
        sample(0.4, "a", 3.0),
    ];
    let kept: Vec<(f64, &str)> = thin_pool(&samples)
        .iter()
        .map(|s| (s.t, s.worker.as_str()))
        .collect();
    // a: 0.1 is inside a run (dropped), 0.2 is the run's end before the step (kept).
    assert_eq!(
        kept,
        [
            (0.0, "a"),
            (0.0, "b"),
            (0.2, "a"),
            (0.3, "a"),
            (0.3, "b"),
            (0.4, "a")
        ]
    );
}

#[test]
fn a_report_replots_from_its_json() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let args = <Cli as clap::Parser>::parse_from(["bench"]).args;
    let machine = Machine {
        cores: 2,
        cpu: "test CPU".into(),
    };
    let results = vec![TargetResult {
        name: "serve".into(),
        levels: vec![LevelReport {
            concurrency: 4,
            requests: 8,
            failed: 0,
            wall: 2.0,
            tokens: 512,
            ttft: vec![0.1, 0.3, 0.2],
            itl: vec![0.01],
        }],
        prompts: vec![PromptPoint {
            tokens: 128,
            server_tokens: Some(128),
            ttft: vec![0.25, 0.35],
            decode_tok_s: vec![90.0],
            output_tokens: vec![16, 16],
            failed: 0,
        }],
        pool: vec![PoolSample {
            t: 0.5,
            worker: "decode-0".into(),
            used: 12.0,
            total: 512.0,
        }],
        markers: vec![(0.1, "c4".into())],
    }];
    let transfer = TransferReport {
        layout: kv::KvLayout {
            layer_count: 30,
            kv_head_count: 3,
            head_dim: 64,
            page_size_tokens: 16,
        },
        points: vec![crate::curves::TransferPoint {
            tokens: 128,
            pages: 8,
            bytes: 8 * 368_640,
            seconds: 0.002,
            pack_seconds: 0.001,
        }],
        shm_points: vec![crate::curves::TransferPoint {
            tokens: 128,
            pages: 8,
            bytes: 8 * 368_640,
            seconds: 0.0006,
            pack_seconds: 0.0004,
        }],
        memcpy_gb_s: 15.0,
        xxh3_gb_s: 13.0,
        socket_gb_s: 4.0,
    };
    let loads = [("start".to_string(), "0.5".to_string())];
    let json = report_json(&args, &machine, &loads, &results, Some(&transfer));
    let text = serde_json::to_string(&json).unwrap();
    let (back, back_transfer) = results_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!(back.len(), 1);
    let target = &back[0];
    assert_eq!(target.name, "serve");
    assert_eq!(target.levels[0].concurrency, 4);
    assert_eq!(target.levels[0].tokens, 512);
    assert!((median_ms(&target.levels[0].ttft) - 200.0).abs() < 1e-9);
    assert_eq!(target.prompts[0].tokens, 128);
    assert!((median_ms(&target.prompts[0].ttft) - 300.0).abs() < 1e-9);
    assert_eq!(target.pool, results[0].pool);
    assert_eq!(target.markers, results[0].markers);
    let back_transfer = back_transfer.unwrap();
    assert_eq!(back_transfer.layout, transfer.layout);
    assert_eq!(back_transfer.points[0].bytes, transfer.points[0].bytes);
    assert_eq!(back_transfer.memcpy_gb_s, 15.0);
    assert!(results_from_json(&serde_json::json!({"targets": [{"concurrency": [{}]}]})).is_err());
}
