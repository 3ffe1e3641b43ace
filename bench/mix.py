#!/usr/bin/env python3
"""Mix benchmark: dflash's `mix` stage against a pandas script doing the same exact dedup and
seeded per-source sampling, on the same synthetic data, in the same run, both on one core.

    python3 bench/mix.py [--rows 1000000]

Needs pyarrow and pandas. Builds dflash in release mode first. The data: ROWS conversations over
4 sources and 5 categories, prompts of 8-60 words, 10% exact copies (case and spacing changed)
and 5% near copies (one word changed). Both sides keep 40% of the rows (weights 4:3:2:1) with a
10% eval split. dflash also removes near duplicates (MinHash); pandas has no such step, so
dflash does strictly more work. Reported: seconds, rows/s, peak memory (max RSS) of each.
"""
import argparse, json, os, random, resource, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DFLASH = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "dflash")
SOURCES = ["code", "chat", "math", "science"]
WEIGHTS = {"code": 4, "chat": 3, "math": 2, "science": 1}


def generate(n, out_dir):
    import pyarrow as pa
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(20000)]
    msg = pa.struct([("role", pa.utf8()), ("content", pa.utf8()), ("reasoning", pa.utf8()), ("tool_calls", pa.utf8())])
    schema = pa.schema([
        pa.field("id", pa.utf8(), False), pa.field("source", pa.utf8(), False), ("category", pa.utf8()),
        pa.field("messages", pa.list_(msg), False), ("tools", pa.utf8()), ("metadata", pa.utf8()),
        ("finish_reason", pa.utf8()),
    ], metadata={"dflash.schema": "conversations/2"})
    per = 100_000
    made = []
    for part in range(0, n, per):
        ids, srcs, cats, msgs = [], [], [], []
        for i in range(part, min(n, part + per)):
            r = rng.random()
            if made and r < 0.10:
                text = "  " + rng.choice(made).upper().replace(" ", "   ")
            elif made and r < 0.15:
                words = rng.choice(made).split(" ")
                words[rng.randrange(len(words))] = rng.choice(vocab)
                text = " ".join(words)
            else:
                text = " ".join(rng.choices(vocab, k=rng.randint(8, 60)))
                if len(made) < 200_000:
                    made.append(text)
            ids.append(f"r{i}")
            srcs.append(SOURCES[i % 4])
            cats.append(f"c{i % 5}")
            msgs.append([{"role": "user", "content": text, "reasoning": None, "tool_calls": None}])
        none = [None] * len(ids)
        t = pa.table([ids, srcs, cats, msgs, none, none, none], schema=schema)
        with pa.OSFile(os.path.join(out_dir, f"train-{part // per:05}.arrow"), "wb") as f:
            with pa.ipc.new_stream(f, schema) as w:
                w.write_table(t, max_chunksize=8192)


PANDAS = r"""
import os, sys, time, resource, pyarrow as pa, pandas as pd
src, total, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
weights = {"code": 4, "chat": 3, "math": 2, "science": 1}
t0 = time.perf_counter()
tables = [pa.ipc.open_stream(open(os.path.join(src, f), "rb")).read_all() for f in sorted(os.listdir(src))]
df = pa.concat_tables(tables).to_pandas()
df["prompt"] = df["messages"].map(lambda m: "\n".join(x["content"] for x in m if x["role"] == "user"))
df["norm"] = df["prompt"].str.lower().str.split().str.join(" ")
df = df[df["norm"].str.len() > 0].drop_duplicates("norm")
parts = []
s = sum(weights.values())
for name, g in df.groupby("source"):
    n = min(len(g), round(total * weights[name] / s))
    parts.append(g.sample(n=n, random_state=seed))
out = pd.concat(parts).sample(frac=1.0, random_state=seed)
n_eval = int(len(out) * 0.1)
out.iloc[n_eval:].drop(columns=["prompt", "norm"]).to_parquet(os.path.join(src, "..", "pandas-train.parquet"))
out.iloc[:n_eval].drop(columns=["prompt", "norm"]).to_parquet(os.path.join(src, "..", "pandas-eval.parquet"))
print(time.perf_counter() - t0, len(out), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="dflash-bench-mix-")
    data = os.path.join(work, "data")
    os.makedirs(data)
    t = time.perf_counter()
    generate(a.rows, data)
    print(f"generated {a.rows} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    total = int(a.rows * 0.4)
    weights = ", ".join(f"{k}: {v}" for k, v in WEIGHTS.items())
    pipeline = os.path.join(work, "mix.yaml")
    with open(pipeline, "w") as f:
        f.write(f"""stages:
  data: {{kind: command, params: {{run: "cp {data}/*.arrow $DFLASH_OUT/"}}}}
  mixed:
    kind: mix
    inputs: [data]
    params: {{weights: {{{weights}}}, total: {total}, seed: 0, eval_fraction: 0.1}}
""")
    env = dict(os.environ, DFLASH_WORK=os.path.join(work, "work"))
    store = os.path.join(work, "store")
    subprocess.run([DFLASH, "run", pipeline, "--only", "data", "--store", store], env=env, check=True,
                   stderr=subprocess.DEVNULL)
    # One core for each side. Max RSS of the dflash process includes the runtime's copy of the
    # inputs into the stage's folder; the stage's own time comes from the run report.
    t = time.perf_counter()
    r = subprocess.run(["taskset", "-c", "0", "/usr/bin/time", "-f", "%M", DFLASH, "run", pipeline, "--json",
                        "--store", store], env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    report = json.loads(r.stdout)
    stage = next(s for s in report["stages"] if s["id"] == "mixed")
    rss_kb = int(r.stderr.strip().splitlines()[-1])
    shown = subprocess.run([DFLASH, "show", "mixed", "-p", pipeline, "--store", store], env=env, check=True,
                           capture_output=True, text=True)
    stats = json.loads(shown.stdout)["stats"]
    p = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", PANDAS, data, str(total), "0"],
                       check=True, capture_output=True, text=True)
    pd_s, pd_rows, pd_rss = p.stdout.split()
    pd_s = float(pd_s)
    rows = a.rows
    print(f"| mix {rows:,} rows -> {stats['rows']:,} (exact + near dedup, 4 weighted sources, eval split), one core "
          f"| {stage['seconds']:.2f} s ({rows / stage['seconds'] / 1e6:.2f}M rows/s), peak {rss_kb / 1024:.0f} MiB "
          f"(whole run {wall:.2f} s) | pandas (exact dedup only): {pd_s:.2f} s, peak {int(pd_rss) / 1024:.0f} MiB, "
          f"{int(pd_rows):,} rows | {pd_s / stage['seconds']:.1f}x |")
    print(f"removed: {json.dumps(stats['removed'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
