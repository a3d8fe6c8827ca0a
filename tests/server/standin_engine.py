"""STAND-IN ENGINE for tests: a small local HTTP server that behaves like `vllm serve` where we look.

It is NOT vLLM. It answers `GET /health` (503 until --ready-after seconds have passed, then 200),
`GET /v1/models` and `POST /v1/completions` (OpenAI shape; `"stream": true` answers server-sent events in
chunked encoding), `GET /metrics` (a few lines in Prometheus text format, like vLLM's), and accepts the engine's
command line (--model MODEL_DIR, --served-model-name NAME..., --uds PATH, or --host and --port; other flags
ignored), so the supervisor starts it through exactly the code that starts vLLM. Like vLLM 0.28 with --uds, it
binds the Unix socket PATH plainly (a file already there fails the bind; the mode follows the umask; the file is
left when it exits) and then ignores --host and --port. Like vLLM, it lists the served names (the model
path when none is given) and answers 404 for a completion naming another model. Like vLLM, with VLLM_API_KEY in
its environment it answers 401 to any /v1 request without `Authorization: Bearer <that key>` (other paths stay
open); every response says which authorization it saw (X-Standin-Saw-Authorization: none, engine-key, other),
and so does its log line for the request (`auth=...`).
Test hooks: --bind-after S (binds S seconds after starting, as vLLM binds before loading its model but takes seconds
to start), --exit-after/--exit-code (crash), --spawn-worker (a child in its process group, like vLLM's workers),
--ignore-sigterm, --busy-health S (once ready, /health computes for S seconds before it answers: a busy engine),
--hold-stream (a stream pauses after its first event until POST /standin/release), --fail-completions (every
completion answers 500), --dead-completions (every completion answers vLLM's 500 for a dead engine core), and hangs:
--hang-after N (every request after the first N is never answered), SIGUSR1 (from now on nothing is answered: a
stopped API server), SIGUSR2 (completions are never answered, /health still is: a wedged engine core behind a live
API server). Its responses carry a hop-by-hop header named in `Connection`, as a proxy must drop, and http.server's
own `Server` and `Date`.
Standard library only: it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()
RELEASE = threading.Event()
HANG_ALL = threading.Event()  # nothing is answered any more
HANG_COMPLETIONS = threading.Event()  # completions are not answered any more
NEVER = threading.Event()  # waited on by a hung request
SEEN = itertools.count(1)  # requests seen, for --hang-after


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stand-in for `vllm serve` (tests only)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", default=None)
    parser.add_argument("--bind-after", type=float, default=0.0)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--spawn-worker", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--hold-stream", action="store_true")
    parser.add_argument("--hang-after", type=int, default=None)
    parser.add_argument("--fail-completions", action="store_true")
    parser.add_argument("--dead-completions", action="store_true")
    parser.add_argument("--busy-health", type=float, default=0.0)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--speculative-config", default=None)
    args, ignored = parser.parse_known_args(argv)
    args.ignored = ignored  # the plan's vLLM flags (--dtype, --max-model-len, ...): accepted, unused
    return args


def completion_words(prompt: str, max_tokens: int) -> list[str]:
    """A deterministic 'generation': one word per token, derived from the prompt's length."""
    return [f" w{(len(prompt) + i) % 97}" for i in range(max_tokens)]


ANSWERED = [0]  # completions answered, for the drafting counters


def drafting_series(args: argparse.Namespace, name: str) -> str:
    """With --speculative-config, vLLM's three spec_decode counters as its /metrics writes them: the stand-in
    'drafts' num_speculative_tokens tokens a completion and 'accepts' all but one (no real drafting)."""
    if args.speculative_config is None:
        return ""
    k = json.loads(args.speculative_config)["num_speculative_tokens"]
    n = ANSWERED[0]
    values = {"num_drafts": n, "num_draft_tokens": k * n, "num_accepted_tokens": (k - 1) * n}
    return "".join(f"# HELP vllm:spec_decode_{key}_total Stand-in.\n# TYPE vllm:spec_decode_{key}_total counter\n"
                   f'vllm:spec_decode_{key}_total{{engine="0",model_name="{name}"}} {value}.0\n'
                   for key, value in values.items())  # fmt: skip


