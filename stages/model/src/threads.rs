//! How many threads a CPU matmul uses, decided once per process.
//!
//! candle (0.11) asks for its matmul thread count on every CPU matmul, and on Linux, unless
//! `RAYON_NUM_THREADS` is set, answers by reading and parsing `/proc/cpuinfo` (which the kernel
//! formats afresh on every read) while the matmul's other thread waits: a decoding step of
//! SmolLM2-135M runs ~210 matmuls, so each step read that file ~210 times (`perf`:
//! `show_cpuinfo` under `read` from `num_cpus::get_physical`).
//! [`settle_cpu_threads`] asks once and sets the variable to candle's own answer, so every later
//! matmul reads an environment variable instead: the same thread count, the same sums in the
//! same order (CPU training stays bit-for-bit); a decoding step's matmuls took 36 ms before and
//! 23 after on two cores (README "CPU threads").

/// Fix the CPU matmul thread count at what candle would pick (`RAYON_NUM_THREADS`, unless the
/// user set it), keeping rayon's own pool at its default (every logical CPU), which that
/// variable would otherwise size; the commands and servers stages start get the user's
/// environment back (`dflash_stage_api::process::as_the_user_set`). Without the `nn` feature
/// (no candle) it does nothing.
///
/// # Safety
/// It sets an environment variable: call it first thing in `main`, while no other thread
/// exists (`std::env::set_var`'s contract).
#[allow(unsafe_code)]
pub unsafe fn settle_cpu_threads() {
    #[cfg(feature = "nn")]
    {
        if std::env::var_os("RAYON_NUM_THREADS").is_some() {
            return;
        }
        let matmul = candle_core::utils::get_num_threads();
        let logical = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        // SAFETY: the caller's contract: no other thread exists yet.
        unsafe {
            std::env::set_var("RAYON_NUM_THREADS", matmul.to_string());
            // Stages take both back out of the environment their children get.
            std::env::set_var(dflash_stage_api::process::THREADS_SETTLED_MARK, "1");
        }
        // Sized explicitly, rayon's pool ignores the variable (and a pool already built, by an
        // embedding program, stays as it is).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(logical)
            .build_global();
    }
}
