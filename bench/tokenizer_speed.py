#!/usr/bin/env python3
"""Tokenize benchmark: dflash's `tokenize` stage against Python `transformers` + `datasets.map`
doing the same templating and masking, on the same real conversations, in the same run.

    python3 bench/tokenizer_speed.py [--rows 5000]
    python3 bench/tokenizer_speed.py --long        # long unbroken text: time as the length doubles

Needs transformers, datasets and pyarrow, and `scripts/fetch-assets` (the real Qwen3 tokenizer
and chat template, and the ShareGPT dump: real multi-turn conversations, code and many
languages). Builds dflash in release mode first. Both sides render every conversation with the
Qwen3 template, find the generated spans the same way (tests/support/tokenize_reference.py is the
Python side, the one the CI exactness test uses), tokenize with offsets and build the loss mask.
Each side runs pinned to one core, then to two (dflash: RAYON_NUM_THREADS; datasets: num_proc).
Reported: output tokens per second per core while tokenizing (dflash's per-file times from its
stage log; Python's `map` + `filter` time, its tokenizer loaded before), the ratio, the scaling
from one to two cores, and the one-core figures again counting loading the tokenizer (and, for
dflash, storing the artifact).
"""
import argparse, json, os, re, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DFLASH = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "dflash")
ASSETS = os.environ.get("DFLASH_ASSETS", os.path.join(ROOT, ".assets"))

PYTHON = r"""
import sys, time, glob, json
sys.path.insert(0, sys.argv[1])
import datasets
from transformers import AutoTokenizer
from tokenize_reference import Reference, messages
data, model, procs = sys.argv[2], sys.argv[3], int(sys.argv[4])
datasets.disable_progress_bars()
t_load = time.perf_counter()
tok = AutoTokenizer.from_pretrained(model)
load = time.perf_counter() - t_load
ref = Reference.transformers(tok, {}, "all")
ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in sorted(glob.glob(data + "/*.arrow"))])

def encode(conv):
    msgs, tools = messages(conv, "keep")
    try:
        _, ids, mask, sp = ref.encode(msgs, tools)
    except Exception:
        ids, mask = [], []
    return {"input_ids": ids, "loss_mask": mask, "length": len(ids)}

t0 = time.perf_counter()
out = ds.map(encode, remove_columns=[c for c in ds.column_names if c not in ("id", "source")],
             num_proc=procs if procs > 1 else None, load_from_cache_file=False, keep_in_memory=True)
out = out.filter(lambda r: 1 in r["loss_mask"], keep_in_memory=True)
secs = time.perf_counter() - t0
print(json.dumps({"seconds": secs, "load": load, "rows": len(out), "tokens": sum(out["length"])}))
"""


PLAIN = r"""
import sys, time, glob, json
sys.path.insert(0, sys.argv[1])
import numpy as np
import pyarrow as pa
from transformers import AutoTokenizer
from tokenize_reference import messages
data, model = sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(model)
rows = []
for f in sorted(glob.glob(data + "/*.arrow")):
    with pa.ipc.open_stream(f) as r:
        rows.extend(r.read_all().to_pylist())
eos = tok.eos_token
t = {"render": 0.0, "spans": 0.0, "bpe": 0.0, "mask": 0.0}
tokens = kept = 0
t0 = time.perf_counter()
for conv in rows:
    msgs, tools = messages(conv, "keep")
    a = time.perf_counter()
    try:
        full = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    except Exception:
        continue
    b = time.perf_counter()
    # Each assistant turn: from where its generation prompt stops matching, to its end token.
    spans = []
    for i, m in enumerate(msgs):
        if i == 0 or m["role"] != "assistant":
            continue
        p = tok.apply_chat_template(msgs[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        s = 0
        n = min(len(p), len(full))
        while s < n and p[s] == full[s]:
            s += 1
        e = full.find(eos, s)
        spans.append((s, len(full) if e < 0 else e + len(eos)))
    c = time.perf_counter()
    enc = tok(full, return_offsets_mapping=True, add_special_tokens=False)
    d = time.perf_counter()
    off = np.asarray(enc["offset_mapping"]).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=np.int8)
    for s, e in spans:
        mask |= ((off[:, 0] < e) & (off[:, 1] > s)).astype(np.int8)
    if mask.any():
        kept += 1
        tokens += len(off)
    t["render"] += b - a; t["spans"] += c - b; t["bpe"] += d - c; t["mask"] += time.perf_counter() - d
print(json.dumps({"seconds": time.perf_counter() - t0, "rows": kept, "tokens": tokens, "parts": t}))
"""


