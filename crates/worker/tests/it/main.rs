//! A real decode worker driven by hand over TCP: the test plays the router on one link and
//! a (misbehaving) prefill worker on another, and checks that every malformed transfer is
//! refused before decode reads a byte of it (I4), with the pages given back (I9).

use gguf::Tokenizer;
use kv::{PagePool, PoolConfig, PoolSize, RequestId, TenantId};
use model::{LoadOptions, Model};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use transfer::transport::{spawn_link, Link, Tcp, Transport};
use transfer::{
    connect_handshake, transfer_checksum, ClusterSecret, Expectation, Failure, Frame, PeerRole,
    Plan, Reject, Role, Sampling, Submit, TransferDone, TransferId,
};
use worker::{start_worker, Listener, Worker, WorkerConfig};

const PAGE_SIZE: usize = 16;

fn model_path() -> String {
    let default =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    std::env::var("AIRLOCK_MODEL").unwrap_or_else(|_| default.display().to_string())
}

fn load() -> (Model, Tokenizer) {
    let options = LoadOptions {
        threads: 1,
        backend: None,
    };
    let loaded = Model::load(model_path().as_ref(), &options, &mut |_| {})
        .expect("model loads (run scripts/fetch-model.sh)");
    (loaded.model, loaded.tokenizer)
}

struct Decode {
    worker: Worker,
    address: String,
    page_bytes: usize,
    secret: ClusterSecret,
}

async fn start_decode() -> Decode {
    let (model, tokenizer) = load();
    let layout = model.config().kv_layout(PAGE_SIZE);
    let pool = PagePool::new(PoolConfig {
        layout,
        size: PoolSize::Tokens(512),
        scrub_on_free: false,
    })
    .expect("pool");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    let config = WorkerConfig {
        role: Role::Decode,
        name: "decode-test".into(),
        model_id: "m".into(),
        weights_hash: 42,
        context_length: 2048,
        queue_max: 8,
        queue_timeout: Duration::from_secs(10),
        transfer_timeout: Duration::from_secs(10),
        step_tokens: 64,
        max_batch: 8,
        faults: worker::FaultPlan::none(),
        tracer: otlp::Tracer::off(),
    };
    let secret = ClusterSecret::random();
    let worker = start_worker(
        config,
        model,
        tokenizer,
        pool,
        Listener::Tcp(listener),
        Arc::new(Tcp),
        secret.clone(),
    )
    .expect("worker starts");
    Decode {
        worker,
        address,
        page_bytes: layout.page_bytes(),
        secret,
    }
}

async fn connect(decode: &Decode, peer: PeerRole) -> Link {
    let mut stream = Tcp.connect(&decode.address).await.expect("connect");
    let expect = Expectation::of(&decode.worker.info);
    let info = connect_handshake(&mut stream, peer, &decode.secret, &expect)
        .await
        .expect("handshake");
    assert_eq!(info.role, Role::Decode);
    spawn_link(stream, "test".into())
}

async fn recv(link: &mut Link) -> Frame {
    tokio::time::timeout(Duration::from_secs(30), link.rx.recv())
        .await
        .expect("a frame in time")
        .expect("link open")
}

/// Next frame that is not a pool report; pool reports update `free`.
async fn next_event(link: &mut Link, free: &mut u32) -> Frame {
    loop {
        match recv(link).await {
            Frame::PoolStats { pages_free, .. } => *free = pages_free,
            frame => return frame,
        }
    }
}

const PROMPT: [u32; 20] = [1; 20];
const TENANT: TenantId = TenantId(7);

fn reserve(request: RequestId, transfer: TransferId) -> Frame {
    Frame::Submit(Submit {
        request,
        tenant: TENANT,
        prompt: PROMPT.to_vec(),
        max_tokens: 4,
        sampling: Sampling::greedy(),
        stop: Vec::new(),
        ignore_eos: true,
        // These tests forge the sender: no cached pages on decode, every page must come.
        prefix_cache: None,
        plan: Plan::Decode { transfer },
        trace: None,
    })
}

/// The frames of an honest transfer of the 19 tokens decode expects (two pages).
fn honest(
    request: RequestId,
    transfer: TransferId,
    page_bytes: usize,
) -> (Vec<Frame>, TransferDone) {
    let pages: Vec<Vec<u8>> = (0..2u8).map(|i| vec![i + 1; page_bytes]).collect();
    let mut done = TransferDone {
        transfer,
        request,
        tenant: TENANT,
        page_count: 2,
        token_count: PROMPT.len() as u32 - 1,
        checksum: 0,
    };
    done.checksum = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
    let frames = pages
        .into_iter()
        .enumerate()
        .map(|(index, bytes)| Frame::Page {
            transfer,
            request,
            tenant: TENANT,
            index: index as u32,
            bytes: bytes.into(),
        })
        .collect();
    (frames, done)
}

