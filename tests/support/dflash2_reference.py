"""z-lab's reference implementation (dflash==0.1.0) on a DFlash 2 drafter that dflash exported.

Usage: dflash2_reference.py DIR OUT.json, where DIR holds what
stages/model/tests/dflash2_reference.rs writes: `drafter/` (the export, loaded unchanged by
`DFlash2DraftModel.from_pretrained`) and `inputs.safetensors` (the tapped context rows, one
block's token ids, an embedding table and an LM head). Runs the reference's forward over the
block as its `dflash_generate` does (the context's features as `target_hidden`, positions from
0 through the block) and its `propose` at temperature 0, and writes the final hidden states of
the block positions after the anchor and the proposed tokens. Needs torch and transformers.
"""
import json
import sys

import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from dflash import DFlash2DraftModel


def main(folder, out):
    model = DFlash2DraftModel.from_pretrained(f"{folder}/drafter", dtype=torch.float32).eval()
    inputs = load_file(f"{folder}/inputs.safetensors")
    context = inputs["context"][None].float()
    ids = inputs["block_ids"][None].long()
    noise = F.embedding(ids, inputs["embed"].float())
    positions = torch.arange(context.shape[1] + ids.shape[1])[None]
    head = torch.nn.Linear(inputs["lm_head"].shape[1], inputs["lm_head"].shape[0], bias=False)
    head.weight.data = inputs["lm_head"].float()
    with torch.inference_mode():
        hidden = model(position_ids=positions, noise_embedding=noise, target_hidden=context)
        hidden = hidden[:, 1:, :]
        proposed, _, _ = model.propose(hidden, ids[:, 0], head, 0.0)
    json.dump(
        {
            "reference": "dflash==0.1.0 DFlash2DraftModel, float32",
            "hidden": [[round(x, 7) for x in row] for row in hidden[0].tolist()],
            "proposed": proposed[0].tolist(),
        },
        open(out, "w"),
    )
    print("proposed", proposed[0].tolist())


if __name__ == "__main__":
    main(*sys.argv[1:])
