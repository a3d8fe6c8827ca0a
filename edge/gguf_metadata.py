"""A GGUF file's header as the Hugging Face config.json its model would have: the one owner of that mapping.

The planner reads a `.gguf` through it (edge.model_reader: shapes, no weights), the converter writes its
config.json from it (kernels.convert.convert), and POST /plan takes the same metadata as JSON. Only the header is
read (gguf-py's GGUFReader memory-maps the file; no tensor data is touched).

The keys follow what llama.cpp's convert_hf_to_gguf.py writes and transformers reads back
(transformers/integrations/ggml.py GGUF_CONFIG_MAPPING): `{arch}.context_length` is max_position_embeddings,
`{arch}.block_count` num_hidden_layers, and so on. The architectures are the families vLLM serves on CPU that
llama.cpp files carry; Mistral and SmolLM files say `llama`. A tied head is a file without `output.weight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
    "gemma3": {"attention.sliding_window": "sliding_window"},
    "phi3": {"attention.sliding_window": "sliding_window", "rope.dimension_count": "rope_dimension_count"},
}  # fmt: skip
HEAD_TENSOR = "output.weight"
EMBEDDING_TENSOR = "token_embd.weight"


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
    reader: Any = field(default=None, repr=False, compare=False)  # gguf-py's, from a file: reused, not re-read

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))


def read_header(path: str | Path) -> GgufHeader:
    """The metadata and the tensor table of a GGUF file; InputError naming the file when it is not one."""
    path = Path(path)
    try:
        import gguf
    except ImportError:  # the planner's own install has no numpy; the engine side's (the vllm extra) has gguf
        raise InputError("model", str(path), "gguf-py installed to read a GGUF header (pip install gguf, or the "
                         "project's vllm extra)") from None
    if not path.is_file():
        raise InputError("model", str(path), "an existing GGUF file")
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
    return GgufHeader(path, metadata, tensors, reader)


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


def tensor_types(header: GgufHeader) -> dict[str, int]:
    """How many tensors of each GGML type the file holds, e.g. {"Q4_K": 169, "Q6_K": 29, "F32": 61}."""
    counts: dict[str, int] = {}
    for t in header.tensors:
        counts[t.type] = counts.get(t.type, 0) + 1
    return dict(sorted(counts.items()))


# The types whose 4-bit codes lie on a group-32 grid that cpu_int4 holds exactly (scale and zero per 32 weights):
# Q4_0 and Q4_1 blocks of 32, and Q4_K's 8 sub-blocks of 32 (kernels.source.gguf_source reads their codes).
FOUR_BIT_GRIDS = ("Q4_0", "Q4_1", "Q4_K")
GRID_GROUP = 32
# The quantized types wider than 4 bits that kernels.source.gguf_source reads (edge.quantized_layers keeps a kind
# the file holds mostly in these at 8 bits).
WIDE_SOURCE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def source_grid(header: GgufHeader) -> int | None:
    """32 when the file's decoder linears are mostly on a 4-bit group-32 grid (a Q4_K_M keeps some at Q6_K: those
    are re-rounded, the rest copied), else None."""
    linears = [t for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    on_grid = sum(t.type in FOUR_BIT_GRIDS for t in linears)
    return GRID_GROUP if linears and on_grid * 2 >= len(linears) else None


# The file's tensor names (blk.N.<name>.weight) as the kinds of weight a plan decides (edge.quantized_layers).
_KINDS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj", "attn_qkv": "qkv_proj",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # fmt: skip


def source_types(header: GgufHeader) -> dict[str, dict[str, int]]:
    """Per kind of weight, how many of its tensors the file holds in each type (a tied head counts as its
    embedding); Phi-3's ffn_up holds the fused gate_up_proj."""
    phi3 = header.architecture == "phi3"
    found: dict[str, dict[str, int]] = {}
    for t in header.tensors:
        parts = t.name.split(".")
        if t.name == EMBEDDING_TENSOR:
            kind = "embed_tokens"
        elif t.name == HEAD_TENSOR:
            kind = "lm_head"
        elif len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _KINDS:
            kind = "gate_up_proj" if phi3 and parts[2] == "ffn_up" else _KINDS[parts[2]]
        else:
            continue
        counts = found.setdefault(kind, {})
        counts[t.type] = counts.get(t.type, 0) + 1
    if "lm_head" not in found and "embed_tokens" in found:
        found["lm_head"] = dict(found["embed_tokens"])
    return {kind: dict(sorted(counts.items())) for kind, counts in found.items()}
