"""A hybrid target's batched decoding, dflash against transformers, same machine, same weights,
same call.

Writes a Qwen3.5 text model at Qwen3.5-27B's layer widths (`hybrid_forward.widths_27b`: LAYERS
layers in 27B's pattern, a small vocabulary, seeded numpy weights), then for each batch size
times greedy decoding steps after a prefill of PROMPT tokens a sequence:
- dflash: `train_probe decode FOLDER --batch B --prompt P --steps S` (generate's candle backend,
  `BatchDecoder`: the batch's projections in one matmul each, each sequence's Gated DeltaNet
  state stepped in one stack with the others'); the median step;
- transformers 5.24: `bench/decode_reference.py` (`model.generate` on the same ids, its default
  dynamic cache; a step is (a generate of S + 1 tokens less one of 1) / S).
f32 on CPU (torch's threads = this machine's cores), bf16 with `--device cuda`. Prints each
side's JSON line and one line per batch with both tokens/s and their ratio.

    cargo build --release -p dflash-model --features nn --example train_probe
    python3 bench/hybrid_decode.py [--layers 2] [--batch 1,8] [--prompt 16] [--steps 8]

Needs torch (`pip install --target DIR torch`, then PYTHONPATH=DIR, works on CPU)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
sys.path.insert(0, HERE)
import qwen3_5_reference as q  # noqa: E402
from hybrid_forward import widths_27b  # noqa: E402


def json_lines(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--probe", default=os.path.join(HERE, "..", "target", "release", "examples",
                                                    "train_probe"))
    a = ap.parse_args()
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    config = widths_27b(a.layers)
    with tempfile.TemporaryDirectory() as d:
        from safetensors.numpy import save_file

        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(q.tensors(config), os.path.join(d, "model.safetensors"))
        for batch in [int(b) for b in a.batch.split(",")]:
            shape = ["--batch", str(batch), "--prompt", str(a.prompt), "--steps", str(a.steps)]
            ours = subprocess.run([a.probe, "decode", d] + shape, capture_output=True, text=True,
                                  check=True).stdout
            theirs = subprocess.run([sys.executable, os.path.join(HERE, "decode_reference.py"), d]
                                    + shape + ["--dtypes", dtype, "--caches", "dynamic"],
                                    capture_output=True, text=True, check=True).stdout
            mine, peer = json_lines(ours)[-1], json_lines(theirs)[-1]
            print(json.dumps(mine), flush=True)
            print(json.dumps(peer), flush=True)
            print(json.dumps({"phase": "hybrid_decode", "layers": a.layers, "batch": batch,
                              "prompt": a.prompt, "steps": a.steps, "device": a.device,
                              "dflash_tokens_per_second": round(mine["tokens_per_second"], 2),
                              "transformers_tokens_per_second": peer["tokens_per_second"],
                              "dflash_speed": round(mine["tokens_per_second"]
                                                    / peer["tokens_per_second"], 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
