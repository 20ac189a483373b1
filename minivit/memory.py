"""Memory checked before it is allocated: the figures a refusal quotes.

A file's header (an .npy shape, an IDX image count) or a flag (--img-size) can ask for more memory
than the machine has; numpy then raises a raw MemoryError, or the kernel kills the process. Each
reader states the bytes it is about to allocate and calls check_fits first, so the refusal names the
file or flag, the figure, and what to change.
"""

import os


def available_memory():
    """Bytes this process can still allocate: MemAvailable from /proc/meminfo (Linux), else the free pages,
    and no more than a container's cgroup limit leaves; None when none is known (then nothing is refused)."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:                                       # cgroup v2: a container sees the host's meminfo, not its own limit
        with open("/sys/fs/cgroup/memory.max") as f_max, open("/sys/fs/cgroup/memory.current") as f_now:
            limit, used = f_max.read().strip(), int(f_now.read())
        if limit != "max":
            free = int(limit) - used if free is None else min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def size_text(nbytes):
    """A byte count as people read it: '8.5 GB' (decimal), '312 MB', '40 kB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


def check_fits(nbytes, what, advice):
    """Refuse, with a ValueError of one line (where numpy would raise a raw MemoryError), nbytes beyond the
    memory available. what: the thing that would be allocated, naming its file or flag; advice: what to change."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {size_text(nbytes)}, and this machine has {size_text(free)} of memory "
                         f"available: {advice}")
