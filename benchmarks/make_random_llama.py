"""Write a random-weight Llama checkpoint (bf16 safetensors + config.json) for engine benchmarks.

No hub, no tokenizer: the engine benchmark feeds token ids (`skip_tokenizer_init`). Weights are N(0, 0.02),
norms 1, so the model is Llama-*shaped* (what speed and memory depend on), not a language model.

    python benchmarks/make_random_llama.py OUT_DIR --preset 1b
    python benchmarks/make_random_llama.py OUT_DIR --preset smollm2   # SmolLM2-135M shapes, tied

Tensors are generated and written one shard at a time, so peak memory is one shard (~1 GiB), never the model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    max_position_embeddings: int = 2048


PRESETS = {
    # ~1.1B parameters (TinyLlama-1.1B's shape): 2.2 GB in bf16.
    "1b": LlamaShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, tied=False),
    # SmolLM2-135M's shape (docs/FACTS.md), tied embeddings.
    "smollm2": LlamaShape(
        hidden=576,
        intermediate=1536,
        layers=30,
        heads=9,
        kv_heads=3,
        vocab=49152,
        tied=True,
        max_position_embeddings=8192,
    ),
}


def tensor_shapes(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in file order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", (shape.hidden,)),
            (f"{p}.self_attn.q_proj.weight", (shape.hidden, shape.hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, shape.hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, shape.hidden)),
            (f"{p}.self_attn.o_proj.weight", (shape.hidden, shape.hidden)),
            (f"{p}.post_attention_layernorm.weight", (shape.hidden,)),
            (f"{p}.mlp.gate_proj.weight", (shape.intermediate, shape.hidden)),
            (f"{p}.mlp.up_proj.weight", (shape.intermediate, shape.hidden)),
            (f"{p}.mlp.down_proj.weight", (shape.hidden, shape.intermediate)),
        ]
    names.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        names.append(("lm_head.weight", (shape.vocab, shape.hidden)))
    return names


def hf_config(shape: LlamaShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write(out: Path, shape: LlamaShape, seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created); returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    plan = tensor_shapes(shape)
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        files.append(name)
        for key in shards[-1]:
            weight_map[key] = name
        shards[-1] = {}

    for name, dims in plan:
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)
        nbytes = t.numel() * 2
        if size and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][name] = t
        size += nbytes
    flush()
    total = sum((out / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (out / "random_llama.json").write_text(json.dumps({"seed": seed, **asdict(shape)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    if args.layers is not None:
        shape = LlamaShape(**{**asdict(shape), "layers": args.layers})
    write(args.out, shape, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
