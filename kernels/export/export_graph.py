"""A decoder (Llama, Mistral, Qwen2/3, Gemma 1/2/3: FAMILIES) as an ONNX graph with an explicit KV cache, its weights
at 8 bits (kernels/export/export.py uses it).

The graph, for batch 1 (no padding mask: one sequence per session run), A the activations' type (float32 or float16):

    inputs   input_ids int64 [1, S], position_ids int64 [1, S],
             past_key_values.{i}.key / .value A [1, kv_heads, P, head_dim] for each layer i (P may be 0)
    outputs  logits float32 [1, S, vocab],
             present.{i}.key / .value A [1, kv_heads, P + S, head_dim]

The names are those ONNX Runtime GenAI's decoder uses. A prompt is one run with P = 0; each generated token is a
run with S = 1 and the previous run's presents as pasts. Attention is plain MatMul/Softmax and the weights are
standard QDQ (no contrib op), so any ONNX runtime with opset 21 loads the graph; QDQ is the form ONNX Runtime's
QNN (NPU) provider takes quantized models in. Not verified here: whether QNN takes int8 weights with *blocked*
scales (opset 21 block_size) rather than per-channel ones; no phone or NPU was available.

Weights: every linear (q/k/v/o, gate/up/down, the head) is exported in float32 with its weight stored [K, N] (so
the MatMul's B is an initializer), then rewritten as DequantizeLinear(int8, opset 21 blocked) -> MatMul: 8 bits,
symmetric, one scale per BLOCK_SIZE inputs of each output channel. The embedding table is int8 the same way (one
scale per block of each row), gathered and scaled in the graph. Norms stay float32, the RoPE tables are in A.
In float16 (the plan's w8a16: what a phone provider runs) the linears, attention and cache are float16 and the
residual, norms' statistics, softmax and logits float32 (Decoder's docstring).

Why per block and not per output channel: on the default model (2048 tokens of the eval text, float32 reference)
per-channel int8 gave mean KLD 0.0039 and top-1 95.6 %; blocks of 64 gave 0.0018 and 97.2 % (2026-11-30, AMD EPYC
AVX-512 host). Why QDQ and not ONNX Runtime's MatMulNBits bits=8: with float activations (accuracy level 0) the
same quality, but the CPU provider here ran it at 4-5 decode tok/s; at its default level 4 it makes the activations
int8 (KLD 0.0068, top-1 95.1 %: docs/reports/2026-12-02-phone-bundle.md), and QNN takes QDQ. ONNX Runtime fuses
this graph's QDQ into that MatMulNBits by default too, so the bundle's session options turn that off
(kernels/export/genai.py SESSION_CONFIG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.formats.export import WEIGHT_BLOCK

BLOCK_SIZE = WEIGHT_BLOCK  # 64: divides SmolLM2's K = 576 and 1536
OPSET = 17  # the TorchScript exporter's graph; converted to QDQ_OPSET when quantized
QDQ_OPSET = 21  # DequantizeLinear with block_size
ROPE_ROWS = 4096  # cos/sin rows in the graph: the bundle's longest sequence (prompt + generated)


# model_type -> the arithmetic that differs from Llama's (transformers' modeling_<family>.py):
#   gemma   norms scale by (1 + w), embeddings are scaled by sqrt(hidden)
#   others  Llama's; Qwen2 adds q/k/v biases, Qwen3 and Gemma 3 norm q and k per head, Gemma 2/3 add norms after
#           attention and around the MLP, Gemma 2 soft-caps attention scores and logits, Mistral and the Gemmas
#           window some or all layers; each is read off the source's own modules and config, not assumed per family
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
ACTIVATIONS = {"float32": torch.float32, "float16": torch.float16}
SEQUENCE_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})  # their tables change with the sequence's length


def family_of(config: Any) -> str:
    """The source's model_type, checked against what the exporter builds (FAMILIES)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r}: the exporter builds {', '.join(FAMILIES)}")
    return model_type


