use proptest::prelude::*;

use crate::testutil::{put_str, Builder};
use crate::{Error, GgmlType, GgufFile, Value};

fn parse(bytes: &[u8]) -> crate::Result<GgufFile> {
    GgufFile::parse(bytes)
}

/// Header bytes up to and including the counts.
fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&n_tensors.to_le_bytes());
    out.extend_from_slice(&n_kv.to_le_bytes());
    out
}

/// A file exercising every value type, nesting and two tensors.
fn sample_file() -> Vec<u8> {
    Builder::new()
        .kv("general.architecture", Value::String("llama".into()))
        .kv("u8", Value::U8(7))
        .kv("i8", Value::I8(-7))
        .kv("u16", Value::U16(700))
        .kv("i16", Value::I16(-700))
        .kv("u32", Value::U32(70_000))
        .kv("i32", Value::I32(-70_000))
        .kv("f32", Value::F32(1.5))
        .kv("bool", Value::Bool(true))
        .kv("u64", Value::U64(1 << 40))
        .kv("i64", Value::I64(-(1 << 40)))
        .kv("f64", Value::F64(-2.25))
        .kv(
            "strings",
            Value::Array(vec![Value::String("a".into()), Value::String("ñ".into())]),
        )
        .kv(
            "nested",
            Value::Array(vec![
                Value::Array(vec![Value::I32(1), Value::I32(2)]),
                Value::Array(vec![Value::I32(3)]),
            ]),
        )
        .tensor("w", &[4, 2], 0, (0..32).collect())
        .tensor("q", &[64, 2], 3, vec![9; 80])
        .build()
}

#[test]
fn minimal_file() {
    let bytes = header(3, 0, 0);
    let f = parse(&bytes).expect("an empty v3 file is valid");
    assert_eq!(f.version, 3);
    assert!(f.metadata.is_empty() && f.tensors.is_empty());
    assert_eq!(f.data_offset(), 32);
    assert_eq!(f.alignment(), 32);
}

#[test]
fn all_value_types_round_trip() {
    let bytes = sample_file();
    let f = parse(&bytes).expect("sample file parses");
    assert_eq!(f.metadata.len(), 14);
    assert_eq!(f.metadata["u8"], Value::U8(7));
    assert_eq!(f.metadata["i8"], Value::I8(-7));
    assert_eq!(f.metadata["u16"], Value::U16(700));
    assert_eq!(f.metadata["i16"], Value::I16(-700));
    assert_eq!(f.metadata["u32"], Value::U32(70_000));
    assert_eq!(f.metadata["i32"], Value::I32(-70_000));
    assert_eq!(f.metadata["f32"], Value::F32(1.5));
    assert_eq!(f.metadata["bool"], Value::Bool(true));
    assert_eq!(f.metadata["u64"], Value::U64(1 << 40));
    assert_eq!(f.metadata["i64"], Value::I64(-(1 << 40)));
    assert_eq!(f.metadata["f64"], Value::F64(-2.25));
    assert_eq!(
        f.metadata["strings"],
        Value::Array(vec![Value::String("a".into()), Value::String("ñ".into())])
    );
    assert_eq!(
        f.metadata["nested"],
        Value::Array(vec![
            Value::Array(vec![Value::I32(1), Value::I32(2)]),
            Value::Array(vec![Value::I32(3)]),
        ])
    );
}

#[test]
fn tensors_are_located_and_sliced() {
    let bytes = sample_file();
    let f = parse(&bytes).expect("sample file parses");
    let w = f.tensor("w").expect("w exists");
    assert_eq!(w.dims, [4, 2]);
    assert_eq!(w.ggml_type, GgmlType::F32);
    assert_eq!(w.byte_len, 32);
    assert_eq!(w.n_elements(), 8);
    assert_eq!(w.offset, f.data_offset());
    assert_eq!(w.offset % 32, 0);
    let data = f.tensor_bytes(&bytes, "w").expect("w data in file");
    assert_eq!(data, (0..32).collect::<Vec<u8>>());

    let q = f.tensor("q").expect("q exists");
    assert_eq!(q.ggml_type, GgmlType::Q4_1);
    assert_eq!(q.byte_len, 80); // 128 elements / 32 per block * 20 bytes
    assert_eq!(q.offset, f.data_offset() + 32);
    assert_eq!(f.tensor_bytes(&bytes, "q").expect("q data"), vec![9; 80]);

    assert_eq!(
        f.tensor("nope"),
        Err(Error::MissingTensor {
            name: "nope".into()
        })
    );
    assert!(matches!(
        f.tensor_bytes(&bytes[..bytes.len() - 1], "w"),
        Err(Error::FileMismatch { .. })
    ));
}

