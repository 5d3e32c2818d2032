"""The memory allocator an `nmt` command runs on: TCMalloc where the machine has it, else
glibc's malloc. No torch here: the choice is made before torch is imported.

glibc's malloc either returns freed memory to the kernel (and every large tensor is then a
fresh mapping whose pages fault in again: up to 3x slower steps, see
`nmt.device.configure_host`) or keeps it, and then the heap fragments: a 2.5-minute `nmt
train` of the Multi30k transformer recipe held 1.3 GB in use and 1.9 GB free but kept at
minute 2 (glibc's `mallinfo2`). TCMalloc
(gperftools' `tcmalloc_minimal`; Debian and Ubuntu: `apt install libtcmalloc-minimal4`) keeps
freed blocks in per-size lists and reuses them, which bounds that. 4-minute runs of that
recipe, one after the other on 2 Zen 4 cores (`scripts/bench_memory.py --minutes 4`), peak
RSS and target tok/s logged after minute 1.5: glibc 3,343 MB, 4,030 tok/s; TCMalloc 2,199 MB,
4,384; jemalloc 2,041 MB, 3,191 (its default decay returns pages: not chosen); then TCMalloc
2,190 MB, 4,325 and glibc 3,442 MB, 4,144. Beam-5 decoding gained too (bf16 200 and 197
against 207 and 212 sentences/s, int8 209 and 215 against 240 and 222, alternating runs of
scripts/bench_decode.py); the step alone did not change (bench_model: 4,348 and 4,336 tok/s).
10-minute runs (README, "Speed and memory"): TCMalloc 4,560 tok/s after minute 2, RSS 2.19 GB
at minute 2 and 2.44 GB at minute 10; glibc 4,099 tok/s, 3.13 and 3.65 GB.

A command relaunches itself once (`relaunch`, an exec of the same command line) with the
library in LD_PRELOAD: an allocator must be in place before the process allocates anything.
NMT_MALLOC=system keeps glibc's malloc; NMT_MALLOC=LIBRARY preloads that library instead.
`heap_bytes` reads the allocator's own count of what it holds (in use, kept free), which
`scripts/bench_model.py --memory` reports; `release_free_memory` hands its free pages back.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

from nmt import NMTError

CHOICE = "NMT_MALLOC"  # unset: TCMalloc when found; "system": glibc's malloc; else a library
DONE = "NMT_MALLOC_PRELOADED"  # set in the relaunched process: a command relaunches once
TCMALLOC = "tcmalloc_minimal"  # gperftools' TCMalloc without its heap profiler
KNOWN = ("tcmalloc", "jemalloc", "mimalloc")  # allocators `in_use` recognises


def wanted() -> str | None:
    """The allocator library to preload (a file or a soname the dynamic loader finds), or None
    for glibc's malloc. A library named in NMT_MALLOC must exist."""
    choice = os.environ.get(CHOICE, "")
    if choice == "system":
        return None
    if choice:
        if "/" in choice and not Path(choice).is_file():
            raise NMTError(
                f"{CHOICE}={choice}: no such file; name an allocator library (a .so), "
                f"or set {CHOICE}=system for glibc's malloc"
            )
        return choice
    return ctypes.util.find_library(TCMALLOC)


def in_use() -> str:
    """The allocator this process runs on, as its memory map shows: the file name of a known
    allocator library mapped in, else "glibc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if line.count("/") and any(k in name for k in KNOWN):
            return name
    return "glibc"


def mapped(library: str) -> bool:
    """Whether `library` (a file, or a soname such as libtcmalloc_minimal.so.4, which names the
    file libtcmalloc_minimal.so.4.5.9) is in this process' memory map."""
    name = Path(library).resolve().name if "/" in library else library
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return True  # nothing to tell by
    return any(
        line.rsplit("/", 1)[-1].startswith(name) for line in maps.splitlines() if "/" in line
    )


def launched_as_nmt() -> bool:
    """This process is the `nmt` command (its script or `python -m nmt`), not a program that
    calls `nmt.cli.main` among other things: only the command may be run again."""
    program = Path(sys.argv[0])
    return program.name == "nmt" or program.parts[-2:] == ("nmt", "__main__.py")


def relaunch(command: bool = False) -> None:
    """Exec this command again with the allocator `wanted` preloaded, unless it is already
    loaded, none is wanted, this is not Linux, or this is neither the `nmt` command nor a
    `command` (a script of nmt's that runs whole, such as a benchmark: it runs on what nmt
    runs on). Returns only when nothing is to be done."""
    if not sys.platform.startswith("linux"):
        return
    if os.environ.get(DONE):  # the relaunched process
        named = os.environ.get(CHOICE, "")
        if named and named != "system" and not mapped(named):
            raise NMTError(
                f"{CHOICE}={named}: the dynamic loader could not load it (its message is "
                f"above); name an allocator library it finds, or a .so file, or set "
                f"{CHOICE}=system for glibc's malloc"
            )
        return
    if not (command or launched_as_nmt()):
        return
    library = wanted()
    if library is None or in_use() != "glibc":
        return
    env = dict(os.environ)
    env[DONE] = library
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc 2.33+): ten size_t counters."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_bytes() -> dict[str, int] | None:
    """What the allocator holds, by its own count: `in_use`, the bytes the program has
    allocated and not freed; `free`, freed bytes it keeps mapped for reuse (resident once
    touched). TCMalloc: `generic.current_allocated_bytes`, and its heap size less that and
    less the pages it has handed back (`tcmalloc.pageheap_unmapped_bytes`); glibc:
    `mallinfo2`'s arena and mmapped bytes in use, and its arenas' free chunks (resident or
    not: `malloc_trim` hands back their pages but they stay free chunks). None on another
    allocator or system. Resident memory beyond in_use + free is the program's code and what
    it maps itself."""
    if not sys.platform.startswith("linux"):
        return None
    process = ctypes.CDLL(None)
    read = getattr(process, "MallocExtension_GetNumericProperty", None)
    if read is not None:
        read.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
        values = {}
        names = "generic.current_allocated_bytes generic.heap_size tcmalloc.pageheap_unmapped_bytes"
        for name in names.split():
            value = ctypes.c_size_t(0)
            if not read(name.encode(), ctypes.byref(value)):
                return None
            values[name] = value.value
        used = values["generic.current_allocated_bytes"]
        mapped = values["generic.heap_size"] - values["tcmalloc.pageheap_unmapped_bytes"]
        return {"in_use": used, "free": max(0, mapped - used)}
    mallinfo2 = getattr(process, "mallinfo2", None)
    if mallinfo2 is not None and in_use() == "glibc":
        mallinfo2.restype = _Mallinfo2
        info = mallinfo2()
        return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}
    return None


def release_free_memory() -> bool:
    """Hand the allocator's free pages back to the kernel: TCMalloc's page heap
    (`MallocExtension_ReleaseFreeMemory`), else glibc's arenas (`malloc_trim`). Used around
    work that allocates in sizes the training step does not, such as validation: what it frees
    would otherwise stay resident beside the step's own free blocks. The pages fault in again
    when they are next used. Returns whether an allocator took the call (not with another
    allocator, such as jemalloc, whose heap neither call reaches)."""
    if not sys.platform.startswith("linux"):
        return False
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return True
    trim = getattr(process, "malloc_trim", None)
    if trim is not None and in_use() == "glibc":  # not another preloaded allocator's heap
        trim(0)
        return True
    return False