def rope_tables(hf_model: nn.Module, head_dim: int, rows: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """cos, sin float32 [rows, head_dim] from the source's own rotary embedding (so every RoPE type transformers
    implements, llama3, linear, yarn, comes out as the source computes it), one pair per layer type where the
    family keys its RoPE by layer type (Gemma 3: local and global bases); the key None where it does not."""
    import inspect

    rotary = hf_model.model.rotary_emb
    rope = getattr(hf_model.config, "rope_parameters", None) or {}
    kinds = {p.get("rope_type", "default") for p in (rope.values() if "rope_type" not in rope else [rope])
             if isinstance(p, dict)}  # fmt: skip
    if kinds & SEQUENCE_DEPENDENT_ROPE:  # edge-export refuses them first, naming the config's field
        raise ValueError(f"rope_type {sorted(kinds & SEQUENCE_DEPENDENT_ROPE)[0]!r}: the graph holds one fixed table")
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(rows).view(1, rows)
    with torch.no_grad():
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            types = sorted(set(hf_model.config.layer_types))
            tables = {t: rotary(x, positions, t) for t in types}
        else:
            tables = {None: rotary(x, positions)}
    for cos, _ in tables.values():
        assert cos.shape[-1] == head_dim, f"expected RoPE over the whole head ({head_dim}), got {cos.shape[-1]}"
    return {t: (cos[0].float(), sin[0].float()) for t, (cos, sin) in tables.items()}


def int8_blocks(weight: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, K] -> (codes int8 [V, K/b, b], scales float32 [V, K/b, 1]), symmetric per block of each row."""
    v, k = weight.shape
    assert k % block_size == 0, f"expected K divisible by {block_size}, got {k}"
    w = weight.float().reshape(v, k // block_size, block_size)
    scale = w.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 127  # [V, K/b, 1]
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


class Decoder(nn.Module):
    """The exported forward: the source family's arithmetic (transformers' modeling code), with the cache as tensors.

    `dtype` is the activations' type: float32, or float16 as a phone's provider runs them. In float16 the linears,
    attention and KV cache are float16; the residual stream, the norms' statistics, the softmax and the logits stay
    float32 (as transformers upcasts norms and softmax, and llama.cpp keeps its residual in float32): Gemma's
    residual outgrows float16's range, and these are a few percent of the work."""

    def __init__(self, hf_model: nn.Module, rope_rows: int = ROPE_ROWS, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = hf_model.config
        self.family = family_of(c)
        self.dtype = dtype
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.rope_rows = min(rope_rows, c.max_position_embeddings)
        self.attn_softcap = getattr(c, "attn_logit_softcapping", None)
        self.final_softcap = getattr(c, "final_logit_softcapping", None)
        self.norm_offset = 1.0 if self.family.startswith("gemma") else 0.0
        self.tables: list[str] = []
        for kind, (cos, sin) in rope_tables(hf_model, self.head_dim, self.rope_rows).items():
            suffix = "" if kind is None else f"_{kind}"
            self.register_buffer(f"cos{suffix}", cos.to(dtype))
            self.register_buffer(f"sin{suffix}", sin.to(dtype))
            self.tables.append(suffix)
        base = hf_model.model
        self.embed_scale = float(getattr(base.embed_tokens, "scalar_embed_scale", 1.0))
        codes, scales = int8_blocks(base.embed_tokens.weight.detach())
        self.register_buffer("embed_codes", codes)  # [V, K/b, b] int8
        self.register_buffer("embed_scales", scales)  # [V, K/b, 1] fp32
        self.layers = nn.ModuleList(_Layer(layer, self) for layer in base.layers)
        self.norm = self.norm_weight(base.norm)
        self.head = _weight(hf_model.lm_head.weight.t(), dtype)  # [K, V]; its own initializer even when tied

    def norm_weight(self, norm: nn.Module) -> nn.Parameter:
        return _weight(norm.weight + self.norm_offset, torch.float32)  # Gemma's (1 + w), added in float32

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        rows = self.embed_codes[input_ids].float() * self.embed_scales[input_ids]  # [1, S, K/b, b]
        x = rows.flatten(2)  # [1, S, K] float32: the residual stream
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        rope = {s: (getattr(self, f"cos{s}")[position_ids].unsqueeze(1), getattr(self, f"sin{s}")[position_ids]
                    .unsqueeze(1)) for s in self.tables}  # [1, 1, S, hd] each  # fmt: skip
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, key, value = layer(x, rope[layer.table], past[2 * i], past[2 * i + 1], self)
            presents += [key, value]
        logits = torch.matmul(self.rms(x, self.norm), self.head).float()  # [1, S, V]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return (logits, *presents)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32 (x of any type), returned in the activations' type."""
        x = x.float()
        return (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))).to(self.dtype)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, d: Decoder) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = d.norm_weight(layer.input_layernorm)
        self.post_norm = d.norm_weight(layer.post_attention_layernorm)
        # Gemma 2/3: post_attention_layernorm norms the attention's output; pre/post_feedforward_layernorm the MLP's
        self.sandwich = hasattr(layer, "pre_feedforward_layernorm")
        if self.sandwich:
            self.pre_ff_norm = d.norm_weight(layer.pre_feedforward_layernorm)
            self.post_ff_norm = d.norm_weight(layer.post_feedforward_layernorm)
        self.qk_norm = hasattr(attn, "q_norm")  # Qwen3, Gemma 3: per head, before RoPE
        if self.qk_norm:
            self.q_norm, self.k_norm = d.norm_weight(attn.q_norm), d.norm_weight(attn.k_norm)
        self.scaling = float(attn.scaling)
        window = getattr(attn, "sliding_window", None)
        if d.family == "mistral":  # Mistral windows every layer by its config, not per attention module
            window = getattr(attn.config, "sliding_window", None)
        self.window = window if window and window < d.rope_rows else None  # a window past the table never binds
        kind = getattr(attn, "layer_type", None)
        self.table = f"_{kind}" if f"_{kind}" in d.tables else ""
        self.act = mlp.act_fn  # the source's activation module: SiLU, or GELU(tanh) for the Gemmas
        self.biases: list[str] = []
        for name, module in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                             ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)]:  # fmt: skip
            setattr(self, name, _weight(module.weight.t(), d.dtype))  # [K, N]
            if module.bias is not None:  # Qwen2's q/k/v
                setattr(self, f"{name}_bias", _weight(module.bias, d.dtype))
                self.biases.append(name)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = torch.matmul(x, getattr(self, name))
        return y + getattr(self, f"{name}_bias") if name in self.biases else y

    def forward(self, x, rope, past_key, past_value, d: Decoder):
        s = x.shape[1]
        cos, sin = rope
        h = d.rms(x, self.input_norm)
        q = self.linear(h, "q").view(1, s, d.heads, d.head_dim)
        k = self.linear(h, "k").view(1, s, d.kv_heads, d.head_dim)
        v = self.linear(h, "v").view(1, s, d.kv_heads, d.head_dim).transpose(1, 2)  # [1, KV, S, hd]
        if self.qk_norm:
            q, k = d.rms(q, self.q_norm), d.rms(k, self.k_norm)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)  # [1, H|KV, S, hd]
        key, value = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)  # [1, KV, T, hd]
        attended = self.linear(_attend(q, key, value, d, self), "o")
        if self.sandwich:
            attended = d.rms(attended, self.post_norm)
        x = x + attended.float()
        h = d.rms(x, self.pre_ff_norm if self.sandwich else self.post_norm)
        mlp = self.linear(self.act(self.linear(h, "gate")) * self.linear(h, "up"), "down")
        if self.sandwich:
            mlp = d.rms(mlp, self.post_ff_norm)
        return x + mlp.float(), key, value


