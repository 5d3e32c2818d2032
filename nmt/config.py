"""Typed, frozen recipe configuration: YAML file + dotted `--set` overrides.

A recipe has five sections: `data`, `tokenizer`, `model`, `train`, `decode`. Every key is
checked against the dataclass of its section: an unknown key, a wrong type or an invalid
value raises `ConfigError` naming the key and the valid choices. The `model` section is
typed by the dataclass that `nmt.models.configs.CONFIGS` names for `model.arch`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nmt import NMTError, first_line
from nmt.models.configs import CONFIGS, ModelConfig, TransformerConfig
from nmt.models.configs import arch_of as _arch_of

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 booleans: only true/false; `no`, `yes`, `on`, `off` stay strings
    (`no` is the language code of Norwegian). YAML 1.2 integers too: `010` is ten (YAML 1.1
    read it as octal 8) and `1:30` a string (it read 90, base 60); 0x and 0o prefixes as
    written. A key given twice in one mapping is an error (PyYAML keeps the last: a second
    `train:` section dropped the first one's keys)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                again = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: PyYAML says what is wrong with it
                continue
            if again:
                raise yaml.YAMLError(
                    f"key {key!r} is given twice (again at line {key_node.start_mark.line + 1}); "
                    "give each key once"
                )
        return super().construct_mapping(node, deep)


_YAML_1_1 = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML_1_1]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^[-+]?(?:0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|[0-9][0-9_]*)$"),
    list("-+0123456789"),
)


def _yaml_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    return int(text, 0) if re.match(r"[-+]?0[xXoO]", text) else int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _yaml_int)


class ConfigError(NMTError):
    pass


# data keys that say where and how the data is read, not what it is: in no prepared-data key
# (`Config.data_key`), free to change when a run resumes, and no difference between models
DATA_LOCATION = ("num_proc", "cache_dir", "local_dir", "download_url")


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel corpus comes from and how it is cleaned."""

    source: Literal["multi30k", "text", "tsv", "jsonl", "hub"] = "multi30k"
    src: str = "en"
    tgt: str = "de"
    # Split names for named corpora and hub datasets; path prefixes (`PREFIX.{src,tgt}[.gz]`)
    # for `text`; file paths for `tsv`/`jsonl`.
    train: str = "train"
    valid: str = "val"
    test: tuple[str, ...] = ("test_2016_flickr", "test_2017_flickr")
    local_dir: str | None = (
        None  # local copy of a named corpus; else $NMT_DATA_DIR/NAME, else download
    )
    download_url: str = MULTI30K_URL
    hub_name: str | None = None  # `datasets.load_dataset` path (Hub id or local dataset directory)
    hub_config: str | None = None
    src_field: str | None = None  # tsv header / jsonl key of the source side (default: data.src)
    tgt_field: str | None = None
    max_len: int = 128  # drop training pairs with more subword tokens than this on either side
    max_ratio: float = 3.0  # drop training pairs whose subword length ratio exceeds this
    limit_train: int | None = None  # keep only the first N training pairs (tiny recipes, tests)
    limit_valid: int | None = None
    limit_test: int | None = None  # keep only the first N pairs of each test split
    num_proc: int = 1
    cache_dir: str | None = None  # prepared-data cache; default $NMT_CACHE_DIR or ~/.cache/nmt

    def __post_init__(self) -> None:
        _check(self.max_len > 0, "data.max_len", "must be a positive integer")
        _check(self.max_ratio >= 1.0, "data.max_ratio", "must be >= 1.0")
        _check(self.num_proc >= 1, "data.num_proc", "must be >= 1")
        _check(self.src != self.tgt, "data.tgt", f"must differ from data.src ({self.src!r})")
        for key in ("limit_train", "limit_valid", "limit_test"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"data.{key}", "must be a positive integer or null")
        if self.source == "hub":
            _check(
                self.hub_name is not None, "data.hub_name", "is required when data.source is hub"
            )


