"""What researchers ask of nmt beyond one model's translations: ensembles behind the model
contract, forced-decoding scores (`nmt score`), and BLEU as papers report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from conftest import tiny_run

from nmt import NMTError, config
from nmt.data.prepare import prepare
from nmt.models.ensemble import Ensemble
from nmt.run import attach
from nmt.search import SearchOptions, force_decode, search
from nmt.train import label_smoothed_loss, train
from nmt.translate import load_model, load_models, source_batch, source_mask

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


def cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs():
    """Two different tiny models that share a tokenizer, and one of another architecture."""
    return {
        "a": tiny_run("transformer", 160)[0],
        "b": tiny_run("transformer", 40)[0],
        "rnn": tiny_run("rnn_attention", 40)[0],
    }


@pytest.fixture(scope="module")
def sources(runs) -> list[list[int]]:
    cfg = load_model(runs["a"], CPU).config
    split = prepare(cfg).split("valid")
    return [split.src_ids(i).tolist() for i in range(12)]


def decode(model, sources, opts):
    src = source_batch(sources)
    return search(model, src, source_mask(src), opts)


@pytest.mark.parametrize(
    "opts",
    [
        SearchOptions(beam=4, nbest=3),
        SearchOptions(beam=1),
        SearchOptions(beam=1, sample=True, seed=3, top_k=5),
        SearchOptions(beam=3, ban_unk=True, no_repeat_ngram=2, max_len_a=0.5, max_len_b=2),
    ],
    ids=["beam-nbest", "greedy", "sampling", "constraints"],
)
def test_an_ensemble_of_a_model_with_itself_is_the_model(runs, sources, opts):
    model = load_model(runs["a"], CPU).model
    alone = decode(model, sources, opts)
    twice = decode(Ensemble([model, model]), sources, opts)
    assert [[h.tokens for h in n] for n in twice] == [[h.tokens for h in n] for n in alone]
    for x, y in zip(twice, alone):
        assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-4)


@pytest.mark.parametrize("other", ["b", "rnn"])
def test_an_ensembles_scores_are_the_mean_of_its_members(runs, sources, other):
    """Forced decoding of one target: the ensemble's log-prob of every token is the mean of
    its members' (across architectures too); its beam search runs on the mixed state."""
    a, b = load_model(runs["a"], CPU).model, load_model(runs[other], CPU).model
    ensemble = Ensemble([a, b])
    (hyp,), *_ = decode(ensemble, sources[:1], SearchOptions(beam=3, nbest=1))
    src = source_batch(sources[:1])
    mixed, attention = force_decode(ensemble, src, source_mask(src), hyp.tokens)
    each = [force_decode(m, src, source_mask(src), hyp.tokens)[0] for m in (a, b)]
    assert mixed == pytest.approx(list(np.mean(each, axis=0)), abs=1e-5)
    assert sum(mixed) == pytest.approx(hyp.logprob, abs=1e-4)  # what the search ranked
    assert attention.shape == (len(hyp.tokens) + 1, src.size(1))


def test_an_ensemble_takes_sentences_into_a_running_search(runs, sources):
    """In-flight batching (`BeamStream`) of an ensemble across architectures: each member's
    state is joined by the member (`join`), and every sentence gets the n-best it gets
    decoded alone."""
    from test_search import stream_decode

    ensemble = Ensemble([load_model(runs["a"], CPU).model, load_model(runs["rnn"], CPU).model])
    opts = SearchOptions(beam=3, nbest=2)
    got, most = stream_decode(ensemble, sources[:10], opts, [2, 0, 3, 1, 0, 2])
    assert most >= 3
    for source, hyps in zip(sources[:10], got):
        (alone,) = decode(ensemble, [source], opts)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)


def test_ensembled_runs_share_one_tokenizer(runs, tmp_path):
    cfg = config.load(
        REPO / "recipes" / "tiny" / "transformer.yaml",
        ["tokenizer.vocab_size=600", "train.max_steps=2", "train.valid_bleu=false"],
    )
    other = tmp_path / "other"
    attach(prepare(cfg), cfg, other)
    train(cfg, other)
    with pytest.raises(NMTError, match="vocabulary has 600 pieces, not 1,000"):
        load_models([runs["a"], other], CPU)
    result = cli("translate", runs["a"], other, stdin="A dog.\n")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"cannot ensemble {other}" in result.stderr
    # One vocabulary: the ensemble translates, through the CLI too.
    result = cli(
        "translate", runs["a"], runs["rnn"], "--beam", "2", "--precision", "fp32", stdin="A dog.\n"
    )
    assert result.returncode == 0 and result.stdout.count("\n") == 1, result.stderr