def _attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, d: Decoder, layer: _Layer) -> torch.Tensor:
    """q [1, H, S, hd], key/value [1, KV, T, hd] -> [1, S, H * hd]; causal (and windowed where the layer is), the S
    queries are the last S of T; scores and softmax in float32."""
    s, t = q.shape[2], key.shape[2]
    group = d.heads // d.kv_heads
    q = q.reshape(1, d.kv_heads, group * s, d.head_dim)  # heads of one kv head side by side: no repeat of K/V
    scores = torch.matmul(q, key.transpose(2, 3)).float() * layer.scaling  # [1, KV, G*S, T]
    if d.attn_softcap is not None:
        scores = torch.tanh(scores / d.attn_softcap) * d.attn_softcap
    row = torch.arange(s).repeat(group).view(-1, 1) + (t - s)  # [G*S, 1] absolute position of each query
    column = torch.arange(t).view(1, -1)
    masked = column > row  # [G*S, T]
    if layer.window is not None:  # transformers' sliding window: a query sees keys kv > q - window
        masked = masked | (column <= row - layer.window)
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(d.dtype), value)  # [1, KV, G*S, hd]
    return out.reshape(1, d.heads, s, d.head_dim).transpose(1, 2).reshape(1, s, d.heads * d.head_dim)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _weight(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(tensor.detach().to(dtype).contiguous(), requires_grad=False)


def io_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", *past], ["logits", *present]


def export_float(hf_model: nn.Module, out: Path, activations: str = "float32") -> dict[str, Any]:
    """Export the graph with float weights (float32 source weights; activations and linears in `activations`) to
    `out` (one .onnx file); returns what the manifest and genai_config.json record of it."""
    dtype = ACTIVATIONS[activations]
    decoder = Decoder(hf_model, dtype=dtype).eval()
    layers = len(decoder.layers)
    inputs, outputs = io_names(layers)
    ids = torch.zeros(1, 3, dtype=torch.int64)
    positions = torch.arange(3).view(1, 3)
    past = [torch.zeros(1, decoder.kv_heads, 2, decoder.head_dim, dtype=dtype) for _ in range(2 * layers)]
    axes = {"input_ids": {1: "sequence"}, "position_ids": {1: "sequence"}, "logits": {1: "sequence"}}
    axes |= {name: {2: "past"} for name in inputs[2:]} | {name: {2: "total"} for name in outputs[1:]}
    with torch.inference_mode():
        torch.onnx.export(decoder, (ids, positions, *past), str(out), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False, do_constant_folding=True)  # fmt: skip
    c = hf_model.config
    return {"family": decoder.family, "layers": layers, "heads": decoder.heads,
            "kv_heads": decoder.kv_heads, "head_dim": decoder.head_dim, "hidden": c.hidden_size,
            "vocab": c.vocab_size, "rope_rows": decoder.rope_rows, "activations": activations,
            "windowed_layers": sum(layer.window is not None for layer in decoder.layers)}  # fmt: skip


def quantize_qdq(src: Path, dst: Path, block_size: int = BLOCK_SIZE) -> int:
    """Rewrite every MatMul whose B is a float initializer [K, N] as
    DequantizeLinear(int8 [K, N], scale [K/block, N], axis=0, block_size) -> MatMul: 8 bits, symmetric, one scale
    per `block_size` inputs of each output channel (opset 21 blocked quantization). Returns the count rewritten."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper, version_converter

    model = version_converter.convert_version(onnx.load(str(src)), QDQ_OPSET)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    count = 0
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.input[1] not in weights:
            continue
        name = node.input[1]
        w = numpy_helper.to_array(weights[name])  # [K, N] in the activations' type
        dtype, w = w.dtype, w.astype(np.float32)
        k, n = w.shape
        assert k % block_size == 0, f"expected K divisible by {block_size}, got {k} in {name}"
        blocks = w.reshape(k // block_size, block_size, n)  # [K/b, b, N]
        # [K/b, N] in the output's type; an all-zero block (a padding row of a tied head) gets the type's smallest
        # normal, not a scale that underflows to 0 in float16
        scale = np.maximum(np.abs(blocks).max(axis=1) / 127, np.finfo(dtype).tiny).astype(dtype)
        # codes against the stored (float16-rounded, where the graph is float16) scale
        codes = np.clip(np.round(blocks / scale[:, None, :].astype(np.float32)), -127, 127)
        codes = codes.astype(np.int8).reshape(k, n)  # [K, N]
        graph.initializer.remove(weights.pop(name))
        graph.initializer.extend([numpy_helper.from_array(codes, f"{name}_int8"),
                                  numpy_helper.from_array(scale, f"{name}_scale"),
                                  numpy_helper.from_array(np.zeros_like(scale, np.int8), f"{name}_zero")])  # fmt: skip
        inputs = [f"{name}_int8", f"{name}_scale", f"{name}_zero"]
        dq = helper.make_node("DequantizeLinear", inputs, [f"{name}_dq"], axis=0, block_size=block_size)
        graph.node.insert(list(graph.node).index(node), dq)
        node.input[1] = f"{name}_dq"
        count += 1
    onnx.checker.check_model(model)
    onnx.save_model(model, str(dst))
    return count