def served_names(args: argparse.Namespace) -> list[str]:
    return args.served_model_name or [args.model]


def hang_if_asked(path: str, hang_after: int | None) -> None:
    """Block this request's thread for good when a hang is in force (the client sees no answer)."""
    seen = next(SEEN)
    if hang_after is not None and seen > hang_after:
        HANG_ALL.set()
    if HANG_ALL.is_set() or (HANG_COMPLETIONS.is_set() and path.startswith("/v1/completions")):
        NEVER.wait()


def authorization_seen(header: str | None) -> str:
    """none, engine-key (the key in VLLM_API_KEY) or other."""
    if not header:
        return "none"
    key = os.environ.get("VLLM_API_KEY")
    return "engine-key" if key and header == f"Bearer {key}" else "other"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    args: argparse.Namespace

    def log_message(self, fmt: str, *fmt_args) -> None:  # to stdout, where the supervisor reads it
        seen = authorization_seen(self.headers.get("Authorization"))
        print(f"INFO stand-in {self.command} {self.path} auth={seen} {fmt % fmt_args}", flush=True)

    def _refused_without_the_key(self) -> bool:
        """401 for /v1 without the engine's key, as vLLM's AuthenticationMiddleware answers."""
        key = os.environ.get("VLLM_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return False
        if authorization_seen(self.headers.get("Authorization")) == "engine-key":
            return False
        self._json(401, {"error": "Unauthorized"})
        return True

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Standin-Saw-Authorization", authorization_seen(self.headers.get("Authorization")))
        self.send_header("Connection", "X-Standin-Hop")  # names a hop-by-hop header (RFC 9110 7.6.1)
        self.send_header("X-Standin-Hop", "this connection only")
        self.send_header("Keep-Alive", "timeout=5")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        hang_if_asked(self.path, self.args.hang_after)
        if self._refused_without_the_key():
            return
        if self.path == "/health":
            ready = time.monotonic() - STARTED >= self.args.ready_after
            if ready and self.args.busy_health:  # an engine that computes and is slow to answer: spin, then answer
                busy_until = time.monotonic() + self.args.busy_health
                while time.monotonic() < busy_until:
                    pass
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.split("?")[0] == "/v1/models":
            cards = [{"id": name, "object": "model", "root": self.args.model} for name in served_names(self.args)]
            self._json(200, {"object": "list", "data": cards})
        elif self.path == "/metrics":
            name = served_names(self.args)[0]
            body = ("# HELP vllm:num_requests_running Requests running (stand-in).\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="{name}"}} 0.0\n'
                    + drafting_series(self.args, name)).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        hang_if_asked(self.path, self.args.hang_after)
        if self.path == "/standin/release":
            RELEASE.set()
            self._json(200, {"released": True})
            return
        if self._refused_without_the_key():
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
        if request.get("model") and request["model"] not in served_names(self.args):
            message = f"The model `{request['model']}` does not exist."
            self._json(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
            return
        if self.args.fail_completions:
            self._json(500, {"error": {"message": "stand-in: --fail-completions", "type": "InternalServerError"}})
            return
        if self.args.dead_completions:  # what vLLM answers when its engine core is dead or shutting down
            message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            self._json(500, {"error": {"message": message, "type": "InternalServerError", "code": 500}})
            return
        words = completion_words(prompt, max_tokens)
        ANSWERED[0] += 1
        if request.get("stream"):
            self._stream(words)
        else:
            choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words)}
            self._json(200, {"object": "text_completion", "model": served_names(self.args)[0], "choices": [choice],
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
    signal.signal(signal.SIGUSR1, lambda signum, frame: HANG_ALL.set())
    signal.signal(signal.SIGUSR2, lambda signum, frame: HANG_COMPLETIONS.set())
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
    time.sleep(args.bind_after)
    if args.uds:
        server = UnixHTTPServer(args.uds, Handler)
        where = f"unix:{args.uds}"
    else:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
        where = f"{args.host}:{args.port}"
    server.daemon_threads = True
    print(f"stand-in engine for {args.model} listening on {where}", flush=True)
    server.serve_forever()


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """HTTP on a Unix socket, bound as vLLM binds it (socket.bind(path): no unlink, no chmod)."""


if __name__ == "__main__":
    main(sys.argv[1:])
