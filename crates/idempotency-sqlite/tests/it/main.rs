//! The SQLite store from the outside, in one test binary (one link instead of one per file): the
//! conformance suite, durability and group commit under SIGKILL, first opens and bad input.

mod bad_input;
mod conformance;
mod durability;
mod first_open;
mod group_commit;
