"""A GGUF file's header as the Hugging Face config.json its model would have: the one owner of that mapping.

The planner reads a `.gguf` through it (edge.model.reader: shapes, no weights), the converter writes its
config.json from it (kernels.convert.convert), and POST /plan takes the same metadata as JSON. Only the header is
read (gguf-py's GGUFReader memory-maps the file), and of the tensor data only the RoPE factors' few floats.

The keys follow what llama.cpp's convert_hf_to_gguf.py writes and transformers reads back
(transformers/integrations/ggml.py GGUF_CONFIG_MAPPING): `{arch}.context_length` is max_position_embeddings,
`{arch}.block_count` num_hidden_layers, and so on. The architectures are the families vLLM serves on CPU that
llama.cpp files carry; Mistral and SmolLM files say `llama`. A tied head is a file without `output.weight`.

RoPE scaling becomes transformers 5's `rope_parameters` (what vLLM 0.28's get_rope reads): from the
`{arch}.rope.scaling.*` keys for linear and YaRN, and from the tensors llama.cpp stores the other kinds as, Llama 3's
`rope_freqs.weight` and Phi-3's `rope_factors_long/short.weight` (`_add_rope_parameters`).
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from edge.bounds import MAX_TENSOR_DIM
from edge.errors import InputError

# general.architecture -> (HF architecture, model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
# {arch}.<key> -> config.json key; the ones every family has, then the family's own.
_COMMON = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
}
_FAMILY = {
    "llama": {"rope.dimension_count": "head_dim"},
    "gemma2": {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window": "sliding_window", "rope.freq_base_swa": "rope_local_base_freq"},
    "phi3": {"attention.sliding_window": "sliding_window", "rope.dimension_count": "rope_dimension_count"},
}  # fmt: skip
HEAD_TENSOR = "output.weight"
EMBEDDING_TENSOR = "token_embd.weight"
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3: per-frequency divisors of the base frequencies
ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR = "rope_factors_long.weight", "rope_factors_short.weight"  # Phi-3 LongRoPE


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str  # the file's name, e.g. blk.0.attn_q.weight
    type: str  # GGML type name: Q4_K, Q6_K, F32, ...
    shape: tuple[int, ...]  # Hugging Face orientation: [N, K] for a matrix


@dataclass(frozen=True)
class GgufHeader:
    path: Path | None
    metadata: dict[str, Any]  # scalars and strings; an array field is its length (`tokenizer.ggml.tokens`: 49152)
    tensors: tuple[GgufTensorInfo, ...]
    # the RoPE tensors' F32 values as the file holds them (a few floats each), by tensor name; {} from POST /plan's JSON
    rope_data: dict[str, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)
    # gguf-py's reader, kept only where asked (read_header's keep_reader: the converter reuses its parse)
    reader: Any = field(default=None, repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))


def import_gguf() -> ModuleType:
    """gguf-py, imported without mistral_common where nothing imported it yet.

    gguf-py's package imports its tokenizer converters (gguf.vocab), and they import mistral_common where it is
    installed (vLLM depends on it): 30 MiB of RssAnon and 0.23 s (pydantic models, pycountry's languages, jsonschema,
    PIL; Zen 5, 2026-12-07) that reading a header never uses. In edge-serve's wrapper, which reads a GGUF's header to
    plan and then serves for as long as the box runs, it stayed. gguf.vocab's Mistral vocabularies are then
    unavailable in this process; nothing here uses them. ImportError where gguf-py is not installed."""
    if "gguf" in sys.modules or "mistral_common" in sys.modules:
        import gguf

        return gguf
    sys.modules["mistral_common"] = None  # type: ignore[assignment]  # import fails: gguf.vocab carries on without
    try:
        import gguf
    finally:
        del sys.modules["mistral_common"]
    return gguf


def read_header(path: str | Path, keep_reader: bool = False) -> GgufHeader:
    """The metadata and the tensor table of a GGUF file; InputError naming the file when it is not one.

    keep_reader: the header holds gguf-py's reader too, for a caller that reads the same file's tensors (the
    converter). Otherwise it is dropped: its parsed fields (objects for every vocabulary token) stayed alive in
    edge-serve's wrapper for as long as it ran."""
    path = Path(path)
    try:
        gguf = import_gguf()
    except ImportError:  # the planner's own install has no numpy; the engine side's (the vllm extra) has gguf
        raise InputError("model", str(path), "gguf-py installed to read a GGUF header (pip install gguf, or the "
                         "project's vllm extra)") from None
    if not path.is_file():
        raise InputError("model", str(path), "an existing GGUF file")
    if not keep_reader:
        try:
            lean = _read_lean(path, gguf)
        except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError, struct.error) as error:
            raise InputError("model", str(path), f"a readable GGUF file ({error})") from None
        if lean is not None:
            return lean
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as error:
        raise InputError("model", str(path), f"a readable GGUF file ({error})") from None
    metadata: dict[str, Any] = {}
    for key, entry in reader.fields.items():
        if not entry.types:
            continue
        if entry.types[0] == gguf.GGUFValueType.ARRAY:
            metadata[key] = len(entry.data)
        elif entry.types[0] == gguf.GGUFValueType.STRING:
            metadata[key] = bytes(entry.parts[entry.data[0]]).decode("utf-8", errors="replace")
        else:
            metadata[key] = entry.parts[entry.data[0]][0].item()
    tensors = tuple(
        GgufTensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
        for t in reader.tensors
    )
    rope = {t.name: tuple(float(str(value)) for value in t.data)  # numpy's str of a float32: its shortest decimal
            for t in reader.tensors if t.name in (ROPE_FREQS_TENSOR, ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR)
            and t.tensor_type.name == "F32"}  # fmt: skip
    return GgufHeader(path, metadata, tensors, rope, reader if keep_reader else None)


