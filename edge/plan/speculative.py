"""Speculative decoding: whether a plan drafts tokens for vLLM to verify, with which proposer, how many at a time.

At one stream a decode step reads every weight for one token. vLLM 0.28's n-gram proposer drafts the next tokens
from the request's own text (prompt and output so far, on the host, no second model), and one forward pass then
checks all of them: the weights are read once for k + 1 positions. Where the answer repeats its input (a summary
quoting its passage, code edited in place) most drafts are accepted; in open prose few are, and each rejected draft
costs its rows in the verify pass.

    off     no drafting (the default: `auto` is asked for by name)
    ngram   vLLM's n-gram proposer (`speculative_config` method "ngram")
    auto    ngram where a measurement on this ISA class shows it costs at most AUTO_MAX_COST on open continuation
            and gains at least AUTO_MIN_GAIN on a workload that quotes its prompt (facts
            `<class>.speculative.ngram.*`, benchmarks/bench_serve.py --workload), else off; the plan says which
            and why

Not offered: vLLM's `suffix` proposer (it needs Snowflake's arctic-inference package, which is not a dependency
here) and a draft model (a second model through the planner is not built); asking for either is refused, naming the
field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from edge.catalog.kernel_registry import decode_rows
from edge.errors import InputError
from edge.facts import FACTS, Reason

SpeculativeMethod = Literal["off", "ngram"]
SPECULATIVE_CHOICES = ("off", "ngram", "auto")
DEFAULT_SPECULATIVE = "off"

# k drafted tokens make a verify pass of k + 1 rows a sequence. The plan keeps them on the decode kernel, which
# reads each weight once for all its rows (kernels/ops/avx2_int4.cpp: rows in blocks of 2); past its rows the layer
# goes to tinygemm. Measured on the default model (AMD EPYC Zen 5, a summary of a given passage, 128 greedy tokens,
# torch on 2 threads in both): k=3 309.7 tok/s, k=5 312.1 (docs/reports/2026-12-07-speculative.md).
DEFAULT_DRAFT_TOKENS = 3
# The n-gram match: the longest suffix of the text so far, from PROMPT_LOOKUP_MAX tokens down to PROMPT_LOOKUP_MIN,
# found earlier in the text proposes the tokens that followed it (vLLM's ngram_proposer).
PROMPT_LOOKUP_MIN = 2
PROMPT_LOOKUP_MAX = 4
# What `auto` asks of a measurement before it drafts (issue 45): at most this much slower on open continuation, and
# at least this much faster on a workload that quotes its prompt.
AUTO_MAX_COST = 0.03
AUTO_MIN_GAIN = 1.3
# vLLM's n-gram proposer is a numba function compiled with parallel=True (vllm/v1/spec_decode/ngram_proposer.py; it
# caps itself at one thread). Starting numba's default threading layer set the process's OpenMP team to every core:
# torch then ran 2 threads under OMP_NUM_THREADS=1, and a 510-token prefill went from 1502 to 2966 tok/s (AMD EPYC
# Zen 5, 2 cores, offline LLM): the plan's thread count no longer held. Numba's own work queue on one thread leaves
# OpenMP alone (torch kept 1 thread: 1578 tok/s).
DRAFTING_ENV = {"NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "1"}
# The plugin's limit on the sequences that draft in one step (kernels/vllm_plugin/drafting.py reads it). k + 1 rows
# fill the decode kernel's rows (draft_tokens), so one sequence: 4 streams all drafting served 0.755x the undrafted
# engine's throughput on the default model, one at a time 0.974x (docs/reports/2026-12-07-speculative.md).
DRAFT_MAX_SEQS_ENV = "EDGE_DRAFT_MAX_SEQS"
DRAFTING_SEQS = 1
# The ledger's item for a drafting engine: what vLLM's n-gram proposer brings in (numba, llvmlite, its JIT)
DRAFTING_BYTES_FACT = "any.ngram_proposer_bytes"


class Speculative(BaseModel):
    """What the plan drafts: vLLM's `speculative_config` is built from it (edge.plan.engine_config)."""

    method: SpeculativeMethod
    num_speculative_tokens: int | None = None  # k, drafted a step; None when off
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    asked: str  # what the caller asked for: off, ngram or auto
    max_seqs: int | None = None  # drafts only while at most this many sequences decode; None when off
    reasons: list[Reason] = []

    def engine_env(self) -> dict[str, str]:
        """The engine's environment for drafting: numba kept off OpenMP (DRAFTING_ENV) and the plugin's limit on the
        sequences that draft (kernels/vllm_plugin/drafting.py); nothing when off."""
        if self.method == "off":
            return {}
        return {**DRAFTING_ENV, DRAFT_MAX_SEQS_ENV: str(self.max_seqs)}

    def vllm_config(self) -> dict | None:
        """vLLM's `--speculative-config`, or None when off."""
        if self.method == "off":
            return None
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}  # fmt: skip


