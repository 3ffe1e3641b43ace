#!/usr/bin/env python3
"""Generate benchmark: how fast dflash's `generate` client drives OpenAI-compatible servers,
against the Python `openai` AsyncOpenAI client with asyncio (the approach of SpecForge's
regeneration script), on the same server in the same run.

    python3 bench/generate.py [--prompts 20000] [--in-flight 256]

Needs `pip install openai` and pyarrow. Builds dflash and the benchmark's server
(`stages/generate/examples/instant_server.rs`, a mock that answers at once) in release mode.

1. Client overhead: one instant server pinned to core 1; each client pinned to core 0 sends the
   same single-turn prompts with the same number in flight. dflash's figure is its whole
   `generate` stage (requests, retries bookkeeping, Arrow shards committed to the store);
   Python's only sends and collects.
2. Saturation: K servers that each take 50 ms per request and are given `max_in_flight` C; the
   share of time, from its first request to its last answer, that each server had C requests in
   progress.
"""
import argparse, json, os, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
DFLASH = os.path.join(TARGET, "release", "dflash")
SERVER = os.path.join(TARGET, "release", "examples", "instant_server")

PYTHON = r"""
import asyncio, json, sys, time
from openai import AsyncOpenAI
url, n, in_flight = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def main():
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=3)
    sem = asyncio.Semaphore(in_flight)
    async def one(i):
        async with sem:
            r = await client.chat.completions.create(
                model="target", messages=[{"role": "user", "content": f"prompt number {i}"}],
                max_tokens=16, temperature=0.0)
            return r.choices[0].message.content
    t = time.perf_counter()
    out = await asyncio.gather(*(one(i) for i in range(n)))
    print(json.dumps({"seconds": time.perf_counter() - t, "answers": len(out)}))
asyncio.run(main())
"""


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start_server(port, cpus, *args):
    p = subprocess.Popen(["taskset", "-c", cpus, SERVER, "--port", str(port), *args])
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return p
        except OSError:
            time.sleep(0.02)
    sys.exit("the benchmark server did not start")


def stats(port):
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5))


def run_dflash(work, endpoints, n, in_flight, cpus):
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n")
    eps = ", ".join(f"'{e}'" for e in endpoints)
    pipeline = os.path.join(work, "gen.yaml")
    with open(pipeline, "w") as f:
        f.write(f"""stages:
  prompts: {{kind: download, params: {{path: prompts.jsonl}}}}
  answers:
    kind: generate
    inputs: [prompts]
    params: {{model: target, endpoints: [{eps}], max_in_flight: {in_flight}, max_tokens: 16}}
""")
    env = dict(os.environ, DFLASH_WORK=os.path.join(work, "work"))
    store = os.path.join(work, "store")
    subprocess.run([DFLASH, "run", pipeline, "--only", "prompts", "--store", store], env=env, cwd=work,
                   check=True, capture_output=True)
    r = subprocess.run(["taskset", "-c", cpus, DFLASH, "run", pipeline, "--json", "--store", store], env=env,
                       cwd=work, check=True, capture_output=True, text=True)
    stage = next(s for s in json.loads(r.stdout)["stages"] if s["id"] == "answers")
    return stage["seconds"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--only", choices=["overhead", "saturation", "faults"],
                    help="run one section (the first needs `pip install openai`)")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "dflash-stage-generate", "--example",
                    "instant_server"], cwd=ROOT, check=True)

    if a.only in (None, "overhead"):
        overhead(a)
    if a.only in (None, "saturation"):
        saturation()
    if a.only in (None, "faults"):
        faults()


def overhead(a):
    """1. Client overhead."""
    port = free_port()
    server = start_server(port, "1")
    try:
        url = f"http://127.0.0.1:{port}/v1"
        d_s = run_dflash(tempfile.mkdtemp(prefix="dflash-bench-gen-"), [url], a.prompts, a.in_flight, "0")
        p = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", PYTHON, url, str(a.prompts),
                            str(a.in_flight)], check=True, capture_output=True, text=True)
        py = json.loads(p.stdout)
    finally:
        server.kill()
    d_rate, p_rate = a.prompts / d_s, a.prompts / py["seconds"]
    print(f"| {a.prompts:,} completions from an instant server, {a.in_flight} in flight, client on one core "
          f"| dflash `generate`: {d_rate:,.0f}/s ({d_s:.2f} s, shards committed) "
          f"| openai AsyncOpenAI + asyncio: {p_rate:,.0f}/s ({py['seconds']:.2f} s) | {d_rate / p_rate:.1f}x |")


def saturation():
    """2. Saturation: 4 servers, 50 ms per request, capacity 16 each."""
    k, cap, n = 4, 16, 4 * 16 * 100
    ports = [free_port() for _ in range(k)]
    servers = [start_server(pt, "1", "--delay-ms", "50", "--capacity", str(cap)) for pt in ports]
    try:
        work = tempfile.mkdtemp(prefix="dflash-bench-gen-")
        secs = run_dflash(work, [f"http://127.0.0.1:{pt}/v1" for pt in ports], n, cap, "0")
        shares = [stats(pt)["full_share"] for pt in ports]
    finally:
        for s in servers:
            s.kill()
    ideal = n / (k * cap) * 0.05
    print(f"| saturation: {k} servers x {cap} slots, 50 ms per request, {n:,} requests "
          f"| each server full {', '.join(f'{s:.1%}' for s in shares)} of the time; "
          f"{secs:.2f} s against {ideal:.2f} s at perfect saturation | |")


def faults():
    """3. Under faults: 2 servers x 16 slots, 50 ms per request, one answering every 4th request
    with a quick 503 (up, but shedding load): both must stay busy (none drained, none idle)."""
    cap = 16
    ports = [free_port() for _ in range(2)]
    servers = [start_server(ports[0], "1", "--delay-ms", "50", "--capacity", str(cap)),
               start_server(ports[1], "1", "--delay-ms", "50", "--capacity", str(cap), "--fail-every", "4")]
    try:
        work = tempfile.mkdtemp(prefix="dflash-bench-gen-")
        n = 2 * cap * 400
        secs = run_dflash(work, [f"http://127.0.0.1:{pt}/v1" for pt in ports], n, cap, "0")
        shares = [stats(pt)["full_share"] for pt in ports]
    finally:
        for s in servers:
            s.kill()
    print(f"| under faults: 2 servers x {cap} slots, 50 ms per request, one answering 25% of requests 503, "
          f"{n:,} prompts | each server full {', '.join(f'{s:.1%}' for s in shares)} of the time; {secs:.2f} s | |")


if __name__ == "__main__":
    main()
