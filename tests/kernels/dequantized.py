"""A converted checkpoint as transformers runs it in float32, every quantized tensor dequantized: the reference the
per-family tests hold the converter (test_convert_gguf.py) and edge-eval's candidate (test_eval_families.py) to.

Reads each format edge-convert writes: cpu_int4 (qweight uint8 [N, K/2], scales, zeros [N, K/g]), the 8-bit set
(qweight int8 [N, K], scales [N] or [N, K/g]) and GPTQ (qweight int32 [K/8, N], scales [K/g, N]; cpu_w4a8 and gptq
plans). The config is the checkpoint's own, less its quantization_config, so the architecture is the one the
checkpoint declares."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def dequantized_model(checkpoint: Path, scratch: Path) -> torch.nn.Module:
    """transformers' module for the checkpoint's config, in float32, holding its weights dequantized; `scratch` is
    a directory for the plain config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernels.ops.gptq import dequantize_gptq
    from kernels.ops.int4 import dequantize
    from kernels.ops.int8 import dequantize_int8

    config = json.loads((checkpoint / "config.json").read_text())
    group = (config.pop("quantization_config", None) or {}).get("group_size")
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(scratch), dtype=torch.float32)
    written: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        written |= load_file(file)
    state = {}
    for name, tensor in written.items():
        if name.endswith((".scales", ".zeros", ".qzeros", ".g_idx")):
            continue
        if not name.endswith(".qweight"):
            state[name] = tensor.float()
            continue
        prefix = name.removesuffix(".qweight")
        scales = written[f"{prefix}.scales"]
        if tensor.dtype == torch.int8:
            weight = dequantize_int8(tensor, scales, torch.float32)
        elif tensor.dtype == torch.int32:
            weight = dequantize_gptq(written, group, prefix=prefix)
        else:
            weight = dequantize(tensor, scales, written[f"{prefix}.zeros"], group).float()
        state[f"{prefix}.weight"] = weight
    loaded = model.load_state_dict(state, strict=False)
    assert loaded.unexpected_keys == [], loaded.unexpected_keys
    assert set(loaded.missing_keys) <= {"lm_head.weight"}, loaded.missing_keys  # a tied head is the embedding
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    return model.eval()
