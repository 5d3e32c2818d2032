"""Exports of a transformer run for other runtimes, built through those libraries' own classes:

- CTranslate2: a `ctranslate2.specs.TransformerSpec` filled with the run's weights and saved by
  CTranslate2's own converter (validation, optional quantization, `ModelSpec.save`), with the
  run's sentencepiece models (source.spm, target.spm) and a README beside it;
- Hugging Face Transformers: a `MarianMTModel` (`MarianConfig`, `save_pretrained`: config.json,
  model.safetensors, generation_config.json) with the files of a `MarianTokenizer`, for runs
  whose architecture Marian can express (`marian_problem`).

An export is written into a temporary directory beside its destination and renamed into place
once complete: a failure or an interruption leaves neither a partial export nor the temporary
directory, and an export it replaces (`--force`) stays until the new one is complete.
`ctranslate2_for_decoding` keeps a run's CTranslate2 export for `--engine ctranslate2` in the
run directory (`RunDir.export_dir`), exported again when the run's checkpoint changes.

ctranslate2 and transformers are the optional `export` extra, imported only here and only
when an export or the engine is asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt import NMTError, __version__
from nmt.config import Config, from_dict
from nmt.data.tokenizer import Tokenizer
from nmt.files import alive
from nmt.models.base import Vocab
from nmt.models.configs import TransformerConfig
from nmt.models.registry import build_model
from nmt.run import RunDir
from nmt.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from nmt.translate import checkpoint_of, model_facts, read_run

log = logging.getLogger(__name__)

FORMATS = ("ctranslate2", "hf")
# CTranslate2's weight types (`ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES`).
QUANTIZATIONS = (
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)
# Positions a CTranslate2 export encodes (its position table has this many rows, or
# model.max_positions when larger): CTranslate2 refuses longer inputs and outputs.
CT2_POSITIONS = 2048
STAMP = "nmt-export.json"  # in every export: what it was made from
EXPORT_VERSION = 2  # raised when the export of a given checkpoint changes (2: model facts)
PACKAGES = {
    "ctranslate2": "ctranslate2>=4.8",
    "transformers": "transformers>=4.40",  # as the export extra (the tests run 4.x)
    "safetensors": "safetensors>=0.4",
}


def require(module: str, what: str) -> Any:
    """Import an optional package of the export extra, or say which pip install is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise NMTError(
            f"{what} needs the {module} package, which is not installed: "
            f"pip install '{PACKAGES[module]}' (or all of nmt's export extra: "
            "pip install -e '.[export]')"
        ) from None


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise NMTError(
            f"unknown quantization {quantization!r}; choose one of: {', '.join(QUANTIZATIONS)}"
        )


# -- reading the run -------------------------------------------------------------------------


@dataclass
class Source:
    """A transformer run's model as nmt decodes with it (CPU, fp32, eval mode)."""

    checkpoint: Path
    model: torch.nn.Module
    config: Config
    tokenizer: Tokenizer
    run_dir: Path
    stamp: dict[str, Any]  # the checkpoint file read (`checkpoint_stamp`)
    progress: dict[str, Any]  # the checkpoint's training progress (step, validation history)


