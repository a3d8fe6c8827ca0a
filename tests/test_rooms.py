"""The rooms' import rules, read from the source: no import cycles between the project's modules (imports inside
functions count: a deferred import is still a dependency), no private name imported across modules, and the
rooms' directions (`edge/` imports neither torch, vllm, fastapi, `kernels` nor `server`; `server/` neither torch,
vllm nor `kernels`)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[1]
ROOMS = ("edge", "kernels", "server")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for room in ROOMS for p in sorted((REPO / room).rglob("*.py"))}


def imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, resolved to project modules where
    `from package import submodule` names one."""
    found: list[tuple[str, list[str]]] = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in modules else (base, [alias.name]))
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {target for target, _ in imports(path, modules) if target in modules and target != name}
            for name, path in modules.items()}  # fmt: skip


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_of_three():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_the_projects_modules():
    assert cycles(graph()) == []


def test_no_private_name_is_imported_from_another_module():
    modules = project_modules()
    crossing = [f"{module_name(path)} imports {name} from {target}"
                for path in modules.values() for target, names in imports(path, modules) if target in modules
                for name in names if name.startswith("_") and not name.startswith("__")]  # fmt: skip
    assert crossing == []


def test_each_room_imports_only_what_it_may():
    never = {"edge": ("torch", "vllm", "fastapi", "kernels", "server"), "server": ("torch", "vllm", "kernels")}
    modules = project_modules()
    broken = [f"{name} imports {target}" for name, path in modules.items() for target, _ in imports(path, modules)
              if name.split(".")[0] in never and target.split(".")[0] in never[name.split(".")[0]]]  # fmt: skip
    assert broken == []


# kernels/' sub-packages, lowest first: each imports only those before it (README's layout table says what each holds).
KERNEL_LAYERS = ("ops", "vllm_plugin", "source", "formats", "scoring", "export", "convert", "evaluate", "calibrate")


def test_kernels_sub_packages_import_only_the_layers_below_them():
    rank = {f"kernels.{name}": i for i, name in enumerate(KERNEL_LAYERS)}
    upward = sorted({f"{a} imports {b}" for a, targets in graph().items() for b in targets
                     if (pa := ".".join(a.split(".")[:2])) in rank and (pb := ".".join(b.split(".")[:2])) in rank
                     and rank[pb] > rank[pa]})  # fmt: skip
    assert upward == []


def test_every_kernels_module_lives_in_a_layer():
    loose = [name for name in project_modules()
             if name.startswith("kernels.") and name.split(".")[1] not in KERNEL_LAYERS]  # fmt: skip
    assert loose == []


# edge/'s rooms, lowest first (README's layout table says what each holds): each imports only the rooms before it.
# Below them all, the floor: modules at edge/'s top that every room may use and that import no room; above them
# all, edge.cli, the command line, which may import any.
EDGE_ROOMS = ("model", "catalog", "formats", "device", "measure", "plan")
EDGE_FLOOR = ("edge.errors", "edge.paths", "edge.bounds", "edge.facts", "edge.sizes")
EDGE_TOP = ("edge.cli",)


def edge_rank(module: str) -> int | None:
    """A module's height in edge/: 0 the floor, then the rooms, the command line on top; None: not in edge/."""
    parts = module.split(".")
    if parts[0] != "edge" or module == "edge":
        return None
    if module in EDGE_FLOOR:
        return 0
    if module in EDGE_TOP:
        return len(EDGE_ROOMS) + 1
    return EDGE_ROOMS.index(parts[1]) + 1 if parts[1] in EDGE_ROOMS else -1


def test_every_edge_module_lives_in_a_room():
    loose = [name for name in project_modules() if edge_rank(name) == -1]
    assert loose == []


def test_edge_rooms_import_only_the_rooms_below_them():
    upward = sorted(f"{a} imports {b}" for a, targets in graph().items() for b in targets
                    if (ra := edge_rank(a)) is not None and (rb := edge_rank(b)) is not None and rb > ra)  # fmt: skip
    assert upward == []


def test_the_edge_room_check_finds_an_upward_import():
    assert edge_rank("edge.model.shapes") < edge_rank("edge.plan.planner") < edge_rank("edge.cli")
    assert edge_rank("edge.errors") == 0 and edge_rank("edge.stray") == -1
