"""Configuration of the API process, read from the environment (prefix EDGE_) by pydantic-settings.

Every field can be set as EDGE_<NAME>, e.g. EDGE_API_TOKEN, EDGE_MAX_BODY_BYTES, EDGE_RUN_DIR, EDGE_CALIBRATION_DB.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.errors import InputError

CalibrationMode = Literal["auto", "cached", "off"]  # Settings.calibration


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EDGE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address the API binds; loopback unless asked otherwise.")
    port: int = Field(default=8080, ge=0, le=65535)
    api_token: str | None = Field(
        default=None,
        description="When set, every endpoint but /healthz and /readyz needs 'Bearer <token>'; required to bind "
        "an address other than loopback (an empty one is no token).",
    )
    max_body_bytes: int = Field(default=1 << 20, ge=1, description="Larger request bodies are refused with 413.")
    max_batch_devices: int = Field(default=256, ge=1, description="Most devices one POST /plan/batch may name.")
    calibration_db: str | None = Field(
        default=None,
        description="Where POST /calibrations keeps records: a PostgreSQL URL shared by replicas "
        "(postgresql://user:password@host:5432/db); default: SQLite in the cache directory.",
    )
    report_token: str | None = Field(
        default=None,
        description="A second bearer token, that may only POST /calibrations here (with EDGE_API_TOKEN set), and "
        "the one `edge-serve --report-to URL` sends: the fleet planner and its boxes share it, and a box that "
        "reports holds no token that can plan, read or serve there.",
    )

    # The engine child process: it listens on a Unix socket in run_dir, fresh for each start, never on a TCP port.
    # A starting engine's socket refuses at once, so a short poll costs nothing and is up to a poll of start time:
    # 1.0 s here lost 0.5 s of each warm start on average (2026-12-03)
    health_poll_s: float = Field(default=0.1, gt=0, description="How often a starting engine's /health is polled.")
    ready_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A start not ready by then is killed and retried (vLLM here: ~150 s).",
    )
    backoff_initial_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=60.0, gt=0)
    backoff_jitter: float = Field(default=0.1, ge=0, le=1, description="Random +- fraction of each delay.")
    backoff_reset_s: float = Field(
        default=120.0,
        gt=0,
        description="An engine ready this long before dying restarts at the initial delay.",
    )
    stop_grace_s: float = Field(default=20.0, gt=0, description="SIGTERM to SIGKILL grace when stopping.")
    run_dir: str | None = Field(
        default=None,
        description="Where the engine's pid file and its socket are kept (made 0700, this user's alone), for the "
        "next edge-serve of this cache directory to find an engine a killed wrapper left; default: "
        "<cache directory>/run. One over 78 bytes (a Unix socket's path holds 107) keeps the pid files, but its "
        "sockets go to a private directory of its own under the temp directory (<tmp>/edge-select-<uid>/<hash>).",
    )
    early_engine: bool = Field(
        default=True,
        description="Start the engine importing vLLM while edge-serve plans, in the environment of the last engine "
        "that became ready in run_dir, used only if the plan's is the same (server/supervisor/early.py): ~1-2 s off "
        "each start. EDGE_EARLY_ENGINE=0: never.",
    )
    calibration: CalibrationMode = Field(
        default="auto",
        description="Which kernel times edge-serve plans from on this host: `auto` (the default) the cached "
        "calibration record of this CPU, timing one first (edge-calibrate, 1-2 minutes on 2 cores) when there is "
        "none, since the plan's decode kernel rests on it (served decode 1.17x on the Zen 5 host, 2026-12-03); "
        "`cached` a cached record when there is one, else the facts table, never timing at start; `off` the "
        "facts table, whatever is cached. A plan for a described device (--device) never times this host.",
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=256,
        description="The model's name in the OpenAI API; default: the model's directory (or GGUF) name. "
        "The checkpoint's full path is accepted too.",
    )

    # Liveness of a ready engine: a stopped or wedged engine must stop receiving traffic and be restarted, within
    # 5 s (issue 46), and an engine that is merely busy (a long prefill on one slow core, a burst of streams) never.
    # A stopped engine process (SIGSTOP) is seen in /proc at the next probe; a probe that times out while the engine's
    # processes used CPU is a busy engine, not a failure, for up to liveness_busy_s; a wedged engine (a deadlock, a
    # lock never released) uses none. Worst case for a wedge: failures x (interval + timeout) = 4 s.
    liveness_interval_s: float = Field(default=1.0, gt=0, description="How often a ready engine's /health is probed.")
    liveness_timeout_s: float = Field(default=1.0, gt=0, description="A /health probe slower than this failed.")
    liveness_failures: int = Field(
        default=2, ge=1, description="Failed probes in a row that make the engine unresponsive (then restarted)."
    )
    liveness_busy_cpu: float = Field(
        default=0.05,
        ge=0,
        description="A probe that timed out while the engine's processes used at least this fraction of a core is "
        "a busy engine, not a failed probe (0: every timeout is a failure).",
    )
    liveness_stall_s: float = Field(
        default=2.0,
        gt=0,
        description="Forwarded requests that have had no byte from the engine for this long while it used no CPU "
        "(less than liveness_busy_cpu) are a failed probe: a wedged engine core whose API still answers /health.",
    )
    liveness_busy_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a busy engine may leave its probes unanswered before it is unresponsive all the same "
        "(a spinning engine uses CPU too).",
    )
    liveness_idle_s: float = Field(
        default=30.0,
        ge=0,
        description="No request forwarded for this long: the engine is idle, and a one-token generation probes it "
        "(/health answers from vLLM's API process even when its engine core is wedged).",
    )
    liveness_generation_interval_s: float = Field(
        default=60.0, ge=0, description="At most one generation probe per this many seconds; 0 turns it off."
    )
    liveness_generation_timeout_s: float = Field(
        default=30.0, gt=0, description="A one-token generation slower than this failed."
    )
    # Requests that arrive while the engine starts or restarts wait for it (as Ollama's do while a model loads),
    # instead of a 503 a fleet client would retry blind into the restart.
    restart_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a /v1 request waits for an engine that is starting or restarting (a warm restart "
        "takes ~10-15 s here); past it, 503 with Retry-After. A client may ask for less with the "
        "X-Edge-Max-Wait header (seconds); a client that goes away stops waiting. 0: never wait.",
    )
    restart_queue: int = Field(
        default=64,
        ge=0,
        description="Most /v1 requests waiting for the engine at once; one more gets 503 with Retry-After.",
    )
    log_tail_lines: int = Field(default=40, ge=1, description="Engine log lines kept to explain a crash.")
    proxy_timeout_s: float = Field(default=600.0, gt=0, description="Read timeout for a forwarded request.")

    # Bounds on connections: what a flood of clients, or clients that stop reading, can hold.
    proxy_max_connections: int = Field(
        default=32,
        ge=1,
        description="Most connections open to the engine for forwarded requests (a CPU engine runs a few "
        "sequences at once; the rest wait in line); /metrics and the probes have connections of their own.",
    )
    proxy_pool_timeout_s: float = Field(
        default=10.0, gt=0, description="A forwarded request that waits longer for a free connection gets 503."
    )
    client_send_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A client that takes longer than this to accept one more part of a streamed answer is cut "
        "off, and its connection to the engine freed.",
    )
    limit_concurrency: int = Field(
        default=128, ge=1, description="Most connections and requests uvicorn serves at once; past it, 503."
    )
    timeout_keep_alive_s: int = Field(default=5, ge=1, description="An idle keep-alive connection is closed then.")

    @field_validator("api_token", "report_token")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        """EDGE_API_TOKEN= (as an unset Secret or a template leaves it) is no token, never the empty token."""
        return (value.strip() or None) if value is not None else None


def load_settings(**given: object) -> Settings:
    """Settings from the environment and `given` (the CLI's flags); InputError naming the first bad one (as
    EDGE_<NAME>, or the flag's field) and its value, instead of pydantic's traceback."""
    try:
        return Settings(**given)  # type: ignore[arg-type]
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "settings"
        field = f"--{name.replace('_', '-')}" if name in given else f"EDGE_{name.upper()}"
        expected = first["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
        raise InputError(field, first.get("input"), expected) from None


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only: localhost, 127.0.0.0/8, ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def exposure_problem(settings: Settings) -> str | None:
    """Why these settings may not serve: an address other than loopback with no API token (anyone who can reach
    it could plan, read the calibrations and use the engine); None when they may."""
    if settings.api_token or is_loopback(settings.host):
        return None
    return (f"--host {settings.host!r} (EDGE_HOST) is not a loopback address and EDGE_API_TOKEN is not set: "
            "refusing to serve without a token; set EDGE_API_TOKEN (e.g. `openssl rand -hex 32`, from a Kubernetes "
            "Secret in the DaemonSet) or bind 127.0.0.1")  # fmt: skip