#[test]
fn versions() {
    assert!(parse(&header(2, 0, 0)).is_ok());
    let v2 = Builder::new()
        .version(2)
        .kv("k", Value::String("v".into()))
        .tensor("t", &[2], 0, vec![1; 8])
        .build();
    let f = parse(&v2).expect("v2 file parses");
    assert_eq!((f.version, f.get_str("k")), (2, Ok("v")));
    for v in [0, 1, 4, 0x0300_0000] {
        match parse(&header(v, 0, 0)) {
            Err(Error::UnsupportedVersion { version, .. }) => assert_eq!(version, v),
            other => panic!("version {v}: expected UnsupportedVersion, got {other:?}"),
        }
    }
    let err = parse(&header(0x0300_0000, 0, 0)).expect_err("big-endian is refused");
    assert!(err.to_string().contains("big-endian"), "{err}");
}

#[test]
fn bad_magic() {
    let mut bytes = header(3, 0, 0);
    bytes[0] = b'X';
    assert_eq!(parse(&bytes), Err(Error::BadMagic { found: *b"XGUF" }));
    assert!(matches!(parse(b"GG"), Err(Error::Truncated { .. })));
    assert!(matches!(parse(b""), Err(Error::Truncated { .. })));
}

/// A header with one key/value whose type and payload are given raw.
fn one_kv(key: &str, type_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut bytes = header(3, 0, 1);
    put_str(&mut bytes, key);
    bytes.extend_from_slice(&type_id.to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

#[test]
fn unknown_value_types_are_refused() {
    match parse(&one_kv("k", 13, &[0; 16])) {
        Err(Error::UnknownValueType { key, type_id, .. }) => {
            assert_eq!((key.as_str(), type_id), ("k", 13))
        }
        other => panic!("expected UnknownValueType, got {other:?}"),
    }
    // Array of an unknown element type.
    let mut payload = 99u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&[0; 8]);
    assert!(matches!(
        parse(&one_kv("arr", 9, &payload)),
        Err(Error::UnknownValueType { type_id: 99, .. })
    ));
}

#[test]
fn invalid_values_are_refused() {
    assert_eq!(
        parse(&one_kv("b", 7, &[2])),
        Err(Error::InvalidBool {
            key: "b".into(),
            byte: 2
        })
    );
    let mut bad_utf8 = 2u64.to_le_bytes().to_vec();
    bad_utf8.extend_from_slice(&[0xC3, 0x28]);
    assert!(matches!(
        parse(&one_kv("s", 8, &bad_utf8)),
        Err(Error::InvalidUtf8 { .. })
    ));
    let huge = (crate::MAX_STRING_LEN + 1).to_le_bytes();
    assert!(matches!(
        parse(&one_kv("s", 8, &huge)),
        Err(Error::TooLarge { .. })
    ));
    let mut long_array = 0u32.to_le_bytes().to_vec();
    long_array.extend_from_slice(&(crate::MAX_ARRAY_LEN + 1).to_le_bytes());
    assert!(matches!(
        parse(&one_kv("a", 9, &long_array)),
        Err(Error::TooLarge { .. })
    ));
    // A count the remaining bytes cannot hold is a truncation, found before
    // allocating.
    let mut short_array = 10u32.to_le_bytes().to_vec();
    short_array.extend_from_slice(&1000u64.to_le_bytes());
    assert!(matches!(
        parse(&one_kv("a", 9, &short_array)),
        Err(Error::Truncated { .. })
    ));
}

#[test]
fn array_nesting_is_bounded() {
    let mut v = Value::Array(vec![Value::U8(1)]);
    for _ in 0..crate::MAX_ARRAY_DEPTH {
        v = Value::Array(vec![v]);
    }
    let bytes = Builder::new().kv("deep", v).build();
    assert!(matches!(parse(&bytes), Err(Error::NestingTooDeep { .. })));
    let mut ok = Value::Array(vec![Value::U8(1)]);
    for _ in 1..crate::MAX_ARRAY_DEPTH {
        ok = Value::Array(vec![ok]);
    }
    assert!(parse(&Builder::new().kv("deep", ok).build()).is_ok());
}

#[test]
fn counts_are_bounded() {
    assert!(matches!(
        parse(&header(3, crate::MAX_TENSOR_COUNT + 1, 0)),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        parse(&header(3, 0, crate::MAX_KV_COUNT + 1)),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        parse(&header(3, 10, 10)),
        Err(Error::Truncated { .. })
    ));
}

#[test]
fn duplicates_are_refused() {
    let bytes = Builder::new()
        .kv("k", Value::U8(1))
        .kv("k", Value::U8(2))
        .build();
    assert_eq!(parse(&bytes), Err(Error::DuplicateKey { key: "k".into() }));
    let bytes = Builder::new()
        .tensor("t", &[1], 0, vec![0; 4])
        .tensor("t", &[1], 0, vec![0; 4])
        .build();
    assert_eq!(
        parse(&bytes),
        Err(Error::DuplicateTensor { name: "t".into() })
    );
}

#[test]
fn alignment_key() {
    let bytes = Builder::new()
        .kv("general.alignment", Value::U32(64))
        .tensor("a", &[3], 0, vec![1; 12])
        .tensor("b", &[3], 0, vec![2; 12])
        .build();
    let f = parse(&bytes).expect("64-aligned file parses");
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("b").expect("b").offset, f.data_offset() + 64);
    for bad in [0, 3, 48] {
        let bytes = Builder::new()
            .kv("general.alignment", Value::U32(bad))
            .build();
        assert_eq!(parse(&bytes), Err(Error::BadAlignment { alignment: bad }));
    }
    let bytes = Builder::new()
        .kv("general.alignment", Value::U64(32))
        .build();
    assert!(matches!(parse(&bytes), Err(Error::WrongType { .. })));
}

