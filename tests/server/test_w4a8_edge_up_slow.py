"""deploy/edge-up pinned to W4A8 with the REAL vLLM: on a host whose vLLM library runs int4_scaled_mm_cpu without
AMX (AVX-512 with AVX512-BF16 and VNNI: the plugin's cpu_w4a8), the plan, /status and every response name
w4a8-gptq, and "The capital of France is" still answers " Paris". Skipped, with the gate's reason, where W4A8
cannot run (AVX2: vLLM's _C_AVX2 has no such op). It also streams max_num_seqs + 2 completions at once through the
wrapper: every one completes.

The speed plan itself does not choose W4A8 for the default model: its measured quality (mean KLD 0.40, shipped
with the package) is over the speed floor; `--path` pins it as an operator would."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.load_test import engine_load
from tests.server.conftest import free_port
from tests.server.test_real_vllm import REPO, complete, get, ready, stop_wrapper, wait_for

pytestmark = pytest.mark.slow


def _refusal() -> str | None:
    from edge.device.probe import probe
    from edge.model.reader import default_model
    from edge.plan.gates import gate_w4a8

    gate = gate_w4a8(probe(measure_layout=False), default_model())
    return "; ".join(gate.refusals) or None


def test_edge_up_pinned_to_w4a8_serves_it_names_it_and_answers_paris(tmp_path: Path):
    if refusal := _refusal():
        pytest.skip(f"W4A8 cannot run on this host: {refusal}")
    port, log = free_port(), tmp_path / "edge-serve.log"
    env = {**os.environ, "EDGE_HEALTH_POLL_S": "2", "EDGE_READY_TIMEOUT_S": "1100"}
    with log.open("w") as out:
        process = subprocess.Popen(
            ["bash", str(REPO / "deploy" / "edge-up"), "--port", str(port), "--max-model-len", "512",
             "--path", "w4a8-gptq"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        wait_for(lambda: ready(url), process, log)
        status = get(f"{url}/status").json()
        assert status["weight_path"] == "w4a8-gptq" and status["engine"]["state"] == "ready"
        config = status["plan"]["quantization_config"]
        assert config["quant_method"] == "cpu_w4a8"  # the plugin's method, not vLLM's AMX-only gptq branch
        assert "--quantization" in status["plan"]["vllm"]["args"]
        model = get(f"{url}/v1/models").json()["data"][0]["id"]
        answer = complete(url, model)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Edge-Weight-Path"] == "w4a8-gptq"
        assert answer.json()["choices"][0]["text"].startswith(" Paris"), answer.json()["choices"][0]["text"]
        print(f"edge-up --path w4a8-gptq ready after {time.monotonic() - started:.0f} s")
        streams = status["plan"]["max_num_seqs"] + 2  # more than the engine runs at once: the rest queue
        load = engine_load(url, streams=streams, tokens=16)
        assert (load["completed"], load["lost"]) == (streams, 0), load
    finally:
        stop_wrapper(process)
