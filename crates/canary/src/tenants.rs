//! The tenants the auditor plays, from the key options or generated for a spawned server.

use crate::plan::code;
use crate::random_seed;
use crate::Args;
use crate::DEFAULT_TENANTS;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use stats::SplitMix64;
use std::path::Path;
use std::path::PathBuf;

/// One tenant as the auditor plays it: its key (if any) and the `user` it sends.
#[derive(Clone, Debug)]
pub(crate) struct Tenant {
    pub(crate) name: String,
    pub(crate) key: Option<String>,
}

/// The tenants from the key options, or generated ones (for --spawn: fresh random keys).
pub(crate) fn tenants(args: &Args) -> Result<Vec<Tenant>> {
    let tenants = if !args.keys.is_empty() {
        let keys: Vec<&String> = args.keys.iter().filter(|k| !k.is_empty()).collect();
        keys.iter()
            .enumerate()
            .map(|(i, key)| Tenant {
                name: format!("key{i}"),
                key: Some(key.to_string()),
            })
            .take(args.tenants.unwrap_or(usize::MAX))
            .collect()
    } else if let Some(path) = &args.keys_file {
        let mut tenants = keys_file(path)?;
        tenants.truncate(args.tenants.unwrap_or(usize::MAX));
        tenants
    } else {
        let count = args.tenants.unwrap_or(DEFAULT_TENANTS);
        let generated = args.spawn.is_some() && args.single_key.is_none();
        let salt = random_seed();
        (0..count)
            .map(|i| Tenant {
                name: format!("canary-{i}"),
                key: if generated {
                    Some(generated_key(salt, i))
                } else {
                    args.single_key.clone()
                },
            })
            .collect()
    };
    if tenants.len() < 2 {
        bail!(
            "a leak audit needs at least 2 tenants (got {}): give more --keys, or --tenants",
            tenants.len()
        );
    }
    Ok(tenants)
}

/// A key for a spawned server's generated keys file.
pub(crate) fn generated_key(salt: u64, tenant: usize) -> String {
    let mut rng = SplitMix64::new(salt ^ (tenant as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
    format!("sk-canary-{tenant}-{}", code(&mut rng, 24))
}

/// The first key of each `[tenants.NAME]` of an `airlock serve --api-keys` file.
pub(crate) fn keys_file(path: &Path) -> Result<Vec<Tenant>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading keys file {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing keys file {}", path.display()))?;
    let Some(toml::Value::Table(entries)) = table.get("tenants") else {
        bail!("keys file {} has no [tenants.NAME] tables", path.display());
    };
    entries
        .iter()
        .map(|(name, entry)| {
            let key = entry
                .get("keys")
                .and_then(|keys| keys.as_array())
                .and_then(|keys| keys.first())
                .and_then(|key| key.as_str())
                .with_context(|| format!("tenant '{name}' in {} has no keys", path.display()))?;
            Ok(Tenant {
                name: name.clone(),
                key: Some(key.to_string()),
            })
        })
        .collect()
}

/// A keys file with one tenant per distinct key (tenants sharing one key are one tenant to
/// the server).
pub(crate) fn write_keys_file(dir: &Path, tenants: &[Tenant]) -> Result<PathBuf> {
    let mut keys: Vec<&str> = Vec::new();
    for key in tenants.iter().filter_map(|t| t.key.as_deref()) {
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    if keys.is_empty() {
        bail!("no keys for the spawned server");
    }
    let mut text = String::new();
    for (i, key) in keys.iter().enumerate() {
        let key = toml::Value::String(key.to_string());
        text.push_str(&format!("[tenants.canary-{i}]\nkeys = [{key}]\n\n"));
    }
    let path = dir.join("keys.toml");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
