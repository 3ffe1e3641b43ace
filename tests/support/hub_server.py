"""A local HTTP server implementing the subset of the Hugging Face Hub API that dflash's
`download` stage uses, serving real dataset files from a folder (a test peer, not the Hub):

  GET  /api/datasets/{owner}/{name}/revision/{rev}   -> {"id", "sha", "siblings": [{"rfilename"}]}
  GET|HEAD /datasets/{owner}/{name}/resolve/{rev}/{path}   (ETag, Content-Length, Range)

Repos are folders ROOT/{owner}/{name}. A repo's sha is derived from its files' names and bytes,
so `main` and that sha resolve alike and any other revision is a 404. A repo holding a file
`.gated` answers 401 unless the request carries `Authorization: Bearer $HUB_TOKEN`.
`--cut-after N` makes the first GET of each file send only N bytes and drop the connection, to
test resumed downloads. Every request line (with its Range header) is appended to `--log`.

Usage: python3 hub_server.py --root DIR --port-file FILE [--cut-after N] [--log FILE]
It binds 127.0.0.1 on a free port and writes the port to FILE once it listens.
"""

import argparse
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

args = None
cut_done = set()
lock = threading.Lock()


def repo_files(repo_dir):
    out = []
    for base, _dirs, files in os.walk(repo_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(base, f), repo_dir)
            if not rel.startswith("."):
                out.append(rel)
    return sorted(out)


def repo_sha(repo_dir):
    h = hashlib.sha1()
    for rel in repo_files(repo_dir):
        h.update(rel.encode())
        with open(os.path.join(repo_dir, rel), "rb") as f:
            h.update(hashlib.sha1(f.read()).digest())
    return h.hexdigest()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def note(self):
        if args.log:
            with lock, open(args.log, "a") as f:
                f.write(f"{self.command} {self.path} range={self.headers.get('Range')} "
                        f"auth={'yes' if self.headers.get('Authorization') else 'no'}\n")

    def send_json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def repo(self, owner, name):
        d = os.path.join(args.root, owner, name)
        if not os.path.isdir(d):
            self.send_json(404, {"error": "Repository not found"})
            return None
        if os.path.exists(os.path.join(d, ".gated")):
            want = "Bearer " + os.environ.get("HUB_TOKEN", "")
            if self.headers.get("Authorization") != want:
                self.send_json(401, {"error": "Access to this dataset is restricted"})
                return None
        return d

    def resolve_rev(self, d, rev):
        sha = repo_sha(d)
        if rev in ("main", sha):
            return sha
        self.send_json(404, {"error": f"Revision not found: {rev}"})
        return None

    def do_HEAD(self):
        self.serve_file(head=True)

    def do_GET(self):
        self.note()
        parts = [unquote(p) for p in self.path.split("?")[0].split("/")[1:]]
        if parts[:2] == ["api", "datasets"] and len(parts) >= 6 and parts[4] == "revision":
            d = self.repo(parts[2], parts[3])
            if d is None:
                return
            rev = "/".join(parts[5:])
            sha = self.resolve_rev(d, rev)
            if sha is None:
                return
            self.send_json(200, {"id": f"{parts[2]}/{parts[3]}", "sha": sha,
                                 "siblings": [{"rfilename": f} for f in repo_files(d)]})
            return
        self.serve_file(head=False)

    def serve_file(self, head):
        parts = [unquote(p) for p in self.path.split("?")[0].split("/")[1:]]
        if len(parts) < 6 or parts[0] != "datasets" or parts[3] != "resolve":
            self.send_json(404, {"error": "not found"})
            return
        d = self.repo(parts[1], parts[2])
        if d is None:
            return
        sha = self.resolve_rev(d, parts[4])
        if sha is None:
            return
        path = os.path.join(d, *parts[5:])
        if not os.path.isfile(path):
            self.send_json(404, {"error": "Entry not found"})
            return
        size = os.path.getsize(path)
        etag = '"' + hashlib.sha1(open(path, "rb").read()).hexdigest() + '"'
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
        length = size - start
        self.send_response(206 if start else 200)
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if head:
            return
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read()
        cut = False
        if args.cut_after is not None:
            with lock:
                if path not in cut_done and len(body) > args.cut_after:
                    cut_done.add(path)
                    cut = True
        if cut:
            self.wfile.write(body[: args.cut_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


def main():
    global args
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--cut-after", type=int)
    p.add_argument("--log")
    args = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
