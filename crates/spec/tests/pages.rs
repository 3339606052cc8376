//! The model's copy of the page rules (`spec::pages`) against the real `kv::PagePool`: the
//! same random operations applied to both, with identical outcomes (every error, down to the
//! page it names), free counts and page headers required after every step.

use kv::{
    Generation, KvLayout, Owner, PageId, PagePool, PageState, PageTable, PoolConfig, PoolSize,
    RequestId, TenantId,
};
use proptest::prelude::*;
use spec::pages::{Access, Pool, PoolError, Table};

const PAGES: u8 = 4;

/// One token per page, as in the model.
const LAYOUT: KvLayout = KvLayout {
    layer_count: 1,
    kv_head_count: 1,
    head_dim: 1,
    page_size_tokens: 1,
};

const STATES: [PageState; 6] = [
    PageState::Free,
    PageState::Writing,
    PageState::Sealed,
    PageState::Sending,
    PageState::Receiving,
    PageState::Quarantined,
];

fn owner(request: u8) -> Owner {
    Owner {
        tenant: TenantId(u64::from(request % 2)),
        request: RequestId(u64::from(request)),
    }
}

/// One table as both pools know it: issued by an allocation, or forged from one.
#[derive(Clone, Debug)]
struct Handle {
    owner: u8,
    table: Table,
}

impl Handle {
    fn real(&self) -> PageTable {
        let pages = self
            .table
            .iter()
            .map(|&(page, generation)| (PageId(u32::from(page)), Generation(u64::from(generation))))
            .collect();
        PageTable::forge(owner(self.owner), pages)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        owner: u8,
        pages: usize,
    },
    Release {
        handle: usize,
    },
    SetState {
        handle: usize,
        state: usize,
    },
    VerifyBatch {
        handles: Vec<usize>,
    },
    VerifyReceiving {
        handle: usize,
    },
    /// A copy of a table claiming another owner.
    ForgeOwner {
        handle: usize,
        owner: u8,
    },
    /// A copy of a table one generation ahead on its first page (never issued yet).
    ForgeGeneration {
        handle: usize,
    },
    /// A copy of a table with a page past the pool's end appended.
    ForgeUnknown {
        handle: usize,
    },
    /// A copy of a table with its first page twice.
    ForgeDuplicate {
        handle: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0usize..=PAGES as usize + 1)
            .prop_map(|(owner, pages)| Op::Allocate { owner, pages }),
        3 => any::<usize>().prop_map(|handle| Op::Release { handle }),
        3 => (any::<usize>(), 0..STATES.len())
            .prop_map(|(handle, state)| Op::SetState { handle, state }),
        3 => prop::collection::vec(any::<usize>(), 1..=3)
            .prop_map(|handles| Op::VerifyBatch { handles }),
        2 => any::<usize>().prop_map(|handle| Op::VerifyReceiving { handle }),
        1 => (any::<usize>(), 0u8..3).prop_map(|(handle, owner)| Op::ForgeOwner { handle, owner }),
        1 => any::<usize>().prop_map(|handle| Op::ForgeGeneration { handle }),
        1 => any::<usize>().prop_map(|handle| Op::ForgeUnknown { handle }),
        1 => any::<usize>().prop_map(|handle| Op::ForgeDuplicate { handle }),
    ]
}

/// `kv::Error` in the copy's terms.
fn outcome<T>(result: kv::Result<T>) -> Result<(), PoolError> {
    let page = |page: PageId| u8::try_from(page.0).expect("small pool");
    match result {
        Ok(_) => Ok(()),
        Err(error) => Err(match error {
            kv::Error::OutOfPages { needed, free } => PoolError::OutOfPages { needed, free },
            kv::Error::UnknownPage { page: p } => PoolError::UnknownPage { page: page(p) },
            kv::Error::StaleGeneration { page: p, .. } => {
                PoolError::StaleGeneration { page: page(p) }
            }
            kv::Error::OwnerMismatch { page: p, .. } => PoolError::OwnerMismatch { page: page(p) },
            kv::Error::PageNotReadable { page: p, .. } => {
                PoolError::PageNotReadable { page: page(p) }
            }
            kv::Error::DuplicatePage { page: p } => PoolError::DuplicatePage { page: page(p) },
            kv::Error::InvalidTransition { page: p, .. } => {
                PoolError::InvalidTransition { page: page(p) }
            }
            other => panic!("the page rules do not produce {other:?}"),
        }),
    }
}

