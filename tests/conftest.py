"""Shared fixtures: real Multi30k data from ../shared/data, an isolated cache per session;
and the helpers several test files use: the CLI in a subprocess (`run_nmt`, `start_nmt`,
`wait_until`) and a tiny transformer ready for training steps (`tiny_trainee`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nmt.config
from nmt.config import Config
from nmt.data.prepare import prepare
from nmt.run import attach
from nmt.train import train

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("NMT_DATA_DIR", REPO.parent / "shared" / "data")).resolve()
MULTI30K = DATA_DIR / "multi30k"


# Test files by the time they take, longest first (README's test command, on a 2-core machine
# much slower than a laptop: `python -m nmt` alone took 13-16 s there). pytest-xdist hands each
# worker whole files in this order (--no-loadscope-reorder; its own order is by number of tests,
# which put test_compare.py and test_docs.py, few tests of minutes each, among the last).
LONGEST_FIRST = (
    "test_serve.py",  # its `nmt serve --compile` test alone: 786 s to over 900 s there
    "test_train.py",
    "test_translate_cli.py",
    "test_compare.py",
    "test_docs.py",
    "test_search.py",
    "test_train_options.py",
    "test_guide.py",
    "test_export.py",
    "test_research.py",
    "test_run.py",
    "test_data.py",
    "test_allocator.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture(scope="session", autouse=True)
def _environment(tmp_path_factory: pytest.TempPathFactory):
    """Point the toolkit at the local corpus copy and a throwaway cache for the whole session;
    under pytest-xdist (README's test command: 2 workers), give each worker, and the processes
    its tests start, their share of the cores: torch's threads, OpenMP's (a training process of
    2 threads beside a busy worker took 72-81 s where 1 thread took 48 s) and inductor's
    compiling processes (each one imports torch again). A test that wants more says so in its
    process' environment."""
    import torch

    threads = torch.get_num_threads()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, threads // workers)
    torch.set_num_threads(share)
    cache = tmp_path_factory.mktemp("nmt-cache")
    env = {
        "NMT_DATA_DIR": str(DATA_DIR),
        "NMT_CACHE_DIR": str(cache),
        "HF_DATASETS_CACHE": str(cache / "hf"),
    }
    if workers > 1:
        env.update(OMP_NUM_THREADS=str(share), TORCHINDUCTOR_COMPILE_THREADS=str(share))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    torch.set_num_threads(threads)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.fail(f"Multi30k not found at {MULTI30K}; set NMT_DATA_DIR")
    return MULTI30K


def tiny_run(
    arch: str, steps: int, overrides: tuple[str, ...] = (), name: str | None = None
) -> tuple[Path, Config]:
    """recipes/tiny/ARCH.yaml trained for `steps` steps in fp32, step checkpoints every steps/4
    (the last 2 kept), with `overrides` on top (a variant, kept under `name`); trained once
    per session."""
    cfg = nmt.config.load(
        REPO / "recipes" / "tiny" / f"{arch}.yaml",
        [
            f"train.max_steps={steps}",
            f"train.valid_every={steps}",
            f"train.save_every={steps // 4}",
            "train.keep_last=2",
            "train.precision=fp32",
            *overrides,
        ],
    )
    run_dir = Path(os.environ["NMT_CACHE_DIR"]) / "test-runs" / f"{name or arch}-{steps}"
    if not (run_dir / "checkpoints" / "last.pt").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        attach(prepare(cfg), cfg, run_dir)
        assert train(cfg, run_dir).progress.step == steps
    return run_dir, cfg


# -- the CPU as the kernel lists it ------------------------------------------------------------


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (vendor_id, flags, ...) as the kernel
    lists them, an oracle independent of torch; empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the first processor's fields end
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags (`cpuinfo`'s flags)."""
    return set(cpuinfo().get("flags", "").split())


# -- the CLI in a subprocess ------------------------------------------------------------------


def run_nmt(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m nmt ARGS` to its end, output captured as text (a wide terminal: rich keeps
    a message on one line)."""
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_nmt(*args) -> subprocess.Popen:
    """`python -m nmt ARGS` started: stdout discarded, stderr piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "nmt", *map(str, args)],
        env={**os.environ, "COLUMNS": "400"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(condition, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Poll `condition()` until it holds; fail with `proc`'s stderr if it ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process ended first: {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- a tiny transformer for training steps ----------------------------------------------------


def tiny_trainee(train_config=None, precision: str = "fp32", batches: int = 4):
    """(Trainee, batches, config): a 1+1-layer d_model 32 transformer without dropout on
    recipes/tiny/transformer.yaml's data, seeded, its optimizer from `train_config` (default:
    the recipe's train section), and `batches` collated batches of 8 training pairs."""
    import numpy as np
    import torch

    from nmt.distributed import World
    from nmt.models.base import Vocab
    from nmt.models.configs import TransformerConfig
    from nmt.models.registry import build_model
    from nmt.train import Trainee, make_optimizer

    cfg = nmt.config.load(REPO / "recipes" / "tiny" / "transformer.yaml", ["model.dropout=0.0"])
    prepared = prepare(cfg)
    v = prepared.summary["vocab"]
    torch.manual_seed(0)
    model = build_model(
        "transformer",
        TransformerConfig(d_model=32, heads=2, enc_layers=1, dec_layers=1, ffn_dim=64, dropout=0),
        Vocab(v["src"], v["tgt"], v["joint"]),
    )
    optimizer = make_optimizer(model, train_config or cfg.train)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    trainee = Trainee(model, model, optimizer, scaler, precision, World())
    split = prepared.split("train")
    return trainee, [split.collate(np.arange(i * 8, i * 8 + 8)) for i in range(batches)], cfg
