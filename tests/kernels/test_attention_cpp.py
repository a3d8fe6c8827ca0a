"""The plugin's C++ attention op (kernels/vllm_plugin/attention.cpp, the `cpp` way of attention.py) against vLLM
0.28's own methods, on a real paged cache and vLLM's own C++ kernels, stepped as the engine steps it: the layer
handed over once, each step's metadata pushed before the call and cleared after. The default model's head shapes;
a prompt's prefill in a padded batch, then decode steps. Outputs and the whole cache must equal vLLM's bit for bit.
Outside a step the op must call vLLM's own Python ops for the layer, by its name."""

import gc

import pytest
import torch

pytest.importorskip("vllm")

from kernels.vllm_plugin import attention_cpp  # noqa: E402
from tests.kernels.test_attention_plugin import (  # noqa: E402
    BLOCK,
    BLOCKS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    STEPS,
    _impl,
    _metadata,
    _qkv,
    _run,
)

REASON = attention_cpp.load()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"C++ attention not built here: {REASON}")
LAYER = 5  # an index as the static forward context gives it: not the first
LEAN_ISAS = ("x86-64-v4", "x86-64-v3", "baseline")  # attention.cpp's lean kernel builds, best first


def _host_lean_isas() -> list[str]:
    """The lean kernel's builds this CPU runs (set_lean_isa refuses one it lacks), so each is tested on every host
    that has it: the AVX2 and baseline code on an AVX-512 host too."""
    if REASON is not None:
        return ["auto"]
    runs = []
    for name in LEAN_ISAS:
        try:
            runs.append(torch.ops.edge_attn.set_lean_isa(name))
        except RuntimeError:
            continue
    torch.ops.edge_attn.set_lean_isa("auto")
    return runs


HOST_LEAN_ISAS = _host_lean_isas()


@pytest.fixture(params=HOST_LEAN_ISAS)
def lean_isa(request):
    assert torch.ops.edge_attn.set_lean_isa(request.param) in (request.param, *LEAN_ISAS)
    yield request.param
    torch.ops.edge_attn.set_lean_isa("auto")


