"""Write a Llama-architecture GGUF model as a Hugging Face model folder: config.json, f32
safetensors (`safetensors`), and its byte-level BPE tokenizer built from the GGUF's vocabulary
and merges with the `tokenizers` package (tokenizer.json, and tokenizer_config.json with the
chat template), for the tests of targets loaded from safetensors.

    python3 gguf_to_hf.py MODEL.gguf OUT_DIR [--no-tokenizer | --tokenizer-only]

llama.cpp's converter permutes the query and key rows of Llama models for its interleaved
rotary embedding; this undoes it, so the folder is in the layout transformers uses."""
import json, os, sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
r = GGUFReader(src)


def meta(key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    return v.tobytes().decode() if v.dtype == np.uint8 else v.item()


arch = meta("general.architecture")
assert arch == "llama", f"{src}: architecture {arch}, this converts llama models"
heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
hidden = meta("llama.embedding_length")


def unpermute(w, n_head):
    # Inverse of llama.cpp's permute(): rows (head, pair, half) back to (head, half, pair).
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# `--tokenizer-only`: the tokenizer files alone (for another model that shares the vocabulary).
if "--tokenizer-only" not in sys.argv:
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    layer_names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    tensors = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        base = t.name.removesuffix(".weight")
        if base.startswith("blk."):
            _, i, part = base.split(".", 2)
            if part == "attn_q":
                w = unpermute(w, heads)
            elif part == "attn_k":
                w = unpermute(w, kv_heads)
            name = f"model.layers.{i}.{layer_names[part]}"
        else:
            name = names[base]
        tensors[f"{name}.weight"] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(out, "model.safetensors"))

    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": meta("llama.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": meta("llama.attention.key_length", hidden // heads),
        "intermediate_size": meta("llama.feed_forward_length"), "vocab_size": vocab,
        "rms_norm_eps": meta("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta("llama.context_length", 2048),
        "tie_word_embeddings": "lm_head.weight" not in tensors, "torch_dtype": "float32",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


if "--no-tokenizer" in sys.argv:
    sys.exit(0)


def strings(key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode() for i in f.data]


from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

tokens = strings("tokenizer.ggml.tokens")
kinds = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
tok.pre_tokenizer = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
)
tok.decoder = decoders.ByteLevel()
# GGUF token type 3 is "control": the special tokens.
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == 3])
tok.save(os.path.join(out, "tokenizer.json"))
special = lambda key: tokens[meta(key)]
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({
        "chat_template": meta("tokenizer.chat_template"),
        "bos_token": special("tokenizer.ggml.bos_token_id"),
        "eos_token": special("tokenizer.ggml.eos_token_id"),
        "unk_token": special("tokenizer.ggml.unknown_token_id"),
        "tokenizer_class": "GPT2Tokenizer",
    }, f, indent=2)
