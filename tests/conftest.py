"""Shared fixtures: real Multi30k data from ../shared/data, an isolated cache per session."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="session", autouse=True)
def _environment(tmp_path_factory: pytest.TempPathFactory):
    """Point the toolkit at the local corpus copy and a throwaway cache for the whole session."""
    cache = tmp_path_factory.mktemp("nmt-cache")
    old = {k: os.environ.get(k) for k in ("NMT_DATA_DIR", "NMT_CACHE_DIR", "HF_DATASETS_CACHE")}
    os.environ["NMT_DATA_DIR"] = str(DATA_DIR)
    os.environ["NMT_CACHE_DIR"] = str(cache)
    os.environ["HF_DATASETS_CACHE"] = str(cache / "hf")
    yield
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
