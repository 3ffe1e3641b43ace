"""A hybrid target's forward, dflash against transformers, same machine, same weights, same call.

Writes a Qwen3.5 text model at a real layer shape (Qwen3.5-27B's widths: hidden 5120, MLP
17408, 24 attention heads of 256 with 4 KV heads, Gated DeltaNet with 16 key heads and 48 value
heads of 128) with LAYERS layers alternating Gated DeltaNet and attention as 27B does (three of
one, then one of the other), a small vocabulary (the layers are what is measured), random weights
(numpy); then times one forward over TOKENS tokens, every layer, no cache:
- transformers 5.24's `Qwen3_5ForCausalLM.model` under `torch.no_grad()`: on CPU in f32 (its own
  chunked Gated DeltaNet in PyTorch, torch's threads = this machine's cores); with `--device
  cuda` in bf16 on the GPU, with the flash-linear-attention kernels where that package imports
  (the output says which ran: `transformers_delta`), else its PyTorch path;
- dflash's `Target::tapped` over all layers (`train_probe target`, a release build of the
  `dflash-model` example; f32 on CPU, bf16 on a GPU, as `train` loads a target).
Each is warmed up once and timed REPEATS times; prints the medians and their ratio. `--check`
also compares every layer's output (transformers' from forward hooks, dflash's from `train_probe
target --dump`): the largest difference relative to the layer's largest value, and the mean;
on a GPU it also measures both bf16 forwards against transformers in f32 (TF32 off, its
PyTorch Gated DeltaNet, in a child process), so a difference between the two says whose it is.

    cargo build --release -p dflash-model --features nn --example train_probe
    python3 bench/hybrid_forward.py [--layers 2] [--tokens 256] [--repeats 3] [--device cuda] [--check]

Needs torch (`pip install --target DIR torch`, then PYTHONPATH=DIR, works on CPU); on the GPU
machine, the probe built with `--features cuda`."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
import qwen3_5_reference as q  # noqa: E402


def widths_27b(layers):
    """A Qwen3.5 text config at Qwen3.5-27B's layer widths with `layers` layers in its pattern
    (three Gated DeltaNet, then one attention; at least one attention layer) and a vocabulary of
    1,024 (the layers are what is measured)."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return dict(q.CONFIG, vocab_size=1024, hidden_size=5120, intermediate_size=17408,
                num_hidden_layers=layers, num_attention_heads=24, num_key_value_heads=4,
                head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=48, layer_types=kinds,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]})


def layer_outputs(model, ids):
    """Every decoder layer's output over `ids` `[1, n]`, each `[n, hidden]` f32 on the host
    (forward hooks, one forward under no_grad)."""
    import torch

    outs = []
    hooks = [layer.register_forward_hook(
        lambda m, i, r: outs.append((r[0] if isinstance(r, tuple) else r)[0].float().cpu()))
        for layer in model.model.layers]
    with torch.no_grad():
        model.model(ids)
    for h in hooks:
        h.remove()
    return outs


