"""What a plan drafts (edge.plan.speculative): off unless asked, n-gram with as many drafted tokens as keep a verify
pass on the decode kernel, `auto` only on a measurement of the device's class, refusals that name the field, and
the attention in one pass for every row in every plan (the greedy text then does not depend on drafting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.catalog.kernel_registry import decode_rows
from edge.device.calibration import CalibrationRecord
from edge.device.describe import load_device_file
from edge.errors import InputError
from edge.facts import FACTS, MeasuredFact
from edge.measure.quality import shipped_records
from edge.model.reader import default_model
from edge.plan import speculative
from edge.plan.engine_config import ATTENTION_ENV
from edge.plan.planner import make_plan
from edge.plan.speculative import DRAFTING_ENV

DATA = Path(__file__).parent / "data"
# the Zen 4 record timed the AVX2 int8-activation decode kernel faster: its speed plan decodes on it
ZEN4 = load_device_file(str(DATA / "cpuinfo_epyc_zen4_avx512.txt"))
ZEN4_RECORD = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_zen4.json").read_text())
PHONE = load_device_file(str(DATA / "device_phone.json"))


def plan(device=ZEN4, **options):
    return make_plan(device, default_model(), quality=shipped_records(), calibration=ZEN4_RECORD, **options)


def speculative_config(p) -> dict | None:
    args = p.vllm.args
    return json.loads(args[args.index("--speculative-config") + 1]) if "--speculative-config" in args else None


def test_a_plan_drafts_nothing_unless_asked():
    p = plan()
    assert p.speculative.method == "off" and speculative_config(p) is None


def test_ngram_drafts_as_many_tokens_as_keep_the_verify_pass_on_the_decode_kernel():
    p = plan(speculative="ngram")
    kernel = p.quantization_config["decode_kernel"]
    rows = decode_rows(kernel)
    assert rows is not None and rows >= 2, "the Zen 4 record's speed plan decodes on an AVX2 kernel"
    config = speculative_config(p)
    assert config == {"method": "ngram", "num_speculative_tokens": rows - 1,
                      "prompt_lookup_min": speculative.PROMPT_LOOKUP_MIN,
                      "prompt_lookup_max": speculative.PROMPT_LOOKUP_MAX}  # fmt: skip
    assert p.speculative.num_speculative_tokens == rows - 1
    assert any(kernel in r.text for r in p.reasons), "the plan says why it drafts that many"


@pytest.mark.parametrize("asked", ["off", "ngram"])
def test_every_served_plan_attends_in_one_pass_so_drafting_never_changes_greedy_text(asked):
    assert plan(speculative=asked).vllm.env.items() >= ATTENTION_ENV.items()


def test_auto_drafts_nothing_on_a_class_without_a_measurement(monkeypatch):
    for key in [k for k in FACTS if ".speculative." in k]:
        monkeypatch.delitem(FACTS, key)
    p = plan(speculative="auto")
    assert p.speculative.method == "off" and speculative_config(p) is None
    assert "not measured on the avx512 class" in p.speculative.reasons[0].text


def _measured(monkeypatch, open_ratio: float, quoting: float) -> None:
    for name, value in (("open_ratio", open_ratio), ("quoting_ratio", quoting)):
        key = f"avx512.speculative.ngram.{name}"
        monkeypatch.setitem(FACTS, key, MeasuredFact(key=key, value=value, unit="x", source="here",
                                                     isa_class="avx512", date="2026-12-07", note="test"))  # fmt: skip


def test_auto_drafts_where_the_class_measured_a_gain_at_no_cost(monkeypatch):
    _measured(monkeypatch, open_ratio=0.99, quoting=1.8)
    p = plan(speculative="auto")
    assert p.speculative.method == "ngram" and speculative_config(p)["method"] == "ngram"
    assert [r.fact for r in p.speculative.reasons[:2]] == ["avx512.speculative.ngram.quoting_ratio",
                                                           "avx512.speculative.ngram.open_ratio"]  # fmt: skip


@pytest.mark.parametrize(("open_ratio", "quoting"), [(0.95, 1.8), (1.0, 1.2)])
def test_auto_drafts_nothing_where_open_text_loses_or_quoting_gains_too_little(monkeypatch, open_ratio, quoting):
    _measured(monkeypatch, open_ratio, quoting)
    p = plan(speculative="auto")
    assert p.speculative.method == "off" and speculative_config(p) is None
    assert f"x{open_ratio:.2f}" in p.speculative.reasons[0].text


@pytest.mark.parametrize("asked", ["suffix", "draft:/models/tiny", "eagle", "", 4])
def test_a_speculative_not_offered_is_refused_naming_the_field(asked):
    with pytest.raises(InputError) as refused:
        plan(speculative=asked)
    assert refused.value.field == "speculative"


def test_a_plan_no_engine_serves_drafts_nothing():
    p = make_plan(PHONE, default_model(), quality=shipped_records(), speculative="ngram")
    assert p.vllm is None and p.speculative.method == "off"


def test_a_drafting_plan_keeps_numba_off_the_engines_openmp_threads_and_drafts_for_one_sequence():
    env = plan(speculative="ngram").vllm.env
    assert env.items() >= DRAFTING_ENV.items() and env["EDGE_DRAFT_MAX_SEQS"] == "1"
    assert not (DRAFTING_ENV.keys() | {"EDGE_DRAFT_MAX_SEQS"}) & plan().vllm.env.keys()


def test_the_ledger_counts_the_proposer_only_where_the_plan_drafts():
    drafting_items = [i for i in plan(speculative="ngram").memory.items if i.kind == "drafting"]
    assert [i.bytes for i in drafting_items] == [int(FACTS[speculative.DRAFTING_BYTES_FACT].value)]
    assert plan(speculative="ngram").memory.resident_bytes - plan().memory.resident_bytes == drafting_items[0].bytes
    assert not [i for i in plan().memory.items if i.kind == "drafting"]
