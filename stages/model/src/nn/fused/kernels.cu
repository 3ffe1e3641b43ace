// Fused CUDA kernels for training the drafter (launched by stages/model/src/nn/fused/cuda.rs).
//
// Each replaces a chain of candle ops whose intermediates candle would write out and keep for
// the backward pass: attention's scale + mask + softmax and its gradient, the cross-entropy over
// the vocabulary and its gradient, RMSNorm and its input and weight gradients, the rotary
// embedding (its gradient is the inverse rotation), SwiGLU's gate and its gradients, the AdamW
// update and the gradients' squared norm, the top-k indices of each row and a table's rows by
// index with their atomic gradient (DFlash 2). Rows are reduced by one thread block each; arithmetic
// is in f32 whatever the storage type.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16(v); }

// Sixteen bytes at once (four f32 or eight bf16) for the elementwise kernels: one load or store
// instruction where element by element takes four or eight, which is what kept those kernels at
// half the memory bandwidth. A kernel takes its vector path when every pointer is 16-byte
// aligned and its lengths are whole vectors (the check is uniform over the grid), else its
// element-by-element loop; both do the same arithmetic on each element, so give the same bits.
template <typename T>
constexpr int kVec = 16 / sizeof(T);
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
__device__ __forceinline__ void load16(const float* p, float (&v)[4]) {
    float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void load16(const __nv_bfloat16* p, float (&v)[8]) {
    uint4 x = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x, v[2 * k + 1] = f.y;
    }
}
__device__ __forceinline__ void store16(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store16(__nv_bfloat16* p, const float (&v)[8]) {
    uint4 x;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&x);
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    *reinterpret_cast<uint4*>(p) = x;
}
// The first element of this thread's first vector, and the step between its vectors.
template <typename T>
__device__ __forceinline__ size_t vec_start() { return (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * kVec<T>; }
template <typename T>
__device__ __forceinline__ size_t vec_step() { return (size_t)gridDim.x * blockDim.x * kVec<T>; }

// Reduce over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <bool IsMax>
__device__ float block_reduce(float v) {
    __shared__ float partial[32];
    __shared__ float result;
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffff, v, o);
        v = IsMax ? fmaxf(v, w) : v + w;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        v = lane < warps ? partial[lane] : (IsMax ? -INFINITY : 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffff, v, o);
            v = IsMax ? fmaxf(v, w) : v + w;
        }
        if (lane == 0) result = v;
    }
    __syncthreads();
    float out = result;
    __syncthreads();  // `partial` and `result` are reused by the next call
    return out;
}

// probs = softmax(scores * scale + mask[row % nq]) over rows of length n; a row masked
// everywhere gives zeros.
template <typename T>
__device__ void masked_softmax(const T* scores, const T* mask, T* probs, uint32_t n, uint32_t nq, float scale) {
    size_t row = blockIdx.x;
    const T* x = scores + row * n;
    const T* m = mask + (row % nq) * n;
    T* y = probs + row * n;
    float mx = -INFINITY;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, load(x, j) * scale + load(m, j));
    mx = block_reduce<true>(mx);
    if (mx == -INFINITY) {
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) store(y, j, 0.0f);
        return;
    }
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) sum += __expf(load(x, j) * scale + load(m, j) - mx);
    float inv = 1.0f / block_reduce<false>(sum);
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) store(y, j, __expf(load(x, j) * scale + load(m, j) - mx) * inv);
}

// d scores = scale * p * (dp - sum(dp * p)) per row.
template <typename T>
__device__ void softmax_grad(const T* probs, const T* dprobs, T* dscores, uint32_t n, float scale) {
    size_t row = blockIdx.x;
    const T* p = probs + row * n;
    const T* dp = dprobs + row * n;
    T* ds = dscores + row * n;
    float dot = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) dot += load(p, j) * load(dp, j);
    dot = block_reduce<false>(dot);
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) store(ds, j, scale * load(p, j) * (load(dp, j) - dot));
}

// The log-sum-exp of one row.
template <typename T>
__device__ float row_lse(const T* z, uint32_t n) {
    float mx = -INFINITY;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, load(z, j));
    mx = block_reduce<true>(mx);
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) sum += __expf(load(z, j) - mx);
    return mx + __logf(block_reduce<false>(sum));
}

// nll[row] = logsumexp(z) - z[label] over rows of length n.
template <typename T>
__device__ void cross_entropy(const T* logits, const uint32_t* labels, float* nll, uint32_t n) {
    size_t row = blockIdx.x;
    const T* z = logits + row * n;
    float lse = row_lse(z, n);
    if (threadIdx.x == 0) nll[row] = lse - load(z, labels[row]);
}

// d logits = g[row] * (softmax(z) - onehot(label)).
template <typename T>
__device__ void cross_entropy_grad(const T* logits, const uint32_t* labels, const float* g, T* dlogits, uint32_t n) {
    size_t row = blockIdx.x;
    const T* z = logits + row * n;
    T* dz = dlogits + row * n;
    float lse = row_lse(z, n);
    float gr = g[row];
    uint32_t y = labels[row];
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
        store(dz, j, gr * (__expf(load(z, j) - lse) - (j == y ? 1.0f : 0.0f)));
}

// m = beta * m + (1 - beta) * (scale * g), or with (scale * g)^2 when `squared`.
template <typename T>
__device__ void moment(float* m, const T* g, size_t n, float beta, float scale, int squared) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = load(g, i) * scale;
        m[i] = beta * m[i] + (1.0f - beta) * (squared ? x * x : x);
    }
}

// p = p * (1 - lr * decay) - lr * (m / c1) / (sqrt(v / c2) + eps).
template <typename T>
__device__ void adam_apply(T* p, const float* m, const float* v, size_t n, float lr, float decay, float c1, float c2, float eps) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = load(p, i) * (1.0f - lr * decay);
        store(p, i, x - lr * (m[i] / c1) / (sqrtf(v[i] / c2) + eps));
    }
}

// AdamW's whole step in one pass: both moments from the clipped gradient (as `moment`), then
// the parameter (as `adam_apply`): reads g, m, v and p once, writes m, v and p once.
// One element's AdamW step: its moments m and v updated, the new parameter returned.
__device__ __forceinline__ float adamw_value(float p, float g, float& m, float& v, float b1, float b2, float scale,
                                             float lr, float decay, float c1, float c2, float eps) {
    float x = g * scale;
    m = b1 * m + (1.0f - b1) * x;
    v = b2 * v + (1.0f - b2) * (x * x);
    float w = p * (1.0f - lr * decay);
    return w - lr * (m / c1) / (sqrtf(v / c2) + eps);
}

