//! With the `cuda` feature, compiles `src/nn/fused/kernels.cu` to PTX for the fused training ops
//! (`src/nn/fused/cuda.rs` loads it at run time). CPU builds compile nothing, so no CUDA toolkit is
//! needed there; ../shared/cuda/README.md says how to get `nvcc` for a GPU build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/nn/fused/kernels.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("kernels.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new("nvcc")
        .args([
            "--ptx",
            "-O3",
            &format!("-arch=sm_{cap}"),
            "src/nn/fused/kernels.cu",
            "-o",
        ])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| {
            panic!("running nvcc for the fused kernels: {e} (is the CUDA toolkit on PATH?)")
        });
    assert!(status.success(), "nvcc failed on src/nn/fused/kernels.cu");
}
