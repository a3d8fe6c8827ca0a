"""Read a Hugging Face config.json into a ModelShape: every linear's (N, K), the attention layout, the head.

No torch, no transformers: the reader follows the defaults transformers 5.24 applies per architecture
(read from site-packages transformers/models/*/configuration_*.py) and the shapes vLLM 0.28 loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
from importlib import resources
from pathlib import Path

from edge.bounds import MAX_DIMENSIONS, check_dimension
from edge.errors import InputError
from edge.model.shapes import LinearShape, ModelShape

log = logging.getLogger(__name__)

# The name of the bf16 directory edge-model builds (kernels.source.default_model.MODEL_NAME), so that a plan for
# "the default model" and one read from that directory name the same model (quality records match by name).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-bf16"
_DEFAULT_MODEL_FILE = "data/smollm2-135m-instruct.json"

# architecture -> (model_type, tie_word_embeddings default as transformers' config class has it)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "GemmaForCausalLM": ("gemma", True),  # GemmaConfig and Gemma2Config tie by default
    "Gemma2ForCausalLM": ("gemma2", True),
    "Gemma3ForCausalLM": ("gemma3_text", True),  # Gemma3TextConfig ties by default
    "Phi3ForCausalLM": ("phi3", False),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _) in ARCHITECTURES.items()}
_BY_MODEL_TYPE["gemma3"] = "Gemma3ForCausalLM"  # a Gemma 3 wrapper's text_config says gemma3_text
# What transformers' config classes default to, where a config may omit the key (Gemma configs often do):
# GemmaConfig/Gemma2Config vocab 256000; Gemma3TextConfig vocab 262208, head_dim 256, sliding_window 4096,
# max_position_embeddings 131072 (transformers/models/gemma*/configuration_gemma*.py).
_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma": {"vocab_size": 256000},
    "gemma2": {"vocab_size": 256000},
    "gemma3_text": {"vocab_size": 262208, "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 131072},
}
# Gemma 3: every sliding_window_pattern-th layer attends to the full context (Gemma3TextConfig's default 6).
GEMMA3_PATTERN = 6
SLIDING = "sliding_attention"
FULL = "full_attention"


# The default model is built from a Q4_1 GGUF (docs/FACTS.md): its weights lie on a group-32 grid, as the
# edge-source.json that edge-model writes beside them says (kernels/source/default_model.py).
DEFAULT_MODEL_SOURCE_GRID = 32


def default_model() -> ModelShape:
    """The embedded default model's shapes (its real config.json ships inside the package)."""
    text = resources.files("edge").joinpath(_DEFAULT_MODEL_FILE).read_text(encoding="utf-8")
    shape = read_model_config(json.loads(text), DEFAULT_MODEL_NAME)
    return shape.model_copy(update={"source_grid": DEFAULT_MODEL_SOURCE_GRID})


def read_model(path: str | Path) -> ModelShape:
    """Shapes of the model `path` names: a local HF directory (its config.json), a config.json file, a `.gguf`
    file (its header, edge.model.gguf_metadata), or a Hugging Face repo id found in the local Hugging Face cache
    (resolve_model). A directory's edge-source.json (written by edge-model for a model built from a GGUF) adds the
    source's own 4-bit grid; a GGUF's own 4-bit tensors give it theirs."""
    path = resolve_model(path)
    if is_gguf(path):
        from edge.model import gguf_metadata

        return read_gguf_header(gguf_metadata.read_header(path), path.stem)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise InputError("model", str(path), "a model directory holding config.json, a config.json file, a .gguf "
                         "file or a Hugging Face repo id in the local cache")  # fmt: skip
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(str(config_file), str(err), "a readable JSON file") from err
    name = path.name if path.is_dir() else (path.parent.name if path.name == "config.json" else path.stem)
    shape = read_model_config(config, name or str(path))
    grid = source_grid(config_file.parent / SOURCE_FILE)
    return shape.model_copy(update={"source_grid": grid}) if grid else shape


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def read_gguf_header(header, name: str) -> ModelShape:
    """Shapes of a GGUF's model from its header (edge.model.gguf_metadata.GgufHeader): its config, its 4-bit grid, its
    tensor types per kind and, for a kind held in several types, per layer."""
    from edge.model import gguf_metadata

    shape = read_model_config(gguf_metadata.hf_config(header), name)
    return shape.model_copy(update={"source_grid": gguf_metadata.source_grid(header),
                                    "source_types": gguf_metadata.source_types(header),
                                    "source_layers": gguf_metadata.source_layers(header) or None})  # fmt: skip


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def hf_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloads, in its own order: HF_HUB_CACHE, then HF_HOME/hub, then
    ~/.cache/huggingface/hub (huggingface_hub/constants.py)."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return [home.expanduser() / "hub"]


