"""Scoring with sacreBLEU (BLEU, chrF, TER, paired bootstrap) and reading line-aligned text.
Without torch: `nmt evaluate --hyp --ref` starts in a fraction of a second."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import sacrebleu

from nmt import NMTError


def language(code: str | None) -> str:
    """The language of a code as sacreBLEU reads it: lowercase, without region or script
    ("zh-CN", "ZH", "zh_Hans": "zh"; sacreBLEU knows "zh" alone and gave the others 13a)."""
    return re.split(r"[-_]", (code or "").strip().lower())[0]


def bleu_metric(tgt_lang: str | None = None) -> sacrebleu.BLEU:
    """sacreBLEU's BLEU with the tokenizer it prescribes for the target language: 13a, but zh
    for Chinese and MeCab for Japanese and Korean (those two need sacreBLEU's extras)."""
    try:
        return sacrebleu.BLEU(trg_lang=language(tgt_lang))
    except RuntimeError:  # sacreBLEU's MeCab tokenizers are optional dependencies
        raise NMTError(
            f"BLEU on {tgt_lang} text needs sacreBLEU's tokenizer for it: "
            f"pip install 'sacrebleu[{tgt_lang}]'"
        ) from None


TOKENIZERS = ("13a", "intl", "none", "char", "zh", "ja-mecab", "ko-mecab", "flores101", "flores200")


def literature_bleu(lowercase: bool, tokenize: str | None, tgt_lang: str | None) -> sacrebleu.BLEU:
    """The BLEU that papers report (Multi30k: lowercased, tokenized), as a second metric beside
    sacreBLEU's default: `lowercase`, and `tokenize` one of sacreBLEU's tokenizers (default:
    the one it prescribes for `tgt_lang`). Its signature says both."""
    if tokenize is not None and tokenize not in TOKENIZERS:
        raise NMTError(f"unknown --tokenize {tokenize!r}; choose one of {', '.join(TOKENIZERS)}")
    lang = language(tgt_lang)
    try:
        return sacrebleu.BLEU(lowercase=lowercase, tokenize=tokenize, trg_lang=lang)
    except RuntimeError:
        which = tokenize or {"ja": "ja-mecab", "ko": "ko-mecab"}.get(lang, lang)
        raise NMTError(
            f"BLEU with the {which} tokenizer needs sacreBLEU's extras: "
            "pip install 'sacrebleu[ja,ko]'"
        ) from None
    except OSError as e:  # flores101/200 download their sentencepiece model at first use
        raise NMTError(
            f"--tokenize {tokenize} downloads its sentencepiece model at first use and could "
            f"not ({e}); run it once where the internet is reachable, or choose another"
        ) from None


def score(
    hyps: list[str],
    refs: list[list[str]],
    tgt_lang: str | None = None,
    literature: sacrebleu.BLEU | None = None,
) -> dict[str, Any]:
    """BLEU, chrF and TER with their sacreBLEU signatures. refs: one list per reference set;
    tgt_lang (an ISO code) picks BLEU's tokenizer. With `literature` (`literature_bleu`), also
    that BLEU, under its own key and signature ("bleu_literature"), never mixed with "bleu"."""
    for k, ref in enumerate(refs):
        if len(ref) != len(hyps):
            raise NMTError(
                f"line counts differ: {len(hyps)} hypotheses but reference {k + 1} has {len(ref)} lines"
            )
    if not hyps:
        raise NMTError("nothing to score: the hypotheses (and references) have no lines")
    out: dict[str, Any] = {"n_sentences": len(hyps)}
    metrics = [
        ("bleu", bleu_metric(tgt_lang)),
        ("chrf", sacrebleu.CHRF()),
        ("ter", sacrebleu.TER()),
    ]
    if literature is not None:
        metrics.append(("bleu_literature", literature))
    for name, metric in metrics:
        result = metric.corpus_score(hyps, refs)
        out[name] = {"score": float(result.score), "signature": str(metric.get_signature())}
    return out


def check_bootstrap_samples(n: int) -> None:
    if n < 1:  # sacreBLEU would quietly take its default of 1,000 for 0
        raise NMTError(f"--bootstrap-samples must be >= 1 (got {n})")


def paired_bootstrap(
    baseline: list[str],
    systems: dict[str, list[str]],
    refs: list[list[str]],
    n_samples: int = 1000,
    tgt_lang: str | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """sacreBLEU's paired bootstrap resampling: 95% CIs and p-values against `baseline`.

    Returns the baseline's and each system's statistics per metric: score, ci_low, ci_high,
    p_value (None for the baseline). Systems may have any names, "baseline" included.

    A system whose translations are the baseline's, line for line, gets p = 1: every resample
    differs by exactly 0, and sacreBLEU counts only strictly larger differences (a rule taken
    from multeval's randomization test, "a zero difference should not be attributed to
    chance"), which would give it the smallest p there is, 1/(n+1).
    """
    from sacrebleu.significance import PairedTest

    check_bootstrap_samples(n_samples)
    hyps = [baseline, *systems.values()]
    labels = [f"system {i}" for i in range(len(hyps))]  # the names are only sacreBLEU's
    metrics = {"bleu": bleu_metric(tgt_lang), "chrf": sacrebleu.CHRF()}
    test = PairedTest(
        list(zip(labels, hyps)), metrics, references=refs, test_type="bs", n_samples=n_samples
    )
    _, results = test()
    stats: list[dict[str, Any]] = [{} for _ in hyps]
    columns = [k for k in results if k != "System"]  # sacreBLEU's own metric names, in order
    for metric, column in zip(metrics, columns):
        for entry, res in zip(stats, results[column]):
            mean = float(res.mean) if res.mean is not None else float(res.score)
            ci = float(res.ci) if res.ci is not None else 0.0
            entry[metric] = {
                "score": float(res.score),
                "ci_low": mean - ci,
                "ci_high": mean + ci,
                "p_value": None if res.p_value is None else float(res.p_value),
            }
    for entry, system in zip(stats[1:], systems.values()):
        if list(system) == list(baseline):
            for metric in metrics:
                entry[metric]["p_value"] = 1.0
    return stats[0], dict(zip(systems, stats[1:]))


def text_lines(data: bytes, name: str) -> list[str]:
    """Lines of UTF-8 text, split at "\\n" only, so as many as `wc -l` counts (plus an
    unterminated last one); a "\\r" before the "\\n" is dropped, and a byte-order mark
    before the first line (it was scored as part of the first hypothesis or reference)."""
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise NMTError(
            f"{name}, line {line}: bytes that are not UTF-8; re-encode it (iconv -t UTF-8)"
        ) from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_text_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 file, or of a pipe (`<(command)`, /dev/stdin); see `text_lines`."""
    path = Path(path)
    if path.is_dir():
        raise NMTError(f"{path} is a directory; give a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NMTError(f"file not found: {path}") from None
    except OSError as e:
        raise NMTError(f"cannot read {path}: {e.strerror}") from None
    return text_lines(data, str(path))
