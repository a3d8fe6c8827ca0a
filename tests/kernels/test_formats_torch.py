"""The formats' torch halves (kernels.formats): each kernel's calibration timer lives with the format that stores
the weights it reads, and each format's converter step writes the tensors its vLLM method loads."""

from __future__ import annotations

import torch

from edge.catalog.kernel_registry import KERNELS
from edge.formats import kernel_layout_format
from kernels.formats import MODULES, timed_kernels, tinygemm
from kernels.ops.int4 import dequantize


def test_each_kernels_timer_lives_with_the_format_of_its_weights():
    homes = {name: fmt for fmt, module in MODULES.items() for name in module.TIMERS}
    assert sorted(timed_kernels()) == sorted(KERNELS)
    assert {name: kernel_layout_format(spec.weight_format).name for name, spec in KERNELS.items()} == homes


def test_the_tinygemm_step_quantizes_chunk_by_chunk_as_one_matrix():
    w = torch.randn(256, 128)
    whole = tinygemm.convert("q", [w], {"group_size": 64}, name="q.weight")
    chunked = tinygemm.convert("q", list(w.split(64)), {"group_size": 64}, name="q.weight")
    assert all(torch.equal(whole[key], chunked[key]) for key in whole)
    restored = dequantize(whole["q.qweight"], whole["q.scales"], whole["q.zeros"], 64, torch.float32)
    assert (restored - w).abs().max() < 0.2 * w.abs().max()  # 4 bits: within a fraction of the range