// Stochastic rounding of f32 to bf16 (the moments of `adamw_sr_T` and `adamw_master_sr_bf16`):
// the 16 bits bf16 drops, plus a 16-bit coin, carry into the kept bits with the probability the
// dropped bits give, so the rounding is unbiased. A moment whose change a step is below bf16's
// resolution (v's 0.1% at beta2 = 0.999, under half of bf16's 0.4% step) then still moves on
// average, where rounding to nearest would keep it where it is. The coin is a hash of the element's index and
// a seed the optimizer derives from its step (the same on CPU: adamw.rs `coin`).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}
__device__ __forceinline__ uint16_t round_stochastic(float x, uint32_t index, uint32_t seed) {
    uint32_t b = __float_as_uint(x);
    // Infinities and NaN keep their bits (a carry would turn a NaN's payload into another value).
    if ((b & 0x7f800000u) != 0x7f800000u) b += mix32(index ^ seed) & 0xffffu;
    return (uint16_t)(b >> 16);
}

// AdamW's moments as stored: f32 as they are, bf16 read up and stored back by stochastic rounding
// (element i's coin from `seed`; f32 ignores it). One element, then eight from 16-byte aligned
// storage (f32: two 16-byte accesses, bf16: one).
__device__ __forceinline__ float load_moment(const float* m, size_t i) { return m[i]; }
__device__ __forceinline__ float load_moment(const __nv_bfloat16* m, size_t i) { return __bfloat162float(m[i]); }
__device__ __forceinline__ void store_moment(float* m, size_t i, float x, uint32_t) { m[i] = x; }
__device__ __forceinline__ void store_moment(__nv_bfloat16* m, size_t i, float x, uint32_t seed) {
    m[i] = __ushort_as_bfloat16(round_stochastic(x, (uint32_t)i, seed));
}
__device__ __forceinline__ void load_moments8(const float* m, float (&v)[8]) {
    load16(m, *reinterpret_cast<float(*)[4]>(v));
    load16(m + 4, *reinterpret_cast<float(*)[4]>(v + 4));
}
__device__ __forceinline__ void load_moments8(const __nv_bfloat16* m, float (&v)[8]) { load16(m, v); }
__device__ __forceinline__ void store_moments8(float* m, const float (&v)[8], size_t, uint32_t) {
    store16(m, *reinterpret_cast<const float(*)[4]>(v));
    store16(m + 4, *reinterpret_cast<const float(*)[4]>(v + 4));
}
__device__ __forceinline__ void store_moments8(__nv_bfloat16* m, const float (&v)[8], size_t i, uint32_t seed) {
    alignas(16) uint16_t r[8];
#pragma unroll
    for (int k = 0; k < 8; k++) r[k] = round_stochastic(v[k], (uint32_t)(i + k), seed);
    *reinterpret_cast<uint4*>(m) = *reinterpret_cast<const uint4*>(r);
}

// The same for element i, its moments (f32 or bf16: `load_moment`) in place.
template <typename M>
__device__ __forceinline__ float adamw_element(float p, float g, M* m, M* v, size_t i, float b1, float b2, float scale,
                                               float lr, float decay, float c1, float c2, float eps, uint32_t seed_m,
                                               uint32_t seed_v) {
    float mi = load_moment(m, i), vi = load_moment(v, i);
    float w = adamw_value(p, g, mi, vi, b1, b2, scale, lr, decay, c1, c2, eps);
    store_moment(m, i, mi, seed_m);
    store_moment(v, i, vi, seed_v);
    return w;
}

// `adamw_fused_T` (f32 moments) and `adamw_sr_T` (bf16 moments, seeds `seed_m`, `seed_v`).
template <typename T, typename M>
__device__ void adamw_fused(T* p, const T* g, M* m, M* v, size_t n, float b1, float b2, float scale, float lr,
                            float decay, float c1, float c2, float eps, uint32_t seed_m, uint32_t seed_v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        store(p, i,
              adamw_element(load(p, i), load(g, i), m, v, i, b1, b2, scale, lr, decay, c1, c2, eps, seed_m, seed_v));
    }
}

// y = x * rsqrt(mean(x^2) + eps) * w per row of length n.
template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, uint32_t n, float eps) {
    size_t row = blockIdx.x;
    const T* xr = x + row * n;
    T* yr = y + row * n;
    float sq = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) { float v = load(xr, j); sq += v * v; }
    float r = rsqrtf(block_reduce<false>(sq) / n + eps);
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) store(yr, j, load(xr, j) * r * load(w, j));
}

// A residual's sum and its RMSNorm in one pass: per row, s = x + r (rounded to T, as the add
// alone stores it) into out's first `rows` rows and rms_norm(s) * w into the next `rows`.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* r, const T* w, T* out, size_t rows, uint32_t n, float eps) {
    size_t row = blockIdx.x;
    const T* xr = x + row * n;
    const T* rr = r + row * n;
    T* sr = out + row * n;
    T* yr = out + (rows + row) * n;
    float sq = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        store(sr, j, load(xr, j) + load(rr, j));
        float v = load(sr, j);
        sq += v * v;
    }
    float rs = rsqrtf(block_reduce<false>(sq) / n + eps);
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) store(yr, j, load(sr, j) * rs * load(w, j));
}

// dx = r * (dy * w) - x * r^3 * mean(dy * w * x) per row, r = rsqrt(mean(x^2) + eps).
template <typename T>
__device__ void rms_norm_grad(const T* x, const T* w, const T* dy, T* dx, uint32_t n, float eps) {
    size_t row = blockIdx.x;
    const T* xr = x + row * n;
    const T* dyr = dy + row * n;
    T* dxr = dx + row * n;
    float sq = 0.0f, dot = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        float v = load(xr, j);
        sq += v * v;
        dot += load(dyr, j) * load(w, j) * v;
    }
    float r = rsqrtf(block_reduce<false>(sq) / n + eps);
    float c = block_reduce<false>(dot) / n * r * r * r;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
        store(dxr, j, r * load(dyr, j) * load(w, j) - load(xr, j) * c);
}

