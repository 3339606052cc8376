//! What one structured-output step costs the grammar engine: the mask of allowed tokens over
//! the served model's 49,152-token vocabulary, and taking the chosen token, at each token of a
//! JSON answer to a schema (median and worst over the answer, five runs). The engine computes
//! a request's mask while the model computes that step's logits, so this is the time a
//! constrained request adds to a step only where it is longer than the forward pass.
//!
//! `cargo bench -p grammar --bench mask` (needs `scripts/fetch-model.sh`'s model).

use grammar::{Shape, Vocabulary};
use std::time::Instant;

fn main() {
    let path = std::env::var_os("AIRLOCK_MODEL").map_or_else(
        || {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        std::path::PathBuf::from,
    );
    let bytes = std::fs::read(&path).expect("the model file (scripts/fetch-model.sh)");
    let file = gguf::GgufFile::parse(&bytes).expect("the model parses");
    let tokenizer = gguf::Tokenizer::from_gguf(&file).expect("its tokenizer");
    let started = Instant::now();
    let vocabulary = Vocabulary::new(&tokenizer).expect("vocabulary");
    println!("vocabulary: {:.1} ms (once per worker)", ms(started));

    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string"}},
            "capital": {"type": "boolean"}
        },
        "required": ["city", "population", "landmarks", "capital"],
        "additionalProperties": false
    });
    let answer = r#"{"city": "Paris", "population": 2102650, "landmarks": ["Eiffel Tower", "Louvre", "Notre-Dame"], "capital": true}"#;
    let tokens = tokenizer.encode(answer, false);
    let shape = Shape::JsonSchema(schema);
    let mut compile = Vec::new();
    let mut steps = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let mut constraint = vocabulary.constraint(&shape).expect("the schema compiles");
        compile.push(ms(started));
        for &token in &tokens {
            let started = Instant::now();
            let mask = constraint.next_mask().expect("a mask");
            let mut logits = vec![0.0f32; tokenizer.vocab_size()];
            mask.apply(&mut logits);
            constraint
                .accept(token)
                .expect("the answer follows the schema");
            steps.push(ms(started));
        }
    }
    compile.sort_by(f64::total_cmp);
    steps.sort_by(f64::total_cmp);
    println!(
        "schema compile: median {:.2} ms; per token ({} tokens x 5): median {:.3} ms, \
         p90 {:.3} ms, worst {:.3} ms",
        compile[compile.len() / 2],
        tokens.len(),
        steps[steps.len() / 2],
        steps[steps.len() * 9 / 10],
        steps[steps.len() - 1]
    );
}

fn ms(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}
