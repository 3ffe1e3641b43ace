"""A hybrid target's forward, dflash against transformers, same machine, same weights, same call.

Writes a Qwen3.5 text model at a real layer shape (Qwen3.5-27B's widths: hidden 5120, MLP
17408, 24 attention heads of 256 with 4 KV heads, Gated DeltaNet with 16 key heads and 48 value
heads of 128) with LAYERS layers alternating Gated DeltaNet and attention as 27B does (three of
one, then one of the other), a small vocabulary (the layers are what is measured), random weights
(numpy); then times one forward over TOKENS tokens, every layer, no cache, in f32:
- transformers 5.24's `Qwen3_5ForCausalLM.model` (its own chunked Gated DeltaNet in PyTorch, the
  fastest it runs without the flash-linear-attention kernels, which need a GPU), under
  `torch.no_grad()`, torch's threads = this machine's cores;
- dflash's `Target::tapped` over all layers (`train_probe target`, a release build of the
  `dflash-model` example).
Each is warmed up once and timed REPEATS times; prints the medians and their ratio.

    cargo build --release -p dflash-model --features nn --example train_probe
    python3 bench/hybrid_forward.py [--layers 2] [--tokens 256] [--repeats 3]

Needs torch (`pip install --target DIR torch`, then PYTHONPATH=DIR, works on CPU)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
import qwen3_5_reference as q  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(HERE, "..", "target"))
    ap.add_argument("--probe", default=os.path.join(target_dir, "release", "examples", "train_probe"))
    a = ap.parse_args()
    import torch
    from transformers import Qwen3_5ForCausalLM

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    config = dict(q.CONFIG, vocab_size=1024, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=a.layers, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=16, linear_num_value_heads=48, layer_types=kinds,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                   "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]})
    with tempfile.TemporaryDirectory() as d:
        from safetensors.numpy import save_file

        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(q.tensors(config), os.path.join(d, "model.safetensors"))
        ids = [(i * 7919 + 13) % 1024 for i in range(a.tokens)]

        torch.set_num_threads(os.cpu_count())
        model = Qwen3_5ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        x = torch.tensor([ids])

        def once():
            t = time.perf_counter()
            with torch.no_grad():
                model.model(x)
            return time.perf_counter() - t

        once()
        theirs = statistics.median(once() for _ in range(a.repeats))
        del model
        out = subprocess.run([a.probe, "target", d, "--tokens", str(a.tokens), "--repeats",
                              str(a.repeats)], capture_output=True, text=True, check=True)
        ours = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    print(json.dumps({"layers": kinds, "tokens": a.tokens, "threads": os.cpu_count(),
                      "transformers_s": round(theirs, 3), "dflash_s": round(ours, 3),
                      "dflash_speed_vs_transformers": round(theirs / ours, 2)}))


if __name__ == "__main__":
    main()
