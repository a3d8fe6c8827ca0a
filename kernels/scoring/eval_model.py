"""The two models edge-eval compares, as plain PyTorch on CPU: the bf16 source, and the candidate running the
kernels its checkpoint is served with.

The candidate starts as a second copy of the source (transformers' own Llama/Qwen/... modules), then every
tensor of the candidate checkpoint replaces its counterpart: bf16 tensors are copied in (a bf16 conversion, or a
re-rounded bf16 model, is simply those weights), and each quantized layer becomes a module that calls what vLLM
calls for it:

    cpu_int4  <prefix>.qweight uint8 [N, K/2], .scales, .zeros bf16 [N, K/g] (kernels/ops/int4.py): the linear runs
              kernels.ops.int4_ops.int4_linear_impl, the body of vLLM's `cpu_int4_linear` op, on the tinygemm buffer
              kernels.ops.tinygemm.to_tinygemm builds, with the checkpoint's group_size, layout (direct / dual /
              kernel-only) and dequant_threshold; so a 512-row prompt dequantizes and runs one GEMM, a row below
              the threshold runs tinygemm, exactly as in the engine. A quantized embedding runs
              kernels.ops.int4_ops.embedding_impl; a head tied to it shares its tensors and, as in
              kernels.vllm_plugin.cpu_int4 (CpuInt4EmbeddingMethod), runs in dual mode. A layer of the 8-bit set
              (qweight int8 [N, K], scales [N], kernels/ops/int8.py) runs int8_linear_impl / int8_embedding_impl.
              A quantized embedding keeps the scale the source's module multiplied by (Gemma 3's sqrt(hidden):
              kernels.scoring.eval_modules.replace_embedding), as vLLM's model applies its normalizer.
    gptq      <prefix>.qweight int32 [K/8, N], .scales [K/g, N]: kernels.scoring.eval_gptq (vLLM's own CPU kernel
    class).

One difference from the engine stays: vLLM fuses q/k/v and gate/up into one GEMM each; here they run as separate
GEMMs over the same dequantized weights, which changes only the GEMM's summation blocking, not the weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.errors import InputError
from kernels.scoring.eval_config import quant_method, read_config
from kernels.scoring.eval_cpu_int4 import install_cpu_int4
from kernels.scoring.eval_cpu_w4a8 import install_cpu_w4a8
from kernels.scoring.eval_gptq import install_gptq

_QUANT_SUFFIXES = ("qweight", "scales", "zeros", "meta", "blocks", "qzeros", "g_idx")
# By the checkpoint's quant_method: what replaces its quantized layers (a bf16 checkpoint has none).
INSTALLERS = {
    "cpu_int4": install_cpu_int4,
    "gptq": lambda model, quantized, qconfig, tied: install_gptq(model, quantized, qconfig),  # no 8-bit set
    "cpu_w4a8": install_cpu_w4a8,
}


@dataclass
class Candidate:
    model: nn.Module
    quant_method: str  # "bf16", "cpu_int4" or "gptq"
    quantization_config: dict[str, Any] | None
    kernel: dict[str, Any] = field(default_factory=dict)  # what runs, for the report


def load_source(directory: Path) -> nn.Module:
    """The bf16 model in eval mode, from local files only."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers imports huggingface_hub
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, local_files_only=True)
    return model.eval()


def load_candidate(directory: Path, source_dir: Path, qconfig: dict[str, Any] | None = None) -> Candidate:
    """The source's architecture with the candidate checkpoint's tensors and kernels (module docstring); qconfig:
    the quantization_config to run it with instead of the checkpoint's (the same weights, another decode kernel)."""
    config = read_config(directory, "CANDIDATE")
    method = quant_method(config)
    qconfig = config.get("quantization_config") if qconfig is None else qconfig
    model = load_source(source_dir)
    tensors = _read_tensors(Path(directory))
    quantized = _copy_plain_tensors(model, tensors)
    tied = _is_tied(model)  # after the copy, which unties a head the candidate writes out
    if method == "bf16" and quantized:
        first = next(iter(quantized))
        raise InputError(f"{first}.{next(iter(quantized[first]))}", "present", "no quantized tensors in a bf16 "
                         "checkpoint (config.json has no quantization_config)")  # fmt: skip
    install = INSTALLERS.get(method)
    kernel = install(model, quantized, qconfig, tied) if install else {"kernel": "bf16 (torch F.linear)"}
    _check_complete(model, tensors, quantized, tied)
    return Candidate(model.eval(), method, qconfig, kernel)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        raise InputError("CANDIDATE", str(directory), "a directory with safetensors weights (*.safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                # clone: get_tensor's storage may be only 8-byte aligned, and PyTorch's _weight_int8pack_mm
                # segfaults on an int8 weight whose data is not 64-byte aligned (seen here, torch 2.13, AVX-512).
                # vLLM copies every weight into its own (aligned) parameter, so the engine never sees this.
                tensors.update({name: f.get_tensor(name).clone() for name in f.keys()})  # noqa: SIM118
        except SafetensorError as error:
            raise InputError(file.name, str(error), "a readable safetensors file") from None
    return tensors


def _copy_plain_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Copy every float tensor into the model; return the quantized ones grouped {prefix: {suffix: tensor}}."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if "lm_head.weight" in tensors and _is_tied(model):
        model.lm_head.weight = nn.Parameter(tensors["lm_head.weight"].clone(), requires_grad=False)  # untie
        params["lm_head.weight"] = model.lm_head.weight
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in _QUANT_SUFFIXES and name not in params:
            quantized.setdefault(prefix, {})[suffix] = tensor
            continue
        if name not in params:
            raise InputError("CANDIDATE tensor", name, "a tensor the source model has")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise InputError(name, list(tensor.shape), f"shape {list(target.shape)}, as in the source")
        with torch.no_grad():
            target.copy_(tensor)
    return quantized


def _is_tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embedding.weight


def _check_complete(model: nn.Module, tensors: dict[str, torch.Tensor], quantized: dict[str, Any], tied: bool) -> None:
    """Every source weight came from the candidate: copied, replaced by a quantized module, or tied."""
    covered = set(tensors) | {f"{prefix}.weight" for prefix in quantized}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name in covered or (tied and name == "lm_head.weight"):
            continue
        if any(name.startswith(prefix + ".") for prefix in quantized):
            continue  # a parameter of a quantized module (the replaced module's own)
        raise InputError("CANDIDATE", f"no tensor {name}", "every weight of the source model")
