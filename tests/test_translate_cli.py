"""End to end through the command line: `nmt translate`, `nmt evaluate` and `nmt average` (and
the CLI's start and exit) in subprocesses, on runs of the tiny recipes trained through the Python API once per session
(`tiny_run` keeps them in the session's throwaway NMT_CACHE_DIR, shared with test_search.py)."""

from __future__ import annotations

import collections
import gzip
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sacrebleu
import torch
from conftest import tiny_run

from nmt import checkpoint
from nmt.cpu import cpu_has_int8
from nmt.data.prepare import prepare
from nmt.special import UNK_ID
from nmt.translate import attention_of, load_model, search_options, translate_lines

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Outputs compared across calls or with the Python API are decoded in fp32: `auto` picks bf16 on
# CPUs with native bf16 (AVX512-BF16/AMX), and bf16 decoding gives other tokens than fp32.
FP32 = ("--precision", "fp32")
CPU = torch.device("cpu")


def nmt_cli(
    *args,
    stdin: str = "",
    cwd: Path | None = None,
    columns: str | None = "400",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,  # NMT_DATA_DIR and NMT_CACHE_DIR from the session fixture
        "COLUMNS": columns,
        "OMP_NUM_THREADS": "1",  # tiny models; a shared 2-core machine
        **(env or {}),
    }
    if columns is None:  # the width nmt picks by itself
        del env["COLUMNS"]
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr
    return result


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """Exit code 2, one line on stderr, no traceback, nothing on stdout."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr == lines[0] + "\n", result.stderr
    assert result.stdout == ""
    return lines[0]


def out_lines(text: str) -> list[str]:
    lines = text.split("\n")
    assert lines[-1] == ""  # every output line ends with a newline
    return lines[:-1]


def read_gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return out_lines(f.read())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(multi30k_dir, _one_thread) -> Path:
    """Tiny transformer, 160 steps; step checkpoints 80 and 120 kept."""
    run_dir, _ = tiny_run("transformer", 160)
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert steps == ["step-120.pt", "step-80.pt"]
    return run_dir


@pytest.fixture(scope="module")
def short_runs(multi30k_dir, _one_thread):
    """rnn_attention and seq2seq runs: enough for attention and its absence."""
    return lambda arch: tiny_run(arch, 40)[0]


@pytest.fixture(scope="module")
def english(multi30k_dir) -> list[str]:
    return read_gz_lines(multi30k_dir / "test_2016_flickr.en.gz")[:12]


@pytest.fixture(scope="module")
def long_line(multi30k_dir) -> str:
    """300 words: longer than any training sentence."""
    words = " ".join(read_gz_lines(multi30k_dir / "train.en.gz")[:60]).split()
    line = " ".join(words[:300])
    assert len(line.split()) == 300
    return line


@pytest.fixture(scope="module")
def file_translation(run, english, long_line, tmp_path_factory):
    """`nmt translate RUN --input F --output G`: (input lines, output lines)."""
    lines = [*english[:3], "", *english[3:6], "   ", *english[6:], long_line, ""]
    work = tmp_path_factory.mktemp("translate")
    src, out = work / "in.en", work / "out.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ok(nmt_cli("translate", run, "--input", src, "--output", out, *FP32))
    return lines, out_lines(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def api_translations(run, file_translation) -> list[tuple[str, float] | None]:
    """(text, score) of every input line translated alone through the Python API (fp32, the
    run's decode settings); None for empty lines."""
    lines, _ = file_translation
    loaded = load_model(run, CPU)
    d = loaded.config.decode
    out = []
    for line in lines:
        nbest = translate_lines(
            loaded.model, loaded.tokenizer, [line], search_options(d), d.batch_tokens, CPU, "fp32"
        )[0]
        out.append((nbest[0][0], nbest[0][1].score) if nbest else None)
    return out


def test_translate_file_one_line_per_line(file_translation, api_translations):
    lines, outputs = file_translation
    assert len(outputs) == len(lines)
    for line, output, expected in zip(lines, outputs, api_translations):
        if line.strip():
            assert output.strip(), f"no translation for {line!r}"
            # Translated in a batch of others, each line still gets its own translation.
            assert output == expected[0]
        else:
            assert expected is None
            assert output == ""


def test_translate_long_line(run, file_translation, api_translations, long_line):
    """A line longer than any training sentence translates like any other line."""
    loaded = load_model(run, CPU)
    train_split = prepare(loaded.config).split("train")
    assert len(loaded.tokenizer.encode_src([long_line])[0]) > train_split.src_lens.max()
    lines, outputs = file_translation
    i = lines.index(long_line)
    assert outputs[i] and outputs[i] == api_translations[i][0]


def test_translate_stdin_any_order_with_scores(run, file_translation, api_translations):
    """Shuffled lines through stdin -> stdout: every line gets the translation it got in file
    order (length-sorted batching does not leak into the output order); --scores appends a tab
    and the model score to every translated line, a tab and NA to an empty one (two columns
    on every row)."""
    lines, outputs = file_translation
    order = list(range(len(lines)))
    random.Random(0).shuffle(order)
    stdin = "\n".join(lines[i] for i in order) + "\n"
    result = ok(nmt_cli("translate", run, "--scores", *FP32, stdin=stdin))
    rows = out_lines(result.stdout)
    assert len(rows) == len(lines)
    for row, i in zip(rows, order):
        if not lines[i].strip():
            assert row == "\tNA"
            continue
        text, tab, score = row.rpartition("\t")
        assert tab == "\t"
        assert text == outputs[i]
        assert float(score) == pytest.approx(api_translations[i][1], abs=1e-4)
        assert float(score) < 0


def test_translate_nbest(run, english, file_translation):
    _, outputs = file_translation
    sentences = english[:4]
    result = ok(
        nmt_cli("translate", run, "--nbest", "3", "--beam", "3", *FP32, stdin="\n".join(sentences))
    )
    rows = out_lines(result.stdout)
    assert len(rows) == 3 * len(sentences)
    parsed = []
    for row in rows:
        m = re.fullmatch(r"(\d+) \|\|\| (.*) \|\|\| (-?\d+\.\d+)", row)
        assert m, row
        parsed.append((int(m.group(1)), m.group(2), float(m.group(3))))
    assert [i for i, _, _ in parsed] == [i for i in range(len(sentences)) for _ in range(3)]
    for i in range(len(sentences)):
        nbest = parsed[3 * i : 3 * i + 3]
        scores = [s for _, _, s in nbest]
        assert scores == sorted(scores, reverse=True)
        assert all(s < 0 for s in scores)
        # The recipe decodes with beam 3: the first of the 3-best is the plain translation.
        assert nbest[0][1] == outputs[i if i < 3 else i + 1]


@pytest.mark.parametrize("arch", ["transformer", "rnn_attention"])
def test_attention_plot(arch, run, short_runs, english, tmp_path):
    """The heatmap is the attention of the printed translation: one row per target piece
    and EOS, one column per source piece and EOS, each row a distribution."""
    run_dir = run if arch == "transformer" else short_runs(arch)
    png = tmp_path / "attention.png"
    result = ok(
        nmt_cli("translate", run_dir, *FP32, "--attention-plot", png, stdin=english[0] + "\n")
    )
    assert png.read_bytes()[:8] == PNG_MAGIC
    (printed,) = out_lines(result.stdout)  # the translation is printed as well
    loaded = load_model(run_dir, CPU)
    opts = search_options(loaded.config.decode, nbest=1)
    (text, hyp), *_ = translate_lines(
        loaded.model, loaded.tokenizer, [english[0]], opts, 10_000, CPU, "fp32"
    )[0]
    assert text == printed
    att = attention_of(loaded.model, loaded.tokenizer, english[0], hyp.tokens, CPU, "fp32")
    assert att.weights.shape == (
        len(hyp.tokens) + 1,
        len(loaded.tokenizer.src_pieces(english[0])) + 1,
    )
    assert att.weights.sum(1) == pytest.approx([1.0] * att.weights.shape[0], abs=1e-5)
    assert att.src_pieces[-1] == att.tgt_pieces[-1] == "</s>"


def test_attention_plot_without_attention(short_runs, english, tmp_path):
    png = tmp_path / "attention.png"
    result = nmt_cli(
        "translate", short_runs("seq2seq"), "--attention-plot", png, stdin=english[0] + "\n"
    )
    assert "no attention" in one_line_error(result)
    assert not png.exists()


@pytest.fixture(scope="module")
def split_evaluation(run, multi30k_dir):
    result = ok(nmt_cli("evaluate", run, "--json"))  # no --split: the first test split
    hyp_file = run / "translations" / "test_2016_flickr.de"
    refs = read_gz_lines(multi30k_dir / "test_2016_flickr.de.gz")
    return json.loads(result.stdout), hyp_file, refs


def sacrebleu_scores(hyps: list[str], refs: list[list[str]]) -> dict[str, float]:
    return {
        "bleu": sacrebleu.corpus_bleu(hyps, refs).score,
        "chrf": sacrebleu.corpus_chrf(hyps, refs).score,
        "ter": sacrebleu.corpus_ter(hyps, refs).score,
    }


def test_evaluate_split(split_evaluation):
    report, hyp_file, refs = split_evaluation
    assert report["n_sentences"] == 1000
    for metric in ("bleu", "chrf", "ter"):
        assert isinstance(report[metric]["score"], float)
        assert "nrefs:1" in report[metric]["signature"]
    # The hypotheses it wrote, scored by sacreBLEU itself against the raw test references.
    hyps = out_lines(hyp_file.read_text(encoding="utf-8"))
    assert len(hyps) == len(refs) == 1000
    expected = sacrebleu_scores(hyps, [refs])
    for metric, score in expected.items():
        assert report[metric]["score"] == pytest.approx(score, abs=1e-9), metric


@pytest.fixture
def files(split_evaluation, tmp_path):
    """hyp, ref, a second reference and a second system, as plain text files."""
    _, hyp_file, refs = split_evaluation
    hyps = out_lines(hyp_file.read_text(encoding="utf-8"))
    ref2 = [" ".join(r.split()[:-1]) for r in refs]  # another (shorter) reference
    other = [h if i % 2 else " ".join(h.split()[:3]) for i, h in enumerate(hyps)]
    paths = {}
    for name, lines in (("hyp", hyps), ("ref", refs), ("ref2", ref2), ("other", other)):
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths, {"hyp": hyps, "ref": refs, "ref2": ref2, "other": other}


def test_evaluate_files_equals_sacrebleu(files):
    paths, lines = files
    report = json.loads(
        ok(nmt_cli("evaluate", "--hyp", paths["hyp"], "--ref", paths["ref"], "--json")).stdout
    )
    assert report["n_sentences"] == 1000
    expected = sacrebleu_scores(lines["hyp"], [lines["ref"]])
    for metric, score in expected.items():
        assert report[metric]["score"] == pytest.approx(score, abs=1e-9), metric


def test_evaluate_table_prints_whole_signatures_into_a_pipe(files):
    paths, lines = files
    table = ok(nmt_cli("evaluate", "--hyp", paths["hyp"], "--ref", paths["ref"], columns=None))
    metrics = {
        "BLEU": sacrebleu.metrics.BLEU(),
        "CHRF": sacrebleu.metrics.CHRF(),
        "TER": sacrebleu.metrics.TER(),
    }
    for name, metric in metrics.items():
        metric.corpus_score(lines["hyp"], [lines["ref"]])
        assert str(metric.get_signature()) in table.stdout, name  # not cut at 80 columns


def test_evaluate_two_references_and_bootstrap(files):
    paths, lines = files
    n = 100
    result = ok(
        nmt_cli(
            "evaluate",
            "--hyp",
            paths["hyp"],
            "--ref",
            paths["ref"],
            "--ref",
            paths["ref2"],
            "--compare-hyp",
            paths["other"],
            "--bootstrap-samples",
            n,
            "--json",
        )
    )
    report = json.loads(result.stdout)
    expected = sacrebleu_scores(lines["hyp"], [lines["ref"], lines["ref2"]])
    for metric, score in expected.items():
        assert report[metric]["score"] == pytest.approx(score, abs=1e-9), metric
        assert "nrefs:2" in report[metric]["signature"]
    boot = report["bootstrap"]
    assert boot["n_samples"] == n
    other_bleu = sacrebleu.corpus_bleu(lines["other"], [lines["ref"], lines["ref2"]]).score
    for name, bleu in (("system", expected["bleu"]), ("compare", other_bleu)):
        for metric in ("bleu", "chrf"):
            r = boot[name][metric]
            assert r["ci_low"] <= r["score"] <= r["ci_high"], (name, metric, r)
            assert r["ci_low"] < r["ci_high"]
        assert boot[name]["bleu"]["score"] == pytest.approx(bleu, abs=1e-6)
    for metric in ("bleu", "chrf"):
        assert 0.0 <= boot["system"][metric]["p_value"] <= 1.0
        assert boot["compare"][metric]["p_value"] is None  # the baseline of the test


def test_evaluate_mismatched_line_counts(files, tmp_path):
    paths, lines = files
    short = tmp_path / "short.txt"
    short.write_text("\n".join(lines["ref"][:-1]) + "\n", encoding="utf-8")
    message = one_line_error(nmt_cli("evaluate", "--hyp", paths["hyp"], "--ref", short))
    assert str(paths["hyp"]) in message and str(short) in message
    assert "1000" in message and "999" in message


def test_evaluate_missing_file(files, tmp_path):
    paths, _ = files
    missing = tmp_path / "missing.txt"
    message = one_line_error(nmt_cli("evaluate", "--hyp", missing, "--ref", paths["ref"]))
    assert str(missing) in message


def test_evaluate_files_refuse_a_runs_options(files):
    """With --hyp nothing is translated: --split (a run's split) is refused as --beam is,
    not ignored."""
    paths, _ = files
    for option in (("--split", "test_2016_flickr"), ("--beam", "3")):
        args = ("evaluate", "--hyp", paths["hyp"], "--ref", paths["ref"], *option)
        message = one_line_error(nmt_cli(*args))
        assert f"{option[0]} set(s) how a run translates; with --hyp there is none" in message


def test_evaluate_refuses_before_it_decodes(run, files, tmp_path):
    """A run's split is scored against its own references: --ref was ignored without a
    word. Scoring options that cannot be honoured were refused only after the split was
    decoded and its translations written over the last ones; now before."""
    paths, _ = files
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    kept = copy / "translations" / "valid.de"
    kept.parent.mkdir(exist_ok=True)
    kept.write_text("keep\n")
    base = ("evaluate", copy, "--split", "valid")
    message = one_line_error(nmt_cli(*base, "--ref", paths["ref"]))
    assert "--ref scores --hyp files" in message and "drop --ref" in message
    for option, fragment in (
        (("--tokenize", "bogus"), "unknown --tokenize 'bogus'"),
        (("--compare-hyp", paths["hyp"]), "line counts differ: --compare-hyp"),
        (("--compare-hyp", paths["hyp"], "--bootstrap-samples", "0"), "--bootstrap-samples"),
    ):
        assert fragment in one_line_error(nmt_cli(*base, *option))
        assert kept.read_text() == "keep\n"  # nothing decoded, nothing written


def test_evaluate_names_files_as_they_are(files, tmp_path):
    """File names in the bootstrap table are text, not rich markup ("exp[lr=3e-4]" lost its
    brackets; a "[/b]" in a name was a MarkupError traceback); --hyp may be a pipe."""
    paths, lines = files
    odd = tmp_path / "exp[lr=3e-4]" / "out[/b].de"  # a folder "out[" holding "b].de"
    odd.parent.mkdir(parents=True)
    shutil.copy(paths["hyp"], odd)
    args = ("--ref", paths["ref"], "--compare-hyp", paths["other"], "--bootstrap-samples", "10")
    table = ok(nmt_cli("evaluate", "--hyp", odd, *args, columns="1000")).stdout
    assert str(odd) in table
    piped = nmt_cli(
        "evaluate",
        "--hyp",
        "/dev/stdin",
        "--ref",
        paths["ref"],
        "--json",
        stdin="\n".join(lines["hyp"]) + "\n",
    )
    report = json.loads(ok(piped).stdout)
    assert report["bleu"]["score"] == pytest.approx(
        sacrebleu_scores(lines["hyp"], [lines["ref"]])["bleu"]
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--precision", "fp64"), "unknown precision 'fp64'"),
        (("--beam", "0"), "beam size must be >= 1"),
        (("--patience", "0"), "invalid value for decode.patience: must be > 0"),
        (("--beam", "4", "--patience", "0.1"), "raise --patience"),
    ],
)
def test_evaluate_bad_decoding_options(run, args, fragment):
    assert fragment in one_line_error(nmt_cli("evaluate", run, "--split", "valid", *args))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--temperature", "0"), "--temperature must be > 0"),
        (("--temperature", "inf"), "--temperature must be > 0 and finite (got inf)"),
        (("--seed", str(2**64)), "--seed must be in [-2^63, 2^64)"),
        (("--top-p", "0"), "--top-p must be in (0, 1]"),
        (("--top-k", "-1"), "--top-k must be >= 0"),
    ],
)
def test_translate_bad_sampling_options(run, args, fragment):
    result = nmt_cli("translate", run, "--sample", *args, stdin="A man.\n")
    assert fragment in one_line_error(result)


