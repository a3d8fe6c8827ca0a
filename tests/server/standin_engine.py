"""STAND-IN ENGINE for tests: a small local HTTP server that behaves like `vllm serve` where we look.

It is NOT vLLM. It answers `GET /health` (503 until --ready-after seconds have passed, then 200),
`GET /v1/models` and `POST /v1/completions` (OpenAI shape; `"stream": true` answers server-sent events in
chunked encoding), and accepts the engine's command line (--model MODEL_DIR, --host, --port; other flags ignored),
so the supervisor starts it through exactly the code that starts vLLM. Test hooks: --exit-after/--exit-code
(crash), --spawn-worker (a child in its process group, like vLLM's workers), --ignore-sigterm,
--hold-stream (a stream pauses after its first event until POST /standin/release).
Standard library only: it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()
RELEASE = threading.Event()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stand-in for `vllm serve` (tests only)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--spawn-worker", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--hold-stream", action="store_true")
    args, ignored = parser.parse_known_args(argv)
    args.ignored = ignored  # the plan's vLLM flags (--dtype, --max-model-len, ...): accepted, unused
    return args


def completion_words(prompt: str, max_tokens: int) -> list[str]:
    """A deterministic 'generation': one word per token, derived from the prompt's length."""
    return [f" w{(len(prompt) + i) % 97}" for i in range(max_tokens)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    args: argparse.Namespace

    def log_message(self, fmt: str, *fmt_args) -> None:  # to stdout, where the supervisor reads it
        print(f"INFO stand-in {self.command} {self.path} {fmt % fmt_args}", flush=True)

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Standin-Saw-Authorization", "yes" if self.headers.get("Authorization") else "no")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            ready = time.monotonic() - STARTED >= self.args.ready_after
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.split("?")[0] == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.args.model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path == "/standin/release":
            RELEASE.set()
            self._json(200, {"released": True})
            return
        if self.path != "/v1/completions":
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})
            return
        try:
            request = json.loads(raw)
            prompt = str(request["prompt"])
            max_tokens = int(request.get("max_tokens", 16))
        except (ValueError, KeyError, TypeError) as exc:
            self._json(400, {"error": {"message": f"bad request: {exc}", "type": "BadRequestError"}})
            return
        words = completion_words(prompt, max_tokens)
        if request.get("stream"):
            self._stream(words)
        else:
            choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words)}
            self._json(200, {"object": "text_completion", "model": self.args.model, "choices": [choice],
                             "usage": usage})  # fmt: skip

    def _stream(self, words: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, word in enumerate(words):
            event = {
                "object": "text_completion",
                "choices": [{"index": 0, "text": word, "finish_reason": None}],
            }
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            if i == 0 and self.args.hold_stream:
                RELEASE.wait(timeout=60)
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_worker:
        # Like vLLM's engine-core/worker processes: a child in the same process group. A stop that signals
        # only the leader leaves it running; only a signal to the group ends it.
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        print(f"stand-in worker pid {worker.pid}", flush=True)
    if args.exit_after is not None:
        print(f"stand-in will exit with code {args.exit_code} after {args.exit_after} s", flush=True)
        timer = threading.Timer(args.exit_after, lambda: os._exit(args.exit_code))
        timer.daemon = True
        timer.start()
    Handler.args = args
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"stand-in engine for {args.model} listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
