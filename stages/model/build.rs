//! With the `cuda` feature, compiles `src/nn/fused/kernels.cu` (the fused training ops, loaded by
//! `src/nn/fused/cuda.rs`) and `src/nn/fused/flash.cu` (flash attention, `src/nn/fused/flash.rs`) to PTX. CPU builds compile nothing, so no CUDA toolkit is
//! needed there; ../shared/cuda/README.md says how to get `nvcc` for a GPU build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/nn/fused/kernels.cu");
    println!("cargo:rerun-if-changed=src/nn/fused/flash.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in ["kernels", "flash"] {
        let out = out_dir.join(format!("{name}.ptx"));
        let source = format!("src/nn/fused/{name}.cu");
        let status = Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch=sm_{cap}"), &source, "-o"])
            .arg(&out)
            .status()
            .unwrap_or_else(|e| {
                panic!("running nvcc for the fused kernels: {e} (is the CUDA toolkit on PATH?)")
            });
        assert!(status.success(), "nvcc failed on {source}");
    }
}