def test_paired_bootstrap_takes_any_system_name(files):
    """A system called "baseline" keeps its own statistics (it once took the baseline's)."""
    from nmt.metrics import paired_bootstrap

    _, lines = files
    n = 200
    hyp, other, ref = lines["hyp"][:n], lines["other"][:n], lines["ref"][:n]
    base, systems = paired_bootstrap(hyp, {"baseline": other}, [ref], 50)
    assert base["bleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hyp, [ref]).score)
    assert systems["baseline"]["bleu"]["score"] == pytest.approx(
        sacrebleu.corpus_bleu(other, [ref]).score
    )
    assert base["bleu"]["p_value"] is None and systems["baseline"]["bleu"]["p_value"] is not None


def test_bleu_tokenizer_follows_the_target_language(files):
    from nmt import NMTError
    from nmt.metrics import score

    _, lines = files
    hyp, ref = lines["hyp"][:50], lines["ref"][:50]
    assert "tok:13a" in score(hyp, [ref], "de")["bleu"]["signature"]
    assert "tok:zh" in score(hyp, [ref], "zh")["bleu"]["signature"]
    try:
        import MeCab  # noqa: F401
    except ImportError:  # without sacreBLEU's extras: a clear error, not a wrong score
        with pytest.raises(NMTError, match=r"pip install 'sacrebleu\[ja\]'"):
            score(hyp, [ref], "ja")


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("translations", "step-*.pt"))
    return dest


