"""Data pipeline: every source kind, the verified downloader, cleaning, the sentencepiece
tokenizer, the prepared-data cache, token-budget batching, and `nmt prepare` on bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from nmt import NMTError
from nmt.config import Config, DataConfig, from_dict
from nmt.data.batching import EncodedSplit, TokenBatches
from nmt.data.prepare import Prepared, prepare, prepared_dir, split_names
from nmt.data.sources import MULTI30K, corpus_file, load_split
from nmt.data.tokenizer import BATCH_CALL, JOINT, SRC, TGT
from nmt.run import attach
from nmt.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny" / "transformer.yaml"
LANGS = ("en", "de")
M30K_FILES = [f"{s}.{lang}.gz" for s in ("train", "val", "test_2016_flickr") for lang in LANGS]
N_TRAIN, N_VALID, N_TEST = 300, 30, 30


# -- helpers ---------------------------------------------------------------------------------


def gz_lines(path: Path) -> list[str]:
    """Lines of a gzip UTF-8 file, split on \\n only, as the pipeline reads them."""
    lines = gzip.decompress(Path(path).read_bytes()).decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def write_lines(path: Path, lines: list[str], newline: str = "\n") -> Path:
    data = "".join(line + newline for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_cfg(data: dict, vocab_size: int = 200, **tokenizer) -> Config:
    return from_dict({"data": data, "tokenizer": {"vocab_size": vocab_size, **tokenizer}})


def strip_all(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(directory: Path, truncate: bool = False):
    """Serve `directory` on 127.0.0.1; yields (url, list of requested paths).

    With `truncate`, every file is announced with its full Content-Length but only half of it
    is sent before the connection is closed (a download cut short)."""
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # keep test output clean
            pass

        def do_GET(self):
            requests.append(self.path)
            path = Path(self.translate_path(self.path))
            if truncate and path.is_file():
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            super().do_GET()

    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(directory))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def mirror(directory: Path, source: Path) -> Path:
    """A writable copy of the Multi30k files the tests need."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in M30K_FILES:
        shutil.copyfile(source / name, directory / name)
    return directory


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file()) if Path(root).exists() else []


@pytest.fixture(autouse=True)
def _no_proxy_for_localhost(monkeypatch):
    """The download tests talk to a local server: never through a configured HTTP proxy."""
    for key in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(key, "127.0.0.1,localhost")


# -- shared data -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def m30k(multi30k_dir: Path) -> dict[str, dict[str, list[str]]]:
    """The real Multi30k lines: split -> language -> lines."""
    return {
        split: {lang: gz_lines(multi30k_dir / f"{split}.{lang}.gz") for lang in LANGS}
        for split in ("train", "val", "test_2016_flickr")
    }


@pytest.fixture(scope="module")
def corpus(m30k) -> dict[str, dict[str, list[str]]]:
    """A small real corpus (split -> language -> lines) with padding whitespace on some lines."""

    def pad(lines: list[str]) -> list[str]:
        return [f"  {s} " if i % 5 == 0 else s for i, s in enumerate(lines)]

    out = {
        "train": {lang: pad(m30k["train"][lang][:N_TRAIN]) for lang in LANGS},
        "valid": {lang: pad(m30k["val"][lang][:N_VALID]) for lang in LANGS},
        "test": {lang: pad(m30k["test_2016_flickr"][lang][:N_TEST]) for lang in LANGS},
    }
    for split in out.values():
        for lines in split.values():
            assert all("\t" not in s and s.strip() for s in lines)
    return out


# -- source kinds ----------------------------------------------------------------------------
# Each builder writes the inputs and returns (data section, raw pairs per prepared split name).


def build_multi30k_env(tmp, corpus, m30k, monkeypatch):
    assert os.environ.get("NMT_DATA_DIR")  # the session fixture points at the local copy
    data = {"limit_train": N_TRAIN, "limit_valid": N_VALID, "test": ["test_2016_flickr"]}
    raw = {
        "train": m30k["train"],
        "valid": m30k["val"],
        "test_2016_flickr": m30k["test_2016_flickr"],
    }
    return data, raw


def build_multi30k_local_dir(tmp, corpus, m30k, monkeypatch):
    # Only data.local_dir can supply the files: no NMT_DATA_DIR, and downloads would fail.
    monkeypatch.delenv("NMT_DATA_DIR")
    copy = tmp / "copy"
    copy.mkdir()
    for split, name in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        for lang in LANGS:
            write_lines(copy / f"{name}.{lang}.gz", corpus[split][lang])
    data = {
        "local_dir": str(copy),
        "download_url": f"http://127.0.0.1:{closed_port()}",
        "cache_dir": str(tmp / "cache"),
        "test": ["test_2016_flickr"],
    }
    raw = {"train": corpus["train"], "valid": corpus["valid"], "test_2016_flickr": corpus["test"]}
    return data, raw


def build_text(tmp, corpus, m30k, monkeypatch, suffix="", newline="\n"):
    for split in ("train", "valid", "test"):
        for lang in LANGS:
            write_lines(tmp / f"{split}.{lang}{suffix}", corpus[split][lang], newline)
    data = {
        "source": "text",
        "train": str(tmp / "train"),
        "valid": str(tmp / "valid"),
        "test": [str(tmp / "test")],
    }
    return data, dict(corpus)


def build_tsv(tmp, corpus, m30k, monkeypatch, fields=None):
    names = fields or LANGS
    for split in ("train", "valid", "test"):
        rows = [f"id\t{names[1]}\t{names[0]}"]  # target column first: fields are found by name
        rows += [
            f"{i}\t{t}\t{s}"
            for i, (s, t) in enumerate(zip(corpus[split]["en"], corpus[split]["de"]))
        ]
        write_lines(tmp / f"{split}.tsv", rows)
    data = {
        "source": "tsv",
        "train": str(tmp / "train.tsv"),
        "valid": str(tmp / "valid.tsv"),
        "test": [str(tmp / "test.tsv")],
    }
    if fields:
        data.update(src_field=fields[0], tgt_field=fields[1])
    return data, dict(corpus)


def build_jsonl(tmp, corpus, m30k, monkeypatch, nested=False):
    for split in ("train", "valid", "test"):
        rows = []
        for i, (s, t) in enumerate(zip(corpus[split]["en"], corpus[split]["de"])):
            record = {"id": i, "translation": {"en": s, "de": t}} if nested else {"en": s, "de": t}
            rows.append(json.dumps(record, ensure_ascii=False))
            if i == 3:
                rows.append("")  # blank lines are skipped
        write_lines(tmp / f"{split}.jsonl", rows)
    data = {
        "source": "jsonl",
        "train": str(tmp / "train.jsonl"),
        "valid": str(tmp / "valid.jsonl"),
        "test": [str(tmp / "test.jsonl")],
    }
    return data, dict(corpus)


def hub_datasets(corpus) -> dict[str, datasets.Dataset]:
    return {
        hub_split: datasets.Dataset.from_dict(
            {
                "translation": [
                    {"en": s, "de": t} for s, t in zip(corpus[split]["en"], corpus[split]["de"])
                ],
                "id": list(range(len(corpus[split]["en"]))),
            }
        )
        for split, hub_split in (("train", "train"), ("valid", "validation"), ("test", "test"))
    }


def build_hub_saved(tmp, corpus, m30k, monkeypatch):
    datasets.DatasetDict(hub_datasets(corpus)).save_to_disk(str(tmp / "saved"))
    assert (tmp / "saved" / "dataset_dict.json").is_file()
    data = {
        "source": "hub",
        "hub_name": str(tmp / "saved"),
        "valid": "validation",
        "test": ["test"],
    }
    return data, {"train": corpus["train"], "valid": corpus["valid"], "test": corpus["test"]}


