//! Where the networks run: the `device:` param that `train`, `bench` and `generate`'s candle
//! backend share (`auto`, `cpu`, `cuda`), resolved once, with an error that names the fix when
//! this build or this machine has no GPU.

use candle_core::Device;

/// The values the `device:` param takes.
pub const CHOICES: &[&str] = &["auto", "cpu", "cuda"];

/// `cpu`; `cuda` (GPU 0, an error naming the fix when this build or machine has none); or
/// `auto` (GPU 0 when there is one, else the CPU). Returns the error text and its hint.
pub fn select(choice: &str) -> Result<Device, (String, String)> {
    let cuda = candle_core::utils::cuda_is_available();
    match choice {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !cuda => Err((
            "this build of dflash has no CUDA support".into(),
            "build with `--features cuda` (../shared/cuda/README.md), or set `device: cpu`".into(),
        )),
        "cuda" => Device::new_cuda(0)
            .map_err(|e| (format!("no usable GPU: {e}"), "set `device: cpu`".into())),
        _ if cuda => Ok(Device::new_cuda(0).unwrap_or(Device::Cpu)),
        _ => Ok(Device::Cpu),
    }
}
