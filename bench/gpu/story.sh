#!/usr/bin/env bash
# Runs pipelines/smollm2.yaml on the GPU machine (the `device` tool: no Rust, no network, 64 MiB
# carried per call, everything forgotten once the machine goes idle). The data flow:
#   - here, `bench/gpu/story.sh pack-inputs BIN .gpu [INIT [SEED]]` fills .gpu/1, .gpu/2, ...
#     (`.gpu/` is in .git/info/exclude), one folder a call: the SmolLM2 GGUF (98 MB) cut to
#     what a call has room for beside the working tree (14 MB), the
#     CUDA build of dflash and `train_probe` (xz), ShareGPT (xz), the benchmark sets, the wheels
#     (the reference package, gguf, flash-linear-attention); given INIT (an exported drafter/
#     folder, or `drafters:NAME`), the drafter the run starts from (train's `init:`); given
#     SEED (a store folder, or a `store-small.tar.gz` that `bring-back` brought and was
#     kept: `drafters:smollm2-expansion-seed` has both batches' completions), its whole
#     small artifacts, which `setup` unpacks into the run's store, so what an earlier session
#     generated is cached. It prints the parts (four for the story's run);
#   - each call carries one part (the device tool's `carry: [".gpu/1"]`, then ".gpu/2", ...) and
#     runs `stash`, which keeps it in /tmp; the calls follow each other while the machine is
#     warm (30 s: about 6 s of device time each), the last one runs `setup` and can go on;
#   - `checks` runs the training kernels' checks and the step against PyTorch (issue 22);
#     `flash` the attention kernels' checks, timings and the step; `wgmma` the wgmma kernels
#     alone and the step with them (a short call);
#     `hybrid [LAYERS] [TOKENS]` a hybrid target's forward against transformers (issue 23),
#     `hybrid-decode` its batched decoding against transformers' `generate`;
#     `decode [BATCH] [PROMPT] [STEPS]` generate's batched decoding against transformers'
#     (generation bounds the story's data: 4,813 tokens/s for a 135M model on an H100);
#   - `run SECONDS` runs the pipeline into a store under /tmp (kept while the machine is warm)
#     and stops it with Ctrl-C (SIGINT) before the call's limit: generate, train and bench
#     commit shards as they go, so the next call's `run` resumes where this one stopped;
#   - `train-fit SECONDS` times a few training steps, sets `max_steps` to what fits in the
#     seconds left, and trains (the value it chose goes to $OUT: commit it to the pipeline);
#   - `bring-back` exports the drafters and the bench results and keeps the store's whole small
#     artifacts (`dflash copy --max-file-bytes 4M`) under $OUT, so they land on this machine.
# The last session's calls (README "The eighth run"): `stash` x3; `stash; setup; verify 300;
# round 300 128`; `PIPE=pipelines/smollm2-bench.yaml run 420; bring-back` (the 5,400-step
# drafter, `verify: all`, 128-node trees); `hybrid 4 2048` (141 s); on a fresh machine `stash`
# x3; `stash; setup; run 535 --only drafter` (pipelines/smollm2.yaml's max_steps 2800, cut);
# `run 340 --only drafter; bring-back` (resumed, done); the new drafter copied over
# .assets/smollm2-drafter there and benched on 8 prompts a set, `verify: tree+lookup`.
# The trained drafters lived in .assets/ (git-ignored) and were lost with the machine they were
# on (2026-12-06: the 8,200-step drafter, README "The eighth run", is gone; its bench results
# and metrics are in bench/results/). Then on a `drafters` branch, which did not survive the
# next checkout either (only main lands: the 5,600-step drafter and the tenth run's store were
# lost). So: `keep-drafter DIR NAME` keeps each drafter `bring-back` (or `promote`) brings, its
# exported `drafter/` folder (config.json + model.safetensors, 24 MB in bf16) and metrics, in
# main's history: added in one commit, out of the tree in the next (every device call carries
# main's tree), `bench/drafters.tsv` saying where; `scripts/fetch-assets` extracts them into
# .assets/drafters/; `pack-inputs BIN .gpu drafters:NAME drafters:SEED` packs from there.
# The ninth run (2026-12-06, README "The ninth run") trained it again from the committed
# completions: 2,800 steps (held-out tau per round 2.11), `drafters:smollm2-2800`
# (pipelines/smollm2-cpu.yaml benches it on a CPU). The tenth (README "The tenth run") trained
# 2,800 more from it (`drafters:smollm2-5600`, held-out 2.48; `stash` x4 with `setup; run 500
# --only drafter`, then `run 470 --only drafter; bring-back`: ~695 s), benched it on 12
# prompts a set (`run 420 --only bench`, 152 s) and on all 164 HumanEval prompts
# (`PIPE=pipelines/smollm2-full.yaml run 530 --only bench_humaneval`, 240 s, after copying the
# new drafter over the stash's .assets/smollm2-drafter). Both were lost with the branch. The
# next (2026-12-06's last session got no machine in seventeen calls, 2026-12-07's in
# twenty-two): `pack-inputs BIN .gpu drafters:smollm2-2800 drafters:smollm2-expansion-seed`
# (four parts), `stash` x3; `stash; setup; run 560 --only drafter` (2,800 more steps from the
# 2,800-step drafter: the tenth run again);
# `run 400 --only drafter && promote` (the drafter to $OUT/trained.tar.gz.NN and in place of
# the stash's .assets/smollm2-drafter) then `PIPE=pipelines/smollm2-full.yaml run SECS --only
# bench_gsm8k --only bench_mt_bench --only bench_humaneval` (100 / 80 / 164 prompts; estimated
# 260 / 416 / 427 s, HumanEval measured 240), resuming from the store's four-prompt shards when
# cut, and `PIPE=... bring-back`; here, `keep-drafter` the promoted drafter.
# The eleventh (2026-12-07, an H200) ran that plan: `run 555 --only drafter` finished the 2,800
# steps in 546 s; `promote; PIPE=... run 490 --only bench_gsm8k --only bench_mt_bench --only
# bench_humaneval; bring-back` (MT-Bench done, HumanEval cut); `PIPE=... run 300 --only
# bench_gsm8k; PIPE=... run 190 --only bench_humaneval; bring-back` (~1,660 s with the start);
# the drafter kept as `drafters:smollm2-5600`, so the next full bench needs no retraining:
# `pack-inputs BIN .gpu drafters:smollm2-5600 drafters:smollm2-expansion-seed`, `stash` x3,
# `stash; setup; PIPE=pipelines/smollm2-full.yaml run SECS --only bench_...`.
# The twelfth (2026-12-07, an H100) ran that pack with blocks of 16: `stash; setup; PIPE=...
# run 470 --only bench16_mt_bench` (321 s), `run 480 --only bench16_gsm8k --only
# bench16_humaneval; bring-back` (199 + 226 s, one after the other), `run 420 --only bench16_mt_bench_256`
# (279 s): 2.16x / 2.10x / 1.96x prompt lookup's tau, MT-Bench 2.00x at 256 nodes; `stash;
# flash` with .gpu/f (95 s); then, on a fresh machine with bench/results moved out of the tree
# (the working tree plus a 47 MB part must stay under 64 MiB), `stash` x3 and `stash; setup;
# sed -i -e 's/^      block_size: 8$/      block_size: 16/' -e '0,/max_steps: 2800/s//max_steps:
# 500/' pipelines/smollm2.yaml; run 290 --only drafter; promote` (127 s) and `PIPE=... run 165
# --only bench16_mt_bench` (56 questions: no gain over the 5,600-step drafter at 16).
# Next: a drafter trained with blocks of 16 for thousands of steps (the sed above with
# max_steps 2800: ~720 s of H100 at 3.9 steps/s, two calls), then `--only bench16_mt_bench_256`.
# The pack for it (made 2026-12-07 after the twelfth run, the working tree at 23 MB) has five
# parts: `stash` x4 (.gpu/1..4), then `stash; setup; ...` with .gpu/5.
# With under ~400 s of device time, `stash; flash` alone, carrying a one-part pack of its own
# (train_probe.xz and flash.ptx from a full pack's parts, 7.3 MB).
# `flash` checks and times the pipelined dK/dV kernel (issue 22; the build's flash.ptx, which
# pack-inputs packs) beside the staged one and FlexAttention, then the step with each and
# PyTorch's eager step, all in one call.
# The thirteenth session (2026-12-07, an H100, issue 22; two of seven calls got a machine) ran
# with .gpu/f only: `stash; flash` (169.8 s: the written-out backward against autograd and
# PyTorch's three forms), `stash; profile compiled` (242 s), later `stash; step` (129 s: AdamW
# keeping the bf16 weights) and `profile dflash` (89.6 s); bench/results/issue22-h100-thirteenth/.
# `step` is the step's comparison alone (~130 s with a start): the cheapest check of a change.
# The fourteenth (2026-12-07, an H100; one of eleven calls got a machine): `stash; flash` with
# .gpu/f (217.6 s): ldmatrix in the flash kernels, the elementwise and row kernels in 16-byte
# vectors, `head_rows` checked (then made the default): bench/results/issue22-h100-fourteenth/.
# The fifteenth (2026-12-07, an H100; the fifth call got a machine): `stash; flash;
# flash-profile` with .gpu/f (252.9 s): the opt-in kernels checked (AdamW's eight-wide master
# update, the norm's squares and `fused::add` in vectors, the wide forward) and three new
# attention kernels (`flash_forward_tall`, `flash_dq_tall`, `flash_dkv_tiled`), then
# `profile dflash` with them (43.1 s): bench/results/issue22-h100-fifteenth/. What paid became
# the default (the tall forward did not: it stays behind DFLASH_FLASH_FORWARD=tall).
# Then `stash; step` three times (186, 179, 193 s: the new defaults beside the earlier
# attention kernels and PyTorch's two forms; the last with the target's unused layers dropped:
# 234.0 ms, 1.50x / 0.97x) and `profile dflash` (the machine has no nsys for the host's side).
# The sixteenth (2026-12-07, an H100; the eleventh try got a machine, ten found none):
# `stash; NO_TORCH=1 wgmma` with .gpu/f (111.3 s): `flash_forward_wg` and `flash_forward_wgv`
# checked and timed (wgv became causal mode's default), AdamW's bf16-moment kernels checked,
# the step with bf16 moments (34,639 MiB): bench/results/issue22-h100-sixteenth/.
# Next, first: `stash; wgmma` with .gpu/f (~300 s): `flash_dq_wg` and `flash_dkv_wg` (block
# mode's dQ and dK/dV on wgmma, written after that call) checked and timed by `flash_reference.py
# dqwg` and `dkvwg`, `train_probe flash` under DFLASH_FLASH_DQ=wg DFLASH_FLASH_DKV=wg, the
# re-templated AdamW kernels checked, the step as `train` runs it, with bf16 moments, with each
# wgmma kernel that held, with all of them, and compiled PyTorch's; where a kernel holds and
# pays, make it the default (flash.rs's `dq_kernel`, `dkv_kernels`, `Forward::chosen_default`).
# Then `stash; profile-phases` (~120 s, ncu): which phase the step's 17 ms with no kernel
# running are in. Then the block-16
# training plan above, with .gpu/1..5 as repacked at the end of the
# fourteenth session (.gpu/3's dflash.xz rebuilt at the fifteenth's end with its kernels, its
# flash.ptx left out: .gpu/f has it) (`pack-inputs BIN .gpu drafters:smollm2-5600
# drafters:smollm2-expansion-seed`, its dflash with that session's kernels: `stash` x4, then
# `stash; setup; ...` with .gpu/5; budget the twelfth run's ~720 s for 2,800 steps).
# Done in the ninth run: `probe fused`, `checks`, `hybrid 4 2048`, `hybrid-decode 4 1,8,64 300
# 16` (bench/results/smollm2-h100-ninth/). Still to run: `verify 300` and `round 300 128` (the
# target's pass with its launches cut, README "The eighth run").
# PIPE=pipelines/smollm2-bench.yaml benches the stash's drafter (INIT) alone: a `command` stage
# copies it into the store, so a drafter trained in one call (or session) is benched in another.

