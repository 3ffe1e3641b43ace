// Flash attention on tensor cores (bf16 in, f32 accumulation) for the frozen target's causal
// attention and the drafter's block attention (launched by stages/model/src/nn/fused/flash.rs).
//
// No score matrix is ever written: each warp owns 16 query rows of one head, walks the keys it
// may see tile by tile (keys and values staged in shared memory, shared by the warps of one
// key/value head's query group), and keeps a running max and sum (the online softmax). The
// backward pass recomputes the probabilities from the saved log-sum-exp: one kernel gives dQ
// (walking keys, as the forward does), another dK and dV (walking the query rows that see a
// key tile), so nothing is summed with atomics and the result is deterministic.
//
// What a row sees. Queries are [heads, M, D], row tiles of 16 rows. Keys and values come in two
// arrays per key/value head: k1/v1 [kv_heads, S1, D] and, in block mode, k2/v2 [kv_heads, M, D].
// - causal mode (past >= 0): row r sees k1 rows 0..=past + r (the target; no k2);
// - block mode (past < 0): row tile t sees k1 rows [0, hi[t]) and k2 rows [16t, 16t + 16) (the
//   drafter: a block of 16 sees the context before its anchor and all of its own block).
// Softmax statistics are kept in base 2 (scores times scale * log2(e)); `lse` holds them so.
//
// Fragment layouts are those of PTX's mma.m16n8k16 (row.col, bf16 -> f32): with g = lane / 4 and
// c = lane % 4, an accumulator holds rows g and g + 8 at columns 2c and 2c + 1; the A operand
// holds rows g, g + 8 at columns 2c, 2c + 1 and 2c + 8, 2c + 9; the B operand holds columns g at
// rows 2c, 2c + 1 and 2c + 8, 2c + 9. An accumulator pair of n-tiles is therefore already the
// A operand of the next product (the probabilities never leave registers).

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

typedef __nv_bfloat16 bf16;

constexpr int ROWS = 16;  // query rows per warp, and the block size of block mode
constexpr int PAD = 8;    // shared rows padded by 16 bytes: fragment loads hit distinct banks

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Two neighbouring bf16 of one row.
__device__ __forceinline__ uint32_t ld32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The A fragment of rows [0, 16) x columns [k, k + 16) of a row-major bf16 matrix with row
// stride `ld` whose rows at or past `valid` read as zero.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* x, int ld, int k, int valid) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    a[0] = g < valid ? ld32(x + g * ld + k + 2 * c) : 0u;
    a[1] = g + 8 < valid ? ld32(x + (g + 8) * ld + k + 2 * c) : 0u;
    a[2] = g < valid ? ld32(x + g * ld + k + 2 * c + 8) : 0u;
    a[3] = g + 8 < valid ? ld32(x + (g + 8) * ld + k + 2 * c + 8) : 0u;
}

// Fragments from shared memory by ldmatrix: one instruction gives a lane its parts of four 8 x 8
// bf16 matrices (lanes 8i..8i+7 address the rows of matrix i), where loading them one 32-bit
// word at a time (or, for a B operand read along its columns, one bf16 at a time) takes four
// to sixteen shared loads. Row addresses must be 16-byte aligned: shared rows are D + PAD bf16.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The same, each matrix transposed as it loads (a lane gets one column's two neighbouring rows).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// load_a's fragment of a shared matrix whose 16 rows are all valid: matrices (rows 0-7 | 8-15)
// x (columns k..k+7 | k+8..k+15), in the A fragment's register order.
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const bf16* x, int ld, int k) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldsm_x4(a, x + ((i & 1) * 8 + r) * ld + k + (i >> 1) * 8);
}

// The B fragments of rows [k0, k0 + 16) x columns [n0, n0 + 16) where B[k][n] = Y[n][k] (Y
// row-major, rows n: keys for scores, queries for dK): b[0], b[1] those of columns n0..n0+7,
// b[2], b[3] those of n0+8..n0+15.
__device__ __forceinline__ void ldsm_b_rows2(uint32_t (&b)[4], const bf16* y, int ld, int n0, int k0) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldsm_x4(b, y + (n0 + (i >> 1) * 8 + r) * ld + k0 + (i & 1) * 8);
}

// The same where B[k][n] = Y[k][n] (Y row-major, rows k: values for the output, keys for dQ),
// by transposing loads.
__device__ __forceinline__ void ldsm_b_cols2(uint32_t (&b)[4], const bf16* y, int ld, int k0, int n0) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldsm_x4_trans(b, y + (k0 + (i & 1) * 8 + r) * ld + n0 + (i >> 1) * 8);
}

// Copy rows [r0, r0 + n) of a [rows, D] bf16 matrix into shared memory (row stride D + PAD),
// rows at or past `limit` as zeros; every thread of the block takes part.
template <int D>
__device__ __forceinline__ void stage(bf16* dst, const bf16* src, int r0, int n, int limit) {
    constexpr int V = D / 8;  // 16-byte vectors per row
    for (int i = threadIdx.x; i < n * V; i += blockDim.x) {
        int r = i / V, v = i % V;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r0 + r < limit) x = reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * D)[v];
        *reinterpret_cast<uint4*>(dst + r * (D + PAD) + v * 8) = x;
    }
}

// The same copy without waiting: 16-byte cp.async per vector (rows at or past `limit` are
// zero-filled), to overlap the next tile's loads with this tile's products. The caller commits
// the group and waits for it.
template <int D>
__device__ __forceinline__ void stage_async(bf16* dst, const bf16* src, int r0, int n, int limit) {
    constexpr int V = D / 8;
    for (int i = threadIdx.x; i < n * V; i += blockDim.x) {
        int r = i / V, v = i % V;
        bool in = r0 + r < limit;
        const bf16* from = in ? src + (size_t)(r0 + r) * D + v * 8 : src;
        unsigned to = (unsigned)__cvta_generic_to_shared(dst + r * (D + PAD) + v * 8);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(in ? 16 : 0));
    }
}

__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// What the rows of one warp see: keys [0, hi) of k1 (and at most past + row in causal mode).
struct View {
    int hi;
    int past;  // < 0: block mode
    int row0;  // the warp's first query row
    __device__ bool sees(int key, int row) const { return key < hi && (past < 0 || key <= past + row); }
};

// Raw scores of the warp's 16 rows against NT * 8 keys (mma's accumulator layout) scaled into
// base 2, masked to -inf where `view` (if any) closes them; `key0` is the first key's index in k1.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], float scale2, const View* view, int key0) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = key0 + n * 8 + 2 * c + (e & 1), row = (view ? view->row0 : 0) + g + (e >= 2 ? 8 : 0);
            bool open = !view || view->sees(key, row);
            s[n][e] = open ? s[n][e] * scale2 : -INFINITY;
        }
}

// The scores of the warp's 16 rows against NT * 8 keys staged at `ks` (row stride D + PAD),
// scaled into base 2, masked to -inf where `view` (if any) closes them; `key0` is the first
// staged key's index in k1.
template <int D, int NT>
__device__ __forceinline__ void scores(float (&s)[NT][4], const uint32_t (&qa)[D / 16][4], const bf16* ks,
                                       float scale2, const View* view, int key0) {
#pragma unroll
    for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; k++)
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            ldsm_b_rows2(b, ks, D + PAD, n * 8, k * 16);
            mma(s[n], qa[k], b[0], b[1]);
            mma(s[n + 1], qa[k], b[2], b[3]);
        }
    mask_scores<NT>(s, scale2, view, key0);
}

// out[16 x D] += P[16 x NT*8] . V[NT*8 x D], P from score accumulators (bf16-rounded).
template <int D, int NT>
__device__ __forceinline__ void times_values(float (&out)[D / 8][4], const float (&p)[NT][4], const bf16* vs) {
#pragma unroll
    for (int j = 0; j < NT / 2; j++) {
        uint32_t a[4] = {pack(p[2 * j][0], p[2 * j][1]), pack(p[2 * j][2], p[2 * j][3]),
                         pack(p[2 * j + 1][0], p[2 * j + 1][1]), pack(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            ldsm_b_cols2(b, vs, D + PAD, j * 16, n * 8);
            mma(out[n], a, b[0], b[1]);
            mma(out[n + 1], a, b[2], b[3]);
        }
    }
}

// The online-softmax state of the warp's two rows per thread (g and g + 8).
template <int D>
struct Running {
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};
    float o[D / 8][4];

    __device__ Running() {
#pragma unroll
        for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    }

    // Fold in one tile of base-2 scores: rescale what is held, turn scores into probabilities,
    // add their product with the tile's values.
    template <int NT>
    __device__ __forceinline__ void fold(float (&s)[NT][4], const bf16* vs) {
        rescale<NT>(s);
        times_values<D, NT>(o, s, vs);
    }

    // The softmax half of `fold`: scores into probabilities, what is held rescaled to the new
    // running maximum.
    template <int NT>
    __device__ __forceinline__ void rescale(float (&s)[NT][4]) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; n++) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            mx = quad_max(mx);
            float next = fmaxf(m[h], mx);
            // A row that has seen nothing open yet keeps -inf; subtract 0 so exp2 gives zeros.
            float base = next == -INFINITY ? 0.f : next;
            float alpha = exp2f(m[h] - base);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                s[n][2 * h] = exp2f(s[n][2 * h] - base);
                s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
                sum += s[n][2 * h] + s[n][2 * h + 1];
            }
            l[h] = l[h] * alpha + sum;
            m[h] = next;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
        }
    }
};

constexpr int KT = 64;          // keys per staged tile in the dK/dV pass
constexpr int KT_FWD = 32;      // keys per tile in the forward pass, two tiles in flight
constexpr int KT_FWD_WIDE = 64; // the same in `flash_forward_wide` (dynamic shared memory)

// The forward pass's shared memory: two tiles of KTF keys and of their values.
template <int D, int KTF>
struct ForwardSmem {
    static constexpr int bytes = 2 * 2 * KTF * (D + PAD) * (int)sizeof(bf16);
};

// Row tiles are taken last first: the last rows see the most keys (causal mode, and block mode's
// anchors ascend), so the longest blocks of threads start first and the short ones fill in.
__device__ __forceinline__ int row_tile() { return gridDim.x - 1 - blockIdx.x; }

