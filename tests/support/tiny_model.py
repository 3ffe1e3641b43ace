"""Write a tiny random Llama-architecture GGUF (f32) and a token dataset as `tokenize` writes it,
for the train tests: real file formats, written by the `gguf` and `pyarrow` packages.
`--held N`: also N held-out rows of the same rule (other draws) as `eval-00000.arrow` beside the
training file, as `tokenize` writes mix's `eval` split."""
import os
import sys

import gguf
import numpy as np
import pyarrow as pa

out_model, out_tokens, rows, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# `--vocab N`: another vocabulary size (a target some drafter does not fit).
V = int(sys.argv[sys.argv.index("--vocab") + 1]) if "--vocab" in sys.argv else 64
rng = np.random.default_rng(0)
H, L, HEADS, KV, FFN = 32, 4, 4, 2, 48
w = gguf.GGUFWriter(out_model, "llama")
w.add_block_count(L)
w.add_embedding_length(H)
w.add_feed_forward_length(FFN)
w.add_head_count(HEADS)
w.add_head_count_kv(KV)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(10000.0)
w.add_context_length(512)
t = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)
ones = lambda n: np.ones(n, dtype=np.float32)
w.add_tensor("token_embd.weight", t(V, H))
w.add_tensor("output_norm.weight", ones(H))
hd = H // HEADS
for i in range(L):
    w.add_tensor(f"blk.{i}.attn_norm.weight", ones(H))
    w.add_tensor(f"blk.{i}.attn_q.weight", t(H, H))
    w.add_tensor(f"blk.{i}.attn_k.weight", t(KV * hd, H))
    w.add_tensor(f"blk.{i}.attn_v.weight", t(KV * hd, H))
    w.add_tensor(f"blk.{i}.attn_output.weight", t(H, H))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(H))
    w.add_tensor(f"blk.{i}.ffn_gate.weight", t(FFN, H))
    w.add_tensor(f"blk.{i}.ffn_up.weight", t(FFN, H))
    w.add_tensor(f"blk.{i}.ffn_down.weight", t(H, FFN))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()



def write_rows(path, rows, prefix):
    """Sequences with a learnable pattern (each token determines the next), trained after a
    prompt."""
    ids, masks = [], []
    for r in range(rows):
        start = int(rng.integers(0, V - 1))
        seq = [(start + 3 * k) % (V - 1) for k in range(length)]
        ids.append(seq)
        masks.append([0] * 8 + [1] * (length - 8))
    table = pa.table({
        "id": [f"{prefix}{r}" for r in range(rows)],
        "source": ["tiny"] * rows,
        "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
        "length": pa.array([length] * rows, type=pa.int32()),
    })
    with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, table.schema) as s:
        s.write_table(table)


write_rows(out_tokens, rows, "r")
if "--held" in sys.argv:
    held = int(sys.argv[sys.argv.index("--held") + 1])
    write_rows(os.path.join(os.path.dirname(out_tokens), "eval-00000.arrow"), held, "h")
