use super::*;
use axum::routing::get;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::oneshot;

fn config(connections_max: usize) -> EdgeConfig {
    EdgeConfig {
        header_timeout: Duration::from_secs(30),
        keep_alive_timeout: Duration::from_secs(30),
        connections_max,
        connections_per_client_max: 16,
        shutdown_grace: Duration::from_secs(1),
    }
}

/// An app whose `/slow` streams one chunk, then waits for `release` before its last one.
fn slow_app(release: oneshot::Receiver<()>) -> axum::Router {
    let release = Arc::new(Mutex::new(Some(release)));
    axum::Router::new()
        .route("/fast", get(|| async { "fast" }))
        .route(
            "/slow",
            get(move || {
                let release = release.lock().unwrap().take().expect("called once");
                async move {
                    let first = futures_util::stream::once(async {
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from("first "))
                    });
                    let last = futures_util::stream::once(async move {
                        let _ = release.await;
                        Ok(axum::body::Bytes::from("last"))
                    });
                    Body::from_stream(futures_util::StreamExt::chain(first, last))
                }
            }),
        )
}

async fn start(app: axum::Router, config: EdgeConfig) -> (SocketAddr, Arc<Metrics>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let metrics = Arc::new(Metrics::new());
    let served = metrics.clone();
    tokio::spawn(serve(listener, app, config, served, std::future::pending()));
    (address, metrics)
}

async fn get_request(stream: &mut TcpStream, path: &str) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
}

/// Reads until `needle` has arrived (or the connection closed), and returns all of it.
async fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 1024];
    let read = async {
        while !String::from_utf8_lossy(&received).contains(needle) {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("an answer in time");
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn a_connection_streaming_an_answer_is_never_evicted_but_an_idle_one_is() {
    let (release, released) = oneshot::channel();
    let (address, metrics) = start(slow_app(released), config(1)).await;

    let mut streaming = TcpStream::connect(address).await.unwrap();
    get_request(&mut streaming, "/slow").await;
    assert!(read_until(&mut streaming, "first").await.contains("first"));

    // The only slot holds a request in progress: a newcomer gets 503, the stream goes on.
    let mut newcomer = TcpStream::connect(address).await.unwrap();
    let refused = read_until(&mut newcomer, "\"code\"").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    release.send(()).unwrap();
    assert!(read_until(&mut streaming, "last").await.contains("last"));

    // Done streaming, the connection is idle (kept alive): the next newcomer takes its slot.
    let mut next = TcpStream::connect(address).await.unwrap();
    get_request(&mut next, "/fast").await;
    let answer = read_until(&mut next, "fast").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), streaming.read_to_end(&mut rest));
    assert!(
        closed.await.is_ok(),
        "the idle connection was closed for the newcomer"
    );
    let page = metrics.render(&[], Default::default());
    assert!(page.contains("airlock_http_connections_closed_total{reason=\"evicted\"} 1"));
    assert!(page.contains("airlock_http_connections_refused_total{reason=\"full\"} 1"));
}

#[tokio::test]
async fn one_address_past_its_share_is_answered_429_and_others_still_get_in() {
    let (_release, released) = oneshot::channel();
    let mut config = config(8);
    config.connections_per_client_max = 2;
    let (address, metrics) = start(slow_app(released), config).await;
    let _held = [
        TcpStream::connect(address).await.unwrap(),
        TcpStream::connect(address).await.unwrap(),
    ];
    let mut third = TcpStream::connect(address).await.unwrap();
    let refused = read_until(&mut third, "\"code\"").await;
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    assert!(refused.contains("retry-after: 1"), "{refused}");

    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = socket.connect(address).await.unwrap();
    get_request(&mut other, "/fast").await;
    assert!(read_until(&mut other, "fast")
        .await
        .starts_with("HTTP/1.1 200"));
    let page = metrics.render(&[], Default::default());
    assert!(page.contains("airlock_http_connections_refused_total{reason=\"per_client\"} 1"));
    assert!(page.contains("airlock_http_connections_open 3"), "{page}");
}

#[test]
fn the_connection_cap_follows_the_open_file_limit_within_bounds() {
    assert_eq!(connections_max_for(1024), 1024 - FDS_RESERVED as usize);
    assert_eq!(connections_max_for(100), 16);
    assert_eq!(
        connections_max_for(1 << 20),
        CONNECTIONS_MAX_DEFAULT_CAP as usize
    );
}

#[test]
fn the_open_file_soft_limit_is_raised_to_the_hard_limit() {
    let soft = raise_open_file_limit().expect("getrlimit works");
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    assert_eq!(soft, limit.rlim_cur);
    assert_eq!(limit.rlim_cur, limit.rlim_max, "soft raised to hard");
}