def build_hub_parquet(tmp, corpus, m30k, monkeypatch):
    (tmp / "pq").mkdir()
    for split, ds in hub_datasets(corpus).items():
        ds.to_parquet(str(tmp / "pq" / f"{split}.parquet"))
    data = {"source": "hub", "hub_name": str(tmp / "pq"), "valid": "validation", "test": ["test"]}
    return data, {"train": corpus["train"], "valid": corpus["valid"], "test": corpus["test"]}


def with_byte_order_mark(builder):
    """The files `builder` writes, each beginning with a UTF-8 byte-order mark (as Windows
    editors save them): text, not data (it became a token of the first line)."""

    def build(tmp, corpus, m30k, monkeypatch):
        data, expected = builder(tmp, corpus, m30k, monkeypatch)
        for path in tmp.iterdir():
            if path.is_file():
                path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        return data, expected

    return build


BUILDERS = {
    "multi30k-nmt_data_dir": build_multi30k_env,
    "multi30k-local_dir": build_multi30k_local_dir,
    "text": build_text,
    "text-gz": functools.partial(build_text, suffix=".gz"),
    "text-crlf": functools.partial(build_text, newline="\r\n"),
    "tsv": build_tsv,
    "tsv-named-fields": functools.partial(build_tsv, fields=("english", "german")),
    "jsonl": build_jsonl,
    "jsonl-translation": functools.partial(build_jsonl, nested=True),
    "hub-save_to_disk": build_hub_saved,
    "hub-parquet-dir": build_hub_parquet,
    "text-bom": with_byte_order_mark(build_text),
    "tsv-bom": with_byte_order_mark(build_tsv),
    "jsonl-bom": with_byte_order_mark(build_jsonl),
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_source_kind_yields_the_input_pairs(kind, tmp_path, corpus, m30k, monkeypatch):
    data, raw = BUILDERS[kind](tmp_path, corpus, m30k, monkeypatch)
    # limits wide open: this test is about reading, not filtering
    cfg = make_cfg({**data, "max_len": 10_000, "max_ratio": 1000.0})
    prepared = prepare(cfg)
    assert list(prepared.summary["splits"]) == list(raw)
    limits = {"train": cfg.data.limit_train, "valid": cfg.data.limit_valid}
    for name, pairs in raw.items():
        n = limits.get(name) or len(pairs["en"])
        split = prepared.split(name)
        assert split.texts("src") == strip_all(pairs["en"][:n])
        assert split.texts("tgt") == strip_all(pairs["de"][:n])
        assert prepared.summary["splits"][name]["pairs"] == n
    assert prepared.summary["train_read"] == (cfg.data.limit_train or len(raw["train"]["en"]))
    assert prepared.summary["dropped"] == {"empty": 0, "too_long": 0, "ratio": 0}

    # Raw loading keeps the lines as they are; de->en swaps the columns.
    reverse = {**data, "src": "de", "tgt": "en"}
    if "src_field" in data:
        reverse.update(src_field=data["tgt_field"], tgt_field=data["src_field"])
    rev = make_cfg(reverse)
    for name, spec in split_names(cfg.data).items():
        if name == "train" and cfg.data.limit_train:
            continue  # the full Multi30k training split: checked above through its slice
        forward = load_split(cfg.data, spec, tmp_path / "work")
        backward = load_split(rev.data, spec, tmp_path / "work-rev")
        assert forward["src"] == raw[name]["en"] and forward["tgt"] == raw[name]["de"]
        assert backward["src"] == raw[name]["de"] and backward["tgt"] == raw[name]["en"]


def test_reversed_direction_prepares_swapped_columns(m30k):
    data = {
        "limit_train": N_TRAIN,
        "limit_valid": N_VALID,
        "test": ["test_2016_flickr"],
        "max_len": 10_000,  # as in test_source_kind_yields_the_input_pairs: reuses its data
        "max_ratio": 1000.0,
    }
    forward = prepare(make_cfg(data))
    backward = prepare(make_cfg({**data, "src": "de", "tgt": "en"}))
    assert forward.dir != backward.dir
    assert (backward.summary["src"], backward.summary["tgt"]) == ("de", "en")
    for name in ("valid", "test_2016_flickr"):
        f, b = forward.split(name), backward.split(name)
        assert b.texts("src") == f.texts("tgt") and b.texts("tgt") == f.texts("src")
    assert backward.split("test_2016_flickr").texts("src") == strip_all(
        m30k["test_2016_flickr"]["de"]
    )


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"source": "tsv", "src_field": "english"}, "no column 'english'"),
        ({"source": "jsonl", "src_field": "english"}, "line 1: needs string fields 'english'"),
        ({"source": "hub", "valid": "nosuch"}, "nosuch"),
        ({"source": "hub", "tgt": "fr"}, "'fr'"),
    ],
)
def test_source_specific_errors_name_the_problem(
    data, fragment, tmp_path, corpus, m30k, monkeypatch
):
    builder = {"tsv": build_tsv, "jsonl": build_jsonl, "hub": build_hub_saved}[data["source"]]
    base, _ = builder(tmp_path, corpus, m30k, monkeypatch)
    with pytest.raises(NMTError) as info:
        prepare(make_cfg({**base, **data}))
    assert fragment in str(info.value)


def test_every_row_of_a_hub_dataset_is_checked(tmp_path, corpus):
    """Only each batch's first row was checked: a later row without the target text was a
    traceback (a KeyError, or an AttributeError where Arrow stored a null)."""
    rows = [{"en": s, "de": t} for s, t in zip(corpus["train"]["en"], corpus["train"]["de"])]
    rows[5] = {"en": "only English"}
    splits = hub_datasets(corpus)
    splits["train"] = datasets.Dataset.from_list([{"translation": r} for r in rows])
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    data = {"source": "hub", "hub_name": str(tmp_path / "saved"), "valid": "validation"}
    with pytest.raises(NMTError, match="split train, row 5: translation has no 'de' text"):
        prepare(make_cfg({**data, "test": ["test"]}))


def test_settings_that_do_not_change_the_data_keep_its_key():
    """src_field/tgt_field equal to the languages they name, and hub or field settings of a
    source that does not read them, prepared the same data again under another key."""
    text = {"source": "text", "train": "t", "valid": "v", "test": []}
    key = make_cfg(text).data_key()
    for same in ({"src_field": "en", "tgt_field": "de"}, {"hub_name": "x", "hub_config": "y"}):
        assert make_cfg({**text, **same}).data_key() == key
    tsv = {"source": "tsv", "train": "t.tsv", "valid": "v.tsv", "test": []}
    assert make_cfg({**tsv, "src_field": "en"}).data_key() == make_cfg(tsv).data_key()
    assert make_cfg({**tsv, "src_field": "english"}).data_key() != make_cfg(tsv).data_key()


def test_test_files_of_one_name_each_get_a_split():
    """Test files with the same base name get numbered split names, none taken twice: a test
    set whose name a numbered one took was silently dropped (not prepared, not scored)."""
    data = DataConfig(
        source="tsv",
        train="t.tsv",
        valid="v.tsv",
        test=("a/test.tsv", "c/test_4.tsv", "b/test.tsv", "d/test.tsv"),
    )
    names = split_names(data)
    assert sorted(names.values()) == sorted(["t.tsv", "v.tsv", *data.test])  # all kept
    assert names["test"] == "a/test.tsv" and names["test_4"] == "c/test_4.tsv"


