"""`nmt compare` end to end on the three tiny recipes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = [
    str(REPO / "recipes" / "tiny" / f"{a}.yaml")
    for a in ("seq2seq", "rnn_attention", "transformer")
]
SETS = [
    "--set",
    "train.max_steps=12",
    "--set",
    "train.valid_every=6",
    "--set",
    "train.save_every=6",
    "--set",
    "train.average_last=2",
    "--set",
    "train.valid_max_sentences=20",
    "--set",
    "data.limit_test=60",
    "--set",
    "decode.beam=2",
    "--set",
    "decode.max_len_b=3",
]


def compare(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nmt",
            "compare",
            *RECIPES,
            "--out",
            str(out),
            *SETS,
            "--bootstrap-samples",
            "100",
        ],
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_compare_three_architectures_and_reuse(tmp_path):
    out = tmp_path / "cmp"
    first = compare(out)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("training into") == 3

    report = json.loads((out / "report.json").read_text())
    systems = report["systems"]
    assert [s["name"] for s in systems] == ["seq2seq", "rnn_attention", "transformer"]
    assert [s["arch"] for s in systems] == ["seq2seq", "rnn_attention", "transformer"]
    assert report["splits"] == ["test_2016_flickr", "test_2017_flickr"]
    for s in systems:
        assert s["params"] > 0 and s["steps"] == 12
        for key in ("train_minutes", "train_tokens_per_s", "decode_sentences_per_s"):
            assert math.isfinite(s[key]) and s[key] > 0, key
        for split in report["splits"]:
            for metric in ("bleu", "chrf"):
                m = s["test"][split][metric]
                assert all(math.isfinite(m[k]) for k in ("score", "ci_low", "ci_high"))
                assert m["ci_low"] <= m["ci_high"]
                assert 0 <= m["score"] <= 100
            p = s["test"][split]["bleu"]["p_value_vs_best"]
            assert (p is None) == s["test"][split]["best"]
        # Same test sets, same decoding: every system translated every test sentence.
        for split in report["splits"]:
            lines = (out / "translations" / f"{s['name']}.{split}.de").read_text().split("\n")
            assert len(lines) == 61 and lines[-1] == ""
    assert sum(s["test"]["test_2016_flickr"]["best"] for s in systems) == 1
    # train.average_last=2: the mean of steps 6 and 12 is validated last, and evaluated
    # exactly when its validation BLEU beats every single checkpoint's.
    for s in systems:
        *single, averaged = s["valid_history"]
        assert averaged["averaged"] == [6, 12] and [h["step"] for h in single] == [6, 12]
        wins = averaged["bleu"] > max(h["bleu"] for h in single)
        assert s["checkpoint"]["averaged"] == ([6, 12] if wins else None)
        assert s["best_valid_bleu"] == max(h["bleu"] for h in s["valid_history"])

    md = (out / "report.md").read_text()
    assert (
        md.count("| seq2seq | seq2seq |") == 2
        and "Example translations" in md
        and "**reference**" in md
        and "Checkpoints evaluated" in md
    )
    for png in (
        "valid_bleu_vs_time.png",
        "valid_bleu_vs_steps.png",
        "train_loss.png",
        "bleu_by_length.png",
        "attention_rnn_attention.png",
        "attention_transformer.png",
    ):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not (out / "attention_seq2seq.png").exists()  # no attention to draw

    second = compare(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("reusing finished run") == 3 and "training into" not in second.stderr
    again = json.loads((out / "report.json").read_text())
    for a, b in zip(systems, again["systems"]):
        assert (
            a["test"]["test_2016_flickr"]["bleu"]["score"]
            == b["test"]["test_2016_flickr"]["bleu"]["score"]
        )


def test_compare_without_test_sets_fails_before_training(tmp_path):
    out = tmp_path / "cmp"
    result = subprocess.run(
        [sys.executable, "-m", "nmt", "compare", RECIPES[0], "--out", str(out)]
        + ["--set", "data.test=[]"],
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.test is empty" in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (out / "runs").exists()


def test_compare_refuses_a_file_as_out_and_bad_bootstrap_samples(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "nmt", "compare", RECIPES[0], *args],
            env={**os.environ, "COLUMNS": "300"},
            capture_output=True,
            text=True,
            timeout=300,
        )

    a_file = tmp_path / "report"
    a_file.write_text("keep\n")
    res = run("--out", str(a_file))
    assert res.returncode == 2 and "is a file" in res.stderr and a_file.read_text() == "keep\n"
    res = run("--out", str(tmp_path / "cmp"), "--bootstrap-samples", "0")
    assert res.returncode == 2 and "--bootstrap-samples must be >= 1" in res.stderr
    assert not (tmp_path / "cmp").exists()


def test_system_names_stay_unique_and_tasks_must_match(tmp_path):
    from nmt import NMTError
    from nmt.compare import compare as run_compare
    from nmt.compare import plan

    recipe = Path(RECIPES[2])
    copies = []
    for folder in ("a/tiny", "b/tiny"):
        (tmp_path / folder).mkdir(parents=True)
        copies.append(tmp_path / folder / recipe.name)
        copies[-1].write_text(recipe.read_text())
    names = [s.name for s in plan([recipe, *copies], tmp_path / "out", [], None)]
    assert names == ["transformer", "tiny-transformer", "tiny-transformer-2"]
    other = tmp_path / "fewer.yaml"  # the same test split, fewer of its sentences
    text = recipe.read_text()
    assert "  limit_valid: 100\n" in text
    other.write_text(text.replace("  limit_valid: 100\n", "  limit_valid: 100\n  limit_test: 50\n"))
    with pytest.raises(NMTError, match="different directions or test sets"):
        run_compare([recipe, other], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was trained
