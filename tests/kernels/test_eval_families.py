"""edge-eval's candidate runs what its checkpoint means, for every family the planner serves (issue 40).

For each family a tiny random model is built from transformers' own config class (AutoConfig.for_model), saved in
bf16, planned by the real planner on this host's probe, and converted by edge-convert: once with the speed plan
(w4a8-gptq where vLLM's int4 x int8 kernel runs, else w4a16-tinygemm), once at w4a16-tinygemm (the speed plan of
a host without it), once at bf16. Each candidate that kernels.scoring.eval_model.load_candidate builds is held to
the float32 reference of its own checkpoint (tests/kernels/dequantized.py: transformers' module, every quantized
tensor dequantized): the only difference left is arithmetic (bf16 activations; int8 activations for W4A8), so a
candidate that drops a piece of the model (Gemma 3's embedding scale, a soft-cap, a tied head, a (1 + w) norm, a
sliding window) falls far outside the bound the bf16 checkpoint itself meets.

The models exercise each family's own pieces: Gemma, Gemma 2 and Gemma 3 scale their embedding by sqrt(hidden)
and tie the head; Gemma 2 soft-caps attention and logits; Mistral, Gemma 2 and Gemma 3 attend in windows of 16
(the test's 64 positions cross them); Gemma's norms are (1 + w); Phi-3 fuses q/k/v and gate/up in its checkpoint.
Weights are drawn at std 0.15 so that next-token distributions are far from uniform (entropy 0.3-5.5 nats of 6.9),
where a lost piece moves them.

Measured here (AMD EPYC Zen 4, 2026-12-04), mean KLD against the reference: bf16 3e-5 to 8e-4, w4a16-tinygemm the
same within 1.1x, w4a8-gptq 7e-5 to 3.9e-3 (its int8 activations); before the fix, Gemma 3 at 6.4 (w4a16) and
6.5 (w4a8), top-1 under 3 %.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.dequantized import dequantized_model

VOCAB = 1024  # packs for tinygemm's blocks (16, 32, 64) and GPTQ's 32s
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "pad_token_id": 0}  # fmt: skip
WINDOW = 16
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"sliding_window": WINDOW},  # soft-capping on by default (attention 50, logits 30)
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"head_dim": None},  # Phi3Config derives head_dim from hidden / heads
}
STD = 0.15
# Mean KLD(reference || candidate) every candidate must stay under, and the top-1 agreement it must reach. The bf16
# checkpoint meets both by 25x and more; W4A8's int8 activations cost up to 3.9e-3 here (5x under); the lost
# Gemma 3 embedding scale cost 6.4.
MAX_KLD = 0.02
MIN_TOP1 = 0.8
POSITIONS = 64


def _source(directory: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**DIMS, **FAMILIES[family]}
    config = AutoConfig.for_model(family, **{k: v for k, v in settings.items() if v is not None})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for _, weight in model.named_parameters():
            if weight.dim() >= 2:
                weight.normal_(0.0, STD)
            else:  # a norm: Gemma's hold w of (1 + w), the others w itself
                weight.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_source(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _source(tmp_path_factory.mktemp(request.param) / "source", request.param)


def _checkpoint(source: Path, dst: Path, path: str | None) -> tuple[str, Path]:
    """The plan's conversion: the speed plan for this host (path None), or the speed plan at that path."""
    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan
    from kernels.convert.convert import convert

    if path == "bf16":
        return "bf16", convert(source, dst, None, path="bf16", log=lambda message: None)
    plan = make_plan(probe(), read_model(source), priority="speed", path=path)
    return plan.path, convert(source, dst, plan.quantization_config, path=plan.path, log=lambda message: None)


def _agreement(checkpoint: Path, source: Path) -> dict[str, float]:
    from kernels.scoring.eval_model import load_candidate

    ids = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(1))
    candidate = load_candidate(checkpoint, source).model
    reference = dequantized_model(checkpoint, checkpoint.parent / f"{checkpoint.name}-plain")
    with torch.inference_mode():
        theirs = reference(ids).logits.float().log_softmax(-1)
        ours = candidate(ids).logits.float().log_softmax(-1)
    kld = (theirs.exp() * (theirs - ours)).sum(-1).mean().item()
    top1 = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    return {"kld": kld, "top1": top1}


