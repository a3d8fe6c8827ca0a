"""Input built to be slow or to overflow gets an answer as fast as real input of its size, and refusals name the
field: the parsers are linear, and every dimension, size, count and text is bounded (edge.bounds).

Times are compared as ratios to benign input of the same size on the same machine, never to a wall clock: the
fastest of a few runs of each, adversarial at most RATIO times benign plus EPSILON_S (timer and cache noise on
inputs both answered in microseconds)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from edge import sizes
from edge.bounds import MAX_DIMENSIONS, MAX_LABELS, MAX_LINE_CHARS, MAX_LSCPU_ENTRIES, check_finite_numbers
from edge.device.cpuinfo import parse_cpuinfo, parse_meminfo
from edge.device.lscpu import parse_lscpu
from edge.device.nfd import parse_nfd_labels
from edge.errors import InputError
from edge.model.gguf_metadata import header_from_json
from edge.model.reader import read_gguf_header, read_model_config
from edge.sizes import parse_size
from tests.edge.conftest import DATA

MIB = 1 << 20
RATIO = 20
EPSILON_S = 0.005
ZEN5_CPUINFO = (DATA / "cpuinfo_epyc_zen5_avx512.txt").read_text()
SMOLLM2 = json.loads((DATA / "configs" / "smollm2-135m-instruct.json").read_text())
GEMMA_2B = json.loads((DATA / "configs" / "gemma-2b.json").read_text())
LSCPU = json.loads((DATA / "lscpu_host_epyc_zen5.json").read_text())
NFD_NODE = json.loads((DATA / "nfd_spr_node.json").read_text())


def fastest(parse: Callable[[Any], Any], given: Any, runs: int = 3) -> float:
    """Seconds of the fastest of `runs` calls; an InputError is an answer too."""
    best = math.inf
    for _ in range(runs):
        start = time.perf_counter()
        with contextlib.suppress(InputError):
            parse(given)
        best = min(best, time.perf_counter() - start)
    return best


def assert_as_fast(parse: Callable[[Any], Any], benign: Any, adversarial: Any) -> None:
    benign_s, adversarial_s = fastest(parse, benign), fastest(parse, adversarial)
    print(f"{parse.__name__}: benign {benign_s * 1e3:.2f} ms, adversarial {adversarial_s * 1e3:.2f} ms, "
          f"ratio {adversarial_s / benign_s:.1f}")  # fmt: skip
    assert adversarial_s <= RATIO * benign_s + EPSILON_S, (benign_s, adversarial_s)


def padded(line: str, size: int = MIB) -> str:
    """Lines just under the line limit, to `size` characters in all."""
    return "\n".join([line] * (size // (len(line) + 1)))


# --- linear-time parsers -----------------------------------------------------------------------------------------


def test_a_size_of_spaces_then_junk_costs_no_more_than_a_size_of_spaces_then_a_unit(monkeypatch):
    """"1" + spaces + "x" backtracked quadratically (8000 spaces: 0.48 s). Measured with the length limit lifted, so
    that it is the reading that is linear, not only the limit that hides it."""
    monkeypatch.setattr(sizes, "MAX_SIZE_CHARS", 2 * MIB)
    spaces = " " * (MIB - 4)
    assert parse_size("8" + spaces + "GiB", "memory") == 8 << 30
    assert_as_fast(lambda text: parse_size(text, "memory"), "8" + spaces + "GiB", "1" + spaces + "xyz")


def test_a_one_mib_size_string_is_refused_as_fast_as_a_one_mib_number():
    assert_as_fast(lambda text: parse_size(text, "memory"), "8" * MIB, "1" + " " * (MIB - 2) + "x")
    with pytest.raises(InputError, match="memory: expected .*at most 64 characters"):
        parse_size("1" + " " * (MIB - 2) + "x", "memory")


def test_cpuinfo_lines_without_a_colon_cost_no_more_than_real_cpuinfo():
    """A 32,000-character line with no colon took 1.6 s through a regex with a lazy key and \\s* before the colon."""
    benign = (ZEN5_CPUINFO.strip() + "\n\n") * (MIB // len(ZEN5_CPUINFO))
    adversarial = padded("a" + " " * (MAX_LINE_CHARS - 2) + "b") + "\nprocessor : 0\nflags : avx2\n"
    assert len(parse_cpuinfo(benign).isa.value) > 0
    assert_as_fast(parse_cpuinfo, benign, adversarial)


def test_cpuinfo_lines_with_a_far_colon_cost_no_more_than_real_cpuinfo():
    benign = (ZEN5_CPUINFO.strip() + "\n\n") * (MIB // len(ZEN5_CPUINFO))
    adversarial = "processor : 0\n" + padded("k" + " \t" * (MAX_LINE_CHARS // 2 - 4) + ": v")
    assert_as_fast(parse_cpuinfo, benign, adversarial)


def test_a_cpuinfo_line_over_the_limit_is_refused_naming_its_length():
    with pytest.raises(InputError, match=f"cpuinfo: expected lines of at most {MAX_LINE_CHARS} characters, got one "
                                         f"of {MIB}"):  # fmt: skip
        parse_cpuinfo("processor : 0\nflags : " + "a" * (MIB - 8))


def test_meminfo_lines_of_spaces_then_junk_cost_no_more_than_real_meminfo():
    benign = padded("MemTotal:" + " " * (MAX_LINE_CHARS - 30) + "32594904 kB")
    adversarial = padded("MemTotal:" + " " * (MAX_LINE_CHARS - 30) + "3259490x kB")
    assert parse_meminfo(benign).total_bytes == 32594904 * 1024
    assert_as_fast(parse_meminfo, benign, adversarial)


def test_a_meminfo_total_of_5000_digits_is_refused_not_a_crash():
    with pytest.raises(InputError, match="meminfo"):
        parse_meminfo("MemTotal: " + "9" * 5000 + " kB\n")


def test_lscpu_of_long_unique_entries_costs_no_more_than_real_lscpu_of_as_many_entries():
    real = LSCPU["lscpu"]
    benign = {"lscpu": (real * (MAX_LSCPU_ENTRIES // len(real) + 1))[:MAX_LSCPU_ENTRIES]}
    per_entry = MIB // MAX_LSCPU_ENTRIES
    adversarial = {"lscpu": [{"field": "Model name:" if i % 2 else "Flags:", "data": f"{i} " + "x" * (per_entry - 40)}
                             for i in range(MAX_LSCPU_ENTRIES)]}  # fmt: skip
    assert parse_lscpu(benign).isa.value
    assert_as_fast(parse_lscpu, benign, adversarial)


def test_lscpu_over_the_entry_limit_is_refused_naming_the_entry():
    entries = [{"field": "Flags:", "data": "avx2"}] * (MAX_LSCPU_ENTRIES + 1)
    with pytest.raises(InputError, match=rf"lscpu\[{MAX_LSCPU_ENTRIES}\]: expected at most {MAX_LSCPU_ENTRIES}"):
        parse_lscpu({"lscpu": entries})


@pytest.mark.parametrize("data", [math.inf, math.nan, 10**400], ids=["inf", "nan", "10**400"])
def test_an_lscpu_number_that_is_not_finite_is_refused_naming_the_entry(data):
    with pytest.raises(InputError, match=r"lscpu\[1\]\.data: expected a finite number"):
        parse_lscpu({"lscpu": [{"field": "Architecture:", "data": "x86_64"}, {"field": "CPU(s):", "data": data}]})


def test_a_unicode_digit_in_an_lscpu_count_is_no_count_not_a_crash():
    entries = [e for e in LSCPU["lscpu"] if e["field"] != "NUMA node(s):"]
    lscpu = {"lscpu": [*entries, {"field": "NUMA node(s):", "data": "²"}]}
    assert parse_lscpu(lscpu).numa_nodes.value is None


def test_a_one_mib_label_map_costs_no_more_than_the_largest_map_kubernetes_allows():
    """Kubernetes caps a label name at 317 characters and a value at 63: 1024 such labels are read in full."""
    largest = {f"feature.node.kubernetes.io/cpu-cpuid.AVX2{'X' * 270}{i:05d}": "true" for i in range(MAX_LABELS - 1)}
    benign = {**largest, "feature.node.kubernetes.io/cpu-cpuid.AVX2": "true"}
    assert parse_nfd_labels(benign).isa.value == ["avx2"]
    one_value = {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "t" * MIB}
    many_labels = {f"example.com/label-{i:06d}": "v" * 63 for i in range(MIB // 100)}
    assert_as_fast(parse_nfd_labels, benign, one_value)
    assert_as_fast(parse_nfd_labels, benign, many_labels)


# --- label maps --------------------------------------------------------------------------------------------------


def test_a_label_map_over_the_count_limit_is_refused_naming_labels():
    labels = {f"feature.node.kubernetes.io/custom-{i}": "true" for i in range(MAX_LABELS + 1)}
    with pytest.raises(InputError, match=f"labels: expected at most {MAX_LABELS} labels"):
        parse_nfd_labels(labels)


def test_a_label_value_over_kubernetes_63_characters_is_refused_naming_the_key():
    key = "feature.node.kubernetes.io/cpu-model.vendor_id"
    with pytest.raises(InputError, match=f"{key}: expected a label value string of at most 63"):
        parse_nfd_labels({"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true", key: "A" * 64})


def test_a_label_name_over_kubernetes_limit_is_refused():
    with pytest.raises(InputError, match="labels: expected label names of at most 317"):
        parse_nfd_labels({"feature.node.kubernetes.io/" + "x" * 300: "true"})


def test_inner_labels_that_are_not_an_object_are_refused_naming_them():
    with pytest.raises(InputError, match="status.capacity: expected a JSON object"):
        parse_nfd_labels({"metadata": {"labels": {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true"}},
                          "status": {"capacity": ["8"]}})  # fmt: skip


def test_an_arch_label_that_is_not_a_string_is_refused_naming_it():
    with pytest.raises(InputError, match="kubernetes.io/arch: expected a label value string"):
        parse_nfd_labels({"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true", "kubernetes.io/arch": ["amd64"]})


def test_a_capacity_of_a_million_cpus_is_refused_naming_it():
    with pytest.raises(InputError, match="capacity.cpu"):
        parse_nfd_labels({"labels": {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true"},
                          "capacity": {"cpu": str(10**6)}})  # fmt: skip


# --- model dimensions --------------------------------------------------------------------------------------------


def test_a_million_layers_is_refused_naming_the_field_before_any_per_layer_list_is_built():
    """10^6 layers took 28 s per plan (a per-layer KV list in edge.catalog.shape_rules)."""
    with pytest.raises(InputError) as refused:
        read_model_config({**SMOLLM2, "num_hidden_layers": 10**6}, "huge")
    assert refused.value.field == "config.json: num_hidden_layers" and refused.value.value == 10**6
    assert "at most 1024" in str(refused.value)


@pytest.mark.parametrize("key", sorted(set(MAX_DIMENSIONS) - {"sliding_window_pattern", "max_window_layers"}))
def test_each_model_dimension_past_its_bound_is_refused_naming_it(key):
    config = {**SMOLLM2, key: MAX_DIMENSIONS[key] + 1}
    if key == "num_key_value_heads":
        config["num_attention_heads"] = MAX_DIMENSIONS[key]  # so that kv_heads is not refused as a non-divisor
    with pytest.raises(InputError, match=f"config.json: {key}: expected a positive integer at most"):
        read_model_config(config, "too-large")


def test_each_model_dimension_at_its_bound_is_read():
    config = {**SMOLLM2, "num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 1 << 20,
              "vocab_size": 1 << 22, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
              "max_position_embeddings": 1 << 24}  # fmt: skip
    shape = read_model_config(config, "largest")
    assert (shape.num_layers, shape.vocab_size, shape.head_dim) == (1024, 1 << 22, 1024)


def test_gemma_3s_vocabulary_of_262208_is_within_the_bound():
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **{
        k: GEMMA_2B[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads")}}  # fmt: skip
    assert read_model_config(config, "gemma-3").vocab_size == 262208


def test_a_head_dim_derived_past_its_bound_is_refused_naming_head_dim():
    config = {**SMOLLM2, "hidden_size": 65536, "num_attention_heads": 1, "num_key_value_heads": 1}
    config.pop("head_dim", None)
    with pytest.raises(InputError, match="config.json: head_dim: expected present when hidden_size=65536"):
        read_model_config(config, "wide-head")


def gguf_body(**metadata) -> dict:
    base = {"general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
            "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
            "llama.attention.head_count_kv": 3, "llama.vocab_size": 49152}  # fmt: skip
    return {"metadata": {**base, **metadata}, "tensors": [{"name": "output.weight", "type": "Q6_K",
                                                          "shape": [49152, 576]}]}  # fmt: skip


def test_a_gguf_header_is_bounded_as_a_config_is():
    assert read_gguf_header(header_from_json(gguf_body()), "small").num_layers == 30
    with pytest.raises(InputError, match="num_hidden_layers: expected a positive integer at most 1024"):
        read_gguf_header(header_from_json(gguf_body(**{"llama.block_count": 10**6})), "huge")


@pytest.mark.parametrize("vocab", [math.inf, math.nan, "many", 1.5], ids=["inf", "nan", "string", "float"])
def test_a_gguf_vocab_size_that_is_no_integer_is_refused_naming_the_key(vocab):
    with pytest.raises(InputError, match="llama.vocab_size: expected an integer metadata value"):
        read_gguf_header(header_from_json(gguf_body(**{"llama.vocab_size": vocab})), "odd")


def test_a_qwen3_gguf_without_a_head_count_is_refused_naming_it():
    body = {"metadata": {"general.architecture": "qwen3", "qwen3.block_count": 28},
            "tensors": [{"name": "blk.0.attn_q.weight", "type": "Q4_K", "shape": [2048, 1024]}]}  # fmt: skip
    with pytest.raises(InputError, match="qwen3.attention.head_count: expected an integer"):
        read_gguf_header(header_from_json(body), "qwen3")


def test_a_gguf_tensor_dimension_past_the_bound_is_refused_naming_the_tensor():
    body = {**gguf_body(), "tensors": [{"name": "output.weight", "type": "Q6_K", "shape": [1 << 40, 576]}]}
    with pytest.raises(InputError, match=r"gguf.tensors\[0\]"):
        header_from_json(body)


# --- numbers -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf, 10**30, float("1e400")],
                         ids=["nan", "inf", "-inf", "10**30", "1e400"])  # fmt: skip
def test_a_number_that_is_not_finite_or_past_2_63_is_refused_naming_its_path(number):
    with pytest.raises(InputError) as refused:
        check_finite_numbers({"isa": ["avx2"], "runtime": {"threads": [1, number]}}, "profile")
    assert refused.value.field == "profile.runtime.threads[1]"


@pytest.mark.parametrize("size", [10**30, 2**61, "2EiB", "9" * 40, 1e300], ids=["10**30", "2**61", "2EiB", "40 digits",
                                                                              "1e300"])  # fmt: skip
def test_a_size_past_one_exbibyte_is_refused_naming_the_field(size):
    with pytest.raises(InputError, match="memory_budget: expected a non-negative size of at most"):
        parse_size(size, "memory_budget")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_device_file_with_a_non_finite_number_is_an_input_error_naming_it(tmp_path, number):
    """edge-select --device FILE: Python's json reads these; the CLI path refuses them as the server does."""
    from edge.device.describe import load_device_file

    path = tmp_path / "device.json"
    path.write_text('{"cpu_model": "x", "cores": 2, "memory_bytes": NUMBER}'.replace("NUMBER", number))
    with pytest.raises(InputError, match="memory_bytes"):
        load_device_file(str(path))
