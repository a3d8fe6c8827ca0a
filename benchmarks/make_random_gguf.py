"""Random-weight GGUF files, written with gguf-py's GGUFWriter: tiny ones of each architecture for the tests, and
a ~1.2B Llama as llama.cpp's Q4_K_M holds it for the conversion memory benchmark (benchmarks/convert_gguf_rss.py):

    python benchmarks/make_random_gguf.py OUT.gguf --preset 1b [--tokenizer-from DEFAULT.gguf]

A model of each architecture, with the tensor names llama.cpp's converter writes for it (written out here by
hand, not derived from the code under test), and encoders for every type: gguf-py's own quantizer where it has one
(`gguf.quants.quantize`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16, F16), else random but valid raw blocks of the right
byte size (`gguf.constants.GGML_QUANT_SIZES`): the K-quants, whose quantizer gguf-py lacks, and types gguf_source
refuses (Q2_K, IQ4_NL, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Dims:
    """A tiny model: hidden and intermediate multiples of 256 so that every matrix takes the K-quants' blocks."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 64
    context: int = 128
    sliding_window: int | None = None  # gemma2/gemma3: llama.cpp requires {arch}.attention.sliding_window


DIMS = Dims()

# llama.cpp's tensor names per architecture, beyond the ones every layer has
_UNTIED = {"llama", "qwen2", "phi3"}  # these get an output.weight; the others are tied (gemma2 always is)
_EXTRA = {  # extra one-per-model tensors llama.cpp writes, which no HF parameter takes (both loaders skip them)
    "llama": {"rope_freqs.weight": "rope"},
    "phi3": {"rope_factors_long.weight": "rope", "rope_factors_short.weight": "rope"},
}


def architecture_shapes(arch: str, dims: Dims = DIMS) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (HF-orientation shape, role) for a tiny `arch` model; role is matrix, norm, bias or rope."""
    h, i, d = dims.hidden, dims.intermediate, dims.head_dim
    q, kv = dims.heads * d, dims.kv_heads * d
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"token_embd.weight": ((dims.vocab, h), "matrix")}
    for layer in range(dims.layers):
        blk = f"blk.{layer}."
        layer_shapes = {"attn_norm.weight": ((h,), "norm"), "attn_output.weight": ((h, q), "matrix")}
        if arch == "phi3":  # fused q/k/v rows, and gate then up rows in ffn_up
            layer_shapes |= {"attn_qkv.weight": ((q + 2 * kv, h), "matrix"), "ffn_up.weight": ((2 * i, h), "matrix")}
        else:
            layer_shapes |= {
                "attn_q.weight": ((q, h), "matrix"), "attn_k.weight": ((kv, h), "matrix"),
                "attn_v.weight": ((kv, h), "matrix"), "ffn_gate.weight": ((i, h), "matrix"),
                "ffn_up.weight": ((i, h), "matrix"),
            }  # fmt: skip
        layer_shapes["ffn_down.weight"] = ((h, i), "matrix")
        layer_shapes["ffn_norm.weight"] = ((h,), "norm")  # gemma: the pre-feedforward norm
        if arch == "qwen2":
            layer_shapes |= {f"attn_{x}.bias": ((rows,), "bias") for x, rows in (("q", q), ("k", kv), ("v", kv))}
        if arch in ("qwen3", "gemma3"):
            layer_shapes |= {"attn_q_norm.weight": ((d,), "norm"), "attn_k_norm.weight": ((d,), "norm")}
        if arch in ("gemma2", "gemma3"):
            layer_shapes |= {"post_attention_norm.weight": ((h,), "norm"), "post_ffw_norm.weight": ((h,), "norm")}
        shapes |= {blk + name: value for name, value in layer_shapes.items()}
    shapes["output_norm.weight"] = ((h,), "norm")
    if arch in _UNTIED:
        shapes["output.weight"] = ((dims.vocab, h), "matrix")
    shapes |= {name: ((d // 2,), role) for name, role in _EXTRA.get(arch, {}).items()}
    return shapes


def float_model(arch: str, rng: np.random.Generator, dims: Dims = DIMS) -> dict[str, tuple[np.ndarray, Q]]:
    """A tiny `arch` model as llama.cpp's f16 files hold it: F16 matrices, F32 norms, biases and rope factors (all 1:
    no RoPE scaling; edge.model.gguf_metadata refuses a rope_freqs.weight that is not Llama 3's form, as random ones
    are). Gemma's norms are stored as 1 + w, as llama.cpp writes them."""
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, (shape, role) in architecture_shapes(arch, dims).items():
        if role == "matrix":
            tensors[name] = ((rng.standard_normal(shape) * 0.05).astype(np.float16), Q.F16)
        elif role == "rope":
            tensors[name] = (np.ones(shape, np.float32), Q.F32)
        else:
            values = rng.standard_normal(shape).astype(np.float32) * 0.1
            if role == "norm":
                values += 1.0
            tensors[name] = (values, Q.F32)
    return tensors


def weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Weight-like float32 [n, k]: small, slightly off centre, a few larger ones."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05 + 0.01
    w[rng.random((n, k)) < 0.01] *= 4
    return w