set -euo pipefail
STASH=/tmp/dflash-story
STORE=$STASH/store
cmd=${1:-}
shift || true
# The pipeline the story runs: pipelines/smollm2.yaml, both drafters (DFlash and DFlash 2)
# starting from the last run's drafter (`init:`) when `pack-inputs` was given one. Written next to the stash (paths in it are
# relative to the repository root, where every command runs); its path is printed.
story_pipeline() {
    # PIPE=pipelines/smollm2-bench.yaml: bench the stash's drafter (INIT) alone.
    if [ -n "${PIPE:-}" ]; then
        echo "$PIPE"
        return
    fi
    if [ -f $STASH/assets/smollm2-drafter/config.json ]; then
        sed -e "s|      draft_layers: 3|      init: .assets/smollm2-drafter\n      draft_layers: 3|" \
            -e "s|head: dflash2, draft_layers: 3|head: dflash2, init: .assets/smollm2-drafter, draft_layers: 3|" \
            pipelines/smollm2.yaml > $STASH/smollm2.yaml
    else
        cp pipelines/smollm2.yaml $STASH/smollm2.yaml
    fi
    echo $STASH/smollm2.yaml
}
# `drafters:NAME` is a drafter or seed kept in main's history (bench/drafters.tsv), which
# `scripts/fetch-assets` extracted into .assets/drafters/NAME; anything else is a path.
kept() {
    case $1 in
    drafters:*)
        [ -d .assets/drafters/${1#drafters:} ] ||
            { echo "$1: not in .assets/drafters/ (scripts/fetch-assets extracts what bench/drafters.tsv lists)" >&2; exit 1; }
        echo .assets/drafters/${1#drafters:} ;;
    *) echo "$1" ;;
    esac
}
# The kernel checks' binary from its stashed xz, once (`setup` and `flash`).
unpack_probe() {
    if [ -f $STASH/train_probe.xz ] && [ ! -x $STASH/train_probe ]; then
        xz -dc $STASH/train_probe.xz > $STASH/train_probe && chmod +x $STASH/train_probe
    fi
}
# PyTorch's CUDA 13 libraries (cuBLAS, ...) for the binary, and .assets/ pointing at the stash.
cuda_env() {
    local lib
    lib=$(python3 -c "import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],'cu13','lib'))")
    export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
    rm -rf .assets && ln -s $STASH/assets .assets
}
# Run a command while sampling the GPU's used memory (nvidia-smi, every 100 ms), then print its
# peak as a JSON line: the same yardstick for both sides (candle has no allocator statistics,
# and PyTorch's max_memory_allocated leaves out its cache and context).
peak_memory() {
    local log=/tmp/peak-memory.$$
    : > $log
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $log 2>/dev/null &
    local sampler=$!
    "$@"
    local rc=$?
    kill $sampler 2>/dev/null
    wait $sampler 2>/dev/null
    local peak
    peak=$(sort -n $log | tail -1)
    echo "{\"phase\": \"peak_memory\", \"command\": \"$(basename "$1") ${2:-}\", \"peak_mib\": ${peak:-null}}"
    rm -f $log
    return $rc
}
# The training step as `train` runs it, then PyTorch's eager step, (given `flex`) its eager step
# with FlexAttention, and its compiled step with FlexAttention, each followed by its peak memory:
# the lines bench/step_ratio.py reads (the dflash run last before PyTorch's is the one compared).
step_against_pytorch() {
    echo '{"phase": "label", "name": "dflash, as train runs it"}'
    peak_memory $STASH/train_probe speed --anchors 512 || echo "speed failed: $?"
    peak_memory python3 bench/train_reference.py speed --anchors 512 || echo "speed (PyTorch) failed: $?"
    if [ "${1:-}" = flex ]; then
        peak_memory python3 bench/train_reference.py speed --anchors 512 --attention flex --steps 5 \
            --warmup 2 || echo "speed (PyTorch, FlexAttention) failed: $?"
    fi
    peak_memory python3 bench/train_reference.py speed --anchors 512 --attention flex --compile \
        --steps 6 --warmup 3 || echo "speed (PyTorch, compiled) failed: $?"
}
# The step with the attention kernels `train` ran before the fifteenth call (the narrow forward
# for both modes, the narrow dQ, the pipelined dK/dV), to see what the new defaults bought in the
# same call.
earlier_kernels_step() {
    echo '{"phase": "label", "name": "dflash, the attention kernels before the fifteenth call"}'
    DFLASH_FLASH_FORWARD=narrow DFLASH_FLASH_DQ=narrow DFLASH_FLASH_DKV=pipelined \
        peak_memory $STASH/train_probe speed --anchors 512 || echo "speed (earlier kernels) failed: $?"
}
# The step with the target's causal forward of before the sixteenth call (the wide kernel; the
# default since is `flash_forward_wgv`, on wgmma), to see what that bought in the same call.
wide_forward_step() {
    echo '{"phase": "label", "name": "dflash, DFLASH_FLASH_FORWARD=wide"}'
    DFLASH_FLASH_FORWARD=wide peak_memory $STASH/train_probe speed --anchors 512 ||
        echo "speed (DFLASH_FLASH_FORWARD=wide) failed: $?"
}
case $cmd in
pack-inputs)
    # Here: fill PACK/1, PACK/2, ... (one folder a call) from a CUDA build and .assets/; INIT
    # (optional, or ""): a drafter folder (config.json + model.safetensors) for the run to
    # start from, `drafters:NAME` for one kept in main's history (bench/drafters.tsv); SEED
    # (optional): a store, or a `store-small.tar.gz` / `seed.tar.gz` that `bring-back` brought,
    # whose objects the run's store starts with.
    bin=${1:?the CUDA build of dflash}
    pack=${2:?a folder outside the clone}
    init=${3:-}
    seed=${4:-}
    rm -rf "$pack" && mkdir -p "$pack"/files
    files=$pack/files
    strip -o /tmp/dflash-cuda "$bin" && xz -T2 -6 -c /tmp/dflash-cuda > "$files"/dflash.xz
    # The kernel checks (`train_probe`, built beside BIN with `--example train_probe`), if built.
    probe_bin=$(dirname "$bin")/examples/train_probe
    if [ -x "$probe_bin" ]; then
        strip -o /tmp/train-probe-cuda "$probe_bin" && xz -T2 -6 -c /tmp/train-probe-cuda > "$files"/train_probe.xz
    fi
    # The flash kernels' PTX as the build compiled it (`flash`: bench/flash_reference.py
    # launches it on PyTorch's tensors).
    ptx=$(ls -t "$(dirname "$bin")"/build/dflash-model-*/out/flash.ptx 2>/dev/null | head -1)
    [ -z "$ptx" ] || cp "$ptx" "$files"/flash.ptx
    xz -T2 -6 -c .assets/sharegpt.json > "$files"/sharegpt.json.xz
    cp .assets/HumanEval.jsonl.gz .assets/gsm8k.jsonl .assets/mt-bench.jsonl "$files"/
    # The reference package (dflash==0.1.0), gguf, and the flash-linear-attention kernels that
    # transformers runs a hybrid's Gated DeltaNet with on a GPU (`hybrid`): wheels from PyPI.
    ls .whl/dflash-0.1.0-*.whl >/dev/null 2>&1 ||
        pip download -q --no-deps -d .whl dflash==0.1.0 gguf==0.19.0 flash-linear-attention==0.6.0 \
            fla-core==0.6.0 einops==0.8.1
    cp .whl/*.whl "$files"/
    if [ -n "$init" ]; then
        mkdir -p "$files"/init
        init=$(kept "$init")
        cp "$init"/config.json "$init"/model.safetensors "$files"/init/
    fi
    if [ -n "$seed" ]; then
        seed=$(kept "$seed")
        # A seed `keep-drafter` archived: its one tar.gz.
        [ ! -f "$seed"/store-small.tar.gz ] || seed=$seed/store-small.tar.gz
        if [ -f "$seed" ]; then
            cp "$seed" "$files"/store-seed.tar.gz
        else
            # Whole artifacts only (a manifest without its blobs would fail the run there).
            rm -rf /tmp/seed-store
            "${DFLASH:-target/release/dflash}" copy --from "$seed" --to /tmp/seed-store --max-file-bytes 4M
            tar -czf "$files"/store-seed.tar.gz -C /tmp/seed-store .
        fi
    fi
    # Each call carries its part beside the working tree (the tracked files: the committed
    # results too), 64 MiB in all: the model is cut to what one call has room for,
    # then the largest files first into the first part with room (the fewest calls).
    tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
    room=$(( 63 * 1024 * 1024 - tree ))
    [ $room -gt $((8 * 1024 * 1024)) ] || { echo "the working tree ($tree bytes) leaves under 8 MiB a call" >&2; exit 1; }
    split -b $room -d -a 2 .assets/SmolLM2-135M-Instruct.Q4_1.gguf "$files"/gguf.part-
    python3 - "$files" "$pack" $room <<'PY'
import os, shutil, sys
files, pack, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
def size(p):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs) if os.path.isdir(p) else os.path.getsize(p)
items = sorted(os.listdir(files), key=lambda n: -size(os.path.join(files, n)))
parts = []
for name in items:
    n = size(os.path.join(files, name))
    if n > room:
        sys.exit(f"{name} ({n} bytes) is over what one call has room for ({room})")
    for part in parts:
        if part[0] + n <= room:
            part[0] += n; part[1].append(name); break
    else:
        parts.append([n, [name]])
for i, (n, names) in enumerate(parts, 1):
    os.makedirs(os.path.join(pack, str(i)))
    for name in names:
        shutil.move(os.path.join(files, name), os.path.join(pack, str(i), name))
    print(f"{pack}/{i}: {n} bytes: {' '.join(sorted(names))}")
PY
    rmdir "$files"
    echo "the working tree: $tree bytes; carry each part in turn (\".gpu/1\", ...) with \`stash\`, the last with \`setup\`"
    ;;
keep-drafter)
    # Here: archive an exported drafter folder (config.json + model.safetensors, and its
    # training.json / metrics when given), or a seed (its store-small.tar.gz), in main's
    # history: one commit adds it at bench/results/drafters/NAME/, the next removes it from the
    # tree and records that commit in bench/drafters.tsv, where `scripts/fetch-assets` finds it
    # (into .assets/drafters/NAME/). Only main lands: a branch of its own was lost once.
    dir=${1:?an exported drafter folder}
    name=${2:?a name, e.g. smollm2-2800}
    cut -f1 bench/drafters.tsv | grep -qx "$name" &&
        { echo "drafters:$name exists; drafters are never replaced: choose another name" >&2; exit 1; }
    git diff --cached --quiet || { echo "the index has staged changes: commit them first" >&2; exit 1; }
    mkdir -p bench/results/drafters/$name
    # The folder's files, and its drafter/'s when it is an export (`promote`'s trained/).
    for f in "$dir"/* "$dir"/drafter/*; do
        if [ -f "$f" ]; then cp "$f" bench/results/drafters/$name/; fi
    done
    git add -f bench/results/drafters/$name
    git commit -q -m "drafters: $name, kept in history (removed from the tree in the next commit)"
    mkdir -p .assets/drafters
    [ -e .assets/drafters/$name ] || cp -r bench/results/drafters/$name .assets/drafters/$name
    printf '%s\t%s\t%s\n' "$name" "$(git rev-parse HEAD)" "bench/results/drafters/$name" >> bench/drafters.tsv
    git rm -r -q bench/results/drafters/$name
    git add bench/drafters.tsv
    git commit -q -m "drafters: $name out of the tree; bench/drafters.tsv says where it is"
    tail -1 bench/drafters.tsv
    ;;
stash)
    # There: keep what this call carried (the working tree's .gpu/ is replaced by the next call).
    mkdir -p $STASH
    for d in .gpu/*/; do cp -r "$d". $STASH/; done
    ls -la $STASH
    ;;
