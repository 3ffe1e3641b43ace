#!/usr/bin/env python3
"""A store's small, whole artifacts as one tar.gz: what a GPU session brings back to seed the next.

    python3 bench/gpu/store_subset.py STORE OUT.tar.gz [--max-bytes 4194304]

Takes every artifact whose files are all present and each under MAX bytes (manifests/KEY.json
and the blobs it names), the run records (runs/), and the shard lists of stages in progress
(shards/, small files only). An artifact with one large file (a drafter's weights) is left out
whole: a manifest without its blobs would read as done in `dflash plan` and fail the first
stage that opens it (`dflash verify` names such files as missing). Prints what it kept."""
import argparse
import json
import os
import tarfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--max-bytes", type=int, default=4 * 1024 * 1024)
    a = ap.parse_args()
    keep, whole, partial = [], 0, []

    def small(rel):
        p = os.path.join(a.store, rel)
        return os.path.isfile(p) and os.path.getsize(p) < a.max_bytes

    mdir = os.path.join(a.store, "manifests")
    for name in sorted(os.listdir(mdir)):
        m = json.load(open(os.path.join(mdir, name)))
        blobs = [os.path.join("blobs", f["digest"][:2], f["digest"]) for f in m["files"]]
        if all(small(b) for b in blobs):
            keep += [os.path.join("manifests", name)] + blobs
            whole += 1
        else:
            partial.append(m["lineage"]["stage_id"])
    for root, _, files in os.walk(os.path.join(a.store, "runs")):
        keep += [os.path.relpath(os.path.join(root, f), a.store) for f in files]
    # A finished shard of a stage in progress, with its blobs: resuming reads them, so a
    # record whose blobs stay behind would fail the stage instead of redoing the shard.
    for root, _, files in os.walk(os.path.join(a.store, "shards")):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), a.store)
            blobs = [os.path.join("blobs", x["digest"][:2], x["digest"])
                     for x in json.load(open(os.path.join(a.store, rel))).get("files", [])]
            if all(small(b) for b in blobs):
                keep += [rel] + blobs
    with tarfile.open(a.out, "w:gz") as t:
        for rel in sorted(set(keep)):
            t.add(os.path.join(a.store, rel), arcname=rel)
    print(f"{a.out}: {whole} whole artifacts, {len(set(keep))} files; "
          f"left out (a file over {a.max_bytes} bytes or absent): {', '.join(sorted(partial)) or 'none'}")


if __name__ == "__main__":
    main()
