"""Sentencepiece subword tokenizer: training on the training split, encoding, decoding.

Special ids are fixed for every model (see `nmt.special`): pad 0, unk 1, bos 2, eos 3.
A joint tokenizer is one file `spm.model`; separate ones are `spm.src.model` and `spm.tgt.model`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

from nmt import NMTError
from nmt.config import TokenizerConfig
from nmt.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID

if TYPE_CHECKING:  # annotations only: translating does not import datasets (~0.7 s)
    import datasets

JOINT, SRC, TGT = "spm.model", "spm.src.model", "spm.tgt.model"


def _sentences(ds: datasets.Dataset, columns: tuple[str, ...]) -> Iterator[str]:
    for batch in ds.iter(batch_size=10_000):
        for column in columns:
            for line in batch[column]:
                if line:
                    yield line


def _train_one(
    ds: datasets.Dataset, columns: tuple[str, ...], cfg: TokenizerConfig, out: Path
) -> None:
    prefix = str(out.with_suffix(""))
    spm.set_random_generator_seed(0)  # sampling of input_sentence_size lines: reproducible
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(ds, columns),
            model_prefix=prefix,
            model_type=cfg.type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            normalization_rule_name=cfg.normalization,
            input_sentence_size=cfg.input_sentence_size,
            shuffle_input_sentence=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            minloglevel=2,
            num_threads=2,
        )
    except RuntimeError as e:
        message = str(e)
        m = re.search(r"<= (\d+)", message)
        small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
        if small:  # fewer pieces than the characters sentencepiece must keep
            raise NMTError(
                f"tokenizer.vocab_size={cfg.vocab_size} is too small for the {small.group(2)} "
                f"characters this training data needs; raise it with --set "
                f"tokenizer.vocab_size=N (or lower tokenizer.character_coverage)"
            ) from None
        if "Vocabulary size" in message or "vocab_size" in message:
            hint = f" (at most {m.group(1)} for this corpus)" if m else ""
            raise NMTError(
                f"tokenizer.vocab_size={cfg.vocab_size} is too large for this training data{hint}; "
                "lower it with --set tokenizer.vocab_size=N"
            ) from None
        raise NMTError(f"sentencepiece training failed: {message.splitlines()[0]}") from None


def same_vocabulary(a: Path, b: Path) -> bool:
    """Whether two sentencepiece models give every id the same piece (and kind): a tokenizer
    trained again on the same data (its file differs in the paths it records)."""

    def pieces(path: Path) -> list[tuple]:
        sp = _load(path)
        return [
            (sp.id_to_piece(i), sp.is_control(i), sp.is_unknown(i))
            for i in range(sp.get_piece_size())
        ]

    return pieces(a) == pieces(b)


def train_tokenizer(ds: datasets.Dataset, cfg: TokenizerConfig, out_dir: Path) -> None:
    """Train sentencepiece model(s) on the training split into `out_dir`."""
    if cfg.joint:
        _train_one(ds, ("src", "tgt"), cfg, out_dir / JOINT)
    else:
        _train_one(ds, ("src",), cfg, out_dir / SRC)
        _train_one(ds, ("tgt",), cfg, out_dir / TGT)


def _load(path: Path) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):  # sentencepiece: "could not parse ModelProto"
        raise NMTError(
            f"{path} is not a sentencepiece model (damaged?); copy it again from the run or "
            "the prepared data"
        ) from None


# Below this many items, sentencepiece is called once per item: its batch call starts a pool
# of threads each time, ~0.15-0.3 ms however short the list (a server's stream encodes the few
# lines it takes in and decodes the few that end at each step), while one short line encodes
# in ~10 us and decodes in ~6 us. Measured on the 2-core Zen 4 machine: 1 line encoded in
# 326 us as a list, 50 us alone; 64 lines 1,385 against 814 us; 500 lines 3,779 against
# 6,499 us (decoding 1 line: 161 against 18 us).
BATCH_CALL = 256


def _batched(call, items: list) -> list:
    """`call` (a sentencepiece encode or decode) of every item, in one batch call (threads)
    for long lists only (`BATCH_CALL`)."""
    if len(items) >= BATCH_CALL:
        return call(items)
    return [call(item) for item in items]


class Tokenizer:
    """Source and target sentencepiece processors (the same one when the vocabulary is joint)."""

    def __init__(self, src_model: Path, tgt_model: Path) -> None:
        self.src_model, self.tgt_model = Path(src_model), Path(tgt_model)
        for path in {self.src_model, self.tgt_model}:
            if not path.is_file():
                raise NMTError(f"tokenizer model not found: {path}; run `nmt prepare` first")
        self.src = _load(self.src_model)
        self.tgt = self.src if self.src_model == self.tgt_model else _load(self.tgt_model)

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenizer:
        directory = Path(directory)
        if (directory / JOINT).is_file():
            return cls(directory / JOINT, directory / JOINT)
        return cls(directory / SRC, directory / TGT)

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def files(self) -> list[Path]:
        return sorted({self.src_model, self.tgt_model})

    def encode_src(self, lines: list[str]) -> list[list[int]]:
        return _batched(self.src.encode, lines)

    def encode_tgt(self, lines: list[str]) -> list[list[int]]:
        return _batched(self.tgt.encode, lines)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        return _batched(self.tgt.decode, ids)

    def src_pieces(self, line: str) -> list[str]:
        return self.src.encode(line, out_type=str)

    def encode_src_pieces(self, lines: list[str]) -> list[list[str]]:
        """The source pieces of every line (what CTranslate2 translates)."""
        return _batched(lambda x: self.src.encode(x, out_type=str), lines)

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_piece(i) for i in ids]


class Encoder:
    """Picklable batch function for `datasets.map(num_proc=...)`: text -> ids and lengths."""

    def __init__(self, src_model: str, tgt_model: str) -> None:
        self.src_model, self.tgt_model = src_model, tgt_model
        self._tok: Tokenizer | None = None

    def __getstate__(self) -> dict:
        return {"src_model": self.src_model, "tgt_model": self.tgt_model, "_tok": None}

    def __call__(self, batch: dict) -> dict:
        if self._tok is None:
            self._tok = Tokenizer(Path(self.src_model), Path(self.tgt_model))
        src = [s.strip() for s in batch["src"]]
        tgt = [t.strip() for t in batch["tgt"]]
        src_ids, tgt_ids = self._tok.encode_src(src), self._tok.encode_tgt(tgt)
        return {
            "src": src,
            "tgt": tgt,
            "src_ids": src_ids,
            "tgt_ids": tgt_ids,
            "src_len": [len(x) for x in src_ids],
            "tgt_len": [len(x) for x in tgt_ids],
        }
