use std::cell::RefCell;

use gguf::{GgmlType, GgufFile, Value};
use proptest::test_runner::{Config, TestRunner};

use crate::common::model;

#[test]
fn header_facts() {
    let m = model();
    let f = &m.file;
    assert_eq!(f.version, 3);
    assert_eq!(f.tensors.len(), 272);
    assert_eq!(f.metadata.len(), 33);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.get_str("general.architecture"), Ok("llama"));
    assert_eq!(f.get_u32("llama.block_count"), Ok(30));
    assert_eq!(f.get_u32("llama.embedding_length"), Ok(576));
    assert_eq!(f.get_u32("llama.feed_forward_length"), Ok(1536));
    assert_eq!(f.get_u32("llama.attention.head_count"), Ok(9));
    assert_eq!(f.get_u32("llama.attention.head_count_kv"), Ok(3));
    assert_eq!(f.get_u32("llama.context_length"), Ok(8192));
    assert_eq!(f.get_u32("llama.vocab_size"), Ok(49152));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Ok(100_000.0));
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon"),
        Ok(1e-5)
    );
    assert_eq!(
        f.get_bool_or("tokenizer.ggml.add_bos_token", true),
        Ok(false)
    );
    match f.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => assert_eq!(tokens.len(), 49152),
        other => panic!("tokenizer.ggml.tokens: {other:?}"),
    }
    assert_eq!(
        f.get_array("tokenizer.ggml.merges").map(<[Value]>::len),
        Ok(48900)
    );
}

#[test]
fn tensors() {
    let m = model();
    let f = &m.file;
    let emb = f
        .tensor("token_embd.weight")
        .expect("token_embd.weight exists");
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    assert_eq!(emb.dims, [576, 49152]);
    assert_eq!(emb.byte_len, 576 * 49152 / 32 * 34);
    // Cross-checked with Python's gguf.GGUFReader.
    assert_eq!(emb.offset, 1_785_664);

    let count = |t: GgmlType| f.tensors.iter().filter(|i| i.ggml_type == t).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(count(GgmlType::F32), 61);
    assert_eq!(count(GgmlType::Q8_0), 1);

    let q = f
        .tensor("blk.0.attn_q.weight")
        .expect("blk.0.attn_q.weight exists");
    assert_eq!(
        (q.ggml_type, q.dims.as_slice()),
        (GgmlType::Q4_1, &[576, 576][..])
    );
    let norm = f
        .tensor("output_norm.weight")
        .expect("output_norm.weight exists");
    assert_eq!(
        (norm.ggml_type, norm.dims.as_slice()),
        (GgmlType::F32, &[576][..])
    );
    let norm_bytes = f
        .tensor_bytes(&m.bytes, "output_norm.weight")
        .expect("output_norm data lies in the file");
    assert_eq!(norm_bytes.len(), 576 * 4);

    let mut end = 0;
    for t in &f.tensors {
        let data = f
            .tensor_bytes(&m.bytes, &t.name)
            .expect("every tensor slices");
        assert_eq!(data.len() as u64, t.byte_len);
        assert_eq!(t.offset % 32, 0, "{}", t.name);
        end = end.max(t.offset + t.byte_len);
    }
    assert_eq!(end, m.bytes.len() as u64, "tensor data ends with the file");
    assert!(f.tensor("output.weight").is_err(), "embeddings are tied");
}

#[test]
fn truncated_real_header_is_an_error() {
    let m = model();
    let header_len = m.file.data_offset() as usize;
    // Every 9973rd prefix of the 1.7 MB header, plus the area around its end.
    let lens = (0..header_len)
        .step_by(9973)
        .chain(header_len - 64..m.bytes.len().min(header_len + 64));
    for len in lens {
        assert!(GgufFile::parse(&m.bytes[..len]).is_err(), "prefix {len}");
    }
}

#[test]
fn mutated_real_header_never_panics() {
    let m = model();
    let header_len = m.file.data_offset() as usize;
    let bytes = RefCell::new(m.bytes.clone());
    let mut runner = TestRunner::new(Config {
        cases: 200,
        ..Config::default()
    });
    let edits = proptest::collection::vec((0..header_len, proptest::num::u8::ANY), 1..4);
    runner
        .run(&edits, |edits| {
            let mut buf = bytes.borrow_mut();
            let saved: Vec<(usize, u8)> = edits.iter().map(|&(i, _)| (i, buf[i])).collect();
            for &(i, b) in &edits {
                buf[i] = b;
            }
            let result = GgufFile::parse(&buf);
            if let Ok(f) = &result {
                for t in &f.tensors {
                    assert!(f.tensor_bytes(&buf, &t.name).is_ok());
                }
            }
            for &(i, b) in saved.iter().rev() {
                buf[i] = b;
            }
            Ok(())
        })
        .expect("parsing a mutated header never panics");
}
