"""Memory checked before it is allocated: the figures a refusal quotes.

A file's header (an .npy shape, an IDX image count) or a flag (--img-size) can ask for more memory
than the machine has; numpy then raises a raw MemoryError, or the kernel kills the process. Each
reader states the bytes it is about to allocate and calls check_fits first, so the refusal names the
file or flag, the figure, and what to change.
"""

import os


def available_memory():
    """Bytes this process can still allocate: MemAvailable from /proc/meminfo (Linux), else the free pages;
    None when neither is known (then nothing is refused)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(nbytes):
    """A byte count as people read it: '8.5 GB' (decimal), '312 MB', '40 kB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


def check_fits(nbytes, what, advice):
    """Refuse (MemoryError's cousin, a ValueError with one line) when nbytes exceed the memory available.
    what: the thing that would be allocated, naming its file or flag; advice: what to change."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {gib(nbytes)}, and this machine has {gib(free)} of memory available: "
                         f"{advice}")
