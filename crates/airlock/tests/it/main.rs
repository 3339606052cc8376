//! End-to-end tests of the `airlock` binary and of a serving cluster (router + workers over
//! real TCP on loopback) on the real model.

mod api;
mod architectures;
mod canary;
mod cli;
mod cluster;
mod deploy;
mod edge;
mod fuzz;
mod harness;
mod logprobs;
mod matrix;
mod openapi;
mod prefix;
mod processes;
mod serving;
mod structured;
mod tools;
