"""The bundle as ONNX Runtime GenAI loads it: `genai_config.json`, and greedy generation through its own API.

ONNX Runtime GenAI (`onnxruntime-genai`, the library Android and iOS apps use through its Model / Tokenizer /
Generator API) opens a directory holding `genai_config.json`, the decoder graph it names, and the Hugging Face
tokenizer files (tokenizer.json, tokenizer_config.json), which its tokenizer reads as they are. The config says
which graph inputs and outputs carry what (its decoder feeds `input_ids` and `position_ids`, and the KV cache as
`past_key_values.%d.key|value` -> `present.%d.key|value`, the names kernels/export/export_graph.py gives them), the
shapes of the cache, the special tokens, and the search defaults, which come from the model's
generation_config.json where it has one (as onnxruntime-genai's own model builder takes them).

`past_present_share_buffer` is false: the graph concatenates the past with the new keys and values (plain ONNX ops,
no GroupQueryAttention contrib op), so each step's presents are new tensors that the runtime feeds back as pasts.
Sliding-window layers (Gemma 2/3, Mistral) mask inside the graph over the whole cache, so the config declares no
`sliding_window`: the runtime keeps every position, as the graph expects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "genai_config.json"
# The session options the bundle runs with, here and in an app (written into genai_config.json's session_options,
# which onnxruntime-genai passes to ONNX Runtime as config entries): fold each weight's DequantizeLinear into a
# float initializer at load, so the linears run with float activations (w8a16, what the plan names). Without it
# ONNX Runtime 1.32's CPU provider fuses DequantizeLinear -> MatMul into MatMulNBits (bits=8) at accuracy level 4,
# which quantizes the activations to int8 per block: on the default model that measured mean KLD 0.0068 and top-1
# 95.1 % against 0.0018 and 97.7 % folded (1024 tokens, benchmarks/export_session_paths.py), below the 97 % target.
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}
# search options read from generation_config.json, with transformers' GenerationConfig defaults
SEARCH_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "num_beams": 1, "length_penalty": 1.0, "no_repeat_ngram_size": 0}  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids(value: Any) -> int | list[int] | None:
    if isinstance(value, list):
        return [int(v) for v in value] if len(value) > 1 else int(value[0]) if value else None
    return None if value is None else int(value)


def genai_config(src: Path, graph: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The genai_config.json of a bundle whose decoder is `graph`, exported from the model at `src` with `shape`
    (export_graph.export_float's record: family, layers, kv_heads, head_dim, heads, hidden, vocab, and rope_rows,
    the longest sequence the graph takes). model.type is the family as transformers names it, which is
    onnxruntime-genai's name for each of them (its model builder: model_type before "For", lower-cased)."""
    context_length = shape["rope_rows"]
    config, generation = _read(src / "config.json"), _read(src / "generation_config.json")
    text = config.get("text_config") or config  # a multimodal wrapper's language model
    bos = _ids(generation.get("bos_token_id", text.get("bos_token_id")))
    eos = _ids(generation.get("eos_token_id", text.get("eos_token_id")))
    pad = _ids(generation.get("pad_token_id", text.get("pad_token_id")))
    if pad is None:  # the runtime pads batched prompts; an end token is what its model builder falls back to
        pad = eos[0] if isinstance(eos, list) else eos
    search = {key: generation.get(key, default) for key, default in SEARCH_DEFAULTS.items()}
    search |= {"top_k": search["top_k"] or SEARCH_DEFAULTS["top_k"], "top_p": search["top_p"] or 1.0,
               "max_length": context_length, "min_length": 0, "num_return_sequences": 1, "early_stopping": True,
               "diversity_penalty": 0.0, "past_present_share_buffer": False}  # fmt: skip
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": [], **SESSION_CONFIG},
        "filename": graph,
        "head_size": shape["head_dim"],
        "hidden_size": shape["hidden"],
        "num_attention_heads": shape["heads"],
        "num_hidden_layers": shape["layers"],
        "num_key_value_heads": shape["kv_heads"],
        "inputs": {"input_ids": "input_ids", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }  # fmt: skip
    model = {"type": shape["family"], "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
             "context_length": context_length, "vocab_size": shape["vocab"], "decoder": decoder}  # fmt: skip
    model = {key: value for key, value in model.items() if value is not None}  # the runtime reads no nulls
    return {"model": model, "search": dict(sorted(search.items()))}


def write_genai_config(bundle: Path, src: Path, graph: str, shape: dict[str, Any]) -> None:
    body = genai_config(src, graph, shape)
    (bundle / CONFIG).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def greedy_ids(model: Any, ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `ids` by onnxruntime_genai's Generator on `model` (an og.Model), on its own
    KV cache; min_length keeps an end token from stopping it short."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens([ids])
    while not generator.is_done():
        generator.generate_next_token()
    return [int(i) for i in generator.get_sequence(0)][len(ids) :]


def generate(bundle: Path, prompts: list[str], new_tokens: int) -> list[dict[str, Any]]:
    """Greedy continuations of `prompts`, `new_tokens` each, by onnxruntime-genai itself: its Model loads the
    bundle from genai_config.json, its Tokenizer encodes the prompt and decodes the continuation, its Generator
    runs the graph (greedy_ids). Returns per prompt its prompt ids, continuation ids and text."""
    import onnxruntime_genai as og

    model = og.Model(str(bundle))
    tokenizer = og.Tokenizer(model)
    rows = []
    for prompt in prompts:
        ids = [int(i) for i in tokenizer.encode(prompt)]
        got = greedy_ids(model, ids, new_tokens)
        rows.append({"prompt": prompt, "prompt_ids": ids, "ids": got, "text": tokenizer.decode(got)})
    return rows
