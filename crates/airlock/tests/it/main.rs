//! End-to-end tests of the `airlock` binary and of a serving cluster (router + workers over
//! real TCP on loopback) on the real model.

mod api;
mod cli;
mod cluster;
mod harness;
mod processes;
mod serving;