@dataclass(frozen=True)
class TokenizerConfig:
    """Sentencepiece subwords, trained on the training split only."""

    type: Literal["bpe", "unigram"] = "bpe"
    joint: bool = True  # one vocabulary for both sides (required for tied embeddings)
    vocab_size: int = 8000
    character_coverage: float = 1.0
    input_sentence_size: int = 2_000_000  # sentences sampled for training on large corpora
    # sentencepiece's text normalization, applied to what it encodes (so decoded output comes
    # back normalized): nmt_nfkc (NFKC plus whitespace clean-up), nfkc, their case-folding
    # *_cf variants, or identity (text kept as it is: full-width punctuation in zh/ja).
    normalization: Literal["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"] = "nmt_nfkc"

    def __post_init__(self) -> None:
        _check(self.vocab_size >= 16, "tokenizer.vocab_size", "must be >= 16")
        _check(
            self.input_sentence_size == 0 or self.input_sentence_size > 100,
            "tokenizer.input_sentence_size",
            "must be > 100 (sentences sampled to train the tokenizer), or 0 for all of them",
        )
        _check(
            0.9 <= self.character_coverage <= 1.0,
            "tokenizer.character_coverage",
            "must be between 0.9 and 1.0",
        )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, budgets, precision, validation and checkpointing."""

    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    compile: bool = False
    batch_tokens: int = 4096  # max tokens per batch, padding included
    # A batch cut by batch_tokens holds a multiple of this many sentences (the leftovers begin
    # the next): its padded matrices' heights are multiples of it, so an epoch has fewer
    # distinct heights, and the CPU fewer oneDNN kernels to make and keep. 1 = any count.
    batch_multiple: int = 8
    accumulate: int = 1
    optimizer: Literal["adam", "adamw"] = "adam"
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 disables clipping
    schedule: Literal["inverse_sqrt", "cosine", "plateau", "constant"] = "inverse_sqrt"
    warmup_steps: int = 1000
    min_lr: float = 0.0
    plateau_factor: float = 0.5
    plateau_patience: int = 2
    label_smoothing: float = 0.1
    max_steps: int | None = None
    max_epochs: int | None = None
    max_minutes: float | None = None
    max_tokens: int | None = None  # target tokens trained on (all processes)
    log_every: int = 50
    valid_every: int = 1000  # steps; validation also runs at the end of training
    valid_bleu: bool = True  # decode the validation split and score BLEU/chrF
    valid_beam: int = 1
    valid_max_sentences: int | None = None
    early_stop_metric: Literal["bleu", "chrf", "loss"] = "bleu"
    patience: int | None = None  # validations without improvement before stopping
    save_every: int = 1000
    keep_last: int = 3
    # At the end of a finished run, average the weights of the last K saves (last.pt and the
    # newest step checkpoints), validate the average like any checkpoint, and keep it as
    # best.pt when it beats the best single one. 1 = off.
    average_last: int = 1
    max_nonfinite: int = 10  # consecutive non-finite losses before training stops
    tensorboard: bool = False
    # Bit-exact resume on CUDA: deterministic kernels (torch.use_deterministic_algorithms,
    # cuBLAS workspace, cuDNN), somewhat slower. CPU training is deterministic without it.
    deterministic: bool = False
    tf32: bool = True  # fp32 matmuls and convolutions on TensorFloat-32 units (CUDA, Ampere+)
    dist_timeout_minutes: float = 120.0  # how long ranks wait for each other (rank 0 validates)

    def __post_init__(self) -> None:
        _check(self.batch_tokens >= 16, "train.batch_tokens", "must be >= 16")
        _check(self.batch_multiple >= 1, "train.batch_multiple", "must be >= 1")
        _check(self.accumulate >= 1, "train.accumulate", "must be >= 1")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "train.betas",
            "must be two numbers in [0, 1), e.g. [0.9, 0.98]",
        )
        _check(self.eps > 0, "train.eps", "must be > 0")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(self.clip_norm >= 0, "train.clip_norm", "must be >= 0 (0 disables clipping)")
        _check(self.min_lr >= 0, "train.min_lr", "must be >= 0")
        _check(0.0 < self.plateau_factor < 1.0, "train.plateau_factor", "must be in (0, 1)")
        _check(self.plateau_patience >= 0, "train.plateau_patience", "must be >= 0")
        _check(
            self.patience is None or self.patience >= 1,
            "train.patience",
            "must be >= 1 (validations without improvement), or null for no early stopping",
        )
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        budgets = (self.max_steps, self.max_epochs, self.max_minutes, self.max_tokens)
        _check(
            any(x is not None for x in budgets),
            "train.max_steps",
            "set at least one budget: train.max_steps, train.max_epochs, train.max_minutes or "
            "train.max_tokens",
        )
        _check(
            self.schedule != "cosine" or self.max_steps is not None or self.max_epochs is not None,
            "train.schedule",
            "cosine decays to train.min_lr at the last step, so it needs train.max_steps or "
            "train.max_epochs (train.max_minutes alone does not say when that step comes)",
        )
        for key in (
            "max_steps",
            "max_epochs",
            "max_tokens",
            "log_every",
            "valid_every",
            "save_every",
        ):
            value = getattr(self, key)
            _check(value is None or value > 0, f"train.{key}", "must be a positive integer")
        _check(self.max_minutes is None or self.max_minutes > 0, "train.max_minutes", "must be > 0")
        _check(self.keep_last >= 0, "train.keep_last", "must be >= 0")
        _check(
            1 <= self.average_last <= self.keep_last + 1,
            "train.average_last",
            f"must be between 1 (off) and train.keep_last + 1 = {self.keep_last + 1} "
            "(the step checkpoints kept plus last.pt)",
        )
        _check(self.valid_beam >= 1, "train.valid_beam", "must be >= 1")
        _check(self.seed >= 0, "train.seed", "must be >= 0")
        _check(
            self.valid_max_sentences is None or self.valid_max_sentences > 0,
            "train.valid_max_sentences",
            "must be a positive integer, or null for the whole validation split",
        )
        _check(self.max_nonfinite >= 1, "train.max_nonfinite", "must be >= 1")
        _check(self.dist_timeout_minutes > 0, "train.dist_timeout_minutes", "must be > 0")


# Bounds of an output length limit a * |source| + b: far past any translation, and within
# what the search's integer lengths hold.
MAX_LEN_A = 100.0
MAX_LEN_B = 1_000_000


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings used by validation, `nmt translate`, `nmt evaluate` and `nmt compare`."""

    beam: int = 5
    nbest: int = 1
    length_penalty: float = 1.0  # alpha; 0 = raw log-probability
    # How a hypothesis' log-probability is normalised by its length |y| (tokens and EOS):
    # gnmt divides by ((5 + |y|) / 6) ** alpha (Wu et al. 2016), plain by |y| ** alpha (as
    # CTranslate2, OpenNMT and Marian do; `--engine ctranslate2` beam search needs it).
    length_norm: Literal["gnmt", "plain"] = "gnmt"
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_len: int = 1
    no_repeat_ngram: int = 0
    ban_unk: bool = False  # never output <unk> (the tokenizer's piece for unseen characters)
    # When beam search ends a sentence: null, once no live hypothesis can beat its `beam` best
    # finished ones (exact); P, once round(beam * P) hypotheses have finished (CTranslate2's
    # `patience`; `--engine ctranslate2` uses 1 when this is null).
    patience: float | None = None
    batch_tokens: int = 6000
    workers: int = 0  # batches decoded at once on CPU, sharing the cores; 0 = auto
    # int8: linear maps on int8 weights, the rest in fp32 (CPU; `nmt.models.layers.int8_linears`)
    precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] = "auto"

    def nbest_within(self, beam: int) -> int:
        """The n-best this decode section keeps when decoding with another `beam` (`nmt
        translate --beam`, a served default beam, a request's beam): its own, at most `beam`."""
        return min(self.nbest, beam)

    def __post_init__(self) -> None:
        _check(self.beam >= 1, "decode.beam", "must be >= 1")
        _check(1 <= self.nbest <= self.beam, "decode.nbest", "must be between 1 and decode.beam")
        _check(
            0 <= self.max_len_a <= MAX_LEN_A,
            "decode.max_len_a",
            f"must be in [0, {MAX_LEN_A:g}] (output tokens per source token)",
        )
        _check(
            1 <= self.max_len_b <= MAX_LEN_B, "decode.max_len_b", f"must be in [1, {MAX_LEN_B:,}]"
        )
        _check(self.batch_tokens >= 16, "decode.batch_tokens", "must be >= 16")
        _check(self.workers >= 0, "decode.workers", "must be >= 0 (0 = auto)")
        _check(self.min_len >= 0, "decode.min_len", "must be >= 0")
        _check(
            0 <= self.length_penalty < math.inf,
            "decode.length_penalty",
            "must be >= 0 (beam search stops early on a bound that holds for alpha >= 0)",
        )
        _check(self.no_repeat_ngram >= 0, "decode.no_repeat_ngram", "must be >= 0 (0 = off)")
        _check(
            self.patience is None or 0 < self.patience < math.inf,
            "decode.patience",
            "must be > 0 and finite, or null for the exact stopping rule",
        )


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=TransformerConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000))
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("data", "tokenizer", "model", "train", "decode"):
            section = _plain(dataclasses.asdict(getattr(self, name)))
            if name == "model":
                section = {"arch": arch_of(self.model), **section}
            out[name] = section
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """8 hex digits naming the config, or only its `sections` (`nmt compare` names its run
        folders by what trains the weights). Keys added to the config later are left out while
        they hold the value every run had before them (`LATER_KEYS`): an older run keeps its
        digest, and its folder is reused."""
        d = self.to_dict()
        for (section, key), before in LATER_KEYS.items():
            if d[section].get(key) == before:
                del d[section][key]
        if sections is not None:
            d = {k: d[k] for k in sections}
        text = yaml.safe_dump(d, sort_keys=False, allow_unicode=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def data_key(self) -> str:
        """Hash of everything that determines the prepared data (data + tokenizer sections)."""
        d = self.to_dict()
        payload = {"data": dict(d["data"]), "tokenizer": d["tokenizer"]}
        data = payload["data"]
        for volatile in DATA_LOCATION:
            data.pop(volatile)
        # settings this source does not read, or that say what it reads anyway: as unset
        if data["source"] not in ("tsv", "jsonl", "hub"):
            data["src_field"] = data["tgt_field"] = None
        for side in ("src", "tgt"):
            if data[f"{side}_field"] == data[side]:
                data[f"{side}_field"] = None
        if data["source"] != "hub":
            data["hub_name"] = data["hub_config"] = None
        if payload["tokenizer"]["normalization"] == "nmt_nfkc":  # the key from before the option
            del payload["tokenizer"]["normalization"]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# (section, key) of options added after runs were made, with the value those runs had.
LATER_KEYS: dict[tuple[str, str], Any] = {
    ("decode", "length_norm"): "gnmt",
    ("decode", "patience"): None,
    ("train", "max_tokens"): None,
    ("train", "deterministic"): False,
    ("train", "tf32"): True,
    ("train", "dist_timeout_minutes"): 120.0,
    ("train", "batch_multiple"): 1,
}


def as_it_ran(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's written config (always whole) with the `LATER_KEYS` it lacks set to the values
    it ran with: one written by an older nmt then resumes as it began (batches packed as
    before, `train.batch_multiple` 1), instead of taking a later key's new default."""
    out = {name: dict(v) if isinstance(v, dict) else v for name, v in raw.items()}
    for (section, key), before in LATER_KEYS.items():
        if isinstance(out.get(section), dict):
            out[section].setdefault(key, before)
    return out


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
}


def arch_of(model_config: ModelConfig) -> str:
    """The architecture name of a model config (`model.arch`)."""
    try:
        return _arch_of(model_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value for {key}: {message}")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it in canonical form."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"bad value for {key}: {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"bad value for {key}: {value!r}; valid choices: {', '.join(map(str, choices))}"
            )
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str) and args[-1] is Ellipsis:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"bad type for {key}: expected a list, got {value!r}")
        if args[-1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"bad value for {key}: expected {len(args)} items, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"bad type for {key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"bad type for {key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads exponents without a dot (1e-4) as strings
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"bad type for {key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"bad type for {key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"bad type for {key}: cannot read {value!r} as {_type_name(tp)}")


def build_section(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, rejecting unknown keys and bad types."""
    if not isinstance(values, dict):
        raise ConfigError(f"bad type for {prefix}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(
                f"unknown key {prefix}.{key}; valid keys in {prefix}: {', '.join(names)}"
            )
        kwargs[key] = _coerce(f"{prefix}.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ValueError as e:  # models' own __post_init__ checks
        raise ConfigError(f"invalid value in {prefix}: {e}") from None


def from_dict(raw: dict[str, Any]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(
            "a recipe must be a YAML mapping with sections data, tokenizer, model, train, decode"
        )
    valid = ["data", "tokenizer", "model", "train", "decode"]
    for key in raw:
        if key not in valid:
            raise ConfigError(f"unknown key {key}; valid sections: {', '.join(valid)}")
        if raw[key] is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"bad type for {key}: expected a mapping of keys, got {raw[key]!r}")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        values = raw.get(name) or {}
        if name == "train" and not any(
            k in values for k in ("max_steps", "max_epochs", "max_minutes", "max_tokens")
        ):
            values = {**values, "max_steps": 1000}
        sections[name] = build_section(cls, values, name)
    model_raw = dict(raw.get("model") or {})
    arch = model_raw.pop("arch", "transformer")
    if not isinstance(arch, str) or arch not in CONFIGS:
        raise ConfigError(
            f"bad value for model.arch: {arch!r}; valid choices: {', '.join(CONFIGS)}"
        )
    sections["model"] = build_section(CONFIGS[arch], model_raw, "model")
    return Config(**sections)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"bad override {item!r}: write --set section.key=value")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"bad override {item!r}: write --set section.key=value")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))  # deep copy
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"bad override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path} (give the path to a recipe YAML file)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot parse recipe {path}: {first_line(e)}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(
            f"cannot parse recipe {path}: expected a mapping with sections data, tokenizer, "
            "model, train, decode"
        )
    return raw or {}


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a recipe file and apply `section.key=value` overrides."""
    raw = read_yaml(Path(path))
    return from_dict(apply_overrides(raw, overrides or []))


def replace(cfg: Config, overrides: list[str]) -> Config:
    return from_dict(apply_overrides(cfg.to_dict(), overrides))