// The row kernels' 16-byte forms (`*_vec`, launched where every row starts 16-byte aligned and
// n is whole vectors): a row's `per` threads (a power of two) are consecutive, each taking one
// vector at a time. per <= 32 packs blockDim / per rows into a block, summed by shuffles
// within the group (a per-head norm's 128 elements are 16 threads, not a block of 128); per >
// 32 is a block of per threads a row. Each element's arithmetic is the scalar form's; sums
// are taken in another order, so they agree to rounding.
__device__ __forceinline__ float group_sum(float v, uint32_t per) {
    if (per > 32) return block_reduce<false>(v);
    for (uint32_t o = per >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ size_t group_row(uint32_t per) {
    return per > 32 ? blockIdx.x : (size_t)blockIdx.x * (blockDim.x / per) + threadIdx.x / per;
}
__device__ __forceinline__ uint32_t group_lane(uint32_t per) { return per > 32 ? threadIdx.x : threadIdx.x % per; }

// A float rounded to T, as storing and loading it back gives.
__device__ __forceinline__ float rounded(float v, const float*) { return v; }
__device__ __forceinline__ float rounded(float v, const __nv_bfloat16*) { return __bfloat162float(__float2bfloat16(v)); }

// yr = xr * r * w over one row's vectors, the group's lane `lane` of `per` (a norm's second
// pass).
template <typename T>
__device__ __forceinline__ void scale_row_vec(const T* xr, const T* w, T* yr, float r, uint32_t n, uint32_t lane,
                                              uint32_t per) {
    constexpr int V = kVec<T>;
    float v[V], ww[V];
    for (uint32_t j = lane * V; j < n; j += per * V) {
        load16(xr + j, v);
        load16(w + j, ww);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] = v[k] * r * ww[k];
        store16(yr + j, v);
    }
}

template <typename T>
__device__ void rms_norm_vec(const T* x, const T* w, T* y, size_t rows, uint32_t n, uint32_t per, float eps) {
    constexpr int V = kVec<T>;
    size_t row = group_row(per);
    uint32_t lane = group_lane(per);
    bool valid = row < rows;  // rows past the end still take part in the group's shuffles
    const T* xr = x + row * n;
    T* yr = y + row * n;
    float sq = 0.0f, v[V];
    if (valid)
        for (uint32_t j = lane * V; j < n; j += per * V) {
            load16(xr + j, v);
#pragma unroll
            for (int k = 0; k < V; k++) sq += v[k] * v[k];
        }
    float r = rsqrtf(group_sum(sq, per) / n + eps);
    if (valid) scale_row_vec(xr, w, yr, r, n, lane, per);
}

template <typename T>
__device__ void add_rms_norm_vec(const T* x, const T* res, const T* w, T* out, size_t rows, uint32_t n, uint32_t per,
                                 float eps) {
    constexpr int V = kVec<T>;
    size_t row = group_row(per);
    uint32_t lane = group_lane(per);
    bool valid = row < rows;
    const T* xr = x + row * n;
    const T* rr = res + row * n;
    T* sr = out + row * n;
    T* yr = out + (rows + row) * n;
    float sq = 0.0f, a[V], b[V];
    if (valid)
        for (uint32_t j = lane * V; j < n; j += per * V) {
            load16(xr + j, a);
            load16(rr + j, b);
#pragma unroll
            for (int k = 0; k < V; k++) {
                a[k] = rounded(a[k] + b[k], x);
                sq += a[k] * a[k];
            }
            store16(sr + j, a);
        }
    float rs = rsqrtf(group_sum(sq, per) / n + eps);
    if (valid) scale_row_vec(sr, w, yr, rs, n, lane, per);
}

template <typename T>
__device__ void rms_norm_grad_vec(const T* x, const T* w, const T* dy, T* dx, size_t rows, uint32_t n, uint32_t per,
                                  float eps) {
    constexpr int V = kVec<T>;
    size_t row = group_row(per);
    uint32_t lane = group_lane(per);
    bool valid = row < rows;
    const T* xr = x + row * n;
    const T* dyr = dy + row * n;
    T* dxr = dx + row * n;
    float sq = 0.0f, dot = 0.0f, a[V], d[V], ww[V];
    if (valid)
        for (uint32_t j = lane * V; j < n; j += per * V) {
            load16(xr + j, a);
            load16(dyr + j, d);
            load16(w + j, ww);
#pragma unroll
            for (int k = 0; k < V; k++) {
                sq += a[k] * a[k];
                dot += d[k] * ww[k] * a[k];
            }
        }
    float r = rsqrtf(group_sum(sq, per) / n + eps);
    float c = group_sum(dot, per) / n * r * r * r;
    if (valid)
        for (uint32_t j = lane * V; j < n; j += per * V) {
            load16(xr + j, a);
            load16(dyr + j, d);
            load16(w + j, ww);
#pragma unroll
            for (int k = 0; k < V; k++) d[k] = r * d[k] * ww[k] - a[k] * c;
            store16(dxr + j, d);
        }
}

// Rotate-half rotary embedding of x [.., n, d] by cos/sin [n, d/2]; `sign` -1 rotates back.
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, size_t total, uint32_t n, uint32_t d, float sign) {
    uint32_t half = d / 2;
    constexpr int V = kVec<T>;
    if (half % V == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) && aligned16(y)) {
        // A thread a vector of a row's first half and the matching vector of its second.
        uint32_t per_row = half / V;
        size_t units = total / 2 / V;
        for (size_t u = blockIdx.x * (size_t)blockDim.x + threadIdx.x; u < units; u += (size_t)gridDim.x * blockDim.x) {
            size_t row = u / per_row, t = row % n;
            uint32_t j = (u % per_row) * V;
            float a[V], b[V], c[V], sn[V];
            load16(x + row * d + j, a);
            load16(x + row * d + half + j, b);
            load16(cos + t * half + j, c);
            load16(sin + t * half + j, sn);
#pragma unroll
            for (int k = 0; k < V; k++) {
                float sk = sign * sn[k], lo = a[k] * c[k] + -b[k] * sk;
                b[k] = b[k] * c[k] + a[k] * sk;
                a[k] = lo;
            }
            store16(y + row * d + j, a);
            store16(y + row * d + half + j, b);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t j = i % d;
        size_t t = (i / d) % n;
        uint32_t k = j < half ? j : j - half;
        float c = load(cos, t * half + k), s = sign * load(sin, t * half + k);
        float v = load(x, i);
        float other = j < half ? -load(x, i + half) : load(x, i - half);
        store(y, i, v * c + other * s);
    }
}

