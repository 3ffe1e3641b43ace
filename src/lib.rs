//! dflash: declarative, content-addressed pipelines for training DFlash drafters.
//!
//! Data flows through one module per step: [`pipeline`] (YAML -> validated spec) ->
//! [`graph`] (the DAG) -> [`key`] (content keys) -> [`store`] (create-only artifact store) ->
//! [`run`] (the executor). [`plan`] answers "what will run and why"; [`cli`] wires them into the
//! `dflash` command.

pub mod cli;
pub mod estimate;
pub mod graph;
pub mod hashcache;
pub mod html;
pub mod key;
pub mod kinds;
pub mod lineage;
pub mod pipeline;
pub mod plan;
pub mod run;
pub mod store;