#[test]
fn tensor_shapes_are_checked() {
    let shape_err = |b: Builder| match parse(&b.build()) {
        Err(Error::BadTensorShape { reason, .. }) => reason,
        other => panic!("expected BadTensorShape, got {other:?}"),
    };
    let reason = shape_err(Builder::new().raw_tensor("t", &[1, 1, 1, 1, 1], 0, 0));
    assert!(reason.contains("5 dimensions"), "{reason}");
    let reason = shape_err(Builder::new().raw_tensor("t", &[u64::MAX, 2], 0, 0));
    assert!(reason.contains("overflows"), "{reason}");
    let reason = shape_err(Builder::new().raw_tensor("t", &[1 << 62, 2], 0, 0));
    assert!(reason.contains("overflows"), "{reason}");
    let reason = shape_err(Builder::new().raw_tensor("t", &[33], 8, 0));
    assert!(reason.contains("multiple"), "{reason}");
    assert_eq!(
        parse(&Builder::new().raw_tensor("t", &[32], 4, 0).build()),
        Err(Error::UnknownTensorType {
            tensor: "t".into(),
            type_id: 4
        })
    );
    // A known type without its own variant is still sized: Q4_K, 256 per 144 bytes.
    let bytes = Builder::new()
        .tensor("k", &[256, 2], 12, vec![0; 288])
        .build();
    let f = parse(&bytes).expect("Q4_K tensor parses");
    let k = f.tensor("k").expect("k");
    assert_eq!((k.ggml_type, k.byte_len), (GgmlType::Other(12), 288));
    // Zero-sized and zero-dimensional tensors.
    let bytes = Builder::new()
        .tensor("empty", &[0, 5], 0, Vec::new())
        .tensor("scalar", &[], 0, vec![0; 4])
        .build();
    let f = parse(&bytes).expect("degenerate shapes parse");
    assert_eq!(f.tensor("empty").expect("empty").byte_len, 0);
    assert_eq!(f.tensor("scalar").expect("scalar").byte_len, 4);
}

