use crate::transport::{read_frame, spawn_link, InProcess, Tcp, Transport};
use crate::*;
use crate::{accept_handshake, connect_handshake, ClusterSecret, Expectation, HandshakeError};
use kv::{RequestId, TenantId};
use proptest::prelude::*;

pub(crate) fn worker_info() -> WorkerInfo {
    WorkerInfo {
        role: Role::Decode,
        name: "decode-0".into(),
        model_id: "smollm2".into(),
        weights_hash: 0x1234,
        kv_dtype: "f16".into(),
        layer_count: 30,
        kv_head_count: 3,
        head_dim: 64,
        page_size_tokens: 16,
        capacity_tokens: 8192,
        context_length: 8192,
        weight_bytes: 100,
        kv_bytes: 200,
        epoch: 5,
    }
}

fn sample_frames() -> Vec<Frame> {
    let submit = Submit {
        request: RequestId(7),
        tenant: TenantId(3),
        prompt: vec![1, 2, 3, 49151],
        max_tokens: 64,
        sampling: Sampling {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            presence_penalty: -0.5,
            frequency_penalty: 1.5,
            repetition_penalty: 1.1,
            logit_bias: vec![(2, -100.0), (49151, 3.5)],
            seed: 11,
            logprobs: Some(5),
            prompt_logprobs: true,
            constraint: Some("{\"type\":\"object\"}".into()),
        },
        stop: vec!["\n\n".into(), "é".into()],
        ignore_eos: true,
        prefix_cache: Some(kv::Partition(0xfeed)),
        plan: Plan::Prefill {
            transfer: TransferId(99),
            decode_addr: "127.0.0.1:9002".into(),
            decode_holds_pages: 3,
        },
        trace: Some(otlp::TraceContext {
            trace_id: [0xab; 16],
            span_id: [0xcd; 8],
        }),
    };
    let done = TransferDone {
        transfer: TransferId(99),
        request: RequestId(7),
        tenant: TenantId(3),
        page_count: 2,
        token_count: 20,
        checksum: 0xdead_beef,
    };
    vec![
        Frame::Connect {
            peer: PeerRole::Prefill,
            nonce: [7; 32],
        },
        Frame::Challenge { nonce: [1; 32] },
        Frame::Proof { proof: [3; 32] },
        Frame::Hello(worker_info()),
        Frame::Submit(submit.clone()),
        Frame::Submit(Submit {
            plan: Plan::Decode {
                transfer: TransferId(1),
            },
            ..submit.clone()
        }),
        Frame::Submit(Submit {
            plan: Plan::Unified,
            stop: vec![],
            prefix_cache: None,
            ..submit
        }),
        Frame::Abort {
            request: RequestId(1),
        },
        Frame::Admitted {
            request: RequestId(2),
            cached_tokens: 32,
            cached_pages: 2,
        },
        Frame::Started {
            request: RequestId(3),
        },
        Frame::Text {
            request: RequestId(4),
            text: "Paris.".into(),
            logprobs: vec![
                TokenLogprob {
                    token: 9,
                    logprob: -0.25,
                    top: vec![(9, -0.25), (12, -1.5)],
                },
                TokenLogprob {
                    token: 13,
                    logprob: -3.0,
                    top: Vec::new(),
                },
            ],
        },
        Frame::Text {
            request: RequestId(4),
            text: String::new(),
            logprobs: Vec::new(),
        },
        Frame::PromptLogprobs {
            request: RequestId(4),
            first: 1,
            logprobs: vec![TokenLogprob {
                token: 7,
                logprob: -9.5,
                top: vec![(3, -0.5)],
            }],
        },
        Frame::Finished {
            request: RequestId(5),
            finish: Finish::Length,
            prompt_tokens: 6,
            completion_tokens: 7,
        },
        Frame::Failed {
            request: RequestId(6),
            failure: Failure::TransferFailed,
            message: "checksum".into(),
        },
        Frame::PoolStats {
            pages_free: 1,
            pages_total: 2,
            pages_quarantined: 0,
            queue_depth: 3,
            ownership_failures: 4,
            frames_rejected: 5,
            auth_failures: 6,
            prefix: crate::PrefixCounters {
                lookups: 7,
                hit_pages: 8,
                hit_tokens: 9,
                evictions: 10,
                cached_pages: 11,
                prefilled_tokens: 12,
                pages_sent: 13,
                pages_not_sent: 14,
            },
            transfer: Box::new(std::array::from_fn(|t| crate::TransferCounters {
                bytes_sent: 15 + 100 * t as u64,
                bytes_received: 16,
                transfers: 17,
                micros_sum: 18,
                buckets: std::array::from_fn(|i| 19 + i as u64),
            })),
            draining: true,
        },
        Frame::Page {
            transfer: TransferId(99),
            request: RequestId(7),
            tenant: TenantId(3),
            index: 1,
            bytes: vec![1, 2, 3, 4, 5].into(),
        },
        // The sender's form: the bytes lent from its pool, written without a copy.
        Frame::Page {
            transfer: TransferId(99),
            request: RequestId(7),
            tenant: TenantId(3),
            index: 2,
            bytes: crate::PageBytes::Lent(lent_page()),
        },
        Frame::Done(done),
        Frame::TransferAbort {
            transfer: TransferId(99),
            request: RequestId(7),
        },
        Frame::Ack {
            transfer: TransferId(99),
        },
        Frame::Nack {
            transfer: TransferId(99),
            reject: Reject::ChecksumMismatch,
        },
        Frame::AbortAck {
            transfer: TransferId(99),
        },
        Frame::GrantAsk {
            transfer: TransferId(99),
            request: RequestId(7),
            tenant: TenantId(3),
        },
        Frame::WriteGrant {
            transfer: TransferId(99),
            first_index: 1,
            pool_pages: vec![5, 0, 17],
        },
        Frame::WriteAbort {
            transfer: TransferId(99),
        },
        Frame::WriteAbortAck {
            transfer: TransferId(99),
        },
        Frame::Written {
            transfer: TransferId(99),
            index: 4,
        },
    ]
}

