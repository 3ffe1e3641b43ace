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
Prints per set: prompts, tau by dflash bench, tau by the reference, their ratio, outputs equal."""
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
        for line in open(path):
            row = json.loads(line)
            if row["method"] != a.method:
                continue
            if a.limit is not None and n >= a.limit:
                break
            n += 1
            ids = torch.tensor([row["prompt"]], device=a.device)
            with torch.no_grad():
                out = dflash_generate(
                    draft, target, ids, a.max_new_tokens, stop, temperature=0.0, return_stats=True
                )
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
        print(f"{name:<12} {n:>4} prompts  tau dflash {ours:.3f}  reference {ref:.3f}  "
              f"ratio {ref / ours:.3f}  identical outputs {same}/{n}", flush=True)
    json.dump(summary, sys.stdout if not os.environ.get("OUT") else
              open(os.path.join(os.environ["OUT"], "reference_check.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
