"""`nmt compare` end to end on the tiny recipes: seeds, ensembles, scores recomputed from the
written translations, figures checked against the runs' own records, reuse, budgets."""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from nmt import NMTError, checkpoint
from nmt.compare import describe_budget, parse_budget, plan
from nmt.run import RunDir

REPO = Path(__file__).resolve().parents[1]
RECIPES = [
    str(REPO / "recipes" / "tiny" / f"{a}.yaml")
    for a in ("seq2seq", "rnn_attention", "transformer")
]
SETS = [
    *("--set", "train.max_steps=8", "--set", "train.valid_every=4"),
    *("--set", "train.save_every=4", "--set", "train.average_last=2"),
    *("--set", "train.log_every=4"),
    *("--set", "train.valid_max_sentences=20", "--set", "data.limit_test=40"),
    *("--set", "decode.beam=2", "--set", "decode.max_len_b=3"),
]
SPLITS = ["test_2016_flickr", "test_2017_flickr"]


def nmt(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
    )


def compare(out: Path, *args: str) -> subprocess.CompletedProcess:
    return nmt("compare", RECIPES[0], RECIPES[2], "--out", out, *SETS, *args)


def lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return text[:-1].split("\n")


def references(multi30k_dir: Path, split: str) -> list[str]:
    with gzip.open(multi30k_dir / f"{split}.de.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:40]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """seq2seq and transformer, 2 seeds each, with ensembles and the papers' BLEU."""
    out = tmp_path_factory.mktemp("cmp") / "cmp"
    args = ("--seeds", "2", "--ensemble", "--lowercase", "--tokenize", "intl")
    first = compare(out, *args, "--bootstrap-samples", "100")
    assert first.returncode == 0, first.stderr[-3000:]
    return out, first, args


def test_seeds_train_distinct_runs_and_the_report_aggregates_them(seeded, multi30k_dir):
    out, first, _ = seeded
    assert first.stderr.count("training into") == 4
    report = json.loads((out / "report.json").read_text())
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == [
        "seq2seq",
        "transformer",
        "ensemble (all)",
        "seq2seq (ensemble of 2 seeds)",
        "transformer (ensemble of 2 seeds)",
    ]
    for name in ("seq2seq", "transformer"):
        runs = systems[name]["runs"]
        assert [r["seed"] for r in runs] == [1234, 1235] and systems[name]["seeds"] == [1234, 1235]
        assert len({r["run_dir"] for r in runs}) == 2
        for r in runs:  # each run trained its own seed
            cfg = checkpoint.load(Path(r["run_dir"]) / "checkpoints" / "last.pt")["config"]
            assert cfg["train"]["seed"] == r["seed"] and r["steps"] == 8
    for split in SPLITS:
        refs = references(multi30k_dir, split)
        for name, s in systems.items():
            per_run = []
            for r in s["runs"]:
                label = name.replace(" (", "-").replace(")", "").replace(" ", "-")
                if s["kind"] == "system":
                    label = f"{name}.seed{r['seed']}"
                hyps = lines(out / "translations" / f"{label}.{split}.de")
                bleu = sacrebleu.corpus_bleu(hyps, [refs]).score  # scored here, by sacreBLEU
                assert r["test"][split]["bleu"]["score"] == pytest.approx(bleu, abs=1e-9)
                lc = sacrebleu.corpus_bleu(
                    [h.lower() for h in hyps], [[x.lower() for x in refs]], tokenize="intl"
                ).score
                assert r["test"][split]["bleu_literature"]["score"] == pytest.approx(lc, abs=1e-9)
                per_run.append(bleu)
            b = s["test"][split]["bleu"]
            assert b["mean"] == pytest.approx(statistics.fmean(per_run), abs=1e-9)
            assert b["sd"] == pytest.approx(statistics.stdev(per_run) if len(per_run) > 1 else 0)
            assert (b["min"], b["max"]) == pytest.approx((min(per_run), max(per_run)))
        best = max(systems.values(), key=lambda s: s["test"][split]["bleu"]["mean"])
        assert [s["name"] for s in systems.values() if s["test"][split]["best"]] == [best["name"]]
        for s in systems.values():
            if s is not best:
                v = s["test"][split]["bleu"]["vs_best"]
                assert v["pairs"] == len(best["runs"]) * len(s["runs"])
                assert 0 <= v["significant"] <= v["best_better"] <= v["pairs"]
    md = (out / "report.md").read_text()
    assert "2 runs per system" in md and "Per seed:" in md and "no seed variance" not in md
    assert "BLEU as papers report it: sacreBLEU `nrefs:1|case:lc|eff:no|tok:intl" in md
    assert "run pairs, significantly" in md and "Total training compute" in md


def test_the_ensemble_rows_are_the_ensembles_translations(seeded, multi30k_dir):
    """The 'ensemble (all)' translations are `nmt translate RUN_A RUN_B`'s."""
    out, _, _ = seeded
    report = json.loads((out / "report.json").read_text())
    ensemble = next(s for s in report["systems"] if s["name"] == "ensemble (all)")
    with gzip.open(multi30k_dir / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        sources = f.read().splitlines()[:40]
    src = out / "src.en"
    src.write_text("\n".join(sources) + "\n")
    result = nmt("translate", *ensemble["members"], "--input", src)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == lines(
        out / "translations" / "ensemble-all.test_2016_flickr.de"
    )


def test_figures_show_every_seed_of_every_system(seeded):
    """Counted from the figures themselves, checked against the runs' own metrics files."""
    out, _, _ = seeded
    report = json.loads((out / "report.json").read_text())
    systems = [s for s in report["systems"] if s["kind"] == "system"]
    figures = report["figures"]
    for name in ("valid_bleu_vs_steps.png", "valid_bleu_vs_time.png"):
        assert set(figures[name]["bands"]) == {"seq2seq", "transformer"}
        for s in systems:
            counts = {
                len(
                    [
                        r
                        for r in RunDir(run["run_dir"]).metrics()
                        if r["kind"] == "valid" and "averaged" not in r
                    ]
                )
                for run in s["runs"]
            }
            assert figures[name]["series"][s["name"]] == min(counts) == 2
    for s in systems:
        steps = {
            len([r for r in RunDir(run["run_dir"]).metrics() if r["kind"] == "train"])
            for run in s["runs"]
        }
        assert figures["train_loss.png"]["series"][s["name"]] == min(steps)
    bars = figures["bleu_by_length.png"]
    assert bars == {s["name"]: len(report["length_buckets"]) for s in report["systems"]}
    heat = figures["attention_transformer.png"]
    assert heat["shape"] == [len(heat["y_labels"]), len(heat["x_labels"])]
    assert heat["x_labels"][-1] == heat["y_labels"][-1] == "</s>"
    assert "attention_seq2seq.png" not in figures and not (out / "attention_seq2seq.png").exists()
    for png in figures:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_a_second_compare_reuses_every_run(seeded):
    out, _, args = seeded
    before = json.loads((out / "report.json").read_text())
    second = compare(out, *args, "--bootstrap-samples", "100")
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("reusing finished run") == 4 and "training into" not in second.stderr
    again = json.loads((out / "report.json").read_text())
    for a, b in zip(before["systems"], again["systems"]):
        assert (
            a["test"]["test_2016_flickr"]["bleu"]["mean"]
            == (b["test"]["test_2016_flickr"]["bleu"]["mean"])
        )
    # other decoding settings train nothing again: a run's folder is named by what trains it
    third = compare(out, *args, "--bootstrap-samples", "20", "--set", "decode.beam=1")
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stderr.count("reusing finished run") == 4 and "training into" not in third.stderr
    assert json.loads((out / "report.json").read_text())["decode"]["beam"] == 1


def test_one_seed_reuses_nmt_trains_run_and_says_no_variance_was_measured(tmp_path):
    """A finished `nmt train` run of the same recipe and settings is reused, not trained
    again; with one seed the report says that no seed variance was measured, and gives
    bootstrap intervals."""
    trained = nmt("train", RECIPES[2], *SETS, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    result = nmt(
        "compare", RECIPES[2], "--out", "cmp", *SETS, "--bootstrap-samples", "50", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reusing finished run runs/tiny_transformer" in result.stderr
    assert "training into" not in result.stderr
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    (system,) = report["systems"]
    assert system["runs"][0]["run_dir"] == "runs/tiny_transformer"
    b = system["test"]["test_2016_flickr"]["bleu"]
    assert b["ci_low"] <= b["score"] <= b["ci_high"] and system["test"]["test_2016_flickr"]["best"]
    assert "no seed variance was measured" in (tmp_path / "cmp" / "report.md").read_text()


def test_a_minutes_budget_ends_every_run(tmp_path):
    out = tmp_path / "cmp"
    result = nmt(
        "compare", RECIPES[2], "--out", out, *SETS, "--budget", "0.003", "--bootstrap-samples", "20"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    run = report["systems"][0]["runs"][0]
    assert run["finished"] == "reached train.max_minutes=0.003" and run["steps"] >= 1
    assert report["budget_minutes"] == 0.003
    assert "Training budget: 0.003 minutes per run." in (out / "report.md").read_text()


def test_budgets_in_minutes_steps_and_tokens():
    assert parse_budget("30") == parse_budget("30min") == parse_budget("30m")
    assert [describe_budget(b) for b in ("30", "2000steps", "5Mtokens", "0.5")] == [
        "30 minutes",
        "2,000 steps",
        "5,000,000 target tokens",
        "0.5 minutes",
    ]
    assert "train.max_minutes=30.0" in parse_budget("30")
    steps = parse_budget("2000steps")
    assert "train.max_steps=2000" in steps and "train.max_minutes=null" in steps
    assert "train.max_tokens=5000000" in parse_budget("5Mtokens")
    assert "train.max_tokens=500000" in parse_budget("500ktokens")
    for bad in ("fast", "0", "2.5steps", "5Msteps", "-3"):
        with pytest.raises(NMTError, match="budget"):
            parse_budget(bad)
    systems = plan([Path(RECIPES[2])], Path("out"), [], parse_budget("300steps"), seeds=3)
    (system,) = systems
    assert [r.seed for r in system.runs] == [1234, 1235, 1236]
    assert {r.cfg.train.max_steps for r in system.runs} == {300}
    assert {r.cfg.train.max_minutes for r in system.runs} == {None}
    assert len({r.run_dir for r in system.runs}) == 3


def test_compare_without_test_sets_fails_before_training(tmp_path):
    out = tmp_path / "cmp"
    result = nmt("compare", RECIPES[0], "--out", out, "--set", "data.test=[]")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.test is empty" in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (out / "runs").exists()


def test_compare_refuses_bad_options_before_any_work(tmp_path):
    a_file = tmp_path / "report"
    a_file.write_text("keep\n")
    res = nmt("compare", RECIPES[0], "--out", a_file)
    assert res.returncode == 2 and "is a file" in res.stderr and a_file.read_text() == "keep\n"
    # a folder of the user's own: its report.md (notes) was replaced by the report
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("my notes\n")
    res = nmt("compare", RECIPES[0], "--out", notes)
    assert res.returncode == 2 and "holds a report.md or report.json nmt compare" in res.stderr
    assert [p.name for p in notes.iterdir()] == ["report.md"]
    assert (notes / "report.md").read_text() == "my notes\n"
    (notes / "report.json").write_text('"systems to try: transformer, rnn"')  # JSON, not ours
    res = nmt("compare", RECIPES[0], "--out", notes)
    assert res.returncode == 2 and "holds a report.md or report.json nmt compare" in res.stderr
    out = tmp_path / "cmp"
    for args, message in (
        (("--bootstrap-samples", "0"), "--bootstrap-samples must be >= 1"),
        (("--seeds", "0"), "--seeds must be >= 1"),
        (("--budget", "soon"), "bad --budget 'soon'"),
        (("--tokenize", "moses"), "unknown --tokenize 'moses'"),
    ):
        res = nmt("compare", RECIPES[0], "--out", out, *args)
        assert res.returncode == 2 and message in res.stderr, res.stderr
        assert res.stderr.strip().count("\n") == 0 and not out.exists()
    other = tmp_path / "other.yaml"
    other.write_text(Path(RECIPES[2]).read_text().replace("vocab_size: 1000", "vocab_size: 700"))
    res = nmt("compare", RECIPES[0], other, "--out", tmp_path / "cmp2", "--ensemble")
    assert res.returncode == 2 and "--ensemble needs systems that share one tokenizer" in res.stderr
    assert not (tmp_path / "cmp2").exists()


def test_system_names_stay_unique_and_tasks_must_match(tmp_path):
    from nmt.compare import compare as run_compare

    recipe = Path(RECIPES[2])
    copies = []
    for folder in ("a/tiny", "b/tiny"):
        (tmp_path / folder).mkdir(parents=True)
        copies.append(tmp_path / folder / recipe.name)
        copies[-1].write_text(recipe.read_text())
    names = [s.name for s in plan([recipe, *copies], tmp_path / "out", [], [])]
    assert names == ["transformer", "tiny-transformer", "tiny-transformer-2"]
    other = tmp_path / "fewer.yaml"  # the same test split, fewer of its sentences
    text = recipe.read_text()
    assert "  limit_valid: 100\n" in text
    other.write_text(text.replace("  limit_valid: 100\n", "  limit_valid: 100\n  limit_test: 50\n"))
    with pytest.raises(NMTError, match="different directions or test sets"):
        run_compare([recipe, other], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was trained


def test_systems_whose_names_give_one_file_label_keep_their_own_files():
    from nmt.compare import System, file_labels

    names = ["rnn+attn", "rnn-attn", "基线", "变体", "v1.2", "v1-2"]
    labels = file_labels([System(n, None, []) for n in names])
    assert list(labels.values()) == [
        "rnn-attn",
        "rnn-attn-2",
        "system",
        "system-2",
        "v1-2",
        "v1-2-2",
    ]


def test_figures_draw_text_as_given_and_cap_long_heatmaps(tmp_path):
    """A '$' in a sentence, a piece or a name is not math markup: an unmatched one made
    matplotlib raise, after every run had trained, and the report was never written. A long
    sentence's heatmap shrinks its cells to stay within MAX_INCHES a side."""
    import numpy as np
    from PIL import Image

    from nmt import plots

    title = "a: A man with a sign that says $5 is 50% off , was $10 ."
    drawn = plots.attention_heatmap(
        np.ones((2, 3)), ["$5", "$x$", "$"], ["$10", "</s>"], tmp_path / "a.png", title=title
    )
    assert drawn["x_labels"] == ["$5", "$x$", "$"] and drawn["y_labels"] == ["$10", "</s>"]
    series = {"$5 $x": [(0, 1.0), (1, 2.0)], "b$": [(0, 1.0)]}
    assert plots.curves(series, "x", "y", tmp_path / "c.png", title) == {"$5 $x": 2, "b$": 1}
    bands = plots.band_curves({"$a$": [[(0, 1.0)], [(0, 2.0)]]}, "x", "$y", tmp_path / "b.png")
    assert bands == {"series": {"$a$": 1}, "bands": ["$a$"]}
    bars = plots.grouped_bars(["1-10", "$"], {"$x": [1.0, math.nan]}, "x", "y", tmp_path / "g.png")
    assert bars == {"$x": 2}
    long = plots.attention_heatmap(
        np.random.rand(120, 257), [f"p{i}" for i in range(257)], ["t"] * 120, tmp_path / "l.png"
    )
    assert long["shape"] == [120, 257]
    cap = plots.MAX_INCHES * 120  # pixels at the figures' 120 dpi
    assert max(Image.open(tmp_path / "l.png").size) <= cap
    assert Image.open(tmp_path / "a.png").size == (480, 360)  # short ones as before


def test_report_numbers_are_finite(seeded):
    out, _, _ = seeded
    report = json.loads((out / "report.json").read_text())
    for s in report["systems"]:
        for split in SPLITS:
            for metric in ("bleu", "chrf"):
                m = s["test"][split][metric]
                assert all(math.isfinite(m[k]) for k in ("mean", "sd", "min", "max"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_run_trains_stops_compare_as_an_interruption(sig, tmp_path):
    """Ctrl-C (or SIGTERM) while one of the runs trains: it saves where it was and the
    comparison stops with 130 (143), saying how to go on; it exited 2 with "error:", the code
    of a user's mistake."""
    from conftest import start_nmt, wait_until

    out = tmp_path / "cmp"
    sets = ("--set", "train.max_steps=100000", "--set", "train.save_every=5")
    proc = start_nmt("compare", RECIPES[2], "--out", out, *sets)
    wait_until(lambda: any(out.glob("runs/*/checkpoints/step-5.pt")), proc, timeout=300)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, stderr
    assert "error:" not in stderr and "Traceback" not in stderr
    assert "run the same nmt compare command again to resume it" in stderr
    said = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert stderr.rstrip().endswith(said)
    (run,) = out.glob("runs/*")
    assert RunDir(run).state().kind == "resumable"