def checkpoint_stamp(path: Path) -> dict[str, Any]:
    """What identifies a checkpoint file's content cheaply: its path, inode, size and
    modification time (checkpoints are replaced by renaming a new file over them, never
    edited: a new checkpoint is a new inode, even within a coarse mtime's tick)."""
    st = Path(path).stat()
    return {
        "path": str(Path(path).resolve()),
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def refuse_rnn(arch: str) -> None:
    if arch != "transformer":
        raise NMTError(
            f"model.arch={arch}: CTranslate2 and Marian run transformer models only, and nmt's "
            "RNN models have no format there; export a transformer run"
        )


def load_source(path: Path) -> Source:
    """The model of a run directory or checkpoint, with the stamp of the checkpoint file it
    was read from (read again if training replaced that file meanwhile)."""
    for _ in range(3):
        before = checkpoint_stamp(checkpoint_of(path))
        ckpt, payload, cfg, tokenizer = read_run(path)
        if checkpoint_stamp(ckpt) == before:
            break
    else:
        raise NMTError(f"{ckpt} kept changing while it was read; try again")
    refuse_rnn(payload["arch"])
    model = build_model(payload["arch"], cfg.model, Vocab(**payload["vocab"]))
    model.load_state_dict(payload["model"])
    model.eval()
    run_dir = RunDir.tokenizer_of(ckpt, payload.get("run_dir")).parent
    return Source(ckpt, model, cfg, tokenizer, run_dir, before, payload.get("progress", {}))


def position_table(model: torch.nn.Module, rows: int) -> torch.Tensor:
    """[rows, D] the encodings nmt adds at positions 0..rows-1 (as it decodes: a learned or
    Marian table's last entry repeated past its end)."""
    with torch.inference_mode():
        return model.positions(torch.arange(rows)).clone()


def pieces(sp) -> list[str]:
    """A sentencepiece model's vocabulary, by id."""
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


# -- writing a directory whole or not at all ---------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale(out: Path) -> None:
    """Temporary directories of exports to `out` whose process is gone (killed mid-export):
    the names `staged` and `publish` make, .NAME.tmp-PID-X and .NAME.old-PID-X, only."""
    ours = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d+)-[A-Za-z0-9_]+")
    for leftover in out.parent.glob(f".{out.name}.*-*"):
        match = ours.fullmatch(leftover.name)
        pid = int(match.group(2)) if match else None
        if pid is not None and pid != os.getpid() and not alive(pid):
            _remove(leftover)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new empty directory beside `out` to build an export in; removed when the scope ends
    (after `publish` moved it, there is nothing left to remove)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # as a directory made with mkdir (mkdtemp's is private)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, out: Path, replace: bool) -> None:
    """Move the complete export `tmp` to `out`. An existing `out` is replaced only when
    `replace`: moved aside first, removed once the new one is in place (put back if that
    fails)."""
    try:
        os.rename(tmp, out)  # out absent
        return
    except OSError:
        if not (out.exists() or out.is_symlink()):
            raise
    if not replace:
        raise NMTError(f"{out} already exists; add --force to replace it")
    old = out.parent / f".{out.name}.old-{os.getpid()}-{tmp.name.rsplit('-', 1)[-1]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(old, out)
        raise
    _remove(old)


def _write_stamp(directory: Path, stamp: dict[str, Any]) -> None:
    (directory / STAMP).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")