class CustomDict(collections.OrderedDict):
    """Loading this needs the class: arbitrary code."""


class Custom:
    def __init__(self) -> None:
        self.weights = [1.0, 2.0]


@pytest.mark.parametrize("kind", ["garbage", "text", "truncated"])
def test_corrupt_checkpoint(run, tmp_path, kind):
    copy = copy_run(run, tmp_path / "run")
    best = copy / "checkpoints" / "best.pt"
    data = best.read_bytes()
    best.write_bytes(
        {
            "garbage": random.Random(0).randbytes(4096),
            "text": b"this is not a checkpoint\n" * 100,
            "truncated": data[: len(data) // 2],
        }[kind]
    )
    message = one_line_error(nmt_cli("translate", copy, stdin="A man.\n"))
    assert str(best) in message
    assert "arbitrary code" not in message  # corrupt, not dangerous


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_checkpoint_needing_code_is_refused(run, tmp_path, kind):
    copy = copy_run(run, tmp_path / "run")
    best = copy / "checkpoints" / "best.pt"
    if kind == "torch.save":
        payload = torch.load(best, map_location="cpu", weights_only=True)
        torch.save(CustomDict(payload), best)
    else:
        best.write_bytes(pickle.dumps(Custom(), protocol=2))
    message = one_line_error(nmt_cli("translate", copy, stdin="A man.\n"))
    assert str(best) in message
    assert "arbitrary code" in message


def test_average_last_checkpoints(run, english, tmp_path):
    ok(nmt_cli("average", run, "--last", "2", "--no-promote"))  # the shared run's best.pt stays
    ckpt_dir = run / "checkpoints"
    averaged = torch.load(ckpt_dir / "averaged.pt", map_location="cpu", weights_only=True)
    steps = [
        torch.load(ckpt_dir / f"step-{s}.pt", map_location="cpu", weights_only=True)["model"]
        for s in (80, 120)
    ]
    assert set(averaged["model"]) == set(steps[0])
    differing = 0
    for key, value in averaged["model"].items():
        a, b = steps[0][key], steps[1][key]
        if value.is_floating_point():
            torch.testing.assert_close(value, ((a.double() + b.double()) / 2).to(a.dtype))
            differing += not torch.equal(a, b)
        else:
            assert torch.equal(value, a)
    assert differing > 0  # the two checkpoints are different models

    # Translating with the averaged checkpoint = translating with the mean parameters.
    src = tmp_path / "in.en"
    src.write_text("\n".join(english[:5]) + "\n", encoding="utf-8")
    result = ok(nmt_cli("translate", ckpt_dir / "averaged.pt", "--input", src, *FP32))
    loaded = load_model(run, CPU)
    loaded.model.load_state_dict(
        {
            k: ((a.double() + steps[1][k].double()) / 2).to(a.dtype) if a.is_floating_point() else a
            for k, a in steps[0].items()
        }
    )
    d = loaded.config.decode
    expected = translate_lines(
        loaded.model, loaded.tokenizer, english[:5], search_options(d), d.batch_tokens, CPU, "fp32"
    )
    assert out_lines(result.stdout) == [nbest[0][0] for nbest in expected]

    # Written outside the run, the average still finds the run's tokenizer.
    elsewhere = tmp_path / "elsewhere" / "avg.pt"
    ok(nmt_cli("average", run, "--last", "2", "--output", elsewhere, "--no-promote"))
    moved = ok(nmt_cli("translate", elsewhere, "--input", src, *FP32))
    assert moved.stdout == result.stdout


# -- user errors on the command line: one line (or click's usage and one error line), exit 2


@pytest.mark.parametrize(
    "args",
    [
        ("translate", "RUN", "--bogus"),
        ("translate", "RUN", "--beam", "abc"),
        ("bogus",),
        ("train",),
    ],
)
def test_usage_errors_exit_2_without_a_traceback(run, args):
    result = nmt_cli(*[run if a == "RUN" else a for a in args])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("Error: ")


def test_translate_never_overwrites_its_input(run, english, tmp_path):
    src = tmp_path / "in.en"
    src.write_text(english[0] + "\n", encoding="utf-8")
    message = one_line_error(nmt_cli("translate", run, "-i", src, "-o", tmp_path / "." / "in.en"))
    assert "is the --input file" in message
    assert src.read_text(encoding="utf-8") == english[0] + "\n"


def test_the_attention_plot_never_replaces_the_input_or_the_translations(run, english, tmp_path):
    """--attention-plot is checked as --output is: the PNG was saved over the --input file
    (exit 0), and over --output's path the translations then replaced the plot."""
    src = tmp_path / "in.en"
    src.write_text(english[0] + "\n", encoding="utf-8")
    message = one_line_error(nmt_cli("translate", run, "-i", src, "--attention-plot", src))
    assert message.endswith(
        f"--attention-plot {src} is the --input file; write --attention-plot elsewhere"
    )
    out = tmp_path / "out.de"
    message = one_line_error(
        nmt_cli(
            "translate", run, "-i", src, "-o", out, "--attention-plot", tmp_path / "." / "out.de"
        )
    )
    assert "is the --output file" in message
    folder = tmp_path / "plots"
    folder.mkdir()
    message = one_line_error(nmt_cli("translate", run, "-i", src, "--attention-plot", folder))
    assert "--attention-plot" in message and "is a directory" in message
    assert src.read_text(encoding="utf-8") == english[0] + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "plots"]


