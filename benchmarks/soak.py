"""The service under load and faults, for a bounded time on loopback (issue 46): edge-serve on the default model
(or --model), --streams concurrent streaming completions the whole time (a quarter of them cut off by their
client after a few events), the bad inputs clients have sent it mixed in, vLLM's API server killed (SIGKILL) at a
third of the run and stopped (SIGSTOP) at two thirds.

    .venv/bin/python -m benchmarks.soak [--seconds 300] [--streams 48] [--json FILE]

Every request ends as one of:
  served       a stream that ended with [DONE], or an answer (200)
  cut          a stream its client cut off, as planned
  refused      503 with Retry-After: the wrapper's planned refusal (the wait for the engine ran out, or too many
               waited)
  rejected     a bad input answered with a clear 4xx (what it should get)
  in-flight    taken by an engine that was then killed or found stopped, and ended with the wrapper's clear error
               (an error event, a 502 or 504 naming the engine): counted apart by whether it was sent before the
               fault (in flight) or to an engine already stopped but not yet found so
  failed       anything else: a 5xx that is not the above, a transport error, a stream that ended without
               [DONE] or an error event, a bad input that got 5xx or broke the engine
TTFT: seconds from sending a stream to its first token, over the served and cut streams (those that waited for a
restart included; the report gives them apart too). Memory: the tree's RssAnon (benchmarks/rss.py) at the start
(idle, SETTLE_S after --warmup-seconds of the same load without faults: first use is not growth) and at the end
(idle, after the load has drained and SETTLE_S passed), and the wrapper process's own, which lives through the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.bench_serve import Server, edge_argv, free_port
from benchmarks.host import cpu_model_name
from benchmarks.rss import rss_anon_bytes, tree_rss_anon_bytes

SETTLE_S = 15.0
CUT_AFTER_EVENTS = 3
MIB = 1 << 20


@dataclass
class Outcome:
    kind: str  # "stream", "bad:<name>"
    sent_s: float  # seconds from the run's start
    ended_s: float
    result: str  # served, cut, refused, rejected, in-flight, failed
    detail: str = ""
    ttft_s: float | None = None
    waited: bool = False  # sent while the engine was not ready


def bad_inputs(model: str, max_model_len: int) -> dict[str, tuple[str, dict]]:
    """What clients have sent: (path, body) by name. Each must get a clear 4xx or an answer. (A prompt that all but
    fills the context is no bad input, but a long prefill on one core must not look like a wedged engine.)"""
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    base = {"model": model, "max_tokens": 4, "temperature": 0}
    return {
        "over-context prompt": ("completions", {**base, "prompt": "word " * (2 * max_model_len)}),
        "near-full-context prefill": ("completions", {**base, "prompt": "word " * (max_model_len - 64)}),
        "max_tokens 10^9": ("completions", {**base, "prompt": "Hi", "max_tokens": 10**9}),
        "logprobs 10^6": ("completions", {**base, "prompt": "Hi", "logprobs": 10**6}),
        "n 10^4": ("completions", {**base, "prompt": "Hi", "n": 10**4}),
        "10^5 logit_bias entries": ("completions", {**base, "prompt": "Hi",
                                                    "logit_bias": {str(i): 1.0 for i in range(10**5)}}),
        "negative temperature": ("completions", {**base, "prompt": "Hi", "temperature": -1.0}),
        "out-of-vocabulary ids": ("completions", {**base, "prompt": [10**9, 10**9 + 1]}),
        "(a+)+$ regex": ("completions", {**base, "prompt": "aaaa", "structured_outputs": {"regex": "(a+)+$"}}),
        "depth-200 JSON schema": ("chat/completions", {
            **base, "messages": [{"role": "user", "content": "Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}}),
    }  # fmt: skip


def engine_error(text: str) -> bool:
    """The wrapper's clear error for a request the engine took and did not answer (server/proxy.py)."""
    try:
        return json.loads(text)["error"]["type"] == "engine_error"
    except (ValueError, KeyError, TypeError):
        return False


