"""A W4A8 conversion solved by GPTQ after smoothing (kernels/convert/gptq_pass.py, `rounding: gptq`) on the default
model: what the checkpoint holds, and what the converter refuses. Two calibration windows keep it fast; the quality
is measured by benchmarks/w4a8_gptq.py (docs/reports/2026-12-07-w4a8-gptq.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from edge.errors import InputError
from edge.plan.engine_config import W4A8_ROUNDING
from kernels.convert.convert import convert
from kernels.ops.gptq import dequantize_gptq, zeros_of
from kernels.vllm_plugin.cpu_w4a8 import quantization_config

ROUNDING = {**W4A8_ROUNDING, "calibration_windows": 2}


@pytest.fixture(scope="module")
def source():
    from kernels.source.default_model import ensure_default_model

    return ensure_default_model(log=lambda message: None)


@pytest.fixture(scope="module")
def solved(source, tmp_path_factory):
    dst = tmp_path_factory.mktemp("gptq") / "w4a8"
    qconfig = quantization_config(group_size=32, sym=False, rounding=ROUNDING)
    return convert(source, dst, qconfig, path="w4a8-gptq", log=lambda message: None)


def tensors(directory) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def test_the_config_says_how_it_was_rounded(solved):
    qconfig = json.loads((solved / "config.json").read_text())["quantization_config"]
    assert qconfig["sym"] is False and qconfig["checkpoint_format"] == "gptq_v2"
    assert {key: qconfig[key] for key in ROUNDING} == ROUNDING


def test_every_linear_has_its_own_zeros_and_stays_near_the_source(solved, source):
    written, original = tensors(solved), tensors(source)
    prefix = "model.layers.3.self_attn.o_proj"  # no scale folds into o_proj: its weight is the source's, re-rounded
    zeros = zeros_of(written[f"{prefix}.qzeros"])
    assert int(zeros.min()) >= 0 and int(zeros.max()) <= 15 and len(torch.unique(zeros)) > 2  # not uint4b8's 8
    weight = dequantize_gptq(written, 32, prefix=prefix, sym=False)  # [N, K]
    reference = original[f"{prefix}.weight"].float()
    relative = float((weight - reference).norm() / reference.norm())
    assert relative < 0.2, relative  # 4-bit rounding of the weight itself (GPTQ trades some of it for the output's)


def test_the_norms_carry_the_smoothing_scales(solved, source):
    written, original = tensors(solved), tensors(source)
    name = "model.layers.0.input_layernorm.weight"
    assert written[name].dtype == torch.bfloat16
    assert not torch.equal(written[name], original[name])
    assert torch.equal(written["model.norm.weight"], original["model.norm.weight"])  # the final norm feeds the head


def test_calibration_never_reads_the_windows_edge_eval_scores(source):
    from transformers import AutoTokenizer

    from kernels.convert.gptq_pass import WINDOW, calibration_windows
    from kernels.scoring.eval_text import make_windows, read_text, tokenize

    tokenizer = AutoTokenizer.from_pretrained(source)
    ids, bos = tokenize(tokenizer, read_text(None).content)
    scored = make_windows(ids, 16384, 512, bos, text="default")  # edge-eval's default
    calibration = calibration_windows(tokenizer, W4A8_ROUNDING["calibration_windows"])
    assert calibration.shape == (W4A8_ROUNDING["calibration_windows"], WINDOW)
    first_calibrated = len(ids) - calibration.numel()
    assert first_calibrated > scored.numel()  # the scored tokens are the text's first ones
    assert torch.equal(calibration[0, 1:], torch.tensor(ids[first_calibrated + 1 : first_calibrated + WINDOW]))


def test_more_windows_than_half_the_text_is_refused_naming_the_field(source):
    from transformers import AutoTokenizer

    from kernels.convert.gptq_pass import calibration_windows

    with pytest.raises(InputError, match="calibration.windows"):
        calibration_windows(AutoTokenizer.from_pretrained(source), 10_000)


def test_a_gguf_source_is_not_solved_by_gptq(tmp_path):
    from kernels.source.default_model import source_gguf

    qconfig = quantization_config(group_size=32, sym=False, rounding=ROUNDING)
    with pytest.raises(InputError, match="quantization_config.rounding"):
        convert(source_gguf(), tmp_path / "w4a8", qconfig, path="w4a8-gptq", log=lambda message: None)
    assert not (tmp_path / "w4a8").exists()


def test_a_fold_into_a_layer_kept_in_float_is_written_whole(source, tmp_path):
    """q/k/v kept bf16 (`ignore`) while the input norm is smoothed: both are written scaled, so their product, the
    function, is the source's."""
    qconfig = quantization_config(group_size=32, sym=False, rounding=ROUNDING, ignore=["q_proj"])
    dst = convert(source, tmp_path / "w4a8", qconfig, path="w4a8-gptq", log=lambda message: None)
    written, original = tensors(dst), tensors(source)
    norm = "model.layers.5.input_layernorm.weight"
    for kept in ("model.layers.5.self_attn.q_proj.weight", "model.layers.5.self_attn.v_proj.weight"):
        assert written[kept].dtype == torch.bfloat16, kept  # kept in float with its fused siblings
        product = written[kept].float() * written[norm].float()[None, :]
        reference = original[kept].float() * original[norm].float()[None, :]
        assert float((product - reference).norm() / reference.norm()) < 0.01, kept
    assert not torch.equal(written[norm], original[norm])
