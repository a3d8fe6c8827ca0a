"""ARM's own 4-bit kernel: symmetric int4 weights per group of 32, activations quantized to int8 per row inside the
kernel (KleidiAI's micro-kernels behind torch's `_dyn_quant_pack_4bit_weight` / `_dyn_quant_matmul_4bit`, the ops
vLLM's Dynamic4bitLinearKernel calls on Arm). It reads the `w4a8-gptq` path's checkpoint (kernels/ops/gptq.py: codes
0..15 meaning q - 8 times the group's scale), so one conversion serves both this kernel and x86's int4_scaled_mm_cpu.

    codes    uint8 [N, K/2]: two 4-bit codes a byte along K, the even column in the low nibble (the order torch's
             packer takes, as vLLM's kernel builds it)
    scales   bf16 [N, K/g]: KleidiAI's groupwise kernels take bf16 scales
    packed   torch's opaque buffer for the host: KleidiAI's own layout on aarch64 (with the scales inside), a reference
             layout elsewhere, where torch computes the same arithmetic without KleidiAI (this project's x86 hosts
             check the logic with it, never the speed)

Activations go in as float32: KleidiAI's groupwise kernels take only float32 (vLLM upcasts bf16 and float16 the same
way), and the output comes back in the caller's dtype. Every core torch's aarch64 build runs on takes group 32
(emulated Cortex-A76 and a 256-bit SVE core, docs/FACTS.md); channelwise needs BF16 ("CPU does not support BF16" on
the A76), so this module offers group 32 alone.
"""

from __future__ import annotations

import torch

from edge.catalog.shape_rules import KLEIDIAI_GROUP as GROUP
from edge.errors import InputError

ZERO = 8  # uint4b8: a code q means q - 8


def available() -> bool:
    """Whether the running torch has the ops (2.6 and later)."""
    return hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit") and hasattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight")


def accelerated() -> bool:
    """Whether torch runs them on KleidiAI (its aarch64 builds) rather than its reference code."""
    backend = getattr(torch.backends, "kleidiai", None)
    return bool(backend is not None and backend.is_available())


def check(n: int, k: int, group: int = GROUP, name: str = "weight") -> None:
    if group != GROUP:
        raise InputError("group_size", group, f"{GROUP} (KleidiAI's groupwise int4 kernels on every Arm core)")
    if k % group or k % 2:
        raise InputError(name, f"K={k}", f"K a multiple of {group}")
    if n < 1:
        raise InputError(name, f"N={n}", "at least one output channel")


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 (any integer dtype) -> uint8 [N, K/2], the even column in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[:, 1::2] << 4 | c[:, 0::2]).contiguous()


def from_gptq(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPTQ checkpoint's qweight int32 [K/8, N] and scales [K/g, N] -> (codes uint8 [N, K/2], scales bf16
    [N, K/g])."""
    from kernels.ops.gptq import codes_of

    codes = codes_of(qweight).t()  # [N, K] 0..15
    return pack_codes(codes), scales.t().to(torch.bfloat16).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """codes uint8 [N, K/2] and scales [N, K/g] -> torch's packed buffer for `linear`."""
    n, half_k = codes.shape
    check(n, half_k * 2, group)
    if scales.shape != (n, half_k * 2 // group):
        raise InputError("scales", tuple(scales.shape), f"[N, K/{group}] = [{n}, {half_k * 2 // group}]")
    return torch.ops.aten._dyn_quant_pack_4bit_weight(codes, scales.to(torch.bfloat16), None, group, half_k * 2, n)


def linear(x: torch.Tensor, packed: torch.Tensor, k: int, n: int, group: int = GROUP) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype: x rounded to int8 per row by the kernel."""
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.ops.aten._dyn_quant_matmul_4bit(x2, packed, group, k, n)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float32 weight [N, K] the codes and scales stand for (the accuracy tests' reference)."""
    low, high = (codes & 0xF).to(torch.int32), (codes >> 4).to(torch.int32)
    q = torch.stack((low, high), dim=-1).flatten(1) - ZERO  # [N, K]
    n, k = q.shape
    return (q.reshape(n, k // group, group).float() * scales.float().unsqueeze(-1)).reshape(n, k)