setup)
    # There: the model, ShareGPT and the benchmark sets in .assets/, the binary in /tmp.
    mkdir -p $STASH/assets
    [ -f $STASH/assets/SmolLM2-135M-Instruct.Q4_1.gguf ] ||
        cat $STASH/gguf.part-* > $STASH/assets/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f $STASH/assets/sharegpt.json ] || xz -dc $STASH/sharegpt.json.xz > $STASH/assets/sharegpt.json
    cp -n $STASH/HumanEval.jsonl.gz $STASH/gsm8k.jsonl $STASH/mt-bench.jsonl $STASH/assets/
    [ -x $STASH/dflash ] || { xz -dc $STASH/dflash.xz > $STASH/dflash && chmod +x $STASH/dflash; }
    unpack_probe
    # The reference package and gguf, into the stash (a plain `pip install` there left `gguf`
    # unimportable once); `reference` puts them on PYTHONPATH.
    ls $STASH/*.whl >/dev/null 2>&1 && pip install -q --no-deps --target $STASH/site $STASH/*.whl || true
    if [ -d $STASH/init ] && [ ! -d $STASH/assets/smollm2-drafter ]; then
        cp -r $STASH/init $STASH/assets/smollm2-drafter
    fi
    # An earlier session's store objects (content-addressed: the stages they hold are cached).
    if [ -f $STASH/store-seed.tar.gz ] && [ ! -d $STORE/manifests ]; then
        mkdir -p $STORE && tar -xzf $STASH/store-seed.tar.gz -C $STORE && du -sh $STORE
    fi
    rm -rf .assets && ln -s $STASH/assets .assets
    sha256sum .assets/SmolLM2-135M-Instruct.Q4_1.gguf
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    ;;
run)
    # There: run the pipeline for at most SECONDS, then Ctrl-C (what is committed stays).
    secs=${1:?seconds}
    shift
    cuda_env
    pipe=$(story_pipeline)
    timeout -s INT -k 20 "$secs" $STASH/dflash run $pipe --store $STORE "$@" || echo "run stopped: exit $?"
    $STASH/dflash plan $pipe --store $STORE || true
    ;;
smoke)
    # There: the same pipeline, small (256 prompts, 40 training steps, 4 prompts per set), into
    # its own store: the speeds that size the real run, and any failure before it costs much.
    # HEAD=dflash2 trains a DFlash 2 drafter instead.
    cuda_env
    sed -e 's/total: [0-9]*/total: 256/' -e 's/limit: 12000/limit: 600/' \
        -e 's/max_steps: [0-9]*/max_steps: 40/' \
        -e 's/prompts: [0-9]* .*/prompts: 4/' \
        -e "s/      draft_layers: 3/      head: ${HEAD:-dflash}\n      draft_layers: 3/" pipelines/smollm2.yaml > pipelines/smoke.yaml
    timeout -s INT -k 20 "${1:-300}" $STASH/dflash run pipelines/smoke.yaml --store $STASH/smoke || echo "smoke stopped: exit $?"
    # Each stage's figures (not the per-step curves): the speeds that size the real run.
    python3 - $STASH/smoke <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/manifests/*.json")):
    m = json.load(open(f))
    st = {k: v for k, v in m.get("stats", {}).items() if k not in ("steps", "curve", "histogram")}
    print(m["fingerprint"]["kind"], json.dumps(st)[:1500])
PY
    rm pipelines/smoke.yaml
    ;;
train-speed)
    # There, after `smoke` (its store holds the tokens): the training step with the target
    # stacked per micro-batch (batch_size 8) against the same 8 sequences a step one at a time
    # (batch_size 1, grad_accum 8), 5 and 45 steps each; the difference over 40 steps is the
    # step time without loading and start-up.
    cuda_env
    for cfg in "stacked|batch_size: 8" "alone|batch_size: 1\n      grad_accum: 8"; do
        name=${cfg%%|*}
        for steps in 5 45; do
            sed -e 's/total: [0-9]*/total: 256/' -e 's/limit: 12000/limit: 600/' \
                -e "s/max_steps: [0-9]*/max_steps: $steps/" -e "s/      batch_size: 16 .*/      ${cfg#*|}/" \
                -e 's/epochs: 4/epochs: 40/' pipelines/smollm2.yaml > pipelines/speed.yaml
            $STASH/dflash run pipelines/speed.yaml --store $STASH/smoke --only drafter --json > /tmp/speed.json
            python3 -c "import json;d=json.load(open('/tmp/speed.json'));print('$name', $steps, 'steps:', [s['seconds'] for s in d['stages'] if s['id']=='drafter'][0], 's')"
        done
    done
    rm -f pipelines/speed.yaml
    ;;