def test_pipeline_errors_name_the_problem(tmp_path):
    write_lines(tmp_path / "train.en", ["A black dog runs.", "Two cats sleep."])
    write_lines(tmp_path / "train.de", ["Ein schwarzer Hund rennt.", "Zwei Katzen schlafen."])
    write_lines(tmp_path / "blank.en", [])
    write_lines(tmp_path / "blank.de", [])
    text = {"source": "text", "train": str(tmp_path / "train"), "valid": str(tmp_path / "train")}
    cases = [
        ({**text, "test": [], "max_len": 1}, ["empty after filtering", "data.max_len=1"]),
        ({"src": "cs"}, ["unknown language 'cs'", "test_2017_flickr", "en, de, fr"]),
        ({"test": ["test_2018_flickr"]}, ["unknown split 'test_2018_flickr'", "test_2016_flickr"]),
        ({**text, "valid": str(tmp_path / "nope")}, ["file not found", str(tmp_path / "nope.en")]),
        # an empty valid or test split would only fail at the first validation or at scoring
        (
            {**text, "test": [], "valid": str(tmp_path / "blank")},
            ["the valid split", "no sentence"],
        ),
        ({**text, "test": [str(tmp_path / "blank")]}, ["the blank split", "no sentence pairs"]),
    ]
    for data, fragments in cases:
        with pytest.raises(NMTError) as info:
            prepare(make_cfg({**data, "limit_train": 100}, vocab_size=40))
        for fragment in fragments:
            assert fragment in str(info.value)
    # fewer pieces than the data's characters: "too small" (it said "too large")
    with pytest.raises(NMTError, match=r"vocab_size=20 is too small for the \d+ characters"):
        prepare(make_cfg({**text, "test": []}, vocab_size=20))


# -- downloader ------------------------------------------------------------------------------


def test_download_verifies_caches_and_reuses_files(tmp_path, monkeypatch, multi30k_dir, m30k):
    monkeypatch.delenv("NMT_DATA_DIR")
    cache = tmp_path / "cache"
    with http_server(mirror(tmp_path / "mirror", multi30k_dir)) as (url, requests):
        data = {
            "download_url": url + "/",
            "cache_dir": str(cache),
            "limit_train": N_TRAIN,
            "limit_valid": N_VALID,
            "test": ["test_2016_flickr"],
        }
        first = prepare(make_cfg(data))
        corpora = cache / "corpora" / "multi30k"
        assert sorted(os.listdir(corpora)) == sorted(M30K_FILES)  # no partial files left
        for name in M30K_FILES:
            assert sha256(corpora / name) == MULTI30K.sha256[name]
            assert (corpora / name).read_bytes() == (multi30k_dir / name).read_bytes()
        assert sorted(requests) == sorted(f"/{name}" for name in M30K_FILES)  # each once
        assert first.split("train").texts("src") == strip_all(m30k["train"]["en"][:N_TRAIN])
        assert first.split("test_2016_flickr").texts("tgt") == strip_all(
            m30k["test_2016_flickr"]["de"]
        )

        # A new prepared dataset (other vocabulary) reads the cached files: no new request.
        seen = len(requests)
        second = prepare(make_cfg(data, vocab_size=210))
        assert not second.reused and second.dir != first.dir
        cfg = make_cfg(data)
        assert corpus_file(cfg.data, "val", "de") == corpora / "val.de.gz"
        assert len(requests) == seen
        assert second.split("valid").texts("tgt") == first.split("valid").texts("tgt")


def test_a_local_copy_is_checked_against_the_published_checksums(
    tmp_path, monkeypatch, multi30k_dir, caplog
):
    """data.local_dir files are the ones read (never a download), with a warning for each file
    that is not the published one: a slice or an edited copy may be intended."""
    monkeypatch.delenv("NMT_DATA_DIR")
    copy = mirror(tmp_path / "copy", multi30k_dir)
    data = {"local_dir": str(copy), "download_url": f"http://127.0.0.1:{closed_port()}"}
    cfg = make_cfg({**data, "cache_dir": str(tmp_path / "cache")})
    with caplog.at_level("WARNING", logger="nmt.data.sources"):
        assert corpus_file(cfg.data, "train", "en") == copy / "train.en.gz"
        assert not caplog.records  # the genuine files: nothing to say
        _corrupt(copy)
        assert corpus_file(cfg.data, "train", "en") == copy / "train.en.gz"
        assert corpus_file(cfg.data, "train", "de") == copy / "train.de.gz"
    (record,) = caplog.records
    assert f"{copy / 'train.en.gz'} is not the published multi30k train.en.gz" in record.message
    assert f"expected {MULTI30K.sha256['train.en.gz'][:12]}" in record.message


def test_an_edited_local_copy_is_prepared_again(tmp_path, monkeypatch, multi30k_dir):
    """The prepared-data key sees the content of a local copy: the published files keep the
    key they have when downloaded (or read from $NMT_DATA_DIR), an edited file gets a new key,
    so the edit is prepared, not hidden behind the cache of the original."""
    data = {"limit_train": N_TRAIN, "limit_valid": N_VALID, "test": ["test_2016_flickr"]}
    published = prepared_dir(make_cfg({**data, "cache_dir": str(tmp_path / "cache")}))
    monkeypatch.delenv("NMT_DATA_DIR")
    copy = mirror(tmp_path / "copy", multi30k_dir)
    data.update({"local_dir": str(copy), "cache_dir": str(tmp_path / "cache")})
    data["download_url"] = f"http://127.0.0.1:{closed_port()}"
    first = prepare(make_cfg(data))
    assert first.dir == published  # the published files, read from elsewhere
    val = gz_lines(copy / "val.de.gz")
    write_lines(copy / "val.de.gz", ["Ein ganz anderer Satz.", *val[1:]])
    assert prepared_dir(make_cfg(data)) != first.dir
    second = prepare(make_cfg(data))
    assert not second.reused and second.dir != first.dir
    assert second.split("valid").texts("tgt")[0] == "Ein ganz anderer Satz."
    assert first.split("valid").texts("tgt")[0] == val[0].strip()  # the original's cache stays
    assert prepare(make_cfg(data)).reused  # and the edit, once prepared, is reused
    shutil.copyfile(multi30k_dir / "val.de.gz", copy / "val.de.gz")  # back to the published file
    assert prepared_dir(make_cfg(data)) == first.dir


def _corrupt(directory: Path) -> None:
    data = bytearray((directory / "train.en.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (directory / "train.en.gz").write_bytes(bytes(data))


def _short(directory: Path) -> None:
    data = (directory / "train.en.gz").read_bytes()
    (directory / "train.en.gz").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("bit-flipped file", "is corrupt"),
        ("short file", "is corrupt"),
        ("connection cut", "is truncated"),
        ("missing on server", "cannot download"),
        ("unreachable", "cannot download"),
    ],
)
def test_bad_download_raises_and_leaves_nothing_in_the_cache(
    case, fragment, tmp_path, monkeypatch, multi30k_dir
):
    monkeypatch.delenv("NMT_DATA_DIR")
    served = mirror(tmp_path / "mirror", multi30k_dir)
    if case == "bit-flipped file":
        _corrupt(served)
    elif case == "short file":
        _short(served)
    elif case == "missing on server":
        (served / "train.en.gz").unlink()
    cache = tmp_path / "cache"
    with contextlib.ExitStack() as stack:
        if case == "unreachable":
            url, requests = f"http://127.0.0.1:{closed_port()}", None
        else:
            url, requests = stack.enter_context(
                http_server(served, truncate=case == "connection cut")
            )
        cfg = make_cfg({"download_url": url, "cache_dir": str(cache), "limit_train": N_TRAIN})
        with pytest.raises(NMTError) as info:
            corpus_file(cfg.data, "train", "en")
        message = str(info.value)
        assert fragment in message and f"{url}/train.en.gz" in message
        assert files_under(cache) == []
        if requests is not None:
            assert requests == ["/train.en.gz"]
        # the whole pipeline fails the same way and leaves no file behind
        with pytest.raises(NMTError, match=fragment):
            prepare(cfg)
        assert files_under(cache) == []