// *out += sum(x^2) over n elements (out zeroed by the caller).
template <typename T>
__device__ void sum_squares(const T* x, size_t n, float* out) {
    float acc = 0.0f;
    constexpr int V = kVec<T>;
    if (n % V == 0 && aligned16(x)) {
        for (size_t i = vec_start<T>(); i < n; i += vec_step<T>()) {
            float e[V];
            load16(x + i, e);
#pragma unroll
            for (int k = 0; k < V; k++) acc += e[k] * e[k];
        }
    } else {
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
            float v = load(x, i);
            acc += v * v;
        }
    }
    acc = block_reduce<false>(acc);
    if (threadIdx.x == 0) atomicAdd(out, acc);
}

// h = silu(g) * u, the SwiGLU gate, elementwise.
template <typename T>
__device__ void swiglu(const T* g, const T* u, T* h, size_t n) {
    constexpr int V = kVec<T>;
    if (n % V == 0 && aligned16(g) && aligned16(u) && aligned16(h)) {
        for (size_t i = vec_start<T>(); i < n; i += vec_step<T>()) {
            float a[V], b[V];
            load16(g + i, a);
            load16(u + i, b);
#pragma unroll
            for (int k = 0; k < V; k++) a[k] = a[k] / (1.0f + __expf(-a[k])) * b[k];
            store16(h + i, a);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = load(g, i);
        store(h, i, a / (1.0f + __expf(-a)) * load(u, i));
    }
}

// out = a + b elementwise (`add.rs`).
template <typename T>
__device__ void add(const T* a, const T* b, T* out, size_t n) {
    constexpr int V = kVec<T>;
    if (n % V == 0 && aligned16(a) && aligned16(b) && aligned16(out)) {
        for (size_t i = vec_start<T>(); i < n; i += vec_step<T>()) {
            float x[V], y[V];
            load16(a + i, x);
            load16(b + i, y);
#pragma unroll
            for (int k = 0; k < V; k++) x[k] += y[k];
            store16(out + i, x);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        store(out, i, load(a, i) + load(b, i));
}

// h[r, j] = silu(gu[r, j]) * gu[r, f + j]: SwiGLU over rows that hold the gate's f outputs then
// the up projection's (one matmul over the two weights stacked), h [rows, f].
template <typename T>
__device__ void swiglu_packed(const T* gu, T* h, size_t n, uint32_t f) {
    constexpr int V = kVec<T>;
    if (f % V == 0 && aligned16(gu) && aligned16(h)) {
        // A vector never straddles a row: f is whole vectors.
        for (size_t i = vec_start<T>(); i < n; i += vec_step<T>()) {
            size_t r = i / f, j = i % f;
            float a[V], b[V];
            load16(gu + 2 * f * r + j, a);
            load16(gu + 2 * f * r + f + j, b);
#pragma unroll
            for (int k = 0; k < V; k++) a[k] = a[k] / (1.0f + __expf(-a[k])) * b[k];
            store16(h + i, a);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / f, j = i % f;
        float a = load(gu, 2 * f * r + j);
        store(h, i, a / (1.0f + __expf(-a)) * load(gu, 2 * f * r + f + j));
    }
}

// y[t, c] = silu(sum_j w[c, j] * x[t + j, c]): a Gated DeltaNet layer's depthwise causal
// convolution over the carried-then-new inputs x [rows + k - 1, channels] and its SiLU, in f32.
// Consecutive threads take consecutive channels, so each tap's loads are coalesced.
template <typename T>
__device__ void causal_conv_silu(const T* x, const T* w, float* y, size_t n, uint32_t channels, uint32_t k) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / channels, c = i % channels;
        float a = 0.0f;
        for (uint32_t j = 0; j < k; ++j) a += load(w, c * k + j) * load(x, (t + j) * channels + c);
        y[i] = a / (1.0f + __expf(-a));
    }
}

// The chunked Gated DeltaNet's pass over its chunks (`scan.rs`). Block (h, tile): head h, value
// columns [32 tile, 32 tile + 32). The state's tile S [dk, 32] and the chunk's v_new [L, 32] live
// in shared memory; thread t takes column t % 32 and every 8th row from t / 32. Per chunk:
// v_new = values - k_decayed @ S; out = q_decayed @ S + intra @ v_new; S = S * decay + k_tail @
// v_new, a barrier between the phases (each reads what the one before wrote).
// rows [chunks, heads, L, dv + 2 dk + L], tails [chunks, heads, dk, L + 1], s0 [heads, dk, dv],
// out [heads, chunks L + dk, dv]: every chunk's rows, then the final state.
template <typename T>
__device__ void delta_scan(const T* rows, const T* tails, const T* s0, T* out, uint32_t chunks,
                           uint32_t heads, uint32_t l, uint32_t dk, uint32_t dv) {
    extern __shared__ float shared[];
    float* st = shared;             // [dk][32]
    float* vn = shared + dk * 32;   // [l][32]
    const uint32_t h = blockIdx.x, jj = threadIdx.x % 32, r0 = threadIdx.x / 32, step = blockDim.x / 32;
    const uint32_t j = blockIdx.y * 32 + jj;
    const bool col = j < dv;
    const size_t w = dv + 2 * dk + l, out_rows = (size_t)chunks * l + dk;
    for (uint32_t d = r0; d < dk; d += step) st[d * 32 + jj] = col ? load(s0, ((size_t)h * dk + d) * dv + j) : 0.0f;
    __syncthreads();
    for (uint32_t c = 0; c < chunks; ++c) {
        const size_t base = ((size_t)c * heads + h) * l * w;
        for (uint32_t i = r0; i < l; i += step) {
            float a = col ? load(rows, base + i * w + j) : 0.0f;
            for (uint32_t d = 0; d < dk; ++d) a -= load(rows, base + i * w + dv + d) * st[d * 32 + jj];
            vn[i * 32 + jj] = a;
        }
        __syncthreads();
        for (uint32_t i = r0; i < l; i += step) {
            float a = 0.0f;
            for (uint32_t d = 0; d < dk; ++d) a += load(rows, base + i * w + dv + dk + d) * st[d * 32 + jj];
            for (uint32_t m = 0; m < l; ++m) a += load(rows, base + i * w + dv + 2 * dk + m) * vn[m * 32 + jj];
            if (col) store(out, ((size_t)h * out_rows + (size_t)c * l + i) * dv + j, a);
        }
        __syncthreads();
        const size_t tb = ((size_t)c * heads + h) * dk * (l + 1);
        const float decay = load(tails, tb + l);
        for (uint32_t d = r0; d < dk; d += step) {
            float a = st[d * 32 + jj] * decay;
            for (uint32_t m = 0; m < l; ++m) a += load(tails, tb + (size_t)d * (l + 1) + m) * vn[m * 32 + jj];
            st[d * 32 + jj] = a;
        }
        __syncthreads();
    }
    for (uint32_t d = r0; d < dk; d += step)
        if (col) store(out, ((size_t)h * out_rows + (size_t)chunks * l + d) * dv + j, st[d * 32 + jj]);
}

// The gradient of swiglu's gate input (which == 0) or of its up input (which == 1) given dh.
template <typename T>
__device__ void swiglu_grad(const T* g, const T* u, const T* dh, T* out, size_t n, int which) {
    constexpr int V = kVec<T>;
    if (n % V == 0 && aligned16(g) && aligned16(u) && aligned16(dh) && aligned16(out)) {
        for (size_t i = vec_start<T>(); i < n; i += vec_step<T>()) {
            float a[V], b[V], d[V];
            load16(g + i, a);
            load16(dh + i, d);
            if (which == 0) load16(u + i, b);
#pragma unroll
            for (int k = 0; k < V; k++) {
                float s = 1.0f / (1.0f + __expf(-a[k]));
                d[k] = which == 0 ? d[k] * b[k] * s * (1.0f + a[k] * (1.0f - s)) : d[k] * a[k] * s;
            }
            store16(out + i, d);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = load(g, i), d = load(dh, i);
        float s = 1.0f / (1.0f + __expf(-a));
        store(out, i, which == 0 ? d * load(u, i) * s * (1.0f + a * (1.0f - s)) : d * a * s);
    }
}

// 1 / sqrt(mean(x^2) + eps) of each row (one block per row).
template <typename T>
__device__ void rms_rstd(const T* x, float* r, uint32_t n, float eps) {
    size_t row = blockIdx.x;
    const T* xr = x + row * n;
    float sq = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        float v = load(xr, j);
        sq += v * v;
    }
    sq = block_reduce<false>(sq);
    if (threadIdx.x == 0) r[row] = rsqrtf(sq / n + eps);
}

// RMSNorm's weight gradient in parts: partial[chunk][j] = sum over the chunk's rows of
// dy * x * rstd at column j. Grid (column blocks, chunks); a thread per column walks its rows,
// so neighbouring threads read neighbouring columns.
template <typename T>
__device__ void rms_norm_dw(const T* x, const T* dy, const float* r, float* partial, uint32_t rows, uint32_t n,
                            uint32_t per_chunk) {
    uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    size_t r0 = (size_t)blockIdx.y * per_chunk, r1 = min((size_t)rows, r0 + per_chunk);
    float acc = 0.0f;
    for (size_t row = r0; row < r1; row++) acc += load(dy, row * n + j) * load(x, row * n + j) * r[row];
    partial[(size_t)blockIdx.y * n + j] = acc;
}

// Whether (a, i) ranks before (b, j): larger first, the lower index among equals.
__device__ __forceinline__ bool ranks_before(float a, uint32_t i, float b, uint32_t j) {
    return a > b || (a == b && i < j);
}

// Merge each lane's running (max, sum of exp(x - max)) and best (value, index) with its warp's
// other lanes' (a butterfly: afterwards every lane holds the warp's).
__device__ __forceinline__ void warp_merge_rows(float& m, float& s, float& best, uint32_t& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        float b2 = __shfl_xor_sync(0xffffffff, best, o);
        uint32_t i2 = __shfl_xor_sync(0xffffffff, bi, o);
        float mm = fmaxf(m, m2);
        s = (m == -INFINITY ? 0.0f : s * __expf(m - mm)) + (m2 == -INFINITY ? 0.0f : s2 * __expf(m2 - mm));
        m = mm;
        if (ranks_before(b2, i2, best, bi)) { best = b2; bi = i2; }
    }
}

// The LM head's rows in one read and one read-write (`head_rows`, one block per row of n, a
// power of two of threads up to 1024): each row's cross-entropy against its label, its argmax
// (ties to the lower id, NaN never taken, as `top_k` with k = 1), and in place of the logits
// the loss's gradient per unit of its own, softmax - onehot; `cross_entropy`, `top_k` and
// `cross_entropy_grad` read each row five times for the same. The log-sum-exp is online: each
// thread keeps its running max and its sum of exp(x - max), rescaled when the max grows.
template <typename T>
__device__ void head_rows(T* logits, const uint32_t* labels, float* nll, uint32_t* top, uint32_t n) {
    __shared__ float sm[32], ss[32], sb[32];
    __shared__ uint32_t si[32];
    size_t row = blockIdx.x;
    T* z = logits + row * n;
    float m = -INFINITY, s = 0.0f, best = -INFINITY;
    uint32_t bi = 0xffffffffu;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        float x = load(z, j);
        if (x > m) {
            s = s * __expf(m - x) + 1.0f;
            m = x;
        } else if (x != -INFINITY) {
            s += __expf(x - m);  // NaN propagates into the sum, as in `row_lse`
        }
        if (x == x && ranks_before(x, j, best, bi)) { best = x; bi = j; }
    }
    // Warps, then the block: (max, sum) pairs merge by rescaling; (value, index) by rank.
    warp_merge_rows(m, s, best, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; sb[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? sm[lane] : -INFINITY;
        s = lane < warps ? ss[lane] : 0.0f;
        best = lane < warps ? sb[lane] : -INFINITY;
        bi = lane < warps ? si[lane] : 0xffffffffu;
        warp_merge_rows(m, s, best, bi);
        if (lane == 0) { sm[0] = m + __logf(s); si[0] = bi; }
    }
    __syncthreads();
    float lse = sm[0];
    uint32_t y = labels[row];
    // Every thread reads the label's logit before any thread overwrites the row.
    float zy = load(z, y);
    __syncthreads();
    if (threadIdx.x == 0) { nll[row] = lse - zy; top[row] = si[0]; }
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
        store(z, j, __expf(load(z, j) - lse) - (j == y ? 1.0f : 0.0f));
}

#define TOP_K_MAX 32

// The k largest entries' indices of each row of length n (one block per row), largest first,
// equal values in index order. Each thread keeps the best k of its strided slice, sorted (it
// scans up the indices, so an equal value never displaces one it holds); then k rounds each
// take the best of the threads' heads by a shared-memory reduction, and its thread moves on.
// Assumes k <= TOP_K_MAX, k <= n and blockDim.x a power of two up to 1024.
template <typename T>
__device__ void top_k(const T* logits, uint32_t* out, uint32_t n, uint32_t k) {
    __shared__ float sv[1024];
    __shared__ uint32_t si[1024];
    size_t row = blockIdx.x;
    const T* z = logits + row * n;
    float v[TOP_K_MAX];
    uint32_t ix[TOP_K_MAX];
    for (uint32_t i = 0; i < k; i++) { v[i] = -INFINITY; ix[i] = 0xffffffffu; }
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        float x = load(z, j);
        if (x != x || !ranks_before(x, j, v[k - 1], ix[k - 1])) continue;
        uint32_t p = k - 1;
        while (p > 0 && ranks_before(x, j, v[p - 1], ix[p - 1])) { v[p] = v[p - 1]; ix[p] = ix[p - 1]; p--; }
        v[p] = x;
        ix[p] = j;
    }
    uint32_t head = 0;
    for (uint32_t r = 0; r < k; r++) {
        sv[threadIdx.x] = head < k ? v[head] : -INFINITY;
        si[threadIdx.x] = head < k ? ix[head] : 0xffffffffu;
        __syncthreads();
        for (uint32_t s = blockDim.x >> 1; s > 0; s >>= 1) {
            if (threadIdx.x < s && ranks_before(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = sv[threadIdx.x + s];
                si[threadIdx.x] = si[threadIdx.x + s];
            }
            __syncthreads();
        }
        uint32_t won = si[0];
        if (threadIdx.x == 0) out[row * k + r] = won;
        if (head < k && ix[head] == won) head++;
        __syncthreads();  // `sv` and `si` are rewritten by the next round
    }
}

// out[j, c] = table[ids[j], c] over n rows of width r; an id past the table's `rows` reads as 0.
template <typename T>
__device__ void gather_rows(const T* table, const uint32_t* ids, T* out, size_t n, uint32_t r, uint32_t rows) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n * r; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t id = ids[i / r];
        if (id < rows) out[i] = table[(size_t)id * r + i % r];
        else store(out, i, 0.0f);
    }
}