train-fit)
    # There: time 12 training steps of STAGE (default `drafter`; a scratch copy of the pipeline,
    # same data), then train it with `max_steps` set to what fits in SECONDS less the load and
    # the export; resumes as `run`. Every `max_steps:` of the pipeline gets the value, so fitting
    # the slower head (`drafter2`) first gives both drafters the same steps.
    secs=${1:?seconds}
    stage=${2:-drafter}
    cuda_env
    t0=$(date +%s)
    timeout -s INT -k 20 "$secs" $STASH/dflash run $(story_pipeline) --store $STORE --only tokens --only tokens_more || true
    probe() {
        sed -e "s/max_steps: [0-9]*/max_steps: $1/" -e 's/checkpoint_every: [0-9]*/checkpoint_every: 100000/' \
            $(story_pipeline) > pipelines/probe.yaml
        $STASH/dflash run pipelines/probe.yaml --store $STASH/probe-$1 --only $stage --json 2>/dev/null |
            python3 -c "import json,sys;d=json.load(sys.stdin);print([s['seconds'] for s in d['stages'] if s['id']=='$stage'][0])"
    }
    # The probes' upstream stages are the pipeline's: copy the store so they are cached.
    cp -r $STORE $STASH/probe-4 && cp -r $STORE $STASH/probe-16
    # 16 steps first: the first run on a fresh machine also pays one-time costs (the kernels'
    # loading, the page cache), which made 4 steps look slower than 16 once (67,390 steps
    # chosen for 400 s). Paid by the 16-step probe, they overstate the step: the safe side.
    b=$(probe 16) && a=$(probe 4)
    rm -rf pipelines/probe.yaml $STASH/probe-4 $STASH/probe-16
    left=$(( secs - ($(date +%s) - t0) ))
    steps=$(python3 -c "d=($b-$a)/12; s=d if d>0.005 else $b/16; f=max($a-4*s, 0); print(max(1, int(($left - 2*f - 20) / s)))")
    echo "probe ($stage): 4 steps $a s, 16 steps $b s; $left s left: max_steps $steps" | tee -a "$OUT/train-fit.txt"
    # The story's two drafters (between `drafter:` and `bench:`), not the sweep's.
    sed -i "/^  drafter:/,/^  bench:/ s/max_steps: [0-9]*/max_steps: $steps/" pipelines/smollm2.yaml
    cp pipelines/smollm2.yaml "$OUT/smollm2.yaml"
    timeout -s INT -k 20 "$left" $STASH/dflash run $(story_pipeline) --store $STORE --only $stage || echo "run stopped: exit $?"
    ;;
