#!/usr/bin/env python3
"""The training step's comparison from one `story.sh flash` or `checks` log (issue 22).

Reads the JSON lines `train_probe speed` and `bench/train_reference.py speed` print (and
`story.sh`'s `peak_memory` lines after each), in the order the log has them: dflash's summaries
(the last one is what `train` runs), then PyTorch's forms (eager with SDPA; FlexAttention;
compiled). Prints a table and one JSON line with each ratio PyTorch / dflash (above 1: dflash
is faster).

    python3 bench/step_ratio.py flash.txt
"""
import json
import sys


def records(lines):
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                pass


def torch_name(r):
    """PyTorch's form, from its summary (older logs have only the eager one)."""
    if r.get("compile"):
        return "PyTorch compiled, FlexAttention" if r.get("attention") == "flex" else "PyTorch compiled"
    return "PyTorch eager, FlexAttention" if r.get("attention") == "flex" else "PyTorch eager, SDPA"


def main(path):
    with open(path) as f:
        rows = list(records(f))
    # `story.sh` names each run before it (`{"phase": "label", ...}`); older logs do not. A
    # `peak_memory` line follows the run it measured. PyTorch's summaries have `peak_gib`.
    seq, ours, torch, label, current, peaks = None, [], [], None, None, {}
    for r in rows:
        phase = r.get("phase")
        if phase == "label":
            label = r["name"]
        elif phase == "init" and "seq" in r:
            seq = r["seq"]
        elif phase == "summary" and "peak_gib" in r:
            torch.append((torch_name(r), r))
            label, current = None, r
        elif phase == "summary" and "sequence_tokens_per_second" in r:
            ours.append((label or "dflash", r))
            label, current = None, r
        elif phase == "peak_memory" and current is not None:
            peaks[id(current)] = r.get("peak_mib")
    if not ours or not torch:
        sys.exit(f"{path}: no dflash and PyTorch step summaries to compare")
    mine_name, mine = ours[-1]
    print(f"the step (means of the timed steps), {seq} sequence tokens:")
    for name, r in ours + torch:
        peak = peaks.get(id(r))
        tps = f", {seq * 1000.0 / r['total_ms']:,.0f} seq tokens/s" if seq else ""
        print(f"  {name:<34} {r['total_ms']:7.1f} ms (target {r['target_ms']:.1f}, drafter "
              f"{r['drafter_ms']:.1f}, AdamW {r['optim_ms']:.1f}){tps}"
              + (f", peak {peak:,} MiB (nvidia-smi)" if peak else ""))
    ratios = {}
    for name, r in torch:
        ratios[name] = r["total_ms"] / mine["total_ms"]
        print(f"  {name} / dflash ({mine_name}): {ratios[name]:.2f}x")
    first = torch[0][1]
    print(json.dumps({"dflash_ms": mine["total_ms"], "torch_ms": first["total_ms"],
                      "ratio_torch_over_dflash": ratios[torch[0][0]], "ratios": ratios,
                      "dflash_peak_mib": peaks.get(id(mine)),
                      "torch_peak_mib": {n: peaks.get(id(r)) for n, r in torch}}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdin")