def f32_dump(folder, tokens, out):
    """Every layer's output from transformers in f32 on the GPU, TF32 off: the answer both bf16
    forwards are measured against. Run in a child process whose PYTHONPATH leaves out
    flash-linear-attention, so transformers takes its own PyTorch Gated DeltaNet."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    ids = torch.tensor([[(i * 7919 + 13) % 1024 for i in range(tokens)]], device="cuda")
    save_file({"layers": torch.cat(layer_outputs(model, ids), dim=-1).contiguous()}, out)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--f32-dump":
        return f32_dump(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(HERE, "..", "target"))
    ap.add_argument("--probe", default=os.path.join(target_dir, "release", "examples", "train_probe"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    import torch
    from transformers import Qwen3_5ForCausalLM

    config = widths_27b(a.layers)
    with tempfile.TemporaryDirectory() as d:
        from safetensors.numpy import save_file

        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(q.tensors(config), os.path.join(d, "model.safetensors"))
        ids = [(i * 7919 + 13) % 1024 for i in range(a.tokens)]

        torch.set_num_threads(os.cpu_count())
        cuda = a.device == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        model = Qwen3_5ForCausalLM.from_pretrained(d, torch_dtype=dtype).to(a.device).eval()
        x = torch.tensor([ids], device=a.device)
        # Which Gated DeltaNet transformers actually runs: the flash-linear-attention kernel
        # where that package imports (and transformers accepts its version), else its own.
        import transformers

        rule = next((getattr(m, "chunk_gated_delta_rule", None) for m in model.modules()
                     if hasattr(m, "chunk_gated_delta_rule")), None)
        where = getattr(rule, "__module__", "") or ""
        delta = "flash-linear-attention" if where.startswith("fla") else f"torch ({where or 'unknown'})"

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def once():
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                model.model(x)
            sync()
            return time.perf_counter() - t

        once()
        theirs = statistics.median(once() for _ in range(a.repeats))
        # Each layer's time in transformers' forward (CUDA events around every layer, one more
        # forward), beside dflash's per-layer split from the probe.
        their_layers = []
        if cuda:
            marks = []
            pre = [layer.register_forward_pre_hook(
                lambda m, i: marks.append(torch.cuda.Event(enable_timing=True)) or marks[-1].record())
                for layer in model.model.layers]
            post = [layer.register_forward_hook(
                lambda m, i, r: marks.append(torch.cuda.Event(enable_timing=True)) or marks[-1].record())
                for layer in model.model.layers]
            with torch.no_grad():
                model.model(x)
            sync()
            for h in pre + post:
                h.remove()
            their_layers = [round(marks[2 * j].elapsed_time(marks[2 * j + 1]) / 1000, 5)
                            for j in range(len(marks) // 2)]
        layers = []
        if a.check:
            layers = layer_outputs(model, x)
        del model
        if cuda:
            torch.cuda.empty_cache()  # the probe runs beside this process on the same GPU
        dump = os.path.join(d, "dflash_layers.safetensors")
        cmd = [a.probe, "target", d, "--tokens", str(a.tokens), "--repeats", str(a.repeats),
               "--phases"]
        if a.check:
            cmd += ["--dump", dump]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        lines = [json.loads(l) for l in out.stdout.strip().splitlines() if l.startswith("{")]
        probe = next(l for l in lines if "seconds" in l)
        # Each Gated DeltaNet layer's milliseconds by phase (mixing, the chunks' operands, the
        # pass over them, the output), to aim a kernel at the largest.
        phases = {l["layer"]: l["ms"] for l in lines if l.get("phase") == "delta_phases"}
        ours = probe["seconds"]
        kinds = config["layer_types"]
        result = {"layers": kinds, "tokens": a.tokens, "device": a.device,
                  "threads": os.cpu_count(), "dtype": str(dtype).replace("torch.", ""),
                  "dflash_dtype": probe.get("dtype"), "transformers": transformers.__version__,
                  "transformers_delta": delta,
                  "transformers_s": round(theirs, 4), "dflash_s": round(ours, 4),
                  "dflash_speed_vs_transformers": round(theirs / ours, 2),
                  "dflash_layer_s": [round(t, 5) for t in probe.get("layer_seconds", [])],
                  "dflash_delta_phases_ms": {str(k): {p: round(v, 3) for p, v in ms.items()}
                                             for k, ms in phases.items()},
                  "transformers_layer_s": their_layers}
        if a.check:
            from safetensors.torch import load_file

            mine = load_file(dump)["layers"]
            hidden = config["hidden_size"]
            diffs = []
            for i, ref in enumerate(layers):
                got = mine[:, i * hidden:(i + 1) * hidden]
                scale = ref.abs().max().item()
                diffs.append({"layer": i, "kind": kinds[i],
                              "max_rel": round((got - ref).abs().max().item() / scale, 5),
                              "mean_rel": round((got - ref).abs().mean().item() / ref.abs().mean().item(), 5)})
            result["layer_diffs"] = diffs
            if cuda:
                # Which bf16 forward is nearer the f32 answer: each against transformers in f32.
                f32 = os.path.join(d, "f32_layers.safetensors")
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                child = subprocess.run([sys.executable, os.path.abspath(__file__), "--f32-dump", d,
                                        str(a.tokens), f32], env=env, capture_output=True, text=True)
                if child.returncode != 0:
                    result["vs_f32"] = "failed: " + child.stderr.strip()[-400:]
                else:
                    exact = load_file(f32)["layers"]

                    def rel(got, ref):
                        return (round((got - ref).abs().max().item() / ref.abs().max().item(), 5),
                                round((got - ref).abs().mean().item() / ref.abs().mean().item(), 5))

                    vs = []
                    for i, ref_bf16 in enumerate(layers):
                        ref = exact[:, i * hidden:(i + 1) * hidden]
                        ours_max, ours_mean = rel(mine[:, i * hidden:(i + 1) * hidden], ref)
                        theirs_max, theirs_mean = rel(ref_bf16, ref)
                        vs.append({"layer": i, "dflash_max_rel": ours_max, "dflash_mean_rel": ours_mean,
                                   "transformers_max_rel": theirs_max,
                                   "transformers_mean_rel": theirs_mean})
                    result["vs_f32"] = vs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
