"""A Llama decoder as an ONNX graph with an explicit KV cache, its weights at 8 bits (kernels/export/export.py uses it).

The graph, for batch 1 (no padding mask: one sequence per session run):

    inputs   input_ids int64 [1, S], position_ids int64 [1, S],
             past_key_values.{i}.key / .value float32 [1, kv_heads, P, head_dim] for each layer i (P may be 0)
    outputs  logits float32 [1, S, vocab],
             present.{i}.key / .value float32 [1, kv_heads, P + S, head_dim]

The names are those ONNX Runtime GenAI's decoder uses. A prompt is one run with P = 0; each generated token is a
run with S = 1 and the previous run's presents as pasts. Attention is plain MatMul/Softmax and the weights are
standard QDQ (no contrib op), so any ONNX runtime with opset 21 loads the graph; QDQ is the form ONNX Runtime's
QNN (NPU) provider takes quantized models in. Not verified here: whether QNN takes int8 weights with *blocked*
scales (opset 21 block_size) rather than per-channel ones; no phone or NPU was available.

Weights: every linear (q/k/v/o, gate/up/down, the head) is exported in float32 with its weight stored [K, N] (so
the MatMul's B is an initializer), then rewritten as DequantizeLinear(int8, opset 21 blocked) -> MatMul: 8 bits,
symmetric, one scale per BLOCK_SIZE inputs of each output channel. The embedding table is int8 the same way (one
scale per block of each row), gathered and scaled in the graph. Norms and the RoPE tables stay float32.
Activations are float32 in the graph (ONNX Runtime's CPU provider runs them so); the reference study's w8a16 means
a phone provider running them in float16, which is not built or measured here.

Why per block and not per output channel: on the default model (2048 tokens of the eval text, float32 reference)
per-channel int8 gave mean KLD 0.0039 and top-1 95.6 %; blocks of 64 gave 0.0018 and 97.2 % (2026-11-30, AMD EPYC
AVX-512 host). Why QDQ and not ONNX Runtime's MatMulNBits bits=8: same quality (0.0016, 97.5 %), but the CPU
provider here ran it at 1.7 decode tok/s with accuracy_level unset (float activations; its fast path wants int8
activations, which the reference study found breaks phones), and QNN takes QDQ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.export_plan import WEIGHT_BLOCK

BLOCK_SIZE = WEIGHT_BLOCK  # 64: divides SmolLM2's K = 576 and 1536
ACTIVATIONS = "float32 (float16 on a phone provider: not built or measured here)"
OPSET = 17  # the TorchScript exporter's graph; converted to QDQ_OPSET when quantized
QDQ_OPSET = 21  # DequantizeLinear with block_size
ROPE_ROWS = 4096  # cos/sin rows in the graph: the bundle's longest sequence (prompt + generated)


def rope_tables(head_dim: int, theta: float, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [rows, head_dim] as transformers' default RoPE builds them (halves, not interleaved)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [hd/2]
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), inv_freq)  # [rows, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [rows, hd]
    return angles.cos().float(), angles.sin().float()


def int8_blocks(weight: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, K] -> (codes int8 [V, K/b, b], scales float32 [V, K/b, 1]), symmetric per block of each row."""
    v, k = weight.shape
    assert k % block_size == 0, f"expected K divisible by {block_size}, got {k}"
    w = weight.float().reshape(v, k // block_size, block_size)
    scale = w.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 127  # [V, K/b, 1]
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


class Decoder(nn.Module):
    """The exported forward: transformers' LlamaForCausalLM arithmetic, in float32, with the cache as tensors."""

    def __init__(self, hf_model: nn.Module, rope_rows: int = ROPE_ROWS) -> None:
        super().__init__()
        c = hf_model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
        scaling = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
        assert scaling == "default", f"expected default RoPE, got {scaling}"
        cos, sin = rope_tables(self.head_dim, theta, min(rope_rows, c.max_position_embeddings))
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        base = hf_model.model
        codes, scales = int8_blocks(base.embed_tokens.weight.detach())
        self.register_buffer("embed_codes", codes)  # [V, K/b, b] int8
        self.register_buffer("embed_scales", scales)  # [V, K/b, 1] fp32
        self.layers = nn.ModuleList(_Layer(layer) for layer in base.layers)
        self.norm = _weight(base.norm.weight)
        self.head = _weight(hf_model.lm_head.weight.t())  # [K, V]; its own initializer even when tied

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        rows = self.embed_codes[input_ids].float() * self.embed_scales[input_ids]  # [1, S, K/b, b]
        x = rows.flatten(2)  # [1, S, K]
        cos, sin = self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)  # [1, 1, S, hd]
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, key, value = layer(x, cos, sin, past[2 * i], past[2 * i + 1], self)
            presents += [key, value]
        logits = torch.matmul(_rms(x, self.norm, self.eps), self.head)  # [1, S, V]
        return (logits, *presents)


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _weight(layer.input_layernorm.weight)
        self.post_norm = _weight(layer.post_attention_layernorm.weight)
        for name, linear in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                             ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)]:  # fmt: skip
            assert linear.bias is None, f"expected linears without bias, got one in {name}"
            setattr(self, name, _weight(linear.weight.t()))  # [K, N]

    def forward(self, x, cos, sin, past_key, past_value, d: Decoder):
        s = x.shape[1]
        h = _rms(x, self.input_norm, d.eps)
        q = torch.matmul(h, self.q).view(1, s, d.heads, d.head_dim).transpose(1, 2)  # [1, H, S, hd]
        k = torch.matmul(h, self.k).view(1, s, d.kv_heads, d.head_dim).transpose(1, 2)  # [1, KV, S, hd]
        v = torch.matmul(h, self.v).view(1, s, d.kv_heads, d.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        key, value = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)  # [1, KV, T, hd]
        x = x + torch.matmul(_attend(q, key, value, d), self.o)
        h = _rms(x, self.post_norm, d.eps)
        up = torch.nn.functional.silu(torch.matmul(h, self.gate)) * torch.matmul(h, self.up)
        return x + torch.matmul(up, self.down), key, value