def typed(run, lines: list[str], *args) -> subprocess.CompletedProcess:
    """nmt translate with `lines` typed at a terminal (a pseudo-terminal), then Ctrl-D."""
    import pty

    master, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", "translate", str(run), *FP32, *map(str, args)],
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"},
    )
    os.close(terminal)
    try:
        os.write(master, "".join(line + "\n" for line in lines).encode() + b"\x04")
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(master)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_closed_standard_input_is_one_line(run):
    """`nmt translate RUN <&-` (no standard input at all) was an AttributeError traceback."""
    closed = subprocess.run(
        ["sh", "-c", f'exec "{sys.executable}" -m nmt translate "{run}" <&-'],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
        timeout=300,
    )
    assert "standard input is closed: give --input FILE" in one_line_error(closed)


def test_typed_lines_keep_their_numbers_and_go_to_output(run, english, tmp_path):
    """At a terminal: the n-best ids count the typed lines (every line was 0), and with
    --output the lines typed up to Ctrl-D are written there (they went to the terminal, and
    the file was never written)."""
    lines = english[:2]
    piped = ok(nmt_cli("translate", run, *FP32, "--nbest", "2", stdin="\n".join(lines) + "\n"))
    session = ok(typed(run, lines, "--nbest", "2"))
    assert "interactive" in session.stderr
    assert out_lines(session.stdout) == out_lines(piped.stdout)
    assert [line.split(" ||| ")[0] for line in out_lines(session.stdout)] == ["0", "0", "1", "1"]
    target = tmp_path / "out.de"
    written = ok(typed(run, lines, "-o", target))
    assert written.stdout == "" and "interactive" not in written.stderr
    assert target.read_text(encoding="utf-8") == "".join(
        line + "\n" for line in translations(run, lines)
    )


def test_translate_output_paths_that_cannot_be_written(run, english, tmp_path):
    src = tmp_path / "in.en"
    src.write_text(english[0] + "\n", encoding="utf-8")
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "is a directory" in one_line_error(nmt_cli("translate", run, "-i", src, "-o", folder))
    missing = tmp_path / "nowhere" / "out.de"
    message = one_line_error(nmt_cli("translate", run, "-i", src, "-o", missing))
    assert f"cannot write --output {missing}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "in.en"]  # no temp files


def test_translate_input_that_is_not_utf8(run, tmp_path):
    latin1 = "A man.\nUn garçon.\n".encode("latin-1")
    src = tmp_path / "latin1.en"
    src.write_bytes(latin1)
    existing = tmp_path / "out.de"
    existing.write_text("keep me\n", encoding="utf-8")
    message = one_line_error(nmt_cli("translate", run, "-i", src, "-o", existing))
    assert f"{src}, line 2: bytes that are not UTF-8" in message
    assert existing.read_text(encoding="utf-8") == "keep me\n"
    piped = subprocess.run(
        [sys.executable, "-m", "nmt", "translate", str(run)],
        input=latin1,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert piped.returncode == 2 and b"Traceback" not in piped.stderr
    assert b"standard input, line 2: bytes that are not UTF-8" in piped.stderr


def test_ban_unk_flag_reaches_the_search(run, english, tmp_path):
    """A model whose output bias favours <unk> emits it (sentencepiece shows it as ⁇) with
    --allow-unk, on every line; --ban-unk removes it and still translates."""
    copy = copy_run(run, tmp_path / "run")
    best = copy / "checkpoints" / "best.pt"
    payload = checkpoint.load(best)
    payload["model"]["output.bias"][UNK_ID] += 30.0
    checkpoint.save(payload, best)
    stdin = "\n".join(english[:5]) + "\n"
    allowed = out_lines(ok(nmt_cli("translate", copy, *FP32, "--allow-unk", stdin=stdin)).stdout)
    assert len(allowed) == 5 and all("\u2047" in line for line in allowed)
    banned = out_lines(ok(nmt_cli("translate", copy, *FP32, "--ban-unk", stdin=stdin)).stdout)
    assert len(banned) == 5 and all(line and "\u2047" not in line for line in banned)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_interactive_translation_line_by_line_on_a_terminal(run):
    """stdin a terminal: each typed line is translated as it comes (same text as a file would
    give); a line that is not UTF-8 is reported and the session goes on to Ctrl-D."""
    expected = ok(nmt_cli("translate", run, *FP32, stdin="A dog runs.\n\nTwo men.\n")).stdout
    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", "translate", str(run), *FP32],
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(terminal)
    try:
        first = proc.stdout.readline() if os.write(controller, b"A dog runs.\n") else b""
        assert first.decode() == expected.splitlines(keepends=True)[0]  # before more is typed
        os.write(controller, "Un garçon.\n".encode("latin-1") + b"\nTwo men.\n\x04")
        out, errors = proc.communicate(timeout=600)
    finally:
        proc.kill()
        os.close(controller)
    assert proc.returncode == 0, errors.decode()
    assert (first + out).decode() == expected
    assert b"that line is not UTF-8 text; type it again" in errors
    assert b"Traceback" not in errors


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--sample", "--beam", "4"), "drop --beam and --nbest"),
        (("--sample", "--nbest", "2"), "drop --beam and --nbest"),
        (("--temperature", "0.5"), "add --sample"),
        (("--length-penalty", "-0.5"), "decode.length_penalty"),
        (("--no-repeat-ngram", "-1"), "decode.no_repeat_ngram"),
        (("--device", "tpu"), "unknown device 'tpu'"),
    ],
)
def test_translate_refuses_option_values_it_cannot_honour(run, args, fragment):
    assert fragment in one_line_error(nmt_cli("translate", run, *args, stdin="A man.\n"))


def test_translate_with_parallel_workers_equals_one_worker(run, multi30k_dir):
    """--workers 2 decodes two batches at once (small batches: many of them); the output is
    the same, line for line, as with one worker."""
    lines = read_gz_lines(multi30k_dir / "val.en.gz")[:48]
    lines[7] = ""
    stdin = "\n".join(lines) + "\n"
    args = ("translate", run, "--batch-tokens", "200", "--scores", *FP32)
    one = ok(nmt_cli(*args, "--workers", "1", stdin=stdin)).stdout
    two = ok(nmt_cli(*args, "--workers", "2", stdin=stdin)).stdout
    assert len(out_lines(two)) == len(lines) and out_lines(two)[7] == "\tNA"
    assert two == one
    assert "decode.workers" in one_line_error(nmt_cli(*args, "--workers", "-1", stdin=stdin))


def test_workers_split_the_threads(run):
    """--workers N: N batches at once, each with threads/N intra-op threads (seen in the
    debug log), and the output of one worker."""
    env = {"OMP_NUM_THREADS": "2", "NMT_DEBUG": "1"}
    stdin = "A dog runs.\nTwo men sit on a bench.\nA woman reads.\n"
    args = ("translate", run, "--batch-tokens", "30", *FP32)
    two = ok(nmt_cli(*args, "--workers", "2", stdin=stdin, env=env))
    one = ok(nmt_cli(*args, "--workers", "1", stdin=stdin, env=env))
    assert "3 batch(es) on cpu in fp32, 2 at once, 1 thread(s) each" in two.stderr
    assert "3 batch(es) on cpu in fp32, 1 at once, 2 thread(s) each" in one.stderr
    assert two.stdout == one.stdout


