"""Speculative decoding as the server reports it: /status's `drafting` from the engine's spec_decode counters, vLLM's
series on /metrics as the engine wrote them, and a `speculative` that /plan refuses naming the field. The engine
here is the STAND-IN (tests/server/standin_engine.py), whose counters are fixed per completion: this checks the
server's reading of them; tests/kernels/test_speculative_slow.py checks the real engine's drafting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from edge.plan.speculative import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, Speculative
from server.app import create_app
from server.metrics import drafting_counts
from server.settings import Settings
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import fast_settings, smollm2_plan, standin, uvicorn_on_loopback

MODEL_DIR = "/models/smollm2"
GW17 = json.loads((Path(__file__).parents[1] / "edge" / "data" / "device_gw17.json").read_text())
DRAFTED = 3


def drafting_plan():
    spec = Speculative(method="ngram", num_speculative_tokens=DRAFTED, prompt_lookup_min=PROMPT_LOOKUP_MIN,
                       prompt_lookup_max=PROMPT_LOOKUP_MAX, asked="ngram")  # fmt: skip
    plan = smollm2_plan()
    vllm = plan.vllm.model_copy(update={"args": [*plan.vllm.args, "--speculative-config",
                                                 json.dumps(spec.vllm_config())]})  # fmt: skip
    return plan.model_copy(update={"speculative": spec, "vllm": vllm})


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def test_status_reports_the_acceptance_rate_from_the_engines_counters():
    plan = drafting_plan()
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=fast_settings(), executable=standin())
    with uvicorn_on_loopback(create_app(fast_settings(), supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        _wait(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        before = httpx.get(f"{url}/status").json()["drafting"]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for _ in range(2):
            body = {"model": model, "prompt": "The gateway", "max_tokens": 4}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        after = httpx.get(f"{url}/status").json()["drafting"]
        metrics = httpx.get(f"{url}/metrics").text
    assert before["drafts"] == 0 and before["acceptance_rate"] is None and before["tokens_per_step"] is None
    assert after["method"] == "ngram" and after["num_speculative_tokens"] == DRAFTED
    assert (after["drafts"], after["drafted_tokens"], after["accepted_tokens"]) == (2, 2 * DRAFTED, 2 * (DRAFTED - 1))
    assert after["acceptance_rate"] == pytest.approx((DRAFTED - 1) / DRAFTED)
    assert after["tokens_per_step"] == pytest.approx(1 + (DRAFTED - 1))
    assert "vllm:spec_decode_num_accepted_tokens_total" in metrics


def test_status_has_no_drafting_for_a_plan_that_does_not_draft():
    plan = smollm2_plan()
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=fast_settings(), executable=standin())
    with uvicorn_on_loopback(create_app(fast_settings(), supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        _wait(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        assert httpx.get(f"{url}/status").json()["drafting"] is None


def test_drafting_counts_need_all_three_counters():
    text = ('# TYPE vllm:spec_decode_num_drafts_total counter\nvllm:spec_decode_num_drafts_total{engine="0"} 5.0\n'
            '# TYPE vllm:spec_decode_num_draft_tokens_total counter\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0"} 15.0\n')  # fmt: skip
    assert drafting_counts(text) is None
    text += ('# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n'
             'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 9.0\n')  # fmt: skip
    assert drafting_counts(text) == {"drafts": 5, "drafted_tokens": 15, "accepted_tokens": 9}


@pytest.mark.parametrize("value", ["suffix", "draft:/models/tiny", "fast", 3])
def test_plan_refuses_a_speculative_it_does_not_offer_naming_the_field(value):
    with TestClient(create_app(Settings())) as client:
        response = client.post("/plan", json={"device": {"profile": GW17}, "speculative": value})
    assert response.status_code == 422
    assert "speculative" in response.text


def test_plan_drafts_with_ngram_when_asked():
    with TestClient(create_app(Settings())) as client:
        plan = client.post("/plan", json={"device": {"profile": GW17}, "speculative": "ngram"}).json()
    assert plan["speculative"]["method"] == "ngram"
    config = json.loads(plan["vllm"]["args"][plan["vllm"]["args"].index("--speculative-config") + 1])
    assert config["method"] == "ngram"
    assert config["num_speculative_tokens"] == plan["speculative"]["num_speculative_tokens"]
