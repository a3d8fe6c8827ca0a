"""Read a Llama GGUF's quantized blocks as they are: the cpu_int4 grid (and int8 codes) without re-quantizing.

GGUF Q4_1 blocks of 32 weights hold d (fp16), m (fp16) and 4-bit codes q, meaning w = d*q + m: exactly the
cpu_int4 grid at group 32 (kernels/ops/int4.py: w = (q - 8) * scale + zero) with scale = d, zero = m + 8*d. Q4_0
(w = d*(q - 8)) is scale = d, zero = 0. The one loss is rounding scale and zero to bf16 (the kernel's dtype).
Q8_0 blocks (fp16 d, 32 int8 q, w = d*q) are returned as int8 codes and float32 scales (exact) for an 8-bit path.

Block layouts, read in gguf-py's gguf/quants.py (`Q4_0`, `Q4_1`, `Q8_0`.dequantize_blocks), 32 weights a block:
    Q4_0  fp16 d | 16 bytes qs                  byte j: element j in the low nibble, element j+16 in the high
    Q4_1  fp16 d | fp16 m | 16 bytes qs         same nibble order
    Q8_0  fp16 d | 32 int8 qs

Orientation: GGUF lists dims innermost first ([K, N]); rows are output channels and blocks run along K, so
the HF [N, K] weight is the file's row-major data and a block never straddles two rows.

Names and row order follow transformers' legacy GGUF loader, which built the bf16 default model
(transformers/modeling_gguf_pytorch_utils.py): names from `get_gguf_hf_weights_map` (gguf-py's
`get_tensor_name_map`, applied to the HF names), and `LlamaTensorProcessor._reverse_permute_weights`, which undoes
llama.cpp's rotary permutation of attn_q (num_attention_heads) and attn_k (num_key_value_heads) rows. That
permutation moves whole rows, so it is applied to rows of codes, scales and zeros alike (`rotary_row_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge.errors import InputError

BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block: the cpu_int4 group size of what we return
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
FLOATS = ("F16", "BF16", "F32")
SUPPORTED = QUANTIZED + FLOATS
ZERO_CODE = 8  # cpu_int4's w = (q - 8) * scale + zero
_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16, "Q8_0": 2 + 32}
_LLAMA_LAYER = (  # HF module names inside model.layers.N of a LlamaForCausalLM
    "input_layernorm", "post_attention_layernorm",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


@dataclass(frozen=True)
class GgufTensor:
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # e.g. blk.0.attn_q.weight
    type: str  # GGML type name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # HF orientation: [N, K] for a matrix, [N] for a vector
    rotary_heads: int | None  # heads whose rows llama.cpp permuted (q: attention heads, k: kv heads), else None
    data: np.ndarray = field(repr=False)  # the file's data, memory-mapped: [N, K/32 * block bytes] uint8 if quantized


@dataclass(frozen=True)
class GgufModel:
    path: Path
    architecture: str
    num_heads: int
    num_kv_heads: int
    tensors: dict[str, GgufTensor]  # by HF name, in file order
    unmapped: tuple[str, ...]  # GGUF tensors without an HF name (skipped, as transformers skips them)

    @property
    def tied(self) -> bool:
        """No output.weight in the file: lm_head is the embedding."""
        return "lm_head.weight" not in self.tensors


def read_gguf(path: str | Path) -> GgufModel:
    """The tensors' HF names, types and shapes, from the header only (data stays memory-mapped, nothing is
    dequantized). Takes ~3-4 s on the default model here: gguf-py parses the 49152-token vocabulary field by field."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise InputError("gguf", str(path), "an existing GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as error:  # bad magic, version, unknown type number
        raise InputError("gguf", str(path), f"a readable GGUF file ({error})") from None
    if reader.byte_order != "I":
        raise InputError("gguf", str(path), "a little-endian GGUF file")
    architecture = _field(reader, "general.architecture", path)
    if architecture != "llama":
        raise InputError("general.architecture", architecture, "llama (the names and q/k row order known here)")
    layers = int(_field(reader, "llama.block_count", path))
    heads = int(_field(reader, "llama.attention.head_count", path))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", path, default=heads))

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = gguf.get_tensor_name_map(arch, layers)
    hf_modules = ["model.embed_tokens", "model.norm", "lm_head"]
    hf_modules += [f"model.layers.{i}.{module}" for i in range(layers) for module in _LLAMA_LAYER]
    to_hf = {f"{name_map.get_name(module)}.weight": f"{module}.weight" for module in hf_modules}

    tensors: dict[str, GgufTensor] = {}
    unmapped: list[str] = []
    for t in reader.tensors:
        hf_name = to_hf.get(t.name)
        if hf_name is None:
            unmapped.append(t.name)
            continue
        rotary = heads if ".attn_q." in t.name else kv_heads if ".attn_k." in t.name else None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF [K, N] -> HF [N, K]
        tensors[hf_name] = GgufTensor(hf_name, t.name, t.tensor_type.name, shape, rotary, t.data)
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
    """A Q4_0/Q4_1 tensor as cpu_int4 at group 32: (qweight uint8 [N, K/2], scales bf16 [N, K/32], zeros bf16
    [N, K/32]), the file's codes unchanged; scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0), rounded to bf16."""
    t = _tensor(model, hf_name, ("Q4_0", "Q4_1"), "cpu_int4_tensors")
    blocks = _blocks(t)  # [N, K/32, 18 or 20] uint8
    d = _fp16(blocks, 0)  # [N, K/32] float32
    qs = blocks[..., -16:]  # [N, K/32, 16] uint8: element j low nibble, element j+16 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32] uint8 in 0..15, in K order
    pairs = codes.reshape(t.shape[0], -1, 2)  # [N, K/2, 2]
    qweight = pairs[..., 0] | (pairs[..., 1] << 4)  # [N, K/2] uint8: k=2j low nibble, k=2j+1 high
    # Q4_1: d and m are fp16 (multiples of 2^-24), so m + 8d is exact in float32 while |m + 8d| < 1 (every weight
    # here): the only rounding is the one to bf16.
    zeros = _fp16(blocks, 2) + ZERO_CODE * d if t.type == "Q4_1" else np.zeros_like(d)  # [N, K/32] float32
    return (
        torch.from_numpy(np.ascontiguousarray(qweight)),
        torch.from_numpy(d).to(torch.bfloat16),
        torch.from_numpy(zeros).to(torch.bfloat16),
    )


