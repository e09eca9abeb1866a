"""What is free: the memory this worker may still allocate on the host or a device (worker/memory/ admits
requests against it).

* host: ``MemAvailable`` from ``/proc/meminfo``, lowered by the cgroup's limit when one is set
  (v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``, each plus
  the reclaimable ``inactive_file`` page cache, on every level up to the root), and by the operator's
  cap ``TINKERQ_MEMORY_LIMIT_MB`` (a bound on this process's own RSS: cap - current RSS is left);
* device (CUDA): ``torch.cuda.mem_get_info`` plus what torch's caching allocator holds but does not use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 1024 * 1024
# cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything above this is no limit.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class Free:
    """Bytes this worker may still allocate on one device, and which limit decided it (for messages)."""

    nbytes: int
    limited_by: str


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    """``MemAvailable`` (bytes): free memory plus what the kernel can reclaim without swapping."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes(pid: int | str = "self", proc: Path = Path("/proc")) -> int:
    """Resident set size of a process (``VmRSS`` in /proc/<pid>/status), bytes; 0 if unreadable."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":  # cgroup v2: no limit
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _NO_LIMIT else None


def _stat_value(path: Path, *keys: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in keys:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_available(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limits (the tightest level), None when none is set.

    Each level with a limit leaves ``limit - usage + inactive_file``: page cache the kernel reclaims
    before it OOM-kills counts as free, as it does in MemAvailable. Levels are walked from this
    process's cgroup up to the mount's root; inside a container the cgroup namespace makes the path "/".
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy: "0::/path"
            cache_keys: tuple[str, ...] = ("inactive_file",)
            base, limit_file, usage_file = cgroup_root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1 memory controller: "4:memory:/path"
            base, limit_file, usage_file = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache_keys = ("total_inactive_file", "inactive_file")
        else:
            continue
        level = base / path.lstrip("/")
        while True:
            limit = _read_int(level / limit_file)
            usage = _read_int(level / usage_file)
            if limit is not None and usage is not None:
                left = max(0, limit - usage + _stat_value(level / "memory.stat", *cache_keys))
                best = left if best is None else min(best, left)
            if level == base or base not in level.parents:
                break
            level = level.parent
    return best


def host_free(limit_mb: int = 0) -> Free:
    """Bytes this worker may still allocate on the host: the smallest of MemAvailable, the cgroup's
    room, and the operator's cap (``limit_mb`` MiB for this process's RSS; 0 = no cap)."""
    candidates = []
    available = meminfo_available()
    if available is not None:
        candidates.append(Free(available, "the host's available memory (MemAvailable)"))
    room = cgroup_available()
    if room is not None:
        candidates.append(Free(room, "the container's memory limit (cgroup)"))
    if limit_mb > 0:
        candidates.append(Free(max(0, limit_mb * MiB - rss_bytes()),
                               f"TINKERQ_MEMORY_LIMIT_MB={limit_mb} for this worker process"))
    if not candidates:  # not Linux: nothing to go by, admit (the estimates still guard nothing)
        return Free(1 << 62, "no memory information on this platform")
    return min(candidates, key=lambda f: f.nbytes)


def device_free(device: str | torch.device, limit_mb: int = 0) -> Free:
    """Bytes free where a worker on ``device`` allocates its tensors (the host for cpu)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host_free(limit_mb)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(index)
    # Blocks torch's caching allocator holds but no tensor uses are free to this process too.
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    return Free(free + cached, f"free memory on cuda:{index}")


def describe(nbytes: int) -> str:
    """``nbytes`` for a message: MiB, or GiB from 1 GiB."""
    if nbytes >= 10 * 1024 * MiB:
        return f"{nbytes / (1024 * MiB):.0f} GiB"
    if nbytes >= 1024 * MiB:
        return f"{nbytes / (1024 * MiB):.1f} GiB"
    return f"{nbytes / MiB:.1f} MiB"
