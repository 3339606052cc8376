//! The `airlock` binary as a user runs it.

use std::path::Path;
use std::process::Command;

/// The server executable, as `cargo test` built it: with fault injection compiled into the
/// workers it links, at the path (`target/<profile>/airlock`) users run.
pub fn airlock() -> Command {
    Command::new(env!("CARGO_BIN_EXE_airlock"))
}

/// The test-only executable whose workers obey `AIRLOCK_FAULTS`.
pub fn airlock_fault_injection() -> Command {
    Command::new(env!("CARGO_BIN_EXE_airlock-fault-injection"))
}

pub fn model_path() -> String {
    let default =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let path = std::env::var("AIRLOCK_MODEL").unwrap_or_else(|_| default.display().to_string());
    assert!(
        Path::new(&path).is_file(),
        "model missing at {path}: run scripts/fetch-model.sh"
    );
    path
}

#[test]
fn missing_model_fails_with_the_fetch_command() {
    let output = airlock()
        .args([
            "generate",
            "--prompt",
            "hi",
            "--model",
            "/nonexistent/model.gguf",
        ])
        .env_remove("AIRLOCK_MODEL")
        .output()
        .expect("the binary runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("scripts/fetch-model.sh"),
        "stderr: {stderr}"
    );
    assert!(
        stderr.contains("/nonexistent/model.gguf"),
        "stderr: {stderr}"
    );
}

/// Runs `generate` on a copy of the model with `damage` done to its bytes, asserts it exits
/// with an error (1, not a panic's 101), and returns its stderr.
fn generate_on_damaged_model(name: &str, damage: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut bytes = std::fs::read(model_path()).expect("model readable");
    damage(&mut bytes);
    let dir = crate::harness::scratch().join(format!("airlock-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let damaged = dir.join(format!("{name}.gguf"));
    std::fs::write(&damaged, &bytes).expect("write temp model");
    let output = airlock()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&damaged)
        .output()
        .expect("the binary runs");
    std::fs::remove_dir_all(&dir).ok();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(1),
        "an error exit, not a panic: {stderr}"
    );
    stderr
}

/// Where a header entry `prefix` followed by `value` starts its value.
fn header_value_at(bytes: &[u8], prefix: &[u8], value: &[u8]) -> usize {
    bytes
        .windows(prefix.len() + value.len())
        .position(|w| &w[..prefix.len()] == prefix && &w[prefix.len()..] == value)
        .expect("the entry is in the header")
        + prefix.len()
}

/// A GGUF string: its u64 length, then its bytes.
fn gguf_string(text: &[u8]) -> Vec<u8> {
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text);
    bytes
}

#[test]
fn truncated_model_file_is_refused_with_an_error_not_a_panic() {
    let stderr = generate_on_damaged_model("truncated", |bytes| bytes.truncate(bytes.len() / 3));
    assert!(
        stderr.contains("truncated.gguf"),
        "stderr names the file: {stderr}"
    );
}

/// A tensor of a type Airlock does not load is refused by name, with the list of what it loads:
/// `output_norm.weight`'s type id changed from F32 to I32 (same size, so the file still parses).
#[test]
fn a_tensor_type_airlock_does_not_load_is_named_in_a_clear_error() {
    let stderr = generate_on_damaged_model("i32-norm", |bytes| {
        // Tensor info: name, u32 dimension count (1), u64 dimension (576), u32 type id (F32).
        let mut prefix = gguf_string(b"output_norm.weight");
        prefix.extend_from_slice(&1u32.to_le_bytes());
        prefix.extend_from_slice(&576u64.to_le_bytes());
        let at = header_value_at(bytes, &prefix, &0u32.to_le_bytes());
        bytes[at..at + 4].copy_from_slice(&26u32.to_le_bytes());
    });
    for needed in ["output_norm.weight is I32", "Q4_K", "Q6_K", "BF16"] {
        assert!(stderr.contains(needed), "stderr says {needed:?}: {stderr}");
    }
}

/// A model of an architecture Airlock does not run is refused by name, with what it runs:
/// `general.architecture` changed from `llama` to `mamba` (same length, so the file parses).
#[test]
fn an_architecture_airlock_does_not_run_is_named_in_a_clear_error() {
    let stderr = generate_on_damaged_model("mamba", |bytes| {
        // Key, u32 value type 8 (string), then the value as a GGUF string.
        let mut prefix = gguf_string(b"general.architecture");
        prefix.extend_from_slice(&8u32.to_le_bytes());
        prefix.extend_from_slice(&5u64.to_le_bytes());
        let at = header_value_at(bytes, &prefix, b"llama");
        bytes[at..at + 5].copy_from_slice(b"mamba");
    });
    for needed in ["\"mamba\"", "Airlock loads llama, qwen2, qwen3"] {
        assert!(stderr.contains(needed), "stderr says {needed:?}: {stderr}");
    }
}

