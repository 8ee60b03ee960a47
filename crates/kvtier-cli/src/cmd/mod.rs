//! The `kvtier` subcommands: argument structs and their entry points (the binary only dispatches).

pub mod bench;
pub mod inspect;
pub mod node;
pub mod serve;
