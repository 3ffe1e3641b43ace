#!/usr/bin/env python3
"""Runtime benchmarks: dflash against DVC in the same run, reporting ratios.

    python3 bench/runtime.py [--dvc-stages 1000] [--plan-stages 10000]

Needs `pip install dvc==3.67.1` for the peer. Builds dflash in release mode first.
1. No-op rerun of a fully cached 6-stage linear pipeline: `dflash run` vs `dvc repro` / `dvc status`.
2. Status of a built DAG where stage i needs i-1 and i/2: `dflash plan` vs `dvc status`.
3. blake3 hashing of a 2 GiB local input (cold), and the stat-cached re-check.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DFLASH = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "dflash")


def sh(cmd, cwd, check=True):
    return subprocess.run(cmd, cwd=cwd, shell=True, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed(cmd, cwd, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sh(cmd, cwd)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def dag_inputs(i):
    return sorted({i - 1, i // 2} - {i}) if i > 0 else []


def dflash_pipeline(n, dag):
    lines = ["name: bench", "stages:"]
    for i in range(n):
        ins = dag_inputs(i) if dag else ([i - 1] if i else [])
        lines.append(f"  s{i}:")
        lines.append("    kind: command")
        if ins:
            lines.append("    inputs: [" + ", ".join(f"s{j}" for j in ins) + "]")
        lines.append(f"    params: {{run: 'echo {i} > $DFLASH_OUT/o.txt'}}")
    return "\n".join(lines) + "\n"


def dvc_pipeline(n, dag):
    lines = ["stages:"]
    for i in range(n):
        ins = dag_inputs(i) if dag else ([i - 1] if i else [])
        lines.append(f"  s{i}:")
        lines.append(f"    cmd: echo {i} > o{i}.txt")
        if ins:
            lines.append("    deps: [" + ", ".join(f"o{j}.txt" for j in ins) + "]")
        lines.append(f"    outs: [o{i}.txt]")
    return "\n".join(lines) + "\n"


def dvc_dir(n, dag):
    d = tempfile.mkdtemp(prefix="bench-dvc-")
    sh("git init -q && dvc init -q && dvc config core.analytics false && dvc config core.autostage false", d)
    open(os.path.join(d, "dvc.yaml"), "w").write(dvc_pipeline(n, dag))
    return d


def dflash_dir(n, dag):
    d = tempfile.mkdtemp(prefix="bench-dflash-")
    open(os.path.join(d, "p.yaml"), "w").write(dflash_pipeline(n, dag))
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dvc-stages", type=int, default=1000)
    ap.add_argument("--plan-stages", type=int, default=10000)
    ap.add_argument("--hash-gib", type=float, default=2.0)
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    have_dvc = shutil.which("dvc") is not None
    rows = []

    d = dflash_dir(6, False)
    sh(f"{DFLASH} run p.yaml", d)
    t_dflash = timed(f"{DFLASH} run p.yaml", d, 10)
    rows.append(("no-op rerun, 6-stage pipeline", "dflash run", t_dflash, None))
    if have_dvc:
        v = dvc_dir(6, False)
        sh("dvc repro -q", v)
        for peer in ("dvc repro", "dvc status"):
            t = timed(peer, v, 3)
            rows.append(("no-op rerun, 6-stage pipeline", peer, t, t / t_dflash))

    for n in sorted({a.dvc_stages, a.plan_stages}):
        d = dflash_dir(n, True)
        t = time.perf_counter()
        sh(f"{DFLASH} run p.yaml --jobs 2", d)
        build = time.perf_counter() - t
        t_plan = timed(f"{DFLASH} plan p.yaml", d, 3)
        rows.append((f"status of a built {n}-stage DAG", "dflash plan", t_plan, None))
        rows.append((f"build of a {n}-stage DAG (each stage a shell command)", "dflash run --jobs 2", build, None))
        if have_dvc and n == a.dvc_stages:
            v = dvc_dir(n, True)
            t = time.perf_counter()
            sh("dvc repro -q", v)
            rows.append((f"build of a {n}-stage DAG (each stage a shell command)", "dvc repro", time.perf_counter() - t, (time.perf_counter() - t) / build))
            t_dvc = timed("dvc status", v, 3)
            rows.append((f"status of a built {n}-stage DAG", "dvc status", t_dvc, t_dvc / t_plan))

    d = dflash_dir(0, False)
    size = int(a.hash_gib * (1 << 30))
    with open(os.path.join(d, "big.bin"), "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)
    # Backdate it: a file modified within 2 s of being hashed is never trusted from the stat cache.
    old = time.time() - 60
    os.utime(os.path.join(d, "big.bin"), (old, old))
    open(os.path.join(d, "p.yaml"), "w").write("stages:\n  a: {kind: command, params: {files: [big.bin], run: 'true'}}\n")
    open(os.path.join(d, "q.yaml"), "w").write("stages:\n  a: {kind: command, params: {run: 'true'}}\n")
    base = timed(f"{DFLASH} plan q.yaml", d, 3)
    sh("cat big.bin > /dev/null", d)  # warm the page cache so this measures hashing, not the disk
    t = time.perf_counter()
    sh(f"DFLASH_WORK=.w1 {DFLASH} plan p.yaml", d)
    cold = time.perf_counter() - t - base
    warm = timed(f"DFLASH_WORK=.w1 {DFLASH} plan p.yaml", d, 3)
    rows.append((f"hash a {a.hash_gib:g} GiB input (cold)", "dflash plan", cold, None))
    rows.append(("re-check it unchanged (stat cache)", "dflash plan", warm, None))
    rows.append(("same pipeline without the input (baseline)", "dflash plan", base, None))
    print(f"hashing: {size / cold / 1e9:.2f} GB/s on one core", file=sys.stderr)

    print("| work | tool | median seconds | peer / dflash |")
    print("|---|---|---|---|")
    for work, tool, t, ratio in rows:
        print(f"| {work} | {tool} | {t:.3f} | {'' if ratio is None else f'{ratio:.0f}x'} |")
    print(f"\nhashing throughput: {size / cold / 1e9:.2f} GB/s (one core, page cache warm)")


if __name__ == "__main__":
    main()
