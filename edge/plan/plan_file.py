"""A Plan read back from its JSON file (`edge-convert --plan`, `edge-eval --plan`, `edge-export --plan`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from edge.errors import InputError
from edge.plan.schema import Plan


def load_plan(plan_file: Path, field: str = "--plan") -> Plan:
    """The plan in `plan_file`; a missing file or one that is not a Plan is an InputError naming `field`."""
    try:
        return Plan.model_validate_json(Path(plan_file).read_text())
    except OSError as error:
        raise InputError(field, str(plan_file), f"a readable plan file ({error.strerror})") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise InputError(field, str(plan_file), f"a Plan JSON ({where}: {first['msg']})") from None
