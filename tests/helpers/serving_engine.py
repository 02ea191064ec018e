"""An OpenAI-compatible engine stand-in whose health answers while its completions may fail: the field's hardest
failure (vLLM's `/health` and `/v1/models` answering 200 while generation was dead, vllm#53157, #16259).

Run as a script. It titles itself like the engine whose command line it is given (setproctitle rewrites argv, as
vLLM's own processes do), binds the port that command line names on 127.0.0.1, and serves:
- GET /health, GET /v1/models: 200, always;
- POST /v1/completions: 200 with one choice, unless the file `--broken PATH` exists: then per its content, `500`
  (an error answer) or `hang` (no answer, as a stuck engine core);
- every request's path and Authorization header appended to `--requests PATH` (the tests read what reached it).

With `--batch1 TOK_S` it is shaped as a vLLM engine with one sequence slot (`--max-num-seqs 1`): completions are
served one at a time, each generating its `max_tokens` at TOK_S tokens a second, the others waiting their turn; and
GET /metrics answers at once (vLLM's API server serves it on its event loop, beside the engine core) in vLLM's text
format with its real names: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total` (added each token, as vllm/v1/metrics/loggers.py adds each engine step's), their
`_created` samples and a histogram's buckets. `--broken` `freeze` then stops the generation where it is: the request
being generated and all behind it hang, and the counters stay (an engine core stuck in a collective).

    python serving_engine.py --requests req.log --broken broken.flag -- vllm serve m --port 18001 --api-key k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import setproctitle


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", required=True)
    ap.add_argument("--broken", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--batch1", type=float, default=0.0, help="tokens a second: one request at a time, /metrics")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    port = int(cmd[cmd.index("--port") + 1])
    setproctitle.setproctitle(" ".join(cmd))
    lock = threading.Lock()
    slot = threading.Lock()  # --batch1: the one sequence slot
    stats = {"running": 0, "waiting": 0, "prompt": 0, "generated": 0}
    created = time.time()

    def broken_now() -> str:
        try:
            with open(args.broken, encoding="ascii") as fh:
                return fh.read().strip() or "500"
        except FileNotFoundError:
            return ""

    def exposition() -> bytes:
        labels = 'engine="0",model_name="m"'
        with lock:
            s = dict(stats)
        lines = [
            "# HELP python_gc_objects_collected_total Objects collected during gc",
            "# TYPE python_gc_objects_collected_total counter",
            'python_gc_objects_collected_total{generation="0"} 1234.0',
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(s['running'])}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(s['waiting'])}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(s['prompt'])}",
            f"vllm:prompt_tokens_created{{{labels}}} {created}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(s['generated'])}",
            f"vllm:generation_tokens_created{{{labels}}} {created}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{le}"}} 0.0' for le in (0.001, 0.005, 0.01)),
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 0.0',
        ]
        return ("\n".join(lines) + "\n").encode()

    def generate(max_tokens: int) -> None:
        """One request through the one slot: its prompt, then its tokens one by one (a freeze holds it there)."""
        with lock:
            stats["waiting"] += 1
        with slot:
            with lock:
                stats["waiting"] -= 1
                stats["running"] += 1
                stats["prompt"] += 3
            try:
                for _ in range(max_tokens):
                    while broken_now() == "freeze":
                        time.sleep(0.05)
                    time.sleep(1.0 / args.batch1)
                    with lock:
                        stats["generated"] += 1
            finally:
                with lock:
                    stats["running"] -= 1

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: object) -> None:
            pass

        def _record(self) -> None:
            with lock, open(args.requests, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"path": self.path, "auth": self.headers.get("Authorization")}) + "\n")

        def _send(self, status: int, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._record()
            if self.path == "/metrics" and args.batch1 > 0:
                body = exposition()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path == "/metrics":  # no /metrics: an engine that serves no counters (404, as FastAPI answers)
                self._send(404, {"detail": "Not Found"})
                return
            self._send(200, {"object": "list", "data": [{"id": "m"}]} if "models" in self.path else {})

        def do_POST(self) -> None:
            self._record()
            length = int(self.headers.get("Content-Length") or 0)
            request = json.loads(self.rfile.read(length) or b"{}")
            broken = broken_now()
            if args.batch1 > 0 and broken in ("", "freeze"):
                generate(int(request.get("max_tokens") or 16))
                broken = broken_now()
            if broken == "hang":
                time.sleep(3600)
            if broken:
                self._send(500, {"error": {"message": "EngineCore died", "type": "InternalServerError"}})
                return
            self._send(200, {"object": "text_completion", "choices": [{"index": 0, "text": "-"}]})

    server = ThreadingHTTPServer((args.host, port), Handler)
    server.daemon_threads = True
    print(f"listening on {args.host}:{port} pid {os.getpid()}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
