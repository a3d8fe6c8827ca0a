"""ARM64 ISA features from this process's ELF aux vector (AT_HWCAP, AT_HWCAP2 in /proc/self/auxv).

The kernel fills these from the CPU's ID registers, the same source as /proc/cpuinfo's `Features`, but
/proc/cpuinfo can be hidden or faked in containers (lxcfs, Android sandboxes) while the aux vector cannot.
Bit numbers are Linux's arch/arm64/include/uapi/asm/hwcap.h; they mean nothing on x86.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

AT_HWCAP = 16
AT_HWCAP2 = 26
# feature -> (aux vector entry, bit)
ARM64_HWCAP_BITS = {
    "asimd": (AT_HWCAP, 1),
    "fphp": (AT_HWCAP, 9),
    "asimdhp": (AT_HWCAP, 10),
    "asimddp": (AT_HWCAP, 20),
    "sve": (AT_HWCAP, 22),
    "sve2": (AT_HWCAP2, 1),
    "i8mm": (AT_HWCAP2, 13),
    "bf16": (AT_HWCAP2, 14),
    "sme": (AT_HWCAP2, 23),
}


def read_auxv(data: bytes) -> dict[int, int]:
    """Aux vector entries (type -> value) from the raw bytes of /proc/self/auxv (native word size)."""
    word = "Q" if sys.maxsize > 2**32 else "I"
    size = struct.calcsize("=" + word * 2)
    entries: dict[int, int] = {}
    for a_type, a_value in struct.iter_unpack("=" + word * 2, data[: len(data) - len(data) % size]):
        if a_type == 0:  # AT_NULL ends the vector
            break
        entries[a_type] = a_value
    return entries


def arm64_features(entries: dict[int, int]) -> list[str] | None:
    """Vocabulary features present per AT_HWCAP/AT_HWCAP2; None when the vector has no AT_HWCAP."""
    if AT_HWCAP not in entries:
        return None
    return [f for f, (entry, bit) in ARM64_HWCAP_BITS.items() if entries.get(entry, 0) >> bit & 1]


def probe_arm64_features(root: Path = Path("/")) -> list[str] | None:
    try:
        data = (root / "proc/self/auxv").read_bytes()
    except OSError:
        return None
    return arm64_features(read_auxv(data))
