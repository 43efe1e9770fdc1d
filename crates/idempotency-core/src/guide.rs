//! The guides of the project's `docs/` folder, as part of these docs.

#[doc = include_str!("../../../docs/PROTOCOL.md")]
pub mod protocol {}

#[doc = include_str!("../../../docs/WRITING-A-STORE.md")]
pub mod writing_a_store {}
