"""The off switch for Inductor's C++ wrapper, which every plan asks for (edge.engine_config.COMPILED_WRAPPER_ARGS).

EDGE_SELECT_WRAPPER=python in the engine's environment compiles the model with Inductor's Python wrapper, as vLLM
ships it: the escape hatch where the C++ wrapper fails to build, and the "before" of benchmarks/bench_serve.py's
`edge:MODE+python-wrapper`. The switch drops `cpp_wrapper` and `cpp_wrapper_build_separate` from
CompilationConfig.inductor_compile_config as the config is made, before vLLM hashes it into its compile-cache key
and before it hands the options to torch.compile (compilation/wrapper.py), so a cache compiled one way is never
loaded the other way.
"""

from __future__ import annotations

import functools
import os
from typing import Any

SWITCH = "EDGE_SELECT_WRAPPER"
_MARK = "_edge_select_wrapper_switch"


def python_wrapper_asked() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() == "python"


def drop_cpp_wrapper(inductor_config: dict[str, Any]) -> bool:
    """Remove the C++ wrapper (and how it is built) from an inductor_compile_config; True if it was asked for."""
    inductor_config.pop("cpp_wrapper_build_separate", None)
    return bool(inductor_config.pop("cpp_wrapper", False))


def install() -> bool:
    """With the switch set, wrap CompilationConfig.__post_init__ once per process; True if the wrap is (now) in
    place. vLLM loads its general plugins (this one) before it parses --compilation-config or builds a config."""
    if not python_wrapper_asked():
        return False
    from vllm.config.compilation import CompilationConfig

    post_init = CompilationConfig.__post_init__
    if getattr(post_init, _MARK, False):
        return True

    @functools.wraps(post_init)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        drop_cpp_wrapper(self.inductor_compile_config)
        post_init(self, *args, **kwargs)

    setattr(__post_init__, _MARK, True)
    CompilationConfig.__post_init__ = __post_init__
    return True
