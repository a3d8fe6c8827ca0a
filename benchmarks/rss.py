"""RssAnon summed over a process tree, sampled through a whole load: the project's one memory yardstick.

VmRSS moved 1-2 GB between identical runs in the reference study; RssAnon (anonymous pages: heap, tensors
that were copied) is what a plan's ledger predicts, so it is what every benchmark reports.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process went between being listed and being read
        return kids
    for task in tasks:
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += _children(current)
    return tree


def rss_anon_bytes(pid: int) -> int:
    """RssAnon of one process in bytes; 0 when it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def tree_rss_anon_bytes(pid: int) -> int:
    return sum(rss_anon_bytes(p) for p in process_tree(pid))


@dataclass
class TreeSampler:
    """Samples a process tree's RssAnon in a background thread until stopped."""

    pid: int
    interval_s: float = 0.2
    samples: list[tuple[float, int]] = field(default_factory=list)
    root_samples: list[tuple[float, int]] = field(default_factory=list)  # the root process's own, same instants
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now, tree = time.monotonic(), process_tree(self.pid)
            sizes = [rss_anon_bytes(p) for p in tree]
            self.samples.append((now, sum(sizes)))
            self.root_samples.append((now, sizes[0]))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def settled_bytes(self, since: float) -> int:
        """Median of the samples taken after `since` (time.monotonic())."""
        tail = [b for t, b in self.samples if t >= since]
        return int(statistics.median(tail)) if tail else 0

    def below_root(self) -> TreeSampler:
        """The same samples less the root process's own RssAnon: what its children hold (a wrapper's engine)."""
        below = TreeSampler(self.pid, self.interval_s)
        below.samples = [(t, b - r) for (t, b), (_, r) in zip(self.samples, self.root_samples, strict=True)]
        return below