// A cache cut and appended to in one copy: out [h, kept + n, d] holds past [h, len, d]'s
// positions keep[0..kept] (in order), then added [h, n, d].
template <typename T>
__device__ void keep_append(const T* past, const uint32_t* keep, const T* added, T* out, size_t total, uint32_t len,
                            uint32_t kept, uint32_t n, uint32_t d) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t c = i % d, j = (i / d) % (kept + n), h = i / ((size_t)d * (kept + n));
        out[i] = j < kept ? past[((size_t)h * len + keep[j]) * d + c] : added[((size_t)h * n + (j - kept)) * d + c];
    }
}

__device__ __forceinline__ void add_at(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void add_at(__nv_bfloat16* p, float v) { atomicAdd(p, __float2bfloat16(v)); }

// table[ids[j], c] += grad[j, c] over n rows of width r, one thread per element (atomics: an
// index may repeat); `table` (`rows` rows) starts at zero; an id past it adds nothing.
template <typename T>
__device__ void scatter_add_rows(const T* grad, const uint32_t* ids, T* table, size_t n, uint32_t r, uint32_t rows) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n * r; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t id = ids[i / r];
        if (id < rows) add_at(table + (size_t)id * r + i % r, load(grad, i));
    }
}

// decay[m, i, j] = exp(min(cum[m, i] - cum[m, j], 0)) for j <= i, else 0: each of `rows`
// cumulative log-decays of length l (a head's chunk) as its l x l matrix of what the state
// loses between positions j and i, one thread per element.
template <typename T>
__device__ void chunk_decay(const T* cum, T* out, size_t total, uint32_t l) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t j = e % l, i = (e / l) % l, m = e / ((size_t)l * l);
        float v = 0.0f;
        if (j <= i) v = expf(fminf(load(cum, m * l + i) - load(cum, m * l + j), 0.0f));
        store(out, e, v);
    }
}