# GGUF's value types (gguf-py GGUFValueType) with a fixed size, as struct formats (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
GGUF_DEFAULT_ALIGNMENT = 32  # where general.alignment is absent (the GGUF spec)


class _Cursor:
    """Reads a GGUF header's little-endian fields from a mapped file, in order."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.take("<Q")
        if self.at + size > len(self.view):
            raise ValueError(f"a string of {size} bytes past the end of the file")
        text = bytes(self.view[self.at : self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def skip_array(self, kind: int, count: int) -> None:
        if kind == _STRING:
            for _ in range(count):  # each string is its length and its bytes: the lengths say where the next starts
                self.at += 8 + struct.unpack_from("<Q", self.view, self.at)[0]
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_array(self.take("<I"), self.take("<Q"))
        else:
            self.at += count * struct.calcsize(_SCALARS[kind])
        if self.at > len(self.view):
            raise ValueError("an array past the end of the file")


def _read_lean(path: Path, gguf: ModuleType) -> GgufHeader | None:
    """read_header's fields without gguf-py's reader, which builds objects for every array element: a 262144-token
    vocabulary's header took it 12 s and 600-800 MiB (a Gemma 3-shaped Q4_K_M, AMD EPYC Zen 5, 2026-12-07), in
    edge-serve's wrapper on every start. Arrays are skipped by their lengths, as the GGUF spec lays them out; only
    gguf-py's enums are used. None for a file this does not read (big-endian, another version): gguf-py's reader
    then does."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            cursor = _Cursor(view)
            if bytes(view[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            cursor.at = 4
            version = cursor.take("<I")
            if version not in (2, 3):
                return None
            tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
            # gguf-py's reader lists the header's own fields first, under these names
            metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                        "GGUF.kv_count": kv_count}  # fmt: skip
            for _ in range(kv_count):
                key, kind = cursor.string(), cursor.take("<I")
                if kind == _ARRAY:
                    inner, count = cursor.take("<I"), cursor.take("<Q")
                    cursor.skip_array(inner, count)
                    metadata[key] = count
                elif kind == _STRING:
                    metadata[key] = cursor.string()
                else:
                    metadata[key] = cursor.take(_SCALARS[kind])
            tensors, offsets = [], {}
            for _ in range(tensor_count):
                name, dims = cursor.string(), cursor.take("<I")
                shape = [cursor.take("<Q") for _ in range(dims)]
                kind = gguf.GGMLQuantizationType(cursor.take("<I"))
                offsets[name] = (cursor.take("<Q"), kind.name, math.prod(shape), kind)
                tensors.append(GgufTensorInfo(name, kind.name, tuple(reversed(shape))))
            alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
            data = -(-cursor.at // alignment) * alignment
            for name, (start, _, count, kind) in offsets.items():  # every tensor's bytes in the file, as gguf-py checks
                block, size = gguf.GGML_QUANT_SIZES[kind]
                if data + start + count // block * size > len(view):
                    raise ValueError(f"{name}'s data past the end of the file")
            rope = {}
            for name in (ROPE_FREQS_TENSOR, ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR):
                if name in offsets and offsets[name][1] == "F32":
                    start, _, count, _ = offsets[name]
                    values = struct.unpack_from(f"<{count}f", view, data + start)
                    rope[name] = tuple(_shortest_f32(v) for v in values)
        finally:
            view.release()
    return GgufHeader(path, metadata, tuple(tensors), rope)


def _shortest_f32(value: float) -> float:
    """A float32 value as its shortest decimal that reads back as the same float32 (what numpy's str of a float32
    gives, which gguf-py's parse goes through: read_header's RoPE factors)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == value:
            return float(text)
    return value


def header_from_json(body: Mapping[str, Any]) -> GgufHeader:
    """A GGUF header sent as JSON (POST /plan): {"metadata": {key: value}, "tensors": [{"name", "type",
    "shape"}]}, shapes in Hugging Face orientation ([N, K]); an array-valued key may be given as its length."""
    metadata = body.get("metadata")
    if not isinstance(metadata, Mapping):
        raise InputError("gguf.metadata", type(metadata).__name__, "an object of GGUF metadata keys")
    tensors = body.get("tensors", [])
    if not isinstance(tensors, list):
        raise InputError("gguf.tensors", type(tensors).__name__, "a list of {name, type, shape}")
    infos = []
    for i, t in enumerate(tensors):
        ok = isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("type"), str)
        shape = t.get("shape") if isinstance(t, Mapping) else None
        dims_ok = isinstance(shape, list) and all(_is_int(d) and 0 < d <= MAX_TENSOR_DIM for d in shape)
        if not ok or not dims_ok:
            raise InputError(f"gguf.tensors[{i}]", t, f"{{name: str, type: str, shape: [positive ints, each at most "
                             f"{MAX_TENSOR_DIM}]}}")  # fmt: skip
        infos.append(GgufTensorInfo(t["name"], t["type"], tuple(shape)))
    values = {k: (len(v) if isinstance(v, list) else v) for k, v in metadata.items()}
    return GgufHeader(None, values, tuple(infos))


def hf_config(header: GgufHeader) -> dict[str, Any]:
    """config.json for the file's model, as transformers writes it when it loads the GGUF."""
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise InputError("general.architecture", arch, f"one of {sorted(ARCHITECTURES)}")
    architecture, model_type = ARCHITECTURES[arch]
    meta = header.metadata
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for suffix, key in {**_COMMON, **_FAMILY.get(arch, {})}.items():
        value = meta.get(f"{arch}.{suffix}")
        if value is not None and key not in config:
            config[key] = value
    if "num_hidden_layers" not in config:
        raise InputError(f"{arch}.block_count", None, "a metadata key of the GGUF file")
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens")
    if vocab is None:
        embedding = _tensor(header, EMBEDDING_TENSOR)
        vocab = embedding.shape[0] if embedding else None
    if vocab is not None:
        config["vocab_size"] = _int(f"{arch}.vocab_size", vocab)
    if "intermediate_size" not in config and (gate := _tensor(header, "blk.0.ffn_gate.weight")):
        config["intermediate_size"] = gate.shape[0]
    config["tie_word_embeddings"] = _tensor(header, HEAD_TENSOR) is None
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):  # fmt: skip
        if meta.get(name) is not None:
            config[key] = _int(name, meta[name])
    if arch == "qwen3" and "head_dim" not in config and (q := _tensor(header, "blk.0.attn_q.weight")):
        heads = _int(f"{arch}.attention.head_count", config.get("num_attention_heads"))
        if heads <= 0:
            raise InputError(f"{arch}.attention.head_count", heads, "a positive integer")
        config["head_dim"] = q.shape[0] // heads
    _add_rope_parameters(header, config)
    config["torch_dtype"] = "bfloat16"
    return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(key: str, value: Any) -> int:
    """An integer metadata value (gguf-py reads them as ints; JSON may send anything); InputError naming the key."""
    if not _is_int(value):
        raise InputError(key, value, "an integer metadata value")
    return value


def _tensor(header: GgufHeader, name: str) -> GgufTensorInfo | None:
    return next((t for t in header.tensors if t.name == name), None)


# Llama 3's rope_freqs.weight (llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors): for frequency i,
# theta^(-2i/d), of wavelength w = 2*pi*theta^(2i/d), the divisor is 1 where w < L/high_freq_factor, `factor` where
# w > L/low_freq_factor, and 1/((1 - s)/factor + s) between, s = (L/w - low)/(high - low): the frequencies
# transformers' _compute_llama3_parameters and vLLM's Llama3RotaryEmbedding compute from rope_type llama3. They
# depend on low/L and high/L only, so L is fixed: the file's rope.scaling.original_context_length, else 8192 (what
# llama.cpp's converter assumes, and Meta's Llama 3.1 and 3.2 value); s is linear in 1/w, which gives low and high.
LLAMA3_ORIGINAL_CONTEXT = 8192
LLAMA3_BAND = (1.0, 4.0)  # Meta's low/high_freq_factor: tried when fewer than two divisors lie between 1 and factor
# How close the rebuilt divisors must be: llama.cpp rounds them in float32, 1.5-3.7 x 2^-24 off the exact ones for
# Llama 3.1, 3.2 and a 64-wide head (measured here, 2026-12-02); 2^-20 is 16 such steps.
FLOAT32_MATCH = 2.0**-20
SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # gguf-py's RopeScalingType


def _add_rope_parameters(header: GgufHeader, config: dict[str, Any]) -> None:
    """The file's RoPE scaling as transformers 5 writes it (`rope_parameters`; Gemma 3's per layer type), and
    Phi-3's partial rotary; nothing for a file without either, which keeps transformers' defaults."""
    arch, meta = header.architecture, header.metadata
    kind_key = f"{arch}.rope.scaling.type"
    kind = meta.get(kind_key) or ("linear" if f"{arch}.rope.scale_linear" in meta else "none")
    if kind not in SCALING_TYPES:
        raise InputError(kind_key, kind, f"one of {', '.join(SCALING_TYPES)}")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if _is_int(hidden) and _is_int(heads) and heads else None)
    dims_key = f"{arch}.rope.dimension_count"
    rotary_dim = _int(dims_key, meta[dims_key]) if meta.get(dims_key) is not None else head_dim
    if not _is_int(rotary_dim) or rotary_dim <= 0:
        return  # no head size: the model reader refuses the config for it
    if arch == "phi3" and _is_int(head_dim) and rotary_dim != head_dim:  # Phi-4-mini rotates 96 of 128
        config["partial_rotary_factor"] = rotary_dim / head_dim
    from_metadata = _metadata_scaling(arch, meta, kind)
    from_tensors = _llama3_scaling(header, config.get("rope_theta", 10000.0), rotary_dim) or _longrope_scaling(
        header, config, rotary_dim)  # fmt: skip
    if from_metadata and from_tensors:
        raise InputError(kind_key, kind, f"none beside the file's {from_tensors['rope_type']} RoPE tensors")
    scaling = from_metadata or from_tensors
    if scaling is None:
        return
    theta = {"rope_theta": config["rope_theta"]} if "rope_theta" in config else {}
    rope = {"rope_type": scaling.pop("rope_type"), **theta, **scaling}
    if arch == "gemma3":  # only the global layers scale (llama.cpp; transformers' Gemma3TextConfig)
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
        rope = {"full_attention": rope, "sliding_attention": local}
    config["rope_parameters"] = rope
    if rope.get("rope_type") == "longrope":  # Phi3Config keeps it beside rope_parameters too, and prefers it
        config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]