def int8_tensors(model: GgufModel, hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor as (codes int8 [N, K], scales float32 [N, K/32]), exact: w = codes * scale per block."""
    t = _tensor(model, hf_name, ("Q8_0",), "int8_tensors")
    blocks = _blocks(t)  # [N, K/32, 34] uint8
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(t.shape)  # [N, K] int8
    return torch.from_numpy(codes), torch.from_numpy(_fp16(blocks, 0))


def float_tensor(model: GgufModel, hf_name: str) -> torch.Tensor:
    """An F16/BF16/F32 tensor (norms, or unquantized weights) in its own dtype, HF shape, q/k rows reordered."""
    t = _tensor(model, hf_name, FLOATS, "float_tensor")
    if t.type == "BF16":  # the reader gives raw bytes: numpy has no bfloat16
        values = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        values = torch.from_numpy(np.array(t.data))  # a copy: the memory map is read-only
    values = values.reshape(t.shape)
    if t.rotary_heads:
        values = values[torch.from_numpy(rotary_row_order(t.shape[0], t.rotary_heads))]
    return values


def _tensor(model: GgufModel, hf_name: str, types: tuple[str, ...], reader: str) -> GgufTensor:
    t = model.tensors.get(hf_name)
    if t is None:
        tied = " (tied: lm_head is model.embed_tokens.weight)" if hf_name == "lm_head.weight" and model.tied else ""
        raise InputError("hf_name", hf_name, f"a tensor of {model.path.name}{tied}")
    if t.type not in SUPPORTED:
        raise InputError(hf_name, f"{t.gguf_name} of type {t.type}", f"one of the types read here: {SUPPORTED}")
    if t.type not in types:
        raise InputError(hf_name, f"{t.gguf_name} of type {t.type}", f"a {'/'.join(types)} tensor for {reader}()")
    if t.type in QUANTIZED and len(t.shape) != 2:
        raise InputError(hf_name, t.shape, "a 2-D quantized tensor [N, K]")
    return t


def _blocks(t: GgufTensor) -> np.ndarray:
    """The tensor's blocks as uint8 [N, K/32, block bytes], rows in HF order."""
    n, k = t.shape
    blocks = t.data.reshape(n, k // BLOCK, _BLOCK_BYTES[t.type])
    if t.rotary_heads:
        blocks = blocks[rotary_row_order(n, t.rotary_heads)]  # whole rows: a block never straddles two
    return blocks


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of every block, as float32 [N, K/32] (exact)."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


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
