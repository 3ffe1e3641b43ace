"""A tiny random Qwen3.5 text model (the hybrid of Gated DeltaNet and gated full attention) and,
where torch is present, transformers' outputs for it: the reference `tests/qwen3_5.rs` compares
dflash's implementation against.

    python3 tests/support/qwen3_5_reference.py write DIR [--vocab N]  # numpy only: the folder
    python3 tests/support/qwen3_5_reference.py reference DIR OUT  # torch + transformers 5.24
    python3 tests/support/qwen3_5_reference.py moe DIR OUT        # torch + transformers 5.24
    python3 tests/support/qwen3_5_reference.py next DIR OUT       # torch + transformers 5.24
    python3 tests/support/qwen3_5_reference.py qwen3_moe DIR OUT  # torch + transformers 5.24

The committed references (stages/model/tests/fixtures/) were computed on CPU with torch 2.11.0
from PyPI (`pip install --target DIR torch==2.11.0`, then PYTHONPATH=DIR) and transformers 5.24.0.

`write` puts config.json and model.safetensors in DIR: seeded numpy draws, the same bytes on every
machine (PCG64 is stable), so the reference computed once on a machine with torch holds for the
folder written anywhere else. `reference` loads DIR with transformers' `Qwen3_5ForCausalLM` in
f32 and writes OUT (JSON): for each prompt, the logits and every layer's output (the hidden
states a drafter taps) over the whole prompt at once (the chunked Gated DeltaNet form), and the
logits of decoding it one token at a time after a prefix (the recurrent form with its state).

`moe`, `next` and `qwen3_moe` do the same for a tiny `qwen3_5_moe_text` model (the experts and
router of Qwen3.5-MoE on the same hybrid layers), a tiny `qwen3_next` one and a tiny `qwen3_moe`
one (dense attention, experts without a shared one, a dense layer among them); `write-kind KIND
DIR` writes one of them (numpy only, the published per-expert layout), and `write-gguf qwen3_moe
FILE [--f16 | --q8_0]` the tiny Qwen3-MoE as llama.cpp's `qwen3moe` GGUF (numpy and the `gguf` package)."""
import json
import os
import sys

import numpy as np

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0]},
    "hidden_act": "silu",
}

# Long enough for several 64-token chunks of the chunked form, and a short one.
PROMPTS = [[(i * 37 + 11) % 96 for i in range(150)], [5, 17, 3, 90, 42, 8, 61]]
# Decoding: the first PREFIX tokens prefilled, the rest fed one at a time.
PREFIX = 70