// Grid (row tiles, kv_heads); block 32 * group threads, warp w = query head kv * group + w.
// Keys come in tiles of KTF, two in flight, staged at `smem` (ForwardSmem<D, KTF>::bytes:
// key tiles, then value tiles).
template <int D, int KTF>
__device__ void flash_forward(unsigned char* smem, const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,
                              const bf16* v2, const uint32_t* hi, bf16* out, float* lse, int m, int s1, int group,
                              int past, float scale2) {
    constexpr int TILE = KTF * (D + PAD);
    bf16* ks_all = reinterpret_cast<bf16*>(smem);
    bf16* vs_all = ks_all + 2 * TILE;
    auto ks = [&](int b) { return ks_all + b * TILE; };
    auto vs = [&](int b) { return vs_all + b * TILE; };
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, head = kv * group + warp, tile = row_tile(), row0 = tile * ROWS;
    const bf16* qh = q + ((size_t)head * m + row0) * D;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int k = 0; k < D / 16; k++) load_a(qa[k], qh, D, k * 16, m - row0);
    View view;
    view.past = past;
    view.row0 = row0;
    view.hi = past >= 0 ? min(past + row0 + ROWS, s1) : (int)hi[tile];
    Running<D> run;
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    int tiles = (view.hi + KTF - 1) / KTF;
    if (tiles > 0) {
        stage_async<D>(ks(0), kh, 0, KTF, s1);
        stage_async<D>(vs(0), vh, 0, KTF, s1);
    }
    async_commit();
    for (int t = 0; t < tiles; t++) {
        // Tile t + 1 loads while tile t is multiplied; its buffer was last read before the
        // barrier that ended the previous iteration.
        if (t + 1 < tiles) {
            stage_async<D>(ks((t + 1) & 1), kh, (t + 1) * KTF, KTF, s1);
            stage_async<D>(vs((t + 1) & 1), vh, (t + 1) * KTF, KTF, s1);
        }
        async_commit();
        async_wait<1>();
        __syncthreads();
        float sc[KTF / 8][4];
        scores<D, KTF / 8>(sc, qa, ks(t & 1), scale2, &view, t * KTF);
        run.template fold<KTF / 8>(sc, vs(t & 1));
        __syncthreads();
    }
    if (past < 0) {
        // The block's own 16 keys, all open.
        async_wait<0>();
        stage<D>(ks(0), k2 + (size_t)kv * m * D, row0, ROWS, m);
        stage<D>(vs(0), v2 + (size_t)kv * m * D, row0, ROWS, m);
        __syncthreads();
        float sc[ROWS / 8][4];
        scores<D, ROWS / 8>(sc, qa, ks(0), scale2, nullptr, 0);
        run.template fold<ROWS / 8>(sc, vs(0));
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float l = quad_sum(run.l[h]);
        float inv = l > 0.f ? 1.f / l : 0.f;
        int row = row0 + g + 8 * h;
        if (row < m) {
            bf16* o = out + ((size_t)head * m + row) * D;
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) = pack(run.o[n][2 * h] * inv, run.o[n][2 * h + 1] * inv);
            if (c == 0) lse[(size_t)head * m + row] = l > 0.f ? run.m[h] + log2f(l) : INFINITY;
        }
    }
}

// The scores of MT row tiles of 16 (queries staged at `qs`, row stride D + PAD) against NT * 8
// keys staged at `ks`, as `scores` gives them: each key fragment loaded once serves every row
// tile, and the query fragments come from shared memory (registers hold the accumulators of
// MT row tiles instead). `views` (one a row tile, or null: all open) close keys as `scores`'
// view does.
template <int D, int NT, int MT>
__device__ __forceinline__ void scores_tall(float (&s)[MT][NT][4], const bf16* qs, const bf16* ks, float scale2,
                                            const View* views, int key0) {
    constexpr int LD = D + PAD;
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int n = 0; n < NT; n++) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int i = 0; i < MT; i++) ldsm_a(qa[i], qs + i * ROWS * LD, LD, k * 16);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            ldsm_b_rows2(b, ks, LD, n * 8, k * 16);
#pragma unroll
            for (int i = 0; i < MT; i++) {
                mma(s[i][n], qa[i], b[0], b[1]);
                mma(s[i][n + 1], qa[i], b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = key0 + n * 8 + 2 * c + (e & 1);
                int row = (views ? views[i].row0 : 0) + g + (e >= 2 ? 8 : 0);
                bool open = !views || views[i].sees(key, row);
                s[i][n][e] = open ? s[i][n][e] * scale2 : -INFINITY;
            }
}

constexpr int TALL = 2;  // row tiles of 16 a warp in `flash_forward_tall`

// flash_forward with TALL row tiles a warp (32 query rows of one head; FlashAttention-2's
// shape for d = 128): each key and value fragment read from shared memory feeds twice the
// products, and each block of threads stages its key tiles for twice the rows, which halves
// what the forward reads from L2 and shared memory per product. Queries wait in shared memory
// (ldmatrix per product step) where flash_forward holds them in registers: the registers hold
// two row tiles' accumulators instead. Grid (row tiles of TALL * 16, kv_heads); block 32 *
// group threads; dynamic shared memory (flash.rs's `Forward::smem`, the layout below): two tiles
// of KTF keys and of their values, then every head's TALL * 16 query rows. Row tile i of a warp keeps its
// own online softmax and view (block mode: its own `hi` and its own 16 keys of k2).
template <int D, int KTF>
__device__ void flash_forward_tall(unsigned char* smem, const bf16* q, const bf16* k1, const bf16* v1,
                                   const bf16* k2, const bf16* v2, const uint32_t* hi, bf16* out, float* lse, int m,
                                   int s1, int group, int past, float scale2) {
    constexpr int LD = D + PAD, TILE = KTF * LD;
    bf16* ks_all = reinterpret_cast<bf16*>(smem);
    bf16* vs_all = ks_all + 2 * TILE;
    bf16* qs_all = vs_all + 2 * TILE;
    auto ks = [&](int b) { return ks_all + b * TILE; };
    auto vs = [&](int b) { return vs_all + b * TILE; };
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, head = kv * group + warp, tile = row_tile(), row0 = tile * TALL * ROWS;
    bf16* qs = qs_all + warp * TALL * ROWS * LD;
    for (int h = 0; h < group; h++)
        stage_async<D>(qs_all + h * TALL * ROWS * LD, q + (size_t)(kv * group + h) * m * D, row0, TALL * ROWS, m);
    View views[TALL];
    int reach = 0;  // keys of k1 the last row tile sees (row tiles see ascending prefixes)
#pragma unroll
    for (int i = 0; i < TALL; i++) {
        int r0 = row0 + i * ROWS;
        views[i].past = past;
        views[i].row0 = r0;
        views[i].hi = r0 >= m ? 0 : past >= 0 ? min(past + r0 + ROWS, s1) : (int)hi[r0 / ROWS];
        reach = max(reach, views[i].hi);
    }
    Running<D> run[TALL];
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    int tiles = (reach + KTF - 1) / KTF;
    if (tiles > 0) {
        stage_async<D>(ks(0), kh, 0, KTF, s1);
        stage_async<D>(vs(0), vh, 0, KTF, s1);
    }
    async_commit();  // the queries and the first tile, one group
    for (int t = 0; t < tiles; t++) {
        if (t + 1 < tiles) {
            stage_async<D>(ks((t + 1) & 1), kh, (t + 1) * KTF, KTF, s1);
            stage_async<D>(vs((t + 1) & 1), vh, (t + 1) * KTF, KTF, s1);
        }
        async_commit();
        async_wait<1>();
        __syncthreads();
        float sc[TALL][KTF / 8][4];
        scores_tall<D, KTF / 8, TALL>(sc, qs, ks(t & 1), scale2, views, t * KTF);
#pragma unroll
        for (int i = 0; i < TALL; i++)
            if (t * KTF < views[i].hi) run[i].template fold<KTF / 8>(sc[i], vs(t & 1));  // uniform over the warp
        __syncthreads();
    }
    async_wait<0>();  // the queries, where no tile of k1 was staged
    if (past < 0) {
        // Each row tile's own 16 keys, all open.
        stage<D>(ks(0), k2 + (size_t)kv * m * D, row0, TALL * ROWS, m);
        stage<D>(vs(0), v2 + (size_t)kv * m * D, row0, TALL * ROWS, m);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TALL; i++) {
            if (row0 + i * ROWS >= m) continue;
            float sc[1][ROWS / 8][4];
            scores_tall<D, ROWS / 8, 1>(sc, qs + i * ROWS * LD, ks(0) + i * ROWS * LD, scale2, nullptr, 0);
            run[i].template fold<ROWS / 8>(sc[0], vs(0) + i * ROWS * LD);
        }
    }
#pragma unroll
    for (int i = 0; i < TALL; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float l = quad_sum(run[i].l[h]);
            float inv = l > 0.f ? 1.f / l : 0.f;
            int row = row0 + i * ROWS + g + 8 * h;
            if (row < m) {
                bf16* o = out + ((size_t)head * m + row) * D;
#pragma unroll
                for (int n = 0; n < D / 8; n++)
                    *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) =
                        pack(run[i].o[n][2 * h] * inv, run[i].o[n][2 * h + 1] * inv);
                if (c == 0) lse[(size_t)head * m + row] = l > 0.f ? run[i].m[h] + log2f(l) : INFINITY;
            }
        }
}

// The forward on Hopper's warpgroup MMA (`flash_forward_wg`, causal mode, groups of four heads):
// the four warps of a block are one warpgroup, so one `wgmma` computes the scores of all four
// heads' 16 rows against a key tile, reading the tile from shared memory once for the four
// where each warp of flash_forward reads it for itself. The keys are staged K-major in the
// 128-byte swizzle (`stage_async_sw128`) that `wgmma` reads through a matrix descriptor; the
// queries stay in registers (the A fragment of `wgmma` with A in registers is, warp by warp,
// mma.m16n8k16's), and so do the accumulators (warp by warp, mma's too), so the online softmax
// and the values' product are flash_forward's. Only where the PTX targets sm_90a (the build's
// default for compute capability 9.0); elsewhere the kernel traps, and flash.rs never picks it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASH_WGMMA 1
#endif

#ifdef DFLASH_WGMMA
constexpr int KT_WG = 64;  // keys per tile in flash_forward_wg (wgmma's N)

// Rows [r0, r0 + n) of a [rows, D] bf16 matrix into rows [row_at, row_at + n) of a tile of
// `atom_rows` rows at `dst` (1024-byte aligned), K-major in the 128-byte swizzle, rows at or
// past `limit` as zeros, by cp.async: D / 64 atoms of atom_rows rows x 64 columns (a row 128
// bytes), atom a at dst + a * atom_rows * 64; a row's 16-byte chunk j sits at chunk j ^ (row % 8),
// so eight rows' same chunk fall in eight different bank groups (row_at a multiple of 8, so the
// source row's swizzle is the tile row's). Several sources' rows can so make one tile.
template <int D>
__device__ __forceinline__ void stage_async_sw128_at(bf16* dst, int atom_rows, int row_at, const bf16* src, int r0,
                                                     int n, int limit) {
    constexpr int V = D / 8;
    for (int i = threadIdx.x; i < n * V; i += blockDim.x) {
        int r = i / V, v = i % V;
        bool in = r0 + r < limit;
        const bf16* from = in ? src + (size_t)(r0 + r) * D + v * 8 : src;
        bf16* at = dst + (v >> 3) * atom_rows * 64 + (row_at + r) * 64 + (((v & 7) ^ (r & 7)) * 8);
        unsigned to = (unsigned)__cvta_generic_to_shared(at);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(in ? 16 : 0));
    }
}

