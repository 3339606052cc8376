//! `airlock`, the server: the command line with fault injection refused (see `lib.rs`).

fn main() {
    airlock::main(airlock::Faults::Refused);
}