#[test]
fn tensor_ranges_must_lie_in_the_file() {
    let bytes = Builder::new().raw_tensor("t", &[4], 0, 16).build();
    assert!(matches!(
        parse(&bytes),
        Err(Error::MisalignedTensor { offset: 16, .. })
    ));
    let bytes = Builder::new().raw_tensor("t", &[4], 0, 1 << 20).build();
    assert!(matches!(
        parse(&bytes),
        Err(Error::TensorOutOfBounds { .. })
    ));
    let bytes = Builder::new()
        .raw_tensor("t", &[4], 0, u64::MAX - 31)
        .build();
    assert!(matches!(
        parse(&bytes),
        Err(Error::TensorOutOfBounds { .. })
    ));
    // Data cut short by one byte.
    let bytes = Builder::new().tensor("t", &[4], 0, vec![0; 16]).build();
    assert!(matches!(
        parse(&bytes[..bytes.len() - 1]),
        Err(Error::TensorOutOfBounds { .. })
    ));
}

#[test]
fn typed_getters() {
    let bytes = Builder::new()
        .kv("small", Value::U8(5))
        .kv("neg", Value::I32(-1))
        .kv("big", Value::U64(1 << 40))
        .kv("f", Value::F64(0.5))
        .kv("s", Value::String("x".into()))
        .kv("b", Value::Bool(true))
        .build();
    let f = parse(&bytes).expect("getter file parses");
    assert_eq!(f.get_u32("small"), Ok(5));
    assert_eq!(f.get_u64("big"), Ok(1 << 40));
    assert_eq!(f.get_i32("neg"), Ok(-1));
    assert_eq!(f.get_f32("f"), Ok(0.5));
    assert_eq!(f.get_str("s"), Ok("x"));
    assert_eq!(f.get_bool("b"), Ok(true));
    assert_eq!(
        f.get_u32("missing"),
        Err(Error::MissingKey {
            key: "missing".into()
        })
    );
    match f.get_u32("neg") {
        Err(Error::WrongType { key, found, .. }) => {
            assert_eq!(key, "neg");
            assert!(found.contains("out of range"), "{found}");
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    assert!(matches!(f.get_u32("big"), Err(Error::WrongType { .. })));
    let err = f.get_str("small").expect_err("u8 is not a string");
    assert_eq!(
        err,
        Error::WrongType {
            key: "small".into(),
            expected: "string",
            found: "u8".into()
        }
    );
    assert!(err.to_string().contains("\"small\""), "{err}");
    assert_eq!(f.get_bool_or("missing", true), Ok(true));
    assert_eq!(f.get_bool_or("b", false), Ok(true));
    assert!(f.get_bool_or("s", false).is_err());
    assert_eq!(f.get_u32_or("missing", 9), Ok(9));
    assert_eq!(f.get_u32_or("small", 9), Ok(5));
    assert_eq!(f.get_f32_or("missing", 1.0), Ok(1.0));
    assert_eq!(f.get_str_or("missing", "d"), Ok("d"));
    assert!(f.get_f32("s").is_err());
    assert!(f.get_array("s").is_err());
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample_file();
    assert!(parse(&bytes).is_ok());
    for len in 0..bytes.len() {
        assert!(
            parse(&bytes[..len]).is_err(),
            "prefix of {len} of {} bytes parsed",
            bytes.len()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse(&bytes);
    }

    #[test]
    fn random_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512), version in 2u32..4) {
        // A valid magic and version so that the body is actually parsed.
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&body);
        let _ = parse(&bytes);
    }

    #[test]
    fn mutated_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = sample_file();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(f) = parse(&bytes) {
            // Whatever parsed must be sliceable.
            for t in &f.tensors {
                prop_assert!(f.tensor_bytes(&bytes, &t.name).is_ok());
            }
        }
    }

    #[test]
    fn mutated_length_fields_never_panic(
        field in 0usize..4,
        value in prop_oneof![any::<u64>(), 0u64..64, Just(u64::MAX), Just(1 << 63)],
    ) {
        // Overwrite the tensor count, kv count, first key length or first
        // value's string length with hostile values.
        let mut bytes = sample_file();
        let at = [8, 16, 24, 24 + 8 + "general.architecture".len() + 4][field];
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        let _ = parse(&bytes);
    }
}
