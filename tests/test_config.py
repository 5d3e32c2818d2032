"""Recipe configuration: strict typing, overrides, architecture selection, round trips, data key."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from nmt import NMTError, config
from nmt.config import (
    Config,
    ConfigError,
    DataConfig,
    DecodeConfig,
    TokenizerConfig,
    TrainConfig,
    from_dict,
    load,
)
from nmt.models.configs import CONFIGS

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
SECTION_CLASSES = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
}


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    return str(info.value)


def write_recipe(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def literal_choices(cls: type, key: str) -> tuple:
    tp = typing.get_type_hints(cls)[key]
    assert typing.get_origin(tp) is typing.Literal
    return typing.get_args(tp)


# -- defaults --------------------------------------------------------------------------------


def test_empty_recipe_gives_defaults_with_a_training_budget():
    cfg = from_dict({})
    assert cfg == Config()
    assert cfg.data == DataConfig()
    assert cfg.tokenizer == TokenizerConfig()
    assert type(cfg.model) is CONFIGS["transformer"]
    assert cfg.train.max_steps == 1000  # a budget is always present
    assert from_dict({"train": {"max_epochs": 2}}).train.max_steps is None


def test_config_error_is_an_nmt_error_and_config_is_frozen():
    assert issubclass(ConfigError, NMTError)
    cfg = from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.src = "fr"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = TrainConfig(max_steps=1)  # type: ignore[misc]


# -- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("section", ["data", "tokenizer", "model", "train", "decode"])
def test_unknown_key_in_every_section_names_the_key_and_the_valid_keys(section):
    message = error_of({section: {"no_such_key": 1}})
    assert f"unknown key {section}.no_such_key" in message
    cls = SECTION_CLASSES.get(section, CONFIGS["transformer"])
    for field in dataclasses.fields(cls):
        assert field.name in message


def test_unknown_key_next_to_valid_keys_is_still_rejected():
    message = error_of({"train": {"lr": 0.1, "max_steps": 5, "lrr": 0.1}})
    assert "train.lrr" in message


def test_unknown_top_level_section_names_it_and_lists_sections():
    message = error_of({"data": {}, "optimiser": {"lr": 1}})
    assert "unknown key optimiser" in message
    for name in ("data", "tokenizer", "model", "train", "decode"):
        assert name in message


def test_model_keys_are_checked_against_the_chosen_architecture():
    # d_model is a transformer key, not a seq2seq one
    message = error_of({"model": {"arch": "seq2seq", "d_model": 64}})
    assert "model.d_model" in message
    assert "hidden" in message  # lists the seq2seq keys
    assert from_dict({"model": {"arch": "seq2seq", "hidden": 64}}).model.hidden == 64


# -- wrong types and invalid values ----------------------------------------------------------


WRONG_TYPES = [
    ({"train": {"lr": "abc"}}, ["train.lr", "'abc'", "number"]),
    ({"train": {"lr": True}}, ["train.lr", "number"]),
    ({"tokenizer": {"joint": 3}}, ["tokenizer.joint", "true or false", "3"]),
    ({"tokenizer": {"joint": "yes please"}}, ["tokenizer.joint", "true or false"]),
    ({"tokenizer": {"vocab_size": 8000.5}}, ["tokenizer.vocab_size", "integer"]),
    ({"tokenizer": {"vocab_size": True}}, ["tokenizer.vocab_size", "integer"]),
    ({"train": {"max_steps": "10"}}, ["train.max_steps", "integer"]),
    ({"data": {"src": 5}}, ["data.src", "string"]),
    ({"data": {"limit_train": "many"}}, ["data.limit_train", "integer"]),
    ({"data": {"test": 5}}, ["data.test", "list"]),
    ({"data": {"test": ["a", 3]}}, ["data.test[1]", "string"]),
    ({"train": {"betas": [0.9]}}, ["train.betas", "2 items"]),
    ({"train": {"betas": [0.9, "x"]}}, ["train.betas[1]", "number"]),
    ({"model": {"d_model": "big"}}, ["model.d_model", "integer"]),
    ({"decode": {"beam": 2.5}}, ["decode.beam", "integer"]),
    ({"train": 5}, ["train", "mapping"]),
    ({"data": ["en", "de"]}, ["data", "mapping"]),
    ({"model": "transformer"}, ["model", "mapping"]),
]


@pytest.mark.parametrize(
    "raw, fragments", WRONG_TYPES, ids=[json.dumps(raw) for raw, _ in WRONG_TYPES]
)
def test_wrong_type_names_the_key(raw, fragments):
    message = error_of(raw)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "cls, section, key, bad",
    [
        (TrainConfig, "train", "precision", "bf17"),
        (TrainConfig, "train", "device", "tpu"),
        (TrainConfig, "train", "schedule", "linear"),
        (TrainConfig, "train", "optimizer", "sgd"),
        (TokenizerConfig, "tokenizer", "type", "wordpiece"),
        (DataConfig, "data", "source", "csv"),
        (DecodeConfig, "decode", "precision", "fp8"),
        (DecodeConfig, "decode", "length_norm", "average"),
    ],
)
def test_literal_value_outside_choices_lists_every_valid_choice(cls, section, key, bad):
    message = error_of({section: {key: bad}})
    assert f"{section}.{key}" in message
    assert repr(bad) in message
    choices = literal_choices(cls, key)
    assert f"valid choices: {', '.join(choices)}" in message


def test_model_literal_choices_are_listed():
    message = error_of({"model": {"norm": "middle"}})
    assert "model.norm" in message and "pre, post" in message


@pytest.mark.parametrize("arch", ["lstm", ["transformer"], 3])
def test_unknown_architecture_lists_the_registered_ones(arch):
    message = error_of({"model": {"arch": arch}})
    assert "model.arch" in message
    for name in CONFIGS:
        assert name in message


INVALID_VALUES = [
    ({"tokenizer": {"vocab_size": 0}}, "tokenizer.vocab_size"),
    ({"tokenizer": {"character_coverage": 0.5}}, "tokenizer.character_coverage"),
    ({"data": {"max_len": 0}}, "data.max_len"),
    ({"data": {"max_ratio": 0.5}}, "data.max_ratio"),
    ({"data": {"num_proc": 0}}, "data.num_proc"),
    ({"data": {"limit_train": 0}}, "data.limit_train"),
    ({"data": {"src": "de", "tgt": "de"}}, "data.tgt"),
    ({"data": {"source": "hub"}}, "data.hub_name"),
    ({"train": {"lr": 0}}, "train.lr"),
    ({"train": {"lr": -1e-3}}, "train.lr"),
    ({"train": {"batch_tokens": 8}}, "train.batch_tokens"),
    ({"train": {"betas": [0.9, 1.5]}}, "train.betas"),
    ({"train": {"betas": [-0.1, 0.98]}}, "train.betas"),
    ({"train": {"eps": -1}}, "train.eps"),
    ({"train": {"eps": 0}}, "train.eps"),
    ({"train": {"weight_decay": -0.01}}, "train.weight_decay"),
    ({"train": {"clip_norm": -1}}, "train.clip_norm"),
    ({"train": {"min_lr": -1e-5}}, "train.min_lr"),
    ({"train": {"plateau_factor": 1.0}}, "train.plateau_factor"),
    ({"train": {"plateau_factor": 0}}, "train.plateau_factor"),
    ({"train": {"plateau_patience": -1}}, "train.plateau_patience"),
    ({"train": {"patience": 0}}, "train.patience"),
    ({"train": {"batch_multiple": 0}}, "train.batch_multiple"),
    ({"train": {"label_smoothing": 1.0}}, "train.label_smoothing"),
    ({"train": {"max_steps": None}}, "train.max_steps"),
    ({"train": {"max_steps": 0}}, "train.max_steps"),
    ({"train": {"average_last": 0}}, "train.average_last"),
    ({"train": {"keep_last": 1, "average_last": 3}}, "train.average_last"),
    # cosine needs to know its last step; a time budget does not say when it comes
    ({"train": {"schedule": "cosine", "max_steps": None, "max_minutes": 30}}, "train.schedule"),
    ({"decode": {"beam": 2, "nbest": 3}}, "decode.nbest"),
    ({"decode": {"beam": 0}}, "decode.beam"),
    ({"decode": {"no_repeat_ngram": -1}}, "decode.no_repeat_ngram"),
    ({"decode": {"min_len": -1}}, "decode.min_len"),
    ({"decode": {"length_penalty": -0.5}}, "decode.length_penalty"),
    # these were tracebacks (seed -1: numpy's generator; input_sentence_size -5: sentencepiece)
    # or silent (valid_max_sentences -50: all but the last 50; 0: all)
    ({"train": {"seed": -1}}, "train.seed"),
    ({"tokenizer": {"input_sentence_size": -5}}, "tokenizer.input_sentence_size"),
    ({"tokenizer": {"input_sentence_size": 10}}, "tokenizer.input_sentence_size"),
    ({"train": {"valid_max_sentences": -50}}, "train.valid_max_sentences"),
    ({"train": {"valid_max_sentences": 0}}, "train.valid_max_sentences"),
]


@pytest.mark.parametrize(
    "raw, key", INVALID_VALUES, ids=[json.dumps(raw) for raw, _ in INVALID_VALUES]
)
def test_invalid_value_names_the_key(raw, key):
    message = error_of(raw)
    assert message.startswith(f"invalid value for {key}:")


def test_invalid_model_value_reports_the_model_check():
    message = error_of({"model": {"d_model": 30, "heads": 4}})
    assert "model" in message and "divisible" in message
    assert ">= 1" in error_of({"model": {"heads": 0}})  # checked before dividing by it


# -- overrides -------------------------------------------------------------------------------


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write_recipe(
        tmp_path / "recipe.yaml",
        {
            "data": {"limit_train": 2000},
            "tokenizer": {"vocab_size": 1000},
            "model": {"arch": "transformer", "d_model": 64, "heads": 4},
            "train": {"lr": 0.002, "max_steps": 60},
        },
    )


def test_overrides_are_typed_by_yaml_and_win_over_the_file(recipe):
    cfg = load(
        recipe,
        [
            "train.lr=0.01",
            "train.max_steps=5",
            "tokenizer.joint=false",
            "data.test=[a.txt, b.txt]",
            "data.limit_train=",
            "data.limit_valid=null",
            "train.betas=[0.8, 0.9]",
            "model.dropout=0",
            "decode.beam=7",
            "data.src=no",  # Norwegian, not the boolean false
            "data.tgt=de",
        ],
    )
    assert cfg.train.lr == 0.01 and isinstance(cfg.train.lr, float)
    assert cfg.train.max_steps == 5 and type(cfg.train.max_steps) is int
    assert cfg.tokenizer.joint is False
    assert cfg.data.test == ("a.txt", "b.txt")
    assert cfg.data.limit_train is None and cfg.data.limit_valid is None
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.model.dropout == 0.0 and isinstance(cfg.model.dropout, float)
    assert cfg.decode.beam == 7  # section absent from the file
    assert cfg.data.src == "no"
    # untouched file values are kept
    assert cfg.tokenizer.vocab_size == 1000 and cfg.model.d_model == 64


def test_override_exponent_and_single_string_for_a_list(recipe):
    cfg = load(recipe, ["train.lr=1e-3", "data.test=only_one"])
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.data.test == ("only_one",)


def test_integers_are_read_as_yaml_1_2_reads_them(recipe):
    """YAML 1.1 (PyYAML's) read 010 as octal 8 and 1:30 as 90 (base 60), silently."""
    cfg = load(recipe, ["train.seed=010", "train.max_steps=2_000", "train.log_every=0x10"])
    assert (cfg.train.seed, cfg.train.max_steps, cfg.train.log_every) == (10, 2000, 16)
    with pytest.raises(ConfigError, match="train.max_steps"):
        load(recipe, ["train.max_steps=1:30"])


def test_later_override_wins_and_the_input_is_not_mutated():
    raw = {"train": {"lr": 0.5, "max_steps": 3}}
    out = config.apply_overrides(raw, ["train.lr=0.1", "train.lr=0.2"])
    assert out["train"]["lr"] == 0.2
    assert raw == {"train": {"lr": 0.5, "max_steps": 3}}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.no_such_key=1", "model.no_such_key"),
        ("nosection.key=1", "unknown key nosection"),
        ("train.lr=abc", "train.lr"),
        ("train.precision=bf17", "valid choices: auto, fp32, bf16, fp16"),
        ("tokenizer.vocab_size=0", "tokenizer.vocab_size"),
        ("train.lr", "section.key=value"),
        ("lr=0.1", "section.key=value"),
        ("train..lr=0.1", "section.key=value"),
        ("data.src.code=en", "src"),
        ("model.arch=lstm", "model.arch"),
    ],
)
def test_bad_override_raises_config_error_naming_it(recipe, override, fragment):
    with pytest.raises(ConfigError) as info:
        load(recipe, [override])
    assert fragment in str(info.value)


