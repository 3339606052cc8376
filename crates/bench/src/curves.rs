//! The measurements behind `airlock bench`'s scaling curves that are not plain HTTP load:
//!
//! - `--sweep` parsing (`concurrency=`, `prompt-tokens=`, `transfer-tokens=`);
//! - prompts of an exact token count, built with the model's own tokenizer (the same GGUF
//!   vocabulary every engine under test reads);
//! - the KV pool's occupancy over time, polled from a router's Prometheus `/metrics`;
//! - the KV transfer, in process: a prefill-side [`PagePool`] sends N tokens of pages over a
//!   real loopback TCP link ([`transfer::transport::spawn_link`], [`Frame::Page`], `Done` with
//!   the xxh3 checksum) to a decode-side pool that accepts, copies and verifies them, as the
//!   workers do; timed from the start of packing to the verified seal. Beside it, in the same
//!   run, the machine's memory-copy bandwidth (the physical limit of any copy) and xxh3's.

use anyhow::{bail, Context, Result};
use kv::{Owner, PagePool, PageState, PoolConfig, PoolSize, RequestId, TenantId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer::one_sided;
use transfer::transport::{PageHeader, PageSink};
use transfer::{Frame, Inbound, PageBytes, TransferDone, TransferHasher, TransferId};

// ---- --sweep ---------------------------------------------------------------------------------

/// One prompt length of a `prompt-tokens=` sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptLength {
    Tokens(usize),
    /// As long as the context allows with the sweep's max_tokens.
    Max,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sweeps {
    pub concurrency: Option<Vec<usize>>,
    pub prompt_tokens: Option<Vec<PromptLength>>,
    pub transfer_tokens: Option<Vec<usize>>,
}

impl Sweeps {
    /// Parses every `--sweep KEY=V1,V2,...`; a key given twice is an error.
    pub fn parse(specs: &[String]) -> Result<Sweeps> {
        let mut sweeps = Sweeps::default();
        for spec in specs {
            let (key, list) = spec
                .split_once('=')
                .with_context(|| format!("--sweep takes KEY=V1,V2,... (got '{spec}')"))?;
            let values: Vec<&str> = list.split(',').map(str::trim).collect();
            if values.iter().any(|v| v.is_empty()) {
                bail!("--sweep {key}: empty value in '{list}'");
            }
            let positive = |v: &str| -> Result<usize> {
                match v.parse::<usize>() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => bail!("--sweep {key}: '{v}' is not a positive integer"),
                }
            };
            let duplicate = match key {
                "concurrency" if list == "none" => sweeps.concurrency.replace(Vec::new()).is_some(),
                "concurrency" => sweeps
                    .concurrency
                    .replace(values.iter().map(|v| positive(v)).collect::<Result<_>>()?)
                    .is_some(),
                "prompt-tokens" => sweeps
                    .prompt_tokens
                    .replace(
                        values
                            .iter()
                            .map(|v| match *v {
                                "max" => Ok(PromptLength::Max),
                                v => positive(v).map(PromptLength::Tokens),
                            })
                            .collect::<Result<_>>()?,
                    )
                    .is_some(),
                "transfer-tokens" => sweeps
                    .transfer_tokens
                    .replace(values.iter().map(|v| positive(v)).collect::<Result<_>>()?)
                    .is_some(),
                other => bail!(
                    "--sweep: unknown key '{other}' (concurrency, prompt-tokens, transfer-tokens)"
                ),
            };
            if duplicate {
                bail!("--sweep {key} given twice");
            }
        }
        Ok(sweeps)
    }
}

// ---- prompts of a known token count ----------------------------------------------------------

pub(crate) const WORDS: &[&str] = &[
    "river", "mountain", "engine", "garden", "history", "signal", "copper", "market", "winter",
    "lantern", "harbor", "theory", "orchard", "circuit", "planet", "library", "teacher", "bridge",
    "storm", "village", "algebra", "violin", "desert", "factory", "forest", "window", "morning",
    "paper", "island", "stone", "music", "letter", "summer", "castle", "silver", "field",
];

