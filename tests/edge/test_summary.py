"""The human summary of a plan (`edge-select` without --json), as people read it: a pinned path says it was
pinned, and a path the device cannot run is one line naming its layouts, not one line per layout."""

from __future__ import annotations

from edge.cli import render
from edge.device.describe import load_device
from edge.model.reader import default_model
from edge.plan.planner import make_plan
from tests.edge.conftest import DATA


def _lines(plan, prefix: str) -> list[str]:
    return [line.strip() for line in render(plan).splitlines() if line.strip().startswith(prefix)]


def test_a_pinned_path_says_it_was_pinned_not_chosen(zen5):
    plan = make_plan(zen5, default_model(), path="bf16")
    assert plan.reasons[0].text == "pinned by --path bf16: bf16 on an avx512 CPU (priority speed did not choose it)"
    assert "- pinned by --path bf16" in render(plan)
    assert "priority speed on an avx512 CPU chose" not in render(plan)


def test_a_pinned_layout_names_the_layout(zen5):
    plan = make_plan(zen5, default_model(), layout="dual")
    assert plan.reasons[0].text.startswith("pinned by --layout dual: w4a16-tinygemm/dual")


def test_an_unpinned_plan_says_the_priority_chose(zen5):
    plan = make_plan(zen5, default_model(), priority="fidelity")
    assert plan.reasons[0].text.startswith("priority fidelity on an avx512 CPU chose ")


def test_a_phone_gets_one_line_per_refused_path_listing_its_layouts():
    plan = make_plan(load_device((DATA / "device_phone.json").read_text()), default_model())
    refused = _lines(plan, "not here")
    assert len(refused) == 3  # w4a16-tinygemm, bf16, w4a8-gptq: not five
    [tinygemm] = [line for line in refused if "w4a16-tinygemm" in line]
    assert tinygemm.startswith("not here  w4a16-tinygemm (")
    assert all(layout in tinygemm.split(":")[0] for layout in ("direct", "dual", "kernel-only"))
    assert tinygemm.count("vLLM has no phone/NPU backend") == 1
    assert all(line.count("no phone/NPU backend") == 1 for line in refused)


def test_a_path_without_layouts_is_named_alone(zen5):
    refused = _lines(make_plan(zen5, default_model()), "not here")
    assert "not here  export-only: export-only is for phones" in " ".join(refused)
    paths = [line.split()[2].rstrip(":") for line in refused]
    assert len(paths) == len(set(paths))
