"""CPU quota and memory limit of this process's cgroup (v2 unified, or v1 cpu/memory controllers).

Each reader returns None when it cannot tell (no cgroup files), else a Limit whose value is None when the
cgroup sets no limit. The effective limit is the smallest along the path from the process's cgroup up to the
mount's root, since a parent's limit binds its children. All paths hang off `root` so tests can fake a host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_MOUNT = "sys/fs/cgroup"
# v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is no limit.
V1_UNLIMITED = 2**62


@dataclass(frozen=True)
class Limit:
    value: float | int | None  # cores or bytes; None = no limit
    detail: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _exists(path: Path, directory: bool = False) -> bool:
    try:
        return path.is_dir() if directory else path.exists()
    except OSError:  # EACCES is not swallowed by Path.exists
        return False


def _memberships(root: Path) -> dict[str, str]:
    """controller -> cgroup path from /proc/self/cgroup; "" is the v2 unified hierarchy."""
    text = _read(root / "proc/self/cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _candidates(mount: Path, cgroup_path: str, filename: str) -> list[Path]:
    """The file at the process's cgroup and at each ancestor, leaf first; in a cgroup namespace the mount
    itself is the process's cgroup, so the mount's own file is always the last candidate."""
    parts = [p for p in cgroup_path.strip("/").split("/") if p]
    found = [mount.joinpath(*parts[:n], filename) for n in range(len(parts), 0, -1)]
    return [*found, mount / filename]


def _v2_mount(root: Path) -> Path | None:
    mount = root / CGROUP_MOUNT
    return mount if _exists(mount / "cgroup.controllers") else None


def _v1_mount(root: Path, controller: str) -> Path | None:
    base = root / CGROUP_MOUNT
    for name in (controller, f"{controller},cpuacct", f"cpuacct,{controller}"):
        if _exists(base / name, directory=True):
            return base / name
    return None


def cpu_quota(root: Path = Path("/")) -> Limit | None:
    """Cores allowed by cpu.max (v2) or cpu.cfs_quota_us / cpu.cfs_period_us (v1)."""
    paths = _memberships(root)
    quotas: list[tuple[float, str]] = []
    seen = False
    mount = _v2_mount(root)
    if mount is not None and "" in paths:
        for path in _candidates(mount, paths[""], "cpu.max"):
            text = _read(path)
            if text is None:
                continue
            seen = True
            quota, _, period = text.partition(" ")
            if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
                quotas.append((int(quota) / int(period), f"cgroup v2 {path.relative_to(root)} = {text}"))
    mount = _v1_mount(root, "cpu")
    if not seen and mount is not None:
        for path in _candidates(mount, paths.get("cpu", "/"), "cpu.cfs_quota_us"):
            quota, period = _read(path), _read(path.with_name("cpu.cfs_period_us"))
            if quota is None or period is None:
                continue
            seen = True
            if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
                quotas.append(
                    (int(quota) / int(period), f"cgroup v1 {path.relative_to(root)} = {quota}/{period}")
                )
    if not seen:
        return None
    if not quotas:
        return Limit(None, "cgroup sets no CPU quota")
    value, detail = min(quotas)
    return Limit(value, detail)


def memory_limit(root: Path = Path("/")) -> Limit | None:
    """Bytes allowed by memory.max (v2) or memory.limit_in_bytes (v1)."""
    paths = _memberships(root)
    limits: list[tuple[int, str]] = []
    seen = False
    mount = _v2_mount(root)
    if mount is not None and "" in paths:
        for path in _candidates(mount, paths[""], "memory.max"):
            text = _read(path)
            if text is None:
                continue
            seen = True
            if text.isdigit():
                limits.append((int(text), f"cgroup v2 {path.relative_to(root)}"))
    mount = _v1_mount(root, "memory")
    if not seen and mount is not None:
        for path in _candidates(mount, paths.get("memory", "/"), "memory.limit_in_bytes"):
            text = _read(path)
            if text is None:
                continue
            seen = True
            if text.isdigit() and int(text) < V1_UNLIMITED:
                limits.append((int(text), f"cgroup v1 {path.relative_to(root)}"))
    if not seen:
        return None
    if not limits:
        return Limit(None, "cgroup sets no memory limit")
    value, detail = min(limits)
    return Limit(value, detail)