/// A prompt of exactly `tokens` tokens under `count` (the tokenizer's encode without BOS, as
/// the router's completions endpoint counts), made of seeded random words from its very first
/// token, so no two prompts share a prefix an engine could reuse. Returns the text and its
/// token count (equal to `tokens` unless the words cannot hit it exactly).
pub fn prompt_of_tokens(
    count: &dyn Fn(&str) -> usize,
    tokens: usize,
    seed: u64,
) -> (String, usize) {
    let mut rng = stats::SplitMix64::new(seed);
    let mut words: Vec<&str> = Vec::new();
    let mut text = String::new();
    // Grow past the target, then binary-search the longest word prefix that fits.
    while count(&text) < tokens {
        for _ in 0..tokens.max(8) / 2 {
            words.push(WORDS[rng.below(WORDS.len())]);
        }
        text = words.join(" ");
    }
    let (mut low, mut high) = (0usize, words.len());
    while low < high {
        let mid = (low + high).div_ceil(2);
        if count(&words[..mid].join(" ")) <= tokens {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    let mut text = words[..low].join(" ");
    let mut have = count(&text);
    // Words are one or two tokens: pad the last few with one-token pieces.
    for _ in 0..8 {
        if have >= tokens {
            break;
        }
        let padded = format!("{text} a");
        let now = count(&padded);
        if now > tokens {
            break;
        }
        (text, have) = (padded, now);
    }
    (text, have)
}

// ---- pool occupancy from /metrics ------------------------------------------------------------

/// One worker's pool at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSample {
    /// Seconds since the target's measurement began.
    pub t: f64,
    pub worker: String,
    pub used: f64,
    pub total: f64,
}

/// `worker` label and value of each `airlock_kv_pages_used` / `_free` line, as
/// `(worker, used, free)`; workers without both gauges are left out.
pub fn parse_pool_gauges(text: &str) -> Vec<(String, f64, f64)> {
    let mut rows: Vec<(String, Option<f64>, Option<f64>)> = Vec::new();
    for line in text.lines() {
        let (used, rest) = if let Some(rest) = line.strip_prefix("airlock_kv_pages_used{") {
            (true, rest)
        } else if let Some(rest) = line.strip_prefix("airlock_kv_pages_free{") {
            (false, rest)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let Some(worker) = label(labels, "worker") else {
            continue;
        };
        let index = match rows.iter().position(|row| row.0 == worker) {
            Some(index) => index,
            None => {
                rows.push((worker, None, None));
                rows.len() - 1
            }
        };
        if used {
            rows[index].1 = Some(value);
        } else {
            rows[index].2 = Some(value);
        }
    }
    rows.into_iter()
        .filter_map(|(worker, used, free)| Some((worker, used?, free?)))
        .collect()
}

/// The value of `key="..."` in a Prometheus label set (escapes `\\`, `\"`, `\n` undone).
pub(crate) fn label(labels: &str, key: &str) -> Option<String> {
    let start = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let mut value = String::new();
    let mut chars = labels[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => match chars.next()? {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

/// Polls `{url}/metrics` every `interval` until `stop` is set. Returns no samples when the
/// endpoint has no airlock pool gauges (another engine).
pub async fn poll_pool(
    url: String,
    key: Option<String>,
    interval: Duration,
    base: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<PoolSample> {
    let Ok(client) = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
    else {
        return Vec::new();
    };
    let mut samples = Vec::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut polls = 0u32;
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        polls += 1;
        let mut request = client.get(format!("{url}/metrics"));
        if let Some(key) = &key {
            request = request.bearer_auth(key);
        }
        let text = match request.send().await {
            Ok(response) if response.status().is_success() => {
                response.text().await.unwrap_or_default()
            }
            _ => String::new(),
        };
        let t = base.elapsed().as_secs_f64();
        let rows = parse_pool_gauges(&text);
        if rows.is_empty() && samples.is_empty() && polls >= 3 {
            return samples; // not an airlock router
        }
        for (worker, used, free) in rows {
            samples.push(PoolSample {
                t,
                worker,
                used,
                total: used + free,
            });
        }
    }
    samples
}

// ---- memory bandwidth ------------------------------------------------------------------------

/// Best-of-`reps` GB/s (10^9 bytes copied per second) of `copy_from_slice` over `bytes`.
pub fn memcpy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let source: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
    let mut target = vec![1u8; bytes];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        target.copy_from_slice(std::hint::black_box(&source));
        std::hint::black_box(&mut target);
        best = best.min(started.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// Best-of-`reps` GB/s of the transfer checksum's page hash (XXH3-64, run-time dispatched
/// SIMD) over `bytes`.
pub fn xxh3_bandwidth(bytes: usize, reps: usize) -> f64 {
    let data: Vec<u8> = (0..bytes).map(|i| (i * 17 + 3) as u8).collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        std::hint::black_box(transfer::page_hash(std::hint::black_box(&data)));
        best = best.min(started.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// Best-of-`reps` GB/s of a plain copy of `bytes` through a loopback TCP connection, 8 MiB
/// writes on one thread and 8 MiB reads on another: the ceiling for a transfer over TCP
/// (the kernel copies each byte twice).
pub fn socket_copy_bandwidth(bytes: usize, reps: usize) -> Result<f64> {
    use std::io::{Read, Write};
    const CHUNK: usize = 8 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut writer = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (mut reader, _) = listener.accept()?;
    let reading = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buffer = vec![0u8; CHUNK];
        loop {
            if reader.read(&mut buffer)? == 0 {
                return Ok(());
            }
        }
    });
    let source: Vec<u8> = (0..CHUNK).map(|i| (i * 13 + 5) as u8).collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK);
            writer.write_all(&source[..n])?;
            left -= n;
        }
        writer.flush()?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    drop(writer);
    reading
        .join()
        .map_err(|_| anyhow::anyhow!("the socket reader panicked"))??;
    Ok(bytes as f64 / best / 1e9)
}

// ---- KV transfer over loopback TCP -----------------------------------------------------------

/// One transfer size's result.
#[derive(Clone, Debug)]
pub struct TransferPoint {
    pub tokens: usize,
    pub pages: usize,
    pub bytes: usize,
    /// Median seconds from the start of packing to the receiver's verified seal.
    pub seconds: f64,
    /// Median seconds the sender spent packing (page copies, checksum, frames queued).
    pub pack_seconds: f64,
}

impl TransferPoint {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

pub struct TransferReport {
    pub layout: kv::KvLayout,
    /// Over loopback TCP.
    pub points: Vec<TransferPoint>,
    /// One-sided, through shared memory over a Unix socket (empty in reports from before it).
    pub shm_points: Vec<TransferPoint>,
    pub memcpy_gb_s: f64,
    pub xxh3_gb_s: f64,
    /// A plain socket copy over loopback TCP (8 MiB writes and reads), same run: what a
    /// transfer over TCP can reach at most.
    pub socket_gb_s: f64,
}

/// The benchmark receiver's one reservation at a time, landed by its link's reader as a
/// decode worker's `Grants` does: bytes straight into the lent page, hashed there.
#[derive(Default)]
struct BenchSink {
    state: std::sync::Mutex<Option<Reservation>>,
}

struct Reservation {
    inbound: Inbound,
    leases: Vec<Option<kv::LentPageMut>>,
    hashes: Vec<Option<u64>>,
    refused: Option<String>,
    /// Granted to a one-sided writer: each page hashed at its `Written`, or at `Done`, as
    /// decode's `Grants` does.
    one_sided: bool,
}

impl BenchSink {
    fn open(&self, inbound: Inbound, leases: Vec<kv::LentPageMut>) {
        let pages = inbound.page_count() as usize;
        *self.state.lock().expect("bench sink lock") = Some(Reservation {
            inbound,
            leases: leases.into_iter().map(Some).collect(),
            hashes: vec![None; pages],
            refused: None,
            one_sided: false,
        });
    }

    /// The reservation's `Inbound` and page hashes; its leases go back to the pool.
    fn close(&self) -> (Inbound, Vec<Option<u64>>) {
        let reservation = self
            .state
            .lock()
            .expect("bench sink lock")
            .take()
            .expect("a reservation is open");
        (reservation.inbound, reservation.hashes)
    }

    fn refused(&self) -> Option<String> {
        let state = self.state.lock().expect("bench sink lock");
        state.as_ref().and_then(|r| r.refused.clone())
    }
}

impl PageSink for BenchSink {
    fn claim(&self, header: &PageHeader) -> Option<kv::LentPageMut> {
        let mut state = self.state.lock().expect("bench sink lock");
        let reservation = state.as_mut()?;
        let accepted = reservation.inbound.accept_page(
            header.request,
            header.tenant,
            header.index,
            header.len,
        );
        match accepted {
            Ok(index) => reservation.leases[index].take(),
            Err(reject) => {
                reservation.refused = Some(format!("page refused: {reject:?}"));
                None
            }
        }
    }

    fn landed(&self, header: &PageHeader, page: kv::LentPageMut) {
        let hash = transfer::page_hash(page.bytes());
        let mut state = self.state.lock().expect("bench sink lock");
        if let Some(reservation) = state.as_mut() {
            let index = header.index as usize;
            reservation.hashes[index] = Some(hash);
            reservation.leases[index] = Some(page);
        }
    }

    fn closing(&self, _done: &TransferDone) {
        let mut state = self.state.lock().expect("bench sink lock");
        if let Some(reservation) = state.as_mut().filter(|r| r.one_sided) {
            for (hash, lease) in reservation.hashes.iter_mut().zip(&reservation.leases) {
                if let (None, Some(lease)) = (&hash, lease) {
                    *hash = Some(transfer::page_hash(lease.bytes()));
                }
            }
        }
    }

    fn written(&self, _transfer: TransferId, index: u32) {
        let mut state = self.state.lock().expect("bench sink lock");
        let Some(reservation) = state.as_mut().filter(|r| r.one_sided) else {
            return;
        };
        let index = index as usize;
        match (
            reservation.leases.get(index),
            reservation.hashes.get_mut(index),
        ) {
            (Some(Some(lease)), Some(hash @ None)) => {
                *hash = Some(transfer::page_hash(lease.bytes()))
            }
            _ => reservation.refused = Some(format!("page {index} reported written twice")),
        }
    }

    fn grant(&self, transfer: TransferId, request: RequestId, tenant: TenantId) -> Frame {
        let mut state = self.state.lock().expect("bench sink lock");
        let granted = state.as_mut().and_then(|reservation| {
            reservation.inbound.grant_writes(request, tenant).ok()?;
            reservation.one_sided = true;
            let pool_pages = reservation
                .leases
                .iter()
                .flatten()
                .map(kv::LentPageMut::page);
            Some(Frame::WriteGrant {
                transfer,
                first_index: 0,
                pool_pages: pool_pages.collect(),
            })
        });
        granted.unwrap_or(Frame::Nack {
            transfer,
            reject: transfer::Reject::UnknownTransfer,
        })
    }
}

/// What the receiving thread is told to expect.
pub(crate) struct Expect {
    pub(crate) transfer: TransferId,
    pub(crate) owner: Owner,
    pub(crate) tokens: usize,
}

/// Sends `tokens[i]` tokens of KV (layout of the model, `page_size` tokens per page) from one
/// pool to another over loopback TCP and then one-sidedly through shared memory, `reps` times
/// each, and reports the medians; then
/// measures memcpy and xxh3 bandwidth over `bandwidth_bytes` (256 MiB in `airlock bench`) in
/// the same process.
pub fn transfer_sweep(
    layout: kv::KvLayout,
    tokens: &[usize],
    reps: usize,
    bandwidth_bytes: usize,
) -> Result<TransferReport> {
    eprintln!("  over loopback TCP:");
    let points = sweep_on(layout, tokens, reps, false)?;
    eprintln!("  one-sided, through shared memory:");
    let shm_points = sweep_on(layout, tokens, reps, true)?;
    let memcpy_gb_s = memcpy_bandwidth(bandwidth_bytes, 5);
    let xxh3_gb_s = xxh3_bandwidth(bandwidth_bytes, 5);
    let socket_gb_s = socket_copy_bandwidth(bandwidth_bytes, 5)?;
    eprintln!("  loopback socket copy {socket_gb_s:.2} GB/s (best of 5, 8 MiB writes)");
    eprintln!(
        "  memcpy {memcpy_gb_s:.2} GB/s, xxh3 {xxh3_gb_s:.2} GB/s (best of 5 over {} MiB)",
        bandwidth_bytes >> 20
    );
    Ok(TransferReport {
        layout,
        points,
        shm_points,
        memcpy_gb_s,
        xxh3_gb_s,
        socket_gb_s,
    })
}

/// One transport's points: framed over loopback TCP, or (`one_sided`) page writes into a
/// shared-memory pool with control frames over a Unix socket, as `serve` runs them.
fn sweep_on(
    layout: kv::KvLayout,
    tokens: &[usize],
    reps: usize,
    one_sided: bool,
) -> Result<Vec<TransferPoint>> {
    let max_tokens = tokens.iter().copied().max().context("no transfer sizes")?;
    let page_bytes = layout.page_bytes();
    if !transfer::page_fits_frame(page_bytes) {
        bail!("pages of {page_bytes} bytes do not fit a transfer frame");
    }
    let pool = |tokens: usize, shared: bool| {
        let config = PoolConfig {
            layout,
            size: PoolSize::Tokens(layout.pages_for_tokens(tokens) * layout.page_size_tokens),
            scrub_on_free: false,
        };
        if shared {
            PagePool::new_shared(config)
        } else {
            PagePool::new(config)
        }
        .context("creating a KV pool for the transfer benchmark")
    };
    // Twice the largest transfer: a released page the link's writer has not let go of yet
    // is not reused, so the next repetition may need others.
    let mut sender_pool = pool(2 * max_tokens, false)?;
    let receiver_pool = pool(max_tokens, one_sided)?;
    // Two workers, as serve has: the link's reader and writer tasks run here, the engines on
    // their own threads (this one sends, a second one receives).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The receiver lands pages as a decode worker's prefill link does: its reader reads each
    // page's bytes straight into the reserved page and hashes it there.
    let sink = Arc::new(BenchSink::default());
    let (sender_link, receiver_link) = if one_sided {
        runtime.block_on(one_sided_links(&receiver_pool, sink.clone()))?
    } else {
        runtime.block_on(tcp_links(sink.clone()))?
    };

    let (expect_tx, expect_rx) = std::sync::mpsc::channel::<Expect>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (sealed_tx, sealed_rx) = std::sync::mpsc::channel::<Result<Instant, String>>();
    let mut receiver_rx = receiver_link.rx;
    let receiver_sink = sink.clone();
    let receiver = std::thread::spawn(move || {
        let mut pool = receiver_pool;
        while let Ok(expect) = expect_rx.recv() {
            let table = pool
                .allocate(expect.owner, expect.tokens)
                .expect("the receiving pool holds the largest transfer");
            pool.set_state(&table, PageState::Receiving)
                .expect("fresh pages go Writing -> Receiving");
            let inbound = Inbound::new(
                expect.transfer,
                expect.owner.request,
                expect.owner.tenant,
                expect.tokens as u32,
                layout.page_size_tokens as u32,
                page_bytes,
                0,
            );
            let leases = pool
                .lend_for_receive(&table, 0..inbound.page_count() as usize)
                .expect("a fresh reservation lends");
            receiver_sink.open(inbound, leases);
            let _ = ready_tx.send(());
            let verdict = match receiver_rx.blocking_recv() {
                Some(Frame::Done(done)) => {
                    let (inbound, hashes) = receiver_sink.close();
                    let checked = inbound.check_done(&done).and_then(|()| {
                        let mut root = TransferHasher::new(&done);
                        for hash in &hashes {
                            root.page_hash(hash.ok_or(transfer::Reject::MissingPage)?);
                        }
                        inbound.verify_checksum(&done, root.finish())
                    });
                    match checked {
                        Ok(()) => {
                            pool.set_state(&table, PageState::Sealed)
                                .expect("verified pages go Receiving -> Sealed");
                            Ok(Instant::now())
                        }
                        Err(reject) => Err(format!("transfer refused: {reject:?}")),
                    }
                }
                Some(other) => Err(format!("unexpected frame {other:?}")),
                None => Err("the link closed".into()),
            };
            if let Some(refused) = receiver_sink.refused() {
                let _ = sealed_tx.send(Err(refused));
            } else {
                let _ = sealed_tx.send(verdict);
            }
            pool.release(table)
                .expect("the table is the receiver's own");
        }
    });

    let mut points = Vec::new();
    let mut transfer_id = 0u64;
    for &count in tokens {
        let mut totals = Vec::new();
        let mut packs = Vec::new();
        for rep in 0..reps.max(1) {
            transfer_id += 1;
            let owner = Owner {
                tenant: TenantId(1),
                request: RequestId(transfer_id),
            };
            let table = sender_pool.allocate(owner, count)?;
            {
                // Untimed: prefill's K/V, any bytes will do (not zeros: no shortcut anywhere).
                let mut views = sender_pool.verify_batch(&[&table])?;
                let view = &mut views[0];
                for index in 0..view.page_len() {
                    let page: &mut [u8] = bytemuck::cast_slice_mut(view.page_mut(index));
                    let fill = (rep as u8).wrapping_add(index as u8) | 1;
                    page.fill(fill);
                }
            }
            let transfer = TransferId(transfer_id);
            expect_tx
                .send(Expect {
                    transfer,
                    owner,
                    tokens: count,
                })
                .ok()
                .context("the receiving thread stopped")?;
            ready_rx.recv().context("the receiving thread stopped")?;

            // Timed from here: what the prefill engine does in send_pages, then the wire and
            // the decode engine's accept, copy and checksum.
            let started = Instant::now();
            sender_pool.set_state(&table, PageState::Sealed)?;
            // As the engine sends: pages lent from the pool and handed to the link's writer,
            // which hashes each page as it writes (or copies) it and computes `Done`'s
            // checksum.
            let lent = sender_pool.lend(&table, 0..table.pages().len())?;
            let done = TransferDone {
                transfer,
                request: owner.request,
                tenant: owner.tenant,
                page_count: lent.len() as u32,
                token_count: count as u32,
                checksum: 0,
            };
            for (index, page) in lent.into_iter().enumerate() {
                sender_link
                    .tx
                    .send(Frame::Page {
                        transfer,
                        request: owner.request,
                        tenant: owner.tenant,
                        index: index as u32,
                        bytes: PageBytes::Lent(page),
                    })
                    .ok()
                    .context("the sending link closed")?;
            }
            sender_link
                .tx
                .send(Frame::Done(done))
                .ok()
                .context("the sending link closed")?;
            let packed = started.elapsed().as_secs_f64();
            let sealed = sealed_rx
                .recv()
                .context("the receiving thread stopped")?
                .map_err(anyhow::Error::msg)?;
            totals.push(sealed.duration_since(started).as_secs_f64());
            packs.push(packed);
            sender_pool.release(table)?;
        }
        let pages = layout.pages_for_tokens(count);
        let point = TransferPoint {
            tokens: count,
            pages,
            bytes: pages * page_bytes,
            seconds: stats::median(&totals),
            pack_seconds: stats::median(&packs),
        };
        eprintln!(
            "  transfer {count} tokens ({:.1} MB): {:.2} ms, {:.2} GB/s",
            point.bytes as f64 / 1e6,
            point.seconds * 1e3,
            point.gb_per_s()
        );
        points.push(point);
    }
    drop(expect_tx);
    receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the receiving thread panicked"))?;
    drop(sender_link);
    drop(runtime);
    Ok(points)
}

type Links = (transfer::transport::Link, transfer::transport::Link);

/// A sending link and a receiving one over loopback TCP.
async fn tcp_links(sink: Arc<BenchSink>) -> Result<Links> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (connected, accepted) =
        tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (connected, (accepted, _)) = (connected?, accepted?);
    connected.set_nodelay(true)?;
    accepted.set_nodelay(true)?;
    let sender = transfer::transport::spawn_hashing_link(
        Box::new(connected),
        "bench-prefill".into(),
        transfer::SenderHashes::default(),
    );
    let page_sink: Arc<dyn PageSink> = sink;
    let receiver = transfer::transport::spawn_link_with_sink(
        Box::new(accepted),
        "bench-decode".into(),
        Some(page_sink),
    );
    Ok((sender, receiver))
}

/// A one-sided sending link that writes into `receiver_pool` (shared memory), and the
/// receiving link that grants its pages, over a Unix socket pair.
async fn one_sided_links(receiver_pool: &PagePool, sink: Arc<BenchSink>) -> Result<Links> {
    let (prefill_end, decode_end) = tokio::net::UnixStream::pair()?;
    let fence = hugemem::shared::WriteFence::create()?;
    let pool_fd = receiver_pool.shared_fd().context("a shared pool")?;
    let page_bytes = receiver_pool.layout().page_bytes();
    let page_count = receiver_pool.page_count() as u32;
    let offered =
        one_sided::offer_pool(&decode_end, pool_fd, page_count, page_bytes as u64, &fence);
    let accepted = one_sided::accept_pool(&prefill_end, page_bytes);
    let (offered, accepted) = tokio::join!(offered, accepted);
    offered?;
    let sender = one_sided::spawn_one_sided_link(
        Box::new(prefill_end),
        "bench-prefill".into(),
        Arc::new(accepted?),
        one_sided::WriterFaults::default(),
    );
    let page_sink: Arc<dyn PageSink> = sink;
    let receiver = transfer::transport::spawn_link_with_sink(
        Box::new(decode_end),
        "bench-decode".into(),
        Some(page_sink),
    );
    Ok((sender, receiver))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_parse_and_refuse_nonsense() {
        let specs = [
            "concurrency=1,2,4".to_string(),
            "prompt-tokens=128, 256,max".to_string(),
            "transfer-tokens=128".to_string(),
        ];
        let sweeps = Sweeps::parse(&specs).unwrap();
        assert_eq!(sweeps.concurrency, Some(vec![1, 2, 4]));
        assert_eq!(
            sweeps.prompt_tokens,
            Some(vec![
                PromptLength::Tokens(128),
                PromptLength::Tokens(256),
                PromptLength::Max
            ])
        );
        assert_eq!(sweeps.transfer_tokens, Some(vec![128]));
        let none = Sweeps::parse(&["concurrency=none".to_string()]).unwrap();
        assert_eq!(none.concurrency, Some(vec![]));
        for bad in [
            "concurrency",
            "concurrency=0",
            "concurrency=1,,2",
            "threads=1",
            "prompt-tokens=big",
        ] {
            assert!(Sweeps::parse(&[bad.to_string()]).is_err(), "{bad}");
        }
        let twice = ["concurrency=1".to_string(), "concurrency=2".to_string()];
        assert!(Sweeps::parse(&twice).is_err());
    }

    #[test]
    fn pool_gauges_are_read_per_worker() {
        let text = "# HELP airlock_kv_pages_free Free KV pages per worker.\n\
            # TYPE airlock_kv_pages_free gauge\n\
            airlock_kv_pages_free{worker=\"prefill-0\",role=\"prefill\"} 500\n\
            airlock_kv_pages_free{worker=\"decode \\\"b\\\"\",role=\"decode\"} 12\n\
            airlock_kv_pages_used{worker=\"prefill-0\",role=\"prefill\"} 12\n\
            airlock_kv_pages_used{worker=\"decode \\\"b\\\"\",role=\"decode\"} 500\n\
            airlock_kv_pages_used{worker=\"lonely\",role=\"decode\"} 1\n\
            airlock_kv_pages_quarantined{worker=\"prefill-0\",role=\"prefill\"} 0\n";
        assert_eq!(
            parse_pool_gauges(text),
            vec![
                ("prefill-0".to_string(), 12.0, 500.0),
                ("decode \"b\"".to_string(), 500.0, 12.0),
            ]
        );
        assert!(parse_pool_gauges("no metrics here").is_empty());
    }

    #[test]
    fn prompts_hit_the_token_count() {
        // A stand-in tokenizer: one token per word, two for words over six letters.
        let count = |text: &str| -> usize {
            text.split_whitespace()
                .map(|w| if w.len() > 6 { 2 } else { 1 })
                .sum()
        };
        for tokens in [1, 2, 37, 128, 1000] {
            let (text, have) = prompt_of_tokens(&count, tokens, 7);
            assert_eq!(have, tokens, "{text}");
            assert_eq!(count(&text), tokens);
        }
        // Different seeds start differently (no shared prefix).
        let (a, _) = prompt_of_tokens(&count, 64, 1);
        let (b, _) = prompt_of_tokens(&count, 64, 2);
        assert_ne!(a.split(' ').next(), b.split(' ').next());
    }

    #[test]
    fn a_small_transfer_round_trips() {
        let layout = kv::KvLayout {
            layer_count: 2,
            kv_head_count: 1,
            head_dim: 8,
            page_size_tokens: 4,
        };
        let report = transfer_sweep(layout, &[3, 9], 2, 1 << 20).unwrap();
        assert_eq!(report.points.len(), 2);
        assert_eq!(report.points[1].pages, 3);
        assert_eq!(report.points[1].bytes, 3 * layout.page_bytes());
        assert!(report.points.iter().all(|p| p.seconds > 0.0));
        // The one-sided sweep verifies every transfer too (a refused one is an error).
        assert_eq!(report.shm_points.len(), 2);
        assert_eq!(report.shm_points[1].bytes, report.points[1].bytes);
        assert!(report.shm_points.iter().all(|p| p.seconds > 0.0));
        assert!(report.memcpy_gb_s > 0.0 && report.xxh3_gb_s > 0.0);
    }
}