def test_many_lines_decode_in_a_child_process_as_in_threads(run, multi30k_dir, tmp_path):
    """From `HELPER_WORK` lines x beam (2,000 lines at beam 5), the second decoding worker
    hands its batches to a child process (`nmt.decode_process.helping`): it decodes some of
    them (debug log), and the output is line for line what one worker writes. Greedy search
    of as many lines, or one line fewer at beam 5, is too little work for a child."""
    from nmt.decode_process import HELPER_WORK

    lines = read_gz_lines(multi30k_dir / "train.en.gz")[: HELPER_WORK // 5]
    src = tmp_path / "in.en"
    src.write_text("\n".join(lines) + "\n")
    args = ("translate", run, "--input", src, "--beam", "5", "--scores", *FP32)
    two = ok(nmt_cli(*args, "--workers", "2", env={"NMT_DEBUG": "1"}))
    one = ok(nmt_cli(*args, "--workers", "1"))
    decoded = re.search(r"(\d+) batch\(es\) decoded in 1 decoding process", two.stderr)
    assert decoded and int(decoded.group(1)) > 0, two.stderr
    assert len(out_lines(two.stdout)) == len(lines)
    assert two.stdout == one.stdout
    greedy = ok(nmt_cli(*args, "--workers", "2", "--beam", "1", env={"NMT_DEBUG": "1"}))
    assert "decoded in 1 decoding process" not in greedy.stderr
    fewer = src.with_name("fewer.en")
    fewer.write_text("\n".join(lines[:-1]) + "\n")  # one line short: threads only
    two = ok(nmt_cli("translate", run, "--input", fewer, "--workers", "2", env={"NMT_DEBUG": "1"}))
    assert "decoded in 1 decoding process" not in two.stderr


def test_map_in_workers_hands_items_to_helpers_and_falls_back_when_one_is_gone():
    """A thread that took a helper calls it for its items (whichever items it is free for),
    the others call fn; a helper raising `HelperUnavailable` has its item, and the next
    ones of its thread, done by fn. Results and `done` stay in item order."""
    from nmt.translate import HelperUnavailable, map_in_workers

    calls: list[str] = []

    def helper(x):
        calls.append("helper")
        time.sleep(0.002)
        return -x

    def fn(x):
        calls.append("fn")
        time.sleep(0.002)
        return -x

    done: list[int] = []
    items = list(range(40))
    assert map_in_workers(fn, items, 2, done.append, None, [helper]) == [-x for x in items]
    assert done == items
    assert 0 < calls.count("helper") < 40 and calls.count("fn") > 0
    assert map_in_workers(fn, items, 1, None, None, [helper]) == [-x for x in items]  # 1: none

    gone = []

    def broken(x):
        gone.append(x)
        raise HelperUnavailable

    calls.clear()
    assert map_in_workers(fn, items, 2, None, None, [broken]) == [-x for x in items]
    assert len(gone) == 1 and calls.count("fn") == 40  # called once, never again


def test_map_in_workers_starts_the_costliest_items_first():
    """With a cost and several workers, items are handed to the pool (which starts them in
    that order) and reported to `done` costliest first, ties in item order; the results stay
    in item order. One worker keeps item order."""
    from nmt.translate import map_in_workers

    items = [3, 9, 1, 9, 5, 2, 7]
    done: list[int] = []
    costs = {x: x // 2 for x in items}  # 9 and 9 tie, 3 and 2 tie
    result = map_in_workers(lambda x: -x, items, 2, done.append, None, None, costs.__getitem__)
    assert result == [-x for x in items]
    assert done == [9, 9, 7, 5, 3, 2, 1]
    done.clear()
    assert (
        map_in_workers(lambda x: -x, items, 1, done.append, None, None, costs.__getitem__) == result
    )
    assert done == items


def test_a_helper_whose_process_cannot_start_leaves_the_batches_to_this_process(
    run, caplog, monkeypatch
):
    """A child that cannot load (here: told to expect other weights than the checkpoint's)
    makes its helper give up with a warning: every batch is decoded in this process, the
    same output."""
    import dataclasses

    from nmt.decode_process import Load, helping
    from nmt.engine import open_engine

    engine = open_engine([run], "nmt", CPU, "fp32")
    lines = ["A dog runs.", "Two men sit on a bench.", "A woman reads a book.", ""] * 6
    opts = search_options(engine.config.decode, beam=2, nbest=1)
    alone = engine.translate(lines, opts, 40, workers=2)
    of = Load.of
    monkeypatch.setattr(
        Load, "of", lambda *a, **k: dataclasses.replace(of(*a, **k), fingerprint="other")
    )
    with helping(engine, len(lines), opts, 2, helpers=1) as helpers:
        assert engine.helpers == helpers and len(helpers) == 1
        with caplog.at_level("WARNING", logger="nmt.decode_process"):
            helped = engine.translate(lines, opts, 40, workers=2)
    assert engine.helpers == []
    assert helped == alone
    assert helpers[0].gone and helpers[0].batches == 0
    assert "could not start" in caplog.text and "decoded in this process" in caplog.text


def test_a_compiled_engines_helper_compiles_its_child_with_the_first_batchs_settings(
    run, monkeypatch
):
    """The child a helper starts for a compiled engine (`open_engine(compile=True)`, as
    scripts/bench_decode.py --compile opens it) loads the run to decode through compiled code,
    warmed up with the search settings of the first batch it is handed (`Load.warm_up`); an
    eager engine's child loads it eagerly."""
    import nmt.decode_process as dp
    from nmt.engine import open_engine

    started = []

    class Child:  # a stand-in for the child process: what it was asked to load
        def __init__(self, loads, threads):
            started.append((loads, threads))

        def start(self, stop=None):
            return self

        def search(self, name, opts, src, stop=None):
            return [[] for _ in range(src.size(0))]

    monkeypatch.setattr(dp, "DecodeProcess", Child)
    engine = open_engine([run], "nmt", CPU, "fp32")
    assert not engine.compiled
    opts = search_options(engine.config.decode, beam=3, nbest=1)
    src = torch.tensor([[5, 6, 2]])
    for compiled in (False, True):
        started.clear()
        engine.compiled = compiled  # as open_engine(compile=True) marks it (not compiled here)
        assert dp.BatchHelper(engine, 1)(src, opts) == [[]]
        ((load,), threads) = started[0]
        assert threads == 1 and load.compile == compiled
        assert load.warm_up == (opts if compiled else None)
        assert load.checkpoint == engine.checkpoints[0] and load.precision == "fp32"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_a_helper_keeps_no_file_open_per_batch_and_stops_with_the_others(run):
    """Batches sent to a helper's child leave nothing open behind (a tensor sent through a
    pipe would stay a shared-memory file as long as it lives: one per batch, and the
    command's file limit after ~1,000); a set `stop` kills the child and raises
    SearchStopped, as a search in this process stops, also while the child starts."""
    import threading

    from nmt.decode_process import helping
    from nmt.engine import open_engine
    from nmt.search import SearchStopped
    from nmt.translate import source_batch

    engine = open_engine([run], "nmt", CPU, "fp32")
    opts = search_options(engine.config.decode, beam=2, nbest=1)
    ids = engine.tokenizer.encode_src(["A dog runs.", "Two men sit."])
    batches = [source_batch(ids) for _ in range(41)]  # kept, as a decode keeps its batches
    with engine.held(), helping(engine, 2, opts, 2, helpers=1) as (helper,):
        first = helper(batches[0], opts)
        assert first == engine.search(batches[0], opts)
        files = len(os.listdir("/proc/self/fd"))
        assert all(helper(src, opts) == first for src in batches[1:])
        assert len(os.listdir("/proc/self/fd")) <= files + 2
        stop = threading.Event()
        stop.set()
        with pytest.raises(SearchStopped):
            helper(batches[0], opts, stop)
        assert not helper.process.alive()
    with helping(engine, 2, opts, 2, helpers=1) as (starting,):  # stopped while it starts
        started = time.monotonic()
        with pytest.raises(SearchStopped):
            starting(batches[0], opts, stop)
        assert starting.process is None and not starting.gone
        assert time.monotonic() - started < 1.0  # not the ~1.5 s a child takes to load


@pytest.mark.parametrize(
    "sig, workers, code, message",
    [
        (signal.SIGINT, 1, 130, "interrupted"),
        (signal.SIGINT, 2, 130, "interrupted"),
        (signal.SIGTERM, 2, 143, "terminated"),
    ],
)
def test_interrupted_translation_exits_128_plus_signal_and_writes_nothing(
    run, multi30k_dir, tmp_path, sig, workers, code, message
):
    """Ctrl-C (SIGINT) or SIGTERM while translating a file: exit code 128 + signal and one
    line saying so (typer returned exit code 0 for Ctrl-C; SIGTERM killed the process and left
    its temporary file), no output file and no temporary file left."""
    src, out = tmp_path / "in.en", tmp_path / "out.de"
    # 3,400 lines x the tiny recipe's beam 3 >= HELPER_WORK: with 2 workers, one is a child
    src.write_text("\n".join(read_gz_lines(multi30k_dir / "train.en.gz")[:3400]) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["translate", run, "--input", src, "--output", out, "--workers", workers, *FP32]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", *map(str, args)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # as from a terminal: a test run started in the background (`cmd &` in a script)
        # ignores SIGINT, and its children would inherit that and never see Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tmp = out.with_name(f".{out.name}.tmp-{proc.pid}")
    deadline = time.monotonic() + 120
    while not tmp.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the output is opened just before decoding starts
    assert tmp.exists(), "translation finished or failed before it could be interrupted"
    time.sleep(0.5)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1] == message and "Traceback" not in stderr
    assert not out.exists() and not tmp.exists()


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing children `pid` has spawned (its resource tracker aside), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "sig, code, message", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_to_the_group_while_the_first_decoding_child_starts(
    run, multi30k_dir, tmp_path, sig, code, message
):
    """Ctrl-C on a terminal signals the whole process group, the decoding child with it, and
    may come while the child still imports torch: the child, the process' first spawn (which
    starts multiprocessing's resource tracker too), holds the signals blocked until it ignores
    them, so only the command answers, with its one line and no traceback of the child's."""
    src, out = tmp_path / "in.en", tmp_path / "out.de"
    src.write_text("\n".join(read_gz_lines(multi30k_dir / "train.en.gz")[:3400]) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["translate", run, "--input", src, "--output", out, "--workers", "2", *FP32]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", *map(str, args)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # a group of its own, signalled as a terminal signals one
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not spawned_children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    children = spawned_children(proc.pid)
    assert children, "no decoding child was started"
    time.sleep(0.3)  # importing torch: it takes the child ~1.5 s to load
    os.killpg(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.split() == [message], stderr  # no traceback, no warning of a child lost
    assert not out.exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)


def test_nbest_output_keeps_an_entry_for_every_input_line(run, english):
    rows = out_lines(
        ok(
            nmt_cli(
                "translate", run, "--nbest", "2", "--beam", "3", *FP32, stdin=f"{english[0]}\n\n"
            )
        ).stdout
    )
    assert [row.split(" ||| ")[0] for row in rows] == ["0", "0", "1"]
    assert rows[-1] == "1 |||  ||| 0.0000"


def test_damaged_tokenizer(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")
    for model in (copy / "tokenizer").glob("spm*.model"):
        model.write_bytes(model.read_bytes()[:1000])
    assert "is not a sentencepiece model" in one_line_error(
        nmt_cli("translate", copy, stdin="A man.\n")
    )


def test_attention_plot_is_written_at_the_path_given(run, english, tmp_path):
    target = tmp_path / "heatmap"  # no suffix: PNG, and matplotlib must not add ".png"
    ok(nmt_cli("translate", run, "--attention-plot", target, stdin=english[0] + "\n"))
    assert target.read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "heatmap.png").exists()
    svg = tmp_path / "heatmap.svg"  # a suffix matplotlib knows: that format
    ok(nmt_cli("translate", run, "--attention-plot", svg, stdin=english[0] + "\n"))
    assert b"<svg" in svg.read_bytes()[:2000]


def test_evaluate_empty_files_and_bootstrap_samples(files, tmp_path):
    paths, _ = files
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert "nothing to score" in one_line_error(nmt_cli("evaluate", "--hyp", empty, "--ref", empty))
    scored = [f"--hyp={paths['hyp']}", f"--ref={paths['ref']}", f"--compare-hyp={paths['other']}"]
    message = one_line_error(nmt_cli("evaluate", *scored, "--bootstrap-samples=0"))
    assert "--bootstrap-samples must be >= 1" in message


def test_average_refuses_bad_counts_and_directory_outputs(run, tmp_path):
    assert "--last must be >= 1" in one_line_error(nmt_cli("average", run, "--last", "-1"))
    message = one_line_error(nmt_cli("average", run, "--last", "2", "--output", tmp_path))
    assert "is a directory" in message
    assert list(tmp_path.iterdir()) == []  # nothing written into it
    missing = tmp_path / "no-run"
    message = one_line_error(nmt_cli("average", missing, "--last", "2"))
    assert message.endswith(f"no such run directory: {missing}")  # not "keeps 0 checkpoints"


def test_average_never_writes_over_a_step_checkpoint_or_an_input(run, tmp_path):
    """--output over one of the run's step checkpoints (an average without optimizer state
    that a later --last K averaged again: 0.75 and 0.25 of two saves, reported as their
    mean), a new file named as one, or one of the checkpoints averaged is refused, and
    nothing changes; a file in checkpoints/ named step-SOMETHING.pt is not taken for a
    save (its name was read as a step number: a traceback)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("translations"))
    ckpts = copy / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    step = ckpts / "step-80.pt"
    message = one_line_error(nmt_cli("average", copy, "--last", "2", "--output", step))
    assert message == (
        f"error: --output {step} is one of the checkpoints averaged; give another file name"
    )
    for name in ("step-120.pt", "step-200.pt", "step-final.pt"):
        message = one_line_error(
            nmt_cli("average", copy, "--checkpoint", step, "--output", ckpts / name)
        )
        assert "is named as the run's step checkpoints" in message
    outside = tmp_path / "mine.pt"
    shutil.copy(step, outside)
    message = one_line_error(
        nmt_cli("average", copy, "--checkpoint", outside, "--output", outside, "--no-promote")
    )
    assert "is one of the checkpoints averaged" in message
    assert outside.read_bytes() == before["step-80.pt"]
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before
    text = tmp_path / "notes.txt"  # any file not an nmt checkpoint: refused, kept
    text.write_text("mine\n")
    message = one_line_error(nmt_cli("average", copy, "--last", "2", "--output", text))
    assert message.endswith("exists and is not an nmt checkpoint; give another file name")
    assert text.read_text() == "mine\n"
    other = tmp_path / "other"  # another run's checkpoints: not this run's to write
    shutil.copytree(copy, other)
    message = one_line_error(
        nmt_cli(
            "average",
            copy,
            "--last",
            "2",
            "--output",
            other / "checkpoints" / "best.pt",
            "--no-promote",
        )
    )
    assert f"is in another run's checkpoints ({other.resolve()})" in message
    assert (other / "checkpoints" / "best.pt").read_bytes() == before["best.pt"]
    ok(nmt_cli("average", copy, "--last", "2", "--output", outside, "--no-promote"))
    assert checkpoint.load(outside)["averaged"] == [80, 120]  # an nmt checkpoint: replaced
    shutil.copy(step, ckpts / "step-final.pt")  # a user's copy, named so by hand
    ok(nmt_cli("average", copy, "--last", "2", "--no-promote"))
    assert checkpoint.load(ckpts / "averaged.pt")["averaged"] == [80, 120]


def main_with_probe(probe: str, *args, stdin: str = "") -> subprocess.CompletedProcess:
    """`nmt ARGS` through nmt.cli.main in a fresh Python whose last stderr line (written by an
    atexit handler, after main has returned) is `probe` evaluated there."""
    code = (
        "import atexit, gc, sys\n"
        f"atexit.register(lambda: print({probe}, file=sys.stderr))\n"
        "from nmt.cli import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def test_the_cli_leaves_its_objects_out_of_the_exit_collections(run, tmp_path):
    """main() freezes the garbage collector's objects as it returns, so Python's shutdown does
    not collect torch's objects (0.5-0.7 s of every command); the output is complete and
    atexit handlers still run."""
    out = tmp_path / "out.de"
    result = main_with_probe(
        "gc.get_freeze_count() > 0",
        *("translate", run, "--output", out, *FP32),
        stdin="A man.\n\nTwo dogs.\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "True"
    lines = out_lines(out.read_text(encoding="utf-8"))
    assert len(lines) == 3 and lines[1] == "" and lines[0] and lines[2]


def test_translating_does_not_import_datasets(run):
    """Only commands that prepare data need Hugging Face datasets (~0.7 s to import)."""
    result = main_with_probe("'datasets' in sys.modules", "translate", run, stdin="A man.\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "False"


def test_scoring_files_does_not_import_torch(tmp_path):
    """`nmt evaluate --hyp --ref` is sacreBLEU on text (nmt.metrics): no torch, no datasets."""
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a man rides a bike .\ntwo dogs\n", encoding="utf-8")
    ref.write_text("a man rides a bike .\ntwo dogs play\n", encoding="utf-8")
    probe = "'torch' in sys.modules, 'datasets' in sys.modules"
    result = main_with_probe(probe, "evaluate", "--hyp", hyp, "--ref", ref, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["n_sentences"] == 2
    assert result.stderr.strip().splitlines()[-1] == "False False"


def test_preparing_data_shows_no_datasets_progress_bars(tmp_path):
    """datasets' own progress bars and logs stay off (set through its environment variables
    before it is imported): `nmt prepare` prints its summary only."""
    quiet = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY")
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    env["NMT_CACHE_DIR"] = str(tmp_path / "cache")  # nothing cached: datasets does the work
    result = subprocess.run(
        [sys.executable, "-m", "nmt", "prepare", REPO / "recipes/tiny/transformer.yaml"]
        + ["--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "prepared en→de" in result.stderr
    assert "%|" not in result.stderr and "Map" not in result.stderr, result.stderr


# -- every decoding option changes the search as documented --------------------------------


@pytest.fixture(scope="module")
def val_lines(multi30k_dir) -> list[str]:
    return read_gz_lines(multi30k_dir / "val.en.gz")[:40]


def translations(run, lines: list[str], *options: str) -> list[str]:
    stdin = "\n".join(lines) + "\n"
    out = out_lines(ok(nmt_cli("translate", run, *FP32, *options, stdin=stdin)).stdout)
    assert len(out) == len(lines) * (1 if "--nbest" not in options else int(options[1]))
    return out


def pieces(run: Path, text: str) -> list[str]:
    return load_model(run, CPU).tokenizer.tgt.encode(text, out_type=str)


def test_beam_size_changes_the_search(run, val_lines):
    """Beam 1 is greedy; beam 4 finds other translations for some sentences, and as many
    n-best entries as asked for; both differ from the recipe's own beam (3) as they should."""
    greedy = translations(run, val_lines, "--beam", "1")
    beam4 = translations(run, val_lines, "--beam", "4")
    assert any(a != b for a, b in zip(greedy, beam4))
    nbest = translations(run, val_lines[:5], "--nbest", "4", "--beam", "4")
    assert [int(row.split(" ||| ")[0]) for row in nbest] == [i for i in range(5) for _ in range(4)]
    assert [row.split(" ||| ")[1] for row in nbest[::4]] == beam4[:5]


def test_sampling_follows_its_seed(run, val_lines):
    lines = val_lines[:20]
    one = translations(run, lines, "--sample", "--seed", "1")
    assert translations(run, lines, "--sample", "--seed", "1") == one  # reproducible
    assert translations(run, lines, "--sample", "--seed", "2") != one
    top1 = translations(run, lines, "--sample", "--top-k", "1", "--seed", "3")
    assert top1 == translations(run, lines, "--beam", "1")  # top-k 1 is greedy
    flat = translations(run, lines, "--sample", "--temperature", "5", "--seed", "1")
    assert flat != one  # a higher temperature: other samples from the same seed


def test_length_limits_and_penalty(run, val_lines):
    """--max-len-a 0 --max-len-b 3: at most 2 pieces before the forced EOS; a length penalty
    of 2 against 0 prefers longer translations."""
    short = translations(run, val_lines, "--max-len-a", "0", "--max-len-b", "3")
    assert all(len(pieces(run, line)) <= 2 for line in short)
    assert any(len(pieces(run, line)) == 2 for line in short)
    raw = translations(run, val_lines, "--length-penalty", "0", "--beam", "4")
    long = translations(run, val_lines, "--length-penalty", "2", "--beam", "4")
    assert raw != long
    total = sum(len(pieces(run, line)) for line in long)
    assert total > sum(len(pieces(run, line)) for line in raw)


def test_no_repeat_ngram(run, val_lines):
    plain = translations(run, val_lines, "--beam", "1")

    def repeats(line: str, n: int) -> bool:
        p = pieces(run, line)
        grams = [tuple(p[i : i + n]) for i in range(len(p) - n + 1)]
        return len(grams) != len(set(grams))

    assert any(repeats(line, 1) for line in plain)  # the toy model repeats itself
    blocked = translations(run, val_lines, "--beam", "1", "--no-repeat-ngram", "1")
    assert not any(repeats(line, 1) for line in blocked)


def test_precision_and_device(run, val_lines, tmp_path):
    """--precision bf16 decodes in bf16 (other scores than fp32); --device cpu is auto's
    choice here, and a device the machine lacks is refused in one line."""
    stdin = "\n".join(val_lines[:10]) + "\n"
    args = ("translate", run, "--scores", "--beam", "1")
    fp32 = ok(nmt_cli(*args, "--precision", "fp32", stdin=stdin, env={"NMT_DEBUG": "1"}))
    bf16 = ok(nmt_cli(*args, "--precision", "bf16", stdin=stdin, env={"NMT_DEBUG": "1"}))
    assert "on cpu in bf16" in bf16.stderr and "on cpu in fp32" in fp32.stderr
    assert fp32.stdout != bf16.stdout
    if cpu_has_int8():  # int8 linear maps: other scores, close to fp32's for the same tokens
        int8 = ok(nmt_cli(*args, "--precision", "int8", stdin=stdin, env={"NMT_DEBUG": "1"}))
        assert "on cpu in int8" in int8.stderr and int8.stdout != fp32.stdout
        src, tgt = tmp_path / "src.en", tmp_path / "tgt.de"
        src.write_text(stdin, encoding="utf-8")
        tgt.write_text(
            "".join(line.split("\t")[0] + "\n" for line in out_lines(fp32.stdout)), "utf-8"
        )

        def logprobs(precision: str) -> list[float]:
            scored = ok(nmt_cli("score", run, "--src", src, "--tgt", tgt, "--precision", precision))
            return [float(line.split("\t")[0]) for line in out_lines(scored.stdout)]

        exact, quantized = logprobs("fp32"), logprobs("int8")
        assert exact != quantized
        assert all(abs(q - e) < 0.02 * abs(e) for e, q in zip(exact, quantized, strict=True))
    cpu = ok(nmt_cli(*args, "--precision", "fp32", "--device", "cpu", stdin=stdin))
    assert cpu.stdout == fp32.stdout
    if not torch.cuda.is_available():
        message = one_line_error(nmt_cli(*args, "--device", "cuda", stdin=stdin))
        assert "device cuda asked for, but this machine has none" in message


# -- evaluate: its options and its output ---------------------------------------------------


def test_evaluate_translates_as_translate_does(run, split_evaluation, multi30k_dir):
    """The hypotheses `nmt evaluate RUN --split S` writes are `nmt translate`'s output for the
    same sources and settings; the default split is the first test split."""
    _, hyp_file, _ = split_evaluation
    sources = read_gz_lines(multi30k_dir / "test_2016_flickr.en.gz")
    translated = out_lines(
        ok(nmt_cli("translate", run, stdin="\n".join(sources) + "\n")).stdout
    )  # the run's settings, as evaluate uses them
    assert out_lines(hyp_file.read_text(encoding="utf-8")) == translated


def test_evaluate_options(run, multi30k_dir, tmp_path):
    copy = copy_run(run, tmp_path / "run")
    written = copy / "translations" / "valid.de"

    def evaluate(*options: str) -> tuple[dict, list[str]]:
        result = ok(nmt_cli("evaluate", copy, "--split", "valid", "--json", *options))
        return json.loads(result.stdout), out_lines(written.read_text(encoding="utf-8"))

    default, recipe_beam = evaluate(*FP32)
    assert default["n_sentences"] == 100 and "tok:13a" in default["bleu"]["signature"]
    greedy, beam1 = evaluate("--beam", "1", *FP32)
    assert beam1 != recipe_beam and greedy["bleu"]["score"] != default["bleu"]["score"]
    sources = read_gz_lines(multi30k_dir / "val.en.gz")[:100]
    stdin = "\n".join(sources) + "\n"
    assert beam1 == out_lines(
        ok(nmt_cli("translate", copy, "--beam", "1", *FP32, stdin=stdin)).stdout
    )
    _, bf16 = evaluate("--beam", "1", "--precision", "bf16")
    assert bf16 != beam1  # bf16: other translations
    zh, _ = evaluate("--tgt-lang", "zh", *FP32)
    assert "tok:zh" in zh["bleu"]["signature"]


def test_evaluate_on_sigterm_writes_its_translations_whole_or_not_at_all(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")
    written = copy / "translations" / "test_2016_flickr.de"
    written.parent.mkdir()
    written.write_text("from an earlier evaluation\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", "evaluate", str(copy), "--beam", "5", *FP32],
        env={**os.environ, "OMP_NUM_THREADS": "1", "NMT_DEBUG": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # the debug log says when decoding starts
        if "batch(es) on cpu" in line:
            break
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, errors = proc.communicate(timeout=120)
    assert proc.returncode == 143, errors
    assert errors.strip().splitlines()[-1] == "terminated"
    assert written.read_text() == "from an earlier evaluation\n"  # untouched, no half file
    assert [p.name for p in written.parent.iterdir()] == [written.name]


# -- average, version, default run directory ------------------------------------------------


def test_average_explicit_checkpoints_and_mismatches(run, short_runs, tmp_path):
    ckpts = run / "checkpoints"
    out = tmp_path / "mean.pt"
    ok(
        nmt_cli(
            "average",
            run,
            "--checkpoint",
            ckpts / "step-80.pt",
            "--checkpoint",
            ckpts / "last.pt",
            "--output",
            out,
            "--no-promote",
        )
    )
    mean = checkpoint.load(out)["model"]
    a = checkpoint.load(ckpts / "step-80.pt")["model"]
    b = checkpoint.load(ckpts / "last.pt")["model"]
    for key, value in mean.items():
        if value.is_floating_point():
            expected = (a[key].double() + b[key].double()) / 2  # by hand, not checkpoint.average
            assert torch.allclose(value.double(), expected, atol=1e-7), key
    assert "fewer than --last 5" in one_line_error(nmt_cli("average", run, "--last", "5"))
    other = short_runs("rnn_attention") / "checkpoints" / "last.pt"
    message = one_line_error(
        nmt_cli(
            "average",
            run,
            "--checkpoint",
            ckpts / "last.pt",
            "--checkpoint",
            other,
            "--output",
            tmp_path / "x.pt",
        )
    )
    assert "another model (arch rnn_attention against transformer)" in message
    assert not (tmp_path / "x.pt").exists()
    # another run's checkpoint averaged (alone) into this run: refused before anything is
    # written, so it never becomes this run's best.pt
    s2s = short_runs("seq2seq")
    before = {p.name: p.read_bytes() for p in (s2s / "checkpoints").iterdir()}
    message = one_line_error(nmt_cli("average", s2s, "--checkpoint", ckpts / "last.pt"))
    assert f"not of {s2s}'s model (arch transformer against seq2seq)" in message
    assert {p.name: p.read_bytes() for p in (s2s / "checkpoints").iterdir()} == before
    # an average written over the run's last.pt would leave nothing to resume from
    before = (ckpts / "last.pt").read_bytes()
    message = one_line_error(nmt_cli("average", run, "--last", "2", "--output", ckpts / "last.pt"))
    assert "is the run's last.pt (training resumes from it)" in message
    assert (ckpts / "last.pt").read_bytes() == before


def test_version_and_the_default_run_directory(tmp_path):
    import nmt

    assert ok(nmt_cli("--version")).stdout.strip() == f"nmt {nmt.__version__}"
    recipe = REPO / "recipes" / "tiny" / "transformer.yaml"
    ok(nmt_cli("prepare", recipe, cwd=tmp_path))
    assert (tmp_path / "runs" / "tiny_transformer" / "config.yaml").is_file()


def test_average_validates_a_run_trained_in_fp16_on_a_cpu(run, tmp_path):
    """A run trained in fp16 (on a GPU) is averaged and validated on a CPU in fp32: its
    validation asked for fp16, which computes on CUDA only, and nmt average said to choose
    another precision, an option it does not have, after writing averaged.pt."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("translations"))
    for path in (copy / "checkpoints").glob("*.pt"):  # as a GPU's fp16 run saves them
        payload = checkpoint.load(path)
        payload["config"]["train"]["precision"] = "fp16"
        checkpoint.save(payload, path)
    config_file = copy / "config.yaml"
    config_file.write_text(config_file.read_text().replace("precision: fp32", "precision: fp16"))
    result = ok(nmt_cli("average", copy, "--last", "2", "--device", "cpu"))
    assert "validation: loss" in result.stderr, result.stderr


def test_average_becomes_the_runs_model_when_it_validates_better(run, tmp_path):
    """nmt average validates the average as training validates a checkpoint; when it beats
    the run's best score it becomes best.pt (what `nmt translate RUN` loads), its record in
    the run's history; when it does not, best.pt stays."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("translations"))
    best = copy / "checkpoints" / "best.pt"
    before = best.read_bytes()
    same = ok(nmt_cli("average", copy, "--checkpoint", best, "--checkpoint", best))
    assert "stays the run's model" in same.stderr and best.read_bytes() == before  # not better
    last = copy / "checkpoints" / "last.pt"
    payload = checkpoint.load(last)
    payload["progress"]["best_value"] = -1.0  # any validation beats this recorded best
    checkpoint.save(payload, last)
    promoted = ok(nmt_cli("average", copy, "--last", "2"))
    assert "it is now" in promoted.stderr
    model = checkpoint.load(best)
    assert model["averaged"] == [80, 120] and model["progress"]["best_value"] > -1
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["averaged"] == [80, 120] and records[-1]["best"] is True
    assert checkpoint.load(last)["progress"]["history"][-1]["averaged"] == [80, 120]