def test_score_is_minus_the_training_loss(runs, tmp_path):
    """`nmt score` on references: its per-line log-probs sum to minus the loss training
    computes on the same pairs (no label smoothing); empty and over-long lines get a status,
    lines keep their order; several runs score with the mean of their log-probs."""
    loaded = load_model(runs["a"], CPU)
    split = prepare(loaded.config).split("valid")
    n = 20
    src, tgt = split.texts("src")[:n], split.texts("tgt")[:n]
    batch = split.collate(np.arange(n))
    with torch.no_grad():
        logits = loaded.model(batch.src, batch.src_mask, batch.tgt_in)
    loss = float(label_smoothed_loss(logits, batch.tgt_out, 0.0))
    (tmp_path / "s.en").write_text("\n".join([*src, "", "word " * 90]) + "\n")
    (tmp_path / "s.de").write_text("\n".join([*tgt, "leer", "Wort " * 90]) + "\n")
    args = ["--src", tmp_path / "s.en", "--tgt", tmp_path / "s.de", "--precision", "fp32"]
    result = cli("score", runs["a"], *args, "--max-len", "80", "--format", "jsonl")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in rows] == list(range(1, n + 3))
    assert sum(r["logprob"] for r in rows[:n]) == pytest.approx(-loss, rel=1e-5)
    assert [r["tokens"] for r in rows[:n]] == [int(x) + 1 for x in split.tgt_lens[:n]]
    assert rows[n]["status"] == "empty" and rows[n + 1]["status"] == "too long"
    assert rows[n]["logprob"] is None
    tsv = cli("score", runs["a"], *args, "--max-len", "80")
    first = tsv.stdout.splitlines()[0].split("\t")
    assert float(first[0]) == pytest.approx(rows[0]["logprob"], abs=1e-5) and first[4] == "ok"
    both = cli("score", runs["a"], runs["b"], *args, "--format", "jsonl")
    single_b = cli("score", runs["b"], *args, "--format", "jsonl")
    mixed = [json.loads(line)["logprob"] for line in both.stdout.splitlines()][:n]
    mine = [r["logprob"] for r in rows[:n]]
    theirs = [json.loads(line)["logprob"] for line in single_b.stdout.splitlines()][:n]
    assert mixed == pytest.approx(list(np.mean([mine, theirs], axis=0)), abs=1e-4)
    bad = cli("score", runs["a"], "--src", tmp_path / "s.en", "--tgt", REPO / "README.md")
    assert bad.returncode == 2 and "line counts differ" in bad.stderr
    # normalised as `nmt translate --length-norm plain --length-penalty 0.3` would: |y|^0.3
    plain = cli(
        "score",
        runs["a"],
        *args,
        "--format",
        "jsonl",
        "--length-norm",
        "plain",
        "--length-penalty",
        "0.3",
    )
    assert plain.returncode == 0, plain.stderr
    for row, mine in zip(map(json.loads, plain.stdout.splitlines()[:n]), rows[:n], strict=True):
        assert row["logprob"] == pytest.approx(mine["logprob"], rel=1e-6)
        assert row["normalized"] == pytest.approx(row["logprob"] / row["tokens"] ** 0.3, rel=1e-6)
    before = (tmp_path / "s.de").read_bytes()
    for given in ("s.de", "s.en"):  # the scores never replace the lines they score
        bad = cli("score", runs["a"], *args, "-o", tmp_path / given)
        option = "--tgt" if given == "s.de" else "--src"
        assert bad.returncode == 2 and f"is the {option} file" in bad.stderr, bad.stderr
    assert (tmp_path / "s.de").read_bytes() == before


def test_scores_take_no_search_settings(runs):
    """Forced decoding scores given translations: a run whose n-best and patience could not
    go together in a search (beam 5, n-best 5, patience 0.5) is scored as any other (it
    was refused with "raise --patience", an option nmt score does not have)."""
    import dataclasses

    from nmt.forced import score_pairs

    loaded = load_model(runs["a"], CPU)
    split = prepare(loaded.config).split("valid")
    src, tgt = split.texts("src")[:8], split.texts("tgt")[:8]
    d = loaded.config.decode
    odd = dataclasses.replace(d, beam=5, nbest=5, patience=0.5)
    args = (loaded.tokenizer, src, tgt)
    plain = score_pairs([loaded.model], *args, d, 4096, CPU, "fp32")
    scored = score_pairs([loaded.model], *args, odd, 4096, CPU, "fp32")
    assert [p.normalized for p in scored] == [p.normalized for p in plain]
    assert all(p.status == "ok" for p in scored)


def test_bleu_as_papers_report_it(tmp_path, multi30k_dir):
    import gzip

    with gzip.open(multi30k_dir / "val.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()[:200]
    hyps = [" ".join(r.split()[::-1][:8]).upper() if i % 4 == 0 else r for i, r in enumerate(refs)]
    (tmp_path / "h").write_text("\n".join(hyps) + "\n")
    (tmp_path / "r").write_text("\n".join(refs) + "\n")
    result = cli(
        "evaluate", "--hyp", tmp_path / "h", "--ref", tmp_path / "r", "--lowercase",
        "--tokenize", "intl", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    lower = sacrebleu.corpus_bleu(
        [h.lower() for h in hyps], [[r.lower() for r in refs]], tokenize="intl"
    )
    assert report["bleu_literature"]["score"] == pytest.approx(lower.score, abs=1e-9)
    assert "case:lc" in report["bleu_literature"]["signature"]
    assert "tok:intl" in report["bleu_literature"]["signature"]
    default = sacrebleu.corpus_bleu(hyps, [refs])  # the default BLEU is not touched
    assert report["bleu"]["score"] == pytest.approx(default.score, abs=1e-9)
    assert report["bleu"]["score"] != report["bleu_literature"]["score"]
    bad = cli("evaluate", "--hyp", tmp_path / "h", "--ref", tmp_path / "r", "--tokenize", "moses")
    assert bad.returncode == 2 and "unknown --tokenize 'moses'" in bad.stderr