/// One bad transfer: reserve, send `frames`, expect `reject` on the peer link and a
/// `TransferFailed` to the router, then every page free again.
async fn refused(
    case: u64,
    mutate: impl FnOnce(&mut Vec<Frame>, &mut TransferDone),
    reject: Reject,
) {
    let decode = start_decode().await;
    let mut router = connect(&decode, PeerRole::Router).await;
    let mut peer = connect(&decode, PeerRole::Prefill).await;
    let request = RequestId(case);
    let transfer = TransferId(1000 + case);
    let mut free = 0;
    router.tx.send(reserve(request, transfer)).expect("send");
    assert_eq!(
        next_event(&mut router, &mut free).await,
        Frame::Admitted {
            request,
            cached_tokens: 0,
            cached_pages: 0
        }
    );
    let (mut frames, mut done) = honest(request, transfer, decode.page_bytes);
    mutate(&mut frames, &mut done);
    for frame in frames {
        peer.tx.send(frame).expect("send");
    }
    peer.tx.send(Frame::Done(done)).expect("send");
    assert_eq!(
        recv(&mut peer).await,
        Frame::Nack { transfer, reject },
        "case {case}"
    );
    match next_event(&mut router, &mut free).await {
        Frame::Failed { failure, .. } => assert_eq!(failure, Failure::TransferFailed),
        other => panic!("case {case}: expected Failed, got {other:?}"),
    }
    // The pool reports all 32 pages free again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while free != 32 {
        assert!(tokio::time::Instant::now() < deadline, "pages came back");
        if let Ok(Some(Frame::PoolStats { pages_free, .. })) =
            tokio::time::timeout(Duration::from_millis(200), router.rx.recv()).await
        {
            free = pages_free;
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn an_honest_transfer_is_sealed_and_decoded() {
    runtime().block_on(async {
        let decode = start_decode().await;
        let mut router = connect(&decode, PeerRole::Router).await;
        let mut peer = connect(&decode, PeerRole::Prefill).await;
        let (request, transfer) = (RequestId(1), TransferId(1));
        let mut free = 0;
        router.tx.send(reserve(request, transfer)).expect("send");
        assert_eq!(
            next_event(&mut router, &mut free).await,
            Frame::Admitted {
                request,
                cached_tokens: 0,
                cached_pages: 0
            }
        );
        let (frames, done) = honest(request, transfer, decode.page_bytes);
        for frame in frames.into_iter().rev() {
            // Out of order on purpose: order does not matter, completeness does.
            peer.tx.send(frame).expect("send");
        }
        peer.tx.send(Frame::Done(done)).expect("send");
        assert_eq!(recv(&mut peer).await, Frame::Ack { transfer });
        assert_eq!(
            next_event(&mut router, &mut free).await,
            Frame::Started { request }
        );
        loop {
            match next_event(&mut router, &mut free).await {
                Frame::Text { .. } => {}
                Frame::Finished {
                    completion_tokens, ..
                } => {
                    assert_eq!(completion_tokens, 4);
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    });
}

#[test]
fn a_flipped_bit_fails_the_checksum() {
    runtime().block_on(refused(
        2,
        |frames, _| {
            if let Frame::Page { bytes, .. } = &mut frames[1] {
                bytes[77] ^= 0x04;
            }
        },
        Reject::ChecksumMismatch,
    ));
}

#[test]
fn the_incidents_one_token_placeholder_is_refused() {
    runtime().block_on(refused(
        3,
        |frames, done| {
            frames.truncate(1);
            done.page_count = 1;
            done.token_count = 1;
        },
        Reject::LengthMismatch,
    ));
}

#[test]
fn a_missing_page_is_refused() {
    runtime().block_on(refused(
        4,
        |frames, _| {
            frames.remove(0);
        },
        Reject::MissingPage,
    ));
}

#[test]
fn a_page_claiming_another_tenant_is_refused() {
    runtime().block_on(refused(
        5,
        |frames, _| {
            if let Frame::Page { tenant, .. } = &mut frames[0] {
                *tenant = TenantId(8);
            }
        },
        Reject::HeaderMismatch,
    ));
}

#[test]
fn done_for_an_unknown_transfer_is_refused_and_touches_nothing() {
    runtime().block_on(async {
        let decode = start_decode().await;
        let mut peer = connect(&decode, PeerRole::Prefill).await;
        let (frames, done) = honest(RequestId(9), TransferId(9), decode.page_bytes);
        for frame in frames {
            peer.tx.send(frame).expect("send");
        }
        peer.tx.send(Frame::Done(done)).expect("send");
        assert_eq!(
            recv(&mut peer).await,
            Frame::Nack {
                transfer: TransferId(9),
                reject: Reject::UnknownTransfer
            }
        );
    });
}
