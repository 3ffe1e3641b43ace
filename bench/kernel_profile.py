#!/usr/bin/env python3
"""Where a training step's GPU time goes, kernel by kernel (issue 22). Runs on the GPU machine.

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum -o /tmp/step PROGRAM ... --profile-step 2
    python3 bench/kernel_profile.py /tmp/step.ncu-rep [--label NAME] [--step-ms MS] [--top 25]

`train_probe speed` and `bench/train_reference.py speed` both take `--profile-step K` and
record that step alone (cuProfilerStart/Stop), so the report holds one step's kernels. This
prints each kernel family's count and summed time (names cut at their template arguments),
the sum by kind (matrix products, attention, elementwise, ...), and, given the step's
unprofiled time (`--step-ms`), how much of it no kernel was running: launch gaps and host
work, which ncu's one-kernel-at-a-time replay cannot show otherwise. The last line is JSON.
"""
import argparse, csv, io, json, re, subprocess, sys
from collections import defaultdict

# ncu's unit row, in its long and short spellings.
UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
         "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}

# Kind of a kernel by its (cut) name; the first pattern that matches wins.
KINDS = [
    ("attention", r"flash|fmha|attention|flex|sdpa|dot_do_o|convert_dq"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|sm90_|sm80_|ampere_|cublas|splitK"),
    ("fused (dflash)", r"^(cross_entropy|rms_norm|rope|masked_softmax|swiglu|sum_squares|moment|adam|"
                       r"adamw_fused|add_rms_norm|top_k|gather_rows|scatter_add|head_|ce_)"),
    ("triton (torch.compile)", r"^triton_"),
    ("reduction", r"reduce|sum_|softmax|norm"),
    ("copy / cast", r"copy|cast|ucopy|to_dtype|cat|index|gather|scatter|fill|where"),
    ("elementwise", r"elementwise|affine|bmul|badd|bsub|bdiv|umul|uadd|unary|binary|exp|silu|neg|sqrt|powf"),
]


def short(name):
    name = re.sub(r"^void ", "", name)
    name = name.split("(")[0]
    depth, out = 0, []
    for ch in name:  # drop template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip().split("::")[-1] or name


def kind(name):
    for k, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return k
    return "other"


def rows(report):
    text = subprocess.run(["ncu", "-i", report, "--csv", "--page", "raw"], check=True,
                          capture_output=True, text=True).stdout
    table = list(csv.reader(io.StringIO(text)))
    head = table[0]
    name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    unit = table[1][time_col]
    if unit not in UNITS:
        sys.exit(f"kernel_profile: unknown time unit {unit!r} in {report}")
    scale = UNITS[unit]
    for r in table[2:]:
        if len(r) > time_col and r[time_col]:
            yield r[name_col], float(r[time_col].replace(",", "")) * scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--label", default="")
    ap.add_argument("--step-ms", type=float, default=None, help="the step's time unprofiled")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    families, kinds = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for name, ms in rows(a.report):
        s = short(name)
        for table, key in ((families, s), (kinds, kind(s))):
            table[key][0] += 1
            table[key][1] += ms
    total = sum(ms for _, ms in families.values())
    count = sum(n for n, _ in families.values())
    print(f"== {a.label or a.report}: {count} kernels, {total:.1f} ms of kernel time")
    for k, (n, ms) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"   {k:<24} {n:>6} launches {ms:>9.2f} ms  {100 * ms / max(total, 1e-9):5.1f}%")
    print(f"   top {a.top} kernels:")
    for f, (n, ms) in sorted(families.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"   {ms:>9.2f} ms {n:>6} x  {f[:90]}")
    idle = None if a.step_ms is None else a.step_ms - total
    if idle is not None:
        print(f"   the step unprofiled: {a.step_ms:.1f} ms, so {idle:.1f} ms with no kernel running")
    print(json.dumps({"phase": "kernel_profile", "label": a.label, "kernels": count, "kernel_ms": total,
                      "step_ms": a.step_ms, "idle_ms": idle,
                      "kinds": {k: {"launches": n, "ms": ms} for k, (n, ms) in kinds.items()}}))


if __name__ == "__main__":
    sys.exit(main())