def _run_cpp(steps, group=0, lean=False):
    ops = torch.ops.edge_attn
    impl = _impl()
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    ops.forget()
    ops.set_lean(lean)
    ops.set_layer(LAYER, group, cache, impl.scale, None, -1, 0.0, None, 1.0, 1.0, "auto", impl.isa)
    outputs = []
    for start, tokens, padded, seed in steps:
        if isinstance(seed, tuple):  # one row of each seed's: single-row steps' rows again, in one pass
            q, k, v = (torch.cat(parts) for parts in zip(*(_qkv(1, one) for one in seed), strict=True))
        else:
            q, k, v = _qkv(padded, seed)
        meta = _metadata(impl.isa, start, tokens, padded)
        out = torch.zeros(padded, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        ops.set_step(group, tokens, True, meta.query_start_loc, meta.seq_lens, meta.block_table,
                     meta.scheduler_metadata, meta.slot_mapping, None)  # fmt: skip
        assert ops.ready_group(LAYER) == group
        ops.attention(q, k, v, out, LAYER)  # the whole padded batch, as the compiled graph passes it
        ops.end_step()
        outputs.append(out[:tokens].clone())
    return outputs, cache


def test_the_op_gives_vllms_outputs_and_cache_bit_for_bit():
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl
    vllm_forward = getattr(impl.forward, "vllm_method", impl.forward)
    vllm_update = getattr(impl.do_kv_cache_update, "vllm_method", impl.do_kv_cache_update)
    expected, expected_cache = _run(vllm_forward, vllm_update, STEPS)
    got, cache = _run_cpp(STEPS, group=1)
    assert expected_cache.abs().sum() > 0 and all(o.abs().sum() > 0 for o in expected)  # the kernels ran
    assert torch.equal(cache, expected_cache)
    for i, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(mine, theirs), f"step {i}"
    assert torch.ops.edge_attn.calls() == [len(STEPS), 0, 0]  # every call took the C++ way, vLLM's kernel


def _reference(q, cache, start, tokens):
    """Attention in float64 over the cache as the "vec" layout holds it (keys column-major in a block, values
    row-major): row j of `tokens` sees positions [0, start + j]."""
    blocks = torch.arange(1, BLOCKS)
    halves = cache.view(BLOCKS, KV_HEADS, 2 * BLOCK, HEAD_DIM).double()
    keys = halves[:, :, :BLOCK].reshape(BLOCKS, KV_HEADS, HEAD_DIM, BLOCK)[blocks]  # [b, kv, d, t]
    keys = keys.permute(1, 0, 3, 2).reshape(KV_HEADS, -1, HEAD_DIM)  # [kv, positions, d]
    values = halves[:, :, BLOCK:][blocks].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)
    out = torch.zeros(tokens, HEADS, HEAD_DIM, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for j in range(tokens):
        count = start + j + 1
        for h in range(HEADS):
            scores = keys[h // group, :count] @ q[j, h].double() * HEAD_DIM**-0.5
            out[j, h] = torch.softmax(scores, 0) @ values[h // group, :count]
    return out


def test_decode_rows_take_the_lean_kernel_on_vllms_cache_as_vllm_writes_it(lean_isa):
    """The lean kernel reads the cache vLLM's own write fills, in its "vec" layout: the cache must equal vLLM's bit
    for bit, each decode step's output must be as close to float64 attention as vLLM's own (within one bf16 step of
    it), and only the decode steps take it (the 20-row prompt is vLLM's). Each of its builds this CPU runs."""
    from vllm.v1.attention.backends import cpu_attn

    if _impl().isa != "vec":
        pytest.skip(f"the lean kernel reads vLLM's 'vec' cache layout; this host's is {_impl().isa!r}")
    impl = cpu_attn.CPUAttentionBackendImpl
    vllm_forward = getattr(impl.forward, "vllm_method", impl.forward)
    vllm_update = getattr(impl.do_kv_cache_update, "vllm_method", impl.do_kv_cache_update)
    expected, expected_cache = _run(vllm_forward, vllm_update, STEPS)
    got, cache = _run_cpp(STEPS, lean=True)
    assert torch.equal(cache, expected_cache)
    assert torch.ops.edge_attn.calls() == [len(STEPS), 0, len(STEPS) - 1]
    assert torch.equal(got[0], expected[0])  # the prompt: vLLM's kernel
    for i, ((start, tokens, padded, seed), mine, theirs) in enumerate(zip(STEPS, got, expected, strict=True)):
        if i == 0:
            continue
        # the cache as it stood after this step's write: positions past it are not read
        reference = _reference(_qkv(padded, seed)[0], cache, start, tokens)
        mine_error = (mine.double() - reference).abs().max().item()
        theirs_error = (theirs.double() - reference).abs().max().item()
        step = reference.abs().max().item() * 2**-8  # one bf16 step at the largest output
        assert mine_error <= theirs_error + step, f"step {i}: {mine_error} against vLLM's {theirs_error}"
    torch.ops.edge_attn.set_lean(True)


def test_a_verify_pass_gives_each_row_what_the_row_alone_gives(lean_isa):
    """A drafted verify pass (several rows of one sequence) attends each row as a decode step of that row alone
    would: speculative decoding's greedy text is the undrafted one only if these are bit for bit equal."""
    if _impl().isa != "vec":
        pytest.skip(f"the lean kernel reads vLLM's 'vec' cache layout; this host's is {_impl().isa!r}")
    prompt = [(0, 20, 24, 0)]
    one_by_one = prompt + [(20 + i, 1, 1, 100 + i) for i in range(4)]
    together = prompt + [(20, 4, 4, tuple(100 + i for i in range(4)))]
    single, single_cache = _run_cpp(one_by_one, lean=True)
    verify, verify_cache = _run_cpp(together, lean=True)
    assert torch.ops.edge_attn.calls()[2] == 1  # the verify pass took the lean kernel
    assert torch.equal(verify[1], torch.cat(single[1:]))
    torch.ops.edge_attn.set_lean(True)


def test_the_lean_kernel_runs_the_best_build_the_cpu_and_aten_cpu_capability_allow():
    """Unset, the best build the CPU has; ATEN_CPU_CAPABILITY=avx2 (how an AVX2 host's code is checked on an AVX-512
    one) caps it at x86-64-v3 and =default at the baseline, each in a fresh process (the choice is made at load);
    a build the CPU lacks, or an unknown name, is refused naming it."""
    import os
    import subprocess
    import sys

    best = HOST_LEAN_ISAS[0]
    assert torch.ops.edge_attn.lean_isa() == best
    capped = {None: best, "avx2": LEAN_ISAS[max(LEAN_ISAS.index(best), 1)], "default": "baseline"}
    script = "from kernels.vllm_plugin import attention_cpp; import torch; attention_cpp.load(); " \
             "print(torch.ops.edge_attn.lean_isa())"  # fmt: skip
    for capability, expected in capped.items():
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert done.stdout.strip().splitlines()[-1] == expected, (capability, done.stdout, done.stderr)
    with pytest.raises(RuntimeError, match="name: expected auto, x86-64-v4, x86-64-v3 or baseline, got 'avx9'"):
        torch.ops.edge_attn.set_lean_isa("avx9")
    for name in LEAN_ISAS[: LEAN_ISAS.index(best)]:  # above what the CPU has
        with pytest.raises(RuntimeError, match=f"name: '{name}' needs instructions this CPU lacks"):
            torch.ops.edge_attn.set_lean_isa(name)
    assert torch.ops.edge_attn.lean_isa() == best


def test_a_layer_is_ready_only_inside_a_step_it_was_handed():
    ops = torch.ops.edge_attn
    ops.forget()
    assert ops.ready_group(LAYER) == -1
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    ops.set_layer(LAYER, 0, cache, 1.0, None, -1, 0.0, None, 1.0, 1.0, "auto", _impl().isa)
    assert ops.ready_group(LAYER) == -1  # no step yet
    meta = _metadata(_impl().isa, 0, 1, 1)
    ops.set_step(0, 1, True, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.scheduler_metadata,
                 meta.slot_mapping, None)  # fmt: skip
    assert ops.ready_group(LAYER) == 0 and ops.ready_group(LAYER + 1) == -1
    ops.end_step()
    assert ops.ready_group(LAYER) == -1
    ops.forget()


def test_outside_a_step_the_op_calls_vllms_ops_for_the_layer_by_name(monkeypatch):
    from vllm.model_executor.layers.attention import attention as vllm_attention

    calls = []

    def update_stand_in(key, value, name):  # stand-in for vLLM's op: records the call
        calls.append(("update", name, key.shape))
        return key.new_empty(0)

    def attention_stand_in(query, key, value, output, name, kv_cache_dummy_dep=None):  # stand-in, records
        calls.append(("attention", name, query.shape))
        output.fill_(1)

    monkeypatch.setattr(vllm_attention, "unified_kv_cache_update", update_stand_in)
    monkeypatch.setattr(vllm_attention, "unified_attention_with_output", attention_stand_in)
    monkeypatch.setitem(attention_cpp._Layers.names, LAYER, "model.layers.5.self_attn.attn")
    torch.ops.edge_attn.forget()
    q, out = torch.zeros(2, HEADS, HEAD_DIM), torch.zeros(2, HEADS, HEAD_DIM)
    k = v = torch.zeros(2, KV_HEADS, HEAD_DIM)
    torch.ops.edge_attn.attention(q, k, v, out, LAYER)
    name = "model.layers.5.self_attn.attn"
    assert calls == [("update", name, k.shape), ("attention", name, q.shape)]
    assert torch.ops.edge_attn.calls() == [0, 1, 0]
    assert torch.equal(out, torch.ones_like(out))


def test_the_models_tensors_are_held_from_cpp_once_per_model():
    """hold_model gives each parameter and buffer one C++ reference more (so the compiled graph, running without
    the GIL, never releases the last one and needs the GIL for its PyObject), once per model; a new model's replace
    the last one's, which go back to what they were."""
    first = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    first.register_buffer("table", torch.zeros(5))
    tensors = [*first.parameters(), *first.buffers()]
    before = [t._use_count() for t in tensors]
    assert attention_cpp.hold_model(first) == len(tensors) == 5
    assert [t._use_count() for t in tensors] == [n + 1 for n in before]
    assert attention_cpp.hold_model(first) == 0  # already held
    assert [t._use_count() for t in tensors] == [n + 1 for n in before]
    second = torch.nn.Linear(2, 2)
    assert attention_cpp.hold_model(second) == 2
    assert [t._use_count() for t in tensors] == before
    del first  # collected: its finalizer must not release the model held now
    gc.collect()
    weights = second.weight
    assert weights._use_count() == 2
    del second  # an engine shut down: its model goes, and what was held for it with it
    gc.collect()
    assert weights._use_count() == 1 and attention_cpp._Layers.held_model is None


def test_a_steps_input_views_are_kept_from_step_to_step():
    """vLLM slices its persistent input buffers anew each step; steady_input gives the same tensor for the same view
    of the same memory (written through: the buffer's new contents show), held from C++, and another for another
    view; a new model's hold starts over."""
    model, next_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    attention_cpp.hold_model(model)
    buffer = torch.zeros(16, dtype=torch.int64)
    first = attention_cpp.steady_input(buffer[:1])
    assert attention_cpp.steady_input(buffer[:1]) is first  # the next step's new slice of the same row
    assert first._use_count() == 2  # held from C++
    buffer[0] = 7
    assert first.tolist() == [7]
    other = attention_cpp.steady_input(buffer[:3])
    assert other is not first and other.shape == (3,) and other.data_ptr() == buffer.data_ptr()
    assert attention_cpp.steady_input(None) is None
    attention_cpp.hold_model(next_model)
    assert attention_cpp.steady_input(buffer[:1]) is not first and first._use_count() == 1
    attention_cpp._release(attention_cpp._Layers.held_model)
