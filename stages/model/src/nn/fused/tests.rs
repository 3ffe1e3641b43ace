//! The fused ops against the composed candle ops they replace, values and gradients, in f64.

use candle_core::{D, DType, Device, Tensor, Var};

use super::*;
use crate::nn::ops;

/// The composed references the fused ops replaced: softmax and log-softmax over the last
/// dimension from differentiable candle ops.
fn softmax_last(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).unwrap().detach();
    let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

fn log_softmax_last(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).unwrap().detach();
    let shifted = x.broadcast_sub(&max).unwrap();
    let lse = shifted
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap();
    shifted.broadcast_sub(&lse).unwrap()
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    crate::nn::drafter::Init::new(seed)
        .normal(shape, 1.0, DType::F64, &Device::Cpu)
        .expect("cpu")
}

use crate::nn::testing::max_diff;

/// A mask with a fully masked row and a row that sees one key.
fn mask(nq: usize, nk: usize) -> Tensor {
    let v: Vec<f64> = (0..nq * nk)
        .map(|i| {
            let (r, c) = (i / nk, i % nk);
            let open = r != 1 && (r == 2 && c == 0 || r != 2 && (c + r) % 3 != 0);
            if open { 0.0 } else { f64::NEG_INFINITY }
        })
        .collect();
    Tensor::from_vec(v, (nq, nk), &Device::Cpu).unwrap()
}

