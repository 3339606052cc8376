//! API keys -> tenants, from a TOML keys file, and each tenant's limits.
//!
//! ```toml
//! [tenants.alice]
//! keys = ["sk-alice-1"]
//! max_concurrent = 8          # requests in flight at once (optional)
//! max_queued_tokens = 200000  # prompt + max_tokens summed over its requests in flight (optional)
//! prefix_cache = false        # never reuse cached prompt pages, nor leave any (default: true)
//! ```
//!
//! A tenant's id is derived from its name, not from its place in the file: workers keep
//! cached prompt pages under that id across router restarts, so a keys file edited between
//! runs must never hand one tenant's id (and its cached pages) to another name.
//!
//! A key is compared against every configured key in constant time, so neither the answer's
//! timing nor its content says which tenant (or how much of a key) matched. Keys are never
//! logged or echoed. Tenant identity comes from the key alone.

use kv::TenantId;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Who may call, and how much.
pub struct Tenants {
    tenants: Vec<Arc<Tenant>>,
    /// Keys, each with the index of its tenant.
    keys: Vec<(Vec<u8>, usize)>,
    /// No keys file: every request runs as the one "default" tenant.
    open: bool,
}

pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    /// Whether this tenant's requests may reuse (and leave) cached prompt pages.
    pub prefix_cache: bool,
    pub max_concurrent: Option<usize>,
    pub max_queued_tokens: Option<usize>,
    concurrent: AtomicUsize,
    queued_tokens: AtomicUsize,
}

#[derive(Debug, thiserror::Error)]
pub enum KeysFileError {
    #[error("cannot read keys file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("keys file {path} is not valid: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    tenants: BTreeMap<String, TenantEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    keys: Vec<String>,
    max_concurrent: Option<usize>,
    max_queued_tokens: Option<usize>,
    prefix_cache: Option<bool>,
}

/// Why a tenant may not start another request now.
#[derive(Debug, PartialEq, Eq)]
pub enum LimitExceeded {
    Concurrent { limit: usize },
    QueuedTokens { limit: usize, asked: usize },
}

/// A tenant's share of the limits, held while a request is in flight.
pub struct TenantPermit {
    tenant: Arc<Tenant>,
    tokens: usize,
}

impl Drop for TenantPermit {
    fn drop(&mut self) {
        self.tenant.concurrent.fetch_sub(1, Ordering::AcqRel);
        self.tenant
            .queued_tokens
            .fetch_sub(self.tokens, Ordering::AcqRel);
    }
}

impl TenantPermit {
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }
}

impl Tenants {
    /// Single-tenant mode: no keys, everyone is "default".
    pub fn open() -> Tenants {
        Tenants {
            tenants: vec![Arc::new(Tenant::new(
                TenantId(0),
                "default".into(),
                None,
                None,
                true,
            ))],
            keys: Vec::new(),
            open: true,
        }
    }

    pub fn from_file(path: &Path) -> Result<Tenants, KeysFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Tenants::from_toml(&text).map_err(|message| KeysFileError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    pub fn from_toml(text: &str) -> Result<Tenants, String> {
        let file: KeysFile = toml::from_str(text).map_err(|e| e.message().to_string())?;
        if file.tenants.is_empty() {
            return Err("no [tenants.NAME] tables".into());
        }
        let mut tenants = Vec::new();
        let mut keys: Vec<(Vec<u8>, usize)> = Vec::new();
        for (index, (name, entry)) in file.tenants.into_iter().enumerate() {
            if entry.keys.is_empty() {
                return Err(format!("tenant '{name}' has no keys"));
            }
            for key in entry.keys {
                if key.len() < 8 {
                    return Err(format!("a key of tenant '{name}' is under 8 characters"));
                }
                if keys.iter().any(|(existing, _)| existing == key.as_bytes()) {
                    return Err(format!("a key of tenant '{name}' is also another key"));
                }
                keys.push((key.into_bytes(), index));
            }
            let id = tenant_id(&name);
            if tenants.iter().any(|tenant: &Arc<Tenant>| tenant.id == id) {
                return Err(format!(
                    "tenant '{name}' hashes to another tenant's id; rename it"
                ));
            }
            tenants.push(Arc::new(Tenant::new(
                id,
                name,
                entry.max_concurrent,
                entry.max_queued_tokens,
                entry.prefix_cache.unwrap_or(true),
            )));
        }
        Ok(Tenants {
            tenants,
            keys,
            open: false,
        })
    }

    pub fn is_open(&self) -> bool {
        self.open
    }

    pub fn count(&self) -> usize {
        self.tenants.len()
    }

    /// The tenant a bearer key belongs to. Every configured key is compared, whatever
    /// matched first, in time that depends only on the lengths involved.
    pub fn authenticate(&self, key: Option<&[u8]>) -> Option<Arc<Tenant>> {
        if self.open {
            return Some(self.tenants[0].clone());
        }
        let key = key?;
        let mut found = None;
        for (candidate, index) in &self.keys {
            if constant_time_eq(candidate, key) {
                found = Some(*index);
            }
        }
        found.map(|index| self.tenants[index].clone())
    }
}

/// The id of the tenant named `name`: stable across restarts and edits of the keys file,
/// never 0 (the keyless "default" tenant's).
fn tenant_id(name: &str) -> TenantId {
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), 0x7e4a_4e77);
    TenantId(hash.max(1))
}

