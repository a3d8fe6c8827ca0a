"""A real Q4_K_M's plan with the file's own blocks: the default model's weights quantized by llama.cpp to Q4_K_M
(tests/edge/data/models/smollm2-Q4_K_M.header.json: its header, the chat template dropped). Its rows are 576 wide,
not a multiple of 256, so llama.cpp falls back: 166 Q5_0, 16 Q4_K, 14 Q6_K, 15 Q8_0 (the 14 layers whose v_proj is
Q8_0 beside Q5_0 q_proj and k_proj). On a plan that decodes on int8 activations every linear keeps the file's blocks:
those 14 layers' q, k and v as Q8_0 (Q5_0 written unrounded as Q8_0), the other Q5_0 ones as Q5_0."""

import json
from pathlib import Path

import pytest

from edge.device.describe import load_device_file
from edge.measure.quality import QualityRecord, grid_key, quality_key
from edge.model.gguf_metadata import GGML_BLOCKS, header_from_json
from edge.model.reader import read_gguf_header
from edge.plan.planner import make_plan

DATA = Path(__file__).parent / "data"
HEADER = json.loads((DATA / "models" / "smollm2-Q4_K_M.header.json").read_text())
W4A16 = {"path": "w4a16-tinygemm", "layout": "direct"}


def _record(model: str, key: dict, kld: float) -> QualityRecord:
    return QualityRecord(model=model, key=key, kld_mean=kld, kld_mean_se=0.0001, top1_agreement=0.96,
                         top1_agreement_se=0.004, ppl_ratio=1.003, ppl_ratio_se=0.002, confident_flip_rate=0.001,
                         confident_flip_rate_se=0.0005, tokens=2048, evaluator=2)  # fmt: skip


@pytest.fixture(scope="module")
def planned():
    """(the model, the plain speed plan, the plan read against the grid's int8-activation record)."""
    device = load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt"))
    model = read_gguf_header(header_from_json(HEADER), "smollm2-Q4_K_M")
    plain = make_plan(device, model, priority="speed", **W4A16)
    grid = quality_key("w4a16-tinygemm", {**plain.quantization_config, "decode_kernel": "avx2-w4a8"})
    record = _record(model.name, grid, 0.0016)
    return device, model, plain, make_plan(device, model, priority="speed", quality=[record], **W4A16)


def _file_types() -> dict[str, str]:
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}  # fmt: skip
    types = {}
    for t in HEADER["tensors"]:
        parts = t["name"].split(".")
        if parts[0] == "blk" and parts[2] in names:
            types[f"model.layers.{parts[1]}.{names[parts[2]]}"] = t["type"]
    return types


def test_every_linear_keeps_a_block_type_and_a_q5_0_weight_fused_with_q8_0_takes_q8_0(planned):
    _, _, plain, lossy = planned
    assert plain.quantization_config["decode_kernel"] == "avx2"
    assert not {"q4k", "q6k", "q8_0", "q5_0"} & set(plain.quantization_config)
    config = lossy.quantization_config
    assert config["decode_kernel"] == "avx2-w4a8"
    types = _file_types()
    widened = {p.rsplit(".", 1)[0] for p, t in types.items() if p.endswith("v_proj") and t == "Q8_0"}
    assert len(widened) == 14
    expected = {key: set() for key in ("q4k", "q6k", "q8_0", "q5_0")}
    for prefix, held in types.items():
        fused_with_q8_0 = prefix.rsplit(".", 1)[0] in widened and prefix.endswith(("q_proj", "k_proj", "v_proj"))
        key = "q8_0" if fused_with_q8_0 else {"Q4_K": "q4k", "Q6_K": "q6k", "Q5_0": "q5_0"}[held]
        expected[key].add(prefix)
    for key, prefixes in expected.items():
        named = set(config[key])  # layer prefixes, or a kind that is so throughout by its name
        assert {p for p in types if p in named or p.rsplit(".", 1)[1] in named} == prefixes, key
    q_proj = next(layer for layer in lossy.layers if layer.name == "q_proj" and layer.blocks == "Q8_0")
    assert q_proj.count == 14 and "the file's Q5_0 written as Q8_0 blocks, unrounded" in q_proj.why


def test_the_ledger_counts_every_block_at_its_types_bytes(planned):
    _, model, _, lossy = planned
    items = [i for i in lossy.memory.items if "blocks" in i.name and i.kind in ("int8-weights", "int4-weights",
                                                                            "row-major-copy")]
    by_layer = {}
    for layer in lossy.layers:
        if layer.blocks:
            weights, nbytes = GGML_BLOCKS[layer.blocks]
            by_layer.setdefault(layer.name, 0)
            by_layer[layer.name] += layer.count * layer.n * layer.k // weights * nbytes
    counted = {}
    for item in items:
        counted[item.layer] = counted.get(item.layer, 0) + item.bytes
    assert counted == by_layer
    # the linears' blocks hold no more than the file's own tensors, but the 14 layers' q and k widened to Q8_0
    held = [(t["shape"], *GGML_BLOCKS[t["type"]]) for t in HEADER["tensors"]
            if t["name"].startswith("blk.") and t["type"] in GGML_BLOCKS]  # fmt: skip
    file_bytes = sum(shape[0] * shape[1] // weights * nbytes for shape, weights, nbytes in held)
    widening = 14 * (576 + 192) * 576 // 32 * (34 - 22)
    assert sum(by_layer.values()) == file_bytes + widening


def test_the_blocks_plan_is_gated_by_the_grids_record_until_its_own_is_measured(planned):
    device, model, _, lossy = planned
    assert lossy.quality.status == "unmeasured"
    gate = next(r.text for r in lossy.reasons if r.text.startswith("decode rows on"))
    assert "with the 8-bit set on its grid" in gate and "edge-eval --plan PLAN measures them" in gate
    own = quality_key("w4a16-tinygemm", lossy.quantization_config)
    assert own != grid_key(own) and {"q8_0", "q5_0", "q6k"} <= set(own) and "q4k" not in own
    grid = _record(model.name, grid_key(own), 0.0016)
    measured = make_plan(device, model, priority="speed", quality=[grid, _record(model.name, own, 0.0038)], **W4A16)
    assert measured.quality.status == "measured" and measured.quality.record.kld_mean == pytest.approx(0.0038)
    assert "with the 8-bit set on its grid" not in next(r.text for r in measured.reasons
                                                        if r.text.startswith("decode rows on"))  # fmt: skip
    over = make_plan(device, model, priority="speed", quality=[grid, _record(model.name, own, 0.2)], **W4A16)
    assert over.quantization_config["decode_kernel"] == "avx2"  # its own record over the floor: no int8 activations