def _attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, d: Decoder) -> torch.Tensor:
    """q [1, H, S, hd], key/value [1, KV, T, hd] -> [1, S, H * hd]; causal, the S queries are the last S of T."""
    s, t = q.shape[2], key.shape[2]
    group = d.heads // d.kv_heads
    q = q.reshape(1, d.kv_heads, group * s, d.head_dim)  # heads of one kv head side by side: no repeat of K/V
    scores = torch.matmul(q, key.transpose(2, 3)) * d.head_dim**-0.5  # [1, KV, G*S, T]
    row = torch.arange(s).repeat(group).view(-1, 1) + (t - s)  # [G*S, 1] absolute position of each query
    masked = torch.arange(t).view(1, -1) > row  # [G*S, T]
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [1, KV, G*S, hd]
    return out.reshape(1, d.heads, s, d.head_dim).transpose(1, 2).reshape(1, s, d.heads * d.head_dim)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _weight(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().float().contiguous(), requires_grad=False)


def io_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", *past], ["logits", *present]


def export_float(hf_model: nn.Module, out: Path) -> dict[str, Any]:
    """Export the float32 graph to `out` (one .onnx file); returns what the manifest records of it."""
    decoder = Decoder(hf_model).eval()
    layers = len(decoder.layers)
    inputs, outputs = io_names(layers)
    ids = torch.zeros(1, 3, dtype=torch.int64)
    positions = torch.arange(3).view(1, 3)
    past = [torch.zeros(1, decoder.kv_heads, 2, decoder.head_dim) for _ in range(2 * layers)]
    axes = {"input_ids": {1: "sequence"}, "position_ids": {1: "sequence"}, "logits": {1: "sequence"}}
    axes |= {name: {2: "past"} for name in inputs[2:]} | {name: {2: "total"} for name in outputs[1:]}
    with torch.inference_mode():
        torch.onnx.export(decoder, (ids, positions, *past), str(out), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False, do_constant_folding=True)  # fmt: skip
    return {"layers": layers, "kv_heads": decoder.kv_heads, "head_dim": decoder.head_dim,
            "rope_rows": decoder.cos.shape[0]}  # fmt: skip


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
        w = numpy_helper.to_array(weights[name]).astype(np.float32)  # [K, N]
        k, n = w.shape
        assert k % block_size == 0, f"expected K divisible by {block_size}, got {k} in {name}"
        blocks = w.reshape(k // block_size, block_size, n)  # [K/b, b, N]
        scale = np.maximum(np.abs(blocks).max(axis=1), 1e-12) / 127  # [K/b, N]
        codes = np.clip(np.round(blocks / scale[:, None, :]), -127, 127).astype(np.int8).reshape(k, n)  # [K, N]
        graph.initializer.remove(weights.pop(name))
        graph.initializer.extend([numpy_helper.from_array(codes, f"{name}_int8"),
                                  numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale"),
                                  numpy_helper.from_array(np.zeros_like(scale, np.int8), f"{name}_zero")])  # fmt: skip
        inputs = [f"{name}_int8", f"{name}_scale", f"{name}_zero"]
        dq = helper.make_node("DequantizeLinear", inputs, [f"{name}_dq"], axis=0, block_size=block_size)
        graph.node.insert(list(graph.node).index(node), dq)
        node.input[1] = f"{name}_dq"
        count += 1
    onnx.checker.check_model(model)
    onnx.save_model(model, str(dst))
    return count
