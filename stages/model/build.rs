//! With the `cuda` feature, compiles `src/nn/fused/kernels.cu` (the fused training ops, loaded by
//! `src/nn/fused/cuda.rs`) and `src/nn/fused/flash.cu` (flash attention, `src/nn/fused/flash.rs`) to PTX. CPU builds compile nothing, so no CUDA toolkit is
//! needed there; ../shared/cuda/README.md says how to get `nvcc` for a GPU build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/nn/fused/kernels.cu");
    println!("cargo:rerun-if-changed=src/nn/fused/flash.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rustc-check-cfg=cfg(dflash_wgmma_ptx)");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in ["kernels", "flash"] {
        let out = out_dir.join(format!("{name}.ptx"));
        let source = format!("src/nn/fused/{name}.cu");
        // Hopper's warpgroup MMA (flash.cu's `flash_forward_wg`) is an sm_90a feature: the
        // flash PTX for compute capability 9.0 targets it (it loads on 9.0 devices only, which
        // is what a 9.0 build is for); other capabilities compile that kernel as a stub.
        let arch = if cap == "90" && name == "flash" {
            // flash.rs picks `flash_forward_wg` only where this is set.
            println!("cargo:rustc-cfg=dflash_wgmma_ptx");
            "sm_90a".to_owned()
        } else {
            format!("sm_{cap}")
        };
        let status = Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch={arch}"), &source, "-o"])
            .arg(&out)
            .status()
            .unwrap_or_else(|e| {
                panic!("running nvcc for the fused kernels: {e} (is the CUDA toolkit on PATH?)")
            });
        assert!(status.success(), "nvcc failed on {source}");
    }
}