hybrid)
    # There: a hybrid target's forward at Qwen3.5-27B's layer widths (LAYERS layers, TOKENS
    # tokens), dflash (bf16, `train_probe target`) against transformers (bf16) on the GPU, every
    # layer's output compared; twice: transformers with the flash-linear-attention kernels, and
    # with its own PyTorch Gated DeltaNet (HYBRID_RUNS="1 0"; the default, "1", runs the
    # peer's fastest form alone). Needs `train_probe` in the pack (`c`).
    cuda_env
    for with_fla in ${HYBRID_RUNS:-1}; do
        site=""; [ $with_fla = 1 ] && site=$STASH/site
        PYTHONPATH=$site python3 bench/hybrid_forward.py --device cuda --check --probe $STASH/train_probe \
            --layers "${1:-4}" --tokens "${2:-2048}" --repeats 5 | tee -a "$OUT/hybrid_forward.jsonl"
    done
    ;;
hybrid-decode)
    # There: a hybrid target's batched decoding (LAYERS layers at Qwen3.5-27B's widths, BATCHES
    # comma-separated, PROMPT tokens, STEPS steps), dflash (`train_probe decode`, bf16) against
    # transformers' `generate` (bf16, flash-linear-attention's kernels from the stash), same call.
    cuda_env
    PYTHONPATH=$STASH/site python3 bench/hybrid_decode.py --device cuda --probe $STASH/train_probe \
        --layers "${1:-4}" --batch "${2:-1,8,64}" --prompt "${3:-300}" --steps "${4:-16}" \
        2>&1 | grep -v Warning | tee -a "$OUT/hybrid_decode.jsonl"
    ;;
