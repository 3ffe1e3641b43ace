#!/usr/bin/env python3
"""dflash's flash-attention kernels (stages/model/src/nn/fused/flash.cu) checked and timed
against PyTorch on the GPU machine, without the Rust build: the PTX that `nvcc` makes of
flash.cu is loaded through the CUDA driver API and launched on PyTorch's tensors.

    nvcc --ptx -O3 -arch=sm_90a stages/model/src/nn/fused/flash.cu -o flash.ptx   (CPU machine)
    python3 bench/flash_reference.py check flash.ptx
        Small and odd shapes, block mode (forward, dQ, dK, dV) and causal mode (forward),
        against autograd on float64 copies of the same bf16 inputs: the largest error of each,
        relative to the reference's largest magnitude (`wide_*`: the forward with tiles of 64
        keys, flash_forward_wide; `tall_*`: 32 query rows a warp, flash_forward_tall), and
        whether the pipelined dK/dV kernel's gradients equal the staged one's bit for bit
        (`tiled_*`: the tiled dK/dV pass's errors, `tall_dq` the tall dQ kernel's; JSON
        lines).
    python3 bench/flash_reference.py speed flash.ptx [--anchors 512] [--seq 3072]
        The Qwen3-8B attention shapes of one training step (32 heads, 8 KV heads, d 128): the
        drafter's block attention forward + backward against SDPA under the dense block mask
        (what bench/train_reference.py runs), and the target's causal forward against SDPA with
        an additive causal mask (train_reference.py) and with is_causal (PyTorch's flash
        kernel); the three forward kernels (`*_wide_ms`, `*_tall_ms`) and the three dK/dV
        passes (staged, pipelined, tiled), both dQ kernels, the backward as `train` runs it
        (`dflash_block_bwd_default_ms`: the tall dQ, the tiled dK/dV); FlexAttention under
        torch.compile with the same block mask, forward and backward. Milliseconds, TFLOP/s and
        the ratios (JSON lines).
    python3 bench/flash_reference.py wg|wgv flash.ptx
        flash_forward_wg (the causal forward's scores on wgmma) or flash_forward_wgv (the
        values' product too; `wgv` checks and times its block-mode form too) checked and timed
        alone.
    python3 bench/flash_reference.py dqwg flash.ptx
        flash_dq_wg (block mode's dQ on wgmma) checked and timed alone.
    python3 bench/flash_reference.py dkvwg flash.ptx
        flash_dkv_wg (block mode's dK/dV of the context keys on wgmma) checked and timed alone.
    python3 bench/flash_reference.py once flash.ptx
        Each kernel launched once at those shapes, for a profiler (story.sh `flash-profile`).
"""
import argparse, ctypes, json, math, time

import torch
import torch.nn.functional as F

ROWS = 16


class Kernels:
    """The PTX module, launched on PyTorch's current stream."""

    def __init__(self, ptx_path):
        torch.zeros(1, device="cuda")  # PyTorch makes the primary context current
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.mod = ctypes.c_void_p()
        with open(ptx_path, "rb") as f:
            image = f.read() + b"\0"
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(self.mod), image), "cuModuleLoadData")
        self.funcs = {}
        self.opted = {}  # the dynamic shared memory each function has opted in to

    def _ok(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def launch(self, name, grid, block, args, shared=0):
        if name not in self.funcs:
            f = ctypes.c_void_p()
            self._ok(self.cu.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.funcs[name] = f
            self.opted[name] = 48 * 1024
        if shared > self.opted[name]:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: past 48 KB a kernel must opt in
            # (a group's size changes a kernel's need).
            self._ok(self.cu.cuFuncSetAttribute(self.funcs[name], 8, shared), f"{name}: shared memory {shared}")
            self.opted[name] = shared
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_uint64(a.data_ptr()))
            elif isinstance(a, ctypes._SimpleCData):
                holders.append(a)
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            else:
                holders.append(ctypes.c_int(a))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.cu.cuLaunchKernel(self.funcs[name], *grid, *block, shared, stream, params, None), name)


def scales(d):
    scale = 1.0 / math.sqrt(d)
    return scale, scale * math.log2(math.e)


