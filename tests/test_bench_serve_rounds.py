"""benchmarks/bench_serve.py --rounds: the pairing and the ratio arithmetic, against a stand-in for one HTTP stream
(named as such; the servers themselves are what the benchmark measures)."""

from __future__ import annotations

import pytest

from benchmarks import bench_serve


def test_rounds_rotate_the_order_and_pair_each_round(monkeypatch):
    calls: list[str] = []
    speed = {"a": 100.0, "b": 120.0, "c": 50.0}

    def standin_stream(url, model, prompt, tokens, sampling):
        calls.append(url)
        drift = 1 + 0.1 * (len(calls) // 3)  # the whole VM speeds up round by round: a pair keeps its ratio
        return {"decode_tok_s": speed[url] * drift, "ttft_s": 0.05, "tokens": tokens}

    class Server:
        def __init__(self, name):
            self.url = name

    monkeypatch.setattr(bench_serve, "stream", standin_stream)
    servers = {name: (Server(name), "m", "edge") for name in ("a", "b", "c")}
    per: dict[str, list[float]] = {}
    bench_serve.decode_rounds(servers, 4, {"edge": None}, per)
    bench_serve.decode_rounds(servers, 2, {"edge": None}, per, first=4)  # a second start's share goes on rotating
    out = bench_serve.paired_summary(per, ["a", "b", "c"])
    assert calls[:9] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert calls[12:15] == ["b", "c", "a"]  # round 5
    assert out["ratio_to"] == "a" and len(out["each"]["a"]) == 6
    assert out["ratios"]["b"]["median"] == pytest.approx(1.2, rel=0.1)
    assert out["ratios"]["c"]["median"] == pytest.approx(0.5, rel=0.1)
    assert "| b | " in bench_serve.rounds_table(out)