class Soak:
    def __init__(self, url: str, model: str, seconds: float, streams: int, max_model_len: int, seed: int,
                 faults: bool = True) -> None:  # fmt: skip
        self.url, self.model, self.seconds, self.streams, self.with_faults = url, model, seconds, streams, faults
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self.faults: list[dict] = []
        self.lock = threading.Lock()
        self.engine_ready = True

    def now(self) -> float:
        return time.monotonic() - self.started

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def stream_worker(self, index: int) -> None:
        cut = index % 4 == 0  # a quarter of the clients cut their streams off
        rng = random.Random(index)
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                tokens = rng.randint(8, 64)
                body = {"model": self.model, "prompt": f"Story {index}: once upon a time", "max_tokens": tokens,
                        "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
                self.record(self.one_stream(client, body, cut))

    def one_stream(self, client: httpx.Client, body: dict, cut: bool) -> Outcome:
        sent, waited = self.now(), not self.engine_ready
        first, events, last = None, 0, ""
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = response.read().decode(errors="replace")
                    result = ("refused" if response.status_code == 503 and "Retry-After" in response.headers
                              else "in-flight" if response.status_code in (502, 504) and engine_error(text)
                              else "failed")  # fmt: skip
                    return Outcome("stream", sent, self.now(), result, f"{response.status_code}: {text[:160]}",
                                   waited=waited)  # fmt: skip
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    last = line
                    if line == "data: [DONE]":
                        break
                    events += 1
                    first = first if first is not None else self.now() - sent
                    if cut and events >= CUT_AFTER_EVENTS:
                        return Outcome("stream", sent, self.now(), "cut", ttft_s=first, waited=waited)
        except httpx.HTTPError as exc:
            return Outcome("stream", sent, self.now(), "failed", f"{type(exc).__name__}: {exc}", first, waited)
        if last == "data: [DONE]":
            return Outcome("stream", sent, self.now(), "served", ttft_s=first, waited=waited)
        if last and engine_error(last[6:]):
            return Outcome("stream", sent, self.now(), "in-flight", last[6:160], first, waited)
        return Outcome("stream", sent, self.now(), "failed", f"ended without [DONE]: {last[:160]}", first, waited)

    def bad_worker(self) -> None:
        inputs = bad_inputs(self.model, self.max_model_len)
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                for name, (path, body) in inputs.items():
                    if self.stop.is_set():
                        return
                    sent = self.now()
                    try:
                        response = client.post(f"{self.url}/v1/{path}", json=body)
                    except httpx.HTTPError as exc:
                        self.record(Outcome(f"bad:{name}", sent, self.now(), "failed", f"{type(exc).__name__}"))
                        continue
                    code, text = response.status_code, response.text
                    result = ("served" if code == 200 else "rejected" if 400 <= code < 500
                              else "refused" if code == 503 and "Retry-After" in response.headers
                              else "in-flight" if code in (502, 504) and engine_error(text) else "failed")  # fmt: skip
                    self.record(Outcome(f"bad:{name}", sent, self.now(), result, f"{code}: {text[:160]}"))
                    self.stop.wait(1.0)

    def watch_ready(self) -> None:
        while not self.stop.is_set():
            try:
                self.engine_ready = httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                self.engine_ready = False
            self.stop.wait(0.2)

    def fault(self, name: str, sig: signal.Signals) -> None:
        status = httpx.get(f"{self.url}/status", timeout=30).json()["engine"]
        pid, restarts = status["engine_pid"], status["restarts"]
        at = self.now()
        os.kill(pid, sig)
        unready = ready = None
        while self.now() - at < 300:
            state = httpx.get(f"{self.url}/status", timeout=30).json()["engine"]
            if unready is None and state["state"] != "ready":
                unready = self.now() - at
            if state["restarts"] > restarts and state["state"] == "ready":
                ready = self.now() - at
                break
            time.sleep(0.1)
        self.faults.append({"fault": name, "pid": pid, "at_s": round(at, 1), "at": at,
                            "noticed_after_s": None if unready is None else round(unready, 2),
                            "ready_again_after_s": None if ready is None else round(ready, 1),
                            "last_error": state["last_error"][:200]})  # fmt: skip

    def run(self) -> None:
        threads = [threading.Thread(target=self.stream_worker, args=(i,), daemon=True) for i in range(self.streams)]
        threads += [threading.Thread(target=self.bad_worker, daemon=True),
                    threading.Thread(target=self.watch_ready, daemon=True)]  # fmt: skip
        for thread in threads:
            thread.start()
        faults = (("SIGKILL", signal.SIGKILL, self.seconds / 3), ("SIGSTOP", signal.SIGSTOP, 2 * self.seconds / 3))
        for name, sig, at in faults if self.with_faults else ():
            time.sleep(max(0.0, at - self.now()))
            self.fault(name, sig)
        time.sleep(max(0.0, self.seconds - self.now()))
        self.stop.set()
        for thread in threads:
            thread.join(timeout=360)

    def report(self) -> dict:
        by_result: dict[str, int] = {}
        for outcome in self.outcomes:
            by_result[outcome.result] = by_result.get(outcome.result, 0) + 1
        in_flight = [o for o in self.outcomes if o.result == "in-flight"]
        # sent after a fault and before the wrapper noticed it (an engine already stopped, not yet found so)
        sent_after_fault = [o for o in in_flight if any(
            f["at"] < o.sent_s <= f["at"] + (f["noticed_after_s"] or 0.0) for f in self.faults)]  # fmt: skip
        ttft = [o.ttft_s for o in self.outcomes if o.ttft_s is not None and o.result in ("served", "cut")]
        ttft_direct = [o.ttft_s for o in self.outcomes
                       if o.ttft_s is not None and o.result in ("served", "cut") and not o.waited]  # fmt: skip
        bad: dict[str, dict[str, int]] = {}
        for outcome in self.outcomes:
            if outcome.kind.startswith("bad:"):
                counts = bad.setdefault(outcome.kind[4:], {})
                key = f"{outcome.result} {outcome.detail.split(':')[0]}"
                counts[key] = counts.get(key, 0) + 1
        return {
            "requests": len(self.outcomes),
            "by_result": by_result,
            "in_flight_sent_after_a_fault": len(sent_after_fault),
            "failed": [asdict(o) for o in self.outcomes if o.result == "failed"][:20],
            "ttft_s": {"p50": _q(ttft, 0.5), "p99": _q(ttft, 0.99), "n": len(ttft)},
            "ttft_s_not_waited": {"p50": _q(ttft_direct, 0.5), "p99": _q(ttft_direct, 0.99), "n": len(ttft_direct)},
            "bad_inputs": bad,
            "faults": [{k: v for k, v in f.items() if k != "at"} for f in self.faults],
        }


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def idle_rss(pid: int, samples: int = 5) -> dict[str, float]:
    """The tree's RssAnon and the wrapper's own, medians of `samples` a second apart, MiB."""
    tree, own = [], []
    for _ in range(samples):
        tree.append(tree_rss_anon_bytes(pid))
        own.append(rss_anon_bytes(pid))
        time.sleep(1.0)
    return {"tree_mib": round(statistics.median(tree) / MIB, 1), "wrapper_mib": round(statistics.median(own) / MIB, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--warmup-seconds", type=float, default=30)
    parser.add_argument("--serving-mode", default="one-process")
    parser.add_argument("--model", type=Path, help="edge-serve's --model (default: the embedded model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("/tmp/soak-edge-serve.log"))
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    args.max_kld, args.path, args.threads = None, None, None
    port = free_port()
    server = Server(edge_argv(args.serving_mode, args, "--port", str(port)), dict(os.environ), port, args.log)
    try:
        ready_s = server.wait_ready("/readyz")
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = httpx.post(f"{server.url}/v1/completions", timeout=300,
                          json={"model": model, "prompt": "Hi", "max_tokens": 8})  # fmt: skip
        assert warm.status_code == 200, warm.text
        # The same load without faults first: the engine's KV cache pages and the wrapper's buffers are touched
        # by the first load, which is first use, not growth; the start is measured idle after it
        Soak(server.url, model, args.warmup_seconds, args.streams, 2048, args.seed, faults=False).run()
        time.sleep(SETTLE_S)
        start_rss = idle_rss(server.proc.pid)
        soak = Soak(server.url, model, args.seconds, args.streams, 2048, args.seed)
        soak.run()
        time.sleep(SETTLE_S)
        end_rss = idle_rss(server.proc.pid)
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()
    waits = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("edge_engine_requests_")}  # fmt: skip
    result = {
        "command": "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_model_name(),
        "plan": {"path": status["plan"]["path"], "layout": status["plan"].get("layout"),
                 "mode": status["plan"]["vllm"].get("mode")},  # fmt: skip
        "first_ready_s": round(ready_s, 1),
        "seconds": args.seconds,
        "streams": args.streams,
        **soak.report(),
        "rss_start": start_rss,
        "rss_end": end_rss,
        "tree_rss_end_over_start": round(end_rss["tree_mib"] / start_rss["tree_mib"], 3),
        "wrapper_metrics": waits,
        "restarts": status["engine"]["restart_reasons"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
