//! `airlock-fault-injection`: the same command line for tests, whose workers obey
//! `AIRLOCK_FAULTS` where built with fault injection (see `lib.rs`). Never serve users with it.

fn main() {
    airlock::main(airlock::Faults::FromEnv);
}