fn run(ops: Vec<Op>) {
    let mut real = PagePool::new(PoolConfig {
        layout: LAYOUT,
        size: PoolSize::Tokens(PAGES as usize),
        scrub_on_free: false,
    })
    .expect("a valid pool");
    let mut copy = Pool::new(PAGES);
    let mut handles: Vec<Handle> = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        let pick = |index: usize| handles[index % handles.len()].clone();
        let (ours, theirs) = match op {
            Op::Allocate { owner: o, pages } => {
                let ours = copy.allocate(o, pages, true);
                let theirs = real.allocate(owner(o), pages);
                if let (Ok(table), Ok(real_table)) = (&ours, &theirs) {
                    let handle = Handle {
                        owner: o,
                        table: table.clone(),
                    };
                    assert_eq!(&handle.real(), real_table, "step {step}: same pages");
                    handles.push(handle);
                }
                (ours.map(|_| ()), outcome(theirs))
            }
            _ if handles.is_empty() => continue,
            Op::Release { handle } => {
                let handle = pick(handle);
                (
                    copy.release(handle.owner, &handle.table),
                    outcome(real.release(handle.real())),
                )
            }
            Op::SetState { handle, state } => {
                let handle = pick(handle);
                let state = STATES[state];
                (
                    copy.set_state(handle.owner, &handle.table, state),
                    outcome(real.set_state(&handle.real(), state)),
                )
            }
            Op::VerifyBatch { handles: picked } => {
                let picked: Vec<Handle> = picked.into_iter().map(pick).collect();
                let claims: Vec<(u8, &Table)> =
                    picked.iter().map(|h| (h.owner, &h.table)).collect();
                let tables: Vec<PageTable> = picked.iter().map(Handle::real).collect();
                let refs: Vec<&PageTable> = tables.iter().collect();
                (
                    copy.verify(&claims, Access::Bytes, false),
                    outcome(real.verify_batch(&refs).map(|_| ())),
                )
            }
            Op::VerifyReceiving { handle } => {
                let handle = pick(handle);
                (
                    copy.verify(&[(handle.owner, &handle.table)], Access::Receive, false),
                    outcome(real.verify_receiving(&handle.real()).map(|_| ())),
                )
            }
            Op::ForgeOwner { handle, owner } => {
                let mut forged = pick(handle);
                forged.owner = owner;
                handles.push(forged);
                continue;
            }
            Op::ForgeGeneration { handle } => {
                let mut forged = pick(handle);
                if let Some(first) = forged.table.first_mut() {
                    first.1 += 1;
                }
                handles.push(forged);
                continue;
            }
            Op::ForgeUnknown { handle } => {
                let mut forged = pick(handle);
                forged.table.push((PAGES, 1));
                handles.push(forged);
                continue;
            }
            Op::ForgeDuplicate { handle } => {
                let mut forged = pick(handle);
                if let Some(&first) = forged.table.first() {
                    forged.table.push(first);
                }
                handles.push(forged);
                continue;
            }
        };
        assert_eq!(ours, theirs, "step {step}: outcome");
        real.check_invariants();
        assert!(copy.consistent(), "step {step}: the copy's own bookkeeping");
        assert_eq!(
            copy.pages_free(),
            real.pages_free(),
            "step {step}: free pages"
        );
        for (index, header) in copy.headers().iter().enumerate() {
            let theirs = real.header(PageId(index as u32)).expect("same page count");
            let their_owner = theirs.holder.map(|holder| {
                let kv::Holder::Request(o) = holder else {
                    panic!("step {step}: the copy never shares a page");
                };
                assert_eq!(o, owner(o.request.0 as u8), "owners are the ones we gave");
                o.request.0 as u8
            });
            assert_eq!(
                (header.owner, u64::from(header.generation), header.state),
                (their_owner, theirs.generation.0, theirs.state),
                "step {step}: header of page {index}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_models_page_rules_agree_with_kv_page_pool(ops in prop::collection::vec(op(), 1..60)) {
        run(ops);
    }
}

/// The life cycle the model drives, spelled out once: every outcome it relies on.
#[test]
fn the_transfer_life_cycle_agrees_step_by_step() {
    use Op::*;
    run(vec![
        // Request 0 reserves two pages, receives, seals; request 1 cannot fit beside it.
        Allocate { owner: 0, pages: 2 },
        SetState {
            handle: 0,
            state: 4,
        },
        VerifyReceiving { handle: 0 },
        Allocate { owner: 1, pages: 3 },
        SetState {
            handle: 0,
            state: 2,
        },
        VerifyBatch { handles: vec![0] },
        // It finishes; request 1 takes the same pages back (LIFO), one generation on.
        Release { handle: 0 },
        Allocate { owner: 1, pages: 2 },
        SetState {
            handle: 1,
            state: 4,
        },
        // The stale table: refused for bytes, for receiving, for release, for state changes.
        VerifyReceiving { handle: 0 },
        VerifyBatch { handles: vec![0] },
        Release { handle: 0 },
        SetState {
            handle: 0,
            state: 5,
        },
        // Request 1 is aborted on a one-sided transport: quarantined, then released.
        SetState {
            handle: 1,
            state: 5,
        },
        VerifyBatch { handles: vec![1] },
        SetState {
            handle: 1,
            state: 2,
        },
        Release { handle: 1 },
        Release { handle: 1 },
    ]);
}
