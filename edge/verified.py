"""Which paths have been measured on which ISA class, by whom. A plan's `verified` comes from here."""

from __future__ import annotations

from edge.plan import Layout, WeightPath

_REFERENCE = "measured by the reference study on a Xeon 8480C (AMX) with vLLM 0.28"
_HERE = "measured on this project's AVX2 host with vLLM 0.28"
_HERE_AVX512 = (
    "measured on this project's AVX-512 host (AMD EPYC Zen 5, AVX512-BF16, no AMX) with vLLM 0.28: the default "
    "model served through edge-serve, 1 thread (docs/FACTS.md, 2026-11-30)"
)

# (path, layout or None for any, isa_class) -> who measured it.
MEASURED: dict[tuple[WeightPath, Layout | None, str], str] = {
    ("bf16", None, "amx"): _REFERENCE,
    ("w4a16-tinygemm", None, "amx"): _REFERENCE,
    ("w4a8-gptq", None, "amx"): _REFERENCE + " (this project's GPTQ export has not run on AMX)",
    ("bf16", None, "avx2"): _HERE,
    ("w4a16-tinygemm", None, "avx2"): _HERE + " (direct, dual and kernel-only served the default model; "
    "docs/reports/2026-11-29-engine.md)",
    ("bf16", None, "avx512"): _HERE_AVX512,
    ("w4a16-tinygemm", "direct", "avx512"): _HERE_AVX512 + " (direct: decode ~103 tok/s vs bf16 ~55-61)",
    ("w4a8-gptq", None, "avx512"): _HERE_AVX512.replace("served through edge-serve", "served by vLLM through the "
                                                        "plugin's cpu_w4a8") + " (decode 131 tok/s vs direct 104)",
}


def verification(path: WeightPath, layout: Layout | None, isa_class: str) -> tuple[bool, str]:
    for key in ((path, layout, isa_class), (path, None, isa_class)):
        if key in MEASURED:
            return True, MEASURED[key]
    return False, f"{path}{'/' + layout if layout else ''} has not been measured on the {isa_class} ISA class"
