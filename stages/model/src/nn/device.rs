//! Where the networks run: the `device:` param that `train`, `bench` and `generate`'s candle
//! backend share (`auto`, `cpu`, `cuda`), resolved once, with an error that names the fix when
//! this build or this machine has no GPU.

use candle_core::Device;
use dflash_stage_api::StageError;

/// The values the `device:` param takes.
pub const CHOICES: &[&str] = &["auto", "cpu", "cuda"];

/// `cpu`; `cuda` (GPU 0, an error naming the fix when this build or machine has none); or
/// `auto` (GPU 0 when there is one, else the CPU).
pub fn select(choice: &str) -> Result<Device, StageError> {
    let cuda = candle_core::utils::cuda_is_available();
    match choice {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !cuda => Err(StageError::new("this build of dflash has no CUDA support")
            .with_help(
                "build with `--features cuda` (../shared/cuda/README.md), or set `device: cpu`",
            )),
        "cuda" => Device::new_cuda(0).map_err(|e| {
            StageError::new(format!("no usable GPU: {e}")).with_help("set `device: cpu`")
        }),
        _ if cuda => Ok(Device::new_cuda(0).unwrap_or(Device::Cpu)),
        _ => Ok(Device::Cpu),
    }
}