#[test]
fn masked_softmax_and_its_gradient_match_the_composed_ops() {
    let (nq, nk, scale) = (5, 7, 0.3);
    let x = Var::from_tensor(&randn(&[2, nq, nk], 1)).unwrap();
    let w = randn(&[2, nq, nk], 2);
    let mask = mask(nq, nk);
    let fused = masked_softmax(x.as_tensor(), &mask, scale).unwrap();
    let fused_grads = (&fused * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let z = (x.as_tensor() * scale)
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    let composed = softmax_last(&z);
    // The composed softmax gives NaN on the fully masked row; the fused op gives zeros.
    let row1 = |t: &Tensor| t.narrow(D::Minus2, 1, 1).unwrap();
    assert_eq!(
        max_diff(&row1(&fused), &row1(&fused).zeros_like().unwrap()),
        0.0
    );
    let keep = |t: &Tensor| {
        Tensor::cat(
            &[
                t.narrow(D::Minus2, 0, 1).unwrap(),
                t.narrow(D::Minus2, 2, nq - 2).unwrap(),
            ],
            D::Minus2,
        )
        .unwrap()
    };
    let d = max_diff(&keep(&fused), &keep(&composed));
    assert!(d < 1e-12, "{d}: {fused} vs {composed}");
    let composed_grads = (&keep(&composed) * &keep(&w))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (gf, gc) = (
        fused_grads.get(x.as_tensor()).unwrap(),
        composed_grads.get(x.as_tensor()).unwrap(),
    );
    assert!(max_diff(&keep(gf), &keep(gc)) < 1e-12, "{gf} vs {gc}");
    assert_eq!(max_diff(&row1(gf), &row1(gf).zeros_like().unwrap()), 0.0);
}

#[test]
fn cross_entropy_and_its_gradient_match_the_composed_ops() {
    let z = Var::from_tensor(&randn(&[4, 9], 3)).unwrap();
    let labels = [0u32, 8, 3, 3];
    let w = Tensor::new(&[1.0f64, 0.5, 0.0, 2.0], &Device::Cpu).unwrap();
    let fused = cross_entropy(z.as_tensor(), &labels).unwrap();
    let gf = (&fused * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let y = Tensor::new(&labels, &Device::Cpu)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    let composed = log_softmax_last(z.as_tensor())
        .gather(&y, 1)
        .unwrap()
        .squeeze(1)
        .unwrap()
        .neg()
        .unwrap();
    assert!(max_diff(&fused, &composed) < 1e-12);
    let gc = (&composed * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (gf, gc) = (
        gf.get(z.as_tensor()).unwrap(),
        gc.get(z.as_tensor()).unwrap(),
    );
    assert!(max_diff(gf, gc) < 1e-12, "{gf} vs {gc}");
    assert!(cross_entropy(z.as_tensor(), &[0, 9, 0, 0]).is_err());
}

#[test]
fn the_adamw_update_is_pytorchs() {
    // One step by hand: m = 0.1 g, v = 0.001 g^2, p' = p (1 - lr wd) - lr m^ / (sqrt(v^) + eps).
    let p = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu).unwrap();
    let g = Tensor::new(&[0.5f32, 0.25, -4.0], &Device::Cpu).unwrap();
    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
    let step = hand_step();
    adamw_update(&p, &g, &m, &v, &step).unwrap();
    let got = p.to_vec1::<f32>().unwrap();
    for (i, (&p0, &g0)) in [1.0f32, -2.0, 0.5]
        .iter()
        .zip(&[0.5f32, 0.25, -4.0])
        .enumerate()
    {
        let g = f64::from(g0) * 0.5;
        let (mh, vh) = (0.1 * g / 0.1, 0.001 * g * g / 0.001);
        let want = f64::from(p0) * (1.0 - 0.1 * 0.01) - 0.1 * mh / (vh.sqrt() + 1e-8);
        assert!(
            (f64::from(got[i]) - want).abs() < 1e-6,
            "{i}: {} vs {want}",
            got[i]
        );
    }
    assert!((m.to_vec1::<f32>().unwrap()[2] - 0.1 * -2.0).abs() < 1e-7);
}

/// The AdamW step the hand-checked tests take: the first (bias corrections 0.1 and 0.001), the
/// gradient clipped by half.
fn hand_step() -> AdamStep {
    AdamStep {
        lr: 0.1,
        weight_decay: 0.01,
        betas: (0.9, 0.999),
        corrections: (0.1, 0.001),
        eps: 1e-8,
        clip_scale: 0.5,
        rounding_seed: 0,
    }
}

/// `low` is `p` cast to bf16, element for element.
fn assert_is_the_cast(low: &Tensor, p: &Tensor) {
    assert_eq!(
        low.to_vec1::<half::bf16>().unwrap(),
        p.to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
    );
}

/// Master weights updated from a bf16 gradient are the update from that gradient widened, and
/// the kept copy is the updated weights' cast, in place (the copy's buffer is the one passed).
#[test]
fn the_master_update_keeps_the_weights_cast() {
    let p = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &Device::Cpu).unwrap();
    let want = p.copy().unwrap();
    let low = p.to_dtype(DType::BF16).unwrap().copy().unwrap();
    let g = Tensor::new(&[0.5f32, 0.25, -4.0, 1e-3], &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let zeros = || p.zeros_like().unwrap();
    let (m, v, m2, v2) = (zeros(), zeros(), zeros(), zeros());
    let step = hand_step();
    adamw_update_master(&p, &g, &m, &v, &low, &step).unwrap();
    adamw_update(&want, &g.to_dtype(DType::F32).unwrap(), &m2, &v2, &step).unwrap();
    assert_eq!(p.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap());
    assert_ne!(p.to_vec1::<f32>().unwrap(), [1.0f32, -2.0, 0.5, 3.0]);
    assert_is_the_cast(&low, &p);
}

/// Stochastic rounding keeps what bf16 holds exactly, lands on one of the two neighbours
/// otherwise, and is unbiased: over many coins the mean is the value, where rounding to nearest
/// is off by the value's distance to its nearest neighbour.
#[test]
fn stochastic_rounding_is_unbiased() {
    for x in [1.0f32, -3.5, 0.0, f32::INFINITY] {
        assert_eq!(round_stochastic(x, 7, 11), half::bf16::from_f32(x));
    }
    assert!(round_stochastic(f32::NAN, 7, 11).is_nan());
    // bf16 keeps 7 mantissa bits: 1 + 2^-10 lies between 1 and 1 + 2^-7, an eighth of the way.
    let x = 1.0f32 + 2f32.powi(-10);
    let (lo, hi) = (1.0f32, 1.0 + 2f32.powi(-7));
    let n = 100_000u32;
    let mut sum = 0.0f64;
    let mut ups = 0u32;
    for i in 0..n {
        let r = round_stochastic(x, i, 0x1234).to_f32();
        assert!(r == lo || r == hi, "{r}");
        ups += u32::from(r == hi);
        sum += f64::from(r);
    }
    let mean = sum / f64::from(n);
    // An eighth of the coins round up: within 4 standard deviations of binomial(n, 1/8).
    let sd = (f64::from(n) * 0.125 * 0.875).sqrt();
    assert!(
        (f64::from(ups) - f64::from(n) * 0.125).abs() < 4.0 * sd,
        "{ups} of {n} up"
    );
    assert!((mean - f64::from(x)).abs() < 4.0 * sd / f64::from(n) * f64::from(hi - lo));
    assert_eq!(
        half::bf16::from_f32(x).to_f32(),
        lo,
        "round to nearest stays at 1"
    );
}

/// AdamW with bf16 moments follows the f32 moments' run: over 2,000 steps of the same
/// gradient the second moment climbs to 1 - 0.999^2000 = 86% of the gradient's square as the
/// f32 one does (rounding to nearest in bf16 would stall it near a third: past there its 0.1%
/// a step is under half of bf16's resolution), and the weights move alike.
#[test]
fn bf16_moments_follow_f32_moments() {
    let dev = Device::Cpu;
    let g = randn(&[64], 3).to_dtype(DType::F32).unwrap();
    let run = |moments: DType| {
        let p = Tensor::zeros(64, DType::F32, &dev).unwrap();
        let (m, v) = (
            Tensor::zeros(64, moments, &dev).unwrap(),
            Tensor::zeros(64, moments, &dev).unwrap(),
        );
        for t in 1..=2000 {
            let step = AdamStep {
                lr: 1e-3,
                weight_decay: 0.0,
                betas: (0.9, 0.999),
                corrections: (1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t)),
                eps: 1e-8,
                clip_scale: 1.0,
                rounding_seed: coin(t as u32),
            };
            adamw_update(&p, &g, &m, &v, &step).unwrap();
        }
        (p, v.to_dtype(DType::F32).unwrap())
    };
    let (p32, v32) = run(DType::F32);
    let (p16, v16) = run(DType::BF16);
    let ratio = (&v16 / &v32).unwrap().to_vec1::<f32>().unwrap();
    let mean = ratio.iter().sum::<f32>() / ratio.len() as f32;
    let worst = ratio.iter().map(|r| (r - 1.0).abs()).fold(0.0f32, f32::max);
    assert!((mean - 1.0).abs() < 0.02, "bf16 v / f32 v averages {mean}");
    assert!(worst < 0.15, "bf16 v / f32 v off by {worst} somewhere");
    // Each weight moved by about 2,000 x lr = 2 (Adam's step is ~lr whatever the gradient).
    let moved = max_diff(&p32, &p16);
    assert!(moved < 0.05, "bf16 moments' weights {moved} from f32's");
}

/// The master update with bf16 moments keeps the weights' cast, and the moments are bf16
/// still (stored in place, not replaced by f32 ones).
#[test]
fn the_master_update_with_bf16_moments_keeps_the_cast() {
    let p = randn(&[300], 5).to_dtype(DType::F32).unwrap();
    let low = p.to_dtype(DType::BF16).unwrap().copy().unwrap();
    let g = randn(&[300], 6).to_dtype(DType::BF16).unwrap();
    let (m, v) = (
        Tensor::zeros(300, DType::BF16, &Device::Cpu).unwrap(),
        Tensor::zeros(300, DType::BF16, &Device::Cpu).unwrap(),
    );
    adamw_update_master(&p, &g, &m, &v, &low, &hand_step()).unwrap();
    assert_eq!(m.dtype(), DType::BF16);
    assert_is_the_cast(&low, &p);
    // The first step's m is (1 - beta1) * g * clip: within bf16's rounding of it.
    let want = (g.to_dtype(DType::F32).unwrap() * (0.1 * 0.5)).unwrap();
    assert!(max_diff(&m.to_dtype(DType::F32).unwrap(), &want) < 1e-2 * 0.05 * 4.0);
}

/// Value and gradients of `sum(f(x, w) * up)` with `x` and `w` as variables.
fn grads_of(
    f: &dyn Fn(&Tensor, &Tensor) -> Tensor,
    x: &Tensor,
    w: &Tensor,
    up: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    let (xv, wv) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap());
    let y = f(xv.as_tensor(), wv.as_tensor());
    let g = (&y * up).unwrap().sum_all().unwrap().backward().unwrap();
    let gx = g.get(xv.as_tensor()).unwrap().clone();
    let gw = g
        .get(wv.as_tensor())
        .map_or_else(|| w.zeros_like().unwrap(), Clone::clone);
    (y, gx, gw)
}

