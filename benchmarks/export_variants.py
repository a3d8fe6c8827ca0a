"""Bundles of one model side by side (e.g. edge-export's float32 and float16 activations): size, and CPU tokens/s
in ONNX Runtime's CPU provider with the bundle's own session options, interleaved pass by pass.

    python -m benchmarks.export_variants BUNDLE [BUNDLE ...] [--passes 3] [--threads N]

Each pass runs kernels/export/export_verify.speed (one 256-token prefill, 64 decode steps on its cache) on every
bundle in turn; the report gives each bundle's median prefill and decode tokens/s, the ratio of each to the first
bundle's, its files' bytes, and the quality its manifest recorded. A sanity figure for this host's CPU, not a phone's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", type=Path, nargs="+", help="edge-export output directories")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    from edge.device.cpuinfo import host_model_name
    from kernels.export.export import GRAPH, MANIFEST
    from kernels.export.export_verify import speed
    from kernels.source.checkpoint import read_manifest

    manifests = {}
    for bundle in args.bundles:
        manifest, problem = read_manifest(bundle, MANIFEST)
        if manifest is None:
            print(f"export_variants: BUNDLE {bundle}: {problem}", file=sys.stderr)
            return 2
        manifests[bundle] = manifest
    runs: dict[Path, list[dict]] = {bundle: [] for bundle in args.bundles}
    for p in range(args.passes):
        for bundle in args.bundles:
            runs[bundle].append(speed(bundle / GRAPH, args.threads))
            print(f"pass {p + 1} {bundle.name}: {runs[bundle][-1]}", file=sys.stderr)
    rows, first = [], None
    for bundle in args.bundles:
        manifest = manifests[bundle]
        prefill = statistics.median(r["prefill_tok_s"] for r in runs[bundle])
        decode = statistics.median(r["decode_tok_s"] for r in runs[bundle])
        first = first or (prefill, decode)
        quality = ((manifest.get("verification") or {}).get("quality") or {}).get("metrics") or {}
        rows.append({"bundle": str(bundle), "activations": manifest["graph"].get("activations"),
                     "bytes": sum(f["size"] for f in manifest["files"].values()),
                     "graph_bytes": manifest["files"][GRAPH]["size"],
                     "prefill_tok_s": prefill, "decode_tok_s": decode,
                     "prefill_ratio": round(prefill / first[0], 3), "decode_ratio": round(decode / first[1], 3),
                     "mean_kld": quality.get("mean_kld"), "top1_agreement": quality.get("top1_agreement"),
                     "ppl_ratio": quality.get("ppl_ratio"), "passes": runs[bundle]})  # fmt: skip
    cpu = host_model_name()
    print(json.dumps({"cpu": cpu, "threads": runs[args.bundles[0]][0]["threads"], "bundles": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