// T = (I + A)^-1 for each n x n block of a (A strictly lower triangular: only j < i is read),
// by forward substitution, T[i] = e_i - sum_{j<i} A[i, j] T[j]: one block of n threads per
// matrix (thread c owns column c), both matrices in shared memory (2 n^2 floats), a row per
// step. The chunked Gated DeltaNet's WY inverse, one launch where the squarings took ~17.
template <typename T>
__device__ void unit_lower_inverse(const T* a, T* t, uint32_t n) {
    extern __shared__ float shared[];
    float* A = shared;
    float* X = shared + n * n;
    size_t base = (size_t)blockIdx.x * n * n;
    for (uint32_t e = threadIdx.x; e < n * n; e += blockDim.x) {
        A[e] = load(a, base + e);
        X[e] = 0.0f;
    }
    __syncthreads();
    uint32_t c = threadIdx.x;
    for (uint32_t i = 0; i < n; ++i) {
        if (c <= i) {
            float s = i == c ? 1.0f : 0.0f;
            for (uint32_t j = c; j < i; ++j) s -= A[i * n + j] * X[j * n + c];
            X[i * n + c] = s;
        }
        __syncthreads();
    }
    for (uint32_t e = threadIdx.x; e < n * n; e += blockDim.x) store(t, base + e, X[e]);
}

// out[i] = x[i] * s[i / per]: each head's `per` elements times its own scale (the chunked
// Gated DeltaNet's state times its chunk's decay), one thread per element.
template <typename T>
__device__ void scale_by_head(const T* x, const T* s, T* out, size_t n, size_t per) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        store(out, i, load(x, i) * load(s, i / per));
    }
}

