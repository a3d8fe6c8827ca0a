"""The engine's states, and what /status reports of the supervisor (EngineStatus).

States: starting (first spawn, not yet healthy) -> ready -> crashed (it died, or was not ready in time; why is
in last_error; waiting out the backoff) -> restarting (spawned again, not yet healthy) -> ready ... ;
ready -> unresponsive (liveness probes failed in a row; being stopped) -> crashed -> restarting ... ;
stopped once stop() ran.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

EngineState = Literal["starting", "ready", "unresponsive", "crashed", "restarting", "stopped"]
ENGINE_STATES: tuple[EngineState, ...] = ("starting", "ready", "unresponsive", "crashed", "restarting", "stopped")
# Why the engine stopped serving, as counted in status().restart_reasons and the metrics.
StopKind = Literal[
    "exited", "exited-before-ready", "not-ready-in-time", "unresponsive", "could-not-start", "socket-taken"
]


class EngineStatus(BaseModel):
    state: EngineState
    pid: int | None = Field(
        description="Process id of the engine's process group leader (its watchdog; the group id), if running."
    )
    engine_pid: int | None = Field(description="Process id of the engine itself (vLLM's API server), if running.")
    served_model_name: str | None = Field(
        description="The model's name in the OpenAI API (/v1); the checkpoint's path is accepted too."
    )
    uptime_s: float | None = Field(description="Seconds since the running engine process was started.")
    ready_since_s: float | None = Field(description="Seconds the engine has been ready, if it is.")
    last_ready_at: float | None = Field(description="Unix time the engine last became ready, if it ever did.")
    restarts: int = Field(description="Times the engine was started again after dying or not becoming ready.")
    restart_reasons: dict[str, int] = Field(
        description="Restarts by why the engine stopped serving: exited, exited-before-ready, not-ready-in-time, "
        "unresponsive, could-not-start, socket-taken (another process listened on the engine's socket; "
        "was port-taken while the engine listened on a TCP port)."
    )
    last_error: str | None = Field(description="Why the engine last died: exit code or signal and its last lines.")
    probe_failures: int = Field(description="Liveness probes failed in a row, now (0 while it answers).")
    last_probe_error: str | None = Field(description="The last liveness probe that failed, and how.")
    next_restart_in_s: float | None = Field(description="Backoff delay before the next start, while restarting.")
    engine_url: str = Field(
        description="The URL requests to the engine name; they go over engine_socket, never TCP (it has no port)."
    )
    engine_socket: str | None = Field(
        default=None,
        description="The Unix socket the engine of this start listens on, in the run directory (0700, this "
        "user's alone), or, when the run directory's path is too long for a socket's, in a private directory of "
        "its own under the temp directory (<tmp>/edge-select-<uid>/<hash>); null before the first start.",
    )