// The whole tile from one source: n rows at row 0.
template <int D>
__device__ __forceinline__ void stage_async_sw128(bf16* dst, const bf16* src, int r0, int n, int limit) {
    stage_async_sw128_at<D>(dst, n, 0, src, r0, n, limit);
}

// The matrix descriptor of a 128-byte-swizzled operand starting at `p` (16-byte units), laid out
// as stage_async_sw128 leaves it: the swizzle mode (1: 128 bytes); the stride byte offset, 1,024
// bytes (eight rows of the atom: K-major, the next eight of N; MN-major, the next eight of K);
// the leading byte offset `lbo`, unused K-major (1 by convention, 16 bytes), MN-major the step
// from one atom's 64 columns of N to the next's.
__device__ __forceinline__ uint64_t sw128_desc(const bf16* p, uint32_t lbo = 16) {
    uint64_t a = (unsigned)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// d (the warp's 16 rows x N, mma's accumulator layout) += A (registers, warp by warp mma's A
// fragment) . B (descriptor: K-major, or N-major where TRANS_B), one k-step of 16.
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma_k16(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc) {
    static_assert(N == 64 || N == 128, "wgmma_k16: N of 64 or 128");
    if constexpr (N == 64) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B));
    }
}

// d (the warp's 16 rows x 64, as wgmma_k16's) += A . B, both by descriptor, K-major (the A
// tile's 64 rows are the warpgroup's M, a warp's 16 its own), one k-step of 16.
__device__ __forceinline__ void wgmma_ss_k16(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(desc_a), "l"(desc_b));
}

// Keep the compiler from moving the accumulators' reads across the wait.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// The descriptor of k-step k (16 columns) of a K-major swizzled tile of `rows` rows, as
// stage_async_sw128 leaves it: atom k / 4, 32 bytes a k-step within the atom's 128-byte rows.
__device__ __forceinline__ uint64_t sw128_kstep(const bf16* tile, int rows, int k) {
    return sw128_desc(tile + (k >> 2) * rows * 64 + (k & 3) * 16);
}

// Commit the wgmma chains issued, wait for them, and keep the accumulators' reads after it.
template <int NT>
__device__ __forceinline__ void wgmma_done(float (&a)[NT][4]) {
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) fence_operand(a[n][e]);
}

// The same for two accumulators (two chains in one commit group).
template <int NT>
__device__ __forceinline__ void wgmma_done(float (&a)[NT][4], float (&b)[NT][4]) {
    wgmma_done<NT>(a);
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) fence_operand(b[n][e]);
}

// An accumulator's NT n-tiles of 8 columns (mma's layout, a warp's 16 rows) rounded to bf16 as
// the A fragments of NT / 2 k-steps of 16: a pair of n-tiles is one k-step's fragment.
template <int NT>
__device__ __forceinline__ void to_a_fragments(uint32_t (&a)[NT / 2][4], const float (&acc)[NT][4]) {
#pragma unroll
    for (int j = 0; j < NT / 2; j++) {
        a[j][0] = pack(acc[2 * j][0], acc[2 * j][1]);
        a[j][1] = pack(acc[2 * j][2], acc[2 * j][3]);
        a[j][2] = pack(acc[2 * j + 1][0], acc[2 * j + 1][1]);
        a[j][3] = pack(acc[2 * j + 1][2], acc[2 * j + 1][3]);
    }
}
#endif

// Causal mode (past >= 0; or with BLOCK block mode, below), group == 4 (one warpgroup a block;
// the launch's group, which the other forward kernels take, is not read; nor k2, v2 and hi in
// causal mode). Grid (row tiles, kv_heads);
// 128 threads; dynamic shared memory: up to 1,023 bytes to align, two swizzled key tiles of
// KT_WG x D, two value tiles: padded, KT_WG x (D + PAD), or with VALUES swizzled as the keys,
// KT_WG x D (flash.rs's `Forward::smem`).
//
// VALUES: the values' product on wgmma too (flash_forward_wgv): the value tiles staged in the
// same swizzle, read N-major (the head's columns are N, the keys K), the probabilities the A
// fragment in registers, the output accumulators wgmma's; else mma.sync, as flash_forward.
//
// BLOCK: block mode (`flash_forward_wgv_block`, with VALUES): a row tile (one anchor's block)
// sees the context keys below `hi[tile]`, then its own 16 keys (k2's and v2's rows of the tile:
// one more tile, the rest of it zeros, closed); `past` is not read.
template <int D, bool VALUES, bool BLOCK = false>
__device__ void flash_forward_wg(unsigned char* smem, const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,
                                 const bf16* v2, const uint32_t* hi, bf16* out, float* lse, int m, int s1, int past,
                                 float scale2) {
    static_assert(VALUES || !BLOCK, "block mode on wgmma takes the values' product there too");
#ifdef DFLASH_WGMMA
    constexpr int KTILE = KT_WG * D, VTILE = VALUES ? KT_WG * D : KT_WG * (D + PAD);
    unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    bf16* ks_all = reinterpret_cast<bf16*>(smem + ((1024 - (base & 1023)) & 1023));
    bf16* vs_all = ks_all + 2 * KTILE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int group = 4, kv = blockIdx.y, head = kv * group + warp, tile = row_tile(), row0 = tile * ROWS;
    const bf16* qh = q + ((size_t)head * m + row0) * D;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int k = 0; k < D / 16; k++) load_a(qa[k], qh, D, k * 16, m - row0);
    View view;
    view.past = BLOCK ? -1 : past;
    view.row0 = row0;
    view.hi = BLOCK ? (int)hi[tile] : min(past + row0 + ROWS, s1);
    Running<D> run;
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    // The context's tiles, then in block mode the row tile's own keys.
    int context = (view.hi + KT_WG - 1) / KT_WG, tiles = context + (BLOCK ? 1 : 0);
    auto issue = [&](int t) {
        if (BLOCK && t == context) {
            int own_end = min(row0 + ROWS, m);
            stage_async_sw128<D>(ks_all + (t & 1) * KTILE, k2 + (size_t)kv * m * D, row0, KT_WG, own_end);
            stage_async_sw128<D>(vs_all + (t & 1) * VTILE, v2 + (size_t)kv * m * D, row0, KT_WG, own_end);
            return;
        }
        stage_async_sw128<D>(ks_all + (t & 1) * KTILE, kh, t * KT_WG, KT_WG, s1);
        if constexpr (VALUES)
            stage_async_sw128<D>(vs_all + (t & 1) * VTILE, vh, t * KT_WG, KT_WG, s1);
        else
            stage_async<D>(vs_all + (t & 1) * VTILE, vh, t * KT_WG, KT_WG, s1);
    };
    if (tiles > 0) issue(0);
    async_commit();
    for (int t = 0; t < tiles; t++) {
        if (t + 1 < tiles) issue(t + 1);
        async_commit();
        async_wait<1>();
        fence_proxy_async();  // this thread's staged keys, visible to wgmma's reads
        __syncthreads();
        const bf16* kt = ks_all + (t & 1) * KTILE;
        float sc[KT_WG / 8][4];
#pragma unroll
        for (int n = 0; n < KT_WG / 8; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < D / 16; k++)
            wgmma_k16<KT_WG, 0>(sc, qa[k], sw128_kstep(kt, KT_WG, k));
        wgmma_done<KT_WG / 8>(sc);
        if (BLOCK && t == context) {
            // The own tile: all 16 of the block's keys open to its rows, the zeros past them shut.
#pragma unroll
            for (int n = 0; n < KT_WG / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) sc[n][e] = n * 8 + 2 * c + (e & 1) < ROWS ? sc[n][e] * scale2 : -INFINITY;
        } else {
            mask_scores<KT_WG / 8>(sc, scale2, &view, t * KT_WG);
        }
        if constexpr (VALUES) {
            run.template rescale<KT_WG / 8>(sc);
            const bf16* vt = vs_all + (t & 1) * VTILE;
            // Every k-step's A fragment packed before the first wgmma (registers written between
            // them make ptxas serialize the warpgroup around each).
            uint32_t pa[KT_WG / 16][4];
            to_a_fragments<KT_WG / 8>(pa, sc);
            wgmma_fence();  // the rescaled accumulators and the fragments, before wgmma reads them
#pragma unroll
            for (int j = 0; j < KT_WG / 16; j++)
                // Keys 16j.. (two groups of eight rows, 1,024 bytes each); the next 64 of the
                // head's columns one atom (KT_WG rows of 128 bytes) on.
                wgmma_k16<D, 1>(run.o, pa[j], sw128_desc(vt + j * 16 * 64, KT_WG * 128));
            wgmma_done<D / 8>(run.o);
        } else {
            run.template fold<KT_WG / 8>(sc, vs_all + (t & 1) * VTILE);
        }
        __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float l = quad_sum(run.l[h]);
        float inv = l > 0.f ? 1.f / l : 0.f;
        int row = row0 + g + 8 * h;
        if (row < m) {
            bf16* o = out + ((size_t)head * m + row) * D;
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) = pack(run.o[n][2 * h] * inv, run.o[n][2 * h + 1] * inv);
            if (c == 0) lse[(size_t)head * m + row] = l > 0.f ? run.m[h] + log2f(l) : INFINITY;
        }
    }
#else
    __trap();
#endif
}

constexpr int KT_DQ = 32;  // keys per staged tile in the dQ pass (two more accumulators live)

// A dQ kernel's warp, its 16 rows of one head (row tile `tile`), made ready: the queries' and
// output gradients' A fragments; delta = rowsum(dO * O) and lse of rows g and g + 8, delta
// written out for the dK/dV pass (rows at or past m: delta 0, lse +inf, so their probabilities
// are 0); dQ's accumulators at zero; the view of the context (block mode: `hi[tile]` keys).
template <int D>
__device__ __forceinline__ void dq_rows(uint32_t (&qa)[D / 16][4], uint32_t (&da)[D / 16][4], float (&dl)[2],
                                        float (&ls)[2], float (&acc)[D / 8][4], View& view, const bf16* q,
                                        const bf16* dout, const bf16* out, const float* lse, float* delta,
                                        const uint32_t* hi, int head, int tile, int m) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, row0 = tile * ROWS;
    size_t at = ((size_t)head * m + row0) * D;
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        load_a(qa[k], q + at, D, k * 16, m - row0);
        load_a(da[k], dout + at, D, k * 16, m - row0);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row0 + g + 8 * h;
        float sum = 0.f;
        if (row < m) {
            const bf16* o = out + ((size_t)head * m + row) * D;
            const bf16* d = dout + ((size_t)head * m + row) * D;
            for (int j = 2 * c; j < D; j += 8) {
                sum += __bfloat162float(o[j]) * __bfloat162float(d[j]);
                sum += __bfloat162float(o[j + 1]) * __bfloat162float(d[j + 1]);
            }
        }
        dl[h] = quad_sum(sum);
        ls[h] = row < m ? lse[(size_t)head * m + row] : INFINITY;
        if (c == 0 && row < m) delta[(size_t)head * m + row] = dl[h];
    }
