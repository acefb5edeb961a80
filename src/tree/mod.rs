//! The approximate prefix tree of where request text was sent: a persistent radix tree per model
//! (`node`), published read-only to every core through `ArcSwap`, mutated by one writer thread
//! (`writer`) that also evicts. Cores never lock, never wait: they `load()` and `try_send`.

pub mod node;
pub mod writer;

pub use node::{Match, RadixTree};
pub use writer::{
    spawn_writer, spawn_writer_held, Forest, HeldWriter, Insert, TreeHandle, TreeKey, WriterConfig,
    WriterStats,
};
