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


def rss_bytes(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) of one process in bytes; zeros when it has gone. RssFile is the mapped files' resident
    pages: the libraries, and the weights where an engine maps them (kernels/vllm_plugin/mapped_weights.py,
    llama.cpp's mmap); a page shared by two processes counts in each."""
    anon = file = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return anon, file


def _command(pid: int) -> str:
    """A process's command line, shortened; empty when it has gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in argv if a)[:160]


def rss_anon_bytes(pid: int) -> int:
    """RssAnon of one process in bytes; 0 when it has gone."""
    return rss_bytes(pid)[0]


def tree_rss_anon_bytes(pid: int) -> int:
    return sum(rss_anon_bytes(p) for p in process_tree(pid))


@dataclass
class TreeSampler:
    """Samples a process tree's RssAnon (and RssFile, apart) in a background thread until stopped."""

    pid: int
    interval_s: float = 0.2
    samples: list[tuple[float, int]] = field(default_factory=list)
    root_samples: list[tuple[float, int]] = field(default_factory=list)  # the root process's own, same instants
    file_samples: list[tuple[float, int]] = field(default_factory=list)  # the tree's RssFile, same instants
    root_file_samples: list[tuple[float, int]] = field(default_factory=list)
    # at the highest RssAnon sample: (time.monotonic(), [(pid, command line, RssAnon)]), to say what peaked
    peak_members: tuple[float, list[tuple[int, str, int]]] = (0.0, [])
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        highest = -1
        while not self._stop.is_set():
            now, tree = time.monotonic(), process_tree(self.pid)
            sizes = [rss_bytes(p) for p in tree]
            total = sum(a for a, _ in sizes)
            if total > highest:
                highest = total
                self.peak_members = (now, [(p, _command(p), a) for p, (a, _) in zip(tree, sizes, strict=True)])
            self.samples.append((now, total))
            self.root_samples.append((now, sizes[0][0]))
            self.file_samples.append((now, sum(f for _, f in sizes)))
            self.root_file_samples.append((now, sizes[0][1]))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def describe_peak(self) -> str:
        """What held the highest sample: each process's RssAnon and command line, and when (seconds from the
        first sample)."""
        at, members = self.peak_members
        start = self.samples[0][0] if self.samples else at
        rows = [f"{a / 2**20:7.0f} MiB  pid {p}  {c}" for p, c, a in sorted(members, key=lambda m: -m[2])]
        return f"peak {self.peak_bytes / 2**20:.0f} MiB at {at - start:.1f} s:\n" + "\n".join(rows)

    def settled_bytes(self, since: float) -> int:
        """Median of the samples taken after `since` (time.monotonic())."""
        tail = [b for t, b in self.samples if t >= since]
        return int(statistics.median(tail)) if tail else 0

    def settled_file_bytes(self, since: float) -> int:
        """RssFile's median after `since`."""
        tail = [b for t, b in self.file_samples if t >= since]
        return int(statistics.median(tail)) if tail else 0

    def peak_between(self, start: float, end: float) -> int:
        """RssAnon's highest sample taken in [start, end) (time.monotonic()): what one part of a workload peaked at."""
        return max((b for t, b in self.samples if start <= t < end), default=0)

    @property
    def peak_file_bytes(self) -> int:
        """RssFile's peak."""
        return max((b for _, b in self.file_samples), default=0)

    def below_root(self) -> TreeSampler:
        """The same samples less the root process's own RssAnon: what its children hold (a wrapper's engine)."""
        below = TreeSampler(self.pid, self.interval_s)
        below.samples = [(t, b - r) for (t, b), (_, r) in zip(self.samples, self.root_samples, strict=True)]
        below.file_samples = [(t, b - r) for (t, b), (_, r) in zip(self.file_samples, self.root_file_samples,
                                                                   strict=True)]  # fmt: skip
        return below


@dataclass
class SampledRun:
    """A command run to its end while its process tree was sampled: its output (stdout and stderr together)."""

    returncode: int
    output: str
    wall_s: float
    sampler: TreeSampler


def run_sampled(argv: list[str], interval_s: float = 0.1) -> SampledRun:
    """Run argv, sampling its tree's RssAnon every interval_s until it exits."""
    import subprocess

    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(process.pid, interval_s=interval_s).start()
    output, _ = process.communicate()
    sampler.stop()
    return SampledRun(process.returncode, output, time.monotonic() - started, sampler)