// out[a, b, c] = src[a * s0 + b * s1 + c * s2] over a `d0 x d1 x d2` view (any transpose or
// narrowing of a 3-D tensor), one thread per output element: an exact copy.
template <typename T>
__device__ void strided_copy3(const T* src, T* out, size_t n, uint32_t d1, uint32_t d2, size_t s0,
                              size_t s1, size_t s2) {
    constexpr int V = kVec<T>;
    if (s2 == 1 && d2 % V == 0 && s1 % V == 0 && s0 % V == 0 && aligned16(src) && aligned16(out) &&
        n / V <= INT32_MAX) {
        // Rows of whole vectors (a transpose of heads, a narrowing of positions): one vector a
        // thread, its position by 32-bit arithmetic (at most 2^31 vectors, so `i` cannot wrap).
        uint32_t dv = d2 / V, count = n / V;
        const uint4* from = reinterpret_cast<const uint4*>(src);
        uint4* to = reinterpret_cast<uint4*>(out);
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
            uint32_t c = i % dv, r = i / dv, b = r % d1, a = r / d1;
            to[i] = from[(a * s0 + b * s1) / V + c];
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t c = i % d2, b = (i / d2) % d1, a = i / ((size_t)d1 * d2);
        out[i] = src[a * s0 + b * s1 + c * s2];
    }
}

}  // namespace

#define FOR_TYPES(X) X(f32, float) X(bf16, __nv_bfloat16)

#define KERNELS(NAME, T)                                                                               \
    extern "C" __global__ void masked_softmax_##NAME(const T* s, const T* m, T* p, uint32_t n,          \
                                                     uint32_t nq, float scale) {                       \
        masked_softmax(s, m, p, n, nq, scale);                                                         \
    }                                                                                                  \
    extern "C" __global__ void softmax_grad_##NAME(const T* p, const T* dp, T* ds, uint32_t n,          \
                                                   float scale) {                                      \
        softmax_grad(p, dp, ds, n, scale);                                                             \
    }                                                                                                  \
    extern "C" __global__ void cross_entropy_##NAME(const T* z, const uint32_t* y, float* nll,          \
                                                    uint32_t n) {                                      \
        cross_entropy(z, y, nll, n);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void cross_entropy_grad_##NAME(const T* z, const uint32_t* y, const float* g, \
                                                         T* dz, uint32_t n) {                          \
        cross_entropy_grad(z, y, g, dz, n);                                                            \
    }                                                                                                  \
    extern "C" __global__ void moment_##NAME(float* m, const T* g, size_t n, float beta, float scale,   \
                                             int squared) {                                            \
        moment(m, g, n, beta, scale, squared);                                                         \
    }                                                                                                  \
    extern "C" __global__ void adam_apply_##NAME(T* p, const float* m, const float* v, size_t n,        \
                                                 float lr, float decay, float c1, float c2, float eps) { \
        adam_apply(p, m, v, n, lr, decay, c1, c2, eps);                                                \
    }                                                                                                  \
    extern "C" __global__ void adamw_fused_##NAME(T* p, const T* g, float* m, float* v, size_t n,       \
                                                  float b1, float b2, float scale, float lr,           \
                                                  float decay, float c1, float c2, float eps) {        \
        adamw_fused(p, g, m, v, n, b1, b2, scale, lr, decay, c1, c2, eps, 0u, 0u);                     \
    }                                                                                                  \
    extern "C" __global__ void adamw_sr_##NAME(T* p, const T* g, __nv_bfloat16* m, __nv_bfloat16* v,      \
                                               size_t n, float b1, float b2, float scale, float lr,    \
                                               float decay, float c1, float c2, float eps,             \
                                               uint32_t seed_m, uint32_t seed_v) {                     \
        adamw_fused(p, g, m, v, n, b1, b2, scale, lr, decay, c1, c2, eps, seed_m, seed_v);             \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_##NAME(const T* x, const T* w, T* y, uint32_t n, float eps) {  \
        rms_norm(x, w, y, n, eps);                                                                     \
    }                                                                                                  \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* r, const T* w, T* out,          \
                                                   size_t rows, uint32_t n, float eps) {               \
        add_rms_norm(x, r, w, out, rows, n, eps);                                                      \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_grad_##NAME(const T* x, const T* w, const T* dy, T* dx,        \
                                                    uint32_t n, float eps) {                           \
        rms_norm_grad(x, w, dy, dx, n, eps);                                                           \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_vec_##NAME(const T* x, const T* w, T* y, size_t rows, uint32_t n, \
                                                   uint32_t per, float eps) {                          \
        rms_norm_vec(x, w, y, rows, n, per, eps);                                                      \
    }                                                                                                  \
    extern "C" __global__ void add_rms_norm_vec_##NAME(const T* x, const T* r, const T* w, T* out,      \
                                                       size_t rows, uint32_t n, uint32_t per, float eps) { \
        add_rms_norm_vec(x, r, w, out, rows, n, per, eps);                                             \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_grad_vec_##NAME(const T* x, const T* w, const T* dy, T* dx,    \
                                                        size_t rows, uint32_t n, uint32_t per, float eps) { \
        rms_norm_grad_vec(x, w, dy, dx, rows, n, per, eps);                                            \
    }                                                                                                  \
    extern "C" __global__ void rope_##NAME(const T* x, const T* c, const T* s, T* y, size_t total,     \
                                           uint32_t n, uint32_t d, float sign) {                       \
        rope(x, c, s, y, total, n, d, sign);                                                           \
    }                                                                                                  \
    extern "C" __global__ void sum_squares_##NAME(const T* x, size_t n, float* out) {                  \
        sum_squares(x, n, out);                                                                        \
    }                                                                                                  \
    extern "C" __global__ void swiglu_##NAME(const T* g, const T* u, T* h, size_t n) {                 \
        swiglu(g, u, h, n);                                                                            \
    }                                                                                                  \
    extern "C" __global__ void add_##NAME(const T* a, const T* b, T* out, size_t n) {                   \
        add(a, b, out, n);                                                                             \
    }                                                                                                  \
    extern "C" __global__ void swiglu_packed_##NAME(const T* gu, T* h, size_t n, uint32_t f) {          \
        swiglu_packed(gu, h, n, f);                                                                    \
    }                                                                                                  \
    extern "C" __global__ void swiglu_grad_##NAME(const T* g, const T* u, const T* dh, T* out, size_t n, \
                                                  int which) {                                         \
        swiglu_grad(g, u, dh, out, n, which);                                                          \
    }                                                                                                  \
    extern "C" __global__ void causal_conv_silu_##NAME(const T* x, const T* w, float* y, size_t n,       \
                                                       uint32_t channels, uint32_t k) {                \
        causal_conv_silu(x, w, y, n, channels, k);                                                     \
    }                                                                                                  \
    extern "C" __global__ void delta_scan_##NAME(const T* rows, const T* tails, const T* s0, T* out,    \
                                                 uint32_t chunks, uint32_t heads, uint32_t l,          \
                                                 uint32_t dk, uint32_t dv) {                           \
        delta_scan(rows, tails, s0, out, chunks, heads, l, dk, dv);                                    \
    }                                                                                                  \
    extern "C" __global__ void rms_rstd_##NAME(const T* x, float* r, uint32_t n, float eps) {          \
        rms_rstd(x, r, n, eps);                                                                        \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_dw_##NAME(const T* x, const T* dy, const float* r, float* part, \
                                                  uint32_t rows, uint32_t n, uint32_t per_chunk) {     \
        rms_norm_dw(x, dy, r, part, rows, n, per_chunk);                                               \
    }                                                                                                  \
    extern "C" __global__ void top_k_##NAME(const T* z, uint32_t* out, uint32_t n, uint32_t k) {       \
        top_k(z, out, n, k);                                                                           \
    }                                                                                                  \
    extern "C" __global__ void head_rows_##NAME(T* z, const uint32_t* y, float* nll, uint32_t* top,     \
                                                uint32_t n) {                                          \
        head_rows(z, y, nll, top, n);                                                                  \
    }                                                                                                  \
    extern "C" __global__ void gather_rows_##NAME(const T* t, const uint32_t* ids, T* out, size_t n,    \
                                                  uint32_t r, uint32_t rows) {                         \
        gather_rows(t, ids, out, n, r, rows);                                                          \
    }                                                                                                  \
    extern "C" __global__ void keep_append_##NAME(const T* past, const uint32_t* keep, const T* added,  \
                                                  T* out, size_t total, uint32_t len, uint32_t kept,   \
                                                  uint32_t n, uint32_t d) {                            \
        keep_append(past, keep, added, out, total, len, kept, n, d);                                   \
    }                                                                                                  \
    extern "C" __global__ void scatter_add_rows_##NAME(const T* g, const uint32_t* ids, T* t, size_t n, \
                                                       uint32_t r, uint32_t rows) {                    \
        scatter_add_rows(g, ids, t, n, r, rows);                                                       \
    }                                                                                                  \
    extern "C" __global__ void strided_copy3_##NAME(const T* src, T* out, size_t n, uint32_t d1,          \
                                                    uint32_t d2, size_t s0, size_t s1, size_t s2) {    \
        strided_copy3(src, out, n, d1, d2, s0, s1, s2);                                                \
    }                                                                                                  \
    extern "C" __global__ void chunk_decay_##NAME(const T* cum, T* out, size_t total, uint32_t l) {     \
        chunk_decay(cum, out, total, l);                                                               \
    }                                                                                                  \
    extern "C" __global__ void unit_lower_inverse_##NAME(const T* a, T* t, uint32_t n) {                \
        unit_lower_inverse(a, t, n);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void scale_by_head_##NAME(const T* x, const T* s, T* out, size_t n,             \
                                                    size_t per) {                                      \
        scale_by_head(x, s, out, n, per);                                                              \
    }

