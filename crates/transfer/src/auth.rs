//! Cluster authentication (I11): every link starts with a mutual HMAC-SHA256
//! challenge-response over a secret shared by the cluster's processes. The connecting side
//! proves itself first; a peer that cannot prove it holds the secret gets neither the
//! worker's proof nor its `Hello`, so it can neither submit, nor send or receive KV, nor learn
//! where pages go, nor collect proofs to guess the secret from offline.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The shared secret. Never logged (no `Debug` of its bytes).
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Shortest secret accepted, in bytes: 32 random bytes, or their base64 (44 characters),
/// leave nothing to guess.
pub const SECRET_BYTES_MIN: usize = 32;

/// Fewest distinct byte values a secret may have. Random bytes, their base64 and their hex
/// all have more (hex: up to 16); a word repeated or a run of one character has fewer.
pub const SECRET_DISTINCT_BYTES_MIN: usize = 10;

/// How to make a good secret, for every refusal.
const SECRET_HOW_TO: &str = "make one with `head -c 32 /dev/urandom | base64 > cluster.secret` \
                             and give every node the same file";

impl ClusterSecret {
    /// The secret, if it is long and varied enough that it was not typed by hand.
    pub fn new(bytes: Vec<u8>) -> Result<ClusterSecret, String> {
        if bytes.len() < SECRET_BYTES_MIN {
            return Err(format!(
                "the cluster secret is {} bytes; it must be at least {SECRET_BYTES_MIN}: \
                 {SECRET_HOW_TO}",
                bytes.len()
            ));
        }
        let mut seen = [false; 256];
        for &byte in &bytes {
            seen[usize::from(byte)] = true;
        }
        let distinct = seen.iter().filter(|&&seen| seen).count();
        if distinct < SECRET_DISTINCT_BYTES_MIN {
            return Err(format!(
                "the cluster secret has only {distinct} distinct byte values, so it is not \
                 random; {SECRET_HOW_TO}"
            ));
        }
        Ok(ClusterSecret(bytes))
    }

    /// A fresh random secret, for a cluster that lives in one process (`airlock serve`).
    pub fn random() -> ClusterSecret {
        ClusterSecret(nonce().to_vec())
    }

    /// The proof that one side (`label`) of the handshake of `client_nonce`/`server_nonce`
    /// holds the secret.
    pub fn proof(
        &self,
        label: &[u8],
        client_nonce: &[u8; 32],
        server_nonce: &[u8; 32],
    ) -> [u8; 32] {
        let mut mac = self.mac();
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.finalize().into_bytes().into()
    }

    /// Checks a proof in constant time.
    pub fn verify(
        &self,
        label: &[u8],
        client_nonce: &[u8; 32],
        server_nonce: &[u8; 32],
        proof: &[u8; 32],
    ) -> bool {
        let mut mac = self.mac();
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.verify_slice(proof).is_ok()
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

/// 32 bytes from the operating system's random source.
pub fn nonce() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).expect("the OS random source is available");
    bytes
}

pub(crate) const CLIENT_LABEL: &[u8] = b"airlock-v1 client";
pub(crate) const SERVER_LABEL: &[u8] = b"airlock-v1 server";
