"""Which paths have been measured on which ISA class, by whom (each path's `measured`, edge.catalog.weight_paths).
A plan's `verified` comes from here."""

from __future__ import annotations

from edge.catalog.weight_paths import PATHS, Layout, WeightPath


def verification(path: WeightPath, layout: Layout | None, isa_class: str) -> tuple[bool, str]:
    measured = PATHS[path].measured
    for key in ((layout, isa_class), (None, isa_class)):
        if key in measured:
            return True, measured[key]
    return False, f"{path}{'/' + layout if layout else ''} has not been measured on the {isa_class} ISA class"
