//! Workers found in DNS: an address `dns:NAME:PORT` stands for every address NAME resolves
//! to, looked up again every interval, so a Kubernetes headless Service (one record per
//! ready pod) gives the router its worker set as pods come and go. Each address found is
//! linked like one named by a flag: same handshake, same cluster authentication.

use crate::cluster::Members;
use futures_util::future::BoxFuture;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;
use transfer::Role;

/// The prefix of an address that names a DNS name to look up.
pub const DNS_PREFIX: &str = "dns:";

/// Looks a `NAME:PORT` up: every socket address it stands for.
pub trait Resolve: Send + Sync {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, io::Result<Vec<SocketAddr>>>;
}

/// The system's resolver (`getaddrinfo`, through tokio).
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, io::Result<Vec<SocketAddr>>> {
        Box::pin(async move { Ok(tokio::net::lookup_host(name).await?.collect()) })
    }
}

/// How `dns:` addresses are looked up.
#[derive(Clone)]
pub struct Dns {
    pub resolver: Arc<dyn Resolve>,
    pub interval: Duration,
}

/// The `NAME:PORT` of a `dns:` address, or `None` for a plain one.
pub fn dns_name(addr: &str) -> Option<&str> {
    addr.strip_prefix(DNS_PREFIX)
}

/// Checks a worker address as given on the command line: a plain one is left to the link
/// (it is resolved at every connect), a `dns:` one must be `dns:NAME:PORT`.
pub fn check_address(addr: &str) -> Result<(), String> {
    let Some(name) = dns_name(addr) else {
        return Ok(());
    };
    match name.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(format!(
            "{addr}: a DNS address is dns:NAME:PORT (for example \
             dns:airlock-decode.default.svc:9002)"
        )),
    }
}

/// Looks `name` up every `dns.interval` until the cluster is gone, handing what it finds to
/// the cluster's members. A failed lookup keeps the last set (a DNS outage must not empty
/// the router); a lookup that succeeds with no address empties it.
pub(crate) async fn discover(name: String, role: Role, dns: Dns, members: Weak<Members>) {
    let mut failing = false;
    loop {
        let found = dns.resolver.resolve(&name).await;
        let Some(members) = members.upgrade() else {
            return;
        };
        match found {
            Ok(addresses) => {
                failing = false;
                let mut addresses: Vec<String> =
                    addresses.iter().map(SocketAddr::to_string).collect();
                addresses.sort();
                addresses.dedup();
                members.found(&name, role, &addresses);
            }
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(dns = %name, %error, "DNS lookup failed; keeping the workers found before");
            }
            Err(_) => {}
        }
        drop(members);
        tokio::time::sleep(dns.interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Cluster;
    use crate::metrics::Metrics;
    use std::sync::Mutex;
    use transfer::{ClusterSecret, Expectation};

    /// A resolver whose answer the test sets.
    struct Fake(Mutex<io::Result<Vec<SocketAddr>>>);

    impl Fake {
        fn set(&self, answer: io::Result<Vec<&str>>) {
            *self.0.lock().unwrap() =
                answer.map(|list| list.iter().map(|a| a.parse().unwrap()).collect());
        }
    }

    impl Resolve for Fake {
        fn resolve<'a>(&'a self, _: &'a str) -> BoxFuture<'a, io::Result<Vec<SocketAddr>>> {
            let answer = match &*self.0.lock().unwrap() {
                Ok(list) => Ok(list.clone()),
                Err(error) => Err(io::Error::new(error.kind(), error.to_string())),
            };
            Box::pin(async move { answer })
        }
    }

    /// Waits (bounded) until the cluster's worker addresses are `expected`, sorted.
    async fn wait_for(cluster: &Cluster, expected: &[&str]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let mut addresses: Vec<String> =
                cluster.clients().iter().map(|c| c.addr.clone()).collect();
            addresses.sort();
            if addresses == expected {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "workers {addresses:?}, expected {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The worker set follows the name's records: new ones are linked, gone ones leave, a
    /// failed lookup keeps what was found, and flag-named workers stay whatever DNS says.
    #[tokio::test]
    async fn the_worker_set_follows_dns() {
        let fake = Arc::new(Fake(Mutex::new(Ok(Vec::new()))));
        fake.set(Ok(vec!["10.0.0.1:9002", "10.0.0.2:9002"]));
        let expect = Expectation {
            model_id: "m".into(),
            weights_hash: 0,
            kv_dtype: "f16".into(),
            page_size_tokens: 16,
            layer_count: 1,
            kv_head_count: 1,
            head_dim: 1,
            context_length: None,
        };
        let workers = vec![
            ("dns:decode.svc:9002".to_string(), Role::Decode),
            ("prefill-0:9001".to_string(), Role::Prefill),
        ];
        let dns = Dns {
            resolver: fake.clone(),
            interval: Duration::from_millis(10),
        };
        // Nothing answers on these addresses: the links stay down, which is all this needs.
        let transport = Arc::new(transfer::transport::InProcess::default());
        let cluster = Cluster::connect_with_dns(
            workers,
            expect,
            ClusterSecret::random(),
            transport,
            Arc::new(Metrics::new()),
            dns,
        );
        assert!(cluster.has_role(Role::Decode) && cluster.has_role(Role::Prefill));
        wait_for(
            &cluster,
            &["10.0.0.1:9002", "10.0.0.2:9002", "prefill-0:9001"],
        )
        .await;
        fake.set(Ok(vec!["10.0.0.2:9002", "10.0.0.3:9002"]));
        wait_for(
            &cluster,
            &["10.0.0.2:9002", "10.0.0.3:9002", "prefill-0:9001"],
        )
        .await;
        fake.set(Err(io::Error::other("no server")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        wait_for(
            &cluster,
            &["10.0.0.2:9002", "10.0.0.3:9002", "prefill-0:9001"],
        )
        .await;
        fake.set(Ok(Vec::new()));
        wait_for(&cluster, &["prefill-0:9001"]).await;
    }

    #[test]
    fn dns_addresses_need_a_name_and_a_port() {
        assert!(check_address("10.0.0.1:9002").is_ok());
        assert!(check_address("dns:airlock-decode:9002").is_ok());
        for bad in ["dns:airlock-decode", "dns::9002", "dns:decode:port"] {
            let error = check_address(bad).unwrap_err();
            assert!(error.contains("dns:NAME:PORT"), "{error}");
        }
    }
}