decode)
    # There: generate's batched decoding (the candle backend) against transformers' `generate`
    # on the same shapes (BATCH prompts of PROMPT tokens, STEPS steps), same call.
    cuda_env
    # gguf (the conversion's reader) is in the stash's site folder, as for `reference`.
    [ -d $STASH/hf ] || PYTHONPATH=$STASH/site python3 tests/support/gguf_to_hf.py \
        .assets/SmolLM2-135M-Instruct.Q4_1.gguf $STASH/hf
    {
        $STASH/train_probe decode .assets/SmolLM2-135M-Instruct.Q4_1.gguf --batch "${1:-512}" \
            --prompt "${2:-300}" --steps "${3:-32}"
        python3 bench/decode_reference.py $STASH/hf --batch "${1:-512}" --prompt "${2:-300}" \
            --steps "${3:-32}"
    } 2>&1 | grep -v Warning | tee -a "$OUT/decode.jsonl"
    ;;
verify)
    # There: a speculative round's verification pass against a one-token step on this GPU
    # (`train_probe verify`: the target over 1-32 tokens after a CONTEXT-token cache, with and
    # without taps, as a tree, and one projection's matmul over the same rows in f32 and bf16):
    # the ratio that sets a drafter's break-even tau on a small target.
    cuda_env
    $STASH/train_probe verify .assets/SmolLM2-135M-Instruct.Q4_1.gguf --context "${1:-300}" 2>&1 |
        tee -a "$OUT/verify.jsonl"
    ;;
round)
    # There: where a speculative round's time goes (`train_probe round`): the stash's drafter
    # (INIT, in .assets/smollm2-drafter) on the target after a CONTEXT-token prompt, NEW tokens,
    # autoregressive, prompt lookup, chain and tree (64 of 8), each timed as `bench` times it
    # and then per phase, the device synchronised at each phase's end.
    cuda_env
    $STASH/train_probe round .assets/SmolLM2-135M-Instruct.Q4_1.gguf .assets/smollm2-drafter \
        --context "${1:-300}" --new "${2:-128}" --budget 64,128 2>&1 | tee -a "$OUT/round.jsonl"
    ;;
reference)
    # There, after `bring-back`: the exported drafter in z-lab's reference implementation
    # (dflash==0.1.0) against the target as a transformers model, on the first N prompts of
    # each set that bench decoded, and its speed beside ours (`--speed`: the reference's
    # autoregressive form times the baseline, as its own harness does); its figures go to
    # $OUT/reference_check.txt.
    cuda_env
    export PYTHONPATH=$STASH/site${PYTHONPATH:+:$PYTHONPATH}
    [ -d $STASH/hf ] || python3 tests/support/gguf_to_hf.py .assets/SmolLM2-135M-Instruct.Q4_1.gguf $STASH/hf
    python3 bench/reference_check.py $STASH/hf /tmp/back/drafter/drafter /tmp/back/bench \
        --limit "${1:-6}" --stop 2 --speed 2>&1 | tee "$OUT/reference_check.txt"
    ;;
dflash)
    cuda_env
    $STASH/dflash "$@"
    ;;
probe)
    # There: `train_probe ARGS` (the fused kernels against the CPU: `probe fused`; a step's
    # time: `probe speed --preset smollm2 --head dflash2 ...`).
    cuda_env
    $STASH/train_probe "$@"
    ;;
flash)
    # There: the drafter's block attention (issue 22): the build's flash PTX checked against
    # autograd in f64 (both dK/dV kernels, the pipelined one bit for bit equal to the staged
    # one), timed beside SDPA and FlexAttention under torch.compile; the fused kernels against
    # their references; the step against PyTorch in f32; then the training step with the
    # attention kernels of before the fifteenth call and as `train` runs it beside eager
    # and compiled PyTorch (FLEX=flex: eager FlexAttention too), each with its peak memory by
    # nvidia-smi.
    # Needs only flash.ptx and train_probe.xz stashed (a one-part pack of its own, no `setup`):
    # cuda_env points .assets at the stash's, which may not exist yet.
    unpack_probe
    mkdir -p $STASH/assets
    cuda_env
    # Each line runs whatever the one before did (a failing kernel must not hide the others).
    {
        python3 bench/flash_reference.py check $STASH/flash.ptx || echo "check failed: $?"
        python3 bench/flash_reference.py speed $STASH/flash.ptx --anchors 512 || echo "speed failed: $?"
        python3 bench/flash_reference.py wg $STASH/flash.ptx || echo "wg failed: $?"
        python3 bench/flash_reference.py wgv $STASH/flash.ptx || echo "wgv failed: $?"
        python3 bench/flash_reference.py dqwg $STASH/flash.ptx || echo "dqwg failed: $?"
        $STASH/train_probe flash || echo "train_probe flash failed: $?"
        DFLASH_FLASH_FORWARD=wide $STASH/train_probe flash || echo "train_probe flash (wide) failed: $?"
        DFLASH_FLASH_DQ=wg $STASH/train_probe flash || echo "train_probe flash (wgmma dQ) failed: $?"
        $STASH/train_probe fused || echo "train_probe fused failed: $?"
        $STASH/train_probe parity /tmp/parity.safetensors &&
            python3 bench/train_reference.py parity /tmp/parity.safetensors || echo "parity failed: $?"
        wide_forward_step
        step_against_pytorch ${FLEX:-}
    } 2>&1 | grep -v Warning | tee "$OUT/flash.txt"
    python3 bench/step_ratio.py "$OUT/flash.txt" | tee -a "$OUT/flash.txt"
    ;;