#[test]
fn every_frame_kind_round_trips() {
    let frames = sample_frames();
    for kind in FrameKind::ALL {
        assert!(
            frames.iter().any(|frame| frame.kind() == *kind),
            "no sample frame of kind {kind:?}: add one to sample_frames"
        );
    }
    for frame in frames {
        assert_eq!(
            frame.encode()[4],
            frame.kind() as u8,
            "the kind byte follows the header"
        );
        let body = frame.encode();
        assert_eq!(
            frame.encode_prefixed()[4..],
            body[..],
            "prefixed = length + body"
        );
        assert_eq!(
            frame.encode_prefixed()[..4],
            (body.len() as u32).to_le_bytes(),
            "the prefix is the body's length"
        );
        assert_eq!(Frame::decode_owned(body.clone()), Ok(frame.clone()));
        assert_eq!(Frame::decode(&body), Ok(frame));
    }
}

#[test]
fn every_truncation_of_every_frame_is_an_error() {
    for frame in sample_frames() {
        let body = frame.encode();
        for len in 0..body.len() {
            assert!(
                Frame::decode(&body[..len]).is_err(),
                "{frame:?} cut at {len}"
            );
        }
        let mut longer = body.clone();
        longer.push(0);
        assert_eq!(
            Frame::decode(&longer),
            Err(DecodeError::TrailingBytes { extra: 1 })
        );
    }
}

#[test]
fn another_protocol_version_is_refused() {
    let mut body = Frame::Ack {
        transfer: TransferId(1),
    }
    .encode();
    let other = PROTOCOL_VERSION + 1;
    body[2..4].copy_from_slice(&other.to_le_bytes());
    assert_eq!(
        Frame::decode(&body),
        Err(DecodeError::Version { found: other })
    );
}

#[test]
fn huge_counts_are_refused_before_allocation() {
    let mut body = Frame::Submit(match &sample_frames()[4] {
        Frame::Submit(submit) => submit.clone(),
        _ => unreachable!("frame 4 is a Submit"),
    })
    .encode();
    // The prompt length sits after magic, version, kind, request and tenant.
    let at = 2 + 2 + 1 + 8 + 8;
    body[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Frame::decode(&body),
        Err(DecodeError::TooLong {
            field: "prompt",
            ..
        })
    ));
}

proptest! {
    #[test]
    fn decode_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert_eq!(
            Frame::decode_owned(bytes.clone()).map(|f| f.encode()),
            Frame::decode(&bytes).map(|f| f.encode())
        );
    }

    #[test]
    fn decode_never_panics_on_mutated_frames(
        which in 0usize..64,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let frames = sample_frames();
        let mut body = frames[which % frames.len()].encode();
        for (at, value) in flips {
            let at = at % body.len();
            body[at] = value;
        }
        // Decoding in place (pages moved within the body) reads exactly what decoding by
        // copy reads. Compared as bytes: a flipped byte can make a sampling field NaN.
        prop_assert_eq!(
            Frame::decode_owned(body.clone()).map(|f| f.encode()),
            Frame::decode(&body).map(|f| f.encode())
        );
        if let Ok(frame) = Frame::decode(&body) {
            // Whatever decodes re-encodes to the same bytes: no two readings of one frame.
            prop_assert_eq!(frame.encode(), body);
        }
    }

    #[test]
    fn text_and_prompts_round_trip(
        text in ".{0,64}",
        prompt in proptest::collection::vec(any::<u32>(), 0..64),
        seed in any::<u64>(),
    ) {
        let frame = Frame::Submit(Submit {
            request: RequestId(seed),
            tenant: TenantId(seed ^ 1),
            prompt,
            max_tokens: 3,
            sampling: Sampling { seed, ..Sampling::greedy() },
            stop: vec![text.clone()],
            ignore_eos: false,
            prefix_cache: None,
            plan: Plan::Unified,
            trace: None,
        });
        prop_assert_eq!(Frame::decode(&frame.encode()), Ok(frame));
    }
}

fn inbound() -> Inbound {
    Inbound::new(TransferId(9), RequestId(1), TenantId(2), 20, 16, 8, 0)
}

fn done_for(inbound: &Inbound, pages: &[Vec<u8>]) -> TransferDone {
    let mut done = TransferDone {
        transfer: inbound.transfer,
        request: inbound.request,
        tenant: inbound.tenant,
        page_count: inbound.page_count(),
        token_count: inbound.token_count,
        checksum: 0,
    };
    done.checksum = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
    done
}

#[test]
fn a_complete_transfer_verifies() {
    let mut inbound = inbound();
    assert_eq!(inbound.page_count(), 2);
    let pages = vec![vec![1u8; 8], vec![2u8; 8]];
    assert_eq!(inbound.accept_page(RequestId(1), TenantId(2), 1, 8), Ok(1));
    assert_eq!(inbound.accept_page(RequestId(1), TenantId(2), 0, 8), Ok(0));
    let done = done_for(&inbound, &pages);
    assert_eq!(inbound.check_done(&done), Ok(()));
    let computed = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
    assert_eq!(inbound.verify_checksum(&done, computed), Ok(()));
}