def check(asked: object) -> str:
    """The caller's `speculative` value, or an InputError naming it."""
    if asked is None:
        return DEFAULT_SPECULATIVE
    if asked == "suffix" or (isinstance(asked, str) and asked.startswith("draft")):
        raise InputError("speculative", asked, "off, ngram or auto: vLLM's suffix proposer needs the arctic-inference "
                         "package and a draft model is not built here yet")  # fmt: skip
    if asked not in SPECULATIVE_CHOICES:
        raise InputError("speculative", asked, f"one of {', '.join(SPECULATIVE_CHOICES)}")
    return str(asked)


def draft_tokens(decode_kernel: str | None) -> tuple[int, str]:
    """k for a plan whose decode rows run on this kernel (None: a path without the choice), and why: as many as keep
    one sequence's verify pass on the kernel."""
    rows = decode_rows(decode_kernel) if decode_kernel else None
    if rows is None or rows < 2:
        return DEFAULT_DRAFT_TOKENS, f"{DEFAULT_DRAFT_TOKENS} drafted tokens a step, while one sequence decodes"
    k = rows - 1
    return k, (f"{k} drafted tokens a step while one sequence decodes: the verify pass's {rows} rows stay on the "
               f"{decode_kernel} decode kernel")  # fmt: skip


def measured_gain(isa_class: str) -> tuple[float, float] | None:
    """(open continuation's ratio, the best quoting workload's ratio) for ngram against off, measured on this ISA
    class, or None."""
    cost = FACTS.get(f"{isa_class}.speculative.ngram.open_ratio")
    gain = FACTS.get(f"{isa_class}.speculative.ngram.quoting_ratio")
    return (cost.value, gain.value) if cost and gain else None


def method_for(asked: str, isa_class: str) -> tuple[SpeculativeMethod, list[Reason]]:
    """What an engine on this ISA class drafts for what was asked (check's value), and why."""
    if asked == "off":
        return "off", [Reason(text="no drafting, as asked (speculative off)", source="asked")]
    if asked == "ngram":
        return "ngram", [Reason(text="n-gram drafting, as asked (speculative ngram)", source="asked")]
    measured = measured_gain(isa_class)
    if measured is None:
        return "off", [Reason(text=f"no drafting: n-gram drafting is not measured on the {isa_class} class "
                                   "(speculative auto)")]  # fmt: skip
    open_ratio, quoting = measured
    key = f"{isa_class}.speculative.ngram"
    if open_ratio < 1 - AUTO_MAX_COST or quoting < AUTO_MIN_GAIN:
        return "off", [Reason(
            text=f"no drafting: n-gram drafting measured x{open_ratio:.2f} on open continuation and x{quoting:.2f} "
                 f"where the answer quotes its prompt on this class, short of at most {AUTO_MAX_COST:.0%} lost and "
                 f"x{AUTO_MIN_GAIN} gained (speculative auto)", fact=f"{key}.open_ratio")]  # fmt: skip
    return "ngram", [
        Reason(text=f"n-gram drafting measured x{quoting:.2f} where the answer quotes its prompt on this class "
                    "(speculative auto)", fact=f"{key}.quoting_ratio", value=quoting, source="measured here"),
        Reason(text=f"and x{open_ratio:.2f} on open continuation, within {AUTO_MAX_COST:.0%}",
               fact=f"{key}.open_ratio", value=open_ratio, source="measured here"),
    ]  # fmt: skip


def drafting_bytes(method: SpeculativeMethod) -> int:
    """What the engine's proposer holds where the plan drafts with this method (the ledger's item)."""
    return int(FACTS[DRAFTING_BYTES_FACT].value) if method != "off" else 0


def decide(asked: str, isa_class: str, decode_kernel: str | None, serves: bool) -> Speculative:
    """The plan's drafting for what was asked (check's value) on a device of this ISA class whose decode rows run
    on decode_kernel (None: the path's own kernel decodes); `serves`: whether vLLM serves the plan at all (an
    export-only plan drafts nothing)."""
    if not serves:
        return Speculative(method="off", asked=asked, reasons=[Reason(text="no engine: nothing drafts")])
    method, reasons = method_for(asked, isa_class)
    if method == "off":
        return Speculative(method="off", asked=asked, reasons=reasons)
    k, why = draft_tokens(decode_kernel)
    reasons.append(Reason(text=why, value=k, unit="tokens"))
    return Speculative(method=method, num_speculative_tokens=k, prompt_lookup_min=PROMPT_LOOKUP_MIN,
                       prompt_lookup_max=PROMPT_LOOKUP_MAX, max_seqs=DRAFTING_SEQS, asked=asked,
                       reasons=reasons)  # fmt: skip
