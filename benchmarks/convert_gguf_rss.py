"""Memory of converting a GGUF straight from the file: RssAnon of edge-convert's process tree, sampled through the
whole conversion (benchmarks/rss.py), peak and settled reported apart, beside the sizes that bound it.

    python benchmarks/convert_gguf_rss.py [--work DIR] [--keep]

It writes a ~1.2B-parameter random Llama as llama.cpp's Q4_K_M holds it (benchmarks/make_random_gguf.py: Q4_K
linears, Q6_K attn_v/ffn_down on about half the layers, Q6_K embedding and head, the default model's tokenizer),
plans it for this host on the W4A16 path (the speed plan's formats: codes copied from the file's Q4_K tensors at
group 32, the Q6_K ones re-rounded, the embedding and head int8) and converts it with edge-convert, then prints
the file's and the output's sizes, the largest tensor's float32 working set (what reading one tensor at a time
may hold), and the peak and settled RssAnon. The file is memory-mapped: its pages are file-backed, not RssAnon.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.host import cpu_model_name
from benchmarks.make_random_gguf import PRESETS, architecture_shapes, write_q4_k_m
from benchmarks.rss import run_sampled

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="where the GGUF and the conversion go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()
    from kernels.source.default_model import source_gguf

    work = args.work or Path(tempfile.mkdtemp(prefix="convert-gguf-rss-"))
    work.mkdir(parents=True, exist_ok=True)
    dims = PRESETS["1b"]
    gguf = work / "random-1b-Q4_K_M.gguf"
    if not gguf.is_file():
        write_q4_k_m(gguf, dims, source_gguf())
    params = sum(_numel(shape) for shape, role in architecture_shapes("llama", dims).values())
    bin_dir = Path(sys.executable).parent
    plan = subprocess.run([str(bin_dir / "edge-select"), "--model", str(gguf), "--path", "w4a16-tinygemm", "--json"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    (work / "plan.json").write_text(plan)
    dst = work / "converted"
    shutil.rmtree(dst, ignore_errors=True)
    run = run_sampled([str(bin_dir / "edge-convert"), str(gguf), str(dst), "--plan", str(work / "plan.json")])
    sampler, output, wall = run.sampler, run.output, run.wall_s
    assert run.returncode == 0, output
    settled = sampler.samples[-max(1, len(sampler.samples) // 20) :]  # the last 5 %: the summary and the manifest
    largest = max(_numel(shape) for shape, role in architecture_shapes("llama", dims).values() if role == "matrix")
    result = {
        "cpu": cpu_model_name(),
        "parameters": params,
        "gguf_mib": gguf.stat().st_size / MIB,
        "output_mib": sum(p.stat().st_size for p in dst.glob("*.safetensors")) / MIB,
        "largest_tensor_fp32_mib": largest * 4 / MIB,
        "peak_rss_anon_mib": sampler.peak_bytes / MIB,
        "settled_rss_anon_mib": sum(b for _, b in settled) / len(settled) / MIB,
        "samples": len(sampler.samples),
        "wall_s": wall,
        "summary": output.strip().splitlines()[0],
    }
    print(json.dumps(result, indent=2))
    print("\n| model | GGUF | output | largest tensor fp32 | peak RssAnon | settled RssAnon | wall |")
    print(f"|---|---|---|---|---|---|---|\n| {params / 1e9:.2f}B random Llama, Q4_K_M | {result['gguf_mib']:.0f} MiB | "
          f"{result['output_mib']:.0f} MiB | {result['largest_tensor_fp32_mib']:.0f} MiB | "
          f"{result['peak_rss_anon_mib']:.0f} MiB | {result['settled_rss_anon_mib']:.0f} MiB | {wall:.0f} s |")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


if __name__ == "__main__":
    main()
