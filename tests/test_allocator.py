"""The allocator an `nmt` command runs on (nmt/allocator.py): TCMalloc where the machine has
it, glibc's malloc with NMT_MALLOC=system, a library of the user's choice otherwise."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nmt import allocator

TCMALLOC = ctypes.util.find_library(allocator.TCMALLOC)
needs_tcmalloc = pytest.mark.skipif(
    TCMALLOC is None or not sys.platform.startswith("linux"),
    reason="no TCMalloc here (Debian/Ubuntu: apt install libtcmalloc-minimal4)",
)


def malloc_of(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, str | None]:
    """Run `args` (an nmt command) with NMT_DEBUG and `env`; the allocator it logged."""
    base = {k: v for k, v in os.environ.items() if k not in (allocator.CHOICE, allocator.DONE)}
    base.pop("LD_PRELOAD", None)  # as a fresh shell starts it, whatever runs the tests
    done = subprocess.run(
        args,
        env={**base, "NMT_DEBUG": "1", "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [
        line.split("malloc: ", 1)[1].strip()
        for line in done.stderr.splitlines()
        if "malloc: " in line
    ]
    return done, said[0] if said else None


NMT = (sys.executable, "-m", "nmt", "evaluate", "--help")


@needs_tcmalloc
def test_a_command_runs_on_tcmalloc_where_the_machine_has_it():
    done, malloc = malloc_of(*NMT)
    assert done.returncode == 0, done.stderr
    assert malloc is not None and "tcmalloc" in malloc


def test_nmt_malloc_system_keeps_glibc():
    done, malloc = malloc_of(*NMT, NMT_MALLOC="system")
    assert done.returncode == 0, done.stderr
    assert malloc == "glibc"


def test_a_missing_allocator_library_is_refused_in_one_line(tmp_path):
    missing = tmp_path / "libnothing.so"
    done, _ = malloc_of(*NMT, NMT_MALLOC=str(missing))
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: NMT_MALLOC={missing}: no such file")
    )
    assert "Traceback" not in done.stderr


def test_an_allocator_the_loader_cannot_find_is_refused_in_one_line():
    """A soname the dynamic loader does not find: the loader says so and goes on without it,
    so the relaunched command checks its memory map (it ran on glibc's malloc, exit 0)."""
    done, _ = malloc_of(*NMT, NMT_MALLOC="libnothing-at-all.so.1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: NMT_MALLOC=libnothing-at-all.so.1: the dynamic loader could")


@needs_tcmalloc
def test_a_named_allocator_the_loader_finds_is_used():
    done, malloc = malloc_of(*NMT, NMT_MALLOC="libtcmalloc_minimal.so.4")
    assert done.returncode == 0, done.stderr
    assert malloc is not None and malloc.startswith("libtcmalloc_minimal.so.4")


@needs_tcmalloc
def test_a_program_that_calls_the_cli_is_not_run_again():
    """Only the `nmt` command itself relaunches: a program calling nmt.cli.main is left as it
    is (an exec would run the whole program again)."""
    code = "import sys; sys.argv = ['x', 'evaluate', '--help']; import nmt.cli; nmt.cli.main()"
    done, malloc = malloc_of(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert malloc == "glibc"


@needs_tcmalloc
def test_in_use_reads_the_allocator_from_the_memory_map():
    code = "from nmt import allocator; print(allocator.in_use())"
    for preload, expected in ((TCMALLOC, TCMALLOC), ("", "glibc")):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if preload:
            env["LD_PRELOAD"] = preload
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith(expected)  # the soname, or the file it names


@needs_tcmalloc
def test_benchmark_scripts_run_on_what_nmt_runs_on():
    """A benchmark script relaunches itself as the commands do, and says so in its machine
    facts: its figures are those of the commands it times."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    code = (
        f"import sys; sys.path.insert(0, {str(scripts)!r}); import _benchutil as bu; "
        "bu.on_nmts_allocator(); print(bu.machine_info()['malloc'])"
    )
    base = {k: v for k, v in os.environ.items() if k not in (allocator.CHOICE, allocator.DONE)}
    base.pop("LD_PRELOAD", None)
    for env, expected in (({}, "libtcmalloc"), ({allocator.CHOICE: "system"}, "glibc")):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith(expected)


RELEASE = """
import sys, torch
from nmt import allocator
{setup}
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
blocks = [torch.ones(1 << 20) for _ in range(300)]  # 300 tensors of 4 MB, each touched
del blocks
kept = rss()
took = allocator.release_free_memory()
print(took, kept, rss())
"""


def probe(code: str, env: dict[str, str]) -> str:
    """What the Python `code` prints, run in a fresh process with `env` (no preloaded library
    unless `env` names one)."""
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def released(env: dict[str, str], setup: str = "") -> tuple[bool, int, int]:
    took, kept, after = probe(RELEASE.format(setup=setup), env).split()
    return took == "True", int(kept), int(after)


@needs_tcmalloc
def test_tcmallocs_free_pages_go_back_to_the_kernel():
    took, kept, after = released({"LD_PRELOAD": TCMALLOC})
    assert took
    assert kept - after > 900, (kept, after)  # most of the 1.2 GB freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux")
def test_glibcs_kept_free_memory_goes_back_to_the_kernel():
    # tuned as nmt commands tune it: no mmap per large block, no trimming when blocks are freed
    took, kept, after = released({}, "from nmt.device import configure_host; configure_host()")
    assert took
    assert kept - after > 900, (kept, after)


HEAP = """
import json, torch
from nmt import allocator
{setup}
counts = [allocator.heap_bytes()]
blocks = [torch.ones(1 << 20) for _ in range(300)]  # 300 tensors of 4 MB, each touched
counts.append(allocator.heap_bytes())
del blocks
counts.append(allocator.heap_bytes())
allocator.release_free_memory()
counts.append(allocator.heap_bytes())
print(json.dumps(counts))
"""


def heap_counts(env: dict[str, str], setup: str = "") -> list[dict[str, int]]:
    """`allocator.heap_bytes()` in MB at the start, with 1.2 GB of tensors, after they are
    freed, and after the free pages are handed back."""
    counts = json.loads(probe(HEAP.format(setup=setup), env))
    return [{k: v >> 20 for k, v in c.items()} for c in counts]


@pytest.mark.parametrize(
    "env, setup, counts_release",
    [
        pytest.param({"LD_PRELOAD": TCMALLOC}, "", True, marks=needs_tcmalloc, id="tcmalloc"),
        pytest.param(
            {},
            "from nmt.device import configure_host; configure_host()",  # as nmt tunes glibc
            False,  # malloc_trim's pages handed back stay free chunks of glibc's arenas
            marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc"),
            id="glibc",
        ),
    ],
)
def test_the_allocators_count_of_what_is_in_use_and_what_is_kept_free(env, setup, counts_release):
    """What `bench_model --memory` reports: the tensors' bytes counted in use while they live,
    then as free memory the allocator keeps (glibc tuned by nmt all of it; TCMalloc hands
    pages back at its own pace, and kept 455 of the 1,200 MB), until it hands them back
    (TCMalloc's count says so; glibc's counts free chunks, their pages resident or not)."""
    start, live, freed, released = heap_counts(env, setup)
    assert live["in_use"] - start["in_use"] >= 1190, (start, live)
    assert abs(freed["in_use"] - start["in_use"]) < 20, (start, freed)
    assert freed["free"] - live["free"] >= 300, (live, freed)  # kept, not handed back
    if counts_release:
        assert released["free"] < 100, (freed, released)


def test_no_count_is_claimed_for_an_allocator_it_cannot_read(monkeypatch):
    if allocator.in_use() != "glibc" or not sys.platform.startswith("linux"):
        pytest.skip("the test runner itself runs on another allocator")
    monkeypatch.setattr(allocator, "in_use", lambda: "libjemalloc.so.2")
    assert allocator.heap_bytes() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux allocators")
def test_no_release_is_claimed_for_an_allocator_neither_call_reaches(monkeypatch):
    if allocator.in_use() != "glibc":
        pytest.skip("the test runner itself runs on another allocator")
    monkeypatch.setattr(allocator, "in_use", lambda: "libjemalloc.so.2")
    assert allocator.release_free_memory() is False