def _metadata_scaling(arch: str, meta: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    """Linear and YaRN scaling from the `{arch}.rope.scaling.*` keys (llama.cpp writes them for Llama, Qwen and
    Gemma 3 configs with rope_scaling linear or yarn); None for a factor of 1 or none."""
    factor_key = f"{arch}.rope.scaling.factor"
    if factor_key not in meta:
        factor_key = f"{arch}.rope.scale_linear"  # the older key llama.cpp still reads
    if kind not in ("linear", "yarn") or meta.get(factor_key) is None:
        return None
    factor = _number(factor_key, meta[factor_key])
    if factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":  # the same YaRN parameters in llama.cpp, transformers and vLLM
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:  # else the training context, in all three
            scaling["original_max_position_embeddings"] = _context(f"{arch}.rope.scaling.original_context_length",
                                                                   original)  # fmt: skip
        for suffix, key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.get(f"{arch}.rope.scaling.{suffix}") is not None:
                scaling[key] = _number(f"{arch}.rope.scaling.{suffix}", meta[f"{arch}.rope.scaling.{suffix}"])
    return scaling


def _llama3_scaling(header: GgufHeader, theta: float, rotary_dim: int) -> dict[str, Any] | None:
    """Llama 3's rope_scaling rebuilt from rope_freqs.weight (see LLAMA3_ORIGINAL_CONTEXT), checked to give back
    every divisor; None without the tensor or for divisors all 1; InputError naming it when it is not of that form."""
    divisors = _rope_values(header, ROPE_FREQS_TENSOR, rotary_dim // 2)
    if divisors is None or all(d == 1 for d in divisors):
        return None
    theta = _number(f"{header.architecture}.rope.freq_base", theta)  # LlamaConfig's and llama.cpp's 10000 if absent
    key = f"{header.architecture}.rope.scaling.original_context_length"
    original = _context(key, header.metadata.get(key, LLAMA3_ORIGINAL_CONTEXT))
    factor = max(divisors)
    wavelengths = [2 * math.pi * theta ** (2 * i / rotary_dim) for i in range(len(divisors))]
    # in the band 1/d = (1 - s)/factor + s with s = (L/w - low)/(high - low) = a/w + b: low = -bL/a, high = (1-b)L/a
    band = [(1 / w, (1 / d - 1 / factor) / (1 - 1 / factor)) for w, d in zip(wavelengths, divisors, strict=True)
            if 1 < d < factor]  # fmt: skip
    candidates = [LLAMA3_BAND]
    if len(band) >= 2 and (line := _line(band)):
        low, high = -line[1] * original / line[0], (1 - line[1]) * original / line[0]
        candidates = [(round(low, 3), round(high, 3)), (low, high)]  # 1.0, not 1.0000001, where that is as exact
    for low, high in candidates:
        rebuilt = [_llama3_divisor(w, factor, low, high, original) for w in wavelengths] if 0 < low < high else []
        if rebuilt and all(abs(d - r) <= FLOAT32_MATCH * d for d, r in zip(divisors, rebuilt, strict=True)):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}  # fmt: skip
    raise InputError(ROPE_FREQS_TENSOR, f"{len(divisors)} divisors from {min(divisors)} to {factor}",
                     "Llama 3's RoPE divisors (rope_type llama3: 1, then a smooth band, then `factor`)")  # fmt: skip


def _llama3_divisor(wavelength: float, factor: float, low: float, high: float, original: int) -> float:
    """transformers' _compute_llama3_parameters, as the base frequency over the scaled one."""
    if wavelength < original / high:
        return 1.0
    if wavelength > original / low:
        return factor
    smooth = (original / wavelength - low) / (high - low)
    return 1 / ((1 - smooth) / factor + smooth)


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope and intercept of y = a*x + b; None unless the slope is positive."""
    n, sx, sy = len(points), sum(x for x, _ in points), sum(y for _, y in points)
    sxx, sxy = sum(x * x for x, _ in points), sum(x * y for x, y in points)
    if n * sxx - sx * sx <= 0:
        return None
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (slope, (sy - slope * sx) / n) if slope > 0 else None


def _longrope_scaling(header: GgufHeader, config: Mapping[str, Any], rotary_dim: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE from rope_factors_long/short.weight and the original context, as Phi3Config holds it."""
    arch, meta = header.architecture, header.metadata
    long, short = (_rope_values(header, name, rotary_dim // 2) for name in (ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR))
    if long is None and short is None:
        return None
    if long is None or short is None:
        missing = ROPE_LONG_TENSOR if long is None else ROPE_SHORT_TENSOR
        raise InputError(missing, None, "a tensor of the file beside the other LongRoPE factors")
    context = _context(f"{arch}.context_length", config.get("max_position_embeddings"))
    key = f"{arch}.rope.scaling.original_context_length"
    original = _context(key, meta.get(key, context))  # llama.cpp: the training context when absent
    scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
               "original_max_position_embeddings": original}  # fmt: skip
    # llama.cpp scales cos and sin by rope.scaling.attn_factor; transformers and vLLM compute the same value from
    # the two contexts (sqrt(1 + ln(s)/ln(original)), s = context/original, 1 for s <= 1) and are told where not
    scale = context / original
    implied = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn_key = f"{arch}.rope.scaling.attn_factor"
    attn = _number(attn_key, meta[attn_key]) if meta.get(attn_key) is not None else implied
    if not math.isclose(attn, implied, rel_tol=FLOAT32_MATCH):
        scaling |= {"attention_factor": attn, "short_mscale": attn, "long_mscale": attn}  # transformers', vLLM's
    return scaling


def _rope_values(header: GgufHeader, name: str, length: int) -> list[float] | None:
    """A RoPE tensor's F32 values, each the shortest decimal of its float32 (1.08, not 1.0800000429); None when
    the file has none, or the header no data: POST /plan's JSON lists tensors without it, and these factors change
    no shape or byte count the planner reads, so it plans without them."""
    info = _tensor(header, name)
    if info is None or header.path is None:
        return None
    if info.type != "F32" or info.shape != (length,):
        raise InputError(name, f"{info.type} {list(info.shape)}", f"F32 [{length}]: one per rotary frequency")
    return list(header.rope_data[name])


def _context(key: str, value: Any) -> int:
    """A context length in tokens, more than one (a logarithm of it divides)."""
    if _int(key, value) < 2:
        raise InputError(key, value, "a context length of at least 2 tokens")
    return value


def _number(key: str, value: Any) -> float:
    """A positive finite number (gguf-py reads float32 keys as floats; JSON may send anything)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InputError(key, value, "a positive number")
    return float(value)


def tensor_types(header: GgufHeader) -> dict[str, int]:
    """How many tensors of each GGML type the file holds, e.g. {"Q4_K": 169, "Q6_K": 29, "F32": 61}."""
    counts: dict[str, int] = {}
    for t in header.tensors:
        counts[t.type] = counts.get(t.type, 0) + 1
    return dict(sorted(counts.items()))


# The types whose 4-bit codes lie on a group-32 grid that cpu_int4 holds exactly (scale and zero per 32 weights):
# Weights a block and its bytes, for the types whose blocks a plan may keep as the file holds them (ggml's
# block_q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes a 256 weights;
# block_q6_K: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 scales, fp16 d; block_q5_0: fp16 d, 32 fifth
# bits, 16 bytes of low nibbles a 32 weights; block_q8_0: fp16 d, 32 int8).
GGML_BLOCKS: dict[str, tuple[int, int]] = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22), "Q8_0": (32, 34)}
# Q4_0 and Q4_1 blocks of 32, and Q4_K's 8 sub-blocks of 32 (kernels.source.gguf_source reads their codes).
FOUR_BIT_GRIDS = ("Q4_0", "Q4_1", "Q4_K")
# Of those, the symmetric one: Q4_0's w = d * (q - 8) is GPTQ's uint4b8 (code q, zero 8, scale d), which the W4A8
# kernel runs (kernels.source.gguf_source: its codes go to a cpu_w4a8 checkpoint unchanged).
SYMMETRIC_FOUR_BIT_GRIDS = ("Q4_0",)
GRID_GROUP = 32
# The quantized types wider than 4 bits that kernels.source.gguf_source reads (edge.catalog.quantized_layers keeps a
# tensor the file holds in one of these at 8 bits).
WIDE_SOURCE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
# The types the 8-bit set holds exactly, and their group: symmetric grids of at most 8 bits, w = s * q per group
# (Q8_0, Q5_0, Q4_0: fp16 d per block of 32; Q6_K: fp16 d times an int8 scale per sub-block of 16, exact in
# float32). int8 per group of that size, or of a divisor of it, copies their codes (kernels.source.gguf_source
# .int8_tensors); the asymmetric ones (Q4_1, Q4_K, Q5_1, Q5_K: a minimum per group) are re-rounded per group.
INT8_GRIDS: dict[str, int] = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q6_K": 16}


def source_grid(header: GgufHeader) -> int | None:
    """32 when the decoder linears a plan keeps at 4 bits (all but those in WIDE_SOURCE_TYPES, which go to the
    8-bit set) are mostly on a 4-bit group-32 grid, else None. llama.cpp's Q4_K_M of a model whose rows are not
    multiples of 256 holds 166 of its 210 linears at Q5_0 and 16 at Q4_K (docs/reports/2026-12-01-gguf-models.md):
    its grid is the Q4_K ones', which keep their codes while the rest go to 8 bits."""
    linears = [t for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    narrow = [t for t in linears if t.type not in WIDE_SOURCE_TYPES]
    on_grid = sum(t.type in FOUR_BIT_GRIDS for t in narrow)
    return GRID_GROUP if on_grid and on_grid * 2 >= len(narrow) else None


# The file's tensor names (blk.N.<name>.weight) as the kinds of weight a plan decides (edge.catalog.quantized_layers).
_KINDS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj", "attn_qkv": "qkv_proj",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # fmt: skip


def _weights(header: GgufHeader) -> list[tuple[str, int | None, str]]:
    """(kind, layer index or None, type) of every tensor a plan decides: the embedding, the head and the decoder
    linears; Phi-3's ffn_up holds the fused gate_up_proj. A layer index that is not an integer below
    `{arch}.block_count` is refused naming the tensor."""
    phi3 = header.architecture == "phi3"
    blocks = header.metadata.get(f"{header.architecture}.block_count")
    found = []
    for t in header.tensors:
        parts = t.name.split(".")
        if t.name == EMBEDDING_TENSOR:
            found.append(("embed_tokens", None, t.type))
        elif t.name == HEAD_TENSOR:
            found.append(("lm_head", None, t.type))
        elif len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _KINDS:
            if not parts[1].isdecimal() or (_is_int(blocks) and int(parts[1]) >= blocks):
                raise InputError(f"gguf tensor {t.name}", parts[1], f"a layer index below {blocks} "
                                 f"({header.architecture}.block_count)")  # fmt: skip
            kind = "gate_up_proj" if phi3 and parts[2] == "ffn_up" else _KINDS[parts[2]]
            found.append((kind, int(parts[1]), t.type))
    return found


def source_types(header: GgufHeader) -> dict[str, dict[str, int]]:
    """Per kind of weight, how many of its tensors the file holds in each type (a tied head counts as its
    embedding)."""
    found: dict[str, dict[str, int]] = {}
    for kind, _, type_name in _weights(header):
        counts = found.setdefault(kind, {})
        counts[type_name] = counts.get(type_name, 0) + 1
    if "lm_head" not in found and "embed_tokens" in found:
        found["lm_head"] = dict(found["embed_tokens"])
    return {kind: dict(sorted(counts.items())) for kind, counts in found.items()}


def source_layers(header: GgufHeader) -> dict[str, dict[str, list[int]]]:
    """Per kind of decoder linear the file holds in more than one type, which layers hold each type, e.g. a
    Q4_K_M's {"v_proj": {"Q4_K": [3, 4, 6, ...], "Q6_K": [0, 1, 2, 5, ...]}} (llama-quant.cpp gives attn_v and
    ffn_down Q6_K on the first and last eighth of the layers and every third between). A kind held in one type
    throughout is absent: source_types says it."""
    found: dict[str, dict[str, list[int]]] = {}
    for kind, layer, type_name in _weights(header):
        if layer is not None:
            found.setdefault(kind, {}).setdefault(type_name, []).append(layer)
    return {kind: {t: sorted(layers) for t, layers in sorted(types.items())}
            for kind, types in found.items() if len(types) > 1}  # fmt: skip