def read_stamp(directory: Path) -> dict[str, Any] | None:
    """The stamp of an export directory (None when there is no readable one)."""
    try:
        return json.loads((Path(directory) / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _stamp(source: Source, fmt: str, quantization: str | None) -> dict[str, Any]:
    return {
        "format": fmt,
        "quantization": quantization,
        "export_version": EXPORT_VERSION,
        "nmt_version": __version__,
        "checkpoint": source.stamp,
        "run_dir": str(source.run_dir.resolve()),
        "config": source.config.to_dict(),
        "model": model_facts(source.model, source.progress),
    }


def _out_path(out: Path, force: bool) -> Path:
    """`out` as an absolute path ("." and ".." name the folders they are, so that an export is
    staged beside them), once `_check_out` says it may be written."""
    out = Path(os.path.abspath(out))
    _check_out(out, force)
    return out


def _check_out(out: Path, force: bool) -> None:
    """`out` may be written: absent, or (with `force`) an earlier export, which it replaces;
    never anything else, such as the run itself or a folder holding it. Its nearest existing
    folder must be a folder this process can write into (checked before the model is loaded:
    the error named a temporary path, after the whole export)."""
    for folder in out.parents:
        if folder.exists():
            if not folder.is_dir():
                raise NMTError(
                    f"--out {out}: {folder} is a file, not a folder; choose another --out"
                )
            if not os.access(folder, os.W_OK | os.X_OK):
                raise NMTError(f"--out {out}: cannot write into {folder}; choose another --out")
            break
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise NMTError(f"{out} already exists; add --force to replace it")
    if not out.is_dir() or read_stamp(out) is None:
        raise NMTError(
            f"{out} exists and is not an nmt export (no {STAMP} in it): --force replaces "
            "only an earlier export; choose another --out"
        )


# -- CTranslate2 --------------------------------------------------------------------------------


def _ct2_spec(source: Source):
    """The run's model as a `ctranslate2.specs.TransformerSpec` (weights as nmt computes with
    them: fp32, the position table nmt adds, shared tables once), vocabularies registered."""
    from ctranslate2.converters import utils as ct2_utils
    from ctranslate2.specs import common_spec, transformer_spec

    model, c = source.model, source.config.model
    assert isinstance(c, TransformerConfig)
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}
    pre = c.norm == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (c.enc_layers, c.dec_layers), c.heads, pre_norm=pre, activation=activation[c.activation]
    )

    def tensor(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().contiguous()

    def linear(dst, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        dst.weight = tensor(weight)
        if bias is not None:
            dst.bias = tensor(bias)

    def fused(dst, module, parts: int) -> None:  # CTranslate2 fuses what nmt fuses: Q|K|V, K|V
        split = [common_spec.LinearSpec() for _ in range(parts)]
        for part, w, b in zip(split, module.weight.chunk(parts), module.bias.chunk(parts)):
            linear(part, w, b)
        ct2_utils.fuse_linear(dst, split)

    def norm(dst, layer_norm: torch.nn.LayerNorm) -> None:
        dst.gamma, dst.beta = tensor(layer_norm.weight), tensor(layer_norm.bias)

    rows = max(CT2_POSITIONS, c.max_positions)
    table = tensor(position_table(model, rows))
    for side, embed in ((spec.encoder, model.src_embed), (spec.decoder, model.tgt_embed)):
        side.scale_embeddings = embed.scale if embed.scale != 1.0 else False  # sqrt(D) or none
        side.position_encodings.encodings = table
    spec.encoder.embeddings[0].weight = tensor(model.src_embed.weight)
    spec.decoder.embeddings.weight = tensor(model.tgt_embed.weight)
    linear(spec.decoder.projection, model.output.weight, model.output.bias)
    if pre:
        norm(spec.encoder.layer_norm, model.enc_norm)
        norm(spec.decoder.layer_norm, model.dec_norm)
    for dst, layer in zip(spec.encoder.layer, model.encoder):
        fused(dst.self_attention.linear[0], layer.attn.qkv, 3)
        linear(dst.self_attention.linear[1], layer.attn.out.weight, layer.attn.out.bias)
        norm(dst.self_attention.layer_norm, layer.res_attn.norm)
        linear(dst.ffn.linear_0, layer.ffn.inner.weight, layer.ffn.inner.bias)
        linear(dst.ffn.linear_1, layer.ffn.outer.weight, layer.ffn.outer.bias)
        norm(dst.ffn.layer_norm, layer.res_ffn.norm)
    for dst, layer in zip(spec.decoder.layer, model.decoder):
        fused(dst.self_attention.linear[0], layer.self_attn.qkv, 3)
        linear(dst.self_attention.linear[1], layer.self_attn.out.weight, layer.self_attn.out.bias)
        norm(dst.self_attention.layer_norm, layer.res_self.norm)
        cross = layer.cross_attn
        linear(dst.attention.linear[0], cross.q.weight, cross.q.bias)
        fused(dst.attention.linear[1], cross.kv, 2)
        linear(dst.attention.linear[2], cross.out.weight, cross.out.bias)
        norm(dst.attention.layer_norm, layer.res_cross.norm)
        linear(dst.ffn.linear_0, layer.ffn.inner.weight, layer.ffn.inner.bias)
        linear(dst.ffn.linear_1, layer.ffn.outer.weight, layer.ffn.outer.bias)
        norm(dst.ffn.layer_norm, layer.res_ffn.norm)

    tok = source.tokenizer
    spec.register_source_vocabulary(pieces(tok.src))
    spec.register_target_vocabulary(pieces(tok.tgt))
    config = spec.config
    config.unk_token, config.bos_token = tok.tgt.id_to_piece(UNK_ID), tok.tgt.id_to_piece(BOS_ID)
    config.eos_token = tok.tgt.id_to_piece(EOS_ID)
    config.decoder_start_token = config.bos_token  # nmt's decoder starts from BOS
    config.add_source_eos = True  # sources are ended by EOS, as nmt ends them
    config.layer_norm_epsilon = model.encoder[0].res_attn.norm.eps
    spec.register_file(str(tok.src_model), "source.spm")
    spec.register_file(str(tok.tgt_model), "target.spm")
    return spec


def _ct2_readme(source: Source, quantization: str) -> str:
    cfg = source.config
    d = cfg.decode
    norm = "" if d.length_norm == "plain" else " (nmt's default normalisation, gnmt, differs)"
    return f"""# {cfg.data.src}→{cfg.data.tgt} transformer for CTranslate2

Exported by nmt {__version__} from `{source.checkpoint}` (weights: {quantization}).
`source.spm` and `target.spm` are the run's sentencepiece models; the model appends `</s>` to
every source itself.

```python
import ctranslate2
import sentencepiece as spm

model_dir = "."  # this directory
translator = ctranslate2.Translator(model_dir, device="cpu", compute_type="{quantization}")
source = spm.SentencePieceProcessor(model_file=f"{{model_dir}}/source.spm")
target = spm.SentencePieceProcessor(model_file=f"{{model_dir}}/target.spm")

lines = ["A man is riding a bicycle down the street."]
results = translator.translate_batch(
    source.encode(lines, out_type=str),
    beam_size={d.beam},
    length_penalty={d.length_penalty},  # divides by length ** alpha{norm}
    min_decoding_length={d.min_len},  # the run's output constraints (decode section)
    no_repeat_ngram_size={d.no_repeat_ngram},
    disable_unk={d.ban_unk},
    suppress_sequences=[["<pad>"], ["<s>"]],  # never generated by nmt either
)
print([target.decode(r.hypotheses[0]) for r in results])
```

nmt decodes with this export directly: `nmt translate RUN --engine ctranslate2 --quantization
{quantization}` (see nmt's README, "Export and deploy").
"""


def _converter(spec):
    """A `ctranslate2.converters.Converter` whose model is `spec`: CTranslate2 validates,
    quantizes and saves it as it does the models of the frameworks it converts from."""
    from ctranslate2.converters import Converter

    class NMTConverter(Converter):
        def _load(self):
            return spec

    return NMTConverter()


def _build_ctranslate2(source: Source, quantization: str, directory: Path) -> None:
    """Write the CTranslate2 model of `source` into the new directory `directory`."""
    ctranslate2 = require("ctranslate2", "the CTranslate2 export")
    _converter(_ct2_spec(source)).convert(str(directory), quantization=quantization, force=True)
    (directory / "README.md").write_text(_ct2_readme(source, quantization), encoding="utf-8")
    _write_stamp(directory, _stamp(source, "ctranslate2", quantization))
    log.debug("CTranslate2 %s wrote %s", ctranslate2.__version__, directory)


def export_ctranslate2(path: Path, out: Path, quantization: str = "float32", force: bool = False):
    """`nmt export RUN --format ctranslate2`: the run's model as a CTranslate2 directory."""
    check_quantization(quantization)
    out = _out_path(out, force)
    require("ctranslate2", "--format ctranslate2")
    source = load_source(path)
    with staged(out) as tmp:
        _build_ctranslate2(source, quantization, tmp)
        publish(tmp, out, force)
    return source


def ctranslate2_for_decoding(path: Path, quantization: str) -> tuple[Path, dict[str, Any]]:
    """The run's CTranslate2 export in `quantization`, kept in the run directory
    (`RunDir.export_dir`) for `--engine ctranslate2`, and its stamp: exported when missing or
    made from another checkpoint file than the one that stands for the run now (another file,
    or the same file rewritten by training). Readers of a run take no lock: a concurrent
    export of the same run builds its own temporary directory, and the first one renamed into
    place is kept."""
    check_quantization(quantization)
    ckpt = checkpoint_of(path)
    run = _run_of(ckpt)
    out = run.export_dir(f"ctranslate2-{quantization}")
    wanted = checkpoint_stamp(ckpt)
    stamp = read_stamp(out)
    if _current(stamp, wanted, quantization):
        return out, stamp
    source = load_source(path)
    with staged(out) as tmp:
        _build_ctranslate2(source, quantization, tmp)
        fresh = read_stamp(tmp)
        for _ in range(3):
            current = read_stamp(out)
            if _current(current, fresh["checkpoint"], quantization):  # another process was faster
                return out, current
            try:
                publish(tmp, out, replace=True)
                break
            except OSError:  # another process renamed its export meanwhile: look again
                continue
        else:
            raise NMTError(f"could not put the CTranslate2 export in place at {out}; try again")
    log.info("exported %s to %s (CTranslate2 %s)", source.checkpoint, out, quantization)
    return out, fresh


def _current(stamp: dict[str, Any] | None, checkpoint: dict[str, Any], quantization: str) -> bool:
    return (
        stamp is not None
        and stamp.get("export_version") == EXPORT_VERSION
        and stamp.get("quantization") == quantization
        and stamp.get("checkpoint") == checkpoint
    )


def _run_of(ckpt: Path) -> RunDir:
    """The run directory of a checkpoint file: the folder above its checkpoints/ folder when
    the run's tokenizer is there, else the run the checkpoint records."""
    here = RunDir.of_checkpoint(ckpt)
    if here.tokenizer_dir.is_dir():
        return here
    _, payload, _, _ = read_run(ckpt)
    return RunDir(RunDir.tokenizer_of(ckpt, payload.get("run_dir")).parent)


def export_config(stamp: dict[str, Any]) -> Config:
    """The config of the run an export was made from (kept in its stamp)."""
    return from_dict(stamp["config"])


# -- Hugging Face Marian ---------------------------------------------------------------------


def marian_problem(c: TransformerConfig) -> str | None:
    """Why Marian (`MarianMTModel`) cannot express a transformer of config `c`: the first
    setting that prevents it and the value that would allow it; None when it can. Marian is
    post-norm, adds fixed sinusoids in [sin | cos] halves, and has a ReLU or GELU FFN; tied or
    untied embeddings, a joint or separate vocabulary, embedding scaling and the dropout
    values all map onto MarianConfig."""
    if c.norm != "post":
        return f"model.norm={c.norm}: Marian is post-norm; train with --set model.norm=post"
    if c.positions != "sinusoidal_marian":
        return (
            f"model.positions={c.positions}: Marian adds fixed sinusoids laid out as [sin | cos] "
            "halves; train with --set model.positions=sinusoidal_marian "
            "(recipes/multi30k/transformer_marian.yaml)"
        )
    if c.activation not in ("relu", "gelu"):  # pragma: no cover - the config allows no other
        return f"model.activation={c.activation}: Marian's FFN is relu or gelu"
    return None


def _marian_model(source: Source):
    """The run's model as a `MarianMTModel`: MarianConfig from the run's config, weights
    copied module by module (Q, K, V split from nmt's fused projections)."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    model, cfg = source.model, source.config
    c = cfg.model
    shared = model.src_embed is model.tgt_embed
    src_vocab, tgt_vocab = model.src_embed.weight.size(0), model.tgt_embed.weight.size(0)
    config = MarianConfig(
        vocab_size=src_vocab,
        decoder_vocab_size=tgt_vocab,
        d_model=c.d_model,
        encoder_layers=c.enc_layers,
        decoder_layers=c.dec_layers,
        encoder_attention_heads=c.heads,
        decoder_attention_heads=c.heads,
        encoder_ffn_dim=c.ffn_dim,
        decoder_ffn_dim=c.ffn_dim,
        activation_function=c.activation,
        max_position_embeddings=c.max_positions,
        dropout=c.dropout,
        attention_dropout=c.attn_dropout,
        activation_dropout=c.activation_dropout,
        scale_embedding=c.scale_embeddings,
        share_encoder_decoder_embeddings=shared,
        tie_word_embeddings=c.tie_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )
    with torch.random.fork_rng():  # its random init (overwritten below) leaves the caller's RNG
        hf = MarianMTModel(config).eval()

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise RuntimeError(f"Marian weight of shape {tuple(dst.shape)} for {tuple(src.shape)}")
        dst.copy_(src)

    def linear(dst, weight: torch.Tensor, bias: torch.Tensor) -> None:
        copy(dst.weight, weight)
        copy(dst.bias, bias)

    def split(dsts, module) -> None:  # nmt fuses Q|K|V (K|V): Marian keeps them apart
        for dst, w, b in zip(dsts, module.weight.chunk(len(dsts)), module.bias.chunk(len(dsts))):
            linear(dst, w, b)

    def norm(dst, layer_norm) -> None:  # both nn.LayerNorm with torch's default epsilon
        linear(dst, layer_norm.weight, layer_norm.bias)

    with torch.no_grad():
        copy(hf.model.encoder.embed_tokens.weight, model.src_embed.weight)
        copy(hf.model.decoder.embed_tokens.weight, model.tgt_embed.weight)
        copy(hf.lm_head.weight, model.output.weight)
        copy(hf.final_logits_bias[0], model.output.bias)
        for dst, layer in zip(hf.model.encoder.layers, model.encoder):
            attn = dst.self_attn
            split((attn.q_proj, attn.k_proj, attn.v_proj), layer.attn.qkv)
            linear(attn.out_proj, layer.attn.out.weight, layer.attn.out.bias)
            norm(dst.self_attn_layer_norm, layer.res_attn.norm)
            linear(dst.fc1, layer.ffn.inner.weight, layer.ffn.inner.bias)
            linear(dst.fc2, layer.ffn.outer.weight, layer.ffn.outer.bias)
            norm(dst.final_layer_norm, layer.res_ffn.norm)
        for dst, layer in zip(hf.model.decoder.layers, model.decoder):
            attn, cross = dst.self_attn, dst.encoder_attn
            split((attn.q_proj, attn.k_proj, attn.v_proj), layer.self_attn.qkv)
            linear(attn.out_proj, layer.self_attn.out.weight, layer.self_attn.out.bias)
            norm(dst.self_attn_layer_norm, layer.res_self.norm)
            linear(cross.q_proj, layer.cross_attn.q.weight, layer.cross_attn.q.bias)
            split((cross.k_proj, cross.v_proj), layer.cross_attn.kv)
            linear(cross.out_proj, layer.cross_attn.out.weight, layer.cross_attn.out.bias)
            norm(dst.encoder_attn_layer_norm, layer.res_cross.norm)
            linear(dst.fc1, layer.ffn.inner.weight, layer.ffn.inner.bias)
            linear(dst.fc2, layer.ffn.outer.weight, layer.ffn.outer.bias)
            norm(dst.final_layer_norm, layer.res_ffn.norm)
    # Marian recomputes its position table when it loads (it is not saved): it must be nmt's.
    table = position_table(model, c.max_positions)
    for side in (hf.model.encoder, hf.model.decoder):
        if not torch.equal(side.embed_positions.weight, table):
            raise NMTError(
                "this version of transformers computes Marian's positions differently from "
                "nmt's model.positions=sinusoidal_marian; the export would not translate alike"
            )
    d = cfg.decode
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=None,
        # nmt never generates PAD or BOS, nor <unk> with decode.ban_unk
        suppress_tokens=[PAD_ID, BOS_ID, *([UNK_ID] if d.ban_unk else [])],
        # nmt's output constraints: EOS banned before decode.min_len tokens (an empty
        # translation where nmt has none), no n-gram of decode.no_repeat_ngram twice
        min_new_tokens=d.min_len or None,
        no_repeat_ngram_size=d.no_repeat_ngram or None,
        num_beams=d.beam,
        # Hugging Face divides by |y| ** alpha, |y| counting the EOS (nmt's length_norm plain)
        length_penalty=d.length_penalty,
        # Beam search stops when no live hypothesis can beat the finished ones, as nmt's does;
        # transformers' default stops on a guess of that (see its _beam_search docstring).
        early_stopping="never",
        max_length=min(512, c.max_positions),
    )
    return hf


def _marian_tokenizer(source: Source, scratch: Path):
    """A `MarianTokenizer` over the run's sentencepiece models: ids are sentencepiece's."""
    from transformers import MarianTokenizer

    tok, cfg = source.tokenizer, source.config
    joint = tok.src_model == tok.tgt_model
    src_vocab, tgt_vocab = scratch / "vocab.json", scratch / "target_vocab.json"
    src_vocab.write_text(json.dumps({p: i for i, p in enumerate(pieces(tok.src))}), "utf-8")
    tgt_vocab.write_text(json.dumps({p: i for i, p in enumerate(pieces(tok.tgt))}), "utf-8")
    with warnings.catch_warnings():  # "Recommended: pip install sacremoses": not used here
        warnings.simplefilter("ignore")
        return MarianTokenizer(
            source_spm=str(tok.src_model),
            target_spm=str(tok.tgt_model),
            vocab=str(src_vocab),
            target_vocab_file=None if joint else str(tgt_vocab),
            separate_vocabs=not joint,
            source_lang=cfg.data.src,
            target_lang=cfg.data.tgt,
            unk_token=tok.src.id_to_piece(UNK_ID),
            eos_token=tok.src.id_to_piece(EOS_ID),
            pad_token=tok.src.id_to_piece(PAD_ID),
            model_max_length=cfg.model.max_positions,
            clean_up_tokenization_spaces=False,  # text as sentencepiece decodes it, as nmt's
        )


def _hf_readme(source: Source) -> str:
    cfg = source.config
    return f"""# {cfg.data.src}→{cfg.data.tgt} transformer (MarianMTModel)

Exported by nmt {__version__} from `{source.checkpoint}`.

```python
from transformers import MarianMTModel, MarianTokenizer, pipeline

tokenizer = MarianTokenizer.from_pretrained(".")  # this directory
model = MarianMTModel.from_pretrained(".")
batch = tokenizer(["A man is riding a bicycle down the street."], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))

translate = pipeline("translation", model=".")  # transformers 4.x (5 removed this pipeline)
print(translate("A man is riding a bicycle down the street.")[0]["translation_text"])
```

Beam search as exported (generation_config.json) divides a hypothesis' log-probability by its
length ** length_penalty (EOS counted), as nmt's `--length-norm plain`; nmt also limits each
translation to a * |x| + b tokens, where `generate` takes one max_new_tokens.
"""


def export_hf(path: Path, out: Path, force: bool = False) -> Source:
    """`nmt export RUN --format hf`: the run's model as a Hugging Face `MarianMTModel`
    directory with its tokenizer, for runs Marian can express (`marian_problem`)."""
    out = _out_path(out, force)
    require("transformers", "--format hf")
    require("safetensors", "--format hf")
    source = load_source(path)
    problem = marian_problem(source.config.model)
    if problem:
        raise NMTError(problem)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with staged(out) as tmp:
        scratch = Path(tempfile.mkdtemp(dir=tmp))
        tokenizer = _marian_tokenizer(source, scratch)
        model = _marian_model(source)
        shutil.rmtree(scratch)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file():
            raise NMTError("transformers did not write model.safetensors; upgrade transformers")
        (tmp / "README.md").write_text(_hf_readme(source), encoding="utf-8")
        _write_stamp(tmp, _stamp(source, "hf", None))
        publish(tmp, out, force)
    return source


EXPORTERS: dict[str, Callable[..., Source]] = {
    "ctranslate2": export_ctranslate2,
    "hf": export_hf,
}
