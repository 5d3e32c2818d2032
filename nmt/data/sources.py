"""Parallel corpora as Hugging Face `datasets` (Arrow-backed, cached) with columns src, tgt.

Source kinds: a pair of plain-text files (optionally .gz), TSV or JSONL files with named
fields, a dataset on the Hugging Face Hub (or saved locally) with a `translation` field, and
named corpora (multi30k) downloaded with integrity checks, or read from a local copy (checked
against the same checksums: a copy that differs is used, with a warning).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nmt import NMTError, first_line
from nmt.config import DataConfig

if TYPE_CHECKING:  # imported where a corpus is read: a prepared run never needs it
    import datasets

log = logging.getLogger(__name__)


def features() -> datasets.Features:
    """The columns of a raw corpus: src and tgt text."""
    import datasets

    return datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})


@dataclass(frozen=True)
class Corpus:
    languages: tuple[str, ...]
    splits: dict[str, tuple[str, ...]]  # split -> languages available
    sha256: dict[str, str]  # file name -> checksum


MULTI30K = Corpus(
    languages=("en", "de", "fr", "cs"),
    splits={
        "train": ("en", "de", "fr", "cs"),
        "val": ("en", "de", "fr", "cs"),
        "test_2016_flickr": ("en", "de", "fr", "cs"),
        "test_2017_flickr": ("en", "de", "fr"),
    },
    sha256={
        "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
        "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
        "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
        "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
        "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
        "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
        "test_2017_flickr.fr.gz": "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496",
        "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
        "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
        "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
        "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
        "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
        "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
        "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
        "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    },
)
CORPORA = {"multi30k": MULTI30K}


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    env = os.environ.get("NMT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "nmt"


# -- reading text files ---------------------------------------------------------------------


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_lines(path: Path) -> Iterator[str]:
    """Lines of a UTF-8 text file (optionally gzip), split on \\n only, without line ends or
    a byte-order mark."""
    if not path.is_file():
        raise NMTError(f"file not found: {path} (check the path in the recipe's data section)")
    try:
        with _open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                if number == 1:  # a byte-order mark is not text (it became a token)
                    raw = raw.removeprefix(b"\xef\xbb\xbf")
                try:
                    yield raw.rstrip(b"\r\n").decode("utf-8")
                except UnicodeDecodeError as e:
                    raise NMTError(
                        f"{path}, line {number}: bytes that are not UTF-8 ({e.reason} at byte "
                        f"{e.start}); re-encode the file as UTF-8"
                    ) from None
    except (OSError, EOFError, zlib.error) as e:
        raise NMTError(f"cannot read {path}: {e} (is the file truncated or not gzip?)") from None


def count_lines(path: Path) -> int:
    with _open_binary(path) as f:
        return sum(1 for _ in f)


def _text_pairs(src_path: str, tgt_path: str, fingerprint: str) -> Iterator[dict[str, str]]:
    """Zip two line-aligned files; a length mismatch names both files and both counts."""
    del fingerprint  # part of gen_kwargs so the datasets cache notices changed files
    src_lines, tgt_lines = read_lines(Path(src_path)), read_lines(Path(tgt_path))
    n = 0
    for src in src_lines:
        tgt = next(tgt_lines, None)
        if tgt is None:
            _mismatch(src_path, n + 1 + sum(1 for _ in src_lines), tgt_path, n)
        n += 1
        yield {"src": src, "tgt": tgt}
    extra = sum(1 for _ in tgt_lines)
    if extra:
        _mismatch(src_path, n, tgt_path, n + extra)


def _mismatch(src_path: str, n_src: int, tgt_path: str, n_tgt: int) -> None:
    raise NMTError(
        f"line counts differ: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}; "
        "parallel files must be line-aligned"
    )


def _tsv_pairs(path: str, src_field: str, tgt_field: str, fingerprint: str) -> Iterator[dict]:
    del fingerprint
    lines = read_lines(Path(path))
    header = next(lines, None)
    if header is None:
        return
    names = header.split("\t")
    for field_name in (src_field, tgt_field):
        if field_name not in names:
            raise NMTError(
                f"{path}: no column {field_name!r} in the header ({', '.join(names)}); "
                "set data.src_field/data.tgt_field"
            )
    i, j = names.index(src_field), names.index(tgt_field)
    for number, line in enumerate(lines, start=2):
        if not line.strip():  # blank lines (a trailing one, say) are skipped, as in jsonl
            continue
        cols = line.split("\t")
        if len(cols) != len(names):
            raise NMTError(
                f"{path}, line {number}: expected {len(names)} tab-separated fields, got {len(cols)}"
            )
        yield {"src": cols[i], "tgt": cols[j]}


def _field(record: dict, name: str) -> object:
    if name in record:
        return record[name]
    translation = record.get("translation")
    if isinstance(translation, dict) and name in translation:
        return translation[name]
    return None


def _jsonl_pairs(path: str, src_field: str, tgt_field: str, fingerprint: str) -> Iterator[dict]:
    del fingerprint
    for number, line in enumerate(read_lines(Path(path)), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise NMTError(f"{path}, line {number}: invalid JSON ({e.msg})") from None
        src, tgt = (
            (_field(record, src_field), _field(record, tgt_field))
            if isinstance(record, dict)
            else (None, None)
        )
        if not isinstance(src, str) or not isinstance(tgt, str):
            raise NMTError(
                f"{path}, line {number}: needs string fields {src_field!r} and {tgt_field!r} "
                "(or translation.{lang}); set data.src_field/data.tgt_field"
            )
        yield {"src": src, "tgt": tgt}


def fingerprint(*paths: Path) -> str:
    parts = []
    for p in paths:
        st = p.stat()
        parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _user_error(e: Exception) -> Exception:
    """The NMTError that `datasets` wrapped (raised inside a generator or map), else `e`."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, NMTError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return e


