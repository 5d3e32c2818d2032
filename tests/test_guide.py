"""The newcomer's path: recipes/custom/example.yaml trains on a user's own files in each
format it documents, as written (only the size made tiny)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [  # the example's model and budget made tiny; its data keys are used as written
    *("--set", "tokenizer.vocab_size=300", "--set", "model.d_model=32"),
    *("--set", "model.heads=2", "--set", "model.ffn_dim=64"),
    *("--set", "model.enc_layers=1", "--set", "model.dec_layers=1"),
    *("--set", "train.max_steps=3", "--set", "train.max_minutes=null"),
    *("--set", "train.valid_every=3", "--set", "train.valid_max_sentences=10"),
    *("--set", "train.warmup_steps=1"),
]


def nmt(*args, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "300", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def corpus(multi30k_dir: Path, split: str, n: int) -> list[tuple[str, str]]:
    sides = []
    for lang in ("en", "de"):
        with gzip.open(multi30k_dir / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
            sides.append(f.read().splitlines()[:n])
    return list(zip(*sides))


@pytest.fixture(scope="module")
def user_files(multi30k_dir, tmp_path_factory) -> Path:
    """A user's corpus in data/: train, valid and test, as text, TSV and JSONL."""
    home = tmp_path_factory.mktemp("user")
    data = home / "data"
    data.mkdir()
    for split, source, n in (("train", "train", 600), ("valid", "val", 40), ("test", "val", 30)):
        pairs = corpus(multi30k_dir, source, n)
        (data / f"{split}.en").write_text("".join(en + "\n" for en, _ in pairs))
        (data / f"{split}.de").write_text("".join(de + "\n" for _, de in pairs))
        (data / f"{split}.tsv").write_text(
            "english\tgerman\n" + "".join(f"{en}\t{de}\n" for en, de in pairs)
        )
        (data / f"{split}.jsonl").write_text(
            "".join(json.dumps({"translation": {"en": en, "de": de}}) + "\n" for en, de in pairs)
        )
    shutil.copytree(REPO / "recipes" / "custom", home / "recipes" / "custom")
    return home


FORMATS = {
    "text": [],
    "tsv": [
        *("--set", "data.source=tsv", "--set", "data.train=data/train.tsv"),
        *("--set", "data.valid=data/valid.tsv", "--set", "data.test=[data/test.tsv]"),
        *("--set", "data.src_field=english", "--set", "data.tgt_field=german"),
    ],
    "jsonl": [
        *("--set", "data.source=jsonl", "--set", "data.train=data/train.jsonl"),
        *("--set", "data.valid=data/valid.jsonl", "--set", "data.test=[data/test.jsonl]"),
    ],
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_custom_example_recipe_trains_on_the_users_files(user_files, fmt):
    recipe = "recipes/custom/example.yaml"
    run = Path("runs") / f"custom_example_{fmt}"
    trained = nmt("train", recipe, "--run-dir", run, *TINY, *FORMATS[fmt], cwd=user_files)
    assert trained.returncode == 0, trained.stderr
    assert "reached train.max_steps=3" in trained.stderr
    translated = nmt("translate", run, stdin="A dog runs.\n", cwd=user_files)
    assert translated.returncode == 0 and translated.stdout.count("\n") == 1, translated.stderr
    scored = nmt("evaluate", run, "--json", cwd=user_files)
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["n_sentences"] == 30  # the test split, named "test"
    assert (user_files / run / "translations" / "test.de").is_file()


def test_the_default_run_directory_of_the_example(user_files):
    """Without --run-dir: runs/custom_example, as the recipe's header says."""
    trained = nmt("prepare", "recipes/custom/example.yaml", *TINY, cwd=user_files)
    assert trained.returncode == 0, trained.stderr
    assert (user_files / "runs" / "custom_example" / "config.yaml").is_file()