# -- cleaning --------------------------------------------------------------------------------

LONG_EN = " ".join(["dog"] * 150)
LONG_DE = " ".join(["Hund"] * 150)
SHORT_EN = "A man."
LONG_SENTENCE_DE = (
    "Ein älterer Mann mit einem roten Hut und einer blauen Jacke steht neben einem kleinen "
    "Mädchen, das auf einer belebten Straße in der Stadt ein großes Eis isst."
)
PLANTED_EMPTY = [("", "Ein Hund rennt."), ("A dog runs.", "   "), ("", ""), (" \t ", "Ein Mann.")]
PLANTED_LONG = [(LONG_EN, LONG_DE), ("A dog runs.", LONG_DE)]
PLANTED_RATIO = [(SHORT_EN, LONG_SENTENCE_DE)]
MAX_LEN, MAX_RATIO = 60, 2.0


def _interleave(good: list[tuple[str, str]], planted: list[tuple[str, str]]) -> list:
    out = list(good)
    for k, pair in enumerate(planted):
        out.insert(7 + 11 * k, pair)
    return out


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory, corpus) -> tuple[Prepared, dict]:
    tmp = tmp_path_factory.mktemp("cleaning")
    train = _interleave(
        list(zip(corpus["train"]["en"], corpus["train"]["de"])),
        PLANTED_EMPTY + PLANTED_LONG + PLANTED_RATIO,
    )
    valid = _interleave(
        list(zip(corpus["valid"]["en"], corpus["valid"]["de"])),
        [("", ""), ("  ", "Ein Hund."), ("A dog.", ""), (LONG_EN, LONG_DE), ("  x  ", "\ty")],
    )
    test = [("", "")] + list(zip(corpus["test"]["en"], corpus["test"]["de"])) + [(" ", " ")]
    lines = {"train": train, "valid": valid, "test": test}
    for split, pairs in lines.items():
        for i, lang in enumerate(LANGS):
            write_lines(tmp / f"{split}.{lang}", [p[i] for p in pairs])
    data = {
        "source": "text",
        "train": str(tmp / "train"),
        "valid": str(tmp / "valid"),
        "test": [str(tmp / "test")],
        "max_len": MAX_LEN,
        "max_ratio": MAX_RATIO,
    }
    return prepare(make_cfg(data, vocab_size=250)), lines


def test_cleaning_drops_and_counts_empty_long_and_unbalanced_training_pairs(cleaned):
    prepared, lines = cleaned
    pairs = [(s.strip(), t.strip()) for s, t in lines["train"]]
    nonempty = [(s, t) for s, t in pairs if s and t]
    dropped = prepared.summary["dropped"]
    assert dropped["empty"] == len(pairs) - len(nonempty) == len(PLANTED_EMPTY)

    # Recompute the length filters with the prepared tokenizer.
    tok = prepared.tokenizer()
    src_len = [len(x) for x in tok.encode_src([s for s, _ in nonempty])]
    tgt_len = [len(x) for x in tok.encode_tgt([t for _, t in nonempty])]
    too_long = [a > MAX_LEN or b > MAX_LEN for a, b in zip(src_len, tgt_len)]
    ratio = [
        not long and max(a, b) / max(min(a, b), 1) > MAX_RATIO
        for a, b, long in zip(src_len, tgt_len, too_long)
    ]
    assert dropped["too_long"] == sum(too_long) >= len(PLANTED_LONG)
    assert dropped["ratio"] == sum(ratio) >= len(PLANTED_RATIO)
    kept = [p for p, a, b in zip(nonempty, too_long, ratio) if not (a or b)]

    train = prepared.split("train")
    assert list(zip(train.texts("src"), train.texts("tgt"))) == kept
    for pair in PLANTED_LONG:
        assert too_long[nonempty.index(pair)]
    for pair in PLANTED_RATIO:
        assert ratio[nonempty.index(pair)]
    assert prepared.summary["train_read"] == len(pairs)
    assert prepared.summary["splits"]["train"]["pairs"] == len(pairs) - sum(dropped.values())
    assert train.src_lens.max() <= MAX_LEN and train.tgt_lens.max() <= MAX_LEN
    assert (
        np.maximum(train.src_lens, train.tgt_lens)
        <= MAX_RATIO * np.minimum(train.src_lens, train.tgt_lens)
    ).all()
    assert train.src_lens.min() >= 1 and train.tgt_lens.min() >= 1


@pytest.mark.parametrize("name", ["valid", "test"])
def test_valid_and_test_keep_every_line_and_are_only_stripped(cleaned, name):
    prepared, lines = cleaned
    split = prepared.split(name)
    assert len(split) == prepared.summary["splits"][name]["pairs"] == len(lines[name])
    assert split.texts("src") == [s.strip() for s, _ in lines[name]]
    assert split.texts("tgt") == [t.strip() for _, t in lines[name]]
    empty_src = [i for i, (s, _) in enumerate(lines[name]) if not s.strip()]
    assert empty_src and all(split.src_lens[i] == 0 for i in empty_src)
    if name == "valid":  # no length filter outside training
        assert split.src_lens.max() > MAX_LEN


# -- tokenizer -------------------------------------------------------------------------------


def _normal(line: str) -> bool:
    return bool(line) and " ".join(line.split()) == line


