"""README.md and docs/*.md cannot drift: every fenced block whose info string is
`bash runnable` is run, in order, in one workspace (the repository's recipes and scripts, a
small corpus in data/ for the custom example), and must exit 0.

The blocks are run as written but for what a test cannot afford, rewritten by the table
below: the Multi30k recipes become the tiny ones (same commands, same options; their run
directories follow), budgets of minutes become a few steps, and the installation lines are
skipped (the suite runs in the environment they create)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "export NMT_DATA_DIR")
TINY_MODEL = (
    "--set tokenizer.vocab_size=300 --set model.d_model=32 --set model.heads=2 "
    "--set model.ffn_dim=64 --set model.enc_layers=1 --set model.dec_layers=1"
)
SUBSTITUTIONS = [  # (pattern, replacement), applied in order
    (r"recipes/multi30k/equal/(\w+)\.yaml", r"recipes/tiny/\1.yaml"),
    (r"recipes/multi30k/transformer_marian\.yaml", "recipes/tiny/transformer_marian.yaml"),
    (r"recipes/multi30k/(\w+)\.yaml", r"recipes/tiny/\1.yaml"),
    (r"recipes/multi30k/\*\.yaml", "recipes/tiny/seq2seq.yaml recipes/tiny/transformer.yaml"),
    (r"runs/multi30k_(\w+)", r"runs/tiny_\1"),
    (r"train\.max_minutes=\d+(\.\d+)?", "train.max_steps=6"),
    (r"--budget \d+\b(?!\w)", "--budget 6steps --set data.limit_test=30"),
    (r"--seeds \d+", "--seeds 2"),
    (
        r"(nmt (?:train|prepare) recipes/custom/example\.yaml)",
        r"\1 " + TINY_MODEL + " --set train.max_steps=3 --set train.max_minutes=null",
    ),
]


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every `bash runnable` block of a Markdown file."""
    out, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash runnable":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append((start, "\n".join(body)))
        i += 1
    return out


def runnable(text: str) -> str:
    """The block as the test runs it (see the module docstring)."""
    commands = text.replace("\\\n", " ").splitlines()
    kept = [c for c in commands if c.strip() and not c.strip().startswith(SKIP)]
    script = "\n".join(kept)
    for pattern, replacement in SUBSTITUTIONS:
        script = re.sub(pattern, replacement, script)
    return script


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, multi30k_dir) -> Path:
    home = tmp_path_factory.mktemp("docs")
    for name in ("recipes", "scripts"):
        (home / name).symlink_to(REPO / name)
    data = home / "data"
    data.mkdir()
    for split, source, n in (("train", "train", 600), ("valid", "val", 40), ("test", "val", 30)):
        for lang in ("en", "de"):
            with gzip.open(multi30k_dir / f"{source}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()[:n]
            (data / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines))
    return home


ALL = [(path, line, text) for path in DOCS for line, text in blocks(path)]


def test_the_docs_have_runnable_blocks():
    assert len([b for b in ALL if b[0].name == "README.md"]) >= 3


@pytest.mark.parametrize(
    "path, line, text", ALL, ids=[f"{p.relative_to(REPO)}:{n}" for p, n, _ in ALL]
)
def test_a_documented_command_runs(workspace, path, line, text):
    script = runnable(text)
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=workspace,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert result.returncode == 0, f"{path.name}:{line}\n{script}\n{result.stderr[-3000:]}"
