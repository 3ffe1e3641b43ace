"""A fault-injecting OpenAI-compatible server for the generate tests (a mock, named as one: the
real peer is llama.cpp's server, which the tests also run).

It answers `/v1/models` and `/v1/chat/completions` deterministically: the reply to a
conversation is `echo[<number of messages>]: <last message>`, so tests can see what context each
turn was generated from. `--fault` injects one failure kind into every `--every`-th request:

  burst5xx   the first `--burst` requests answer 503
  hang       sleeps `--hang` seconds before answering (longer than the client's timeout)
  reset      sends the status line and headers, then closes the connection mid-body
  malformed  answers 200 with a body that is not JSON
  refuse     answers 400 to prompts containing "REFUSE" (the request's own fault)
  shed       answers 503 with `Retry-After: 600` (up, but shedding load for ten minutes)

`--delay` slows every answer. Every request is appended to `--log` as one JSON line
`{"last": ..., "status": ..., "concurrent": ...}`, `concurrent` counting the requests the server
held when this one arrived, itself included (what a server's `--max-running-requests` bounds). Binds 127.0.0.1 only; writes its port to `--port-file`.
"""

import argparse
import json
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, default=0)
ap.add_argument("--port-file")
ap.add_argument("--model", default="target")
ap.add_argument("--fault", default="none")
ap.add_argument("--every", type=int, default=3)
ap.add_argument("--burst", type=int, default=5)
ap.add_argument("--hang", type=float, default=30.0)
ap.add_argument("--delay", type=float, default=0.0)
ap.add_argument("--log")
a = ap.parse_args()

lock = threading.Lock()
count = [0]
held = [0]
local = threading.local()


def log(entry):
    entry["concurrent"] = getattr(local, "concurrent", None)
    if a.log:
        with lock, open(a.log, "a") as f:
            f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status, body, ctype="application/json", headers=()):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in ("/v1/models", "/health"):
            self.send(200, json.dumps({"object": "list", "data": [{"id": a.model, "object": "model"}]}))
        else:
            self.send(404, "{}")

    def do_POST(self):
        with lock:
            held[0] += 1
            local.concurrent = held[0]
        try:
            self.answer()
        finally:
            with lock:
                held[0] -= 1

    def answer(self):
        length = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(length))
        msgs = req["messages"]
        last = msgs[-1]["content"]
        with lock:
            count[0] += 1
            n = count[0]
        if a.delay:
            time.sleep(a.delay)
        faulty = n % a.every == 0
        if a.fault == "burst5xx" and n <= a.burst:
            log({"last": last, "status": 503})
            return self.send(503, '{"error": "overloaded"}')
        if a.fault == "shed" and faulty:
            log({"last": last, "status": 503})
            return self.send(503, '{"error": "overloaded"}', headers=[("Retry-After", "600")])
        if a.fault == "hang" and faulty:
            log({"last": last, "status": "hang"})
            time.sleep(a.hang)
            return self.send(503, "{}")
        if a.fault == "reset" and faulty:
            log({"last": last, "status": "reset"})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if a.fault == "malformed" and faulty:
            log({"last": last, "status": "malformed"})
            return self.send(200, '{"choices": [{"message": ')
        if a.fault == "refuse" and "REFUSE" in last:
            log({"last": last, "status": 400})
            return self.send(400, '{"error": "prompt too long"}')
        content = f"echo[{len(msgs)}]: {last}"
        words = content.split()
        finish = "stop"
        if req.get("max_tokens", 1 << 30) < len(words):
            content = " ".join(words[: req["max_tokens"]])
            finish = "length"
        kwargs = req.get("chat_template_kwargs") or {}
        reasoning = None if kwargs.get("enable_thinking") is False else f"thinking about {last[:20]}"
        log({"last": last, "status": 200, "messages": len(msgs), "seed": req.get("seed"),
             "kwargs": kwargs})
        self.send(200, json.dumps({
            "id": f"c{n}", "object": "chat.completion", "model": a.model,
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content,
                                     "reasoning_content": reasoning}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(content.split())},
        }))


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


s = Server(("127.0.0.1", a.port), Handler)
if a.port_file:
    with open(a.port_file + ".part", "w") as f:
        f.write(str(s.server_address[1]))
    import os
    os.replace(a.port_file + ".part", a.port_file)
s.serve_forever()