def _from_generator(generator, kwargs: dict, cache_dir: Path) -> datasets.Dataset:
    import datasets

    with contextlib.closing(generator(**kwargs)) as pairs:
        empty = next(pairs, None) is None
    if empty:  # datasets refuses to build a dataset from no rows; the caller says what is wrong
        return datasets.Dataset.from_dict({"src": [], "tgt": []}, features=features())
    try:
        return datasets.Dataset.from_generator(
            generator, gen_kwargs=kwargs, features=features(), cache_dir=str(cache_dir)
        )
    except Exception as e:  # datasets wraps errors raised inside the generator
        raise _user_error(e) from None


def resolve_text(prefix: str, lang: str) -> Path:
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise NMTError(
        f"file not found: {prefix}.{lang} (or {prefix}.{lang}.gz); text sources are path "
        "prefixes PREFIX.{src,tgt}[.gz]"
    )


# -- named corpora --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, sha256: str) -> None:
    """Fetch `url` into `dest` atomically, refusing a truncated or corrupt file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    expected = response.headers.get("Content-Length")
                    shutil.copyfileobj(response, out)
            except (urllib.error.URLError, OSError, ValueError) as e:
                raise NMTError(
                    f"cannot download {url}: {e}; check the network or set NMT_DATA_DIR to a "
                    "local copy of the corpus"
                ) from None
            out.flush()
            os.fsync(out.fileno())
        size = os.path.getsize(tmp)
        if expected is not None and int(expected) != size:
            raise NMTError(
                f"download of {url} is truncated ({size} of {expected} bytes); run the command again"
            )
        actual = _sha256(Path(tmp))
        if actual != sha256:
            raise NMTError(
                f"download of {url} is corrupt (sha256 {actual[:12]}..., expected {sha256[:12]}...); "
                "run the command again or use a local copy via NMT_DATA_DIR"
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def local_copy(cfg: DataConfig) -> Path | None:
    """The folder of a named corpus' local copy (data.local_dir, else $NMT_DATA_DIR/<corpus>);
    None when its files are downloaded."""
    if cfg.local_dir:
        return Path(cfg.local_dir)
    if os.environ.get("NMT_DATA_DIR"):
        return Path(os.environ["NMT_DATA_DIR"]) / cfg.source
    return None


def _file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=512)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, hashed again only when its size or modification time changes."""
    del size, mtime_ns  # the cache key
    return _sha256(Path(path))


def edited_local_files(cfg: DataConfig, splits: Iterable[str]) -> str:
    """What tells a named corpus' local copy from the published files, for the prepared-data
    key: the name and sha256 of every file of `splits` (source and target) that is not the
    published one; "" when all are (or the files come from verified downloads), so the
    published data has one key wherever it is read from. Missing files and unknown names
    are left to `corpus_file` to report."""
    corpus, local = CORPORA[cfg.source], local_copy(cfg)
    if local is None:
        return ""
    edited = []
    for split in splits:
        for lang in (cfg.src, cfg.tgt):
            name = f"{split}.{lang}.gz"
            path = local / name
            if name in corpus.sha256 and path.is_file():
                digest = _file_sha256(path)
                if digest != corpus.sha256[name]:
                    edited.append(f"{name}:{digest}")
    return "|".join(edited)


