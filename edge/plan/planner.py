"""make_plan: how should model M run on device D, given priority P and budget B.

Pure: no I/O, no clock, no environment. Everything it knows arrives in its arguments.
Order of work: gates (can it run?) -> rank by priority (edge.measure.rank) -> memory (edge.measure.ledger) -> the first
ranked option that runs and fits; every other option becomes an alternative with why not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from edge.catalog import shape_rules as rules
from edge.catalog.kernel_registry import kernels_for, reads_own_blocks, runs_grouped_int8
from edge.catalog.quantized_layers import EMBEDDING, LayerDecision, model_layers, rules_for
from edge.catalog.weight_paths import PATHS, QUANTIZED_PATHS, path_with_layout, the_path
from edge.device.calibration import CalibrationRecord
from edge.device.profile import DeviceProfile
from edge.errors import InputError
from edge.facts import FACTS, MeasuredFact, fact
from edge.formats.export import export_section
from edge.formats.tinygemm import TINYGEMM
from edge.measure import kernel_params, ledger
from edge.measure.cost import engine_linears, thread_choice
from edge.measure.quality import (
    DEFAULT_MAX_KLD,
    PlanQuality,
    QualityRecord,
    find,
    for_arch,
    grid_key,
    quality_key,
)
from edge.measure.rank import Option, RankInput, rank
from edge.model.shapes import ModelShape
from edge.plan import speculative as drafting
from edge.plan.engine_config import (
    DEFAULT_SERVING_MODE,
    ONE_PROCESS_MAX_CORES,
    attention_block_size,
    quantization_config,
    serving_mode_for,
    vllm_config,
)
from edge.plan.gates import Gate, all_gates
from edge.plan.schema import (
    LAYOUTS,
    PRIORITIES,
    WEIGHT_PATHS,
    Alternative,
    CalibrationRef,
    Layout,
    MemoryLedger,
    Plan,
    Priority,
    Reason,
    ServingMode,
    VllmConfig,
    WeightPath,
    format_bytes,
)
from edge.plan.verified import verification

# The phone bundle (served by no vLLM) and the path whose weights the decode kernels read (tinygemm's format).
EXPORT_PATH = the_path(served_by_vllm=False)
TINYGEMM_PATH = the_path(weight_format=TINYGEMM.name)

DEFAULT_MAX_MODEL_LEN = 2048  # an edge deployment's context; capped by the model's own maximum
DEFAULT_MAX_NUM_SEQS = 4
MIN_MAX_MODEL_LEN = 256  # below this a hint to shrink the context is no help to anyone


class PlanRefused(InputError):
    """A pinned path or layout that a gate refuses (exit code 2 unless forced)."""


@dataclass(frozen=True)
class Request:
    """What one planning call was asked, resolved to concrete values."""

    device: DeviceProfile
    model: ModelShape
    priority: Priority
    budget: int | None
    max_model_len: int
    max_num_seqs: int
    kernel: kernel_params.KernelParams
    max_kld: float = DEFAULT_MAX_KLD
    calibration: CalibrationRecord | None = None  # the device's kernel times (edge-calibrate), when known
    serving_mode: ServingMode = DEFAULT_SERVING_MODE
    threads: int | None = None  # the engine's compute threads as asked; None: the calibration's choice or the default
    drafting_bytes: int = 0  # what the engine's draft proposer holds where the plan drafts (edge.plan.speculative)


class Weights:
    """An option's weights, each computed once: the rules that quantize them (edge.catalog.quantized_layers), the
    layers they give, and the quantization_config the checkpoint would carry (on first use: an option a gate
    refuses may have no group size to write)."""

    def __init__(self, option: Option, gate: Gate, req: Request) -> None:
        self.option, self.gate, self.req = option, gate, req
        self.quant = rules_for(req.model, option.path, gate.group_size, req.priority, amx=req.device.has_amx,
                               int8_groups=runs_grouped_int8(req.device.isa_class),
                               own_blocks=reads_own_blocks(req.kernel.decode_kernel, option.path))  # fmt: skip
        self.layers = model_layers(req.model, self.quant)

    @functools.cached_property
    def qconfig(self) -> dict | None:
        req = self.req
        return quantization_config(req.model, self.option.path, self.option.layout, self.gate.group_size,
                                   self.layers, req.kernel, amx=req.device.has_amx)  # fmt: skip


@dataclass
class Evaluated:
    weights: Weights  # the option, its gate and its layers
    memory: MemoryLedger
    quality: QualityRecord | None = None  # edge-eval's measurement of this option's weights, when there is one
    # unmeasured for this model, but a path that quantizes activations whose every record (other models) is over
    # the speed floor: the best of those records (lossy_elsewhere)
    elsewhere: QualityRecord | None = None

    @property
    def option(self) -> Option:
        return self.weights.option

    @property
    def gate(self) -> Gate:
        return self.weights.gate

    def too_lossy(self, max_kld: float) -> bool:
        return self.quality is not None and self.quality.kld_mean > max_kld


def lossy_elsewhere(path: str, records: list[QualityRecord], max_kld: float,
                    qconfig: dict | None = None) -> QualityRecord | None:  # fmt: skip
    """For a path that quantizes activations: its best record on any model, among those rounded as this option's
    weights would be (`rounding`: GPTQ or to nearest), when every one exceeds max_kld, else None. W4A8 rounded to
    nearest measured 0.40-0.63 mean KLD on every model and kernel tried (docs/reports/2026-11-30-quality.md,
    2026-12-01-gguf-models.md), so without a record of its own a model is not served it for speed while a path
    keeping bf16 activations runs: an unmeasured path is then the likelier to hold the floor, not the other way.
    GPTQ after smoothing measured 0.065 on the default model (docs/reports/2026-12-07-w4a8-gptq.md): that says
    nothing of a checkpoint rounded to nearest."""
    if not PATHS[path].quantizes_activations:
        return None
    rounding = (qconfig or {}).get("rounding")
    mine = [r for r in records if r.key.get("path") == path and r.key.get("rounding") == rounding]
    if not mine or any(r.kld_mean <= max_kld for r in mine):
        return None
    return min(mine, key=lambda r: r.kld_mean)


def _check_inputs(priority: str, path: str | None, layout: str | None, max_model_len: int | None,
                  max_num_seqs: int | None, budget_bytes: int | None, model: ModelShape) -> None:
    if priority not in PRIORITIES:
        raise InputError("priority", priority, f"one of {', '.join(PRIORITIES)}")
    if path is not None and path not in WEIGHT_PATHS:
        raise InputError("path", path, f"one of {', '.join(WEIGHT_PATHS)}")
    if layout is not None and layout not in LAYOUTS:
        raise InputError("layout", layout, f"one of {', '.join(LAYOUTS)}")
    if layout is not None and path not in (None, path_with_layout(layout)):
        raise InputError("layout", layout, f"no layout unless the path is {path_with_layout(layout)}")
    if max_model_len is not None and not 1 <= max_model_len <= model.max_position_embeddings:
        raise InputError("max_model_len", max_model_len,
                         f"1 to the model's max_position_embeddings ({model.max_position_embeddings})")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise InputError("max_num_seqs", max_num_seqs, "a positive integer")
    if budget_bytes is not None and budget_bytes <= 0:
        raise InputError("memory_budget", budget_bytes, "a positive number of bytes")  # fmt: skip


def _check_threads(threads: int | None, device: DeviceProfile, mode: ServingMode) -> None:
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InputError("threads", threads, "a positive number of threads")
    if (cores := device.compute_cores) is not None and threads > cores:
        raise InputError("threads", threads, f"at most the device's {cores} compute cores")
    if mode == "three-process":
        # vLLM binds a three-process engine's worker itself (utils/ompmultiprocessing.py), overriding OMP_NUM_THREADS
        raise InputError("threads", threads, "no thread count in three-process mode, where vLLM binds its worker to "
                         "the cores it does not reserve; use --serving-mode one-process or two-process")


def engine_baseline(mode: ServingMode, isa_class: str) -> MeasuredFact:
    """The engine's own RssAnon (the process tree less weights and KV cache) for this serving mode, measured on
    this ISA class (facts `<class>.vllm_engine_baseline_bytes.<mode>`, benchmarks/ledger_vs_rss.py); else the same
    mode measured on another class: what it holds is Python, torch and vLLM per process, which the mode sets and
    the ISA barely moves, where the mode moves it by 0.5 GB a process (747 MB one-process, 1.25 GB two-process,
    1.65 GB three-process on the AVX-512 host); else the three-process figure measured on the AVX2 host."""
    if (own := FACTS.get(f"{isa_class}.vllm_engine_baseline_bytes.{mode}")) is not None:
        return own
    generic = fact("any.vllm_engine_baseline_bytes")  # three-process, measured on its class's host
    if mode == "three-process" and generic.isa_class == isa_class:
        return generic
    elsewhere = sorted(k for k in FACTS if k.endswith(f".vllm_engine_baseline_bytes.{mode}"))
    return FACTS[elsewhere[0]] if elsewhere else generic


def tokenizer_copies(mode: ServingMode) -> int:
    """The engine's processes that load the tokenizer: the API server, and an engine core of its own where it is
    another process (vLLM 0.28's StructuredOutputManager loads one; in one-process mode it finds the API server's in
    the same process's cache)."""
    return 1 if mode == "one-process" else 2


def bf16_repack_retention(isa_class: str) -> float:
    """The share of bf16 linear bytes the engine's allocator keeps after repacking (ledger item repack-retention),
    where this class's engine baseline was measured on a quantized plan (fact `<class>.bf16_repack_retention`, which
    only such a class has); 0 where the baseline was measured on bf16 and already holds it."""
    found = FACTS.get(f"{isa_class}.bf16_repack_retention")
    return float(found.value) if found is not None else 0.0


def _estimate(weights: Weights, req: Request, max_model_len: int | None = None) -> MemoryLedger:
    baseline = engine_baseline(req.serving_mode, req.device.isa_class)
    option, gate = weights.option, weights.gate
    return ledger.estimate(
        req.model, option.path, option.layout, gate.group_size,
        max_model_len=max_model_len or req.max_model_len, max_num_seqs=req.max_num_seqs,
        kernel=req.kernel, budget_bytes=req.budget,
        engine_baseline_bytes=int(baseline.value), quant=weights.quant, layers=weights.layers,
        tokenizers=tokenizer_copies(req.serving_mode),
        idle_trim=req.serving_mode == "one-process",  # only the one-process engine's thread trims when idle
        tokenizer_bytes_per_token=int(fact("any.tokenizer_bytes_per_vocab_token").value),
        # the retention the baseline's own measurement left out (a baseline measured on bf16 already holds it)
        bf16_repack_retention=bf16_repack_retention(baseline.isa_class),
        drafting_bytes=req.drafting_bytes,
    )  # fmt: skip


def _options(req: Request, gates: dict[WeightPath, Gate]) -> list[Option]:
    """The ranked options, then every path the ranking has no measurement for, so that each is accounted for."""
    device = req.device
    export = Option(EXPORT_PATH, None, None, "", [Reason(
        text="vLLM has no phone/NPU backend; a calibrated w8a16 export was the only scheme correct on device "
        "(36.9 dB; int8 activations gave 5.1 dB)", source="reference study")])
    inp = RankInput(isa_class=device.isa_class, model=req.model, kernel=req.kernel, record=req.calibration,
                    groups={path: gate.group_size for path, gate in gates.items()}, batch=req.max_num_seqs,
                    native_bf16=device.has("avx512_bf16") or device.has_amx)  # fmt: skip
    ranked = rank(inp, req.priority)
    options = [export, *ranked] if device.is_phone else [*ranked, export]
    covered = {o.path for o in options}
    return options + [Option(p, None, None, "unmeasured") for p in WEIGHT_PATHS if p not in covered]


def _largest_fitting_len(ev: Evaluated, req: Request) -> int | None:
    """Binary search of max_model_len for which this option fits the budget (memory grows with the context)."""
    low, high, best = MIN_MAX_MODEL_LEN, req.max_model_len - 1, None
    while low <= high:
        mid = (low + high) // 2
        if _estimate(ev.weights, req, mid).fits:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


# Avoidable memory below this is not worth a warning (1% of the smallest edge box we plan for, 1 GiB).
WARN_AVOIDABLE_BYTES = 10 * 2**20


def _gib(n: int) -> str:
    return format_bytes(n)


def _alternative(ev: Evaluated, chosen: Evaluated, req: Request) -> Alternative:
    base = dict(path=ev.option.path, layout=ev.option.layout, resident_bytes=ev.memory.resident_bytes,
                peak_bytes=ev.memory.peak_bytes)
    if not ev.gate.runnable:
        return Alternative(**base, status="incompatible", why_not="; ".join(ev.gate.refusals))
    if not ev.memory.fits:
        assert req.budget is not None
        why = f"peak {_gib(ev.memory.peak_bytes)} exceeds the budget of {_gib(req.budget)}"
        fitting_len = _largest_fitting_len(ev, req)
        if fitting_len is not None:
            return Alternative(**base, status="fits-with-hint", why_not=why,
                               hint=f"--max-model-len {fitting_len}")
        return Alternative(**base, status="does-not-fit", why_not=why,
                           hint=f"a memory budget of at least {_gib(ev.memory.peak_bytes)}")
    priority = req.priority
    if priority == "speed" and ev.too_lossy(req.max_kld):
        assert ev.quality is not None
        why = (f"measured mean KLD {ev.quality.kld_mean:.4f} (top-1 {ev.quality.top1_agreement:.1%}) exceeds the "
               f"speed priority's quality floor --max-kld {req.max_kld:g}")
    elif priority == "speed" and ev.elsewhere is not None and chosen.option.path != ev.option.path:
        r = ev.elsewhere
        why = (f"its quality is unmeasured for this model, and it measured over --max-kld {req.max_kld:g} on every "
               f"model measured (best: {r.model}, mean KLD {r.kld_mean:.4f}, top-1 {r.top1_agreement:.1%}); "
               "edge-eval --plan measures it for this one")
    elif priority == "speed" and _unmeasured_loss(ev) and chosen.quality is not None:
        why = (f"its quality is unmeasured for this model, while {chosen.option.label} is measured within --max-kld "
               f"{req.max_kld:g} (mean KLD {chosen.quality.kld_mean:.4f}): an unmeasured path never wins over a "
               "measured one; edge-eval --plan measures it")
    elif PATHS[ev.option.path].quantizes_activations and priority == "fidelity":
        why = "quantizes activations to int8 (+27.2% perplexity on the reference model); fidelity never does"
    elif ev.option.request_cost is not None and ev.option.request_cost == chosen.option.request_cost:
        extra = ev.memory.resident_bytes - chosen.memory.resident_bytes
        why = (f"as fast as {chosen.option.label} by the measurements, and needs {_gib(extra)} more resident"
               if extra > 0 else f"as fast as {chosen.option.label} by the measurements; ranked after it")
    elif chosen.option.request_cost is not None and ev.option.request_cost is not None:
        faster = ev.option.request_cost < chosen.option.request_cost
        why = (f"{'not pinned, though faster' if faster else 'ranked below ' + chosen.option.label} for {priority}: "
               f"{ev.option.request_cost:.4g} vs {chosen.option.request_cost:.4g} {ev.option.cost_unit}")
        if priority == "fidelity" and ev.option.path != chosen.option.path:
            why = f"less faithful than {chosen.option.label} (bf16 is the reference)"
    else:
        why = f"ranked below {chosen.option.label} for {priority}"
    return Alternative(**base, status="runnable", why_not=why)


def _pick(evaluated: list[Evaluated], priority: Priority, path: str | None, layout: str | None,
          force: bool, max_kld: float, device_name: str | None = None) -> Evaluated:
    pinned = [ev for ev in evaluated
              if (path is None or ev.option.path == path) and (layout is None or ev.option.layout == layout)]
    if path is not None or layout is not None:
        if not pinned:
            raise PlanRefused("path", path or layout, "a path this device can be planned for")
        runnable = [ev for ev in pinned if ev.gate.runnable]
        if not runnable and not force:
            refusals = "; ".join(pinned[0].gate.refusals)
            raise PlanRefused("path", path or layout, f"a path this device can run ({refusals}); --force overrides")
        candidates = runnable or pinned
    else:
        # fidelity never quantizes activations: W4A8 only when pinned; speed trades quality only within max_kld.
        candidates = [ev for ev in evaluated if ev.gate.runnable
                      and not (priority == "fidelity" and PATHS[ev.option.path].quantizes_activations)
                      and not (priority == "speed" and ev.too_lossy(max_kld))]
        if priority == "speed" and all(ev.quality is None for ev in candidates):  # none measured for this model
            candidates = [ev for ev in candidates if ev.elsewhere is None] or candidates
    if not candidates:
        # nothing runs: a device vLLM's build cannot run on (edge.plan.gates._vllm_refusal) that is no phone either
        if not force:
            why = "; ".join(next(ev for ev in evaluated if ev.option.path == "bf16").gate.refusals)
            raise PlanRefused("device", device_name, f"a device some path runs on ({why}); --force plans it anyway")
        candidates = evaluated
    if priority == "speed" and path is None and layout is None and any(ev.quality is not None for ev in candidates):
        # A quantized path whose quality is unmeasured ranks after every one measured within the floor (the sort
        # is stable: speed order holds within each group); bf16 is the reference and keeps its place.
        candidates = sorted(candidates, key=_unmeasured_loss)
    fitting = [ev for ev in candidates if ev.memory.fits]
    return fitting[0] if fitting else min(candidates, key=lambda ev: ev.memory.peak_bytes)  # fmt: skip


def _unmeasured_loss(ev: Evaluated) -> bool:
    """A path that quantizes weights, with no edge-eval record of its weights for this model."""
    return PATHS[ev.option.path].quantizes_weights and ev.quality is None


def make_plan(
    device: DeviceProfile,
    model: ModelShape,
    *,
    priority: Priority = "speed",
    budget_bytes: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    path: WeightPath | None = None,
    layout: Layout | None = None,
    force: bool = False,
    quality: list[QualityRecord] | None = None,
    max_kld: float = DEFAULT_MAX_KLD,
    calibration: CalibrationRecord | None = None,
    serving_mode: ServingMode | None = None,
    threads: int | None = None,
    speculative: str | None = None,
) -> Plan:
    """speculative: off, ngram or auto (edge.plan.speculative); None: off.
    serving_mode: how many processes vLLM runs as (edge.plan.schema.ServingMode); None: edge.plan.engine_config's
    choice for the device's cores (serving_mode_for).
    threads: the one- or two-process engine's compute threads (OMP_NUM_THREADS); None: the calibration's choice, else
    edge.plan.engine_config.engine_threads.
    quality: edge-eval records (edge.measure.quality.load_records); an option whose measured mean KLD exceeds
    max_kld is not chosen for speed, and the plan's `quality` section reports the chosen option's record.
    calibration: the device's own kernel times (edge.device.calibration; the caller matches it to the device): the
    ranking, the dequant threshold and the prefill dtype come from it instead of the facts table."""
    _check_inputs(priority, path, layout, max_model_len, max_num_seqs, budget_bytes, model)
    if not max_kld > 0:
        raise InputError("max_kld", max_kld, "a positive mean KL divergence (nats per token)")
    mode = serving_mode or serving_mode_for(device, threads)
    _check_threads(threads, device, mode)
    speculative = drafting.check(speculative)
    pin = " ".join(f"--{k} {v}" for k, v in (("path", path), ("layout", layout)) if v) or None
    if layout is not None:
        path = path_with_layout(layout)
    gates = all_gates(device, model, calibration)
    req = Request(
        device=device, model=model, priority=priority,
        budget=budget_bytes if budget_bytes is not None else device.usable_memory_bytes,
        max_model_len=max_model_len or min(DEFAULT_MAX_MODEL_LEN, model.max_position_embeddings),
        max_num_seqs=max_num_seqs or DEFAULT_MAX_NUM_SEQS, max_kld=max_kld, calibration=calibration,
        kernel=kernel_params.for_device(device, calibration, _w4a16_shapes(model, gates)),
        serving_mode=mode, threads=threads,
        drafting_bytes=drafting.drafting_bytes(drafting.method_for(speculative, device.isa_class)[0]),
    )  # fmt: skip
    # A plan quotes records of its device's architecture alone (edge.measure.quality.for_arch); a path whose every
    # record on any architecture is over the speed floor (lossy_elsewhere) is as lossy here: the weights are the same.
    everywhere = quality or []
    quality = for_arch(everywhere, device.arch_name)
    req, decode_reason = _lossy_decode(req, gates, quality)
    evaluated = [_evaluate(Weights(option, gates[option.path], req), req, quality, everywhere)
                 for option in _options(req, gates)]  # fmt: skip
    chosen = _pick(evaluated, priority, path, layout, force, max_kld, device.cpu_model.value or device.name)
    gate, option = chosen.gate, chosen.option
    layers, qconfig = chosen.weights.layers, chosen.weights.qconfig
    drafts = drafting.decide(speculative, device.isa_class, (qconfig or {}).get("decode_kernel"),
                             serves=PATHS[option.path].served_by_vllm)  # fmt: skip
    vllm = vllm_config(device, model, option.path, qconfig, max_model_len=req.max_model_len,
                       max_num_seqs=req.max_num_seqs, mode=req.serving_mode, speculative=drafts,
                       kv_cache_bytes=rules.kv_cache_bytes(model, req.max_model_len, req.max_num_seqs))  # fmt: skip
    threads = _threads(req, option.path, option.layout, vllm)
    if threads.env:
        vllm = vllm.model_copy(update={"env": {**vllm.env, **threads.env}})
    reasons = _reasons(chosen, priority, device, req.kernel, pin)
    if decode_reason is not None and option.path == TINYGEMM_PATH:
        reasons.append(decode_reason)
    if vllm is not None and (block := attention_block_size(model)) is not None:
        reasons.append(Reason(text=f"every layer attends through a sliding window: vLLM's CPU attention then "
                              f"serves only at --block-size {block} (vLLM 0.28, docs/FACTS.md)"))  # fmt: skip
    if vllm is not None:
        reasons.append(_serving_mode_reason(vllm.mode, serving_mode is not None, device))
    verified, verified_detail = verification(option.path, option.layout, device.isa_class)
    if calibration is not None and option.request_cost is not None and not option.extrapolated:
        verified, verified_detail = True, (f"kernels timed on this CPU ({calibration.describe()}); "
                                           + verified_detail)  # fmt: skip
    plan = Plan(
        path=option.path,
        layout=option.layout,
        group_size=gate.group_size,
        verified=verified,
        verified_detail=verified_detail,
        device=device,
        model=model,
        priority=priority,
        max_model_len=req.max_model_len,
        max_num_seqs=req.max_num_seqs,
        memory=chosen.memory,
        layers=layers,
        quantization_config=qconfig,
        vllm=vllm,
        speculative=drafts,
        export=None if PATHS[option.path].served_by_vllm else export_section(model.name, chosen.memory.resident_bytes),
        quality=_plan_quality(chosen),
        calibration=_calibration_ref(calibration),
        reasons=[*reasons, *threads.reasons, *(drafts.reasons if speculative != "off" else [])],
        alternatives=[_alternative(ev, chosen, req) for ev in evaluated if ev is not chosen],
        warnings=[*_warnings(chosen, device, layers), *threads.warnings],
        pinned=path is not None,
        forced=force and not gate.runnable,
    )  # fmt: skip
    return plan


def _evaluate(weights: Weights, req: Request, records: list[QualityRecord],
              everywhere: list[QualityRecord]) -> Evaluated:  # fmt: skip
    """An option's memory and its quality record (`records`: the device's architecture's), or, unmeasured, the record
    elsewhere (`everywhere`: any architecture's) that speaks against it."""
    option = weights.option
    measured = _measured(weights, records)
    # the config says how the weights would be rounded; an option refused for want of a group size has none
    qconfig = weights.qconfig if weights.gate.group_size is not None else None
    elsewhere = None if measured else lossy_elsewhere(option.path, everywhere, req.max_kld, qconfig)
    return Evaluated(weights, _estimate(weights, req), measured, elsewhere)


def _serving_mode_reason(mode: ServingMode, asked: bool, device: DeviceProfile) -> Reason:
    """Why vLLM runs as this many processes: as asked, else what one-process mode measured against two-process
    (edge.plan.engine_config.serving_mode_for decides by cores)."""
    if asked:
        return Reason(text=f"vLLM runs {mode}, as asked (serving_mode)", source="asked")
    rss = fact("avx512.one_process.rss_settled_ratio")
    decode = fact("avx512.one_process.decode_ratio")
    measured = (f"one-process measured {rss.value:.0%} of two-process's settled RssAnon and {decode.value:.2f}x its "
                f"served decode on a {ONE_PROCESS_MAX_CORES}-core {rss.isa_class} host ({rss.date})")  # fmt: skip
    if mode == "one-process":
        return Reason(text=f"vLLM runs one-process, its engine core a thread of the API server's process, on this "
                      f"{device.compute_cores}-core box: {measured}", fact=rss.key, value=rss.value, unit=rss.unit,
                      source="measured here")  # fmt: skip
    cores = f"{device.compute_cores} cores" if device.compute_cores else "an unknown core count"
    return Reason(text=f"vLLM runs two-process (API server, engine core) with {cores}: the API server keeps a process "
                  f"and a GIL of its own beside the engine's threads; {measured}, and is not measured on more cores "
                  "(--serving-mode one-process asks for it)", fact=rss.key, value=rss.value, unit=rss.unit,
                  source="measured here")  # fmt: skip


def _lossy_decode(req: Request, gates: dict[WeightPath, Gate],
                  records: list[QualityRecord]) -> tuple[Request, Reason | None]:  # fmt: skip
    """The speed priority's decode on a lossy decode kernel (int8 activations) where it is faster
    (req.kernel.lossy_decode) and an edge-eval record of this model with it shows the quality floor holds; else the
    kernel stays, and the reason says why. Fidelity never quantizes activations to 8 bits."""
    kernel = req.kernel
    if kernel.lossy_decode is None or req.priority != "speed":
        return req, None
    trial = replace(req, kernel=replace(kernel, decode_kernel=kernel.lossy_decode))
    probe = Option(TINYGEMM_PATH, PATHS[TINYGEMM_PATH].layouts[0], None, "")  # layout is not in the quality key
    key = quality_key(TINYGEMM_PATH, _qconfig(probe, gates[TINYGEMM_PATH], trial))
    record = find(records, req.model.name, key, req.model.architecture)
    # the candidate with the file's own 8-bit blocks unmeasured yet: the same plan's record on the grid gates it (the
    # plan's quality line stays unmeasured until edge-eval measures the plan itself)
    on_grid = record is None and key != grid_key(key)
    if on_grid:
        record = find(records, req.model.name, grid_key(key), req.model.architecture)
    if record is None:
        return req, Reason(
            text=f"decode stays on {kernel.decode_kernel}: {kernel.lossy_decode_why}, but no edge-eval record of this "
            "model with int8 activations shows the quality floor holds (edge-eval --plan PLAN --decode-kernel "
            f"{kernel.lossy_decode} measures it, and the next plan reads the record)", source="derived")  # fmt: skip
    measured = (f"int8 activations measured mean KLD {record.kld_mean:.4f} (top-1 {record.top1_agreement:.1%}, "
                f"{record.tokens} tokens)")  # fmt: skip
    if on_grid:
        measured += (" with the 8-bit set on its grid (the file's own 8-bit blocks this plan keeps are not measured "
                     "yet: edge-eval --plan PLAN measures them)")  # fmt: skip
    if record.kld_mean > req.max_kld:
        return req, Reason(text=f"decode stays on {kernel.decode_kernel}: {measured} exceeds --max-kld {req.max_kld:g}",
                           value=record.kld_mean, unit="nats/token", source="measured by edge-eval")  # fmt: skip
    return trial, Reason(text=f"decode rows on {kernel.lossy_decode_why}; {measured}, within --max-kld {req.max_kld:g}",
                         value=record.kld_mean, unit="nats/token", source="measured by edge-eval")  # fmt: skip


@dataclass
class Threads:
    """The engine's compute threads: what goes into its env, and the reasons and warnings that say why."""

    env: dict[str, str] = field(default_factory=dict)
    reasons: list[Reason] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _threads(req: Request, path: WeightPath, layout: Layout | None, vllm: VllmConfig | None) -> Threads:
    """The thread count asked for, else the one the record measured best for the path's decode kernel."""
    threads = Threads()
    if vllm is not None and req.threads is not None:
        threads.env["OMP_NUM_THREADS"] = str(req.threads)
        threads.reasons.append(Reason(text=f"{req.threads} engine thread{'s' if req.threads > 1 else ''}, as asked "
                                      "(threads)", value=req.threads, unit="threads", source="asked"))  # fmt: skip
        if req.threads > 1 and vllm.mode == "one-process" and req.device.compute_cores == 2:
            decode, _ = _second_thread_facts("one-process")
            threads.warnings.append(f"one-process on {req.threads} threads of a 2-core box: a second thread served "
                                    f"{decode.value:.2f}x the decode of one (fact {decode.key}); two-process loses "
                                    "less")  # fmt: skip
        return threads
    cores = req.device.compute_cores
    if vllm is None or not cores:
        return threads
    decode = kernels_for(path, layout, "decode")  # its decode rows' kernel (edge.catalog)
    choice = thread_choice(req.calibration, decode[0], cores) if decode and req.calibration else None
    if choice is not None:
        if choice.threads > 1 or vllm.mode != "three-process":  # one/two-process: the engine's own binding
            threads.env["OMP_NUM_THREADS"] = str(choice.threads)
        threads.reasons.append(Reason(text=choice.why, value=choice.threads, unit="threads",
                                      source="calibration of this CPU"))  # fmt: skip
    omp = threads.env.get("OMP_NUM_THREADS", vllm.env.get("OMP_NUM_THREADS"))
    if omp == "1" and (reason := _served_threads_reason(vllm, cores)) is not None:
        threads.reasons.append(reason)
    return threads


def _served_threads_reason(vllm: VllmConfig, cores: int) -> Reason | None:
    """Why a one- or two-process engine on a 2-core box computes on one thread: what a second one measured end to
    end through edge-serve in that mode, where the API server and the streams share the cores with it (a kernel's
    own scaling, which the calibration times, leaves that out)."""
    if vllm.mode == "three-process" or cores != 2:
        return None
    decode, prefill = _second_thread_facts(vllm.mode)
    hint = "--threads 2 --serving-mode two-process" if vllm.mode == "one-process" else "--threads 2"
    return Reason(text=f"1 engine thread on this 2-core box: a second one served {decode.value:.2f}x the decode and "
                  f"{prefill.value:.2f}x the prefill@512 through edge-serve {vllm.mode} (measured on the "
                  f"{decode.isa_class} host, {decode.date}); {hint} for prompt-heavy use", fact=decode.key,
                  value=decode.value, unit=decode.unit, source="measured here")  # fmt: skip


def _second_thread_facts(mode: ServingMode) -> tuple[MeasuredFact, MeasuredFact]:
    key = mode.replace("-", "_")
    return fact(f"avx512.{key}.second_thread.decode_ratio"), fact(f"avx512.{key}.second_thread.prefill_ratio")


def _w4a16_shapes(model: ModelShape, gates: dict[WeightPath, Gate]) -> list[tuple[int, int]]:
    """The GEMM shapes whose crossover sets the dequant threshold: the w4a16 speed plan's int4 layers."""
    group = gates[TINYGEMM_PATH].group_size
    linears = engine_linears(model_layers(model, rules_for(model, TINYGEMM_PATH, group, "speed")))
    return sorted({(lin.n, lin.k) for lin in linears if lin.format == "int4"})


def _calibration_ref(record: CalibrationRecord | None) -> CalibrationRef | None:
    if record is None:
        return None
    return CalibrationRef(key=record.key, digest=record.digest, cpu_model=record.cpu_model,
                          measured_at=record.measured_at, model=record.model, threads=record.threads)  # fmt: skip


def _qconfig(option: Option, gate: Gate, req: Request) -> dict | None:
    return Weights(option, gate, req).qconfig


def _measured(weights: Weights, records: list[QualityRecord]) -> QualityRecord | None:
    option, model = weights.option, weights.req.model
    if not records or not weights.gate.runnable or not PATHS[option.path].served_by_vllm:
        return None
    return find(records, model.name, quality_key(option.path, weights.qconfig), model.architecture)


def _plan_quality(chosen: Evaluated) -> PlanQuality:
    record = chosen.quality
    if chosen.option.path == "bf16":
        return PlanQuality(status="reference", note="bf16 is the source's own weights: the reference")
    if record is not None:
        return PlanQuality(status="measured", record=record, note=(
            f"edge-eval, {record.tokens} scored tokens" + (f" on {record.cpu}" if record.cpu else "")
            + (f", {record.measured_at}" if record.measured_at else "")))  # fmt: skip
    ref = PATHS[chosen.option.path].reference
    key = ref.perplexity if ref is not None else None
    if key is None:
        return PlanQuality(status="unmeasured", note="no edge-eval record for this path and model")
    f = fact(key)
    return PlanQuality(status="unmeasured", note=f"no edge-eval record for this model and configuration; nearest "
                       f"reference: {f.note} (+{f.value:g}{f.unit}, {f.source}, facts[{key}])")  # fmt: skip


def _reasons(chosen: Evaluated, priority: Priority, device: DeviceProfile,
             kernel: kernel_params.KernelParams, pin: str | None = None) -> list[Reason]:  # fmt: skip
    memory = chosen.memory
    budget = f"{_gib(memory.budget_bytes)} budget" if memory.budget_bytes else "no known budget"
    reasons = [
        Reason(text=f"pinned by {pin}: {chosen.option.label} on an {device.isa_class} CPU (priority {priority} "
               "did not choose it)" if pin else f"priority {priority} on an {device.isa_class} CPU chose "
               f"{chosen.option.label}", source="derived"),
        Reason(text=f"resident {_gib(memory.resident_bytes)}, load-time peak {_gib(memory.peak_bytes)}, "
               f"{budget}", value=memory.peak_bytes, unit="bytes", source="derived"),
        *chosen.option.reasons,
    ]  # fmt: skip
    if chosen.quality is not None:
        q = chosen.quality
        reasons.append(Reason(
            text=f"measured quality: mean KLD {q.kld_mean:.4f} +- {q.kld_mean_se:.4f}, top-1 {q.top1_agreement:.1%}, "
            f"perplexity ratio {q.ppl_ratio:.3f} ({q.tokens} tokens, edge-eval)",
            value=q.kld_mean, unit="nats/token", source="measured by edge-eval"))  # fmt: skip
    if chosen.option.path == TINYGEMM_PATH:
        block = kernel_params.block_fact(device)
        reasons.append(Reason(text=f"tinygemm n-block {kernel.block} channels ({block.source}: {block.detail})",
                              value=kernel.block, unit="channels", source=block.source))  # fmt: skip
        if kernel.measured and chosen.option.layout != "kernel-only":
            reasons.append(Reason(text=kernel.measured, value=kernel.dequant_threshold, unit="rows",
                                  source="calibration of this CPU"))
    return reasons


def _warnings(chosen: Evaluated, device: DeviceProfile, layers: list[LayerDecision]) -> list[str]:
    warnings = list(chosen.gate.notes) + device.notes  # device.notes: what a description said that was not read
    if chosen.option.extrapolated:
        warnings.append(f"no speed measurements on the {device.isa_class} ISA class: ranking extrapolated")
    if not chosen.memory.fits:
        warnings.append("nothing fits the memory budget: this is the closest option")
    for item in chosen.memory.items:
        if item.avoidable_bytes and item.avoidable_bytes >= WARN_AVOIDABLE_BYTES:
            warnings.append(f"{item.name}: {_gib(item.avoidable_bytes)} avoidable ({item.detail})")
    if chosen.option.path in QUANTIZED_PATHS:
        kept = [f"{layer.name} ({layer.why})" for layer in layers if layer.format == "bf16" and layer.name != EMBEDDING]
        if kept:
            warnings.append(f"layers kept in bf16: {'; '.join(kept)}")
    return warnings