def resolve_model(model: str | Path) -> Path:
    """A path as it is when it exists; else a Hugging Face repo id ("org/name") as its snapshot in the local
    cache (refs/main, or the one snapshot there is), offline: nothing is ever downloaded."""
    path = Path(model)
    if path.exists() or not _REPO_ID.match(str(model)):
        return path
    for cache in hf_cache_dirs():
        repo = cache / f"models--{str(model).replace('/', '--')}"
        ref = repo / "refs" / "main"
        snapshots = repo / "snapshots"
        if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
            return snapshots / ref.read_text().strip()
        found = sorted(p for p in snapshots.glob("*") if p.is_dir()) if snapshots.is_dir() else []
        if len(found) == 1:
            return found[0]
    caches = ", ".join(str(c) for c in hf_cache_dirs())
    raise InputError("model", str(model), f"a local path, or a Hugging Face repo id present in the local cache "
                     f"({caches}); nothing is downloaded")  # fmt: skip


SOURCE_FILE = "edge-source.json"


def source_grid(path: Path) -> int | None:
    """The `q4_group` of an edge-source.json: {"format": "gguf", "q4_group": 32, ...}; None when absent."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(str(path), str(err), "a readable JSON file") from err
    group = record.get("q4_group") if isinstance(record, dict) else None
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group <= 0):
        raise InputError(f"{path}: q4_group", group, "a positive integer or absent")
    return group


def read_model_config(config: dict, name: str) -> ModelShape:
    """Shapes from a parsed config.json. Multimodal: the language model under `text_config` is read."""
    if not isinstance(config, dict):
        raise InputError("config.json", type(config).__name__, "a JSON object")
    architecture = _architecture(config)
    source = "config.json"
    text = config
    if isinstance(config.get("text_config"), dict):
        text, source = config["text_config"], "config.json: text_config"
        log.info("%s: reading the language model from text_config", name)
        if architecture is None:
            architecture = _BY_MODEL_TYPE.get(str(text.get("model_type")).removesuffix("_text"))
    if architecture is None:
        raise InputError(
            "config.json: architectures", config.get("architectures"), f"one of {list(ARCHITECTURES)}"
        )
    model_type, tie_default = ARCHITECTURES[architecture]
    text = {**_DEFAULTS.get(model_type, {}), **text}
    return _shape(_Fields(text, source), name, architecture, model_type, tie_default, config)


def _architecture(config: dict) -> str | None:
    archs = config.get("architectures")
    if isinstance(archs, list):
        known = [a for a in archs if a in ARCHITECTURES]
        if known:
            return known[0]
    return _BY_MODEL_TYPE.get(config.get("model_type")) if archs is None else None


class _Fields:
    """Typed reads from one config dict; every error names the field."""

    def __init__(self, config: dict, source: str) -> None:
        self.config, self.source = config, source

    def _field(self, key: str) -> str:
        return f"{self.source}: {key}" if self.source == "config.json" else f"{self.source}.{key}"

    def positive_int(self, key: str, default: int | None = None) -> int:
        """A positive integer, at most edge.bounds.MAX_DIMENSIONS[key]."""
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(self._field(key), value, "a positive integer")
        return check_dimension(self._field(key), key, value)

    def optional_positive_int(self, key: str) -> int | None:
        return None if self.config.get(key) is None else self.positive_int(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise InputError(self._field(key), value, "true or false")
        return value

    def fraction(self, key: str) -> float | None:
        value = self.config.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise InputError(self._field(key), value, "a number in (0, 1]")
        return float(value)


def _shape(
    f: _Fields, name: str, architecture: str, model_type: str, tie_default: bool, top: dict
) -> ModelShape:
    hidden = f.positive_int("hidden_size")
    intermediate = f.positive_int("intermediate_size")
    layers = f.positive_int("num_hidden_layers")
    heads = f.positive_int("num_attention_heads")
    kv_heads = f.positive_int("num_key_value_heads", default=heads)  # transformers: absent -> MHA
    if heads % kv_heads:
        raise InputError(
            f._field("num_key_value_heads"), kv_heads, f"a divisor of num_attention_heads={heads}"
        )
    head_dim = f.optional_positive_int("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise InputError(
                f._field("head_dim"), None, f"present when hidden_size={hidden} % heads={heads} != 0"
            )
        head_dim = hidden // heads
        if head_dim > MAX_DIMENSIONS["head_dim"]:
            raise InputError(f._field("head_dim"), None, f"present when hidden_size={hidden} // heads={heads} is "
                             f"over {MAX_DIMENSIONS['head_dim']} (no real model's head_dim is larger)")  # fmt: skip
    vocab = f.positive_int("vocab_size")
    # A multimodal wrapper may carry tie_word_embeddings at the top level rather than in text_config.
    tie = f.boolean("tie_word_embeddings", default=top.get("tie_word_embeddings", tie_default))
    max_pos = f.positive_int("max_position_embeddings")
    layer_types, window = _attention_layout(f, model_type, layers)
    return ModelShape(
        name=name,
        architecture=architecture,
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=max_pos,
        rotary_dim=_rotary_dim(f, head_dim),
        layer_types=layer_types,
        sliding_window=window,
        torch_dtype=f.config.get("torch_dtype") or f.config.get("dtype") or top.get("torch_dtype"),
        linears=_linears(model_type, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab),
    )


def _rotary_dim(f: _Fields, head_dim: int) -> int:
    # Phi-3 style partial rotary; vLLM's get_rope: rotary_dim = int(head_size * partial_rotary_factor).
    rope = f.config.get("rope_parameters")
    factor = f.fraction("partial_rotary_factor")
    if factor is None and isinstance(rope, dict):
        factor = _Fields(rope, f._field("rope_parameters")).fraction("partial_rotary_factor")
    return int(head_dim * (factor or 1.0))


def _attention_layout(f: _Fields, model_type: str, layers: int) -> tuple[list[str] | None, int | None]:
    """Per-layer attention types and the window, None/None when every layer attends to the full context.

    Mirrors what vLLM 0.28 ends up with: explicit `layer_types` win; Gemma2 alternates (transformers
    Gemma2Config: layer i slides when (i+1) % 2); Qwen2/3 slide only with use_sliding_window, from layer
    max_window_layers on; otherwise a model-level sliding_window applies to every layer (vLLM
    engine/arg_utils.py sets CacheConfig.sliding_window when there are no layer_types — Mistral v0.1, Phi-3).
    """
    window = f.optional_positive_int("sliding_window")
    explicit = f.config.get("layer_types")
    if explicit is not None:
        if (
            not isinstance(explicit, list)
            or len(explicit) != layers
            or not all(isinstance(t, str) for t in explicit)
        ):
            raise InputError(f._field("layer_types"), explicit, f"a list of {layers} attention type names")
        types = list(explicit)
    elif window is None:
        return None, None
    elif model_type == "gemma2":
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    elif model_type == "gemma3_text":
        pattern = f.positive_int("sliding_window_pattern", default=GEMMA3_PATTERN)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif model_type in ("qwen2", "qwen3"):
        if not f.boolean("use_sliding_window", default=False):
            return None, None
        first = f.positive_int("max_window_layers", default=28)
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    else:
        types = [SLIDING] * layers
    if SLIDING not in types:
        return None, None
    if window is None:
        raise InputError(
            f._field("sliding_window"), None, "a positive integer when layer_types has sliding layers"
        )
    return types, window


def _linears(
    model_type: str,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
) -> list[LinearShape]:
    """Every quantizable linear, weight [N, K].

    Phi-3 checkpoints (and vLLM) hold qkv_proj and gate_up_proj fused; the others list q/k/v and gate/up
    apart as their checkpoints do (vLLM fuses them at load; the sum of N is the same).
    """
    q, kv = heads * head_dim, kv_heads * head_dim
    if model_type == "phi3":
        blocks = [
            ("qkv_proj", q + 2 * kv, hidden),
            ("o_proj", hidden, q),
            ("gate_up_proj", 2 * inter, hidden),
            ("down_proj", hidden, inter),
        ]
    else:
        blocks = [
            ("q_proj", q, hidden),
            ("k_proj", kv, hidden),
            ("v_proj", kv, hidden),
            ("o_proj", hidden, q),
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ]
    linears = [LinearShape(name=name, n=n, k=k, count=layers) for name, n, k in blocks]
    return [*linears, LinearShape(name="lm_head", n=vocab, k=hidden, count=1)]