#pragma unroll
    for (int n = 0; n < D / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    view.past = -1;
    view.row0 = row0;
    view.hi = (int)hi[tile];
}

// dQ for block mode, and delta = rowsum(dO * O), which the dK/dV pass reads. Same grid as the
// forward.
template <int D>
__device__ void flash_dq(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2,
                         const uint32_t* hi, const bf16* out, const bf16* dout, const float* lse, float* delta,
                         bf16* dq, int m, int s1, int group, float scale2, float scale) {
    __shared__ __align__(16) bf16 ks[2][KT_DQ * (D + PAD)];
    __shared__ __align__(16) bf16 vs[2][KT_DQ * (D + PAD)];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, head = kv * group + warp, tile = row_tile(), row0 = tile * ROWS;
    uint32_t qa[D / 16][4], da[D / 16][4];
    float dl[2], ls[2], acc[D / 8][4];
    View view;
    dq_rows<D>(qa, da, dl, ls, acc, view, q, dout, out, lse, delta, hi, head, tile, m);
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    int tiles = (view.hi + KT_DQ - 1) / KT_DQ;
    // Tiles of k1, then the block's own keys (one more tile of 16); tile t + 1 loads while tile
    // t is multiplied.
    auto issue = [&](int t) {
        if (t == tiles) {
            stage_async<D>(ks[t & 1], k2 + (size_t)kv * m * D, row0, ROWS, m);
            stage_async<D>(vs[t & 1], v2 + (size_t)kv * m * D, row0, ROWS, m);
        } else {
            stage_async<D>(ks[t & 1], kh, t * KT_DQ, KT_DQ, s1);
            stage_async<D>(vs[t & 1], vh, t * KT_DQ, KT_DQ, s1);
        }
        async_commit();
    };
    issue(0);
    for (int t = 0; t <= tiles; t++) {
        bool own = t == tiles;
        if (t < tiles) issue(t + 1);
        else async_commit();  // an empty group keeps the wait below uniform
        async_wait<1>();
        __syncthreads();
        const bf16* kt = ks[t & 1];
        const bf16* vt = vs[t & 1];
        constexpr int NT = KT_DQ / 8;
        float p[NT][4], dp[NT][4];
        scores<D, NT>(p, qa, kt, scale2, own ? nullptr : &view, t * KT_DQ);
        int nt = own ? ROWS / 8 : NT;  // the own tile has 16 keys; the rest read as closed
#pragma unroll
        for (int n = 0; n < NT; n++) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            if (n >= nt) continue;  // nt is even: a pair is open or closed as one
#pragma unroll
            for (int k = 0; k < D / 16; k++) {
                uint32_t b[4];
                ldsm_b_rows2(b, vt, D + PAD, n * 8, k * 16);
                mma(dp[n], da[k], b[0], b[1]);
                mma(dp[n + 1], da[k], b[2], b[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int h = e >> 1;
                float pr = n < nt ? exp2f(p[n][e] - ls[h]) : 0.f;
                p[n][e] = pr * (dp[n][e] - dl[h]);  // dS, in the units of the scaled scores
            }
#pragma unroll
        for (int j = 0; j < NT / 2; j++) {
            if (2 * j >= nt) continue;
            uint32_t a[4] = {pack(p[2 * j][0], p[2 * j][1]), pack(p[2 * j][2], p[2 * j][3]),
                             pack(p[2 * j + 1][0], p[2 * j + 1][1]), pack(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t b[4];
                ldsm_b_cols2(b, kt, D + PAD, j * 16, n * 8);
                mma(acc[n], a, b[0], b[1]);
                mma(acc[n + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // the next iteration loads into the buffer read here
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row0 + g + 8 * h;
        if (row >= m) continue;
        bf16* o = dq + ((size_t)head * m + row) * D;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) = pack(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
    }
}

// flash_dq with TALL row tiles a warp, as flash_forward_tall is to flash_forward: each key and
// value fragment feeds twice the products and each staged key tile twice the rows; queries and
// output gradients wait in shared memory. The block's own keys (TALL row tiles' 16 each) are
// one tile of TALL * 16 keys, row tile i's closed to the others. Grid (row tiles of TALL * 16,
// kv_heads); block 32 * group threads; dynamic shared memory (flash.rs's `dq_kernel`, the
// layout below): two tiles of KT_DQ keys and of their values, every head's TALL * 16 rows of q,
// then of dout.

template <int D>
__device__ void flash_dq_tall(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2,
                              const uint32_t* hi, const bf16* out, const bf16* dout, const float* lse, float* delta,
                              bf16* dq, int m, int s1, int group, float scale2, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = D + PAD, TILE = KT_DQ * LD, NT = KT_DQ / 8;
    bf16* ks_all = reinterpret_cast<bf16*>(smem);
    bf16* vs_all = ks_all + 2 * TILE;
    bf16* qs_all = vs_all + 2 * TILE;                // [group][TALL * 16][LD]
    bf16* ds_all = qs_all + group * TALL * ROWS * LD;  // the same for dout
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, head = kv * group + warp, tile = row_tile(), row0 = tile * TALL * ROWS;
    for (int h = 0; h < group; h++) {
        size_t at = (size_t)(kv * group + h) * m * D;
        stage_async<D>(qs_all + h * TALL * ROWS * LD, q + at, row0, TALL * ROWS, m);
        stage_async<D>(ds_all + h * TALL * ROWS * LD, dout + at, row0, TALL * ROWS, m);
    }
    const bf16* qs = qs_all + warp * TALL * ROWS * LD;
    const bf16* ds = ds_all + warp * TALL * ROWS * LD;
    // delta and lse of each row tile's rows g and g + 8; the views of the context.
    float dl[TALL][2], ls[TALL][2];
    View views[TALL];
    int reach = 0;
#pragma unroll
    for (int i = 0; i < TALL; i++) {
        int r0 = row0 + i * ROWS;
        views[i].past = -1;
        views[i].row0 = r0;
        views[i].hi = r0 < m ? (int)hi[r0 / ROWS] : 0;
        reach = max(reach, views[i].hi);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = r0 + g + 8 * h;
            float sum = 0.f;
            if (row < m) {
                const bf16* o = out + ((size_t)head * m + row) * D;
                const bf16* d = dout + ((size_t)head * m + row) * D;
                for (int j = 2 * c; j < D; j += 8) {
                    sum += __bfloat162float(o[j]) * __bfloat162float(d[j]);
                    sum += __bfloat162float(o[j + 1]) * __bfloat162float(d[j + 1]);
                }
            }
            dl[i][h] = quad_sum(sum);
            ls[i][h] = row < m ? lse[(size_t)head * m + row] : INFINITY;
            if (c == 0 && row < m) delta[(size_t)head * m + row] = dl[i][h];
        }
    }
    float acc[TALL][D / 8][4];
#pragma unroll
    for (int i = 0; i < TALL; i++)
#pragma unroll
        for (int n = 0; n < D / 8; n++) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    int tiles = (reach + KT_DQ - 1) / KT_DQ;
    // Tiles of k1, then the block's own keys (one tile of TALL * 16 = KT_DQ keys).
    auto issue = [&](int t) {
        if (t == tiles) {
            stage_async<D>(ks_all + (t & 1) * TILE, k2 + (size_t)kv * m * D, row0, TALL * ROWS, m);
            stage_async<D>(vs_all + (t & 1) * TILE, v2 + (size_t)kv * m * D, row0, TALL * ROWS, m);
        } else {
            stage_async<D>(ks_all + (t & 1) * TILE, kh, t * KT_DQ, KT_DQ, s1);
            stage_async<D>(vs_all + (t & 1) * TILE, vh, t * KT_DQ, KT_DQ, s1);
        }
        async_commit();
    };
    issue(0);  // with the queries and output gradients: one group
    for (int t = 0; t <= tiles; t++) {
        bool own = t == tiles;
        if (t < tiles) issue(t + 1);
        else async_commit();  // an empty group keeps the wait below uniform
        async_wait<1>();
        __syncthreads();
        const bf16* kt = ks_all + (t & 1) * TILE;
        const bf16* vt = vs_all + (t & 1) * TILE;
        float p[TALL][NT][4], dp[TALL][NT][4];
        scores_tall<D, NT, TALL>(p, qs, kt, scale2, own ? nullptr : views, t * KT_DQ);
        // dP = dO V^T (the same shape as the scores, by the same fragments' loop).
        scores_tall<D, NT, TALL>(dp, ds, vt, 1.f, nullptr, 0);
#pragma unroll
        for (int i = 0; i < TALL; i++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int h = e >> 1;
                    // The own tile: row tile i sees its own 16 keys (n-tiles 2i, 2i + 1) alone.
                    bool open = own ? (n >> 1) == i : true;
                    float pr = open ? exp2f(p[i][n][e] - ls[i][h]) : 0.f;
                    p[i][n][e] = pr * (dp[i][n][e] - dl[i][h]);  // dS, in the units of the scaled scores
                }
#pragma unroll
        for (int j = 0; j < NT / 2; j++) {
            uint32_t a[TALL][4];
#pragma unroll
            for (int i = 0; i < TALL; i++) {
                a[i][0] = pack(p[i][2 * j][0], p[i][2 * j][1]);
                a[i][1] = pack(p[i][2 * j][2], p[i][2 * j][3]);
                a[i][2] = pack(p[i][2 * j + 1][0], p[i][2 * j + 1][1]);
                a[i][3] = pack(p[i][2 * j + 1][2], p[i][2 * j + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t b[4];
                ldsm_b_cols2(b, kt, LD, j * 16, n * 8);
#pragma unroll
                for (int i = 0; i < TALL; i++) {
                    if (own && j != i) continue;  // compile-time after unrolling, uniform
                    mma(acc[i][n], a[i], b[0], b[1]);
                    mma(acc[i][n + 1], a[i], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // the next iteration loads into the buffer read here
    }
#pragma unroll
    for (int i = 0; i < TALL; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = row0 + i * ROWS + g + 8 * h;
            if (row >= m) continue;
            bf16* o = dq + ((size_t)head * m + row) * D;
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) =
                    pack(acc[i][n][2 * h] * scale, acc[i][n][2 * h + 1] * scale);
        }
}

// dQ on Hopper's warpgroup MMA (`flash_dq_wg`; block mode, groups of four heads, flash_dq's
// operands and outputs, delta among them). A block's four warps (the group's heads, 16 rows of
// one block each) are one warpgroup. Per tile of 64 keys: S = Q K^T and dP = dO V^T by wgmma
// (the queries and output gradients the A fragments, in registers; keys and values K-major from
// tiles in the 128-byte swizzle), dS = P (dP - delta) in registers, then dQ += dS K by wgmma with
// the same key tile read N-major. The block's own 16 keys: one more tile, k2's rows in its first
// 16 (the rest zeros, closed). Dynamic shared memory: up to 1,023 bytes to align, two key and two
// value tiles of KT_WG x D (flash.rs's dQ kernel choice). Where the PTX is not sm_90a it traps.
template <int D>
__device__ void flash_dq_wg(unsigned char* smem, const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,
                            const bf16* v2, const uint32_t* hi, const bf16* out, const bf16* dout, const float* lse,
                            float* delta, bf16* dq, int m, int s1, float scale2, float scale) {
#ifdef DFLASH_WGMMA
    constexpr int TILE = KT_WG * D;
    unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    bf16* ks_all = reinterpret_cast<bf16*>(smem + ((1024 - (base & 1023)) & 1023));
    bf16* vs_all = ks_all + 2 * TILE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, head = kv * 4 + warp, tile = row_tile(), row0 = tile * ROWS;
    uint32_t qa[D / 16][4], da[D / 16][4];
    float dl[2], ls[2], acc[D / 8][4];
    View view;
    dq_rows<D>(qa, da, dl, ls, acc, view, q, dout, out, lse, delta, hi, head, tile, m);
    const bf16* kh = k1 + (size_t)kv * s1 * D;
    const bf16* vh = v1 + (size_t)kv * s1 * D;
    int tiles = (view.hi + KT_WG - 1) / KT_WG;
    // Tiles of k1, then the block's own keys.
    auto issue = [&](int t) {
        if (t == tiles) {
            int own_end = min(row0 + ROWS, m);
            stage_async_sw128<D>(ks_all + (t & 1) * TILE, k2 + (size_t)kv * m * D, row0, KT_WG, own_end);
            stage_async_sw128<D>(vs_all + (t & 1) * TILE, v2 + (size_t)kv * m * D, row0, KT_WG, own_end);
        } else {
            stage_async_sw128<D>(ks_all + (t & 1) * TILE, kh, t * KT_WG, KT_WG, s1);
            stage_async_sw128<D>(vs_all + (t & 1) * TILE, vh, t * KT_WG, KT_WG, s1);
        }
    };
    issue(0);
    async_commit();
    for (int t = 0; t <= tiles; t++) {
        bool own = t == tiles;
        if (t < tiles) issue(t + 1);
        async_commit();  // empty after the last tile: keeps the wait below uniform
        async_wait<1>();
        fence_proxy_async();  // this thread's staged tiles, visible to wgmma's reads
        __syncthreads();
        const bf16* kt = ks_all + (t & 1) * TILE;
        const bf16* vt = vs_all + (t & 1) * TILE;
        float sc[KT_WG / 8][4], dp[KT_WG / 8][4];
#pragma unroll
        for (int n = 0; n < KT_WG / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[n][e] = dp[n][e] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < D / 16; k++)
            wgmma_k16<KT_WG, 0>(sc, qa[k], sw128_kstep(kt, KT_WG, k));
#pragma unroll
        for (int k = 0; k < D / 16; k++) wgmma_k16<KT_WG, 0>(dp, da[k], sw128_kstep(vt, KT_WG, k));
        wgmma_done<KT_WG / 8>(sc, dp);
        // dS = P (dP - delta), in the units of the scaled scores; closed keys' P is 0: past the
        // row tile's context, or in the own tile past its 16 keys.
        uint32_t pa[KT_WG / 16][4];
#pragma unroll
        for (int n = 0; n < KT_WG / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int h = e >> 1, col = n * 8 + 2 * c + (e & 1);
                bool open = own ? col < ROWS : view.sees(t * KT_WG + col, row0 + g + 8 * h);
                float pr = open ? exp2f(sc[n][e] * scale2 - ls[h]) : 0.f;
                sc[n][e] = pr * (dp[n][e] - dl[h]);
            }
        to_a_fragments<KT_WG / 8>(pa, sc);
        wgmma_fence();  // the fragments and the accumulators, before wgmma reads them
#pragma unroll
        for (int j = 0; j < KT_WG / 16; j++)
            // Keys 16j.. of the tile (K), the head's columns (N) an atom of 64 at a time.
            wgmma_k16<D, 1>(acc, pa[j], sw128_desc(kt + j * 16 * 64, KT_WG * 128));
        wgmma_done<D / 8>(acc);
        __syncthreads();  // the next iteration stages into the buffer read here
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row0 + g + 8 * h;
        if (row >= m) continue;
        bf16* o = dq + ((size_t)head * m + row) * D;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * c) = pack(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
    }
#else
    __trap();
#endif
}

// A dK/dV kernel's two accumulators (a warp's 16 keys x D, mma's layout) at zero.
template <int NT>
__device__ __forceinline__ void zero_pair(float (&a)[NT][4], float (&b)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) a[n][e] = b[n][e] = 0.f;
}

// The first row tile after `t` (before `t_end`) that sees any key from `key0` on: whose context
// reaches past it, or with `all` (a block's own keys, each seen by its own row tile) the next.
__device__ __forceinline__ int next_open_tile(const uint32_t* hi, int t, int t_end, int key0, bool all) {
    for (int u = t + 1; u < t_end; u++)
        if (all || (int)hi[u] > key0) return u;
    return t_end;
}

// One head's 16 rows (q and dout staged at qs and ds, their lse and delta at ls and dl) against
// a warp's 16 keys (staged at ks and vs): dV += P^T . dO and dK += dS^T . Q (dK unscaled). Keys
// at or past `open_hi` are closed to these rows unless `second` (a block's own keys).
template <int D>
__device__ __forceinline__ void dkv_rows(float (&dka)[D / 8][4], float (&dva)[D / 8][4], const bf16* ks,
                                         const bf16* vs, const bf16* qs, const bf16* ds, const float* ls,
                                         const float* dl, int mine, int open_hi, bool second, float scale2) {
    constexpr int LD = D + PAD;
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // S^T: 16 keys x 16 rows.
    float st[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float dpt[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        uint32_t ka[4], va[4], qb[4], db[4];
        ldsm_a(ka, ks, LD, k * 16);
        ldsm_a(va, vs, LD, k * 16);
        ldsm_b_rows2(qb, qs, LD, 0, k * 16);
        ldsm_b_rows2(db, ds, LD, 0, k * 16);
        mma(st[0], ka, qb[0], qb[1]);
        mma(st[1], ka, qb[2], qb[3]);
        mma(dpt[0], va, db[0], db[1]);
        mma(dpt[1], va, db[2], db[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = mine + g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * c + (e & 1);
            bool open = second ? true : key < open_hi;
            float p = open ? exp2f(st[n][e] * scale2 - ls[col]) : 0.f;
            st[n][e] = p;
            dpt[n][e] = p * (dpt[n][e] - dl[col]);
        }
    uint32_t pa[4] = {pack(st[0][0], st[0][1]), pack(st[0][2], st[0][3]), pack(st[1][0], st[1][1]),
                      pack(st[1][2], st[1][3])};
    uint32_t sa[4] = {pack(dpt[0][0], dpt[0][1]), pack(dpt[0][2], dpt[0][3]), pack(dpt[1][0], dpt[1][1]),
                      pack(dpt[1][2], dpt[1][3])};
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
        uint32_t db[4], qb[4];
        ldsm_b_cols2(db, ds, LD, 0, n * 8);
        mma(dva[n], pa, db[0], db[1]);
        mma(dva[n + 1], pa, db[2], db[3]);
        ldsm_b_cols2(qb, qs, LD, 0, n * 8);
        mma(dka[n], sa, qb[0], qb[1]);
        mma(dka[n + 1], sa, qb[2], qb[3]);
    }
}

// A warp's 16 keys' sums out: a block's own keys (`second`) as bf16 dK and dV, context keys as
// this chunk's f32 partials (flash_dkv_sum adds the chunks).
template <int D>
__device__ __forceinline__ void dkv_store(const float (&dka)[D / 8][4], const float (&dva)[D / 8][4], int mine,
                                          int keys, bool second, int kv, int s1, float scale, float* part_k,
                                          float* part_v, bf16* dk2, bf16* dv2) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int key = mine + g + 8 * h;
        if (key >= keys) continue;
        size_t at = ((size_t)kv * keys + key) * D;
        if (second) {
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                *reinterpret_cast<uint32_t*>(dk2 + at + n * 8 + 2 * c) =
                    pack(dka[n][2 * h] * scale, dka[n][2 * h + 1] * scale);
                *reinterpret_cast<uint32_t*>(dv2 + at + n * 8 + 2 * c) = pack(dva[n][2 * h], dva[n][2 * h + 1]);
            }
        } else {
            at += (size_t)blockIdx.z * gridDim.y * s1 * D;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                *reinterpret_cast<float2*>(part_k + at + n * 8 + 2 * c) =
                    make_float2(dka[n][2 * h] * scale, dka[n][2 * h + 1] * scale);
                *reinterpret_cast<float2*>(part_v + at + n * 8 + 2 * c) = make_float2(dva[n][2 * h], dva[n][2 * h + 1]);
            }
        }
    }
}

// What one block of a dK/dV kernel owns (both kernels' grid): a tile of KT keys of k1, or of
// k2 (`second`: a block's own keys, seen by their own row tile only), staged into ks and vs;
// `keys` in that array; and the row tiles [t_first, t_end) it walks (its chunk's, or the k2
// keys' own). False for a block with nothing to do (chunks past the first own no k2 keys).
template <int D>
__device__ __forceinline__ bool dkv_block(int bx, bf16* ks, bf16* vs, const bf16* k1, const bf16* v1,
                                          const bf16* k2, const bf16* v2, int m, int s1, bool& second, int& key0,
                                          int& keys, int& t_first, int& t_end) {
    int kv = blockIdx.y;
    int tiles1 = (s1 + KT - 1) / KT;
    second = bx >= tiles1;
    if (second && blockIdx.z > 0) return false;  // uniform over the block
    key0 = (second ? bx - tiles1 : bx) * KT;
    keys = second ? m : s1;
    const bf16* kh = (second ? k2 + (size_t)kv * m * D : k1 + (size_t)kv * s1 * D);
    const bf16* vh = (second ? v2 + (size_t)kv * m * D : v1 + (size_t)kv * s1 * D);
    stage<D>(ks, kh, key0, KT, keys);
    stage<D>(vs, vh, key0, KT, keys);
    int row_tiles = m / ROWS;
    int chunk = (row_tiles + gridDim.z - 1) / gridDim.z;
    t_first = second ? key0 / ROWS : blockIdx.z * chunk;
    t_end = min(second ? key0 / ROWS + KT / ROWS : t_first + chunk, row_tiles);
    return true;
}

// dK and dV for block mode. Grid (k1 tiles of 64 + k2 tiles of 64, kv_heads, chunks); 4 warps,
// warp w owns 16 keys of the tile and walks the (row tile, head) pairs that see them, summing
// over the group's heads itself. The first context keys are seen by every block, the last by
// few: so that no block of threads walks all rows, grid.z splits the row tiles into `chunks`
// ranges, each writing its partial sums (f32) to part_k/part_v [chunks, kv_heads, S1, D], which
// flash_dkv_sum adds up. A k2 key is seen by its own row tile only: chunk 0 writes it (bf16).
template <int D>
__device__ void flash_dkv(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2,
                          const uint32_t* hi, const bf16* dout, const float* lse, const float* delta, float* part_k,
                          float* part_v, bf16* dk2, bf16* dv2, int m, int s1, int group, float scale2, float scale) {
    __shared__ __align__(16) bf16 ks[KT * (D + PAD)];
    __shared__ __align__(16) bf16 vs[KT * (D + PAD)];
    __shared__ __align__(16) bf16 qs[ROWS * (D + PAD)];
    __shared__ __align__(16) bf16 ds[ROWS * (D + PAD)];
    __shared__ float ls[ROWS], dl[ROWS];
    int warp = threadIdx.x >> 5, kv = blockIdx.y;
    bool second;
    int key0, keys, t_first, t_end;
    if (!dkv_block<D>(blockIdx.x, ks, vs, k1, v1, k2, v2, m, s1, second, key0, keys, t_first, t_end)) return;
    int mine = key0 + warp * ROWS;  // this warp's first key
    float dka[D / 8][4], dva[D / 8][4];
    zero_pair<D / 8>(dka, dva);
    for (int t = t_first; t < t_end; t++) {
        int open_hi = second ? 0 : (int)hi[t];
        if (!second && open_hi <= key0) continue;  // uniform over the block
        bool active = second ? (mine / ROWS == t) : (mine < open_hi && mine < keys);
        for (int h = 0; h < group; h++) {
            int head = kv * group + h;
            __syncthreads();
            stage<D>(qs, q + (size_t)head * m * D, t * ROWS, ROWS, m);
            stage<D>(ds, dout + (size_t)head * m * D, t * ROWS, ROWS, m);
            if (threadIdx.x < ROWS) {
                ls[threadIdx.x] = lse[(size_t)head * m + t * ROWS + threadIdx.x];
                dl[threadIdx.x] = delta[(size_t)head * m + t * ROWS + threadIdx.x];
            }
            __syncthreads();
            if (!active) continue;
            dkv_rows<D>(dka, dva, ks + warp * ROWS * (D + PAD), vs + warp * ROWS * (D + PAD), qs, ds, ls, dl, mine,
                        open_hi, second, scale2);
        }
    }
    dkv_store<D>(dka, dva, mine, keys, second, kv, s1, scale, part_k, part_v, dk2, dv2);
}

// Row tile t's lse and delta for every head of key/value head `kv`'s group into buffer `buf`
// (`rows` = group * 16 each, head by head), by plain loads.
__device__ __forceinline__ void stage_row_stats(float* lb, float* dlb, int buf, int rows, const float* lse,
                                                const float* delta, int kv, int group, int t, int m) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        size_t at = ((size_t)kv * group + i / ROWS) * m + t * ROWS + i % ROWS;
        lb[buf * rows + i] = lse[at];
        dlb[buf * rows + i] = delta[at];
    }
}

// Stage row tile t of every head of key/value head `kv`'s group into buffer `buf` of a dK/dV
// kernel's double buffers (`rows` = group * 16 rows each): q and dout by cp.async (the caller
// commits), lse and delta by plain loads (both complete for the block after the barrier that
// follows the wait).
template <int D>
__device__ __forceinline__ void stage_row_tile(bf16* qb, bf16* db, float* lb, float* dlb, int buf, int rows,
                                               const bf16* q, const bf16* dout, const float* lse,
                                               const float* delta, int kv, int group, int t, int m) {
    constexpr int LD = D + PAD;
    for (int h = 0; h < group; h++) {
        size_t head = (size_t)kv * group + h;
        stage_async<D>(qb + (buf * rows + h * ROWS) * LD, q + head * m * D, t * ROWS, ROWS, m);
        stage_async<D>(db + (buf * rows + h * ROWS) * LD, dout + head * m * D, t * ROWS, ROWS, m);
    }
    stage_row_stats(lb, dlb, buf, rows, lse, delta, kv, group, t, m);
}

// flash_dkv with the rows' loads overlapped (kept beside it until a GPU run has checked and
// timed this kernel, then one of the two goes): the same grid (dkv_block), the same outputs,
// the same products in the same order (so the same sums), but each row tile's queries, output
// gradients, lse and delta for all `group` heads are staged at once, with cp.async, into one of
// two buffers while the other buffer's row tile is multiplied: one barrier per row tile where
// flash_dkv has two per row tile and head, each after a load that nothing overlaps. Shared
// memory is dynamic (dkv_pipelined_smem bytes, past the 48 KB a static array may use): the key
// tile, then two buffers of group * 16 rows of q and dout, then two of group * 16 lse and delta.
// With OWN, the grid's x walks the k2 tiles alone (their blocks follow the k1 tiles'), for
// flash_dkv_tiled, which takes the k1 tiles.
template <int D, bool OWN>
__device__ void flash_dkv_pipelined(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2,
                                    const uint32_t* hi, const bf16* dout, const float* lse, const float* delta,
                                    float* part_k, float* part_v, bf16* dk2, bf16* dv2, int m, int s1, int group,
                                    float scale2, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = D + PAD;
    int rows = group * ROWS;  // rows of one buffer: every head of the group, one row tile
    bf16* ks = reinterpret_cast<bf16*>(smem);
    bf16* vs = ks + KT * LD;
    bf16* qb = vs + KT * LD;        // [2][rows * LD]
    bf16* db = qb + 2 * rows * LD;  // [2][rows * LD]
    float* lb = reinterpret_cast<float*>(db + 2 * rows * LD);  // [2][rows]
    float* dlb = lb + 2 * rows;                                 // [2][rows]
    int warp = threadIdx.x >> 5, kv = blockIdx.y;
    bool second;
    int key0, keys, t_first, t_end;
    int bx = OWN ? (int)blockIdx.x + (s1 + KT - 1) / KT : (int)blockIdx.x;
    if (!dkv_block<D>(bx, ks, vs, k1, v1, k2, v2, m, s1, second, key0, keys, t_first, t_end)) return;
    int mine = key0 + warp * ROWS;  // this warp's first key
    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.f;
    // The next row tile after `t` that sees any of the tile's keys (uniform over the block).
    auto next_open = [&](int t) {
        for (int u = t + 1; u < t_end; u++)
            if (second || (int)hi[u] > key0) return u;
        return t_end;
    };
    auto issue = [&](int t, int buf) {
        stage_row_tile<D>(qb, db, lb, dlb, buf, rows, q, dout, lse, delta, kv, group, t, m);
    };
    int t = next_open(t_first - 1);
    if (t < t_end) issue(t, 0);
    async_commit();
    for (int buf = 0; t < t_end; buf ^= 1) {
        int next = next_open(t);
        // The other buffer was last read before the barrier that ended the previous iteration.
        if (next < t_end) issue(next, buf ^ 1);
        async_commit();
        async_wait<1>();
        __syncthreads();
        int open_hi = second ? 0 : (int)hi[t];
        bool active = second ? (mine / ROWS == t) : (mine < open_hi && mine < keys);
        if (active) {
            for (int h = 0; h < group; h++)
                dkv_rows<D>(dka, dva, ks + warp * ROWS * LD, vs + warp * ROWS * LD, qb + (buf * rows + h * ROWS) * LD,
                            db + (buf * rows + h * ROWS) * LD, lb + buf * rows + h * ROWS,
                            dlb + buf * rows + h * ROWS, mine, open_hi, second, scale2);
        }
        __syncthreads();  // the next iteration's issue writes the buffer read here
        t = next;
    }
    dkv_store<D>(dka, dva, mine, keys, second, kv, s1, scale, part_k, part_v, dk2, dv2);
}

constexpr int KT_TILED = 128;  // keys a block in flash_dkv_tiled
constexpr int SLOTS = 4;       // heads a row tile in flash_dkv_tiled (group <= SLOTS)
constexpr int PLD = SLOTS * ROWS + PAD;  // row stride of its P^T and dS^T in shared memory

// dK and dV of the context keys (k1) in block mode, FlashAttention-2's way: a block of 8 warps
// owns 128 keys and walks the row tiles that see them (its chunk's, as flash_dkv's grid.z
// splits them), each row tile's 16 rows of every head of the group at once (64 rows at most),
// staged by cp.async into one of two buffers while the other's are multiplied. Per row tile:
//   1. S^T = K Q^T and dP^T = V dO^T (128 keys x 64 rows), warp w taking keys 32 (w / 2) .. + 32
//      and the rows of heads 2 (w % 2) and 2 (w % 2) + 1, so each fragment read from shared
//      memory feeds 4 products (flash_dkv's warp reads two fragments for 2);
//   2. P^T and dS^T = P^T (dP^T - delta), rounded to bf16, into shared memory;
//   3. dV += P^T dO and dK += dS^T Q (128 keys x D), warp w taking keys 32 (w / 2) .. + 32 and
//      columns (w % 2) D / 2 .. + D / 2: half the accumulators a thread of flash_dkv holds.
// The k2 keys (each seen by its own row tile alone) are flash_dkv_own's. Grid (k1 tiles of 128,
// kv_heads, chunks); 256 threads; group <= SLOTS; dynamic shared memory (flash.rs's
// `dkv_tiled_smem`, the layout below): the key tile's keys and values, two buffers of a row
// tile's q and dout for every head of the group, P^T and dS^T, two buffers of lse and delta.
template <int D>
__device__ void flash_dkv_tiled(const bf16* q, const bf16* k1, const bf16* v1, const uint32_t* hi, const bf16* dout,
                                const float* lse, const float* delta, float* part_k, float* part_v, int m, int s1,
                                int group, float scale2, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = D + PAD, HALF = D / 2;
    int rows = group * ROWS;
    bf16* ks = reinterpret_cast<bf16*>(smem);
    bf16* vs = ks + KT_TILED * LD;
    bf16* qb = vs + KT_TILED * LD;  // [2][rows * LD]
    bf16* db = qb + 2 * rows * LD;  // [2][rows * LD]
    bf16* pt = db + 2 * rows * LD;  // [KT_TILED][PLD]: P^T, keys by rows
    bf16* st = pt + KT_TILED * PLD;  // [KT_TILED][PLD]: dS^T
    float* lb = reinterpret_cast<float*>(st + KT_TILED * PLD);  // [2][rows]
    float* dlb = lb + 2 * rows;                                  // [2][rows]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kv = blockIdx.y, key0 = blockIdx.x * KT_TILED;
    stage<D>(ks, k1 + (size_t)kv * s1 * D, key0, KT_TILED, s1);
    stage<D>(vs, v1 + (size_t)kv * s1 * D, key0, KT_TILED, s1);
    int row_tiles = m / ROWS;
    int chunk = (row_tiles + gridDim.z - 1) / gridDim.z;
    int t_first = blockIdx.z * chunk, t_end = min(t_first + chunk, row_tiles);
    int kq = warp >> 1, half = warp & 1;  // this warp's 32 keys; its heads (1) or columns (3)
    int mine = key0 + kq * 32;            // its first key
    float dka[2][HALF / 8][4], dva[2][HALF / 8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int n = 0; n < HALF / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) dka[i][n][e] = dva[i][n][e] = 0.f;
    auto next_open = [&](int t) { return next_open_tile(hi, t, t_end, key0, false); };
    auto issue = [&](int t, int buf) {
        stage_row_tile<D>(qb, db, lb, dlb, buf, rows, q, dout, lse, delta, kv, group, t, m);
    };
    int t = next_open(t_first - 1);
    if (t < t_end) issue(t, 0);
    async_commit();
    for (int buf = 0; t < t_end; buf ^= 1) {
        int next = next_open(t);
        if (next < t_end) issue(next, buf ^ 1);
        async_commit();
        async_wait<1>();
        __syncthreads();
        int open_hi = min((int)hi[t], s1);
        const bf16* qt = qb + buf * rows * LD;
        const bf16* dt = db + buf * rows * LD;
        // 1. S^T and dP^T of this warp's 32 keys and (at most) two heads' 16 rows.
        bool keys_open = mine < open_hi;  // uniform over the warp
        float sa[2][4][4], pa[2][4][4];   // [key half][row n-tile][fragment]
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) sa[i][n][e] = pa[i][n][e] = 0.f;
        if (keys_open) {
#pragma unroll
            for (int k = 0; k < D / 16; k++) {
                uint32_t ka[2][4], va[2][4];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    ldsm_a(ka[i], ks + (kq * 32 + i * 16) * LD, LD, k * 16);
                    ldsm_a(va[i], vs + (kq * 32 + i * 16) * LD, LD, k * 16);
                }
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int slot = half * 2 + j;
                    if (slot >= group) continue;  // uniform over the warp
                    uint32_t qf[4], df[4];
                    ldsm_b_rows2(qf, qt + slot * ROWS * LD, LD, 0, k * 16);
                    ldsm_b_rows2(df, dt + slot * ROWS * LD, LD, 0, k * 16);
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        mma(sa[i][2 * j], ka[i], qf[0], qf[1]);
                        mma(sa[i][2 * j + 1], ka[i], qf[2], qf[3]);
                        mma(pa[i][2 * j], va[i], df[0], df[1]);
                        mma(pa[i][2 * j + 1], va[i], df[2], df[3]);
                    }
                }
            }
        }
        // 2. P^T and dS^T into shared memory (zeros where closed, and for the heads past the
        // group: their columns are never read).
        const float* ls = lb + buf * rows;
        const float* dl = dlb + buf * rows;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int n = 0; n < 4; n++) {
                int col = half * 32 + n * 8 + 2 * c;  // this thread's first row of the step
                bool in = col < rows;
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    int key_row = kq * 32 + i * 16 + g + 8 * hh;  // in the tile
                    bool open = in && keys_open && key0 + key_row < open_hi;
                    float p0 = 0.f, p1 = 0.f, d0 = 0.f, d1 = 0.f;
                    if (open) {
                        p0 = exp2f(sa[i][n][2 * hh] * scale2 - ls[col]);
                        p1 = exp2f(sa[i][n][2 * hh + 1] * scale2 - ls[col + 1]);
                        d0 = p0 * (pa[i][n][2 * hh] - dl[col]);
                        d1 = p1 * (pa[i][n][2 * hh + 1] - dl[col + 1]);
                    }
                    *reinterpret_cast<uint32_t*>(pt + key_row * PLD + col) = pack(p0, p1);
                    *reinterpret_cast<uint32_t*>(st + key_row * PLD + col) = pack(d0, d1);
                }
            }
        __syncthreads();
        // 3. dV += P^T dO, dK += dS^T Q: this warp's 32 keys x its half of the columns.
        if (keys_open) {
#pragma unroll
            for (int j = 0; j < SLOTS; j++) {
                if (j >= group) continue;  // uniform over the block
                uint32_t pf[2][4], sf[2][4];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    ldsm_a(pf[i], pt + (kq * 32 + i * 16) * PLD, PLD, j * ROWS);
                    ldsm_a(sf[i], st + (kq * 32 + i * 16) * PLD, PLD, j * ROWS);
                }
#pragma unroll
                for (int n = 0; n < HALF / 8; n += 2) {
                    uint32_t b[4];
                    ldsm_b_cols2(b, dt + j * ROWS * LD, LD, 0, half * HALF + n * 8);
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        mma(dva[i][n], pf[i], b[0], b[1]);
                        mma(dva[i][n + 1], pf[i], b[2], b[3]);
                    }
                    ldsm_b_cols2(b, qt + j * ROWS * LD, LD, 0, half * HALF + n * 8);
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        mma(dka[i][n], sf[i], b[0], b[1]);
                        mma(dka[i][n + 1], sf[i], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // the next row tile's issue and P^T overwrite what was read here
        t = next;
    }
    // This chunk's partial sums of the block's keys (zeros for keys no row tile of it saw).
    float* pk = part_k + ((size_t)blockIdx.z * gridDim.y + kv) * s1 * D;
    float* pv = part_v + ((size_t)blockIdx.z * gridDim.y + kv) * s1 * D;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int key = mine + i * 16 + g + 8 * hh;
            if (key >= s1) continue;
#pragma unroll
            for (int n = 0; n < HALF / 8; n++) {
                size_t at = (size_t)key * D + half * HALF + n * 8 + 2 * c;
                *reinterpret_cast<float2*>(pk + at) = make_float2(dka[i][n][2 * hh] * scale, dka[i][n][2 * hh + 1] * scale);
                *reinterpret_cast<float2*>(pv + at) = make_float2(dva[i][n][2 * hh], dva[i][n][2 * hh + 1]);
            }
        }
}

// flash_dkv_tiled on Hopper's warpgroup MMA (`flash_dkv_wg`; FlashAttention-3's backward, keys
// as M): the same grid, operands and partial sums, groups of four heads. A block's 8 warps are
// two warpgroups, each owning 64 of the block's 128 context keys (wgmma's M); a row tile's 16
// rows of the group's four heads are 64 rows, wgmma's N. Per row tile, each warpgroup:
//   1. S^T = K Q^T and dP^T = V dO^T (64 keys x 64 rows), keys, values, queries and output
//      gradients all read from tiles in the 128-byte swizzle by descriptor, K-major;
//   2. P^T and dS^T = P^T (dP^T - delta) in registers (closed keys 0), packed as A fragments;
//   3. dV += P^T dO and dK += dS^T Q (64 keys x D), the row tile's output gradients and queries
//      read N-major from the same tiles, accumulated in registers across row tiles.
// Nothing goes through shared memory but the staged tiles (flash_dkv_tiled writes P^T and dS^T
// there and reads them back). The next row tile stages by cp.async while this one multiplies.
// Dynamic shared memory (flash.rs's `Dkv`, the layout below): up to 1,023 bytes to align, the
// two warpgroups' key tiles and value tiles (64 x D each), two buffers of a row tile's queries
// and of its output gradients (64 x D each), two of its lse and delta (64 each). Where the PTX
// is not sm_90a it traps.
template <int D>
__device__ void flash_dkv_wg(unsigned char* smem, const bf16* q, const bf16* k1, const bf16* v1, const uint32_t* hi,
                             const bf16* dout, const float* lse, const float* delta, float* part_k, float* part_v,
                             int m, int s1, float scale2, float scale) {
#ifdef DFLASH_WGMMA
    constexpr int TILE = KT_WG * D, RT = 4 * ROWS;  // a swizzled tile; a row tile's rows
    static_assert(RT == KT_WG, "a row tile's 64 rows are one swizzled tile, as 64 keys are");
    unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    bf16* ks_all = reinterpret_cast<bf16*>(smem + ((1024 - (base & 1023)) & 1023));  // [2 warpgroups]
    bf16* vs_all = ks_all + 2 * TILE;                                                   // [2 warpgroups]
    bf16* qb = vs_all + 2 * TILE;                                                       // [2 buffers]
    bf16* db = qb + 2 * TILE;                                                           // [2 buffers]
    float* lb = reinterpret_cast<float*>(db + 2 * TILE);                                // [2][RT]
    float* dlb = lb + 2 * RT;                                                           // [2][RT]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int wg = warp >> 2, wwarp = warp & 3;  // this warp's warpgroup, and its place there
    int kv = blockIdx.y, key0 = blockIdx.x * 2 * KT_WG, mine = key0 + wg * KT_WG;
    const bf16* kt = ks_all + wg * TILE;
    const bf16* vt = vs_all + wg * TILE;
    for (int w = 0; w < 2; w++) {
        stage_async_sw128<D>(ks_all + w * TILE, k1 + (size_t)kv * s1 * D, key0 + w * KT_WG, KT_WG, s1);
        stage_async_sw128<D>(vs_all + w * TILE, v1 + (size_t)kv * s1 * D, key0 + w * KT_WG, KT_WG, s1);
    }
    int row_tiles = m / ROWS;
    int chunk = (row_tiles + gridDim.z - 1) / gridDim.z;
    int t_first = blockIdx.z * chunk, t_end = min(t_first + chunk, row_tiles);
    float dka[D / 8][4], dva[D / 8][4];
    zero_pair<D / 8>(dka, dva);
    auto next_open = [&](int t) { return next_open_tile(hi, t, t_end, key0, false); };
    auto issue = [&](int t, int buf) {
        for (int h = 0; h < 4; h++) {
            size_t head = (size_t)kv * 4 + h;
            stage_async_sw128_at<D>(qb + buf * TILE, RT, h * ROWS, q + head * m * D, t * ROWS, ROWS, m);
            stage_async_sw128_at<D>(db + buf * TILE, RT, h * ROWS, dout + head * m * D, t * ROWS, ROWS, m);
        }
        stage_row_stats(lb, dlb, buf, RT, lse, delta, kv, 4, t, m);
    };
    int t = next_open(t_first - 1);
    if (t < t_end) issue(t, 0);
    async_commit();  // with the key and value tiles
    for (int buf = 0; t < t_end; buf ^= 1) {
        int next = next_open(t);
        // The other buffer was last read before the barrier that ended the previous iteration.
        if (next < t_end) issue(next, buf ^ 1);
        async_commit();
        async_wait<1>();
        fence_proxy_async();  // this thread's staged tiles, visible to wgmma's reads
        __syncthreads();
        int open_hi = min((int)hi[t], s1);
        const bf16* qt = qb + buf * TILE;
        const bf16* dt = db + buf * TILE;
        if (mine < open_hi) {  // uniform over the warpgroup: any of its keys open to this row tile
            // 1. S^T and dP^T: this warp's 16 keys (rows 16 wwarp.. of the warpgroup's tile) x the
            // 64 rows (column 16h + r: head h's row r).
            float st[KT_WG / 8][4], dpt[KT_WG / 8][4];
#pragma unroll
            for (int n = 0; n < KT_WG / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[n][e] = dpt[n][e] = 0.f;
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < D / 16; k++) wgmma_ss_k16(st, sw128_kstep(kt, KT_WG, k), sw128_kstep(qt, RT, k));
#pragma unroll
            for (int k = 0; k < D / 16; k++) wgmma_ss_k16(dpt, sw128_kstep(vt, KT_WG, k), sw128_kstep(dt, RT, k));
            wgmma_done<KT_WG / 8>(st, dpt);
            // 2. P^T and dS^T (in the units of the scaled scores); keys past the row tile's
            // context closed (0).
            const float* ls = lb + buf * RT;
            const float* dl = dlb + buf * RT;
#pragma unroll
            for (int n = 0; n < KT_WG / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = mine + wwarp * ROWS + g + 8 * (e >> 1), col = n * 8 + 2 * c + (e & 1);
                    float p = key < open_hi ? exp2f(st[n][e] * scale2 - ls[col]) : 0.f;
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - dl[col]);
                }
            uint32_t pa[RT / 16][4], sa[RT / 16][4];
            to_a_fragments<KT_WG / 8>(pa, st);
            to_a_fragments<KT_WG / 8>(sa, dpt);
            // 3. dV += P^T dO, dK += dS^T Q: rows 16j.. of the row tile (K), the head's columns
            // (N) an atom of 64 at a time, as flash_forward_wgv reads its value tiles.
            wgmma_fence();  // the fragments and the accumulators, before wgmma reads them
#pragma unroll
            for (int j = 0; j < RT / 16; j++) wgmma_k16<D, 1>(dva, pa[j], sw128_desc(dt + j * 16 * 64, RT * 128));
#pragma unroll
            for (int j = 0; j < RT / 16; j++) wgmma_k16<D, 1>(dka, sa[j], sw128_desc(qt + j * 16 * 64, RT * 128));
            wgmma_done<D / 8>(dka, dva);
        }
        __syncthreads();  // the next iteration's issue writes the buffer read here
        t = next;
    }
    // This chunk's partial sums of the warpgroup's keys (zeros for keys no row tile of it saw).
    float* pk = part_k + ((size_t)blockIdx.z * gridDim.y + kv) * s1 * D;
    float* pv = part_v + ((size_t)blockIdx.z * gridDim.y + kv) * s1 * D;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int key = mine + wwarp * ROWS + g + 8 * h;
        if (key >= s1) continue;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            size_t at = (size_t)key * D + n * 8 + 2 * c;
            *reinterpret_cast<float2*>(pk + at) = make_float2(dka[n][2 * h] * scale, dka[n][2 * h + 1] * scale);
            *reinterpret_cast<float2*>(pv + at) = make_float2(dva[n][2 * h], dva[n][2 * h + 1]);
        }
    }
