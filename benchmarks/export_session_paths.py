"""How ONNX Runtime runs an edge-export bundle's int8 weights, each way measured against the source in one run.

    python -m benchmarks.export_session_paths BUNDLE [--tokens 1024] [--threads N]

The bundle's linears are DequantizeLinear(int8, blocked) -> MatMul. ONNX Runtime's CPU provider can run that as:

    folded      session.disable_quant_qdq=1: each weight dequantized once at load into a float initializer; the
                linears run in the graph's float type (w8a16). What the bundle's genai_config.json asks for.
    nbits-acc4  ONNX Runtime's default: DequantizeLinear -> MatMul fused into MatMulNBits (bits=8) at accuracy
                level 4, which quantizes each activation block to int8 (w8a8)
    nbits-acc0  the same fusion at accuracy level 0: float activations in MatMulNBits

For each: edge-eval's metrics (mean KLD, top-1, perplexity ratio, with standard errors) against the source in float32
arithmetic on the default text (kernels/export/export_verify.quality), and prefill/decode tokens/s here (a sanity
figure for this host's CPU, not a phone's). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PATHS = {
    "folded": {"session.disable_quant_qdq": "1"},
    "nbits-acc4": {},
    "nbits-acc0": {"session.qdq_matmulnbits_accuracy_level": "0"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, help="an edge-export output directory")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    from edge.device.cpuinfo import host_model_name
    from kernels.export.export import GRAPH, MANIFEST
    from kernels.export.export_verify import quality, speed
    from kernels.source.checkpoint import read_manifest

    manifest, problem = read_manifest(args.bundle, MANIFEST)
    if manifest is None:
        print(f"export_session_paths: BUNDLE {args.bundle}: {problem}", file=sys.stderr)
        return 2
    src, graph = Path(manifest["source"]["path"]), args.bundle / GRAPH
    rows = {}
    for name, config in PATHS.items():
        q = quality(src, graph, args.tokens, 512, args.threads, session_config=config)
        rows[name] = {"session_config": config, "metrics": q["metrics"],
                      "speed": speed(graph, args.threads, session_config=config)}  # fmt: skip
        m = q["metrics"]
        print(f"{name}: KLD {m['mean_kld']['value']:.5f}, top-1 {m['top1_agreement']['value']:.4f}, "
              f"{rows[name]['speed']}", file=sys.stderr)  # fmt: skip
    cpu = host_model_name()
    print(json.dumps({"bundle": str(args.bundle), "activations": manifest["graph"].get("activations"), "cpu": cpu,
                      "tokens": args.tokens, "paths": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