@pytest.mark.parametrize("joint", [True, False], ids=["joint", "separate"])
@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_tokenizer_kinds_special_ids_and_round_trip(kind, joint):
    vocab = 200
    data = {"limit_train": N_TRAIN, "limit_valid": N_VALID, "test": []}
    prepared = prepare(make_cfg(data, vocab_size=vocab, type=kind, joint=joint))
    files = {p.name for p in prepared.dir.glob("*.model")}
    assert files == ({JOINT} if joint else {SRC, TGT})
    tok = prepared.tokenizer()
    assert tok.joint is joint and prepared.summary["vocab"]["joint"] is joint
    assert prepared.summary["vocab"]["src"] == prepared.summary["vocab"]["tgt"] == vocab

    train = prepared.split("train")
    sides = [(tok.src, train.texts("src")), (tok.tgt, train.texts("tgt"))]
    for sp, lines in sides:
        special = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
        assert special == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
        assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
        assert sp.get_piece_size() == vocab
        scores = [sp.get_score(i) for i in range(4, vocab)]
        integral = all(float(s).is_integer() for s in scores)
        assert integral is (kind == "bpe")  # BPE ranks merges; unigram stores log-probabilities
        normal = [line for line in lines if _normal(line)]
        assert len(normal) >= 0.9 * len(lines)
        assert sp.decode(sp.encode(normal)) == normal
        ids = sp.encode(normal)
        assert all(PAD_ID not in x and BOS_ID not in x and EOS_ID not in x for x in ids)
    # prepared ids are the tokenizer's encoding of the stripped text
    valid = prepared.split("valid")
    assert isinstance(valid.texts("src"), list)
    assert valid.table.column("src_ids").to_pylist() == tok.encode_src(valid.texts("src"))
    assert valid.table.column("tgt_ids").to_pylist() == tok.encode_tgt(valid.texts("tgt"))
    # short lists go line by line (no thread pool per call), long ones in one batch call:
    # both are sentencepiece's encoding and decoding of the whole list
    texts = train.texts("src")
    assert len(texts) > BATCH_CALL
    for lines in (texts[:1], texts[:5], texts[: BATCH_CALL - 1], texts[:BATCH_CALL], texts):
        ids = tok.encode_src(lines)
        assert ids == tok.src.encode(lines) and tok.encode_tgt(lines) == tok.tgt.encode(lines)
        assert tok.decode_tgt(ids) == tok.tgt.decode(ids)
        assert tok.encode_src_pieces(lines) == tok.src.encode(lines, out_type=str)

    if not joint:  # each side's vocabulary comes from that side's text only
        src_chars = set("".join(train.texts("src")))
        tgt_chars = set("".join(train.texts("tgt")))
        assert tgt_chars - src_chars  # e.g. German umlauts

        def chars(sp) -> set[str]:
            pieces = [sp.id_to_piece(i) for i in range(4, vocab)]
            return set("".join(pieces).replace("\u2581", ""))

        assert chars(tok.src) <= src_chars and chars(tok.tgt) <= tgt_chars
        assert chars(tok.tgt) & (tgt_chars - src_chars)


FULL_WIDTH = {c: c + 0xFEE0 for c in range(0x21, 0x7F)}  # ASCII -> its full-width form


@pytest.mark.parametrize("rule", ["nmt_nfkc", "identity"])
def test_tokenizer_normalization_rule(rule, tmp_path, corpus):
    """tokenizer.normalization=identity keeps full-width text as written (zh/ja punctuation);
    the default NFKC rule folds it to ASCII, also in what the tokenizer decodes."""
    for lang in LANGS:
        lines = [
            s.strip().translate(FULL_WIDTH) if i % 2 else s
            for i, s in enumerate(corpus["train"][lang])
        ]
        write_lines(tmp_path / f"train.{lang}", lines)
    data = {"source": "text", "train": str(tmp_path / "train"), "valid": str(tmp_path / "train")}
    prepared = prepare(make_cfg({**data, "test": []}, normalization=rule))
    tok = prepared.tokenizer()
    line = "Ｔｗｏ ｄｏｇｓ，ｏｎｅ ｂａｌｌ．"
    (back,) = tok.decode_tgt(tok.encode_tgt([line]))
    assert back == (line if rule == "identity" else "Two dogs,one ball.")
    other = "identity" if rule == "nmt_nfkc" else "nmt_nfkc"
    assert (
        make_cfg({**data, "test": []}, normalization=other).data_key()
        != make_cfg({**data, "test": []}, normalization=rule).data_key()
    )  # a prepared dataset of one rule is never reused for the other


def test_tokenizer_is_trained_on_the_training_slice_only(tmp_path, corpus):
    # characters that occur only after the training limit or only in valid/test are unknown
    train_en = corpus["train"]["en"] + ["The ☃ stands in the snow."] * 5
    train_de = corpus["train"]["de"] + ["Der ☃ steht im Schnee."] * 5
    valid_en = ["A § sign.", *corpus["valid"]["en"]]
    valid_de = ["Ein Ω Zeichen.", *corpus["valid"]["de"]]
    for split, en, de in (("train", train_en, train_de), ("valid", valid_en, valid_de)):
        write_lines(tmp_path / f"{split}.en", en)
        write_lines(tmp_path / f"{split}.de", de)
    data = {
        "source": "text",
        "train": str(tmp_path / "train"),
        "valid": str(tmp_path / "valid"),
        "test": [],
        "limit_train": N_TRAIN,
    }
    prepared = prepare(make_cfg(data))
    tok = prepared.tokenizer()
    for char in "☃§Ω":
        assert tok.src.piece_to_id(char) == UNK_ID
    for char in set("".join(strip_all(corpus["train"]["en"] + corpus["train"]["de"]))) - {" "}:
        assert tok.src.piece_to_id(char) != UNK_ID  # full character coverage of the train slice
    valid = prepared.split("valid")
    assert UNK_ID in valid.src_ids(0) and UNK_ID in valid.tgt_ids(0)


# -- caching ---------------------------------------------------------------------------------


def _mtimes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in files_under(directory)}


def test_prepare_writes_a_complete_directory_then_reuses_it(tmp_path):
    data = {"limit_train": N_TRAIN, "limit_valid": N_VALID, "cache_dir": str(tmp_path / "c")}
    cfg = make_cfg(data)
    first = prepare(cfg)
    assert not first.reused
    assert first.dir == prepared_dir(cfg) == tmp_path / "c" / "prepared" / cfg.data_key()
    assert {p.name for p in first.dir.iterdir()} >= {"summary.json", "splits", JOINT}
    assert not (first.dir / "datasets-cache").exists()
    assert [p.name for p in first.dir.parent.iterdir()] == [first.dir.name]  # no temp dirs
    assert sorted(p.name for p in (first.dir / "splits").iterdir()) == sorted(
        ["train", "valid", *cfg.data.test]
    )
    before = _mtimes(first.dir)
    second = prepare(cfg)
    assert second.reused and second.dir == first.dir
    assert second.summary == first.summary == json.loads((first.dir / "summary.json").read_text())
    assert _mtimes(first.dir) == before  # nothing rewritten, summary.json included
    # num_proc does not change the prepared data: same directory, reused
    third = prepare(make_cfg({**data, "num_proc": 2}))
    assert third.reused and third.dir == first.dir
    # a different vocabulary is a different prepared dataset
    other = prepare(make_cfg(data, vocab_size=230))
    assert not other.reused and other.dir != first.dir
    assert other.summary["vocab"]["src"] == 230 and first.summary["vocab"]["src"] == 200
    assert _mtimes(first.dir) == before


def test_changing_a_text_input_invalidates_the_cache(tmp_path, corpus):
    data, _ = build_text(tmp_path, corpus, None, None)
    cfg = make_cfg(data)
    first = prepare(cfg)
    assert prepare(cfg).reused

    # same size, different contents
    path = tmp_path / "valid.de"
    old = path.read_bytes()
    new = old.replace(b"Mann", b"Frau", 1)
    assert new != old and len(new) == len(old)
    path.write_bytes(new)
    second = prepare(cfg)
    assert not second.reused and second.dir != first.dir
    assert second.split("valid").texts("tgt") != first.split("valid").texts("tgt")
    assert second.split("valid").texts("tgt") == strip_all(new.decode().splitlines())
    assert prepare(cfg).reused

    # a line appended to a training file
    with open(tmp_path / "train.en", "a", encoding="utf-8") as f:
        f.write("One more sentence.\n")
    with open(tmp_path / "train.de", "a", encoding="utf-8") as f:
        f.write("Noch ein Satz.\n")
    third = prepare(cfg)
    assert not third.reused and third.dir not in (first.dir, second.dir)
    assert third.summary["train_read"] == N_TRAIN + 1
    assert third.split("train").texts("tgt")[-1] == "Noch ein Satz."