wgmma)
    # There: the wgmma kernels alone, as few seconds as they need (a call with little device
    # time left): each checked against autograd and timed in its own process
    # (`flash_reference.py wg`, `wgv`: the causal forwards, `wgv` block mode's too; `dqwg`:
    # block mode's dQ; `dkvwg`: its dK/dV), block mode's forward, dQ and dK/dV through the
    # model's entry points, AdamW's kernels (bf16 moments among them) against the CPU, then the
    # step as `train` runs it (the causal forward on wgmma since the sixteenth call), the same
    # with bf16 moments, with the wgmma dQ, block forward and dK/dV each where its check passed,
    # with all that passed and bf16 moments, and compiled PyTorch's (NO_TORCH=1: not). Needs
    # only flash.ptx and train_probe.xz stashed.
    unpack_probe
    mkdir -p $STASH/assets
    cuda_env
    {
        for kind in wg wgv dqwg dkvwg; do
            python3 bench/flash_reference.py $kind $STASH/flash.ptx | tee /tmp/$kind.txt ||
                echo "$kind failed: $?"
        done
        DFLASH_FLASH_FORWARD=wgv DFLASH_FLASH_DQ=wg DFLASH_FLASH_DKV=wg $STASH/train_probe flash ||
            echo "train_probe flash (wgmma block forward, dQ and dK/dV) failed: $?"
        $STASH/train_probe fused | grep 'adamw' || echo "train_probe fused failed: $?"
        echo '{"phase": "label", "name": "dflash, as train runs it"}'
        peak_memory $STASH/train_probe speed --anchors 512 || echo "speed failed: $?"
        echo '{"phase": "label", "name": "dflash, AdamW moments in bf16"}'
        peak_memory $STASH/train_probe speed --anchors 512 --moments bf16 || echo "speed (bf16 moments) failed: $?"
        # The step with the wgmma dQ and block forward only where their checks passed (a wrong
        # kernel's time says nothing).
        if grep -q '"pass": true' /tmp/dqwg.txt; then
            echo '{"phase": "label", "name": "dflash, DFLASH_FLASH_DQ=wg"}'
            DFLASH_FLASH_DQ=wg peak_memory $STASH/train_probe speed --anchors 512 ||
                echo "speed (DFLASH_FLASH_DQ=wg) failed: $?"
        fi
        if grep -q '"wgv_block_worst".*"pass": true' /tmp/wgv.txt; then
            echo '{"phase": "label", "name": "dflash, DFLASH_FLASH_FORWARD=wgv (block mode too)"}'
            DFLASH_FLASH_FORWARD=wgv peak_memory $STASH/train_probe speed --anchors 512 ||
                echo "speed (DFLASH_FLASH_FORWARD=wgv) failed: $?"
        fi
        if grep -q '"wg_dkv_worst".*"pass": true' /tmp/dkvwg.txt; then
            echo '{"phase": "label", "name": "dflash, DFLASH_FLASH_DKV=wg"}'
            DFLASH_FLASH_DKV=wg peak_memory $STASH/train_probe speed --anchors 512 ||
                echo "speed (DFLASH_FLASH_DKV=wg) failed: $?"
        fi
        # Every wgmma kernel whose check passed, with bf16 moments: what the defaults would be.
        all=()
        grep -q '"pass": true' /tmp/dqwg.txt && all+=(DFLASH_FLASH_DQ=wg)
        grep -q '"wgv_block_worst".*"pass": true' /tmp/wgv.txt && all+=(DFLASH_FLASH_FORWARD=wgv)
        grep -q '"wg_dkv_worst".*"pass": true' /tmp/dkvwg.txt && all+=(DFLASH_FLASH_DKV=wg)
        if [ ${#all[@]} -gt 1 ]; then
            echo "{\"phase\": \"label\", \"name\": \"dflash, ${all[*]}, AdamW moments in bf16\"}"
            (export "${all[@]}"; peak_memory $STASH/train_probe speed --anchors 512 --moments bf16) ||
                echo "speed (${all[*]}, bf16 moments) failed: $?"
        fi
        [ -n "${NO_TORCH:-}" ] ||
            peak_memory python3 bench/train_reference.py speed --anchors 512 --attention flex \
                --compile --steps 6 --warmup 3 || echo "speed (PyTorch, compiled) failed: $?"
    } 2>&1 | grep -v Warning | tee "$OUT/wgmma.txt"
    [ -n "${NO_TORCH:-}" ] || python3 bench/step_ratio.py "$OUT/wgmma.txt" | tee -a "$OUT/wgmma.txt"
    ;;
step)
    # There: the step's comparison alone (issue 22; what `flash` ends with, without the flash
    # checks): the elementwise kernels against their CPU forms, the step with the attention
    # kernels of before the fifteenth call and as `train` runs it, eager
    # PyTorch and PyTorch compiled with FlexAttention, each with its peak memory, and the
    # ratios. Needs only train_probe.xz stashed.
    unpack_probe
    mkdir -p $STASH/assets
    cuda_env
    {
        $STASH/train_probe fused | grep 'adamw\|head_rows\|swiglu\|strided\|rms_norm\|sum_squares\|"add_' ||
            echo "train_probe fused failed: $?"
        earlier_kernels_step
        wide_forward_step
        step_against_pytorch
    } 2>&1 | grep -v Warning | tee "$OUT/step.txt"
    python3 bench/step_ratio.py "$OUT/step.txt" | tee -a "$OUT/step.txt"
    ;;
flash-profile)
    # There: each flash kernel once at the step's shapes under ncu (flash_reference.py `once`):
    # its time, what bounds it (speed of light: tensor pipe, shared memory, L2, DRAM),
    # occupancy and where its warps stall. Needs only flash.ptx stashed.
    ncu --kernel-name regex:flash --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python3 bench/flash_reference.py once $STASH/flash.ptx --anchors 512 2>&1 | grep -v Warning |
        tee "$OUT/flash-profile.txt"
    ;;
