//! Model code shared by the `train` and `bench` stages and by `dflash estimate`.
//!
//! [`shape`] knows a decoder-only model's dimensions (from `config.json`, GGUF metadata or a table
//! of well-known models) and the parameter and FLOP counts that follow from them; [`drafter`]
//! derives the DFlash drafter's shape from its target's, as the reference implementation does;
//! [`threads`] fixes the CPU matmul thread count once per process.

pub mod drafter;
#[cfg(feature = "nn")]
pub mod nn;
pub mod shape;
pub mod threads;

pub use drafter::{Dflash2Config, DrafterShape};
pub use shape::{ModelShape, ShapeSource};