#[test]
fn rms_norm_and_rope_and_their_gradients_match_the_composed_ops() {
    let x = randn(&[3, 5, 8], 4);
    let up = randn(&[3, 5, 8], 5);
    let w = randn(&[8], 6);
    let composed_norm = |x: &Tensor, w: &Tensor| {
        let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-6)
            .unwrap()
            .sqrt()
            .unwrap()
            .recip()
            .unwrap();
        x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
    };
    let a = grads_of(&|x, w| rms_norm(x, w, 1e-6).unwrap(), &x, &w, &up);
    let b = grads_of(&composed_norm, &x, &w, &up);
    for (p, q) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
        assert!(max_diff(p, q) < 1e-12, "{p} vs {q}");
    }
    let (cos, sin) =
        ops::rope_tables(&[3, 9, 1, 0, 7], 8, 10_000.0, DType::F64, &Device::Cpu).unwrap();
    let composed_rope = |x: &Tensor, _: &Tensor| {
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, 4).unwrap(),
            x.narrow(D::Minus1, 4, 4).unwrap(),
        );
        let c = Tensor::cat(&[&cos, &cos], D::Minus1).unwrap();
        let s = Tensor::cat(&[&sin, &sin], D::Minus1).unwrap();
        let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
        (x.broadcast_mul(&c).unwrap() + rotated.broadcast_mul(&s).unwrap()).unwrap()
    };
    let a = grads_of(&|x, _| rope(x, &cos, &sin).unwrap(), &x, &w, &up);
    let b = grads_of(&composed_rope, &x, &w, &up);
    assert!(max_diff(&a.0, &b.0) < 1e-12 && max_diff(&a.1, &b.1) < 1e-12);
    let total = sum_squares(&x).unwrap().to_vec1::<f32>().unwrap()[0];
    let want = x
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!((f64::from(total) - want).abs() < 1e-4 * want);
}

