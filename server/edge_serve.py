"""edge-serve's entry point: the early engine (server/supervisor/early.py) starts before the rest of edge-serve is
imported (server.cli's FastAPI app, the planner, the calibration store: ~0.7 s of a 2-core box's start), then
server.cli.main runs with it."""

from __future__ import annotations

import sys

from pydantic import ValidationError

from server.settings import Settings
from server.supervisor.early import EarlyEngine
from server.supervisor.run_dir import run_dir_of

# Ways in that never start an engine (server.cli.main decides; what is started and not used is killed there).
NOT_SERVING = frozenset({"--dry-run", "--plan-only", "-h", "--help"})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = Settings()  # run_dir, stop_grace_s, early_engine: from the environment alone, as main()'s
    except ValidationError:  # a bad EDGE_ variable: cli.main says which, and exits 2
        settings = None
    early = None
    if settings is not None and settings.early_engine and not NOT_SERVING.intersection(args):
        early = EarlyEngine.start(run_dir_of(settings), grace_s=settings.stop_grace_s)
    from server import cli  # noqa: PLC0415 - after the early engine started: the point of this module

    return cli.main(argv, early=early)


if __name__ == "__main__":
    sys.exit(main())