def dflash_run(work, pipeline, store, threads, cpus):
    """(seconds tokenizing, seconds for the whole stage, stats); the first from the stage log."""
    env = dict(os.environ, DFLASH_WORK=os.path.join(work, "work"), RAYON_NUM_THREADS=str(threads))
    r = subprocess.run(["taskset", "-c", cpus, DFLASH, "run", pipeline, "--json", "--store", store],
                       env=env, check=True, capture_output=True, text=True, cwd=work)
    run = json.loads(r.stdout)
    stage = next(s for s in run["stages"] if s["id"] == "tok")
    log = open(os.path.join(work, "work", "logs", run["run_id"], "tok.log")).read()
    working = sum(float(m) for m in re.findall(r"tokens in ([0-9.]+) s", log))
    shown = subprocess.run([DFLASH, "show", "tok", "-p", pipeline, "--store", store], env=env, check=True,
                           capture_output=True, text=True, cwd=work)
    return working, stage["seconds"], json.loads(shown.stdout)["stats"]


LONG = r"""
import sys, time, json
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
for n in map(int, sys.argv[2:]):
    text = "-" * n
    t = time.perf_counter()
    tok(text, return_offsets_mapping=True)
    print(json.dumps({"n": n, "seconds": time.perf_counter() - t}))
"""