#[test]
fn rms_norm_weight_gradient_adds_up_every_range_of_rows() {
    // 200 rows: four ranges of the CPU's partial sums, the last one short.
    let x = randn(&[200, 8], 11);
    let up = randn(&[200, 8], 12);
    let w = randn(&[8], 13);
    let (_, _, gw) = grads_of(&|x, w| rms_norm(x, w, 1e-6).unwrap(), &x, &w, &up);
    let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-6)
        .unwrap()
        .sqrt()
        .unwrap()
        .recip()
        .unwrap();
    let want = (&up * x.broadcast_mul(&r).unwrap())
        .unwrap()
        .sum(0)
        .unwrap();
    assert!(max_diff(&gw, &want) < 1e-12, "{gw} vs {want}");
}

#[test]
fn swiglu_and_its_gradients_match_the_composed_ops() {
    let g = (randn(&[7, 33], 14) * 3.0).unwrap();
    let u = randn(&[7, 33], 15);
    let up = randn(&[7, 33], 16);
    let a = grads_of(&|g, u| swiglu(g, u).unwrap(), &g, &u, &up);
    let b = grads_of(&|g, u| (g.silu().unwrap() * u).unwrap(), &g, &u, &up);
    for (p, q) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
        assert!(max_diff(p, q) < 1e-12, "{p} vs {q}");
    }
}

