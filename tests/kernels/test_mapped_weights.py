"""kernels/vllm_plugin/mapped_weights.py: a loaded model's tensors moved onto a private mapping of an image file.

The modules here are stand-ins shaped like one layer of the default model (SmolLM2-135M: hidden 576, MLP 1536) with
tensors carved as the plugin carves them; the real engine is tests/server/test_mapped_weights_slow.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels.ops import huge_pages
from kernels.vllm_plugin import mapped_weights
from kernels.vllm_plugin.mapped_weights import Image, map_model

HIDDEN, MLP = 576, 1536


def _layer(seed: int = 0) -> torch.nn.Module:
    """A stand-in for a loaded linear layer: a norm parameter, int8 codes and float scales from the huge-page arena,
    and a second attribute naming the same codes (as a quantization method keeps a weight under two names)."""
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.norm = torch.nn.Parameter(torch.rand(HIDDEN, generator=gen), requires_grad=False)
    layer.qweight = huge_pages.empty(MLP, HIDDEN, dtype=torch.int8)
    layer.qweight.copy_(torch.randint(-128, 128, (MLP, HIDDEN), generator=gen, dtype=torch.int8))
    layer.scales = huge_pages.empty(MLP, HIDDEN // 32, dtype=torch.bfloat16)
    layer.scales.copy_(torch.rand(MLP, HIDDEN // 32, generator=gen))
    layer.codes = layer.qweight
    return layer


def _values(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name).clone() for name in ("norm", "qweight", "scales")}


def _in_file_mapping(t: torch.Tensor, path: str) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= t.data_ptr() < hi:
            return len(fields) == 6 and fields[5] == path
    return False


def test_the_tensors_read_the_same_values_from_the_image(tmp_path):
    layer = _layer()
    before = _values(layer)
    done = map_model(layer, "a model", tmp_path)
    assert done["written"] and done["tensors"] == 3  # norm, qweight (codes is the same tensor object), scales
    for name, value in before.items():
        t = getattr(layer, name)
        assert torch.equal(t, value) and t.dtype == value.dtype and t.shape == value.shape
        assert _in_file_mapping(t, done["image"])
    assert layer.codes is layer.qweight
    assert done["mapped_bytes"] == sum(v.numel() * v.element_size() for v in before.values())


def test_a_second_start_reuses_an_image_that_holds_the_same_bytes(tmp_path):
    first = map_model(_layer(), "a model", tmp_path)
    mtime = os.stat(first["image"]).st_mtime_ns
    again = map_model(_layer(), "a model", tmp_path)
    assert again["image"] == first["image"] and not again["written"]
    assert os.stat(again["image"]).st_mtime_ns >= mtime


def test_an_image_that_differs_in_one_byte_is_replaced_not_written_in_place(tmp_path):
    first = map_model(_layer(seed=0), "a model", tmp_path)
    old = _layer(seed=0)  # a stand-in for another engine still serving the old image
    map_model(old, "a model", tmp_path)
    old_values = _values(old)
    changed = _layer(seed=0)
    changed.scales[7, 3] += 1
    expected = _values(changed)
    done = map_model(changed, "a model", tmp_path)
    assert done["written"] and done["image"] == first["image"]
    assert all(torch.equal(getattr(changed, n), v) for n, v in expected.items())
    assert all(torch.equal(getattr(old, n), v) for n, v in old_values.items())  # its mapping still reads the old file


def test_a_write_into_a_mapped_weight_stays_in_the_process(tmp_path):
    layer = _layer()
    done = map_model(layer, "a model", tmp_path)
    layer.norm.add_(1)  # private mapping: the page is copied, the file is not touched
    fresh = mapped_weights.model_tensors(_layer())  # the image still holds the original bytes
    assert mapped_weights.swap_in(Image(Path(done["image"])), fresh, mapped_weights.index(fresh))


def test_a_broken_image_is_rewritten(tmp_path):
    first = map_model(_layer(), "a model", tmp_path)
    Path(first["image"]).write_bytes(b"not an image")
    assert map_model(_layer(), "a model", tmp_path)["written"]
    Path(first["image"]).write_bytes(b"")
    assert map_model(_layer(), "a model", tmp_path)["written"]
    image = Path(first["image"])
    image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])  # the index whole, the data cut short
    assert map_model(_layer(), "a model", tmp_path)["written"]


def test_the_arena_slab_is_released_once_its_tensors_are_mapped(tmp_path):
    arena = huge_pages.Arena(slab_bytes=4 << 20)
    layer = torch.nn.Module()
    layer.qweight = arena.empty((MLP, HIDDEN), torch.int8)
    layer.qweight.fill_(3)
    slab = arena.slabs[0][1]
    start, size = slab.data_ptr(), slab.numel()
    del slab
    original = huge_pages._PROCESS_ARENA
    huge_pages._PROCESS_ARENA = arena  # swap_in forgets through the process arena
    try:
        map_model(layer, "a model", tmp_path)
    finally:
        huge_pages._PROCESS_ARENA = original
    assert not arena.slabs
    maps = [
        (int(a, 16), int(b, 16))
        for a, b in (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
    ]
    assert not any(lo <= start < hi or lo < start + size <= hi for lo, hi in maps)
    assert int(layer.qweight.sum()) == 3 * MLP * HIDDEN


def test_a_cache_it_cannot_write_leaves_the_tensors_where_they_were(tmp_path):
    cache = tmp_path / "a file, not a folder"
    cache.write_text("")
    layer = _layer()
    where = layer.qweight.data_ptr()
    with pytest.raises(OSError):
        map_model(layer, "a model", cache)
    assert layer.qweight.data_ptr() == where and not list(tmp_path.glob("**/*.tmp"))


def test_old_images_beyond_the_kept_ones_are_pruned(tmp_path):
    for n in range(mapped_weights.KEEP_IMAGES + 2):
        map_model(_layer(), f"model {n}", tmp_path)
    assert len(list((tmp_path / "mapped").glob("*.bin"))) == mapped_weights.KEEP_IMAGES


def test_turned_off_it_installs_nothing(monkeypatch):
    monkeypatch.setenv(mapped_weights.ENV, "0")
    assert not mapped_weights.install()


def test_the_index_is_the_same_wherever_the_allocator_put_the_tensors():
    a, b = _layer(), _layer()
    b.scales = b.scales.clone()  # now elsewhere in memory, after the codes instead of beside them
    tensors_a, tensors_b = mapped_weights.model_tensors(a), mapped_weights.model_tensors(b)
    assert mapped_weights.index(tensors_a) == mapped_weights.index(tensors_b)
    assert [e.name for e in mapped_weights.index(tensors_a)] == ["norm", "qweight", "scales"]  # codes: qweight's object


def test_the_huge_page_share_of_an_image_is_a_fraction_and_a_small_file_is_never_read_again(tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"\1" * 4096)
    assert mapped_weights.huge_page_share(small) == 1.0 and not mapped_weights.refresh_page_cache(small)
    large = tmp_path / "large.bin"
    content = os.urandom(3 * mapped_weights.HUGE_PAGE)
    large.write_bytes(content)
    assert 0.0 <= mapped_weights.huge_page_share(large) <= 1.0
    mapped_weights.refresh_page_cache(large)
    assert large.read_bytes() == content  # dropping cached pages loses nothing