def long_runs():
    """A reply of 20K to 320K `-` (one unbroken word, as a markdown table rule is), each
    tokenized by the stage on one core, beside `transformers` on the same text: the time per
    doubling should stay near 2x (linear), not 4x (quadratic)."""
    work = tempfile.mkdtemp(prefix="dflash-bench-long-")
    os.symlink(os.path.join(ASSETS, "qwen3"), os.path.join(work, "qwen3"))
    sizes = [20_000, 40_000, 80_000, 160_000, 320_000]
    ours = []
    for n in sizes:
        with open(os.path.join(work, f"long-{n}.jsonl"), "w") as f:
            f.write(json.dumps({"id": "rule", "messages": [{"role": "user", "content": "a table"},
                                                           {"role": "assistant", "content": "-" * n}]}) + "\n")
        pipeline = os.path.join(work, f"long-{n}.yaml")
        with open(pipeline, "w") as f:
            f.write(f"""stages:
  sg: {{kind: download, params: {{path: long-{n}.jsonl, format: messages}}}}
  tok: {{kind: tokenize, inputs: [sg], params: {{tokenizer: qwen3, max_length: 1000000}}}}
""")
        working, _, _ = dflash_run(work, pipeline, os.path.join(work, f"store-{n}"), 1, "0")
        ours.append(working)
    r = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", LONG, os.path.join(work, "qwen3")]
                       + [str(n) for n in sizes], capture_output=True, text=True, check=True)
    theirs = [json.loads(l)["seconds"] for l in r.stdout.strip().splitlines()]
    for n, d, t in zip(sizes, ours, theirs):
        print(f"| {n:,} `-` in one reply | dflash {d:.3f} s | transformers {t:.3f} s |")
    for i in range(1, len(sizes)):
        print(f"| doubling {sizes[i - 1]:,} -> {sizes[i]:,} | dflash x{ours[i] / ours[i - 1]:.2f} "
              f"| transformers x{theirs[i] / theirs[i - 1]:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--long", action="store_true", help="long unbroken text, as its length doubles")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    if a.long:
        return long_runs()
    work = tempfile.mkdtemp(prefix="dflash-bench-tokenize-")
    for name in ("qwen3", "sharegpt.json"):
        os.symlink(os.path.join(ASSETS, name), os.path.join(work, name))
    pipeline = os.path.join(work, "tok.yaml")
    with open(pipeline, "w") as f:
        f.write(f"""stages:
  sg: {{kind: download, params: {{path: sharegpt.json, format: sharegpt, limit: {a.rows}}}}}
  tok: {{kind: tokenize, inputs: [sg], params: {{tokenizer: qwen3}}}}
""")
    one_s, one_all, stats = dflash_run(work, pipeline, os.path.join(work, "store1"), 1, "0")
    two_s, _, _ = dflash_run(work, pipeline, os.path.join(work, "store2"), 2, "0,1")
    data = os.path.join(work, "conversations")
    subprocess.run([DFLASH, "export", "sg", "-p", pipeline, "--store", os.path.join(work, "store1"), data],
                   check=True, cwd=work, capture_output=True,
                   env=dict(os.environ, DFLASH_WORK=os.path.join(work, "work")))
    support = os.path.join(ROOT, "tests", "support")
    py = {}
    for procs, cpus in ((1, "0"), (2, "0,1")):
        r = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", PYTHON, support, data,
                            os.path.join(work, "qwen3"), str(procs)],
                           capture_output=True, text=True,
                           env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if r.returncode != 0:
            sys.exit(f"the Python side failed:\n{r.stderr}")
        py[procs] = json.loads(r.stdout.strip().splitlines()[-1])
    tokens = stats["tokens"]
    if py[1]["tokens"] != tokens or py[1]["rows"] != stats["rows"]:
        sys.exit(f"the two sides disagree: dflash {stats['rows']} rows / {tokens} tokens, "
                 f"python {py[1]['rows']} rows / {py[1]['tokens']} tokens")
    r = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", PLAIN, support, data, os.path.join(work, "qwen3")],
                       capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if r.returncode != 0:
        sys.exit(f"the plain loop failed:\n{r.stderr}")
    plain = json.loads(r.stdout.strip().splitlines()[-1])
    d1, d2 = tokens / one_s, tokens / two_s
    p1, p2 = tokens / py[1]["seconds"], tokens / py[2]["seconds"]
    p1_all = tokens / (py[1]["seconds"] + py[1]["load"])
    d1_all = tokens / one_all
    print(f"| tokenize {stats['rows']:,} ShareGPT conversations ({tokens:,} tokens, Qwen3 template + loss masks) "
          f"| dflash: {d1 / 1e3:,.0f}K tokens/s on 1 core, {d2 / 1e3:,.0f}K on 2 ({d2 / d1:.2f}x) "
          f"| transformers + datasets.map: {p1 / 1e3:,.0f}K tokens/s on 1 core, {p2 / 1e3:,.0f}K on 2 ({p2 / p1:.2f}x) "
          f"| {d1 / p1:.1f}x per core |")
    pl = plain["tokens"] / plain["seconds"]
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in plain["parts"].items())
    print(f"| the same against a plain transformers loop on one core (apply_chat_template, one "
          f"tokenizer call with offsets, masks from offsets with numpy; {plain['rows']:,} rows, "
          f"{plain['tokens']:,} tokens) | dflash {d1 / 1e3:,.0f}K tokens/s | plain loop {pl / 1e3:,.0f}K tokens/s "
          f"({parts}) | {d1 / pl:.1f}x per core |")
    print(f"| the same, one core, counting loading the tokenizer and (dflash) storing the artifact "
          f"| {d1_all / 1e3:,.0f}K tokens/s ({one_all:.2f} s) | {p1_all / 1e3:,.0f}K tokens/s "
          f"({py[1]['seconds'] + py[1]['load']:.2f} s) | {d1_all / p1_all:.1f}x |")


if __name__ == "__main__":
    main()