/// The decay matrices by the kernel's arithmetic are the composed ops' (to f32 rounding of
/// `exp`), zero above the diagonal, one on it.
#[test]
fn chunk_decays_are_the_composed_ones() {
    let g = (randn(&[2, 3, 16], 61).abs().unwrap() * -0.3)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let cum = g.cumsum(candle_core::D::Minus1).unwrap();
    let got = chunk_decay_kernel(&cum).unwrap();
    let want = chunk_decay(&cum).unwrap();
    assert_eq!(got.dims(), &[2, 3, 16, 16]);
    assert!(max_diff(&got, &want) < 1e-6, "{}", max_diff(&got, &want));
    let m: Vec<Vec<f32>> = got.get(1).unwrap().get(2).unwrap().to_vec2().unwrap();
    assert_eq!(m[3][3], 1.0);
    assert_eq!(m[2][5], 0.0);
    assert!(m[5][2] > 0.0 && m[5][2] < 1.0);
}

/// The WY inverse by forward substitution (the kernel's arithmetic) is the squarings' `(I +
/// A)^-1`, and times `I + A` gives the identity.
#[test]
fn forward_substitution_inverts_a_unit_lower_triangular_matrix() {
    let n = 64;
    let a = (randn(&[3, 2, n, n], 51) * 0.1).unwrap();
    let a = a
        .broadcast_mul(&lower_triangle(n, true, DType::F64, &Device::Cpu).unwrap())
        .unwrap();
    let got = unit_lower_inverse_kernel(&a).unwrap();
    let want = unit_lower_inverse(&a).unwrap();
    assert!(max_diff(&got, &want) < 1e-9, "{}", max_diff(&got, &want));
    let eye = Tensor::eye(n, DType::F64, &Device::Cpu).unwrap();
    let product = a.broadcast_add(&eye).unwrap().matmul(&got).unwrap();
    assert!(max_diff(&product, &eye.broadcast_as(product.dims()).unwrap()) < 1e-9);
}

/// A cache's kept positions then the appended ones: the gather and the concatenation it
/// replaces, exactly; a position past the cache is refused.
#[test]
fn keep_append_is_a_gather_then_a_concatenation() {
    let past = randn(&[3, 7, 4], 41).to_dtype(DType::F32).unwrap();
    let added = randn(&[3, 2, 4], 42).to_dtype(DType::F32).unwrap();
    let keep = Tensor::new(&[0u32, 1, 2, 5, 3], &Device::Cpu).unwrap();
    let got = keep_append(&past, &keep, &added).unwrap();
    let want = Tensor::cat(&[&past.index_select(&keep, 1).unwrap(), &added], 1).unwrap();
    assert_eq!(got.dims(), &[3, 7, 4]);
    assert_eq!(max_diff(&got, &want), 0.0);
    let far = Tensor::new(&[0u32, 7], &Device::Cpu).unwrap();
    let e = keep_append(&past, &far, &added).unwrap_err();
    assert!(e.to_string().contains("past the cache"), "{e}");
}

/// The residual's sum and its norm in one op: the sum exactly as the add gives it, the norm
/// as RMSNorm gives it over that sum (f64); mismatched shapes are refused.
#[test]
fn add_and_norm_is_the_sum_then_its_norm() {
    let x = randn(&[6, 20], 31);
    let r = randn(&[6, 20], 32);
    let w = randn(&[20], 33);
    let (sum, normed) = add_rms_norm(&x, &r, &w, 1e-6).unwrap();
    let want_sum = (&x + &r).unwrap();
    assert_eq!(max_diff(&sum, &want_sum), 0.0);
    let want = rms_norm(&want_sum, &w, 1e-6).unwrap();
    assert!(max_diff(&normed, &want) < 1e-12, "{normed} vs {want}");
    let e = add_rms_norm(&x, &randn(&[5, 20], 34), &w, 1e-6).unwrap_err();
    assert!(e.to_string().contains("add_rms_norm"), "{e}");
}

