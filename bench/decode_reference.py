#!/usr/bin/env python3
"""Batched greedy decoding in transformers, the shapes `train_probe decode` runs, same machine.

    python3 bench/decode_reference.py HF_FOLDER [--batch 512] [--prompt 300] [--steps 32]
        [--dtypes float32,bfloat16] [--caches dynamic,static]

The peer of generate's candle backend: `model.generate` on `--batch` prompts of `--prompt`
random ids (the ids `train_probe decode` draws), greedy, `--steps` new tokens and no stopping
early, in f32 (as dflash loads a small GGUF file) and in bf16, each with the default dynamic
cache and with `cache_implementation="static"`. A step's time is (a generate of steps + 1
tokens less one of 1 token) / steps, so the prefill is left out as `train_probe decode` leaves
it out; one JSON line per setting with the step and tokens per second. Needs torch and
transformers (the GPU machine has both); HF_FOLDER from `tests/support/gguf_to_hf.py`."""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    ap.add_argument("--caches", default="dynamic,static", help="comma-separated: dynamic, static")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in [getattr(torch, d) for d in a.dtypes.split(",")]:
        model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=dtype).to(device).eval()
        vocab = model.config.vocab_size
        ids = torch.tensor([[(i * 7919 + b * 104729 + 13) % vocab for i in range(a.prompt)]
                            for b in range(a.batch)], device=device)
        mask = torch.ones_like(ids)
        for cache in [None if c == "dynamic" else c for c in a.caches.split(",")]:
            def run(new):
                kw = {"cache_implementation": cache} if cache else {}
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0, **kw)
                if device == "cuda":
                    torch.cuda.synchronize()
                return time.perf_counter() - t
            run(2)  # warm-up
            step = (run(a.steps + 1) - run(1)) / a.steps
            print(json.dumps({"phase": "decode_reference", "device": device,
                              "dtype": str(dtype).replace("torch.", ""), "cache": cache or "dynamic",
                              "batch": a.batch, "prompt": a.prompt, "steps": a.steps,
                              "step_s": round(step, 5), "tokens_per_second": round(a.batch / step, 1)}),
                  flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