#else
    __trap();
#endif
}

// dk1 and dv1: the sums of flash_dkv's `chunks` partials of `n` elements each.
__device__ void dkv_sum(const float* part_k, const float* part_v, bf16* dk1, bf16* dv1, size_t n, int chunks) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float k = 0.f, v = 0.f;
        for (int z = 0; z < chunks; z++) {
            k += part_k[z * n + i];
            v += part_v[z * n + i];
        }
        dk1[i] = __float2bfloat16(k);
        dv1[i] = __float2bfloat16(v);
    }
}

}  // namespace

#define FLASH_KERNELS(D)                                                                                            \
    extern "C" __global__ void flash_forward_d##D(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,    \
                                                  const bf16* v2, const uint32_t* hi, bf16* out, float* lse, int m, \
                                                  int s1, int group, int past, float scale2) {                      \
        __shared__ __align__(16) unsigned char smem[ForwardSmem<D, KT_FWD>::bytes];                                \
        flash_forward<D, KT_FWD>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, group, past, scale2);                \
    }                                                                                                               \
    extern "C" __global__ void flash_forward_wide_d##D(const bf16* q, const bf16* k1, const bf16* v1,              \
                                                       const bf16* k2, const bf16* v2, const uint32_t* hi,          \
                                                       bf16* out, float* lse, int m, int s1, int group, int past,   \
                                                       float scale2) {                                              \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_forward<D, KT_FWD_WIDE>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, group, past, scale2);          \
    }                                                                                                               \
    extern "C" __global__ void flash_forward_tall_d##D(const bf16* q, const bf16* k1, const bf16* v1,              \
                                                       const bf16* k2, const bf16* v2, const uint32_t* hi,          \
                                                       bf16* out, float* lse, int m, int s1, int group, int past,   \
                                                       float scale2) {                                              \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_forward_tall<D, KT_FWD>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, group, past, scale2);          \
    }                                                                                                               \
    extern "C" __global__ void flash_forward_wg_d##D(const bf16* q, const bf16* k1, const bf16* v1,                \
                                                     const bf16* k2, const bf16* v2, const uint32_t* hi,            \
                                                     bf16* out, float* lse, int m, int s1, int group, int past,     \
                                                     float scale2) {                                                \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_forward_wg<D, false>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, past, scale2);                     \
    }                                                                                                               \
    extern "C" __global__ void flash_forward_wgv_d##D(const bf16* q, const bf16* k1, const bf16* v1,               \
                                                      const bf16* k2, const bf16* v2, const uint32_t* hi,           \
                                                      bf16* out, float* lse, int m, int s1, int group, int past,    \
                                                      float scale2) {                                               \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_forward_wg<D, true>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, past, scale2);                      \
    }                                                                                                               \
    extern "C" __global__ void flash_forward_wgv_block_d##D(const bf16* q, const bf16* k1, const bf16* v1,         \
                                                            const bf16* k2, const bf16* v2, const uint32_t* hi,     \
                                                            bf16* out, float* lse, int m, int s1, int group,        \
                                                            int past, float scale2) {                               \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_forward_wg<D, true, true>(smem, q, k1, v1, k2, v2, hi, out, lse, m, s1, past, scale2);                \
    }                                                                                                               \
    extern "C" __global__ void flash_dq_d##D(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,         \
                                             const bf16* v2, const uint32_t* hi, const bf16* out, const bf16* dout, \
                                             const float* lse, float* delta, bf16* dq, int m, int s1, int group,    \
                                             float scale2, float scale) {                                          \
        flash_dq<D>(q, k1, v1, k2, v2, hi, out, dout, lse, delta, dq, m, s1, group, scale2, scale);                 \
    }                                                                                                               \
    extern "C" __global__ void flash_dq_tall_d##D(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,    \
                                                  const bf16* v2, const uint32_t* hi, const bf16* out,             \
                                                  const bf16* dout, const float* lse, float* delta, bf16* dq,      \
                                                  int m, int s1, int group, float scale2, float scale) {           \
        flash_dq_tall<D>(q, k1, v1, k2, v2, hi, out, dout, lse, delta, dq, m, s1, group, scale2, scale);            \
    }                                                                                                               \
    extern "C" __global__ void flash_dq_wg_d##D(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,      \
                                                const bf16* v2, const uint32_t* hi, const bf16* out,               \
                                                const bf16* dout, const float* lse, float* delta, bf16* dq, int m, \
                                                int s1, int group, float scale2, float scale) {                    \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_dq_wg<D>(smem, q, k1, v1, k2, v2, hi, out, dout, lse, delta, dq, m, s1, scale2, scale);               \
    }                                                                                                               \
    extern "C" __global__ void flash_dkv_d##D(const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2,        \
                                              const bf16* v2, const uint32_t* hi, const bf16* dout,                \
                                              const float* lse, const float* delta, float* part_k,                 \
                                              float* part_v, bf16* dk2, bf16* dv2, int m, int s1, int group,       \
                                              float scale2, float scale) {                                         \
        flash_dkv<D>(q, k1, v1, k2, v2, hi, dout, lse, delta, part_k, part_v, dk2, dv2, m, s1, group, scale2,      \
                     scale);                                                                                        \
    }                                                                                                               \
    extern "C" __global__ void flash_dkv_pipelined_d##D(                                                            \
        const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2, const uint32_t* hi,          \
        const bf16* dout, const float* lse, const float* delta, float* part_k, float* part_v, bf16* dk2, bf16* dv2, \
        int m, int s1, int group, float scale2, float scale) {                                                      \
        flash_dkv_pipelined<D, false>(q, k1, v1, k2, v2, hi, dout, lse, delta, part_k, part_v, dk2, dv2, m, s1,    \
                                      group, scale2, scale);                                                        \
    }                                                                                                               \
    extern "C" __global__ void flash_dkv_own_d##D(                                                                  \
        const bf16* q, const bf16* k1, const bf16* v1, const bf16* k2, const bf16* v2, const uint32_t* hi,          \
        const bf16* dout, const float* lse, const float* delta, float* part_k, float* part_v, bf16* dk2, bf16* dv2, \
        int m, int s1, int group, float scale2, float scale) {                                                      \
        flash_dkv_pipelined<D, true>(q, k1, v1, k2, v2, hi, dout, lse, delta, part_k, part_v, dk2, dv2, m, s1,     \
                                     group, scale2, scale);                                                         \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1) flash_dkv_tiled_d##D(                                      \
        const bf16* q, const bf16* k1, const bf16* v1, const uint32_t* hi, const bf16* dout, const float* lse,      \
        const float* delta, float* part_k, float* part_v, int m, int s1, int group, float scale2, float scale) {    \
        flash_dkv_tiled<D>(q, k1, v1, hi, dout, lse, delta, part_k, part_v, m, s1, group, scale2, scale);          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1) flash_dkv_wg_d##D(                                         \
        const bf16* q, const bf16* k1, const bf16* v1, const uint32_t* hi, const bf16* dout, const float* lse,      \
        const float* delta, float* part_k, float* part_v, int m, int s1, int group, float scale2, float scale) {    \
        extern __shared__ __align__(16) unsigned char smem[];                                                       \
        flash_dkv_wg<D>(smem, q, k1, v1, hi, dout, lse, delta, part_k, part_v, m, s1, scale2, scale);               \
    }

FLASH_KERNELS(64)
FLASH_KERNELS(128)

extern "C" __global__ void flash_dkv_sum(const float* part_k, const float* part_v, bf16* dk1, bf16* dv1, size_t n,
                                         int chunks) {
    dkv_sum(part_k, part_v, dk1, dv1, n, chunks);
}
