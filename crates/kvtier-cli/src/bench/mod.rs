//! `kvtier bench`: recognisable workloads run against several engine configurations in one process,
//! reported as a table, JSON and a PNG chart.
//!
//! [`workload`] says what is sent, [`runner`] sends it to one engine, [`report`] summarises,
//! [`chart`] draws, [`suite`] runs every configuration one after another and checks that every
//! configuration produced the same tokens. [`command`] is `kvtier bench` itself, [`transfer`]
//! its `transfer` subcommand (tier transfer throughput).

pub mod chart;
pub mod command;
pub mod report;
pub mod runner;
pub mod suite;
pub mod transfer;
pub mod workload;