/// The packed SwiGLU (rows of the gate's outputs, then the up projection's) is the two-input
/// one on the halves, bit for bit; an odd width is refused.
#[test]
fn packed_swiglu_is_swiglu_on_the_halves() {
    let gu = (randn(&[5, 2 * 13], 21) * 3.0).unwrap();
    let got = swiglu_packed(&gu).unwrap();
    let want = swiglu(
        &gu.narrow(1, 0, 13).unwrap().contiguous().unwrap(),
        &gu.narrow(1, 13, 13).unwrap().contiguous().unwrap(),
    )
    .unwrap();
    assert_eq!(got.dims(), &[5, 13]);
    assert_eq!(max_diff(&got, &want), 0.0);
    let e = swiglu_packed(&randn(&[2, 7], 22)).unwrap_err();
    assert!(e.to_string().contains("swiglu-packed"), "{e}");
}

/// k argmaxes, each pick masked before the next: what the fused top-k replaced.
/// The composed taps the fused convolution replaced: `silu(sum_j w[:, j] * x[t + j])` in f64.
fn composed_taps(x: &Tensor, w: &Tensor) -> Tensor {
    let (x, w) = (
        x.to_dtype(DType::F64).unwrap(),
        w.to_dtype(DType::F64).unwrap(),
    );
    let k = w.dim(1).unwrap();
    let n = x.dim(0).unwrap() - k + 1;
    let tap = |j: usize| {
        x.narrow(0, j, n)
            .unwrap()
            .broadcast_mul(&w.narrow(1, j, 1).unwrap().t().unwrap())
            .unwrap()
    };
    let sum = (1..k).fold(tap(0), |acc, j| (acc + tap(j)).unwrap());
    candle_nn::ops::silu(&sum).unwrap()
}

/// The causal convolution with its SiLU against the composed taps it replaced (f64 inputs, so
/// the only difference is the f32 output's rounding), for kernels of 1 and 4 taps, and in bf16
/// (the taps in f32 of the bf16 values, as the composed path cast them).
#[test]
fn causal_conv_silu_matches_the_composed_taps() {
    for (k, rows, channels) in [(4, 9, 6), (1, 3, 5), (4, 4, 3)] {
        let x = randn(&[rows, channels], 31 + k as u64);
        let w = randn(&[channels, k], 32 + k as u64);
        let got = causal_conv_silu(&x, &w).unwrap();
        assert_eq!(
            (got.dims(), got.dtype()),
            (&[rows - k + 1, channels][..], DType::F32)
        );
        let want = composed_taps(&x, &w);
        let diff = max_diff(&got.to_dtype(DType::F64).unwrap(), &want);
        assert!(diff < 1e-6, "k {k}: {diff}");
        let (xb, wb) = (
            x.to_dtype(DType::BF16).unwrap(),
            w.to_dtype(DType::BF16).unwrap(),
        );
        let got = causal_conv_silu(&xb, &w)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let diff = max_diff(&got, &composed_taps(&xb, &wb));
        assert!(diff < 1e-6, "bf16 k {k}: {diff}");
    }
    // Shapes that do not fit are refused, not read out of bounds.
    let x = randn(&[2, 3], 1);
    assert!(causal_conv_silu(&x, &randn(&[3, 4], 2)).is_err());
    assert!(causal_conv_silu(&x, &randn(&[4, 1], 2)).is_err());
}

fn repeated_argmax(x: &Tensor, k: usize) -> Vec<Vec<u32>> {
    let mut l = x.clone();
    let n = l.dim(0).unwrap();
    let floor = Tensor::full(f64::NEG_INFINITY, (n, 1), &Device::Cpu)
        .unwrap()
        .to_dtype(l.dtype())
        .unwrap();
    let mut picked = vec![Vec::new(); n];
    for _ in 0..k {
        let idx = l.argmax_keepdim(D::Minus1).unwrap();
        for (row, i) in picked.iter_mut().zip(idx.to_vec2::<u32>().unwrap()) {
            row.push(i[0]);
        }
        l = l.scatter(&idx, &floor, 1).unwrap();
    }
    picked
}

