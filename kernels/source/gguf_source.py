"""Read a GGUF's tensors as they are: HF names and row order, the cpu_int4 grid of its 4-bit blocks (and Q8_0's
int8 codes) without re-quantizing, and any supported type dequantized.

Architectures (`general.architecture`): llama (Mistral and SmolLM files are written as llama too), qwen2, qwen3,
gemma2, gemma3, phi3. Types: the ones in the files people download, SUPPORTED below. Anything else is refused by
`read_gguf` itself, naming the field or the tensor, before any conversion starts.

The 4-bit grids, FOUR_BIT_GRIDS (cpu_int4 at group 32, kernels/ops/int4.py: w = (q - 8) * scale + zero):
    Q4_0  w = d*(q - 8)                scale = d,        zero = 0
    Q4_1  w = d*q + m                  scale = d,        zero = m + 8d
    Q4_K  w = d*sc_j*q - dmin*m_j      scale = d*sc_j,   zero = 8*d*sc_j - dmin*m_j     (sub-block j of 32)
scale and zero are exact in float32: d*sc_j and dmin*m_j are fp16 times a 6-bit integer, and a sum or difference of
such values (multiples of 2^-24, fp16's smallest step) is exact in float32's 24-bit significand below 1 in magnitude,
as every zero is. The one loss is rounding them to bf16, the kernel's dtype. With them unrounded,
(q - 8)*scale + zero is the same exact value gguf-py's float32 dequantization rounds once, so the two agree bit for
bit (tests/kernels/test_gguf_source.py checks it per type, and reports what bf16 adds).
The 8-bit grids, INT8_GRIDS (int8 per group, kernels/ops/int8.py: w = q * scale):
    Q8_0  w = d*q          q in -128..127     scale = d per 32
    Q5_0  w = d*(q - 16)   q - 16 in -16..15  scale = d per 32
    Q4_0  w = d*(q - 8)    q - 8 in -8..7     scale = d per 32
    Q6_K  w = d*sc_j*(q - 32)                 scale = d*sc_j per sub-block j of 16 (sc_j int8)
come back as int8 codes and float32 scales, exact: each scale is fp16 times an integer of at most 8 bits, and each
weight that scale times an integer of at most 8 bits, so gguf-py's float32 value is the product unrounded and the
code is that value divided by the scale (`int8_tensors` checks both, per chunk of rows).

Block layouts, read in gguf-py's gguf/quants.py (`*.dequantize_blocks`):
    Q4_0  32 weights: fp16 d | 16 bytes qs                 byte i: element i in the low nibble, i+16 in the high
    Q4_1  32 weights: fp16 d | fp16 m | 16 bytes qs        same nibble order
    Q8_0  32 weights: fp16 d | 32 int8 qs
    Q4_K  256 weights: fp16 d | fp16 dmin | 12 bytes of 6-bit (sc, m) for 8 sub-blocks | 128 bytes qs
          bytes 32p..32p+31 of qs hold sub-block 2p in their low nibbles and sub-block 2p+1 in their high ones
          (element i of the sub-block in byte 32p + i); the 12 scale bytes b: for j < 4, sc_j = b[j] & 63 and
          m_j = b[j+4] & 63; for j >= 4, the low 4 bits are b[j+4]'s low (sc) or high (m) nibble and the top 2
          bits are those of b[j-4] (sc) or b[j] (m)
Q5_0, Q5_1, Q5_K, Q6_K (and the floats) are read through `dequantized` only: gguf-py's own dequantize does it.

Orientation: GGUF lists dims innermost first ([K, N]); rows are output channels and blocks run along K, so
the HF [N, K] weight is the file's row-major data and a block never straddles two rows.

Names and row order follow transformers' legacy GGUF loader (transformers/modeling_gguf_pytorch_utils.py), which
built the bf16 default model: names from gguf-py's `get_tensor_name_map` applied to the HF module names of the
architecture (`_ARCHITECTURES`), and two per-architecture undos of what llama.cpp's converter did:
  - llama only: the rotary permutation of attn_q (num_attention_heads) and attn_k (num_key_value_heads) rows
    (`LlamaTensorProcessor`). It moves whole rows, so it is applied to rows of codes, scales and zeros alike
    (`rotary_row_order`). Qwen, Gemma and Phi-3 use the NeoX rotary layout, which llama.cpp stores unpermuted.
  - gemma2 and gemma3: every norm weight (the layer norms, the final norm, and Gemma 3's q_norm / k_norm) is
    stored as 1 + w (`Gemma2TensorProcessor`: "norm.weight" in the GGUF name); 1 is subtracted in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge.errors import InputError

# codes copied: cpu_int4 at group 32, cpu_w4a8's GPTQ tensors (symmetric), int8 per group
from edge.model.gguf_metadata import FOUR_BIT_GRIDS, INT8_GRIDS, SYMMETRIC_FOUR_BIT_GRIDS
from kernels.ops import q4k

BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block and per Q4_K sub-block: the cpu_int4 group size we return
FLOATS = ("F32", "F16", "BF16")
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED = FLOATS + QUANTIZED
# their codes go to cpu_int4 at group 32 unchanged (the one list: edge.model.gguf_metadata, which the planner reads)
ZERO_CODE = 8  # cpu_int4's w = (q - 8) * scale + zero
_K_SCALE_BYTES = 12  # Q4_K's packed 6-bit scales and mins


@dataclass(frozen=True)
class _Architecture:
    layer_modules: tuple[str, ...]  # HF module names inside model.layers.N
    rotary_permuted: bool = False  # llama.cpp permuted q/k rows (transformers' LlamaTensorProcessor undoes it)
    norm_offset: float = 0.0  # llama.cpp stored norm weights as offset + w (Gemma)


_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_ARCHITECTURES = {  # general.architecture -> what its tensors are called and how llama.cpp stored them
    "llama": _Architecture(_NORMS + _ATTENTION + _MLP, rotary_permuted=True),
    "qwen2": _Architecture(_NORMS + _ATTENTION + _MLP),  # q/k/v carry biases
    "qwen3": _Architecture(_NORMS + _ATTENTION + _QK_NORMS + _MLP),
    "gemma2": _Architecture(_GEMMA_NORMS + _ATTENTION + _MLP, norm_offset=1.0),
    "gemma3": _Architecture(_GEMMA_NORMS + _ATTENTION + _QK_NORMS + _MLP, norm_offset=1.0),
    "phi3": _Architecture(_NORMS + ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")),
}
ARCHITECTURES = tuple(_ARCHITECTURES)
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass(frozen=True)
class GgufTensor:
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # e.g. blk.0.attn_q.weight
    type: str  # GGML type name: Q4_1, Q8_0, F32, ... (one of SUPPORTED)
    shape: tuple[int, ...]  # HF orientation: [N, K] for a matrix, [N] for a vector
    rotary_heads: int | None  # heads whose rows llama.cpp permuted (q: attention heads, k: kv heads), else None
    data: np.ndarray = field(repr=False)  # the file's data, memory-mapped: [N, row bytes] uint8 if quantized or BF16
    norm_offset: float = 0.0  # llama.cpp stored this norm as norm_offset + w (Gemma: 1.0); undone when read


@dataclass(frozen=True)
class GgufModel:
    path: Path
    architecture: str  # general.architecture: one of ARCHITECTURES
    num_heads: int
    num_kv_heads: int
    tensors: dict[str, GgufTensor]  # by HF name, in file order
    unmapped: tuple[str, ...]  # GGUF tensors without an HF name (skipped, as transformers skips them)

    @property
    def tied(self) -> bool:
        """No output.weight in the file: lm_head is the embedding."""
        return "lm_head.weight" not in self.tensors


def read_gguf(path: str | Path, reader=None) -> GgufModel:
    """The tensors' HF names, types and shapes, from the header only (data stays memory-mapped, nothing is
    dequantized). Refuses an architecture or a tensor type not read here. Takes ~3-4 s on the default model here:
    gguf-py parses the 49152-token vocabulary field by field. `reader`: gguf-py's reader of the same file, already
    made (edge.model.gguf_metadata.read_header's), so the header is parsed once."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise InputError("gguf", str(path), "an existing GGUF file")
    try:
        reader = reader if reader is not None else gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as error:  # bad magic, version, unknown type number
        raise InputError("gguf", str(path), f"a readable GGUF file ({error})") from None
    if reader.byte_order != "I":
        raise InputError("gguf", str(path), "a little-endian GGUF file")
    architecture = _field(reader, "general.architecture", path)
    spec = _ARCHITECTURES.get(architecture)
    if spec is None:
        raise InputError("general.architecture", architecture,
                         f"one of {', '.join(ARCHITECTURES)} (the names and row orders known here; Mistral and "
                         "SmolLM files are llama)")  # fmt: skip
    layers = int(_field(reader, f"{architecture}.block_count", path))
    heads = int(_field(reader, f"{architecture}.attention.head_count", path))
    kv_heads = int(_field(reader, f"{architecture}.attention.head_count_kv", path, default=heads))

    to_hf = _hf_names(architecture, layers)
    tensors: dict[str, GgufTensor] = {}
    unmapped: list[str] = []
    for t in reader.tensors:
        hf_name, module = to_hf.get(t.name, (None, ""))
        if hf_name is None:
            unmapped.append(t.name)
            continue
        kind = t.tensor_type.name
        if kind not in SUPPORTED:
            raise InputError(hf_name, f"{t.name} of type {kind}", f"one of the types read here: {', '.join(SUPPORTED)}")
        rotary = None
        if spec.rotary_permuted:
            rotary = heads if module.endswith(".q_proj") else kv_heads if module.endswith(".k_proj") else None
        offset = spec.norm_offset if module.endswith("norm") and hf_name.endswith(".weight") else 0.0
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF [K, N] -> HF [N, K]
        tensors[hf_name] = GgufTensor(hf_name, t.name, kind, shape, rotary, t.data, offset)
    return GgufModel(path, architecture, heads, kv_heads, tensors, tuple(unmapped))


def rotary_row_order(rows: int, heads: int) -> np.ndarray:
    """Row indices undoing llama.cpp's q/k permutation: hf[r] = gguf[order[r]] (int64 [rows]).

    Same as transformers' `_reverse_permute_weights` (reshape [heads, rows/heads/2, 2], swap the last two axes)
    applied to arange(rows): within each head, GGUF interleaves the two rotary halves; HF keeps them apart.
    """
    if rows % (2 * heads):
        raise InputError("rows", rows, f"a multiple of 2 x {heads} heads")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def cpu_int4_tensors(model: GgufModel, hf_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K tensor as cpu_int4 at group 32: (qweight uint8 [N, K/2], scales bf16 [N, K/32], zeros bf16
    [N, K/32]), the file's codes unchanged; scale and zero as in the module docstring, computed in float32 (exact)
    and rounded once to bf16."""
    t = _tensor(model, hf_name, FOUR_BIT_GRIDS, "cpu_int4_tensors")
    codes, scales, zeros = _grid(t)  # uint8 [N, K] in 0..15; float32 [N, K/32] twice
    pairs = codes.reshape(t.shape[0], -1, 2)  # [N, K/2, 2]
    qweight = pairs[..., 0] | (pairs[..., 1] << 4)  # [N, K/2] uint8: k=2j low nibble, k=2j+1 high
    return (
        torch.from_numpy(np.ascontiguousarray(qweight)),
        torch.from_numpy(scales).to(torch.bfloat16),
        torch.from_numpy(zeros).to(torch.bfloat16),
    )


def gptq_codes(model: GgufModel, hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor on a symmetric 4-bit grid (SYMMETRIC_FOUR_BIT_GRIDS: Q4_0, w = d * (q - 8)) as GPTQ's uint4b8 at
    group 32: (codes uint8 [N, K] in 0..15, scales float32 [N, K/32] = d), exact (kernels.ops.gptq.gptq_from_codes
    packs them; the scale's rounding to bf16 is its only loss)."""
    t = _tensor(model, hf_name, SYMMETRIC_FOUR_BIT_GRIDS, "gptq_codes")
    codes, scales, zeros = _grid(t)
    assert not zeros.any(), f"{hf_name}: a symmetric grid has no zero"
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales)


def int8_tensors(
    model: GgufModel, hf_name: str, group: int = BLOCK, chunk_rows: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor on one of INT8_GRIDS as (codes int8 [N, K], scales float32 [N, K/group]), exact: w = code * scale.
    `group` must divide the type's own group (a Q8_0's scales at group 16 repeat each block's twice; a Q6_K at 32
    would re-round, so it is refused). Read `chunk_rows` rows at a time: one chunk is in float32 at once."""
    t = _tensor(model, hf_name, tuple(INT8_GRIDS), "int8_tensors")
    own = INT8_GRIDS[t.type]
    if group <= 0 or own % group:
        raise InputError("group", group, f"a divisor of {t.type}'s own group {own} (its codes copied exactly)")
    from gguf import GGMLQuantizationType

    n, k = t.shape
    blocks = _blocks(t)  # [N, K/block, block bytes], rows in HF order
    if t.type == "Q6_K":  # ql 128 | qh 64 | int8 scales 16 | fp16 d
        d = _fp16(blocks, 208)  # [N, K/256]
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [N, K/256, 16]
        scales = (d[..., None] * sc).reshape(n, k // own)  # [N, K/16]: fp16 x int8, exact in float32
    else:
        scales = _fp16(blocks, 0)  # [N, K/32]
    codes = np.empty((n, k), dtype=np.int8)
    kind = GGMLQuantizationType[t.type]
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        values = _decoded(blocks[start:stop].reshape(stop - start, -1), kind, 0.0)  # [rows, K] float32
        step = np.repeat(scales[start:stop], own, axis=1)  # [rows, K]
        with np.errstate(divide="ignore", invalid="ignore"):
            chunk = np.where(step != 0, np.rint(values / step), 0)
        assert np.array_equal(chunk * step, values), f"{hf_name}: {t.type} codes are not exact in int8 per {own}"
        codes[start:stop] = chunk
    return torch.from_numpy(codes), torch.from_numpy(np.repeat(scales, own // group, axis=1))


def float_tensor(model: GgufModel, hf_name: str) -> torch.Tensor:
    """An F16/BF16/F32 tensor (norms, or unquantized weights) in its own dtype, HF shape, q/k rows reordered.
    A Gemma norm comes back with llama.cpp's +1 undone, in float32 (w - 1 is exact there; in F16/BF16 it would not
    be: an F32 norm, which is what llama.cpp writes, keeps its dtype)."""
    t = _tensor(model, hf_name, FLOATS, "float_tensor")
    if t.type == "BF16":  # the reader gives raw bytes: numpy has no bfloat16
        values = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        values = torch.from_numpy(np.array(t.data))  # a copy: the memory map is read-only
    values = values.reshape(t.shape)
    if t.rotary_heads:
        values = values[torch.from_numpy(rotary_row_order(t.shape[0], t.rotary_heads))]
    if t.norm_offset:
        values = values.to(torch.float32) - t.norm_offset
    return values


def dequantized(
    model: GgufModel, hf_name: str, dtype: torch.dtype = torch.bfloat16, chunk_rows: int = 4096
) -> torch.Tensor:
    """Any supported tensor as floats [N, K] (or [N]) in `dtype`, HF orientation and row order (q/k rows reordered,
    Gemma's norm offset undone), decoded by gguf-py's `gguf.quants.dequantize` `chunk_rows` rows at a time: at most
    one chunk is in float32 at once (besides the result, when `dtype` is float32). Equals transformers' legacy
    loader's tensor (float32 dequantization, then the same undos) rounded once to `dtype`."""
    from gguf import GGMLQuantizationType

    t = _tensor(model, hf_name, SUPPORTED, "dequantized")
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise InputError("chunk_rows", chunk_rows, "a positive whole number of rows")
    kind = GGMLQuantizationType[t.type]
    out = torch.empty(t.shape, dtype=dtype)
    order = rotary_row_order(t.shape[0], t.rotary_heads) if t.rotary_heads else None
    if len(t.shape) == 1:  # a vector (a norm, a bias): one chunk; a q/k bias has its elements permuted
        values = _decoded(t.data.reshape(1, -1), kind, t.norm_offset)[0]  # float32 [N]
        out.copy_(torch.from_numpy(values if order is None else values[order]))
        return out
    rows, flat_out = t.data.reshape(t.shape[0], -1), out.view(t.shape[0], -1)  # [N, row bytes], [N, K]
    for start in range(0, t.shape[0], chunk_rows):
        stop = min(start + chunk_rows, t.shape[0])
        raw = rows[start:stop] if order is None else rows[order[start:stop]]  # whole rows: blocks stay whole
        flat_out[start:stop] = torch.from_numpy(_decoded(raw, kind, t.norm_offset))
    return out


def _decoded(raw: np.ndarray, kind, norm_offset: float) -> np.ndarray:
    """gguf-py's float32 dequantization of raw rows [rows, row bytes] -> [rows, K], offset undone, writable."""
    from gguf import quants

    values = quants.dequantize(raw, kind)  # float32 [rows, K]
    if norm_offset:
        return values - np.float32(norm_offset)  # a new array
    return values if values.flags.writeable else values.copy()  # F32 straight from the memory map: copy the chunk


def _tensor(model: GgufModel, hf_name: str, types: tuple[str, ...], reader: str) -> GgufTensor:
    t = model.tensors.get(hf_name)
    if t is None:
        tied = " (tied: lm_head is model.embed_tokens.weight)" if hf_name == "lm_head.weight" and model.tied else ""
        raise InputError("hf_name", hf_name, f"a tensor of {model.path.name}{tied}")
    if t.type not in SUPPORTED:
        raise InputError(hf_name, f"{t.gguf_name} of type {t.type}", f"one of the types read here: {SUPPORTED}")
    if t.type not in types:
        raise InputError(hf_name, f"{t.gguf_name} of type {t.type}", f"a {'/'.join(types)} tensor for {reader}()")
    if reader != "dequantized" and t.type in QUANTIZED and len(t.shape) != 2:
        raise InputError(hf_name, t.shape, "a 2-D quantized tensor [N, K]")
    return t


def _grid(t: GgufTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit tensor's codes uint8 [N, K] (0..15, K order), scales and zeros float32 [N, K/32], rows in HF order:
    w = (q - 8) * scale + zero, exactly gguf-py's value before its float32 rounding."""
    n, k = t.shape
    blocks = _blocks(t)  # [N, K/block, block bytes]
    d = _fp16(blocks, 0)  # [N, K/block] float32
    if t.type == "Q4_K":
        dmin = _fp16(blocks, 2)
        sc, mins = q4k.k_scales(blocks[..., 4 : 4 + _K_SCALE_BYTES])  # [N, K/256, 8] uint8 each, 0..63
        qs = blocks[..., 4 + _K_SCALE_BYTES :].reshape(n, -1, 4, 32)  # [N, K/256, pair p, 32]
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [N, K/256, p, 2, 32]: sub-block 2p low, 2p+1 high
        scales = (d[..., None] * sc).reshape(n, -1)  # [N, K/32] float32: fp16 x 6-bit integer, exact
        zeros = ZERO_CODE * scales - (dmin[..., None] * mins).reshape(n, -1)  # exact: see the module docstring
        return codes.reshape(n, k), scales, zeros
    qs = blocks[..., -16:]  # [N, K/32, 16] uint8: element i low nibble, element i+16 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32] uint8 in 0..15, in K order
    # Q4_1: d and m are fp16 (multiples of 2^-24), so m + 8d is exact in float32 while |m + 8d| < 1 (every weight
    # here): the only rounding is the one to bf16.
    zeros = _fp16(blocks, 2) + ZERO_CODE * d if t.type == "Q4_1" else np.zeros_like(d)  # [N, K/32] float32
    return codes.reshape(n, k), d, zeros


def q4k_tensors(model: GgufModel, hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K tensor as its own blocks (kernels/ops/q4k.py from_blocks): (qweight uint8 [N, K/2], cpu_int4_tensors'
    codes; meta uint8 [N, K/256 * 16], each block's d, dmin and 12 scale bytes as the file holds them)."""
    return q4k.from_blocks(np.ascontiguousarray(_blocks(_tensor(model, hf_name, ("Q4_K",), "q4k_tensors"))))


def own_blocks(model: GgufModel, hf_name: str, type_name: str) -> torch.Tensor:
    """A tensor's blocks as the file holds them, uint8 [N, K/block * block bytes], rows in HF order; InputError when
    the file holds it in another type than `type_name`."""
    t = _tensor(model, hf_name, (type_name,), "own_blocks")
    return torch.from_numpy(np.array(_blocks(t), copy=True).reshape(t.shape[0], -1))  # out of the read-only map


def _blocks(t: GgufTensor) -> np.ndarray:
    """The tensor's blocks as uint8 [N, K/block, block bytes], rows in HF order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n, k = t.shape
    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.type]]
    blocks = t.data.reshape(n, k // size, nbytes)
    if t.rotary_heads:
        blocks = blocks[rotary_row_order(n, t.rotary_heads)]  # whole rows: a block never straddles two
    return blocks


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of every block, as float32 [N, K/block] (exact)."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _hf_names(architecture: str, layers: int) -> dict[str, tuple[str, str]]:
    """GGUF tensor name -> (HF tensor name, HF module name), through gguf-py's name map for the architecture."""
    import gguf

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = gguf.get_tensor_name_map(arch, layers)
    per_layer = _ARCHITECTURES[architecture].layer_modules
    modules = [*_MODEL_MODULES, *(f"model.layers.{i}.{module}" for i in range(layers) for module in per_layer)]
    names: dict[str, tuple[str, str]] = {}
    for module in modules:
        base = name_map.get_name(module)
        if base is not None:  # e.g. gemma2 has no output tensor: always tied
            for suffix in (".weight", ".bias"):
                names[base + suffix] = (module + suffix, module)
    return names


def _field(reader, key: str, path: Path, default=None):
    """A scalar or string metadata value, read through `parts` (which every gguf-py release has)."""
    import gguf

    value = reader.fields.get(key)
    if value is None:
        if default is None:
            raise InputError(key, "missing", f"a metadata field of {path.name}")
        return default
    part = value.parts[value.data[0]]
    return bytes(part).decode() if value.types[0] == gguf.GGUFValueType.STRING else part[0].item()
