"""The exported drafter in z-lab's reference implementation (PyPI `dflash==0.1.0`): load the
`drafter/` folder that `train` wrote, unchanged, with `DFlashDraftModel.from_pretrained` (or
`DFlash2DraftModel`'s, for a `head: dflash2` drafter, as the reference's harness picks), decode
the prompts `dflash bench` decoded with its `dflash_generate` against the same target as a
transformers model, and compare the acceptance lengths (and, greedy, the output tokens) with
what `dflash bench` recorded for them in `sets/<set>.jsonl`.

Runs where torch, transformers and the reference package are (the GPU machine):

    python3 bench/reference_check.py TARGET_HF_DIR DRAFTER_DIR BENCH_DIR --method drafter \
        [--stop 2] [--max-new-tokens 256] [--limit N] [--device cuda]

TARGET_HF_DIR is the target as a Hugging Face folder (tests/support/gguf_to_hf.py converts the
GGUF file bench ran); BENCH_DIR holds the bench artifact's `sets/*.jsonl` (`dflash export`).
Prints per set: prompts, tau by dflash bench, tau by the reference, their ratio, outputs equal.
With --speed, each prompt is also decoded by the reference's autoregressive form (its own
harness's baseline: `dflash_generate` with `block_size=1`), after one untimed warm-up, and the
set's line adds both sides' tokens/s (prefill and decode, as `dflash bench` times a prompt) and
each side's speedup over its own autoregressive decoding (ours from the bench's
`autoregressive` rows of the same prompts): the peer as its users run it, same GPU, same call."""
import argparse
import glob
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate


def patch_short_blocks():
    """dflash==0.1.0's DFlash 2 convolution fails on a block shorter than its kernel (the last
    round before `max_new_tokens`: `F.pad(blocks[:, :-offset])` is then longer than the block).
    Offsets at or past the block's length reach only the zero padding before it, so they are
    skipped here; every other offset is the reference's own arithmetic."""
    import dflash.model as m

    original = m._grouped_dynamic_convolve

    def convolve(hidden, dynamic, base, group_size):
        length = hidden.shape[1]
        if base.shape[0] <= length:
            return original(hidden, dynamic, base, group_size)
        return original(hidden, dynamic[:, :, :length], base[:length], group_size)

    m._grouped_dynamic_convolve = convolve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("bench")
    ap.add_argument("--method", default="drafter")
    ap.add_argument("--stop", type=int, action="append", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="lines per set")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--speed", action="store_true", help="time both sides (see above)")
    a = ap.parse_args()
    patch_short_blocks()
    if not a.device.startswith("cuda"):
        # The reference times its rounds with torch.cuda.synchronize(); on CPU, the wall clock.
        import time

        import dflash.model

        dflash.model._cuda_time = time.perf_counter
    dtype = getattr(torch, a.dtype)
    target = AutoModelForCausalLM.from_pretrained(a.target, torch_dtype=dtype).to(a.device).eval()
    # The class the reference's own harness picks: DFlash 2 by its architecture name.
    arch = json.load(open(os.path.join(a.drafter, "config.json"))).get("architectures") or []
    cls = DFlash2DraftModel if "DFlash2DraftModel" in arch else DFlashDraftModel
    draft = cls.from_pretrained(a.drafter, torch_dtype=dtype).to(a.device).eval()
    stop = a.stop or [2]
    summary = {}
    for path in sorted(glob.glob(os.path.join(a.bench, "sets", "*.jsonl"))):
        name = os.path.basename(path)[: -len(".jsonl")]
        ours_tau, ref_tau, same, n = [], [], 0, 0
        ours_rounds = ours_committed = ref_rounds = ref_committed = 0
        # Seconds and tokens for the speeds: ours (the method, autoregressive), the reference's.
        rows = [json.loads(line) for line in open(path)]
        ours_ar = {(r["id"], r["turn"]): r for r in rows if r["method"] == "autoregressive"}
        secs = {"ours": 0.0, "ours_ar": 0.0, "ref": 0.0, "ref_ar": 0.0}
        toks = {"ours": 0, "ours_ar": 0, "ref": 0, "ref_ar": 0}
        warmed = False
        for row in rows:
            if row["method"] != a.method:
                continue
            if a.limit is not None and n >= a.limit:
                break
            n += 1
            ids = torch.tensor([row["prompt"]], device=a.device)
            def decode(block_size=None):
                with torch.no_grad():
                    return dflash_generate(
                        draft, target, ids, a.max_new_tokens, stop, temperature=0.0,
                        block_size=block_size, return_stats=True,
                    )

            if a.speed and not warmed:
                decode()
                decode(1)
                warmed = True
            out = decode()
            if a.speed:
                ar = decode(1)
                for key, o in (("ref", out), ("ref_ar", ar)):
                    secs[key] += o.time_to_first_token + o.time_per_output_token * o.num_output_tokens
                    toks[key] += o.num_output_tokens
                twin = ours_ar.get((row["id"], row["turn"]))
                if twin is not None:
                    for key, r in (("ours", row), ("ours_ar", twin)):
                        secs[key] += r["seconds"]
                        toks[key] += r["output_tokens"]
            gen = out.output_ids[0, out.num_input_tokens :].tolist()
            # The reference keeps the stop token in its output; dflash bench does not return it.
            if gen and gen[-1] in stop:
                gen = gen[:-1]
            same += int(gen == row["tokens"])
            # The first token comes from the prefill in both: rounds are the verifications.
            ref_rounds += len(out.acceptance_lengths)
            ref_committed += sum(out.acceptance_lengths)
            ours_rounds += row["rounds"]
            ours_committed += row["committed"]
        if n == 0:
            continue
        ours = ours_committed / max(ours_rounds, 1)
        ref = ref_committed / max(ref_rounds, 1)
        summary[name] = {"prompts": n, "tau_dflash": ours, "tau_reference": ref,
                         "ratio": ref / ours if ours else None, "identical_outputs": same}
        line = (f"{name:<12} {n:>4} prompts  tau dflash {ours:.3f}  reference {ref:.3f}  "
                f"ratio {ref / ours:.3f}  identical outputs {same}/{n}")
        if a.speed and all(secs.values()):
            rate = {k: toks[k] / secs[k] for k in secs}
            summary[name].update({"tokens_per_second": rate,
                                  "speedup_dflash": rate["ours"] / rate["ours_ar"],
                                  "speedup_reference": rate["ref"] / rate["ref_ar"],
                                  "dflash_over_reference": rate["ours"] / rate["ref"]})
            line += (f"  tokens/s dflash {rate['ours']:.1f} ({rate['ours'] / rate['ours_ar']:.2f}x its AR)"
                     f"  reference {rate['ref']:.1f} ({rate['ref'] / rate['ref_ar']:.2f}x its AR)"
                     f"  dflash/reference {rate['ours'] / rate['ref']:.2f}x")
        print(line, flush=True)
    json.dump(summary, sys.stdout if not os.environ.get("OUT") else
              open(os.path.join(os.environ["OUT"], "reference_check.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