@pytest.mark.parametrize("builder", [build_hub_saved, build_hub_parquet])
def test_changing_a_local_hub_dataset_invalidates_the_cache(builder, tmp_path, corpus, m30k):
    data, _ = builder(tmp_path, corpus, m30k, None)
    cfg = make_cfg(data)
    first = prepare(cfg)
    assert prepare(cfg).reused
    de = [t.replace("Mann", "Frau") for t in corpus["valid"]["de"]]
    assert de != corpus["valid"]["de"]
    changed = {**corpus, "valid": {**corpus["valid"], "de": de}}
    shutil.rmtree(tmp_path / ("saved" if builder is build_hub_saved else "pq"))
    builder(tmp_path, changed, m30k, None)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    second = prepare(cfg)
    assert not second.reused and second.dir != first.dir
    assert second.split("valid").texts("tgt") == strip_all(de)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == written  # untouched


# -- batching --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_train() -> EncodedSplit:
    """The whole Multi30k en-de training split (29k pairs), small vocabulary."""
    prepared = prepare(make_cfg({"limit_valid": 100, "test": []}, vocab_size=500))
    assert prepared.summary["train_read"] == 29_000
    return prepared.split("train")


def _all_indices(batches: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


@pytest.mark.parametrize("budget", [300, 1024, 4096])
def test_batches_never_exceed_the_token_budget(full_train, budget):
    src, tgt = full_train.src_lens, full_train.tgt_lens
    cost = np.maximum(src, tgt) + 1
    assert cost.max() <= budget  # so the bound holds for every batch
    for world in (1, 3):
        batches = TokenBatches(src, tgt, budget, seed=1, world=world).all_batches(0)
        for b in batches:
            assert len(b) >= 1
            assert len(b) * max(src[b].max() + 1, tgt[b].max() + 1) <= budget
        # packing is not wasteful: most batches are more than half full
        fill = np.array([len(b) * cost[b].max() / budget for b in batches])
        assert np.median(fill) > 0.5


def _heights(split, batches: list[np.ndarray]) -> tuple[set[int], set[int]]:
    """The padded matrix heights (examples x positions) of each side's batches."""
    src = {len(b) * (int(split.src_lens[b].max()) + 1) for b in batches}
    tgt = {len(b) * (int(split.tgt_lens[b].max()) + 1) for b in batches}
    return src, tgt


@pytest.mark.parametrize("multiple", [8, 16])
def test_batches_hold_a_multiple_of_examples_and_fewer_shapes(full_train, multiple):
    """train.batch_multiple: every batch the budget cuts holds a multiple of it (the leftovers
    begin the next batch); only the epoch's last batch in length order and batches of fewer
    examples than the multiple may not. So both sides' heights are multiples of it, and an
    epoch has far fewer distinct ones than packing to the budget alone: fewer kernels for
    oneDNN to make and keep."""
    src, tgt = full_train.src_lens, full_train.tgt_lens
    budget = 1500
    plain = TokenBatches(src, tgt, budget, seed=1, multiple=1, shuffle=False).epoch(0)
    batches = TokenBatches(src, tgt, budget, seed=1, multiple=multiple, shuffle=False).epoch(0)
    assert np.array_equal(np.sort(_all_indices(batches)), np.arange(len(src)))
    for b in batches:
        assert len(b) * max(src[b].max() + 1, tgt[b].max() + 1) <= budget
    off = [k for k, b in enumerate(batches) if len(b) % multiple and len(b) >= multiple]
    assert off in ([], [len(batches) - 1])
    whole = [b for b in batches if len(b) % multiple == 0]
    assert len(whole) > 0.9 * len(batches)  # the rest: the few of long sentences, and the last
    src_h, tgt_h = _heights(full_train, whole)
    assert all(h % multiple == 0 for h in src_h | tgt_h)
    src_h, tgt_h = _heights(full_train, batches)
    plain_src, plain_tgt = _heights(full_train, plain)
    assert len(src_h | tgt_h) < 0.6 * len(plain_src | plain_tgt)
    # the batches stay nearly as full: a few more of them for the same examples (this
    # fixture's 500-word vocabulary makes long sentences: 16 gave 755 batches against 610)
    assert len(plain) < len(batches) < {8: 1.15, 16: 1.3}[multiple] * len(plain)
    # shuffled epochs too, and resumable: the same batches for the same (seed, epoch)
    a = TokenBatches(src, tgt, budget, seed=5, multiple=multiple)
    b = TokenBatches(src, tgt, budget, seed=5, multiple=multiple)
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch(2), b.epoch(2)))
    assert sum(len(b) % multiple != 0 and len(b) >= multiple for b in a.epoch(2)) <= 1


def test_batches_of_a_train_config_follow_its_keys(full_train):
    """`TokenBatches.of`, what training, validation and `nmt prepare` build their batches
    with, packs by the config's budget, seed and multiple (8 by default)."""
    t = make_cfg({}).train
    assert t.batch_multiple == 8
    for multiple in (1, 8):
        t2 = dataclasses.replace(t, batch_tokens=1500, batch_multiple=multiple, seed=4)
        direct = TokenBatches(
            full_train.src_lens, full_train.tgt_lens, 1500, seed=4, multiple=multiple
        )
        of = TokenBatches.of(full_train, t2)
        assert all(np.array_equal(x, y) for x, y in zip(of.epoch(1), direct.epoch(1)))
        assert len(of.epoch(1)) == len(direct.epoch(1))


def test_collated_batches_respect_the_budget_and_measure_padding(full_train):
    budget = 4096
    batches = TokenBatches(full_train.src_lens, full_train.tgt_lens, budget, seed=7)
    real = total = 0
    for indices in batches.epoch(0):
        b = full_train.collate(indices)
        assert b.src.shape[0] * max(b.src.shape[1], b.tgt_in.shape[1]) <= budget
        real += int(b.src_mask.sum()) + int((b.tgt_out != PAD_ID).sum())
        total += b.src.numel() + b.tgt_out.numel()
    padding = 1 - real / total
    assert padding == pytest.approx(batches.padding_fraction(0), abs=1e-12)
    assert padding < 0.10


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_example_once_per_epoch_across_ranks(full_train, world):
    n = len(full_train)
    for epoch in (0, 1):
        per_rank = [
            TokenBatches(
                full_train.src_lens, full_train.tgt_lens, 2000, seed=3, rank=r, world=world
            ).epoch(epoch)
            for r in range(world)
        ]
        assert len({len(batches) for batches in per_rank}) == 1  # same number of steps
        everything = _all_indices([b for batches in per_rank for b in batches])
        assert len(everything) == n
        assert np.array_equal(np.sort(everything), np.arange(n))


def test_small_corpus_is_split_so_every_rank_gets_a_batch():
    lens = np.full(5, 4)
    for world in (2, 3, 5):
        per_rank = [
            TokenBatches(lens, lens, 1000, seed=0, rank=r, world=world).epoch(0)
            for r in range(world)
        ]
        assert {len(x) for x in per_rank} == {1}
        assert np.array_equal(np.sort(_all_indices([b for x in per_rank for b in x])), np.arange(5))
    with pytest.raises(NMTError, match="5 examples cannot be shared by 6 ranks"):
        TokenBatches(lens, lens, 1000, seed=0, world=6)
    # Every batch is one example (the budget) and 3 cannot be split over 2 ranks.
    with pytest.raises(NMTError, match="raise train.batch_tokens"):
        TokenBatches(np.full(3, 5), np.full(3, 5), 8, seed=0, world=2).epoch(0)