def tensors(c):
    """Seeded weights for config `c` in the published on-disk layout: Qwen3.5's (the default),
    with experts per layer where `num_experts` is set (one tensor per expert, a shared expert
    where `shared_expert_intermediate_size` is), Qwen3-Next's fused Gated DeltaNet projections,
    Qwen3-MoE's plain attention."""
    rng = np.random.default_rng(20261205)
    h, v = c["hidden_size"], c["vocab_size"]
    hd, nh, kvh = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk, dv = c.get("linear_key_head_dim", 0), c.get("linear_value_head_dim", 0)
    nk, nv = c.get("linear_num_key_heads", 1), c.get("linear_num_value_heads", 0)
    ffn, kernel = c.get("intermediate_size", 0), c.get("linear_conv_kernel_dim", 4)
    family = c["model_type"]
    gated = family != "qwen3_moe"
    kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]

    def w(*shape, std=0.2):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    out = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": w(h, std=0.1),
           "lm_head.weight": w(v, h)}
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = w(h, std=0.1)
        out[p + "post_attention_layernorm.weight"] = w(h, std=0.1)
        if c.get("num_experts") and i not in c.get("mlp_only_layers", []):
            e_ffn = c["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = w(c["num_experts"], h)
            for e in range(c["num_experts"]):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = w(e_ffn, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = w(e_ffn, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = w(h, e_ffn)
            s_ffn = c.get("shared_expert_intermediate_size")
            if s_ffn:
                out[p + "mlp.shared_expert.gate_proj.weight"] = w(s_ffn, h)
                out[p + "mlp.shared_expert.up_proj.weight"] = w(s_ffn, h)
                out[p + "mlp.shared_expert.down_proj.weight"] = w(h, s_ffn)
                out[p + "mlp.shared_expert_gate.weight"] = w(1, h)
        else:
            out[p + "mlp.gate_proj.weight"] = w(ffn, h)
            out[p + "mlp.up_proj.weight"] = w(ffn, h)
            out[p + "mlp.down_proj.weight"] = w(h, ffn)
        if kind == "linear_attention":
            conv = 2 * nk * dk + nv * dv
            if family == "qwen3_next":
                # Per key head: [q, k, v, z] and [b, a].
                out[p + "linear_attn.in_proj_qkvz.weight"] = w(conv + nv * dv, h)
                out[p + "linear_attn.in_proj_ba.weight"] = w(2 * nv, h)
            else:
                out[p + "linear_attn.in_proj_qkv.weight"] = w(conv, h)
                out[p + "linear_attn.in_proj_z.weight"] = w(nv * dv, h)
                out[p + "linear_attn.in_proj_b.weight"] = w(nv, h)
                out[p + "linear_attn.in_proj_a.weight"] = w(nv, h)
            out[p + "linear_attn.conv1d.weight"] = w(conv, 1, kernel, std=0.5)
            out[p + "linear_attn.dt_bias"] = w(nv, std=0.5)
            out[p + "linear_attn.A_log"] = np.log(rng.uniform(0.5, 4.0, nv)).astype(np.float32)
            out[p + "linear_attn.norm.weight"] = (1.0 + w(dv, std=0.1)).astype(np.float32)
            out[p + "linear_attn.out_proj.weight"] = w(h, nv * dv)
        else:
            out[p + "self_attn.q_proj.weight"] = w(nh * hd * (2 if gated else 1), h)
            out[p + "self_attn.k_proj.weight"] = w(kvh * hd, h)
            out[p + "self_attn.v_proj.weight"] = w(kvh * hd, h)
            out[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
            out[p + "self_attn.q_norm.weight"] = w(hd, std=0.1)
            out[p + "self_attn.k_norm.weight"] = w(hd, std=0.1)
    return out


def write(folder, vocab=None, config=None):
    from safetensors.numpy import save_file

    config = config or (dict(CONFIG, vocab_size=vocab) if vocab else CONFIG)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(tensors(config), os.path.join(folder, "model.safetensors"))


def reference(folder, out):
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM

    write(folder)
    model = Qwen3_5ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    rounded = lambda t: [[round(float(x), 6) for x in row] for row in t.tolist()]
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "prompts": []}
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            o = model(x, output_hidden_states=True)
            entry = {"ids": ids, "logits": rounded(o.logits[0]),
                     # hidden_states[0] is the embedding; [i + 1] is layer i's output (the last
                     # one after the final norm in transformers: taken from a hook instead).
                     "layers": []}
            outs = []
            hooks = [layer.register_forward_hook(lambda m, a, r: outs.append(r[0] if isinstance(r, tuple) else r))
                     for layer in model.model.layers]
            model(x)
            for h in hooks:
                h.remove()
            entry["layers"] = [rounded(t[0]) for t in outs]
            if len(ids) > PREFIX:
                o = model(torch.tensor([ids[:PREFIX]]), use_cache=True)
                cache = o.past_key_values if hasattr(o, "past_key_values") else o.cache
                steps = []
                for t in ids[PREFIX:]:
                    o = model(torch.tensor([[t]]), cache=cache, use_cache=True)
                    cache = o.past_key_values if hasattr(o, "past_key_values") else o.cache
                    steps.append(o.logits[0, -1])
                entry["decode_from"] = PREFIX
                entry["decode_logits"] = rounded(torch.stack(steps))
            result["prompts"].append(entry)
    with open(out, "w") as f:
        json.dump(result, f)


def outputs(model, prompts):
    import torch

    rounded = lambda t: [[round(float(x), 6) for x in row] for row in t.tolist()]
    entries = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            outs = []
            hooks = [layer.register_forward_hook(lambda m, a, r: outs.append(r[0] if isinstance(r, tuple) else r))
                     for layer in model.model.layers]
            logits = model(x).logits[0]
            for h in hooks:
                h.remove()
            entries.append({"ids": ids, "logits": rounded(logits), "layers": [rounded(t[0]) for t in outs]})
    return entries


def kind_config(kind):
    """The tiny config of `kind`: `moe` (Qwen3.5-MoE), `next` (Qwen3-Next: Gated DeltaNet
    projections fused per key head, one dense layer, the top-k left unnormalised) or `qwen3_moe`
    (plain attention, experts without a shared one, one dense layer)."""
    c = dict(CONFIG, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
             shared_expert_intermediate_size=20)
    if kind == "qwen3_moe":
        c = {k: v for k, v in c.items() if not k.startswith("linear_") and k not in
             ("layer_types", "shared_expert_intermediate_size", "rope_parameters")}
        c.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                 mlp_only_layers=[1], norm_topk_prob=True, rope_theta=10000.0)
    elif kind == "moe":
        c.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
        c.pop("intermediate_size")
    else:
        c.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                 mlp_only_layers=[1], norm_topk_prob=False, partial_rotary_factor=0.25,
                 rope_theta=10000.0)
        c.pop("rope_parameters")
    return c


def saved(kind, folder, out):
    """The tiny model of `kind` ([`kind_config`]) written with numpy draws, loaded by
    transformers as a user loads a checkpoint; its outputs on two prompts."""
    import torch
    import transformers

    write(folder, config=kind_config(kind))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "prompts": outputs(model, [PROMPTS[1], PROMPTS[0][:80]])}
    with open(out, "w") as f:
        json.dump(result, f)