@pytest.mark.parametrize("path", [None, "w4a16-tinygemm", "bf16"], ids=["speed-plan", "w4a16-tinygemm", "bf16"])
def test_the_candidate_of_each_family_runs_what_its_checkpoint_holds(family_source, path, tmp_path):
    family, source = family_source
    chosen, checkpoint = _checkpoint(source, tmp_path / "candidate", path)
    measured = _agreement(checkpoint, source)
    print(family, chosen, measured)  # -s shows it
    assert measured["kld"] < MAX_KLD, (family, chosen, measured)
    assert measured["top1"] > MIN_TOP1, (family, chosen, measured)


def test_a_gemma_3_candidate_keeps_the_embedding_scale_on_its_quantized_embedding(tmp_path):
    """The piece the family matrix caught (issue 40): the plan quantizes Gemma 3's embedding, and the module that
    replaces it multiplies by sqrt(hidden), rounded to the activations' dtype as vLLM's normalizer is."""
    from kernels.scoring.eval_model import load_candidate
    from kernels.scoring.eval_modules import ScaledEmbedding

    source = _source(tmp_path / "source", "gemma3_text")
    _, checkpoint = _checkpoint(source, tmp_path / "candidate", "w4a16-tinygemm")
    embedding = load_candidate(checkpoint, source).model.get_input_embeddings()
    assert isinstance(embedding, ScaledEmbedding)
    expected = torch.tensor(DIMS["hidden_size"] ** 0.5).to(torch.bfloat16)
    assert embedding.embed_scale.to(torch.bfloat16).item() == expected.item()


ENGINE_SCRIPT = Path(__file__).with_name("test_evaluate.py")  # its __main__ runs vLLM for prompt log-probs


@pytest.mark.slow
def test_a_gemma_3_candidate_scores_what_the_vllm_engine_serves(tmp_path):
    """The engine side of issue 40: the tiny Gemma 3's speed-plan checkpoint through edge-eval's candidate and
    through the real vLLM (its prompt log-probs, the plan's quant_method), against the same pair for the bf16
    checkpoint (transformers vs vLLM with nothing quantized: the bf16 kernels' own residue). The candidate must be
    as close to the engine as the bf16 model is; with the embedding scale lost it is tens of nats off."""
    import json
    import os
    import subprocess
    import sys

    from kernels.scoring.eval_model import load_candidate

    source = _source(tmp_path / "source", "gemma3_text")
    checkpoints = {label: _checkpoint(source, tmp_path / label, path)
                   for label, path in (("speed", None), ("bf16", "bf16"))}  # fmt: skip
    windows = torch.randint(1, VOCAB, (2, 4 * WINDOW * 2 + 1), generator=torch.Generator().manual_seed(2))
    (tmp_path / "windows.json").write_text(json.dumps(windows.tolist()))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    d = {}
    for label, (chosen, checkpoint) in checkpoints.items():
        qconfig = json.loads((checkpoint / "config.json").read_text()).get("quantization_config")
        method = qconfig["quant_method"] if qconfig else None
        spec = {label: {"model": str(checkpoint), "quantization": method, "skip_tokenizer_init": True}}
        out = tmp_path / f"vllm-{label}.json"
        proc = subprocess.run([sys.executable, str(ENGINE_SCRIPT), str(out), json.dumps(spec),
                               str(tmp_path / "windows.json")], env=env, capture_output=True, text=True,
                              timeout=1200)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        engine = json.loads(out.read_text())[label]
        assert engine["quantization"] == method, (label, chosen, engine["quantization"])
        served = torch.tensor([row[1:] for row in engine["logprobs"]], dtype=torch.float64)  # [2, L]
        candidate = load_candidate(checkpoint, source).model
        with torch.inference_mode():
            logprobs = candidate(windows[:, :-1]).logits.double().log_softmax(-1)
        ours = logprobs.gather(-1, windows[:, 1:, None])[..., 0]  # [2, L]: log p(token j | tokens < j)
        d[label] = (ours - served).abs().mean().item()
    print(json.dumps(d))  # -s shows it
    assert d["speed"] < 2 * d["bf16"] + 0.05, d