profile)
    # There: one training step's kernels (ncu, step 2 alone: `--profile-step`), dflash's and
    # eager PyTorch's (given `dflash`, dflash's alone; given `compiled`, torch.compile's with
    # FlexAttention too), each summed
    # by kernel family and kind by bench/kernel_profile.py against the step's unprofiled time.
    unpack_probe
    mkdir -p $STASH/assets
    cuda_env
    prof() {  # LABEL REPORT -- COMMAND...: time it unprofiled, then profile its step 2
        local label=$1 rep=$2
        shift 3
        local ms
        ms=$("$@" --steps 4 | tee -a "$OUT/profile-runs.txt" | python3 -c 'import json,sys
rows=[json.loads(l) for l in sys.stdin if l.startswith("{")]
print([r for r in rows if r.get("phase")=="summary"][-1]["total_ms"])')
        ncu --profile-from-start off --clock-control none --cache-control none \
            --metrics gpu__time_duration.sum -f -o $rep "$@" --steps 3 --profile-step 2 >/dev/null 2>&1 ||
            echo "ncu $label failed: $?"
        python3 bench/kernel_profile.py $rep.ncu-rep --label "$label" --step-ms "$ms"
    }
    {
        prof "dflash (train_probe speed)" /tmp/prof-dflash -- $STASH/train_probe speed --anchors 512
        [ "${1:-}" = dflash ] && exit 0
        prof "PyTorch eager (SDPA)" /tmp/prof-torch -- python3 bench/train_reference.py speed --anchors 512
        if [ "${1:-}" = compiled ]; then
            prof "PyTorch compiled (FlexAttention)" /tmp/prof-compiled -- python3 bench/train_reference.py \
                speed --anchors 512 --attention flex --compile --warmup 2
        fi
    } 2>&1 | grep -v Warning | tee -a "$OUT/profile.txt"
    ;;
profile-phases)
    # There: where the step's time with no kernel running is (issue 22: 17 ms of 235 at the
    # sixteenth call): dflash's step timed unprofiled (each phase's mean, synced apart), then
    # each phase of step 2 profiled alone (`--profile-phase`), its kernels summed by
    # bench/kernel_profile.py against that phase's time: the idle of the target's forward, the
    # drafter's forward + backward and AdamW apart. Needs only train_probe.xz stashed.
    unpack_probe
    mkdir -p $STASH/assets
    cuda_env
    {
        means=$($STASH/train_probe speed --anchors 512 --steps 4 | tee -a "$OUT/profile-runs.txt" |
            python3 -c 'import json,sys
rows=[json.loads(l) for l in sys.stdin if l.startswith("{")]
s=[r for r in rows if r.get("phase")=="summary"][-1]
print(s["target_ms"], s["drafter_ms"], s["optim_ms"])')
        read -r target_ms drafter_ms optim_ms <<< "$means"
        for phase in target drafter optim; do
            ms_var=${phase}_ms
            ncu --profile-from-start off --clock-control none --cache-control none \
                --metrics gpu__time_duration.sum -f -o /tmp/prof-$phase $STASH/train_probe speed \
                --anchors 512 --steps 3 --profile-step 2 --profile-phase $phase >/dev/null 2>&1 ||
                echo "ncu $phase failed: $?"
            python3 bench/kernel_profile.py /tmp/prof-$phase.ncu-rep --label "dflash, the $phase phase" \
                --step-ms "${!ms_var}"
        done
    } 2>&1 | grep -v Warning | tee -a "$OUT/profile-phases.txt"
    ;;
checks)
    # There: the training kernels on this GPU (issue 22), before anything trains with them:
    # every fused op against its CPU form, the flash kernels, the step against PyTorch in f32
    # (through the chunked LM head), where the step's time goes (the chunked head beside the
    # whole-logits one), and the step's speed beside the plain-PyTorch step, same call.
    cuda_env
    {
        $STASH/train_probe fused
        $STASH/train_probe flash
        $STASH/train_probe parity /tmp/parity.safetensors &&
            python3 bench/train_reference.py parity /tmp/parity.safetensors
        $STASH/train_probe parts --anchors 512
        echo '{"phase": "label", "name": "dflash, as train runs it"}'
        peak_memory $STASH/train_probe speed --anchors 512
        peak_memory python3 bench/train_reference.py speed --anchors 512
    } 2>&1 | tee "$OUT/checks.txt"
    python3 bench/step_ratio.py "$OUT/checks.txt" | tee -a "$OUT/checks.txt"
    ;;
promote)
    # There, once `run --only drafter` has finished: the trained drafter (weights, config,
    # training.json and metrics; not the checkpoints) to $OUT/trained.tar.gz.NN (15 MiB pieces)
    # for `keep-drafter` here, and in place of the stash's .assets/smollm2-drafter, so
    # PIPE=pipelines/smollm2-full.yaml (or smollm2-bench.yaml) benches it in the same session.
    cuda_env
    rm -rf /tmp/trained
    $STASH/dflash export drafter -p $(story_pipeline) --store $STORE /tmp/trained \
        --files 'drafter/*' --files '*.json*'
    tar -czf - -C /tmp trained | split -b 15M -d - "$OUT/trained.tar.gz."
    cp /tmp/trained/drafter/config.json /tmp/trained/drafter/model.safetensors $STASH/assets/smollm2-drafter/
    sha256sum $STASH/assets/smollm2-drafter/model.safetensors
    ;;
bring-back)
    # There: the store's whole artifacts whose files are each under 4 MB (`dflash copy`:
    # manifests, run records, finished shards, metrics, results, the completions: commit `store-small.tar.gz` to bench/results/ so a
    # later session seeds its store with it, `pack-inputs ... SEED`, instead of generating
    # again), the drafters and the bench artifacts exported, the run's report, under $OUT in
    # 15 MiB pieces.
    cuda_env
    rm -rf /tmp/back && mkdir -p /tmp/back
    # (pipelines/smollm2-full.yaml's benches are one per set.)
    # The drafters without their checkpoints (weights and both moments, each): the exported
    # weights and metrics.
    for s in drafter drafter2; do
        $STASH/dflash export $s -p $(story_pipeline) --store $STORE /tmp/back/$s \
            --files 'drafter/*' --files '*.json*' 2>/dev/null || true
    done
    for s in bench bench_dflash2 bench_humaneval bench_gsm8k bench_mt_bench \
        bench16_humaneval bench16_gsm8k bench16_mt_bench bench16_mt_bench_256; do
        $STASH/dflash export $s -p $(story_pipeline) --store $STORE /tmp/back/$s 2>/dev/null || true
    done
    $STASH/dflash report latest --store $STORE -o /tmp/back/report.html || true
    rm -rf /tmp/small-store
    $STASH/dflash copy --from $STORE --to /tmp/small-store --max-file-bytes 4M
    tar -czf /tmp/back/store-small.tar.gz -C /tmp/small-store .
    # What is worth committing as a later session's SEED: the completions (GPU minutes to make
    # again) and the bench artifacts; the tokens remake from them in seconds.
    rm -rf /tmp/seed-store
    for s in completions completions_more bench bench_dflash2 bench_humaneval bench_gsm8k bench_mt_bench \
        bench16_humaneval bench16_gsm8k bench16_mt_bench bench16_mt_bench_256; do
        $STASH/dflash copy --from $STORE --to /tmp/seed-store --stage $s --max-file-bytes 4M >/dev/null || true
    done
    tar -czf /tmp/back/seed.tar.gz -C /tmp/seed-store .
    tar -czf - -C /tmp back | split -b 15M -d - "$OUT/back.tar.gz."
    ls -la "$OUT"
    ;;
*)
    echo "usage: bench/gpu/story.sh pack-inputs BIN PACK [INIT|drafters:NAME [SEED]] | keep-drafter DIR NAME | stash | setup | smoke SECONDS | train-speed | run SECONDS | train-fit SECONDS [STAGE] | checks | flash | step | profile [dflash|compiled] | hybrid [LAYERS] [TOKENS] | hybrid-decode [LAYERS] [BATCHES] [PROMPT] [STEPS] | decode [BATCH] [PROMPT] [STEPS] | verify [CONTEXT] | round [CONTEXT] [NEW] | dflash ARGS | probe ARGS | promote | bring-back | reference [N]" >&2
    exit 2
    ;;
esac