def test_an_example_over_the_budget_gets_a_batch_of_its_own():
    src = np.array([3, 3, 200, 3, 3])
    batches = TokenBatches(src, src, 50, seed=0).epoch(0)
    assert [list(b) for b in batches if 2 in b] == [[2]]
    assert np.array_equal(np.sort(_all_indices(batches)), np.arange(5))


def test_batch_order_is_deterministic_per_seed_and_epoch(full_train):
    def order(seed: int, epoch: int) -> list[np.ndarray]:
        return TokenBatches(full_train.src_lens, full_train.tgt_lens, 2000, seed=seed).epoch(epoch)

    def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
        return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))

    assert same(order(1, 0), order(1, 0))
    assert same(order(1, 5), order(1, 5))
    assert not same(order(1, 0), order(1, 1))
    assert not same(order(1, 0), order(2, 0))

    # the batch order itself is reshuffled each epoch, not only the ties within a length
    def profile(batches: list[np.ndarray]) -> list[tuple[int, int]]:
        return [(len(b), int(full_train.src_lens[b].max())) for b in batches]

    assert sorted(profile(order(1, 0))) == sorted(profile(order(1, 1)))
    assert profile(order(1, 0)) != profile(order(1, 1))
    # the first batches of two epochs hold different examples, not just a different order
    assert not np.array_equal(np.sort(order(1, 0)[0]), np.sort(order(1, 1)[0]))


def test_unshuffled_batches_follow_length_order(full_train):
    src, tgt = full_train.src_lens, full_train.tgt_lens
    flat = _all_indices(TokenBatches(src, tgt, 2000, seed=0, shuffle=False).epoch(0))
    key = src[flat] * 10_000 + tgt[flat]
    assert (np.diff(key) >= 0).all()


@pytest.mark.parametrize("world", [1, 2])
def test_resume_from_a_batch_continues_the_same_epoch(full_train, world):
    for rank in range(world):
        tb = TokenBatches(
            full_train.src_lens, full_train.tgt_lens, 3000, seed=11, rank=rank, world=world
        )
        whole = tb.epoch(4)
        for start in (0, 1, 17, len(whole) - 1, len(whole)):
            resumed = tb.epoch(4, start=start)
            assert len(resumed) == len(whole) - start
            assert all(np.array_equal(a, b) for a, b in zip(resumed, whole[start:]))


def test_collate_adds_eos_bos_shifts_targets_and_masks(full_train):
    lens = full_train.src_lens + full_train.tgt_lens
    indices = np.array([0, int(lens.argmax()), int(lens.argmin()), 5, 1234])
    b = full_train.collate(indices)
    n = len(indices)
    S = int(full_train.src_lens[indices].max()) + 1
    T = int(full_train.tgt_lens[indices].max()) + 1
    assert b.src.shape == b.src_mask.shape == (n, S)
    assert b.tgt_in.shape == b.tgt_out.shape == (n, T)
    assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == torch.int64
    assert b.src_mask.dtype == torch.bool
    assert np.array_equal(b.indices, indices)
    assert b.tgt_tokens == int(full_train.tgt_lens[indices].sum()) + n
    rows = full_train.table.take(indices).to_pydict()
    for row, (src_ids, tgt_ids) in enumerate(zip(rows["src_ids"], rows["tgt_ids"])):
        x, y = len(src_ids), len(tgt_ids)
        assert b.src[row, :x].tolist() == list(src_ids)
        assert b.src[row, x] == EOS_ID  # source ends with EOS
        assert (b.src[row, x + 1 :] == PAD_ID).all()
        assert b.src_mask[row].tolist() == [True] * (x + 1) + [False] * (S - x - 1)
        assert b.tgt_in[row, 0] == BOS_ID  # decoder input starts with BOS
        assert b.tgt_in[row, 1 : y + 1].tolist() == list(tgt_ids)
        assert b.tgt_out[row, :y].tolist() == list(tgt_ids)
        assert b.tgt_out[row, y] == EOS_ID
        # tgt_out is tgt_in shifted left by one; both are padded at the same positions
        assert torch.equal(b.tgt_out[row, :y], b.tgt_in[row, 1 : y + 1])
        assert torch.equal(b.tgt_in[row] != PAD_ID, b.tgt_out[row] != PAD_ID)
        assert (b.tgt_in[row, y + 1 :] == PAD_ID).all()
    assert b.src_mask.sum().item() == int(full_train.src_lens[indices].sum()) + n
    assert (b.tgt_out != PAD_ID).sum().item() == b.tgt_tokens


READ_PREPARED = """
import sys
from pathlib import Path
from nmt.data.batching import EncodedSplit
split = EncodedSplit.load(Path(sys.argv[1]))
b = split.collate(list(range(len(split))))
print(len(split), int(b.tgt_tokens), len(split.texts("src")), len(split.texts("tgt")))
print(" ".join(m for m in ("datasets", "pandas") if m in sys.modules) or "-")
"""