def corpus_file(cfg: DataConfig, split: str, lang: str) -> Path:
    """Path of a named corpus file: local copy if configured, else a verified download."""
    corpus = CORPORA[cfg.source]
    if split not in corpus.splits:
        raise NMTError(
            f"unknown split {split!r} for {cfg.source}; valid splits: {', '.join(corpus.splits)}"
        )
    if lang not in corpus.splits[split]:
        raise NMTError(
            f"unknown language {lang!r} for {cfg.source} split {split}; valid languages: "
            f"{', '.join(corpus.splits[split])}"
        )
    name = f"{split}.{lang}.gz"
    local = local_copy(cfg)
    if local:
        path = local / name
        if not path.is_file():
            raise NMTError(
                f"file not found: {path}; the local copy of {cfg.source} (data.local_dir or "
                f"$NMT_DATA_DIR/{cfg.source}) must hold {name}"
            )
        actual, expected = _file_sha256(path), corpus.sha256[name]
        if actual != expected:  # a slice or an edited copy may be intended: say so, go on
            log.warning(
                f"{path} is not the published {cfg.source} {name} (sha256 {actual[:12]}..., "
                f"expected {expected[:12]}...): scores will not compare with published ones"
            )
        return path
    path = cache_root(cfg) / "corpora" / cfg.source / name
    if not path.is_file():
        download(f"{cfg.download_url.rstrip('/')}/{name}", path, corpus.sha256[name])
    return path


# -- one entry point ------------------------------------------------------------------------


def load_split(cfg: DataConfig, split: str, work_dir: Path) -> datasets.Dataset:
    """One split as a Dataset with string columns src, tgt (unstripped, unfiltered)."""
    cache = work_dir / "datasets-cache"
    src_field, tgt_field = cfg.src_field or cfg.src, cfg.tgt_field or cfg.tgt
    if cfg.source in CORPORA:
        for lang in (cfg.src, cfg.tgt):
            if lang not in CORPORA[cfg.source].languages:
                raise NMTError(
                    f"unknown language {lang!r} for {cfg.source}; valid languages: "
                    f"{', '.join(CORPORA[cfg.source].languages)}"
                )
        paths = [corpus_file(cfg, split, cfg.src), corpus_file(cfg, split, cfg.tgt)]
        return _from_generator(
            _text_pairs,
            {
                "src_path": str(paths[0]),
                "tgt_path": str(paths[1]),
                "fingerprint": fingerprint(*paths),
            },
            cache,
        )
    if cfg.source == "text":
        paths = [resolve_text(split, cfg.src), resolve_text(split, cfg.tgt)]
        return _from_generator(
            _text_pairs,
            {
                "src_path": str(paths[0]),
                "tgt_path": str(paths[1]),
                "fingerprint": fingerprint(*paths),
            },
            cache,
        )
    if cfg.source in ("tsv", "jsonl"):
        path = Path(split)
        if not path.is_file():
            raise NMTError(f"file not found: {path} (check data.train/valid/test in the recipe)")
        generator = _tsv_pairs if cfg.source == "tsv" else _jsonl_pairs
        kwargs = {"path": str(path), "src_field": src_field, "tgt_field": tgt_field}
        return _from_generator(generator, {**kwargs, "fingerprint": fingerprint(path)}, cache)
    return _load_hub(cfg, split, src_field, tgt_field, cache)


def _load_hub(
    cfg: DataConfig, split: str, src_field: str, tgt_field: str, cache: Path
) -> datasets.Dataset:
    import datasets

    name = cfg.hub_name or ""
    try:
        if (Path(name) / "dataset_dict.json").is_file():  # saved with DatasetDict.save_to_disk
            ds = datasets.load_from_disk(name)[split]
        else:
            ds = datasets.load_dataset(name, cfg.hub_config, split=split)
    except KeyError:
        raise NMTError(
            f"dataset {name} has no split {split!r}; check data.train/valid/test"
        ) from None
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        raise NMTError(f"cannot load dataset {name!r} split {split!r}: {first_line(e)}") from None
    except datasets.exceptions.DatasetGenerationError as e:  # a data file it cannot read
        why = first_line(e.__cause__ or e)
        raise NMTError(f"cannot load dataset {name!r} split {split!r}: {why}") from None
    if "translation" not in ds.column_names:
        raise NMTError(
            f"dataset {name} has no 'translation' field (columns: {', '.join(ds.column_names)})"
        )

    def pick(batch: dict, indices: list[int]) -> dict:
        rows = batch["translation"]
        for row, index in zip(rows, indices):  # every row: a bad one was a traceback
            if not isinstance(row, dict):
                raise NMTError(
                    f"dataset {name} split {split}, row {index}: 'translation' is not a mapping "
                    "of language codes to texts"
                )
            for field_name in (src_field, tgt_field):
                if not isinstance(row.get(field_name), str):
                    what = "no" if row.get(field_name) is None else "a non-text"
                    raise NMTError(
                        f"dataset {name} split {split}, row {index}: translation has {what} "
                        f"{field_name!r} text"
                    )
        return {"src": [r[src_field] for r in rows], "tgt": [r[tgt_field] for r in rows]}

    cache.mkdir(parents=True, exist_ok=True)
    try:  # written to our cache, never beside a local dataset's own files
        return ds.map(
            pick,
            batched=True,
            with_indices=True,
            remove_columns=ds.column_names,
            features=features(),
            cache_file_name=str(cache / f"hub-{split}.arrow"),
        )
    except Exception as e:  # datasets wraps errors raised inside the map function
        raise _user_error(e) from None