def forward_kernel(kind, group, d):
    """The forward kernel's name, query rows a block and dynamic shared memory (flash.rs's
    `Forward`): `narrow` (flash_forward), `wide` (tiles of 64 keys), `tall` (32 rows a warp)."""
    ld = d + 8
    return {
        "narrow": (f"flash_forward_d{d}", ROWS, 0),
        "wide": (f"flash_forward_wide_d{d}", ROWS, 2 * 2 * 64 * ld * 2),
        "tall": (f"flash_forward_tall_d{d}", 2 * ROWS, (2 * 2 * 32 + group * 2 * ROWS) * ld * 2),
        # causal mode, groups of four heads: wgmma for the scores (sm_90a PTX)
        "wg": (f"flash_forward_wg_d{d}", ROWS, 1024 + 2 * 64 * d * 2 + 2 * 64 * ld * 2),
        # the same with the values' product on wgmma (value tiles swizzled, unpadded)
        "wgv": (f"flash_forward_wgv_d{d}", ROWS, 1024 + 4 * 64 * d * 2),
        # the same in block mode (the context, then the block's own keys)
        "wgv_block": (f"flash_forward_wgv_block_d{d}", ROWS, 1024 + 4 * 64 * d * 2),
    }[kind]


def forward(K, q, k1, v1, k2, v2, hi, past, kind="narrow"):
    heads, m, d = q.shape
    kv, s1 = k1.shape[0], k1.shape[1]
    group = heads // kv
    out = torch.empty_like(q)
    lse = torch.empty(heads, m, device=q.device, dtype=torch.float32)
    scale, scale2 = scales(d)
    z = q  # an unused pointer in causal mode
    name, rows, shared = forward_kernel(kind, group, d)
    K.launch(name, ((m + rows - 1) // rows, kv, 1), (32 * group, 1, 1),
             [q, k1, v1, k2 if k2 is not None else z, v2 if v2 is not None else z, hi if hi is not None else z,
              out, lse, m, s1, group, past, scale2], shared)
    return out, lse


OTHER_FORWARDS = ("wide", "tall")


def other_forward_errors(K, ref_out, ref_lse, *operands, kinds=OTHER_FORWARDS):
    """The other forward kernels' errors against the reference (`wide_out`, `tall_lse`, ...),
    each left out (named in the output) where it fails to launch (a PTX built before it)."""
    errs = {}
    for kind in kinds:
        try:
            out, lse = forward(K, *operands, kind=kind)
            torch.cuda.synchronize()
            errs.update({f"{kind}_out": rel(out, ref_out), f"{kind}_lse": rel(lse * math.log(2), ref_lse)})
        except Exception as e:
            print(json.dumps({f"{kind}_forward_error": repr(e)[:300]}))
    return errs


def dkv_pipelined_smem(group, d):
    """flash_dkv_pipelined's dynamic shared memory (flash.rs's dkv_pipelined_smem)."""
    ld = d + 8
    return 2 * 64 * ld * 2 + 2 * 2 * group * ROWS * ld * 2 + 2 * 2 * group * ROWS * 4


def dkv_tiled_smem(group, d):
    """flash_dkv_tiled's dynamic shared memory (flash.rs's dkv_tiled_smem)."""
    ld, pld = d + 8, 4 * ROWS + 8
    return (2 * 128 * ld + 2 * 2 * group * ROWS * ld + 2 * 128 * pld) * 2 + 2 * 2 * group * ROWS * 4


def dkv_wg_smem(d):
    """flash_dkv_wg's dynamic shared memory (flash.rs's dkv_wg_smem): up to 1,023 bytes to
    align, eight swizzled tiles of 64 x d, two buffers of 64 lse and 64 delta."""
    return 1024 + 8 * 64 * d * 2 + 4 * 64 * 4


def backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=False, dkv="staged", dq_kind="narrow"):
    """dQ (flash_dq, or given dq_kind="tall" flash_dq_tall: 32 rows a warp, or "wg" flash_dq_wg:
    wgmma, groups of four heads), then dK and dV by
    `dkv`: the staged kernel, the pipelined one, the tiled one or (`wg`) flash_dkv_wg, each of
    the last two with flash_dkv_own for the block's own keys."""
    heads, m, d = q.shape
    kv, s1 = k1.shape[0], k1.shape[1]
    group = heads // kv
    scale, scale2 = scales(d)
    delta = torch.empty(heads, m, device=q.device, dtype=torch.float32)
    dq = torch.empty_like(q)
    dq_args = [q, k1, v1, k2, v2, hi, out, dout, lse, delta, dq, m, s1, group, scale2, scale]
    if dq_kind == "tall":
        K.launch(f"flash_dq_tall_d{d}", ((m + 2 * ROWS - 1) // (2 * ROWS), kv, 1), (32 * group, 1, 1), dq_args,
                 (2 * 2 * 32 + 2 * group * 2 * ROWS) * (d + 8) * 2)
    elif dq_kind == "wg":  # groups of four heads, sm_90a PTX
        K.launch(f"flash_dq_wg_d{d}", (m // ROWS, kv, 1), (128, 1, 1), dq_args, 1024 + 4 * 64 * d * 2)
    else:
        K.launch(f"flash_dq_d{d}", (m // ROWS, kv, 1), (32 * group, 1, 1), dq_args)
    if dq_only:
        return dq
    dk1, dv1, dk2, dv2 = (torch.empty_like(t) for t in (k1, v1, k2, v2))
    tiles = (s1 + 63) // 64 + (m + 63) // 64
    chunks = min(max((m // ROWS + 63) // 64, 1), 8)
    part_k = torch.empty(chunks, *k1.shape, device=q.device, dtype=torch.float32)
    part_v = torch.empty_like(part_k)
    common = [dout, lse, delta, part_k, part_v]
    tail = [m, s1, group, scale2, scale]
    if dkv in ("tiled", "wg"):
        # flash_dkv_tiled or flash_dkv_wg over k1's keys (tiles of 128, 8 warps), flash_dkv_own
        # over k2's.
        name, shared = ((f"flash_dkv_tiled_d{d}", dkv_tiled_smem(group, d)) if dkv == "tiled"
                        else (f"flash_dkv_wg_d{d}", dkv_wg_smem(d)))
        K.launch(name, ((s1 + 127) // 128, kv, chunks), (256, 1, 1), [q, k1, v1, hi, *common, *tail], shared)
        K.launch(f"flash_dkv_own_d{d}", ((m + 63) // 64, kv, 1), (128, 1, 1),
                 [q, k1, v1, k2, v2, hi, *common, dk2, dv2, *tail], dkv_pipelined_smem(group, d))
    else:
        name, shared = ((f"flash_dkv_d{d}", 0) if dkv == "staged"
                        else (f"flash_dkv_pipelined_d{d}", dkv_pipelined_smem(group, d)))
        K.launch(name, (tiles, kv, chunks), (128, 1, 1), [q, k1, v1, k2, v2, hi, *common, dk2, dv2, *tail], shared)
    n = k1.numel()
    K.launch("flash_dkv_sum", (min((n + 255) // 256, 1 << 16), 1, 1), (256, 1, 1),
             [part_k, part_v, dk1, dv1, ctypes.c_uint64(n), chunks])
    return dq, dk1, dv1, dk2, dv2


def dense_block_mask(anchors, s, m, dev):
    """[m, s + m] bool, True where open: block j sees context [0, a_j) and its own block."""
    rows = torch.arange(m, device=dev)
    blk = rows // ROWS
    a = anchors[blk]
    cols = torch.arange(s + m, device=dev)
    ctx = (cols[None, :] < s) & (cols[None, :] < a[:, None])
    own = (cols[None, :] >= s) & (((cols[None, :] - s) // ROWS) == blk[:, None])
    return ctx | own


def reference_block(q, k1, v1, k2, v2, anchors):
    heads, m, d = q.shape
    group = heads // k1.shape[0]
    k = torch.cat([k1, k2], 1).repeat_interleave(group, 0)
    v = torch.cat([v1, v2], 1).repeat_interleave(group, 0)
    mask = dense_block_mask(anchors, k1.shape[1], m, q.device)
    s = (q @ k.transpose(1, 2)) / math.sqrt(d)
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def reference_causal(q, k, v, past):
    heads, n, d = q.shape
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    rows = torch.arange(n, device=q.device)[:, None] + past
    open_ = torch.arange(k.shape[1], device=q.device)[None, :] <= rows
    s = (q @ k.transpose(1, 2)) / math.sqrt(d)
    s = s.masked_fill(~open_[None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def block_case(heads, kv, d, s, blocks):
    """Random block-mode operands: `blocks` blocks of ROWS rows over `s` context keys, the
    anchors sorted, the first 0 (a block that sees no context at all)."""
    m = blocks * ROWS
    q, dout = randn(heads, m, d), randn(heads, m, d)
    k1, v1, k2, v2 = randn(kv, s, d), randn(kv, s, d), randn(kv, m, d), randn(kv, m, d)
    anchors = torch.sort(torch.randint(0, s, (blocks,), device="cuda")).values
    anchors[0] = 0
    hi = anchors.to(torch.int32).contiguous()
    return m, q, dout, k1, v1, k2, v2, anchors, hi


def check(K, args):
    torch.manual_seed(0)
    worst = 0.0
    equal_all = True
    for heads, kv, d, s, blocks in [(4, 2, 64, 40, 3), (8, 2, 128, 200, 9), (32, 8, 128, 300, 12), (2, 2, 64, 64, 4),
                                     (6, 2, 128, 150, 5), (9, 3, 64, 100, 6)]:  # the last: SmolLM2's
        m, q, dout, k1, v1, k2, v2, anchors, hi = block_case(heads, kv, d, s, blocks)
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
        ref = [t.double().requires_grad_() for t in (q, k1, v1, k2, v2)]
        ro, rl = reference_block(*ref, anchors)
        ro.backward(dout.double())
        grads = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout)
        errs = {"out": rel(out, ro), "lse": rel(lse * math.log(2), rl)}
        errs.update(other_forward_errors(K, ro, rl, q, k1, v1, k2, v2, hi, -1))
        for name, g, r in zip(["dq", "dk1", "dv1", "dk2", "dv2"], grads, ref):
            errs[name] = rel(g, r.grad)
        worst = max(worst, *errs.values())
        # The pipelined dK/dV kernel sums the same products in the same order: equal bit for bit.
        try:
            piped = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv="pipelined")
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in zip(grads[1:], piped[1:]))
            worst = max(worst, *(rel(g, r.grad) for g, r in zip(piped[1:], ref[1:])))
        except Exception as e:  # say so, and go on checking the staged kernels
            print(json.dumps({"pipelined_dkv_error": repr(e)[:300]}))
            same = False
        # The tiled dK/dV kernels (FlashAttention-2's tiling: other sums, so within bounds only)
        # and the tall dQ kernel.
        try:
            tiled = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv="tiled", dq_kind="tall")
            torch.cuda.synchronize()
            errs["tall_dq"] = rel(tiled[0], ref[0].grad)
            for name, g, r in zip(["dk1", "dv1", "dk2", "dv2"], tiled[1:], ref[1:]):
                errs[f"tiled_{name}"] = rel(g, r.grad)
            worst = max(worst, *errs.values())
        except Exception as e:
            print(json.dumps({"tiled_dkv_error": repr(e)[:300]}))
        print(json.dumps({"mode": "block", "heads": heads, "kv": kv, "d": d, "s": s, "blocks": blocks, **errs,
                          "pipelined_dkv_equal": same}))
        equal_all = equal_all and same
    for heads, kv, d, n, past in [(4, 2, 64, 37, 0), (32, 8, 128, 300, 0), (8, 8, 128, 5, 20), (4, 1, 64, 1, 33),
                                  (8, 2, 128, 77, 50)]:
        q = randn(heads, n, d)
        k, v = randn(kv, past + n, d), randn(kv, past + n, d)
        out, lse = forward(K, q, k, v, None, None, None, past)
        ro, rl = reference_causal(q.double(), k.double(), v.double(), past)
        errs = {"out": rel(out, ro), "lse": rel(lse * math.log(2), rl)}
        errs.update(other_forward_errors(K, ro, rl, q, k, v, None, None, None, past))
        worst = max(worst, *errs.values())
        print(json.dumps({"mode": "causal", "heads": heads, "kv": kv, "d": d, "n": n, "past": past, **errs}))
    print(json.dumps({"worst": worst, "pipelined_dkv_equal": equal_all, "pass": worst < 2e-2 and equal_all}))


def timed(f, reps=5):
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def step_operands(args):
    """The drafter's block attention at one training step's shape (Qwen3-8B: 32 heads, 8 KV
    heads, d 128; `--anchors` blocks of 16 over `--seq` context rows), random bf16."""
    torch.manual_seed(0)
    heads, kv, d, s, anchors_n = 32, 8, 128, args.seq, args.anchors
    m = anchors_n * ROWS
    q, dout = randn(heads, m, d), randn(heads, m, d)
    k1, v1, k2, v2 = randn(kv, s, d), randn(kv, s, d), randn(kv, m, d), randn(kv, m, d)
    anchors = torch.sort(torch.randperm(s - ROWS, device="cuda")[:anchors_n]).values
    hi = anchors.to(torch.int32).contiguous()
    return heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi


def timed_into(res, key, fn, error):
    """res[key] = fn's time, True; where fn fails (a PTX built before its kernel, an older
    torch) say so as the metric `error`, False, and let the caller time the rest."""
    try:
        res[key] = timed(fn)
        return True
    except Exception as e:
        print(json.dumps({"metric": error, "value": repr(e)[:300]}))
        return False


def speed(K, args):
    heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi = step_operands(args)
    seen = anchors.double().mean().item()
    # Useful FLOPs: what each row sees (its context prefix and its own block).
    fwd_flops = 4.0 * heads * m * d * (seen + ROWS)
    res = {}
    fw = lambda: forward(K, q, k1, v1, k2, v2, hi, -1)
    res["dflash_block_fwd_ms"] = timed(fw)
    for kind in OTHER_FORWARDS:
        timed_into(res, f"dflash_block_fwd_{kind}_ms", lambda: forward(K, q, k1, v1, k2, v2, hi, -1, kind=kind),
                   f"{kind}_forward_error")
    out, lse = fw()
    res["dflash_block_bwd_ms"] = timed(lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout))
    res["dflash_block_bwd_dq_only_ms"] = timed(lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=True))
    res["dflash_dkv_staged_ms"] = res["dflash_block_bwd_ms"] - res["dflash_block_bwd_dq_only_ms"]
    timed_into(res, "dflash_dq_tall_ms",
               lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=True, dq_kind="tall"),
               "tall_dq_error")
    for dkv in ("pipelined", "tiled"):
        if timed_into(res, f"dflash_block_bwd_{dkv}_dkv_ms",
                      lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv=dkv), f"{dkv}_dkv_error"):
            res[f"dflash_dkv_{dkv}_ms"] = res[f"dflash_block_bwd_{dkv}_dkv_ms"] - res["dflash_block_bwd_dq_only_ms"]
    # The backward as `train` runs it (flash.rs): the tall dQ and the tiled dK/dV.
    timed_into(res, "dflash_block_bwd_default_ms",
               lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv="tiled", dq_kind="tall"),
               "default_backward_error")
    # FlexAttention under torch.compile with the block mask as a mask_mod: the block-sparse
    # kernel a PyTorch user trains DFlash with (the peer), forward and backward.
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            blk = qi // ROWS
            return ((ki < s) & (ki < anchors[blk])) | ((ki >= s) & ((ki - s) // ROWS == blk))

        bm = create_block_mask(mask_mod, None, None, m, s + m, device="cuda")
        flex = torch.compile(flex_attention)
        fq = q[None].clone().requires_grad_()
        fk = torch.cat([k1, k2], 1)[None].clone().requires_grad_()
        fv = torch.cat([v1, v2], 1)[None].clone().requires_grad_()

        def flex_fb():
            o = flex(fq, fk, fv, block_mask=bm, enable_gqa=True)
            o.backward(dout[None])

        res["torch_flex_block_fwd_bwd_ms"] = timed(flex_fb)
        with torch.no_grad():
            res["torch_flex_block_fwd_ms"] = timed(lambda: flex(fq, fk, fv, block_mask=bm, enable_gqa=True))
    except Exception as e:  # an older torch, or no compiler: say so, time the rest
        print(json.dumps({"metric": "torch_flex_error", "value": repr(e)[:300]}))
    # SDPA under the dense block mask, as the PyTorch reference step runs it.
    mask = dense_block_mask(anchors, s, m, q.device)
    additive = torch.zeros(m, s + m, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    group = heads // kv
    kk = torch.cat([k1, k2], 1).repeat_interleave(group, 0)
    vv = torch.cat([v1, v2], 1).repeat_interleave(group, 0)
    qg = q.clone().requires_grad_()
    kg, vg = kk.clone().requires_grad_(), vv.clone().requires_grad_()
    sd = lambda: F.scaled_dot_product_attention(qg[None], kg[None], vg[None], attn_mask=additive[None, None])
    res["torch_block_fwd_ms"] = timed(lambda: sd())

    def fb():
        o = sd()
        o.backward(dout[None])

    res["torch_block_fwd_bwd_ms"] = timed(fb)
    total = res["dflash_block_fwd_ms"] + res["dflash_block_bwd_ms"]
    res["block_ratio_torch_over_dflash"] = res["torch_block_fwd_bwd_ms"] / total
    if "torch_flex_block_fwd_bwd_ms" in res:
        res["block_ratio_flex_over_dflash"] = res["torch_flex_block_fwd_bwd_ms"] / total
        if "dflash_block_bwd_default_ms" in res:
            default = res["dflash_block_fwd_ms"] + res["dflash_block_bwd_default_ms"]
            res["block_ratio_flex_over_dflash_default"] = res["torch_flex_block_fwd_bwd_ms"] / default
        if "dflash_block_bwd_pipelined_dkv_ms" in res:
            piped = res["dflash_block_fwd_ms"] + res["dflash_block_bwd_pipelined_dkv_ms"]
            res["block_ratio_flex_over_dflash_pipelined"] = res["torch_flex_block_fwd_bwd_ms"] / piped
    res["dflash_block_fwd_tflops"] = fwd_flops / res["dflash_block_fwd_ms"] / 1e9
    res["dflash_block_bwd_tflops"] = 2.5 * fwd_flops / res["dflash_block_bwd_ms"] / 1e9
    # Agreement at this shape (bf16 SDPA against the kernels).
    with torch.no_grad():
        ro = sd()[0]
    res["block_out_rel_err_vs_sdpa"] = rel(out, ro)
    # The target's causal forward.
    n = s
    q, k, v = randn(heads, n, d), randn(kv, n, d), randn(kv, n, d)
    res["dflash_causal_fwd_ms"] = timed(lambda: forward(K, q, k, v, None, None, None, 0))
    for kind in OTHER_FORWARDS:
        timed_into(res, f"dflash_causal_fwd_{kind}_ms", lambda: forward(K, q, k, v, None, None, None, 0, kind=kind),
                   f"{kind}_forward_error")
    causal = torch.full((n, n), float("-inf"), device="cuda", dtype=torch.bfloat16).triu(1)
    kr, vr = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    with torch.no_grad():
        res["torch_causal_masked_fwd_ms"] = timed(
            lambda: F.scaled_dot_product_attention(q[None], kr[None], vr[None], attn_mask=causal[None, None]))
        res["torch_causal_flash_fwd_ms"] = timed(
            lambda: F.scaled_dot_product_attention(q[None], kr[None], vr[None], is_causal=True))
        ro = F.scaled_dot_product_attention(q[None], kr[None], vr[None], is_causal=True)[0]
    res["causal_out_rel_err_vs_sdpa"] = rel(forward(K, q, k, v, None, None, None, 0)[0], ro)
    res["dflash_causal_fwd_tflops"] = 4.0 * heads * n * n / 2 * d / res["dflash_causal_fwd_ms"] / 1e9
    for key, value in res.items():
        print(json.dumps({"metric": key, "value": value}))


def once(K, args):
    """Each kernel once at `speed`'s shapes, for a profiler (ncu --kernel-name regex:flash)."""
    heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi = step_operands(args)
    for kind in ("narrow",) + OTHER_FORWARDS:
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1, kind=kind)
    out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
    backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv="pipelined")
    backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv="tiled", dq_kind="tall")
    q, k, v = randn(heads, s, d), randn(kv, s, d), randn(kv, s, d)
    for kind in ("narrow",) + OTHER_FORWARDS:
        forward(K, q, k, v, None, None, None, 0, kind=kind)
    torch.cuda.synchronize()


def wg(K, args, kind="wg"):
    """flash_forward_wg (`wg`: the scores on wgmma; `wgv`: the values' product too; causal mode,
    groups of four heads) alone, in a process of its own so that a fault in it cannot take the
    other kernels' results along: checked as `check` checks the causal forward (`wg_out`,
    `wg_lse` beside the narrow kernel's `out`, `lse` on the same inputs), then timed at `speed`'s
    causal shape beside the wide kernel and SDPA's flash kernel."""
    torch.manual_seed(0)
    worst = 0.0
    for heads, kv, d, n, past in [(32, 8, 128, 300, 0), (4, 1, 64, 1, 33), (8, 2, 128, 77, 50), (4, 1, 64, 200, 0)]:
        q = randn(heads, n, d)
        k, v = randn(kv, past + n, d), randn(kv, past + n, d)
        ro, rl = reference_causal(q.double(), k.double(), v.double(), past)
        out, lse = forward(K, q, k, v, None, None, None, past)
        errs = {"out": rel(out, ro), "lse": rel(lse * math.log(2), rl)}
        out, lse = forward(K, q, k, v, None, None, None, past, kind=kind)
        torch.cuda.synchronize()
        errs.update({f"{kind}_out": rel(out, ro), f"{kind}_lse": rel(lse * math.log(2), rl)})
        worst = max(worst, errs[f"{kind}_out"], errs[f"{kind}_lse"])
        print(json.dumps({"mode": "causal", "heads": heads, "kv": kv, "d": d, "n": n, "past": past, **errs}))
    print(json.dumps({f"{kind}_worst": worst, "pass": worst < 2e-2}))
    heads, kv, d, n = 32, 8, 128, args.seq
    q, k, v = randn(heads, n, d), randn(kv, n, d), randn(kv, n, d)
    res = {name: timed(lambda: forward(K, q, k, v, None, None, None, 0, kind=name)) for name in ("wide", kind)}
    kr, vr = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    with torch.no_grad():
        res["sdpa_flash"] = timed(
            lambda: F.scaled_dot_product_attention(q[None], kr[None], vr[None], is_causal=True))
    for key, value in res.items():
        print(json.dumps({"metric": f"causal_fwd_{key}_ms", "value": value}))
    if kind == "wgv":
        wgv_block(K, args)


def wgv_block(K, args):
    """flash_forward_wgv_block (block mode's forward on wgmma, groups of four heads): checked
    against autograd in f64 beside the narrow kernel (`wgv_block_out`, `wgv_block_lse`), then
    timed at `speed`'s shape beside it."""
    torch.manual_seed(0)
    worst = 0.0
    for heads, kv, d, s, blocks in [(4, 1, 64, 40, 3), (8, 2, 128, 200, 9), (32, 8, 128, 300, 12), (4, 1, 128, 70, 5)]:
        m, q, dout, k1, v1, k2, v2, anchors, hi = block_case(heads, kv, d, s, blocks)
        ref = [t.double() for t in (q, k1, v1, k2, v2)]
        ro, rl = reference_block(*ref, anchors)
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
        errs = {"out": rel(out, ro), "lse": rel(lse * math.log(2), rl)}
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1, kind="wgv_block")
        torch.cuda.synchronize()
        errs.update({"wgv_block_out": rel(out, ro), "wgv_block_lse": rel(lse * math.log(2), rl)})
        worst = max(worst, errs["wgv_block_out"], errs["wgv_block_lse"])
        print(json.dumps({"mode": "block", "heads": heads, "kv": kv, "d": d, "s": s, "blocks": blocks, **errs}))
    print(json.dumps({"wgv_block_worst": worst, "pass": worst < 2e-2}))
    heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi = step_operands(args)
    for kind in ("narrow", "wgv_block"):
        ms = timed(lambda: forward(K, q, k1, v1, k2, v2, hi, -1, kind=kind))
        print(json.dumps({"metric": f"dflash_block_fwd_{kind}_ms", "value": ms}))


def dqwg(K, args):
    """flash_dq_wg (dQ on wgmma; block mode, groups of four heads) alone, in a process of its
    own (a fault in it cannot take the other kernels' results along): checked against autograd in
    f64 as `check` checks dQ (`wg_dq`, beside the tall kernel's `tall_dq`, and `wg_delta` against
    the tall kernel's delta), then timed at `speed`'s shape beside the tall kernel."""
    torch.manual_seed(0)
    worst = 0.0
    for heads, kv, d, s, blocks in [(4, 1, 64, 40, 3), (8, 2, 128, 200, 9), (32, 8, 128, 300, 12), (4, 1, 128, 70, 5)]:
        m, q, dout, k1, v1, k2, v2, anchors, hi = block_case(heads, kv, d, s, blocks)
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
        ref = [t.double().requires_grad_() for t in (q, k1, v1, k2, v2)]
        ro, _ = reference_block(*ref, anchors)
        ro.backward(dout.double())
        tall = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=True, dq_kind="tall")
        wg = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=True, dq_kind="wg")
        torch.cuda.synchronize()
        errs = {"tall_dq": rel(tall, ref[0].grad), "wg_dq": rel(wg, ref[0].grad)}
        worst = max(worst, errs["wg_dq"])
        print(json.dumps({"mode": "block", "heads": heads, "kv": kv, "d": d, "s": s, "blocks": blocks, **errs}))
    print(json.dumps({"wg_dq_worst": worst, "pass": worst < 2e-2}))
    heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi = step_operands(args)
    out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
    for kind in ("tall", "wg"):
        ms = timed(lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dq_only=True, dq_kind=kind))
        print(json.dumps({"metric": f"dflash_dq_{kind}_ms", "value": ms}))


def dkvwg(K, args):
    """flash_dkv_wg (dK and dV of the context keys on wgmma; block mode, groups of four heads)
    alone, in a process of its own: checked against autograd in f64 beside the tiled kernel
    (`wg_dk1`, `wg_dv1` beside `tiled_dk1`, `tiled_dv1`; the shapes' contexts end inside a block
    of 128 keys, and the last has several row chunks), then the backward as `train` runs it
    (the tall dQ, the tiled dK/dV) timed beside the same with the wgmma dK/dV."""
    torch.manual_seed(0)
    worst = 0.0
    for heads, kv, d, s, blocks in [(4, 1, 64, 40, 3), (8, 2, 128, 200, 9), (32, 8, 128, 300, 12), (4, 1, 128, 70, 5),
                                     (8, 2, 128, 1000, 130)]:
        m, q, dout, k1, v1, k2, v2, anchors, hi = block_case(heads, kv, d, s, blocks)
        out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
        ref = [t.double().requires_grad_() for t in (q, k1, v1, k2, v2)]
        ro, _ = reference_block(*ref, anchors)
        ro.backward(dout.double())
        errs = {}
        for kind in ("tiled", "wg"):
            grads = backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv=kind, dq_kind="tall")
            torch.cuda.synchronize()
            for name, g, r in zip(["dk1", "dv1", "dk2", "dv2"], grads[1:], ref[1:]):
                errs[f"{kind}_{name}"] = rel(g, r.grad)
        worst = max(worst, errs["wg_dk1"], errs["wg_dv1"])
        print(json.dumps({"mode": "block", "heads": heads, "kv": kv, "d": d, "s": s, "blocks": blocks, **errs}))
    print(json.dumps({"wg_dkv_worst": worst, "pass": worst < 2e-2}))
    heads, kv, d, s, m, q, dout, k1, v1, k2, v2, anchors, hi = step_operands(args)
    out, lse = forward(K, q, k1, v1, k2, v2, hi, -1)
    for kind in ("tiled", "wg"):
        ms = timed(lambda: backward(K, q, k1, v1, k2, v2, hi, out, lse, dout, dkv=kind, dq_kind="tall"))
        print(json.dumps({"metric": f"dflash_block_bwd_dkv_{kind}_ms", "value": ms}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "speed", "once", "wg", "wgv", "dqwg", "dkvwg"])
    p.add_argument("ptx")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--seq", type=int, default=3072)
    args = p.parse_args()
    K = Kernels(args.ptx)
    {"check": check, "speed": speed, "once": once, "wg": wg,
     "wgv": lambda K, args: wg(K, args, "wgv"), "dqwg": dqwg, "dkvwg": dkvwg}[args.mode](K, args)


if __name__ == "__main__":
    main()