FOR_TYPES(KERNELS)

// AdamW over f32 master weights from the step's bf16 gradient, also writing the bf16 copy of the
// updated weights that the next step computes with (what a cast would make of them): one pass
// where casting the gradient up and the weights down took two more over the same bytes. The
// moments f32 (`adamw_master_bf16`) or bf16 (`adamw_master_sr_bf16`: stochastic rounding, seeds
// `seed_m`, `seed_v`).
template <typename M>
__device__ void adamw_master(float* p, const __nv_bfloat16* g, M* m, M* v, __nv_bfloat16* low, size_t n, float b1,
                             float b2, float scale, float lr, float decay, float c1, float c2, float eps,
                             uint32_t seed_m, uint32_t seed_v) {
    typedef __nv_bfloat16 bf16;
    if (n % 8 == 0 && aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned16(low)) {
        // Eight elements a thread: the gradient's and the copy's sixteen bytes, the weights'
        // thirty-two, the moments' thirty-two (f32) or sixteen (bf16).
        for (size_t i = vec_start<bf16>(); i < n; i += vec_step<bf16>()) {
            float gs[8], ps[8], ms[8], vs[8];
            load16(g + i, gs);
            load16(p + i, *reinterpret_cast<float(*)[4]>(ps));
            load16(p + i + 4, *reinterpret_cast<float(*)[4]>(ps + 4));
            load_moments8(m + i, ms);
            load_moments8(v + i, vs);
#pragma unroll
            for (int k = 0; k < 8; k++) ps[k] = adamw_value(ps[k], gs[k], ms[k], vs[k], b1, b2, scale, lr, decay, c1, c2, eps);
            store16(p + i, *reinterpret_cast<float(*)[4]>(ps));
            store16(p + i + 4, *reinterpret_cast<float(*)[4]>(ps + 4));
            store_moments8(m + i, ms, i, seed_m);
            store_moments8(v + i, vs, i, seed_v);
            store16(low + i, ps);
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float w = adamw_element(p[i], load(g, i), m, v, i, b1, b2, scale, lr, decay, c1, c2, eps, seed_m, seed_v);
        p[i] = w;
        store(low, i, w);
    }
}

extern "C" __global__ void adamw_master_bf16(float* p, const __nv_bfloat16* g, float* m, float* v,
                                             __nv_bfloat16* low, size_t n, float b1, float b2, float scale,
                                             float lr, float decay, float c1, float c2, float eps) {
    adamw_master(p, g, m, v, low, n, b1, b2, scale, lr, decay, c1, c2, eps, 0u, 0u);
}

extern "C" __global__ void adamw_master_sr_bf16(float* p, const __nv_bfloat16* g, __nv_bfloat16* m,
                                                __nv_bfloat16* v, __nv_bfloat16* low, size_t n, float b1,
                                                float b2, float scale, float lr, float decay, float c1, float c2,
                                                float eps, uint32_t seed_m, uint32_t seed_v) {
    adamw_master(p, g, m, v, low, n, b1, b2, scale, lr, decay, c1, c2, eps, seed_m, seed_v);
}