#[test]
fn foreign_and_misplaced_pages_are_refused() {
    let mut inbound = inbound();
    assert_eq!(
        inbound.accept_page(RequestId(1), TenantId(3), 0, 8),
        Err(Reject::HeaderMismatch)
    );
    assert_eq!(
        inbound.accept_page(RequestId(2), TenantId(2), 0, 8),
        Err(Reject::HeaderMismatch)
    );
    assert_eq!(
        inbound.accept_page(RequestId(1), TenantId(2), 2, 8),
        Err(Reject::BadPage)
    );
    assert_eq!(
        inbound.accept_page(RequestId(1), TenantId(2), 0, 7),
        Err(Reject::BadPage)
    );
}

#[test]
fn the_incidents_placeholder_done_is_refused() {
    // The sender claims "1 token, 1 page, complete" for a 20-token reservation.
    let mut inbound = inbound();
    inbound
        .accept_page(RequestId(1), TenantId(2), 0, 8)
        .unwrap();
    let mut done = done_for(&inbound, &[vec![0u8; 8]]);
    done.token_count = 1;
    done.page_count = 1;
    assert_eq!(inbound.check_done(&done), Err(Reject::LengthMismatch));
}

#[test]
fn done_before_every_page_is_refused() {
    let mut inbound = inbound();
    inbound
        .accept_page(RequestId(1), TenantId(2), 0, 8)
        .unwrap();
    let done = done_for(&inbound, &[vec![0u8; 8], vec![0u8; 8]]);
    assert_eq!(inbound.check_done(&done), Err(Reject::MissingPage));
}

#[test]
fn one_flipped_bit_fails_the_checksum() {
    let inbound = inbound();
    let pages = vec![vec![1u8; 8], vec![2u8; 8]];
    let done = done_for(&inbound, &pages);
    let mut flipped = pages.clone();
    flipped[1][3] ^= 0x10;
    let computed = transfer_checksum(&done, flipped.iter().map(Vec::as_slice));
    assert_eq!(
        inbound.verify_checksum(&done, computed),
        Err(Reject::ChecksumMismatch)
    );
    // Header fields are covered too.
    let mut other = done;
    other.tenant = TenantId(77);
    assert_ne!(
        transfer_checksum(&other, pages.iter().map(Vec::as_slice)),
        done.checksum
    );
}

/// A page of a real pool, filled with a pattern and lent, as a prefill worker sends it.
fn lent_page() -> kv::LentPage {
    let layout = kv::KvLayout {
        layer_count: 2,
        kv_head_count: 1,
        head_dim: 8,
        page_size_tokens: 4,
    };
    let mut pool = kv::PagePool::new(kv::PoolConfig {
        layout,
        size: kv::PoolSize::Tokens(8),
        scrub_on_free: false,
    })
    .unwrap();
    let owner = kv::Owner {
        tenant: TenantId(3),
        request: RequestId(7),
    };
    let table = pool.allocate(owner, 4).unwrap();
    for (i, value) in pool.verify_batch(&[&table]).unwrap()[0]
        .page_mut(0)
        .iter_mut()
        .enumerate()
    {
        *value = half::f16::from_f32(i as f32);
    }
    pool.lend(&table, 0..1).unwrap().pop().unwrap()
}

#[test]
fn a_split_encoding_is_the_whole_encoding_in_two_parts() {
    for frame in sample_frames() {
        let (mut head, payload) = frame.encode_prefixed_split();
        head.extend_from_slice(payload.unwrap_or_default());
        assert_eq!(head, frame.encode_prefixed(), "{frame:?}");
    }
}

async fn echo_over(transport: &dyn Transport, addr: &str) {
    let stream = transport.connect(addr).await.expect("connect");
    let mut link = spawn_link(stream, "test".into());
    for frame in sample_frames() {
        link.tx.send(frame.clone()).expect("writer alive");
        assert_eq!(link.rx.recv().await, Some(frame));
    }
}

fn serve_echo(mut stream: transport::BoxStream) {
    tokio::spawn(async move {
        let (mut reader, mut writer) = tokio::io::split(&mut stream);
        while let Ok(Some(frame)) = read_frame(&mut reader).await {
            transport::write_frame(&mut writer, &frame)
                .await
                .expect("echo");
        }
    });
}

#[tokio::test]
async fn frames_cross_tcp_and_in_process_links() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            serve_echo(Box::new(stream));
        }
    });
    echo_over(&Tcp, &addr).await;

    let in_process = InProcess::default();
    let mut incoming = in_process.bind("decode-0");
    tokio::spawn(async move {
        while let Some(stream) = incoming.recv().await {
            serve_echo(stream);
        }
    });
    echo_over(&in_process, "decode-0").await;
    assert!(in_process.connect("nobody").await.is_err());
}

#[tokio::test]
async fn an_oversized_length_prefix_closes_the_link() {
    let (mut ours, theirs) = tokio::io::duplex(64);
    let mut link = spawn_link(Box::new(theirs), "test".into());
    use tokio::io::AsyncWriteExt;
    ours.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    assert_eq!(link.rx.recv().await, None);
}

async fn handshake_pair(
    server_secret: ClusterSecret,
    client_secret: ClusterSecret,
    expect: Expectation,
) -> (
    Result<WorkerInfo, HandshakeError>,
    Result<PeerRole, HandshakeError>,
) {
    let (client, server) = tokio::io::duplex(1 << 16);
    let mut client: transport::BoxStream = Box::new(client);
    let mut server: transport::BoxStream = Box::new(server);
    let info = worker_info();
    let server_task =
        tokio::spawn(async move { accept_handshake(&mut server, &server_secret, &info).await });
    let client_result =
        connect_handshake(&mut client, PeerRole::Router, &client_secret, &expect).await;
    drop(client);
    (client_result, server_task.await.expect("server task"))
}