#[test]
fn top_k_equals_repeated_argmaxes_ties_included() {
    // Rows of many equal values (rounded to quarters), -inf entries, and one row with fewer
    // distinct values than k; in every float dtype the fused op takes.
    let mut x = (randn(&[9, 3001], 11) * 2.0).unwrap().round().unwrap();
    x = (x / 4.0).unwrap();
    let mut v: Vec<Vec<f64>> = x.to_vec2().unwrap();
    v[3].iter_mut()
        .step_by(3)
        .for_each(|e| *e = f64::NEG_INFINITY);
    v[5] = (0..3001).map(|i| f64::from(i % 2)).collect();
    let x = Tensor::new(v, &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let x = x.to_dtype(dtype).unwrap();
        for k in [1, 8, 32] {
            let got: Vec<Vec<u32>> = top_k(&x, k).unwrap().to_vec2().unwrap();
            assert_eq!(got, repeated_argmax(&x, k), "{dtype:?}, k = {k}");
        }
    }
    assert!(top_k(&x, 33).is_err() && top_k(&x, 0).is_err());
}

#[test]
fn gathered_rows_and_their_gradient_equal_index_select() {
    let table = Var::from_tensor(&randn(&[50, 7], 3)).unwrap();
    // Repeats (row 4 four times), the first and last rows, and an order that is not sorted.
    let ids = Tensor::new(&[4u32, 0, 49, 4, 17, 4, 3, 4, 17], &Device::Cpu).unwrap();
    let upstream = randn(&[9, 7], 4);
    let ours = gather_rows(table.as_tensor(), &ids).unwrap();
    let theirs = table.as_tensor().index_select(&ids, 0).unwrap();
    assert_eq!(max_diff(&ours, &theirs), 0.0);
    let g = |y: &Tensor| {
        (y * &upstream)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
            .get(table.as_tensor())
            .unwrap()
            .clone()
    };
    assert!(max_diff(&g(&ours), &g(&theirs)) < 1e-12);
    let bad = Tensor::new(&[50u32], &Device::Cpu).unwrap();
    assert!(gather_rows(table.as_tensor(), &bad).is_err());
}

/// The LM head and its loss in chunks of rows (a ragged last chunk, and one chunk of all rows)
/// against the whole logits: losses, top-k ids and the rows' gradient equal, the frozen head
/// gets none.
#[test]
fn the_chunked_head_loss_is_the_whole_one() {
    let (m, h, vocab) = (10, 6, 23);
    let w = randn(&[vocab, h], 8);
    let labels: Vec<u32> = (0..m as u32).map(|i| (i * 7 + 2) % vocab as u32).collect();
    let up = Tensor::new(
        &[1.0f64, 0.5, 0.0, 2.0, 1.0, 1.0, 0.25, 3.0, 1.0, 0.0],
        &Device::Cpu,
    )
    .unwrap();
    let whole = |x: &Tensor, w: &Tensor| cross_entropy(&linear(x, w).unwrap(), &labels).unwrap();
    let (want, want_dx, _) = grads_of(&whole, &randn(&[m, h], 9), &w, &up);
    let logits = randn(&[m, h], 9).matmul(&w.t().unwrap()).unwrap();
    let want_top = crate::nn::dflash2::top_k(&logits, 3).unwrap();
    for chunk in [3, m] {
        let f = |x: &Tensor, w: &Tensor| {
            head::head_cross_entropy_in(x, w, &labels, 3, chunk)
                .unwrap()
                .nll
        };
        let (got, got_dx, got_dw) = grads_of(&f, &randn(&[m, h], 9), &w, &up);
        assert!(max_diff(&got, &want) < 1e-12, "chunks of {chunk}");
        assert!(
            max_diff(&got_dx, &want_dx) < 1e-12,
            "chunks of {chunk}: {got_dx} vs {want_dx}"
        );
        // Even as a variable, the head is left alone: it is the frozen target's.
        assert_eq!(max_diff(&got_dw, &got_dw.zeros_like().unwrap()), 0.0);
        let top = head::head_cross_entropy_in(&randn(&[m, h], 9), &w, &labels, 3, chunk)
            .unwrap()
            .top;
        assert_eq!(
            top.to_vec2::<u32>().unwrap(),
            want_top.to_vec2::<u32>().unwrap()
        );
    }
    // f32 rows, the default chunking: the same losses to f32's rounding.
    let x32 = randn(&[m, h], 9).to_dtype(DType::F32).unwrap();
    let got = head_cross_entropy(&x32, &w, &labels, 1).unwrap();
    assert_eq!(got.nll.dtype(), DType::F32);
    assert!(max_diff(&got.nll, &want) < 1e-4);
    assert_eq!(got.top.dims2().unwrap(), (m, 1));
    let e = head_cross_entropy(&randn(&[m, h + 1], 9), &w, &labels, 1).unwrap_err();
    assert!(
        e.to_string().contains("rows of 7 against a head of 6"),
        "{e}"
    );
}

