"""Scoring: the paired bootstrap's p-values mean what they say."""

from __future__ import annotations

import gzip

import pytest

from nmt.metrics import paired_bootstrap


@pytest.fixture(scope="module")
def refs(multi30k_dir) -> list[str]:
    with gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:300]


def test_paired_bootstrap_p_values(refs):
    """Against a good system: a clearly worse one is significantly worse (p < 0.05 for BLEU
    and chrF); identical translations are not different at all (p = 1); a system that drops
    one word in one sentence of 300 is not significantly different."""
    good = [" ".join(r.split()[:-1]) if i % 3 == 0 else r for i, r in enumerate(refs)]
    worse = [" ".join(r.split()[:2]) for r in refs]
    near = [*good[:-1], " ".join(good[-1].split()[1:])]
    base, systems = paired_bootstrap(
        good, {"worse": worse, "same": list(good), "near": near}, [refs], 300, "de"
    )
    assert base["bleu"]["p_value"] is None
    for metric in ("bleu", "chrf"):
        assert systems["worse"][metric]["p_value"] < 0.05
        assert systems["same"][metric]["p_value"] == 1.0
        assert systems["near"][metric]["p_value"] > 0.05
        assert systems["worse"][metric]["ci_high"] < base[metric]["ci_low"]


def test_lines_lose_a_byte_order_mark_and_come_from_pipes(tmp_path):
    """A byte-order mark before the first line was part of the first hypothesis or reference
    (an exact copy scored BLEU 96.68); a pipe (`<(command)`, /dev/stdin) was "file not
    found", and so was a directory."""
    import os
    import threading

    from nmt import NMTError
    from nmt.metrics import read_text_lines, score, text_lines

    assert text_lines(b"\xef\xbb\xbfEin Hund.\r\nZwei Katzen.\n", "x") == [
        "Ein Hund.",
        "Zwei Katzen.",
    ]
    hyp = tmp_path / "hyp.de"
    hyp.write_bytes(b"\xef\xbb\xbf" + b"Ein Hund rennt.\nZwei Katzen schlafen.\n")
    refs = ["Ein Hund rennt.", "Zwei Katzen schlafen."]
    assert score(read_text_lines(hyp), [refs], "de")["bleu"]["score"] == pytest.approx(100)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a\nb\n"), daemon=True)
    writer.start()
    assert read_text_lines(fifo) == ["a", "b"]
    writer.join(timeout=30)
    with pytest.raises(NMTError, match="is a directory; give a file"):
        read_text_lines(tmp_path)
    with pytest.raises(NMTError, match="file not found"):
        read_text_lines(tmp_path / "nowhere.de")


def test_bleu_reads_a_language_code_with_region_or_script():
    """sacreBLEU knows "zh" only: "ZH", "zh-CN" and "zh_Hans" silently got the 13a tokenizer
    (BLEU 0.0 where zh gave 36.56)."""
    from nmt.metrics import bleu_metric, score

    for code in ("zh", "ZH", "zh-CN", "zh_Hans"):
        assert bleu_metric(code).tokenizer.signature() == "zh"
    result = score(["我爱北京天安门。"], [["我爱北京。"]], "zh-CN")
    assert result["bleu"]["score"] > 30


def test_a_tokenizer_that_cannot_download_its_model_is_one_line(tmp_path, monkeypatch):
    """flores101/200 download their sentencepiece model at first use: without the internet
    that was a URLError traceback (here: a real download from a closed local port)."""
    import socket

    import sacrebleu.tokenizers.tokenizer_spm as spm_tokenizers

    from nmt import NMTError
    from nmt.metrics import literature_bleu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(spm_tokenizers, "SACREBLEU_DIR", str(tmp_path))
    entry = dict(spm_tokenizers.SPM_MODELS["flores101"], url=f"http://127.0.0.1:{port}/x.model")
    monkeypatch.setitem(spm_tokenizers.SPM_MODELS, "flores101", entry)
    with pytest.raises(NMTError, match="--tokenize flores101 downloads its sentencepiece model"):
        literature_bleu(False, "flores101", "de")
