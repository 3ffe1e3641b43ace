#!/usr/bin/env bash
# Runs pipelines/smollm2.yaml on the GPU machine (the `device` tool: no Rust, no network, 64 MiB
# carried per call, everything forgotten once the machine goes idle). The data flow:
#   - here, `bench/gpu/story.sh pack-inputs` puts into .gpu/ (ignored by git): the CUDA build of
#     dflash (xz), the SmolLM2 GGUF split in two (98 MB is over one call's 64 MiB) and ShareGPT (xz);
#   - call 1 carries .gpu/ with the binary and the GGUF's first part and runs `stash`; call 2,
#     made while the machine is still warm, carries the rest and runs `stash` then `setup`;
#   - `run SECONDS` runs the pipeline into a store under /tmp (kept while the machine is warm)
#     and stops it with Ctrl-C (SIGINT) before the call's limit: generate and train commit
#     shards as they go, so the next call's `run` resumes where this one stopped;
#   - `bring-back` copies the store's results (manifests, metrics, bench results, the drafter,
#     the run records, zstd) under $OUT, so they land on this machine.
set -euo pipefail
STASH=/tmp/dflash-story
STORE=$STASH/store
cmd=${1:-}
shift || true
# PyTorch's CUDA 13 libraries (cuBLAS, ...) for the binary, and .assets/ pointing at the stash.
cuda_env() {
    local lib
    lib=$(python3 -c "import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],'cu13','lib'))")
    export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
    rm -rf .assets && ln -s $STASH/assets .assets
}
case $cmd in
pack-inputs)
    # Here: fill .gpu/ from a CUDA build and .assets/.
    bin=${1:?the CUDA build of dflash}
    mkdir -p .gpu/a .gpu/b .gpu/c
    strip -o /tmp/dflash-cuda "$bin" && xz -T2 -6 -c /tmp/dflash-cuda > .gpu/a/dflash.xz
    split -n 2 -d .assets/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/gguf.part-
    mv /tmp/gguf.part-00 .gpu/a/ && mv /tmp/gguf.part-01 .gpu/b/
    xz -T2 -6 -c .assets/sharegpt.json > .gpu/c/sharegpt.json.xz
    cp .assets/HumanEval.jsonl.gz .assets/gsm8k.jsonl .assets/mt-bench.jsonl .gpu/a/
    du -sb .gpu/a .gpu/b .gpu/c
    ;;
stash)
    # There: keep what this call carried (the working tree's .gpu/ is replaced by the next call).
    mkdir -p $STASH
    for d in .gpu/*/; do cp -r "$d". $STASH/; done
    [ -d $STASH/a ] && mv $STASH/a/* $STASH/ && rmdir $STASH/a
    ls -la $STASH
    ;;
setup)
    # There: the model, ShareGPT and the benchmark sets in .assets/, the binary in /tmp.
    mkdir -p $STASH/assets
    [ -f $STASH/assets/SmolLM2-135M-Instruct.Q4_1.gguf ] ||
        cat $STASH/gguf.part-00 $STASH/gguf.part-01 > $STASH/assets/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f $STASH/assets/sharegpt.json ] || xz -dc $STASH/sharegpt.json.xz > $STASH/assets/sharegpt.json
    cp -n $STASH/HumanEval.jsonl.gz $STASH/gsm8k.jsonl $STASH/mt-bench.jsonl $STASH/assets/
    [ -x $STASH/dflash ] || { xz -dc $STASH/dflash.xz > $STASH/dflash && chmod +x $STASH/dflash; }
    rm -rf .assets && ln -s $STASH/assets .assets
    sha256sum .assets/SmolLM2-135M-Instruct.Q4_1.gguf
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    ;;
run)
    # There: run the pipeline for at most SECONDS, then Ctrl-C (what is committed stays).
    secs=${1:?seconds}
    shift
    cuda_env
    timeout -s INT -k 20 "$secs" $STASH/dflash run pipelines/smollm2.yaml --store $STORE "$@" || echo "run stopped: exit $?"
    $STASH/dflash plan pipelines/smollm2.yaml --store $STORE || true
    ;;
smoke)
    # There: the same pipeline, small (256 prompts, 40 training steps, 4 prompts per set), into
    # its own store: the speeds that size the real run, and any failure before it costs much.
    cuda_env
    sed -e 's/total: 2400/total: 256/' -e 's/limit: 12000/limit: 600/' \
        -e 's/max_steps: 1400/max_steps: 40/' \
        -e 's/prompts: 24 .*/prompts: 4/' pipelines/smollm2.yaml > pipelines/smoke.yaml
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
            sed -e 's/total: 2400/total: 256/' -e 's/limit: 12000/limit: 600/' \
                -e "s/max_steps: 1400/max_steps: $steps/" -e "s/      batch_size: 8/      ${cfg#*|}/" \
                -e 's/epochs: 4/epochs: 40/' pipelines/smollm2.yaml > pipelines/speed.yaml
            $STASH/dflash run pipelines/speed.yaml --store $STASH/smoke --only drafter --json > /tmp/speed.json
            python3 -c "import json;d=json.load(open('/tmp/speed.json'));print('$name', $steps, 'steps:', [s['seconds'] for s in d['stages'] if s['id']=='drafter'][0], 's')"
        done
    done
    rm -f pipelines/speed.yaml
    ;;
dflash)
    cuda_env
    $STASH/dflash "$@"
    ;;
bring-back)
    # There: the store's small files (manifests, run records, shard lists, metrics, results),
    # the drafter and the bench artifact exported, the run's report, under $OUT in 15 MiB pieces.
    cuda_env
    rm -rf /tmp/back && mkdir -p /tmp/back
    for s in drafter bench; do
        $STASH/dflash export $s -p pipelines/smollm2.yaml --store $STORE /tmp/back/$s || true
    done
    # Not the checkpoints (weights and both moments, each): the exported weights and metrics.
    find /tmp/back/drafter -mindepth 1 -maxdepth 1 ! -name drafter ! -name '*.json*' -exec rm -rf {} + || true
    $STASH/dflash report latest --store $STORE -o /tmp/back/report.html || true
    (cd $STORE && find . -type f -size -2M | sort) > /tmp/small.txt
    tar -czf /tmp/back/store-small.tar.gz -C $STORE -T /tmp/small.txt
    tar -czf - -C /tmp back | split -b 15M -d - "$OUT/back.tar.gz."
    ls -la "$OUT"
    ;;
*)
    echo "usage: bench/gpu/story.sh pack-inputs BIN | stash | setup | smoke SECONDS | train-speed | run SECONDS | dflash ARGS | bring-back" >&2
    exit 2
    ;;
esac