/// The strided copy's index arithmetic (the CUDA kernel's, element for element) gives candle's
/// own copy of every 3-D view the decoding pass makes: rows split into heads (a narrowed range
/// of rows, transposed), heads merged back, a key cache cut short (narrowed along the middle).
#[test]
fn a_strided_copy_of_a_view_is_candles_copy() {
    let cpu = Device::Cpu;
    let rows = Tensor::arange(0f32, 7.0 * 6.0 * 4.0, &cpu)
        .unwrap()
        .reshape((7, 24))
        .unwrap();
    let views = [
        // Rows 2..5 of a pass, as [heads, rows, head_dim].
        rows.narrow(0, 2, 3)
            .unwrap()
            .reshape((3, 6, 4))
            .unwrap()
            .transpose(0, 1)
            .unwrap(),
        // [heads, rows, head_dim] back to [rows, heads, head_dim].
        rows.reshape((6, 7, 4)).unwrap().transpose(0, 1).unwrap(),
        // A cache [kv, positions, head_dim] cut to its first 5 positions.
        rows.reshape((3, 14, 4)).unwrap().narrow(1, 0, 5).unwrap(),
    ];
    for (i, v) in views.iter().enumerate() {
        assert!(!v.is_contiguous(), "view {i} is a view");
        let got = strided_copy3(v).unwrap();
        assert!(got.is_contiguous());
        assert_eq!(got.dims(), v.dims());
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.contiguous()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            "view {i}"
        );
    }
    // Other ranks are refused, not misread.
    let e = strided_copy3(&rows.t().unwrap()).unwrap_err();
    assert!(e.to_string().contains("a 2-D view"), "{e}");
    // On the CPU the hot path is candle's copy.
    let same = contiguous3(&views[0]).unwrap();
    assert_eq!(same.dims(), views[0].dims());
}

/// Each head's elements times its own scale: the products `broadcast_mul` gives, bit for bit;
/// a scale per head or nothing.
#[test]
fn scaling_by_head_is_the_broadcast_product() {
    let cpu = Device::Cpu;
    let x = randn(&[5, 3, 4], 3).to_dtype(DType::F32).unwrap();
    let s = randn(&[5], 4).to_dtype(DType::F32).unwrap();
    let got = scale_by_head_kernel(&x, &s).unwrap();
    let want = x.broadcast_mul(&s.reshape((5, 1, 1)).unwrap()).unwrap();
    assert_eq!(max_diff(&got, &want), 0.0);
    let e = scale_by_head_kernel(&x, &Tensor::ones(4, DType::F32, &cpu).unwrap()).unwrap_err();
    assert!(e.to_string().contains("scale_by_head"), "{e}");
}

/// The one-kernel head rows refuse a label past the vocabulary before anything is launched
/// (the kernel would read past the row), and on a CPU say they need a GPU build's kernel.
#[test]
fn head_rows_refuse_a_label_past_the_vocabulary() {
    let z = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
    let err = head_rows_in_place(&z, &[1, 5]).unwrap_err();
    assert!(err.to_string().contains("each < 5"), "{err}");
    assert!(head_rows_in_place(&z, &[1]).is_err());
    assert!(head_rows_in_place(&z, &[1, 4]).is_err(), "no CPU kernel");
}
