"""edge-convert's progress as people see it: a bar on a terminal, and in a log only the summary at the end
(never one line per tensor: thousands for a 7B model)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

from kernels.convert.convert import StderrProgress
from tests.kernels.test_convert import SMOLLM2_LAYER, W4A16, _write_llama

NAMES = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(40)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_bar_counts_every_tensor():
    screen = Terminal()
    progress = StderrProgress(screen)
    for done, name in enumerate(NAMES, start=1):
        progress(done, len(NAMES), name)
    shown = screen.getvalue()
    assert "edge-convert" in shown and f"{len(NAMES)}/{len(NAMES)}" in shown and "\r" in shown
    assert shown.count("\n") <= 1  # redrawn in place, not a line per tensor


def test_in_a_log_nothing_is_printed_per_tensor():
    log = io.StringIO()
    progress = StderrProgress(log)
    for done, name in enumerate(NAMES, start=1):
        progress(done, len(NAMES), name)
    assert log.getvalue() == ""


def _convert(src: Path, dst: Path, tmp_path: Path, stderr) -> subprocess.CompletedProcess:
    plan = {"path": "w4a16-tinygemm", "quantization_config": W4A16}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    command = [sys.executable, "-c", "import sys; from kernels.convert.convert import StderrProgress, convert; "
               "import json; p = json.load(open(sys.argv[3])); "
               "convert(sys.argv[1], sys.argv[2], p['quantization_config'], path=p['path'], progress=StderrProgress())",
               str(src), str(dst), str(plan_file)]  # fmt: skip
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=300, check=False)


def test_a_conversion_logged_to_a_pipe_prints_its_summary_and_no_tensor_lines(tmp_path):
    src = _write_llama(tmp_path / "src", **SMOLLM2_LAYER)
    done = _convert(src, tmp_path / "dst", tmp_path, subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("converted ") and "tensors:" in lines[0]
    assert not any("model.layers." in line and "/" in line.split()[0] for line in lines)
    assert len(lines) <= 3  # the summary and its kept/added notes


def test_a_conversion_on_a_terminal_draws_a_bar(tmp_path):
    src = _write_llama(tmp_path / "src", **SMOLLM2_LAYER)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    try:
        done = _convert(src, tmp_path / "dst", tmp_path, secondary)
        os.close(secondary)
        secondary = -1
        screen = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal closed: everything has been read
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert done.returncode == 0
    text = screen.decode(errors="replace")
    assert "edge-convert" in text and "tensor" in text and "\r" in text
    assert "converted " in text
