//! `--config FILE`: a TOML file whose every key is also a flag (`kv_tokens` is
//! `--kv-tokens`) and an environment variable (`AIRLOCK_KV_TOKENS`).
//!
//! Precedence, highest first: command-line flag, environment variable, config file, default.
//! The file is applied by turning its keys into flags placed before the user's own, so clap
//! checks their values exactly as it checks typed flags; a key whose flag or environment
//! variable is set is skipped.

use anyhow::{bail, Context, Result};
use std::ffi::OsString;

/// Returns `args` with the config file's settings spliced in after the subcommand.
pub fn apply(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(path) = config_path(&args) else {
        return Ok(args);
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading config file {path}"))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing config file {path}"))?;
    let mut injected = Vec::new();
    for (key, value) in &table {
        if key == "config" {
            bail!("config file {path}: 'config' cannot name another file");
        }
        let flag = format!("--{}", key.replace('_', "-"));
        let env = format!("AIRLOCK_{}", key.to_uppercase().replace('-', "_"));
        let given = args.iter().any(|arg| {
            let arg = arg.to_string_lossy();
            arg == flag || arg.starts_with(&format!("{flag}="))
        });
        if given || std::env::var_os(&env).is_some() {
            continue;
        }
        let values = match value {
            toml::Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for value in values {
            match value {
                toml::Value::Boolean(true) => injected.push(OsString::from(&flag)),
                toml::Value::Boolean(false) => {}
                toml::Value::String(text) => injected.push(format!("{flag}={text}").into()),
                toml::Value::Integer(n) => injected.push(format!("{flag}={n}").into()),
                toml::Value::Float(x) => injected.push(format!("{flag}={x}").into()),
                _ => bail!("config file {path}: key '{key}' must be a string, number or boolean"),
            }
        }
    }
    // argv[0], the subcommand, then the file's flags, then the user's.
    let mut spliced: Vec<OsString> = args.iter().take(2).cloned().collect();
    spliced.extend(injected);
    spliced.extend(args.into_iter().skip(2));
    Ok(spliced)
}

fn config_path(args: &[OsString]) -> Option<String> {
    let mut iter = args.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = iter.next() {
        if arg == "--config" {
            return iter.next();
        }
        if let Some(path) = arg.strip_prefix("--config=") {
            return Some(path.to_string());
        }
    }
    std::env::var("AIRLOCK_CONFIG").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn file_keys_become_flags_that_typed_flags_override() {
        let dir = std::env::temp_dir().join(format!("airlock-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("airlock.toml");
        std::fs::write(
            &path,
            "kv_tokens = 4096\nscrub_on_free = true\nprefill = [\"a:1\", \"b:2\"]\nport = 1\n",
        )
        .unwrap();
        let path = path.display().to_string();
        let args = apply(os(&["airlock", "router", "--config", &path, "--port", "9"])).unwrap();
        let args: Vec<String> = args.iter().map(|a| a.to_string_lossy().into()).collect();
        assert_eq!(
            args,
            [
                "airlock",
                "router",
                "--kv-tokens=4096",
                "--prefill=a:1",
                "--prefill=b:2",
                "--scrub-on-free",
                "--config",
                &path,
                "--port",
                "9"
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