impl Tenant {
    fn new(
        id: TenantId,
        name: String,
        max_concurrent: Option<usize>,
        max_queued_tokens: Option<usize>,
        prefix_cache: bool,
    ) -> Tenant {
        Tenant {
            id,
            name,
            prefix_cache,
            max_concurrent,
            max_queued_tokens,
            concurrent: AtomicUsize::new(0),
            queued_tokens: AtomicUsize::new(0),
        }
    }

    /// Takes a share of the tenant's limits for a request of `tokens` (prompt + max_tokens),
    /// or says which limit it would break.
    pub fn admit(self: &Arc<Self>, tokens: usize) -> Result<TenantPermit, LimitExceeded> {
        let concurrent = self.concurrent.fetch_add(1, Ordering::AcqRel) + 1;
        let queued = self.queued_tokens.fetch_add(tokens, Ordering::AcqRel) + tokens;
        let permit = TenantPermit {
            tenant: self.clone(),
            tokens,
        };
        if let Some(limit) = self.max_concurrent {
            if concurrent > limit {
                return Err(LimitExceeded::Concurrent { limit });
            }
        }
        if let Some(limit) = self.max_queued_tokens {
            if queued > limit {
                return Err(LimitExceeded::QueuedTokens {
                    limit,
                    asked: tokens,
                });
            }
        }
        Ok(permit)
    }
}

/// Equal bytes, in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box((x ^ y) as usize);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
        [tenants.alice]
        keys = ["sk-alice-0001", "sk-alice-0002"]
        max_concurrent = 1

        [tenants.bob]
        keys = ["sk-bob-000001"]
        max_queued_tokens = 100
    "#;

    #[test]
    fn keys_map_to_their_tenant_and_nothing_else() {
        let tenants = Tenants::from_toml(FILE).unwrap();
        let name = |key: &str| {
            tenants
                .authenticate(Some(key.as_bytes()))
                .map(|t| t.name.clone())
        };
        assert_eq!(name("sk-alice-0002").as_deref(), Some("alice"));
        assert_eq!(name("sk-bob-000001").as_deref(), Some("bob"));
        assert_eq!(name("sk-bob-00000"), None);
        assert_eq!(name("sk-bob-0000011"), None);
        assert_eq!(name(""), None);
        assert!(tenants.authenticate(None).is_none());
        assert!(Tenants::open().authenticate(None).is_some());
    }

    #[test]
    fn bad_keys_files_are_refused_with_a_reason() {
        for (text, needle) in [
            ("", "tenants"),
            ("[tenants.a]\nkeys = []", "no keys"),
            ("[tenants.a]\nkeys = [\"short\"]", "under 8"),
            (
                "[tenants.a]\nkeys = [\"sk-same-key\"]\n[tenants.b]\nkeys = [\"sk-same-key\"]",
                "also another key",
            ),
            (
                "[tenants.a]\nkeys = [\"sk-aaaaaaaa\"]\nmax_concurent = 3",
                "unknown field",
            ),
        ] {
            let error = Tenants::from_toml(text).err().expect(text);
            assert!(error.contains(needle), "{text:?}: {error}");
        }
    }

    #[test]
    fn limits_hold_and_permits_give_back_their_share() {
        let tenants = Tenants::from_toml(FILE).unwrap();
        let alice = tenants.authenticate(Some(b"sk-alice-0001")).unwrap();
        let first = alice.admit(10).unwrap();
        assert_eq!(
            alice.admit(10).err(),
            Some(LimitExceeded::Concurrent { limit: 1 })
        );
        drop(first);
        assert!(alice.admit(10).is_ok());

        let bob = tenants.authenticate(Some(b"sk-bob-000001")).unwrap();
        let held = bob.admit(60).unwrap();
        assert_eq!(
            bob.admit(60).err(),
            Some(LimitExceeded::QueuedTokens {
                limit: 100,
                asked: 60
            })
        );
        drop(held);
        assert!(bob.admit(100).is_ok());
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