def test_a_prepared_split_is_read_as_datasets_wrote_it_without_datasets(cleaned):
    """A split `nmt prepare` saved with `datasets` reads back, through pyarrow alone, as
    `datasets.load_from_disk` reads it: the same text, ids and lengths. Neither `datasets` nor
    pandas is imported on the way (78-80 MB of resident memory in a training process)."""
    prepared, _ = cleaned
    path = prepared.dir / "splits" / "valid"
    ours, theirs = EncodedSplit.load(path), EncodedSplit.from_dataset(datasets.load_from_disk(path))
    assert len(ours) == len(theirs) == prepared.summary["splits"]["valid"]["pairs"]
    for column in ("src", "tgt"):
        assert (
            ours.texts(column)
            == theirs.texts(column)
            == list(datasets.load_from_disk(path)[column])
        )
    for name in ("src_offsets", "src_values", "tgt_offsets", "tgt_values", "src_lens", "tgt_lens"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name
    done = subprocess.run(
        [sys.executable, "-c", READ_PREPARED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    counts, imported = done.stdout.splitlines()
    n = len(ours)
    assert counts.split() == [str(n), str(int(ours.tgt_lens.sum()) + n), str(n), str(n)]
    assert imported == "-"


@pytest.mark.parametrize("damage", ["truncated", "missing", "no state"])
def test_a_damaged_prepared_split_says_how_to_prepare_it_again(cleaned, tmp_path, damage):
    """A prepared split whose files are cut, gone or unlisted is one NMTError naming the
    directory to delete and the command to run, not a pyarrow traceback."""
    prepared, _ = cleaned
    split = tmp_path / "prepared" / "key" / "splits" / "valid"
    shutil.copytree(prepared.dir / "splits" / "valid", split)
    arrow = next(split.glob("*.arrow"))
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    elif damage == "missing":
        arrow.unlink()
    else:
        (split / "state.json").unlink()
    with pytest.raises(NMTError) as caught:
        EncodedSplit.load(split)
    message = str(caught.value)
    assert message.startswith(f"the prepared split in {split} cannot be read (")
    assert message.endswith(f"delete {tmp_path / 'prepared' / 'key'} and run `nmt prepare` again")
    assert "\n" not in message


def test_a_prepared_split_cut_between_its_records_is_refused(cleaned, tmp_path):
    """An Arrow file cut exactly between two of its record batches still reads, with fewer
    rows: the split then holds fewer pairs than its summary says, which is refused the same
    way instead of training on part of the data."""
    prepared, _ = cleaned
    directory = tmp_path / "prepared" / "key"
    shutil.copytree(prepared.dir, directory)
    summary = json.loads((directory / "summary.json").read_text())
    pairs = summary["splits"]["valid"]["pairs"]
    summary["splits"]["valid"]["pairs"] = pairs + 1  # as if rows had been lost
    cut = Prepared(directory, summary, reused=True)
    with pytest.raises(NMTError) as caught:
        cut.split("valid")
    split = directory / "splits" / "valid"
    assert str(caught.value) == (
        f"the prepared split in {split} holds {pairs} pairs where {pairs + 1} were prepared; "
        f"delete {directory} and run `nmt prepare` again"
    )
    assert (
        len(
            Prepared(directory, json.loads((directory / "summary.json").read_text()), True).split(
                "valid"
            )
        )
        == pairs
    )


# -- `nmt prepare` on bad input --------------------------------------------------------------

SENTINEL = "# written by the user; nmt prepare must not touch it\nmodel: {arch: seq2seq}\n"


def _text_case(base: Path, en: bytes, de: bytes) -> dict:
    (base / "train.en").write_bytes(en)
    (base / "train.de").write_bytes(de)
    write_lines(base / "valid.en", ["A dog."])
    write_lines(base / "valid.de", ["Ein Hund."])
    return {
        "sets": [
            "data.source=text",
            f"data.train={base / 'train'}",
            f"data.valid={base / 'valid'}",
            "data.test=[]",
            "tokenizer.vocab_size=100",
        ]
    }


def case_missing_file(base: Path, url: str) -> dict:
    case = _text_case(base, b"A dog.\n", b"Ein Hund.\n")
    case["sets"][1] = f"data.train={base / 'nowhere' / 'train'}"
    case["expect"] = ["file not found", str(base / "nowhere" / "train.en")]
    return case


def case_line_counts(base: Path, url: str) -> dict:
    case = _text_case(base, b"a\nb\nc\nd\ne\n", b"A\nB\nC\nD\n")
    case["expect"] = [
        "line counts differ",
        f"{base / 'train.en'} has 5 lines",
        f"{base / 'train.de'} has 4",
    ]
    return case


def case_not_utf8(base: Path, url: str) -> dict:
    case = _text_case(base, b"A dog.\nA cat.\nA caf\xe9 sign.\nA man.\n", b"a\nb\nc\nd\n")
    case["expect"] = [f"{base / 'train.en'}, line 3", "UTF-8"]
    return case


def case_empty_after_filtering(base: Path, url: str) -> dict:
    case = _text_case(base, b"\n  \nA dog.\n\n", b"Ein Hund.\n\n\n\t\n")
    case["expect"] = ["training corpus is empty after filtering", "4 pairs read"]
    return case


def case_unknown_language(base: Path, url: str) -> dict:
    return {"sets": ["data.src=xx"], "expect": ["unknown language 'xx'", "en, de, fr, cs"]}


def case_unknown_split(base: Path, url: str) -> dict:
    return {"sets": ["data.valid=nosuch"], "expect": ["unknown split 'nosuch'", "valid splits"]}


def case_unknown_key(base: Path, url: str) -> dict:
    return {"sets": ["model.no_such_key=1"], "expect": ["model.no_such_key"]}


def case_bad_type(base: Path, url: str) -> dict:
    return {"sets": ["train.lr=abc"], "expect": ["train.lr", "'abc'"]}


def case_truncated_download(base: Path, url: str) -> dict:
    return {
        "sets": [f"data.download_url={url}", f"data.cache_dir={base / 'cache'}"],
        "unset": ["NMT_DATA_DIR"],
        "expect": ["is truncated", f"{url}/train.en.gz"],
        "empty_dir": base / "cache",
    }


def case_path_with_brackets(base: Path, url: str) -> dict:
    (base / "[old]").mkdir()
    case = _text_case(base / "[old]", b"a\nb\n", b"A\n")
    case["expect"] = [f"{base / '[old]' / 'train.en'} has 2 lines"]
    return case


CLI_CASES = {
    "missing-file": case_missing_file,
    "line-counts-differ": case_line_counts,
    "not-utf8": case_not_utf8,
    "empty-after-filtering": case_empty_after_filtering,
    "unknown-language": case_unknown_language,
    "unknown-split": case_unknown_split,
    "unknown-recipe-key": case_unknown_key,
    "bad-value-type": case_bad_type,
    "truncated-download": case_truncated_download,
    "path-with-brackets": case_path_with_brackets,
}


def _run_cli(case: dict) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "COLUMNS": "400",
        "NMT_CACHE_DIR": str(case["cache"]),
        "no_proxy": "127.0.0.1,localhost",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    for key in case.get("unset", []):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "nmt", "prepare", str(case.get("recipe", TINY_RECIPE))]
    cmd += ["--run-dir", str(case["run_dir"])]
    for item in case["sets"]:
        cmd += ["--set", item]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=300, cwd=case["base"]
    )


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, multi30k_dir):
    """Run every bad-input case in its own subprocess, a few at a time."""
    root = tmp_path_factory.mktemp("cli")
    served = mirror(root / "mirror", multi30k_dir)
    with http_server(served, truncate=True) as (url, _):
        cases = {}
        for name, make in CLI_CASES.items():
            base = root / name
            base.mkdir()
            case = make(base, url)
            run_dir = base / "run"
            run_dir.mkdir()
            (run_dir / "config.yaml").write_text(SENTINEL, encoding="utf-8")
            cases[name] = {**case, "base": base, "run_dir": run_dir, "cache": base / "nmt-cache"}
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = dict(zip(cases, pool.map(_run_cli, cases.values())))
    return {name: (cases[name], results[name]) for name in cases}


def _check_cli_case(case: dict, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), result.stderr
    assert lines[0].startswith("error:")
    for fragment in case["expect"]:
        assert fragment in lines[0]
    assert result.stdout == ""
    # nothing pre-existing in the run dir was overwritten, nothing was added
    run_dir = case["run_dir"]
    assert (run_dir / "config.yaml").read_text(encoding="utf-8") == SENTINEL
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]
    assert not list((case["cache"] / "prepared").glob("*/summary.json"))
    if "empty_dir" in case:
        assert files_under(case["empty_dir"]) == []


@pytest.mark.parametrize("name", [n for n in CLI_CASES if n != "path-with-brackets"])
def test_prepare_cli_reports_bad_input_in_one_line(cli_runs, name):
    _check_cli_case(*cli_runs[name])


def test_prepare_cli_prints_paths_with_brackets_verbatim(cli_runs):
    _check_cli_case(*cli_runs["path-with-brackets"])


def test_tsv_with_a_byte_order_mark_and_blank_lines(tmp_path, corpus, m30k):
    data, expected = build_tsv(tmp_path, corpus, m30k, None)
    for split in ("train", "valid", "test"):
        path = tmp_path / f"{split}.tsv"
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes() + b"\n\n")  # BOM; blank lines
    prepared = prepare(make_cfg(data))
    assert prepared.split("valid").texts("tgt") == strip_all(expected["valid"]["de"])


def test_attach_removes_tokenizer_models_of_an_earlier_setting(tmp_path):
    cfg = make_cfg({"limit_train": N_TRAIN, "limit_valid": N_VALID, "test": []})
    run = tmp_path / "run"
    attach(prepare(cfg), cfg, run)
    assert sorted(p.name for p in (run / "tokenizer").iterdir()) == ["spm.model"]
    separate = from_dict({**cfg.to_dict(), "tokenizer": {"vocab_size": 200, "joint": False}})
    attach(prepare(separate), separate, run)  # no checkpoint yet: the run may change its mind
    names = sorted(p.name for p in (run / "tokenizer").iterdir())
    assert "spm.model" not in names and len(names) == 2
