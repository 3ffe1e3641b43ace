#!/usr/bin/env python3
"""The DFlash online training step in plain PyTorch, written from ../shared/DFLASH.md — the
reference `train` is held to, for correctness and for speed (issue 7). Runs on the GPU machine.

    python3 bench/train_reference.py parity parity.safetensors
        Reads what `train_probe parity` wrote (a small target's and drafter's weights, one
        sequence's blocks, candle's taps, loss and gradients), recomputes them in f32 and prints
        the relative error of each (JSON).

    python3 bench/train_reference.py speed [--seq 3072] [--anchors 512] [--block 16] [--layers 5]
        The same step as `train_probe speed` at the Qwen3-8B shape with random bf16 weights:
        target forward under no_grad (SDPA's causal flash kernel), drafter forward + backward
        (SDPA with the dense block mask), fused AdamW; prints per-phase milliseconds and the
        peak memory (JSON). PyTorch's faster forms, as its users run them: `--attention flex`
        (FlexAttention's block-sparse kernel under torch.compile, the mask a BlockMask) and
        `--compile` (the target's forward and the drafter's loss under torch.compile; give
        `--warmup 2` so compilation stays out of the mean). `--profile-step K` records step K
        alone for `ncu --profile-from-start off` (bench/kernel_profile.py).

The maths, as `stages/model/src/nn` does it: RMSNorm; rotate-half RoPE at absolute positions;
Qwen3 per-head q/k norms; grouped-query attention; SwiGLU. The drafter fuses the tapped layers
with `fc` + `hidden_norm` into a context every layer projects with its own k/v; queries come
from the block tokens `[anchor, MASK x (B-1)]`; block j sees the context before its anchor and
its own block; the loss is the cross-entropy at block positions 1..B-1 weighted by
exp(-(k-1)/gamma) (the weights arrive with the batch), summed and divided by the weights' sum.
"""
import argparse, json, math, sys, time

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(pos, hd, theta, dtype, dev):
    inv = 1.0 / theta ** (torch.arange(0, hd // 2, device=dev, dtype=torch.float64) * 2 / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float().to(dtype), ang.sin().float().to(dtype)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def rope(x, cos, sin):  # x [heads, n, hd]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def attention(q, k, v, mask):  # q [H, n, d], k/v [KV, s, d], mask additive [n, s] or a BlockMask
    if not torch.is_tensor(mask):  # FlexAttention's block-sparse kernel (`--attention flex`)
        return FLEX[0](q[None], k[None], v[None], block_mask=mask, enable_gqa=True)[0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask.to(q.dtype)[None, None],
                                          enable_gqa=True)[0]


# flex_attention as its documentation has users run it: under torch.compile (eager, it
# materialises the scores); set by speed(`--attention flex`).
FLEX = [None]


class Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def target_taps(W, cfg, ids, taps):
    x = W["model.embed_tokens.weight"][ids]
    n = ids.shape[0]
    cos, sin = rope_tables(torch.arange(n, device=ids.device), cfg.hd, cfg.theta, x.dtype, ids.device)
    out = {}
    for i in range(max(taps) + 1):
        p = lambda s: W[f"model.layers.{i}.{s}.weight"]
        h = rms(x, p("input_layernorm"), cfg.eps)
        q = (h @ p("self_attn.q_proj").T).view(n, cfg.heads, cfg.hd).transpose(0, 1)
        k = (h @ p("self_attn.k_proj").T).view(n, cfg.kv, cfg.hd).transpose(0, 1)
        v = (h @ p("self_attn.v_proj").T).view(n, cfg.kv, cfg.hd).transpose(0, 1)
        q, k = rms(q, p("self_attn.q_norm"), cfg.eps), rms(k, p("self_attn.k_norm"), cfg.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # PyTorch's flash kernel through SDPA's causal flag (plain usage; no mask tensor).
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                           enable_gqa=True)[0].transpose(0, 1).reshape(n, -1)
        x = x + a @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"), cfg.eps)
        x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        out[i] = x
    return torch.cat([out[t] for t in taps], -1)


def block_mask(anchors, bs, s, dev):
    """Additive [m, s + m]: row q (block j = q // bs) sees context before anchor j and its own block."""
    anchors = torch.as_tensor(anchors, device=dev)
    m = anchors.shape[0] * bs
    j = torch.arange(m, device=dev)[:, None] // bs
    c = torch.arange(s + m, device=dev)[None, :]
    seen = (c < anchors[j]) | ((c >= s) & ((c - s) // bs == j))
    return torch.zeros(seen.shape, device=dev).masked_fill_(~seen, float("-inf"))


def flex_block_mask(anchors, bs, s, dev):
    """The same mask as FlexAttention's BlockMask (its kernel skips the tiles no row sees)."""
    from torch.nn.attention.flex_attention import create_block_mask
    anchors = torch.as_tensor(anchors, device=dev)
    m = anchors.shape[0] * bs

    def seen(b, h, q, kv):
        j = q // bs
        return (kv < anchors[j]) | ((kv >= s) & ((kv - s) // bs == j))
    return create_block_mask(seen, None, None, m, s + m, device=dev)


def drafter_hidden(D, cfg, context, block, block_pos, mask):
    s, m = context.shape[0], block.shape[0]
    dev, dt = block.device, block.dtype
    ctx = rms(context @ D["fc.weight"].T, D["hidden_norm.weight"], cfg.eps)
    qc, qs = rope_tables(block_pos, cfg.hd, cfg.theta, dt, dev)
    kc, ks = rope_tables(torch.cat([torch.arange(s, device=dev), block_pos]), cfg.hd, cfg.theta, dt, dev)
    x = block
    for i in range(cfg.draft_layers):
        p = lambda n: D[f"layers.{i}.{n}.weight"]
        h = rms(x, p("input_layernorm"), cfg.eps)
        q = rms((h @ p("self_attn.q_proj").T).view(m, cfg.heads, cfg.hd), p("self_attn.q_norm"), cfg.eps).transpose(0, 1)
        both = torch.cat([ctx, h])
        k = rms((both @ p("self_attn.k_proj").T).view(s + m, cfg.kv, cfg.hd), p("self_attn.k_norm"), cfg.eps).transpose(0, 1)
        v = (both @ p("self_attn.v_proj").T).view(s + m, cfg.kv, cfg.hd).transpose(0, 1)
        q, k = rope(q, qc, qs), rope(k, kc, ks)
        a = attention(q, k, v, mask).transpose(0, 1).reshape(m, -1)
        x = x + a @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"), cfg.eps)
        x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return rms(x, D["norm.weight"], cfg.eps)


def block_loss(D, W, cfg, context, block_ids, block_pos, anchors, labels, weights, bs, mask=None):
    dev = context.device
    block = W["model.embed_tokens.weight"][block_ids].to(context.dtype)
    if mask is None:
        mask = block_mask(anchors, bs, context.shape[0], dev)
    hidden = drafter_hidden(D, cfg, context, block, block_pos, mask)
    # Rows 1..bs-1 of every block (row 0, the anchor, predicts nothing).
    hidden = hidden.view(-1, bs, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    logits = (hidden @ W["lm_head.weight"].to(hidden.dtype).T).float()
    picked = logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    return -(picked * weights).sum() / weights.sum()


def parity(path):
    from safetensors.torch import load_file
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = {k: v.to(dev) for k, v in load_file(path).items()}
    W = {k[len("target."):]: v for k, v in t.items() if k.startswith("target.")}
    D = {k[len("drafter."):]: v.clone().requires_grad_(True) for k, v in t.items() if k.startswith("drafter.")}
    hd = W["model.layers.0.self_attn.q_norm.weight"].shape[0]
    H = W["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[1]) for k in D if k.startswith("layers."))
    cfg = Cfg(hd=hd, heads=W["model.layers.0.self_attn.q_proj.weight"].shape[0] // hd,
              kv=W["model.layers.0.self_attn.k_proj.weight"].shape[0] // hd, eps=1e-6, theta=1e6,
              draft_layers=layers)
    taps = [1, 3]
    bs = int(t["batch.block_ids"].shape[0] // t["batch.anchors"].shape[0])
    context = target_taps(W, cfg, t["batch.ids"], taps)
    loss = block_loss(D, W, cfg, context, t["batch.block_ids"], t["batch.block_pos"],
                      t["batch.anchors"].tolist(), t["batch.labels"], t["batch.weights"], bs)
    loss.backward()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    grads = {k: rel(t[f"grad.{k}"], v.grad) for k, v in D.items() if f"grad.{k}" in t}
    worst = max(grads, key=grads.get)
    print(json.dumps({"phase": "parity", "device": dev, "hidden": H, "loss_torch": loss.item(),
                      "loss_candle": t["out.loss"].item(),
                      "loss_rel_err": abs(loss.item() - t["out.loss"].item()) / abs(loss.item()),
                      "taps_rel_err": rel(t["out.context"], context), "grads": len(grads),
                      "grad_rel_err_max": grads[worst], "grad_rel_err_worst": worst,
                      "grad_rel_err_median": sorted(grads.values())[len(grads) // 2]}))


def speed(a):
    dev, dt = "cuda", torch.bfloat16
    H, L, heads, kv, hd, ffn, V = 4096, 36, 32, 8, 128, 12288, 151936
    cfg = Cfg(hd=hd, heads=heads, kv=kv, eps=1e-6, theta=1e6, draft_layers=a.layers)
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)
    taps = [1, 9, 17, 25, 33]
    last = max(taps)
    W = {"model.embed_tokens.weight": r(V, H), "lm_head.weight": r(V, H)}
    ones = lambda n: torch.ones(n, device=dev, dtype=dt)

    def layer(p):  # one Qwen3 decoder layer's weights under prefix `p`
        return {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
                p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                p + "self_attn.q_proj.weight": r(heads * hd, H), p + "self_attn.k_proj.weight": r(kv * hd, H),
                p + "self_attn.v_proj.weight": r(kv * hd, H), p + "self_attn.o_proj.weight": r(H, heads * hd),
                p + "mlp.gate_proj.weight": r(ffn, H), p + "mlp.up_proj.weight": r(ffn, H),
                p + "mlp.down_proj.weight": r(H, ffn)}

    for i in range(last + 1):
        W.update(layer(f"model.layers.{i}."))
    D = {"fc.weight": r(H, len(taps) * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    for i in range(a.layers):
        D.update(layer(f"layers.{i}."))
    for v in D.values():
        v.requires_grad_(True)
    opt = torch.optim.AdamW(list(D.values()), lr=6e-4, fused=True)
    n, bs = a.seq, a.block
    flex = a.attention == "flex"
    if flex:
        from torch.nn.attention.flex_attention import flex_attention
        FLEX[0] = torch.compile(flex_attention)
    taps_fn, loss_fn = target_taps, block_loss
    if a.compile:  # the whole target forward and drafter loss, as one compiled graph each
        taps_fn, loss_fn = torch.compile(target_taps), torch.compile(block_loss)
    steps = []
    for step in range(a.steps):
        if step == a.profile_step:  # what `ncu --profile-from-start off` records
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, V, (n,), generator=gen).to(dev)
        anchors = sorted(torch.randperm(n - bs - 64, generator=gen)[:a.anchors].add(64).tolist())
        block_ids = torch.full((len(anchors), bs), V - 1, dtype=torch.long)
        block_ids[:, 0] = ids.cpu()[anchors]
        block_pos = (torch.tensor(anchors)[:, None] + torch.arange(bs)[None]).reshape(-1).to(dev)
        labels = ids[block_pos.clamp_max(n - 1)].view(len(anchors), bs)[:, 1:].reshape(-1)
        gamma = 7.0
        weights = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / gamma).repeat(len(anchors)).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            context = taps_fn(W, cfg, ids, taps)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        mask = flex_block_mask(anchors, bs, n, dev) if flex else block_mask(anchors, bs, n, dev)
        loss = loss_fn(D, W, cfg, context, block_ids.reshape(-1).to(dev), block_pos, anchors, labels, weights, bs,
                       mask)
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(list(D.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if step == a.profile_step:
            torch.cuda.profiler.stop()
        row = {"phase": "step", "step": step, "target_ms": (t1 - t0) * 1e3, "drafter_ms": (t2 - t1) * 1e3,
               "optim_ms": (t3 - t2) * 1e3, "total_ms": (t3 - t0) * 1e3, "loss": loss.item()}
        steps.append(row)
        print(json.dumps(row), flush=True)
    warm = steps[a.warmup:] or steps
    mean = lambda k: sum(s[k] for s in warm) / len(warm)
    print(json.dumps({"phase": "summary", "attention": a.attention, "compile": a.compile,
                      **{k: mean(k) for k in ["target_ms", "drafter_ms", "optim_ms", "total_ms"]},
                      "sequence_tokens_per_second": n / (mean("total_ms") / 1e3),
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "steps_timed": len(warm)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["parity", "speed"])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the summary (compilation)")
    ap.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                    help="the drafter's block attention: SDPA with a dense mask, or FlexAttention's block mask")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target forward and the drafter loss")
    ap.add_argument("--profile-step", type=int, default=-1, help="record only this step for ncu")
    a = ap.parse_args()
    parity(a.path) if a.mode == "parity" else speed(a)