def test_switching_architecture_by_override_checks_the_new_model_keys(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.d_model"):
        load(recipe, ["model.arch=seq2seq"])
    rnn = write_recipe(
        tmp_path / "rnn.yaml", {"model": {"arch": "seq2seq", "emb_dim": 64, "enc_layers": 2}}
    )
    cfg = load(rnn, ["model.arch=rnn_attention"])
    assert type(cfg.model) is CONFIGS["rnn_attention"]
    assert (cfg.model.emb_dim, cfg.model.enc_layers) == (64, 2)  # shared keys carried over


def test_replace_returns_a_new_config(recipe):
    cfg = load(recipe)
    other = config.replace(cfg, ["decode.beam=2", "decode.nbest=2"])
    assert (other.decode.beam, other.decode.nbest) == (2, 2)
    assert cfg.decode.beam == DecodeConfig().beam
    assert dataclasses.replace(other, decode=cfg.decode) == cfg


# -- recipe files ----------------------------------------------------------------------------


def test_missing_unparsable_and_non_mapping_recipes(tmp_path):
    with pytest.raises(ConfigError, match="recipe not found"):
        load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"cannot parse recipe {re.escape(str(bad))}"):
        load(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- data\n- model\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="mapping"):
        load(listing, ["data.src=en"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n", encoding="utf-8")
    assert load(empty) == Config()
    twice = tmp_path / "twice.yaml"  # PyYAML keeps the last: the first train section was lost
    twice.write_text("train:\n  lr: 0.002\n  max_steps: 60\ntrain:\n  max_steps: 5\n")
    with pytest.raises(ConfigError, match=r"key 'train' is given twice \(again at line 4\)"):
        load(twice)
    inner = tmp_path / "inner.yaml"
    inner.write_text("train:\n  lr: 0.002\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="key 'lr' is given twice"):
        load(inner)


def test_recipe_file_reads_no_as_a_string_and_exponents_as_numbers(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  src: en\n  tgt: no\ntrain:\n  lr: 3e-4\n  max_steps: 4\n")
    cfg = load(path)
    assert cfg.data.tgt == "no"
    assert cfg.train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_recipes_load_with_the_declared_architecture(path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    cfg = load(path)
    arch = raw["model"]["arch"]
    assert type(cfg.model) is CONFIGS[arch]
    assert config.arch_of(cfg.model) == arch
    for key, value in raw["model"].items():
        if key != "arch":
            assert getattr(cfg.model, key) == value


# -- architecture selection ------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_model_arch_picks_the_model_dataclass(arch):
    cfg = from_dict({"model": {"arch": arch}})
    assert type(cfg.model) is CONFIGS[arch]
    assert cfg.model == CONFIGS[arch]()
    assert config.arch_of(cfg.model) == arch
    assert cfg.to_dict()["model"]["arch"] == arch


def test_model_defaults_to_transformer():
    assert config.arch_of(from_dict({"model": {}}).model) == "transformer"
    assert config.arch_of(from_dict({"model": None}).model) == "transformer"


# -- round trip ------------------------------------------------------------------------------

NON_DEFAULT = {
    "data": {
        "source": "text",
        "src": "de",
        "tgt": "en",
        "train": "/x/train",
        "valid": "/x/valid",
        "test": ["/x/t1", "/x/t2"],
        "local_dir": "/somewhere",
        "src_field": "source",
        "max_len": 64,
        "max_ratio": 2.5,
        "limit_train": 300,
        "num_proc": 2,
    },
    "tokenizer": {"type": "unigram", "joint": False, "vocab_size": 300},
    "model": {"arch": "rnn_attention", "cell": "lstm", "attention": "dot", "input_feed": True},
    "train": {
        "precision": "bf16",
        "lr": 3e-4,
        "betas": [0.8, 0.95],
        "max_steps": None,
        "max_epochs": 3,
        "max_minutes": 1.5,
        "patience": 4,
    },
    "decode": {"beam": 4, "nbest": 2, "length_penalty": 0.6},
}


@pytest.mark.parametrize(
    "cfg",
    [Config(), from_dict(NON_DEFAULT)] + [load(p) for p in RECIPES],
    ids=["defaults", "non-default"] + [f"{p.parent.name}/{p.stem}" for p in RECIPES],
)
def test_round_trip_to_dict_from_dict_and_yaml(cfg, tmp_path):
    d = cfg.to_dict()
    json.dumps(d)  # plain data: lists, not tuples
    assert list(d) == ["data", "tokenizer", "model", "train", "decode"]
    assert from_dict(d) == cfg
    assert d == from_dict(d).to_dict()
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert load(path) == cfg


def test_non_default_values_are_read_with_their_types():
    """Lists become tuples, null becomes None, the architecture picks the model dataclass
    (the round trip of these values: test_round_trip_to_dict_from_dict_and_yaml)."""
    cfg = from_dict(NON_DEFAULT)
    assert cfg.data.test == ("/x/t1", "/x/t2") and cfg.train.betas == (0.8, 0.95)
    assert isinstance(cfg.data.test, tuple) and isinstance(cfg.train.betas, tuple)
    assert cfg.train.max_steps is None and cfg.train.max_epochs == 3
    assert config.arch_of(cfg.model) == "rnn_attention" and cfg.model.cell == "lstm"
    assert cfg.model.input_feed is True and type(cfg.model) is CONFIGS["rnn_attention"]


# -- data key --------------------------------------------------------------------------------

BASE = {"data": {"limit_train": 500}, "tokenizer": {"vocab_size": 300}}


def key_with(*overrides: str) -> str:
    return from_dict(config.apply_overrides(BASE, list(overrides))).data_key()


def test_data_key_is_a_stable_short_hash():
    key = key_with()
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert key == key_with() == from_dict(BASE).data_key()


@pytest.mark.parametrize(
    "override",
    [
        "tokenizer.vocab_size=301",
        "tokenizer.type=unigram",
        "tokenizer.joint=false",
        "tokenizer.character_coverage=0.9995",
        "tokenizer.input_sentence_size=1000",
        "data.src=fr",
        "data.limit_train=501",
        "data.max_len=64",
        "data.max_ratio=2.0",
        "data.test=[test_2016_flickr]",
    ],
)
def test_data_key_changes_with_data_and_tokenizer_settings(override):
    assert key_with(override) != key_with()


@pytest.mark.parametrize(
    "override",
    [
        "data.num_proc=4",
        "data.cache_dir=/elsewhere",
        "data.local_dir=/copy/of/multi30k",
        "data.download_url=http://mirror.example/multi30k",
        "model.arch=seq2seq",
        "train.lr=0.1",
        "train.batch_tokens=1000",
        "decode.beam=1",
    ],
)
def test_data_key_ignores_settings_that_do_not_change_the_prepared_data(override):
    assert key_with(override) == key_with()


def test_length_norm_defaults_to_gnmt_and_reaches_the_search():
    from nmt.translate import search_options

    cfg = from_dict({})
    assert cfg.decode.length_norm == "gnmt"
    plain = config.replace(cfg, ["decode.length_norm=plain"]).decode
    assert search_options(plain).length_norm == "plain"
    assert search_options(cfg.decode).length_norm == "gnmt"


def test_the_config_digest_names_a_config_as_before_the_later_options():
    """`nmt compare` names run folders by `Config.digest`: a config at the defaults of the
    options added since (decode.length_norm, decode.patience, train.max_tokens, deterministic,
    tf32, dist_timeout_minutes; batch_multiple at 1, its value before) keeps the digest it had
    before they existed (the hash of its YAML without those keys), so compare reuses runs made
    by earlier versions; another value of any of them changes it."""
    import hashlib

    import yaml

    cfg = from_dict(BASE)
    before = cfg.to_dict()
    del before["decode"]["length_norm"]
    del before["decode"]["patience"]
    for key in ("max_tokens", "deterministic", "tf32", "dist_timeout_minutes"):
        del before["train"][key]
    text = yaml.safe_dump(before, sort_keys=False, allow_unicode=True)
    assert cfg.digest() == hashlib.sha256(text.encode()).hexdigest()[:8]
    for change in (
        "decode.length_norm=plain",
        "decode.patience=1",
        "train.max_tokens=5000",
        "train.deterministic=true",
        "train.tf32=false",
        "train.dist_timeout_minutes=30",
        "train.batch_multiple=1",
        "decode.beam=2",
    ):
        assert config.replace(cfg, [change]).digest() != cfg.digest(), change
    assert re.fullmatch(r"[0-9a-f]{8}", cfg.digest())
    # train.batch_multiple came with a new default (8): the runs made before it packed as 1
    # does, so a config with 1 has the digest of that config before the key existed
    one = config.replace(cfg, ["train.batch_multiple=1"])
    del before["train"]["batch_multiple"]
    text = yaml.safe_dump(before, sort_keys=False, allow_unicode=True)
    assert one.digest() == hashlib.sha256(text.encode()).hexdigest()[:8]


def test_a_written_config_without_a_later_key_is_read_as_it_ran():
    """`config.as_it_ran`: what a run's config.yaml from an older nmt lacks is read with the
    value that nmt ran with, whatever the key's default is now; what it says is kept."""
    written = from_dict(BASE).to_dict()
    del written["train"]["batch_multiple"]
    del written["decode"]["length_norm"]
    cfg = from_dict(config.as_it_ran(written))
    assert cfg.train.batch_multiple == 1 and from_dict(BASE).train.batch_multiple == 8
    assert cfg.decode.length_norm == "gnmt"
    assert "batch_multiple" not in written["train"]  # its argument is left as it was
    written["train"]["batch_multiple"] = 16
    assert from_dict(config.as_it_ran(written)).train.batch_multiple == 16