def encoded(kind: Q, rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """A [n, k] tensor in type `kind`, as the GGUFWriter takes it: gguf-py's quantizer where it has one, else
    random valid raw blocks (uint8 [n, k / block * block bytes])."""
    if kind in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gguf.quants.quantize(weights(rng, n, k), kind)
    return raw_blocks(kind, rng, n, k)


# fp16 fields of a K-quant block (byte offset, low, high): random magnitudes that give weight-like values, e.g. Q4_K
# with sc, m in 0..63 and q in 0..15: d*sc*q up to ~0.5, dmin*m up to ~0.2 (the sub-block's minimum)
_K_FP16 = {
    Q.Q4_K: ((0, 2e-4, 6e-4), (2, 1e-3, 3e-3)),  # d, dmin
    Q.Q5_K: ((0, 1e-4, 3e-4), (2, 1e-3, 3e-3)),  # d, dmin (5-bit codes: half the step)
    Q.Q6_K: ((208, 2e-5, 6e-5),),  # d, last: int8 scales times codes in -32..31
}


def raw_blocks(kind: Q, rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random but valid raw blocks for a [n, k] tensor of type `kind`: random bytes, with each fp16 scale field of
    a K-quant set to a sensible magnitude (other types keep random bytes: only read or refused, not checked)."""
    size, nbytes = gguf.constants.GGML_QUANT_SIZES[kind]
    assert k % size == 0, (kind.name, k)
    blocks = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for offset, low, high in _K_FP16.get(kind, ()):
        scale = rng.uniform(low, high, (n, k // size)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(n, k // size, 2)
    return blocks.reshape(n, -1)


def write_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], dims: Dims = DIMS, *, layers: int | None = None,
    tokenizer_from: Path | None = None,
) -> Path:
    """A GGUF at `path`: `arch`'s metadata for `dims` (what transformers' loader reads into a config) and `tensors`
    (gguf name -> (data, type)), in that order. `tokenizer_from`: a GGUF whose tokenizer.* fields (vocabulary,
    merges, special tokens, chat template) are copied, so that the file converts and serves like a real one; a
    vocabulary smaller than `dims.vocab` is padded with unused tokens (a Gemma 3-sized table on a smaller one)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer_from is not None:
        _copy_tokenizer(tokenizer_from, writer, dims.vocab)
    if dims.sliding_window is not None:
        writer.add_sliding_window(dims.sliding_window)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(dims.context)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_block_count(dims.layers if layers is None else layers)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(dims.vocab)
    if tokenizer_from is None:
        writer.add_bos_token_id(1)  # ids inside the tiny vocabulary (Phi-3's config defaults pad to 32000)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(source: Path, writer: gguf.GGUFWriter, vocab: int) -> None:
    reader = gguf.GGUFReader(source)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].contents())
    if vocab < tokens:
        raise ValueError(f"vocab {vocab} is smaller than {source.name}'s {tokens} tokens")
    padding = {  # rows past the tokenizer's own: tokens that no text produces, as a padded embedding table holds
        "tokenizer.ggml.tokens": [f"<unused{i}>" for i in range(vocab - tokens)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (vocab - tokens),
        "tokenizer.ggml.scores": [0.0] * (vocab - tokens),
    }
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in padding:
            value = value + padding[key]
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


# ~1.2B parameters at TinyLlama-1.1B's shape with the default model's 49152-token vocabulary (its tokenizer is
# copied in), hidden and intermediate multiples of 256 so every matrix takes K-quant blocks.
PRESETS = {"1b": Dims(layers=22, hidden=2048, heads=32, kv_heads=4, head_dim=64, intermediate=5632, vocab=49152,
                   context=2048)}


def q4_k_m_type(name: str, layers: int) -> Q:
    """The types llama.cpp's Q4_K_M gives a Llama (llama-quant.cpp): Q6_K for the output and the embedding, and
    for attn_v and ffn_down on the first eighth, the last eighth and every third layer between (use_more_bits: about
    half of them); Q4_K elsewhere. Rows whose width is not a multiple of 256 would fall back; none here."""
    if name in ("token_embd.weight", "output.weight"):
        return Q.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i = int(parts[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return Q.Q6_K
    return Q.Q4_K


def write_q4_k_m(path: Path, dims: Dims, tokenizer_from: Path | None, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, (shape, role) in architecture_shapes("llama", dims).items():
        if role == "matrix":
            kind = q4_k_m_type(name, dims.layers)
            tensors[name] = (raw_blocks(kind, rng, *shape), kind)
        else:
            tensors[name] = (np.ones(shape, np.float32), Q.F32)  # norms, and rope_freqs of no scaling
    return write_gguf(path, "llama", tensors, dims, tokenizer_from=tokenizer_from)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--tokenizer-from", type=Path, help="a GGUF whose tokenizer is copied (vocabulary 49152)")
    args = parser.parse_args()
    print(write_q4_k_m(args.out, PRESETS[args.preset], args.tokenizer_from))


if __name__ == "__main__":
    main()
