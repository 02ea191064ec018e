"""An OpenAI-compatible engine stand-in whose health answers while its completions may fail: the field's hardest
failure (vLLM's `/health` and `/v1/models` answering 200 while generation was dead, vllm#53157, #16259).

Run as a script. It titles itself like the engine whose command line it is given (setproctitle rewrites argv, as
vLLM's own processes do), binds the port that command line names on 127.0.0.1, and serves:
- GET /health, GET /v1/models: 200, always;
- POST /v1/completions: 200 with one choice, unless the file `--broken PATH` exists: then per its content, `500`
  (an error answer) or `hang` (no answer, as a stuck engine core);
- every request's path and Authorization header appended to `--requests PATH` (the tests read what reached it).

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
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    port = int(cmd[cmd.index("--port") + 1])
    setproctitle.setproctitle(" ".join(cmd))
    lock = threading.Lock()

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
            self._send(200, {"object": "list", "data": [{"id": "m"}]} if "models" in self.path else {})

        def do_POST(self) -> None:
            self._record()
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            try:
                with open(args.broken, encoding="ascii") as fh:
                    broken = fh.read().strip() or "500"
            except FileNotFoundError:
                broken = ""
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