#[test]
fn generate_streams_greedy_text_and_reports_speed() {
    let output = airlock()
        .args([
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
        ])
        .args(["--threads", "1", "--model", &model_path()])
        .output()
        .expect("the binary runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    // llama.cpp's greedy continuation starts " Paris." (tests/data/reference.json).
    assert!(stdout.starts_with(" Paris."), "stdout: {stdout:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("tok/s"), "stderr: {stderr}");
    assert!(stderr.contains("generated: 4 tokens"), "stderr: {stderr}");
}

#[test]
fn context_overflow_is_a_clear_error() {
    let output = airlock()
        .args([
            "generate",
            "--prompt",
            "hello",
            "--max-tokens",
            "9000",
            "--model",
            &model_path(),
        ])
        .output()
        .expect("the binary runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("exceeds the context length 8192"),
        "stderr: {stderr}"
    );
}

#[test]
fn every_serving_role_explains_its_flags_and_defaults() {
    for role in ["serve", "router", "prefill", "decode", "unified"] {
        let output = airlock().args([role, "--help"]).output().expect("runs");
        assert!(output.status.success(), "{role} --help");
        let help = String::from_utf8_lossy(&output.stdout);
        for flag in [
            "--host",
            "--port",
            "--model",
            "--api-keys",
            "--kv-tokens",
            "--context-length",
            "--page-size",
            "--threads",
            "--config",
            "AIRLOCK_KV_TOKENS",
            "[default: 16]",
        ] {
            assert!(help.contains(flag), "{role} --help lacks {flag}:\n{help}");
        }
    }
}

#[test]
fn a_config_file_with_a_bad_value_is_refused_naming_the_flag() {
    let dir = crate::harness::scratch().join(format!("airlock-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("airlock.toml");
    std::fs::write(&path, "page_size = 0\n").expect("write");
    let output = airlock()
        .args(["serve", "--config", &path.display().to_string()])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--page-size"), "{stderr}");
}

#[test]
fn a_short_or_hand_typed_cluster_secret_is_refused_at_start_saying_how_to_make_one() {
    let dir = crate::harness::scratch().join(format!("airlock-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (name, secret, why) in [
        ("short", "0123456789abcdef", "at least 32"),
        ("typed", "passwordpasswordpasswordpassword", "not random"),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, secret).expect("write secret");
        for role in ["decode", "prefill", "router"] {
            let mut command = airlock();
            command.args([role, "--cluster-secret-file"]).arg(&path);
            if role == "router" {
                command.args(["--unified", "127.0.0.1:1"]);
            }
            let output = command.output().expect("the binary runs");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(1), "{role} {name}: {stderr}");
            assert!(stderr.contains(why), "{role} {name}: {stderr}");
            assert!(
                stderr.contains("head -c 32 /dev/urandom | base64"),
                "{role} {name}: {stderr}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn without_keys_the_server_refuses_to_listen_beyond_loopback_unless_told() {
    for command in ["serve", "unified"] {
        let output = airlock()
            .args([command, "--host", "0.0.0.0", "--port", "0"])
            .env_remove("AIRLOCK_API_KEYS")
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command}: {stderr}");
        assert!(stderr.contains("--api-keys"), "{command}: {stderr}");
        assert!(
            stderr.contains("--allow-unauthenticated-remote"),
            "{command}: {stderr}"
        );
    }
}

/// `cargo test` builds the workers with fault injection, and its `airlock` lands where users
/// run it: that executable still refuses every fault plan, for every serving role, before it
/// loads anything; only `airlock-fault-injection` reads one.
#[test]
fn the_server_executable_refuses_airlock_faults_whatever_it_was_built_with() {
    let path = std::path::PathBuf::from(env!("CARGO_BIN_EXE_airlock"));
    assert_eq!(path.file_name().and_then(|n| n.to_str()), Some("airlock"));
    for faults in [
        "drop-page",
        "no-owner-check",
        "decode:no-transfer-verify",
        "no-admission",
    ] {
        for role in ["serve", "unified", "prefill", "decode"] {
            let output = airlock()
                .args([role, "--port", "0"])
                .env("AIRLOCK_FAULTS", faults)
                .output()
                .expect("the binary runs");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(1), "{role} {faults}: {stderr}");
            assert!(stderr.contains("never injects faults"), "{stderr}");
            assert!(stderr.contains(faults), "{stderr}");
        }
    }
    // The test executable says what it is, and does read the plan: a misspelt fault is an
    // error naming it.
    let secret = crate::harness::scratch().join(format!("airlock-faults-{}", std::process::id()));
    std::fs::write(&secret, "fault-test-secret-0123456789abcdef").expect("secret file");
    let output = airlock_fault_injection()
        .args([
            "decode",
            "--port",
            "0",
            "--threads",
            "1",
            "--model",
            &model_path(),
        ])
        .arg("--cluster-secret-file")
        .arg(&secret)
        .env("AIRLOCK_FAULTS", "no-such-fault")
        .output()
        .expect("the binary runs");
    std::fs::remove_file(&secret).ok();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("TEST executable"), "{stderr}");
    assert!(stderr.contains("no-such-fault"), "{stderr}");
}

/// Every option of every subcommand can also be set from the environment, and `--help` names
/// the variable.
#[test]
fn every_flag_of_every_subcommand_has_its_environment_variable() {
    let subcommands = [
        "serve",
        "router",
        "prefill",
        "decode",
        "unified",
        "bench",
        "canary",
        "preflight",
        "generate",
        "bench-model",
    ];
    for subcommand in subcommands {
        let output = airlock()
            .args([subcommand, "--help"])
            .output()
            .expect("runs");
        assert!(output.status.success(), "{subcommand} --help");
        let help = String::from_utf8_lossy(&output.stdout);
        let mut blocks: Vec<String> = Vec::new();
        for line in help.lines() {
            // Options sit at most 6 columns in; descriptions (long help) further in.
            let trimmed = line.trim_start();
            let indent = line.len() - trimmed.len();
            let starts_option = indent <= 6 && trimmed.starts_with('-');
            if starts_option {
                blocks.push(String::new());
            }
            if let Some(block) = blocks.last_mut() {
                block.push_str(line);
                block.push('\n');
            }
        }
        assert!(blocks.len() > 2, "{subcommand} has options:\n{help}");
        for block in blocks {
            let flag = block.split_whitespace().find(|w| w.starts_with("--"));
            if matches!(flag, Some("--help") | Some("--version")) {
                continue;
            }
            assert!(
                block.contains("[env: AIRLOCK_"),
                "{subcommand} {flag:?} has no environment variable:\n{block}"
            );
        }
    }
}