#[tokio::test]
async fn peers_with_the_secret_handshake_and_others_are_refused() {
    let secret = ClusterSecret::new(b"0123456789abcdef-secret-0123456789".to_vec()).unwrap();
    let expect = Expectation::of(&worker_info());
    let (client, server) = handshake_pair(secret.clone(), secret.clone(), expect.clone()).await;
    assert_eq!(client.expect("client side").name, "decode-0");
    assert_eq!(server.expect("server side"), PeerRole::Router);

    let wrong = ClusterSecret::new(b"another-secret-0123456789abcdefghij".to_vec()).unwrap();
    let (client, server) = handshake_pair(secret.clone(), wrong.clone(), expect.clone()).await;
    assert!(matches!(client, Err(HandshakeError::Auth)), "{client:?}");
    assert!(matches!(server, Err(HandshakeError::Auth)), "{server:?}");
    let (client, _) = handshake_pair(wrong, secret.clone(), expect).await;
    assert!(matches!(client, Err(HandshakeError::Auth)), "{client:?}");
}

#[test]
fn secrets_short_or_typed_by_hand_are_refused_and_random_ones_taken() {
    let check = |bytes: &[u8], accepted: bool| {
        let result = ClusterSecret::new(bytes.to_vec());
        assert_eq!(
            result.is_ok(),
            accepted,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
        if let Err(message) = result {
            assert!(message.contains("head -c 32 /dev/urandom"), "{message}");
        }
    };
    check(b"short", false);
    check(&[b'x'; 31], false);
    check(&[b'a'; 64], false);
    check(b"passwordpasswordpasswordpassword", false);
    check(b"test-cluster-secret-0123456789abcdef", true);
    // The forms `head -c 32 /dev/urandom` is usually turned into: raw, base64, hex.
    let raw: Vec<u8> = (0u8..32)
        .map(|i| i.wrapping_mul(97).wrapping_add(13))
        .collect();
    check(&raw, true);
    check(b"q3Yx0b8mZ2vT9c1KpW4nR7sJ6hL5dF0gA2eU8iO1yXw=", true);
    check(
        b"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        true,
    );
}

/// A peer without the secret that connects to a worker gets a challenge and nothing else:
/// no proof it could test guesses of the secret against, and no `Hello`.
#[tokio::test]
async fn the_accepting_side_proves_nothing_before_the_peer_has() {
    let secret = ClusterSecret::random();
    let (client, server) = tokio::io::duplex(1 << 16);
    let mut client: transport::BoxStream = Box::new(client);
    let mut server: transport::BoxStream = Box::new(server);
    let info = worker_info();
    let worker = tokio::spawn(async move { accept_handshake(&mut server, &secret, &info).await });
    let connect = Frame::Connect {
        peer: PeerRole::Router,
        nonce: [5; 32],
    };
    transport::write_frame(&mut client, &connect).await.unwrap();
    let challenge = transport::read_frame(&mut client).await.unwrap();
    assert!(
        matches!(challenge, Some(Frame::Challenge { .. })),
        "the worker's first answer is a bare challenge: {challenge:?}"
    );
    let guess = Frame::Proof { proof: [0; 32] };
    transport::write_frame(&mut client, &guess).await.unwrap();
    assert!(matches!(worker.await.unwrap(), Err(HandshakeError::Auth)));
    let after = transport::read_frame(&mut client).await;
    assert!(
        matches!(after, Ok(None)),
        "after a wrong proof the worker sends nothing and closes: {after:?}"
    );
}

#[tokio::test]
async fn every_handshake_field_must_match() {
    let secret = ClusterSecret::random();
    let good = Expectation::of(&worker_info());
    type Change = Box<dyn Fn(&mut Expectation)>;
    let variants: Vec<(&str, Change)> = vec![
        ("model_id", Box::new(|e| e.model_id = "other".into())),
        ("weights_hash", Box::new(|e| e.weights_hash ^= 1)),
        ("kv_dtype", Box::new(|e| e.kv_dtype = "f32".into())),
        ("page_size", Box::new(|e| e.page_size_tokens = 32)),
        ("layers", Box::new(|e| e.layer_count = 31)),
        ("kv_heads", Box::new(|e| e.kv_head_count = 4)),
        ("head_dim", Box::new(|e| e.head_dim = 128)),
        (
            "context_length",
            Box::new(|e| e.context_length = Some(4096)),
        ),
    ];
    for (field, change) in variants {
        let mut expect = good.clone();
        change(&mut expect);
        let (client, _) = handshake_pair(secret.clone(), secret.clone(), expect).await;
        match client {
            Err(HandshakeError::Mismatch { field: found, .. }) => assert_eq!(found, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    let mut any_context = good;
    any_context.context_length = None;
    let (client, _) = handshake_pair(secret.clone(), secret, any_context).await;
    assert!(client.is_ok());
}

#[test]
fn a_page_frame_adds_at_most_its_stated_overhead_to_the_page() {
    let page_bytes = 4096;
    let frame = Frame::Page {
        transfer: TransferId(u64::MAX),
        request: RequestId(u64::MAX),
        tenant: TenantId(u64::MAX),
        index: u32::MAX,
        bytes: vec![0; page_bytes].into(),
    };
    let body = frame.encode().len() - 4;
    assert!(
        body - page_bytes <= PAGE_FRAME_OVERHEAD_BYTES_MAX,
        "{}",
        body - page_bytes
    );
    assert!(page_fits_frame(
        MAX_FRAME_BYTES - PAGE_FRAME_OVERHEAD_BYTES_MAX
    ));
    assert!(!page_fits_frame(
        MAX_FRAME_BYTES - PAGE_FRAME_OVERHEAD_BYTES_MAX + 1
    ));
}

/// Every variant of every one-byte enum crosses a link intact, in the frame that carries it,
/// and the first byte past each enum's variants is refused by name.
#[test]
fn every_variant_of_every_wire_enum_round_trips() {
    let round_trip = |frame: Frame| {
        let decoded = Frame::decode(&frame.encode()).expect("decodes");
        assert_eq!(decoded, frame);
    };
    for &failure in Failure::ALL {
        round_trip(Frame::Failed {
            request: RequestId(1),
            failure,
            message: format!("{failure:?}"),
        });
    }
    for &reject in Reject::ALL {
        round_trip(Frame::Nack {
            transfer: TransferId(1),
            reject,
        });
    }
    for &finish in Finish::ALL {
        round_trip(Frame::Finished {
            request: RequestId(1),
            finish,
            prompt_tokens: 1,
            completion_tokens: 1,
        });
    }
    for &role in Role::ALL {
        round_trip(Frame::Hello(WorkerInfo {
            role,
            ..worker_info()
        }));
    }
    for &peer in PeerRole::ALL {
        round_trip(Frame::Connect {
            peer,
            nonce: [1; 32],
        });
    }
    // One past the last variant: the byte sits right after the kind in `Nack`'s body.
    let mut body = Frame::Nack {
        transfer: TransferId(1),
        reject: Reject::UnknownTransfer,
    }
    .encode();
    let last = body.len() - 1;
    body[last] = Reject::ALL.len() as u8;
    assert_eq!(
        Frame::decode(&body),
        Err(DecodeError::UnknownEnum {
            field: "reject",
            value: Reject::ALL.len() as u8
        })
    );
}

#[test]
fn a_delta_transfer_takes_only_the_pages_the_receiver_lacks() {
    // 40 tokens in pages of 16: 3 pages, of which the receiver holds the first 2.
    let mut inbound = Inbound::new(TransferId(9), RequestId(1), TenantId(2), 40, 16, 8, 2);
    assert_eq!(inbound.held_pages(), 2);
    // A frame for a held page would overwrite a shared page: refused.
    for held in 0..2 {
        assert_eq!(
            inbound.accept_page(RequestId(1), TenantId(2), held, 8),
            Err(Reject::BadPage)
        );
    }
    // The checksum covers every page decode will read, held ones included.
    let pages = vec![vec![1u8; 8], vec![2u8; 8], vec![3u8; 8]];
    let done = done_for(&inbound, &pages);
    assert_eq!(inbound.check_done(&done), Err(Reject::MissingPage));
    assert_eq!(inbound.accept_page(RequestId(1), TenantId(2), 2, 8), Ok(2));
    assert_eq!(inbound.check_done(&done), Ok(()));
    let computed = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
    assert_eq!(inbound.verify_checksum(&done, computed), Ok(()));
    // Held pages whose bytes differ from the sender's (a wrong reuse) fail like corruption.
    let wrong_reuse = [vec![9u8; 8], vec![2u8; 8], vec![3u8; 8]];
    let computed = transfer_checksum(&done, wrong_reuse.iter().map(Vec::as_slice));
    assert_eq!(
        inbound.verify_checksum(&done, computed),
        Err(Reject::ChecksumMismatch)
    );
    // Holding more pages than the transfer has is capped: every page is held, none comes.
    let all_held = Inbound::new(TransferId(9), RequestId(1), TenantId(2), 40, 16, 8, 9);
    assert_eq!(all_held.held_pages(), 3);
}

#[test]
fn the_streaming_hasher_equals_the_one_shot_checksum() {
    let done = TransferDone {
        transfer: TransferId(5),
        request: RequestId(6),
        tenant: TenantId(7),
        page_count: 3,
        token_count: 40,
        checksum: 0,
    };
    let pages: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 64]).collect();
    let mut streamed = crate::TransferHasher::new(&done);
    for page in &pages {
        streamed.page(page);
    }
    assert_eq!(streamed.pages(), 3);
    assert_eq!(
        streamed.finish(),
        transfer_checksum(&done, pages.iter().map(Vec::as_slice))
    );
    // One page fewer is another checksum: the count of pages is part of what is proved.
    let mut short = crate::TransferHasher::new(&done);
    short.page(&pages[0]);
    short.page(&pages[1]);
    assert_ne!(short.finish(), streamed.finish());
}

#[test]
fn transfer_times_land_in_their_bucket() {
    let mut counters = crate::TransferCounters::default();
    counters.observe(1000, std::time::Duration::from_micros(3000));
    counters.observe(500, std::time::Duration::from_secs(60));
    assert_eq!(counters.bytes_received, 1500);
    assert_eq!(counters.transfers, 2);
    assert_eq!(counters.micros_sum, 60_003_000);
    // 3 ms is within the 5 ms bound; a minute is beyond every bound.
    let five_ms = crate::TRANSFER_SECONDS_BOUNDS
        .iter()
        .position(|&b| b == 0.005)
        .unwrap();
    assert_eq!(counters.buckets[five_ms], 1);
    assert_eq!(counters.buckets.iter().sum::<u64>(), 1);
}

/// A page sink over a pool's reservation: pages it holds a lease for land, the rest are
/// refused; what happened is recorded.
#[derive(Default)]
struct RecordingSink {
    leases: std::sync::Mutex<std::collections::HashMap<u32, kv::LentPageMut>>,
    landed: std::sync::Mutex<Vec<u32>>,
    refused: std::sync::Mutex<Vec<u32>>,
    closed: std::sync::Mutex<Vec<TransferId>>,
}

impl crate::transport::PageSink for RecordingSink {
    fn claim(&self, header: &crate::transport::PageHeader) -> Option<kv::LentPageMut> {
        let page = self.leases.lock().unwrap().remove(&header.index);
        if page.is_none() {
            self.refused.lock().unwrap().push(header.index);
        }
        page
    }

    fn landed(&self, header: &crate::transport::PageHeader, _page: kv::LentPageMut) {
        self.landed.lock().unwrap().push(header.index);
    }

    fn closing(&self, done: &TransferDone) {
        self.closed.lock().unwrap().push(done.transfer);
    }
}

/// `Done` of transfer 9 (request 7, tenant 3): three pages, 12 tokens.
fn done_of_three_pages(checksum: u64) -> TransferDone {
    TransferDone {
        transfer: TransferId(9),
        request: RequestId(7),
        tenant: TenantId(3),
        page_count: 3,
        token_count: 12,
        checksum,
    }
}

/// Page `index` of the transfer [`done_of_three_pages`] closes, holding `bytes`.
fn page_of_three(index: u32, bytes: Vec<u8>) -> Frame {
    Frame::Page {
        transfer: TransferId(9),
        request: RequestId(7),
        tenant: TenantId(3),
        index,
        bytes: bytes.into(),
    }
}

/// A pool with a reservation of `tokens` for request 7 of tenant 3, receiving, and a sink
/// holding the leases of its first `lent` pages.
fn receiving(
    layout: kv::KvLayout,
    tokens: usize,
    lent: usize,
) -> (kv::PagePool, kv::PageTable, std::sync::Arc<RecordingSink>) {
    let mut pool = kv::PagePool::new(kv::PoolConfig {
        layout,
        size: kv::PoolSize::Tokens(tokens),
        scrub_on_free: false,
    })
    .unwrap();
    let owner = kv::Owner {
        tenant: TenantId(3),
        request: RequestId(7),
    };
    let table = pool.allocate(owner, tokens).unwrap();
    pool.set_state(&table, kv::PageState::Receiving).unwrap();
    let sink = std::sync::Arc::new(RecordingSink::default());
    let leases = pool.lend_for_receive(&table, 0..lent).unwrap();
    for (index, lease) in leases.into_iter().enumerate() {
        sink.leases.lock().unwrap().insert(index as u32, lease);
    }
    (pool, table, sink)
}

#[tokio::test]
async fn a_readers_sink_lands_page_bytes_in_the_pool_and_drops_what_it_refuses() {
    let layout = kv::KvLayout {
        layer_count: 2,
        kv_head_count: 1,
        head_dim: 8,
        page_size_tokens: 4,
    };
    let page_bytes = layout.page_bytes();
    // Pages 0 and 1 are offered; page 2 is not (as a page decode holds, or a dropped one).
    let (mut pool, table, sink) = receiving(layout, 12, 2);
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let sender = spawn_link(Box::new(ours), "prefill".into());
    let sink_handle: std::sync::Arc<dyn crate::transport::PageSink> = sink.clone();
    let mut receiver = crate::transport::spawn_link_with_sink(
        Box::new(theirs),
        "decode".into(),
        Some(sink_handle),
    );
    let page = |index: u32| page_of_three(index, vec![index as u8 + 1; page_bytes]);
    let done = done_of_three_pages(5);
    for frame in [page(0), page(2), page(1), Frame::Done(done)] {
        sender.tx.send(frame).unwrap();
    }
    // Only `Done` comes out of the link: the pages went into the pool or were dropped.
    assert_eq!(receiver.rx.recv().await, Some(Frame::Done(done)));
    assert_eq!(*sink.landed.lock().unwrap(), [0, 1]);
    assert_eq!(*sink.refused.lock().unwrap(), [2]);
    assert_eq!(*sink.closed.lock().unwrap(), [TransferId(9)]);
    let view = pool
        .verify_receiving(&table)
        .expect("every lease came back");
    for index in 0..2 {
        let bytes: &[u8] = bytemuck::cast_slice(view.page(index));
        assert!(bytes.iter().all(|&b| b == index as u8 + 1), "page {index}");
    }
    let untouched: &[u8] = bytemuck::cast_slice(view.page(2));
    assert!(
        untouched.iter().all(|&b| b == 0),
        "a refused page's bytes land nowhere"
    );
}

/// A sink that lends nothing and records, per page it is asked about, whether its link had
/// been announced by then.
#[derive(Default)]
struct AnnouncedLog {
    announced: std::sync::atomic::AtomicBool,
    claims: std::sync::Mutex<Vec<bool>>,
}

impl crate::transport::PageSink for AnnouncedLog {
    fn claim(&self, _: &crate::transport::PageHeader) -> Option<kv::LentPageMut> {
        let announced = self.announced.load(std::sync::atomic::Ordering::SeqCst);
        self.claims.lock().unwrap().push(announced);
        None
    }
    fn landed(&self, _: &crate::transport::PageHeader, _: kv::LentPageMut) {}
    fn closing(&self, _: &TransferDone) {}
}

/// A decode engine hears of a refused page on its event queue and answers on the link: the
/// link must be announced there before its reader can refuse anything. Here a page waits on
/// the stream before the link exists, and the announcement is slow; the reader must still
/// not reach the page before it is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_links_reader_starts_only_after_the_link_is_announced() {
    use tokio::io::AsyncWriteExt;
    let (mut ours, theirs) = tokio::io::duplex(1 << 16);
    let page = Frame::Page {
        transfer: TransferId(9),
        request: RequestId(7),
        tenant: TenantId(3),
        index: 0,
        bytes: vec![1u8; 64].into(),
    };
    let body = page.encode();
    ours.write_all(&(body.len() as u32).to_le_bytes())
        .await
        .unwrap();
    ours.write_all(&body).await.unwrap();
    ours.shutdown().await.unwrap();
    let log = std::sync::Arc::new(AnnouncedLog::default());
    let sink: std::sync::Arc<dyn crate::transport::PageSink> = log.clone();
    let mut link = crate::transport::spawn_link_announced(
        Box::new(theirs),
        "decode".into(),
        Some(sink),
        |_| {
            // Long enough for a reader already running on the other thread to reach the page.
            std::thread::sleep(std::time::Duration::from_millis(200));
            log.announced
                .store(true, std::sync::atomic::Ordering::SeqCst);
        },
    );
    // The stream ends after the page: the reader has claimed it once the link closes.
    assert_eq!(link.rx.recv().await, None);
    assert_eq!(*log.claims.lock().unwrap(), [true]);
}

/// A sink that lends nothing and records the headers it is asked about, and the writes it is
/// told of.
#[derive(Default)]
struct HeaderLog {
    claims: std::sync::Mutex<Vec<crate::transport::PageHeader>>,
    written: std::sync::Mutex<Vec<(TransferId, u32)>>,
}

impl crate::transport::PageSink for HeaderLog {
    fn claim(&self, header: &crate::transport::PageHeader) -> Option<kv::LentPageMut> {
        self.claims.lock().unwrap().push(*header);
        None
    }
    fn landed(&self, _: &crate::transport::PageHeader, _: kv::LentPageMut) {}
    fn closing(&self, _: &TransferDone) {}
    fn written(&self, transfer: TransferId, index: u32) {
        self.written.lock().unwrap().push((transfer, index));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The reader's own page-header parser (the sink path) agrees with the decoder on hostile
    /// bytes: a body it takes as a page frame decodes as exactly that page frame, any other
    /// body is passed on as the decoder reads it, and nothing panics.
    #[test]
    fn the_sink_readers_page_header_agrees_with_the_decoder(
        which in 0usize..64,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        let frames = sample_frames();
        let mut body = frames[which % frames.len()].encode();
        for (at, value) in flips {
            let at = at % body.len();
            body[at] = value;
        }
        let mut wire = (body.len() as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&body);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (forwarded, claims, written) = runtime.block_on(async {
            use tokio::io::AsyncWriteExt;
            let (mut ours, theirs) = tokio::io::duplex(1 << 20);
            let log = std::sync::Arc::new(HeaderLog::default());
            let sink: std::sync::Arc<dyn crate::transport::PageSink> = log.clone();
            let mut link =
                crate::transport::spawn_link_with_sink(Box::new(theirs), "fuzz".into(), Some(sink));
            ours.write_all(&wire).await.unwrap();
            ours.shutdown().await.unwrap();
            let mut forwarded = Vec::new();
            while let Some(frame) = link.rx.recv().await {
                forwarded.push(frame);
            }
            let claims = log.claims.lock().unwrap().clone();
            let written = log.written.lock().unwrap().clone();
            (forwarded, claims, written)
        });
        match Frame::decode(&body) {
            Ok(Frame::Page { transfer, request, tenant, index, bytes }) => {
                prop_assert!(forwarded.is_empty());
                prop_assert_eq!(claims.len(), 1);
                let header = claims[0];
                prop_assert_eq!(
                    (header.transfer, header.request, header.tenant, header.index, header.len),
                    (transfer, request, tenant, index, bytes.len())
                );
            }
            // Answered by the reader itself: its answer goes out on the link, nothing comes in.
            Ok(Frame::GrantAsk { .. }) => {
                prop_assert!(claims.is_empty() && forwarded.is_empty() && written.is_empty());
            }
            Ok(Frame::Written { transfer, index }) => {
                prop_assert!(claims.is_empty() && forwarded.is_empty());
                prop_assert_eq!(written, vec![(transfer, index)]);
            }
            // Compared as bytes: a flipped byte can make a sampling field NaN, which is not
            // equal to itself.
            Ok(frame) => {
                prop_assert!(claims.is_empty() && written.is_empty());
                let forwarded: Vec<Vec<u8>> = forwarded.iter().map(Frame::encode).collect();
                prop_assert_eq!(forwarded, vec![frame.encode()]);
            }
            Err(_) => {
                prop_assert!(claims.is_empty() && forwarded.is_empty() && written.is_empty());
            }
        }
    }
}

#[test]
fn page_hashes_are_xxh3_under_the_page_secret_at_every_length() {
    let data: Vec<u8> = (0..400_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for len in [0, 1, 16, 128, 240, 241, 256, 1024, 368_640] {
        assert_eq!(
            crate::page_hash(&data[..len]),
            xxhash_rust::xxh3::xxh3_64_with_secret(&data[..len], &crate::checksum::PAGE_SECRET),
            "{len}"
        );
    }
}

/// `unix:@name` addresses: a socket in the abstract namespace, bound and reached by name, and
/// one at a path; a frame crosses each.
#[tokio::test]
async fn unix_sockets_by_path_and_by_abstract_name_carry_frames() {
    use crate::transport::{bind_unix, connect_unix, read_frame, unix_path, write_frame};
    let dir = std::env::temp_dir().join(format!("airlock-unix-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    let by_path = format!("unix:{}", dir.join("s.sock").display());
    let by_name = format!("unix:@airlock-unix-test-{}", std::process::id());
    for addr in [by_path, by_name] {
        let path = unix_path(&addr).expect("a unix address");
        let listener = bind_unix(path).expect("binds");
        let (connected, accepted) = tokio::join!(connect_unix(path), listener.accept());
        let (mut ours, (mut theirs, _)) = (connected.expect("connects"), accepted.unwrap());
        let frame = Frame::Ack {
            transfer: TransferId(3),
        };
        write_frame(&mut ours, &frame).await.unwrap();
        assert_eq!(
            read_frame(&mut theirs).await.unwrap(),
            Some(frame),
            "{addr}"
        );
    }
    // Nothing listens there any more: refused, not hung.
    assert!(connect_unix("@airlock-nobody-listens-here").await.is_err());
    assert!(unix_path("10.0.0.1:9002").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `Text` frame whose token claims more alternatives than any request may ask for is
/// refused, not allocated for.
#[test]
fn a_text_frame_over_the_top_logprobs_cap_is_refused() {
    let frame = |top: usize| Frame::Text {
        request: RequestId(1),
        text: "x".into(),
        logprobs: vec![TokenLogprob {
            token: 1,
            logprob: -1.0,
            top: vec![(2, -2.0); top],
        }],
    };
    let fits = frame(MAX_TOP_LOGPROBS);
    assert_eq!(Frame::decode(&fits.encode()), Ok(fits));
    assert!(matches!(
        Frame::decode(&frame(MAX_TOP_LOGPROBS + 1).encode()),
        Err(DecodeError::TooLong {
            field: "top_logprobs",
            ..
        })
    ));
}

/// The link's reader reads through a small buffer: frames that arrive together in one write,
/// with pages several times the buffer's size among them, still come out one by one, in
/// order, and each page's bytes land whole and in place.
#[tokio::test]
async fn frames_arriving_together_are_read_apart_and_pages_land_whole() {
    let layout = kv::KvLayout {
        layer_count: 8,
        kv_head_count: 2,
        head_dim: 64,
        page_size_tokens: 4,
    };
    let page_bytes = layout.page_bytes();
    assert!(
        page_bytes > 3 * 4096,
        "a page several times the reader's buffer"
    );
    let (mut pool, table, sink) = receiving(layout, 8, 2);
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let sink_handle: std::sync::Arc<dyn crate::transport::PageSink> = sink.clone();
    let mut receiver = crate::transport::spawn_link_with_sink(
        Box::new(theirs),
        "decode".into(),
        Some(sink_handle),
    );
    let pattern = |index: usize| -> Vec<u8> {
        (0..page_bytes)
            .map(|at| (at * 7 + index * 13 + at / 251) as u8)
            .collect()
    };
    let page = |index: u32| page_of_three(index, pattern(index as usize));
    let ack = |transfer: u64| Frame::WriteAbortAck {
        transfer: TransferId(transfer),
    };
    let frames = [ack(1), ack(2), page(0), ack(3), page(1), ack(4), ack(5)];
    let mut wire = Vec::new();
    for frame in &frames {
        wire.extend_from_slice(&frame.encode_prefixed());
    }
    tokio::io::AsyncWriteExt::write_all(&mut ours, &wire)
        .await
        .unwrap();
    for transfer in 1..=5 {
        assert_eq!(receiver.rx.recv().await, Some(ack(transfer)));
    }
    assert_eq!(*sink.landed.lock().unwrap(), [0, 1]);
    let view = pool
        .verify_receiving(&table)
        .expect("every lease came back");
    for index in 0..2 {
        let bytes: &[u8] = bytemuck::cast_slice(view.page(index));
        assert!(
            bytes == pattern(index).as_slice(),
            "page {index} whole, in place"
        );
    }
}

/// A hashing link's writer (`spawn_hashing_link`) hashes each page frame as it writes it and
/// sends `Done` with the root over those hashes and the ones the engine put for pages decode
/// holds; a page hashed by neither counts as 0, and a `TransferAbort` drops what was put.
#[tokio::test]
async fn a_hashing_links_done_carries_the_checksum_over_its_pages_and_the_held_ones() {
    let page_bytes = 1024;
    let pages: Vec<Vec<u8>> = (0..3u8).map(|p| vec![p + 0x31; page_bytes]).collect();
    let done = done_of_three_pages(0xDEAD);
    let page = |index: usize| page_of_three(index as u32, pages[index].clone());
    let abort = Frame::TransferAbort {
        transfer: TransferId(9),
        request: RequestId(7),
    };
    let held = crate::page_hash(&pages[0]);
    let whole = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
    // Page 0 held by decode (its hash put by the engine), or hashed by no one; an abort in
    // between drops the held hash, so the next `Done` finds none.
    let cases = [
        (vec![page(1), page(2), Frame::Done(done)], true),
        (vec![page(1), page(2), Frame::Done(done)], false),
        (
            vec![page(1), abort.clone(), page(2), Frame::Done(done)],
            true,
        ),
    ];
    for (case, (frames, engine_puts_held)) in cases.into_iter().enumerate() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let hashes = crate::SenderHashes::default();
        if engine_puts_held {
            hashes.put(TransferId(9), 0, held);
        }
        let link = crate::transport::spawn_hashing_link(Box::new(ours), "prefill".into(), hashes);
        for frame in frames {
            link.tx.send(frame).unwrap();
        }
        let received = loop {
            match read_frame(&mut theirs).await.unwrap().expect("a frame") {
                Frame::Done(received) => break received,
                Frame::Page { .. } | Frame::TransferAbort { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        };
        let expect_whole = case == 0;
        assert_eq!(received.checksum == whole, expect_whole, "case {case}");
        assert_ne!(
            received.checksum, 0xDEAD,
            "case {case}: the engine's value is replaced"
        );
    }
}

#[test]
fn sender_hashes_keep_the_latest_transfers_and_drop_the_oldest() {
    let hashes = crate::SenderHashes::default();
    let max = crate::checksum::SENDER_HASHES_TRANSFERS_MAX as u64;
    for transfer in 0..=max {
        hashes.put(TransferId(transfer), 0, transfer + 1);
    }
    assert!(hashes.forget(TransferId(0)).is_empty(), "the oldest went");
    assert_eq!(hashes.forget(TransferId(1)).get(&0), Some(&2));
    assert_eq!(hashes.forget(TransferId(max)).get(&0), Some(&(max + 1)));
}
