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


# --- loading into the last image (premap) ---------------------------------------------------------------------


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """What a loader would copy into _params_layer's parameters."""
    gen = torch.Generator().manual_seed(seed)
    return {"qweight": torch.randint(-128, 128, (MLP, HIDDEN), generator=gen, dtype=torch.int8),
            "scales": torch.rand(MLP, HIDDEN // 32, generator=gen).to(torch.bfloat16)}  # fmt: skip


def _params_layer() -> torch.nn.Module:
    """A stand-in for a layer before loading: uninitialized parameters from the arena (as the plugin registers its
    weights), and a buffer computed when the module is built (as a rotary table is)."""
    layer = torch.nn.Module()
    layer.qweight = torch.nn.Parameter(huge_pages.empty(MLP, HIDDEN, dtype=torch.int8), requires_grad=False)
    layer.scales = torch.nn.Parameter(huge_pages.empty(MLP, HIDDEN // 32, dtype=torch.bfloat16), requires_grad=False)
    layer.register_buffer("table", torch.arange(HIDDEN, dtype=torch.float32))
    return layer


def _load(layer: torch.nn.Module, checkpoint: dict[str, torch.Tensor], premapped=None) -> None:
    """The loader's copies: each parameter's first and second halves of rows, as a fused layer's shards load."""
    with mapped_weights.SkipEqualCopies(premapped) if premapped else torch.no_grad():
        for name, value in checkpoint.items():
            param = getattr(layer, name)
            half = value.shape[0] // 2
            param.data[:half].copy_(value[:half])
            param.data[half:].copy_(value[half:])


def _anonymous_kib(path: str) -> int:
    """The private copies this process holds of `path`'s pages (Anonymous in /proc/self/smaps, every mapping)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and fields[5] == path
        elif inside and fields[0] == "Anonymous:":
            total += int(fields[1])
    return total


def _first_start(tmp_path) -> dict:
    layer = _params_layer()
    _load(layer, _checkpoint())
    return map_model(layer, "a model", tmp_path)


def test_a_second_start_loads_into_the_last_image_without_a_private_copy(tmp_path):
    first = _first_start(tmp_path)
    path = mapped_weights.last_image("a model", tmp_path)
    assert str(path) == first["image"]
    layer = _params_layer()
    premapped = mapped_weights.premap(layer, Image(path))
    assert {name for name, _, _ in premapped.params} == {"qweight", "scales"}  # parameters only, not the buffer
    assert _in_file_mapping(layer.qweight, first["image"]) and not _in_file_mapping(layer.table, first["image"])
    _load(layer, _checkpoint(), premapped)
    done = premapped.summary()
    assert (
        done["copies_skipped_bytes"] == done["premapped_bytes"] == premapped.nbytes
        and done["copies_written_bytes"] == 0
    )
    assert done["uncovered"] == [] and _anonymous_kib(first["image"]) == 0  # every page still the file's
    again = map_model(layer, "a model", tmp_path, premapped)
    assert not again["written"] and again["image"] == first["image"] and again["tensors"] == 3
    for name, value in _checkpoint().items():
        assert torch.equal(getattr(layer, name), value) and _in_file_mapping(getattr(layer, name), first["image"])


def test_a_load_that_differs_writes_its_own_values_and_the_image_is_replaced(tmp_path):
    first = _first_start(tmp_path)
    layer = _params_layer()
    premapped = mapped_weights.premap(layer, Image(mapped_weights.last_image("a model", tmp_path)))
    changed = _checkpoint()
    changed["scales"][MLP - 1, 0] += 1  # in the second half's copy only
    _load(layer, changed, premapped)
    done = premapped.summary()
    assert 0 < done["copies_written_bytes"] < premapped.nbytes and done["uncovered"] == []
    assert all(torch.equal(getattr(layer, n), v) for n, v in changed.items())
    again = map_model(layer, "a model", tmp_path, premapped)
    assert again["written"] and again["image"] == first["image"]
    assert all(torch.equal(getattr(layer, n), v) for n, v in changed.items())


def test_a_parameter_the_load_does_not_write_whole_is_named(tmp_path):
    _first_start(tmp_path)
    layer = _params_layer()
    premapped = mapped_weights.premap(layer, Image(mapped_weights.last_image("a model", tmp_path)))
    with mapped_weights.SkipEqualCopies(premapped):
        layer.qweight.data.copy_(_checkpoint()["qweight"])
    assert premapped.uncovered() == ["scales"]


def test_the_last_image_is_the_same_models_most_recent_and_a_mismatch_is_not_premapped(tmp_path):
    assert mapped_weights.last_image("a model", tmp_path) is None
    _first_start(tmp_path)
    other = torch.nn.Module()
    other.qweight = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    map_model(other, "another model", tmp_path)
    image = Image(mapped_weights.last_image("a model", tmp_path))
    assert [e.name for e in image.index[0]] == ["qweight", "scales", "table"]
    wider = torch.nn.Module()  # same names, another shape: loads as vLLM would, into its own memory
    wider.qweight = torch.nn.Parameter(torch.empty(MLP, 2 * HIDDEN, dtype=torch.int8), requires_grad=False)
    assert mapped_weights.premap(wider, image).params == []


@pytest.mark.parametrize("premap", ["1", "0"])
def test_the_loaders_load_goes_into_the_last_image_unless_turned_off(tmp_path, monkeypatch, premap):
    """The wrapper around vLLM's DefaultModelLoader.load_weights, with a stand-in loader method and model config."""
    from types import SimpleNamespace

    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(mapped_weights.PREMAP_ENV, premap)
    config = SimpleNamespace(model="/models/a", revision=None, dtype=torch.bfloat16, hf_config=SimpleNamespace())
    identity = mapped_weights._identity(config)
    first = _params_layer()
    _load(first, _checkpoint())
    image = map_model(first, identity, tmp_path)["image"]

    def load_weights(loader, model, model_config):  # what vLLM's loader does: copies into the parameters
        _load(model, _checkpoint())

    layer = _params_layer()
    mapped_weights._into_last_image(load_weights)(None, layer, config)
    premapped = mapped_weights._PREMAPPED.pop(id(layer), None)
    assert (premapped is not None) == (premap == "1") and _in_file_mapping(layer.qweight, image) == (premap == "1")
    assert all(torch.equal(getattr(layer, n), v) for n, v in _checkpoint().items())


def test_a_first_start_loads_as_vllm_does_and_a_later_one_into_the_image(tmp_path):
    assert mapped_weights.load_source("a model", tmp_path) is None
    image = _first_start(tmp_path)["image"]
    assert str(mapped_weights.load_source("a model", tmp_path)[0]) == image