def write_gguf(kind, path, dtype="f32", all_sparse=False):
    """The tiny model of `kind` (only `qwen3_moe`: llama.cpp's `qwen3moe` architecture) as a GGUF
    file, the same numpy draws as `write-kind` puts in safetensors, under llama.cpp's tensor
    names: each layer's experts stacked into one `[experts, rows, cols]` tensor per projection
    (`ffn_{gate,up,down}_exps`), the router as `ffn_gate_inp`, a dense layer's MLP as
    `ffn_{gate,up,down}`. `dtype` `f16` stores the matrices in f16, `q8_0` those whose rows fill
    32-value blocks in Q8_0 (the norms stay f32)."""
    import gguf

    assert kind == "qwen3_moe", kind
    c = kind_config(kind)
    if all_sparse:
        # llama.cpp's `qwen3moe` wants a router in every layer (as the published Qwen3-MoE
        # models have): other draws, no dense layer, and a vocabulary llama.cpp can read.
        c = dict(c, mlp_only_layers=[])
    hf = tensors(c)
    w = gguf.GGUFWriter(path, "qwen3moe")
    if all_sparse:
        w.add_tokenizer_model("none")
        w.add_vocab_size(c["vocab_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    def put(name, a):
        if a.ndim > 1 and dtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        elif a.ndim > 1 and dtype == "q8_0" and a.shape[-1] % 32 == 0:
            # Rows of whole 32-value blocks only (the rest stay f32, as llama.cpp's own
            # quantizer leaves a tensor whose rows do not fill its blocks).
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", hf["model.embed_tokens.weight"])
    put("output_norm.weight", hf["model.norm.weight"])
    put("output.weight", hf["lm_head.weight"])
    for i in range(c["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]:
            put(b + ours + ".weight", hf[p + theirs + ".weight"])
        if p + "mlp.gate.weight" in hf:
            put(b + "ffn_gate_inp.weight", hf[p + "mlp.gate.weight"])
            for ours, theirs in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
                put(b + f"ffn_{ours}_exps.weight", np.stack(
                    [hf[p + f"mlp.experts.{e}.{theirs}.weight"] for e in range(c["num_experts"])]))
        else:
            for ours, theirs in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
                put(b + f"ffn_{ours}.weight", hf[p + f"mlp.{theirs}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if sys.argv[1] == "write-gguf":
        # write-gguf KIND FILE [--f16 | --q8_0] [--all-sparse]
        flags = [a[2:] for a in sys.argv[4:] if a.startswith("--")]
        write_gguf(sys.argv[2], sys.argv[3], next((f for f in flags if f != "all-sparse"), "f32"),
                   "all-sparse" in flags)
    elif sys.argv[1] == "llama-cpp-logits":
        # llama-cpp-logits FILE OUT: llama.cpp's logits for PROMPTS[0][:40] (llama-cpp-python).
        from llama_cpp import Llama
        m = Llama(sys.argv[2], logits_all=True, verbose=False, n_ctx=256)
        m.eval(PROMPTS[0][:40])
        with open(sys.argv[3], "w") as f:
            json.dump({"ids": PROMPTS[0][:40], "logits": [[float(x) for x in row] for row in m.scores[:40]]}, f)
    elif sys.argv[1] == "write-kind":
        write(sys.argv[3], config=kind_config(sys.argv[2]))
    elif sys.argv[1] == "write":
        # `--vocab N`: another vocabulary size (a real tokenizer's, for pipeline tests).
        write(sys.argv[2], int(sys.argv[sys.argv.index("--vocab") + 1]) if "--vocab" in sys.argv else None)
    elif sys.argv[1] in ("moe", "next", "qwen3_moe"):
        saved(sys.argv[1], sys.argv[2], sys.argv[3])
    else:
        reference(sys.argv[2], sys.argv[3])
