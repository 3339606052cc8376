//! The model checks: the transfer protocol ([`transfer`]) and the prefix cache with its delta
//! transfer ([`prefix_cache`]). Each explores its model exhaustively within small bounds, and
//! has one test per mutant showing the checker finds the counterexample for the invariant that
//! mutant's guard protects.
//!
//! Every check prints the states it explored; every mutant prints its counterexample.

mod prefix_cache;
mod transfer;
