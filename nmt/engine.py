"""What decodes lines for `nmt translate`, `nmt evaluate` and `nmt serve`: nmt's own search
over the run's model (`NMTEngine`), or CTranslate2 over the run's export (`CT2Engine`,
`--engine ctranslate2`). One interface, `Engine.translate(lines, opts, batch_tokens, progress,
workers)`, n-best (text, Hypothesis) per line as `nmt.translate.translate_lines` returns them,
so a caller switches decoder by opening another engine (`open_engine`); and `Engine.stream(opts)`
for a server, lines added between the steps of a running decode: nmt's search takes them into
the running batch (`NMTStream`, in-flight batching); CTranslate2, which decodes whole batches,
takes them at the next step (`BatchStream`).

CTranslate2 honours nmt's search settings where it can and `CT2Engine.check` refuses the
others with one line. What matches, and why (CTranslate2's src/decoding.cc, v4.8):

- length limit a*|x|+b per sentence (`nmt.search.length_limits`): nmt's last allowed position
  holds a forced EOS, so at most limit-1 tokens come before it; CTranslate2 gets
  max_decoding_length = limit-1, one call per distinct limit. A hypothesis that reaches it
  ends there without an EOS in CTranslate2 (nmt scores the forced EOS): same tokens, a score
  without the EOS log-prob.
- length normalisation: CTranslate2 divides a finished hypothesis' log-probability by
  length ** length_penalty, the length counting the EOS (it keeps EOS in hypotheses while it
  decodes, and drops it from the tokens it returns unless return_end_token): nmt's
  `length_norm: plain`. Beam search with gnmt and alpha != 0 is refused; greedy search asks
  CTranslate2 for raw log-probabilities and normalises them as nmt does, either way.
- beam search: both expand the 2K best candidates of the K hypotheses of a sentence, put the
  EOS ones among the top K aside as finished and keep the K best others. With
  `decode.patience` P both stop a sentence once round(K*P) hypotheses have finished
  (length_penalty != 0) or when its best candidate has ended (length_penalty 0): the same
  search. nmt's default (patience null) stops a sentence only when no live hypothesis can beat
  its K-th finished one, a rule CTranslate2 does not have: it then decodes with patience 1, and
  with a length penalty a hypothesis that finishes after CTranslate2 stopped can win in nmt.
- constraints (min_len, ban_unk, no_repeat_ngram, no PAD or BOS): the same tokens are
  excluded, but CTranslate2 removes them before its softmax and nmt after, so beam scores
  differ by the probability the excluded tokens had (greedy choices are the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from nmt import NMTError
from nmt.config import Config
from nmt.data.tokenizer import Tokenizer
from nmt.device import INT8, autocast, resolve_precision
from nmt.models.base import fixed_weights
from nmt.search import BeamStream, Hypothesis, SearchOptions, length_limits, length_penalty
from nmt.special import EOS_ID
from nmt.translate import (
    Helper,
    decode_batch,
    decode_workers,
    load_models,
    model_facts,
    source_batch,
    source_mask,
    to_translate,
    translate_lines,
    worker_threads,
)

ENGINES = ("nmt", "ctranslate2")
WARM_UP = (3, 11, 6, 20, 1, 15, 8, 30, 4)  # words of `NMTEngine.warm_up`'s sentences

# (text, hypothesis) per hypothesis, best first: an engine's n-best list of one line
NBest = list[tuple[str, Hypothesis]]


class Stream(Protocol):
    """Lines decoded while other lines come and go (a server's batch): `add` lines between
    steps, `step` decodes and returns the lines that are done. Used by one thread at a time."""

    def __len__(self) -> int:
        """Lines added and not yet returned."""

    def add(self, lines: list[str], ids: list) -> None:
        """Decode these (non-empty) lines from the next step on; `ids` name them in `step`.
        Lines that cannot join raise here, or, in a stream that takes them in at the step (a
        decoding process's, `nmt.decode_process.RemoteStream`), make that step raise
        `JoinError` with the batch as it was."""

    def step(self) -> list[tuple[object, NBest]]:
        """Decode; (id, n-best) of the lines that are done."""


class Engine(Protocol):
    """A decoder of a run's model."""

    config: Config  # the run's config (decode settings, languages)
    tokenizer: Tokenizer
    run_dir: Path  # the run the model comes from (an ensemble's first run)
    checkpoints: list[Path]  # the checkpoint file(s) decoded: several for an ensemble
    arch: str  # what decodes: an architecture, or the members' joined by "+"
    name: str  # the engine: "nmt" or "ctranslate2"
    precision: str  # what it computes in: nmt's precision, CTranslate2's quantization
    facts: dict[str, Any]  # parameters, checkpoint step, best validation BLEU (`model_facts`)

    def check(self, opts: SearchOptions) -> None:
        """Raise `NMTError` (one line) for settings this engine cannot honour."""

    def held(self) -> contextlib.AbstractContextManager:
        """While a caller decodes many batches with fixed weights (a server): whatever the
        engine keeps ready for them."""

    def translate(
        self,
        lines: list[str],
        opts: SearchOptions,
        batch_tokens: int,
        progress: Callable[[int], None] | None = None,
        workers: int = 0,
    ) -> list[list[tuple[str, Hypothesis]]]:
        """n-best (text, hypothesis) per input line; empty lines give an empty list."""

    def stream(self, opts: SearchOptions) -> Stream:
        """A `Stream` decoding lines with search settings `opts` (checked by `check`)."""


@dataclasses.dataclass
class NMTEngine:
    """nmt's own search (`nmt.translate.translate_lines`) on a loaded model (an `Ensemble`
    of several runs' models too)."""

    model: torch.nn.Module
    config: Config
    tokenizer: Tokenizer
    run_dir: Path
    device: torch.device
    precision: str
    checkpoints: list[Path]
    arch: str
    facts: dict[str, Any]
    name: str = "nmt"
    compiled: bool = False  # decodes through compiled code (`compile_decoding`)
    # decoders of whole batches in other processes, which `translate` hands batches to
    # (`nmt.decode_process.helping` sets them for the scope of a command's decoding)
    helpers: list[Helper] = dataclasses.field(default_factory=list)

    def check(self, opts: SearchOptions) -> None:
        pass

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The weights packed for the decoder once (`fixed_weights`), not at every call."""
        with fixed_weights(self.model):
            yield

    def translate(
        self,
        lines: list[str],
        opts: SearchOptions,
        batch_tokens: int,
        progress: Callable[[int], None] | None = None,
        workers: int = 0,
    ) -> list[list[tuple[str, Hypothesis]]]:
        return translate_lines(
            self.model,
            self.tokenizer,
            lines,
            opts,
            batch_tokens,
            self.device,
            self.precision,
            progress,
            workers,
            self.helpers,
        )

    def search(self, src: Tensor, opts: SearchOptions) -> list[list[Hypothesis]]:
        """Search one batch of token ids src[B,S] as `translate` searches each of its batches
        (a helper's child process does it for `translate` in another process)."""
        return decode_batch(self.model, src, opts, self.device, self.precision)

    def stream(self, opts: SearchOptions) -> NMTStream:
        return NMTStream(self, opts)

    def warm_up(self, opts: SearchOptions, progress: Callable[[], None] | None = None) -> None:
        """Decode made-up sentences with `opts` as a server's running batch does, so that
        compiled code (`compile_decoding`) makes its graphs now rather than during the first
        requests: batches of several and one sentence alone (a batch of one, and a step of one
        hypothesis per sentence, made graphs of their own before the batch sizes were
        unbacked: still met, should a torch without `shape_id` trace them backed), then
        sentences joining one at a time and leaving. Test sentences streamed after it make no
        graph more (tests). `progress()` after every step: the longest silence is one graph's
        compiling."""
        words = "the man in a red shirt is riding his bike down the street near two dogs".split()
        lines = [" ".join(itertools.islice(itertools.cycle(words), n)) for n in WARM_UP]
        with self.held():
            stream = self.stream(opts)

            def step() -> None:
                stream.step()
                if progress is not None:
                    progress()

            for group in (lines[:3], lines[:1], lines[3:6]):  # batches, then one alone
                stream.add(group, list(range(len(group))))
                while len(stream):
                    step()
            for i, line in enumerate(lines):
                stream.add([line], [i])
                step()
            while len(stream):
                step()


class NMTStream:
    """In-flight batching (`nmt.search.BeamStream`): added lines join the sentences being
    decoded at the next step, each searched as it would be alone, and leave the batch when
    they end. The caller holds the model's weights fixed (`NMTEngine.held`)."""

    def __init__(self, engine: NMTEngine, opts: SearchOptions) -> None:
        if opts.sample:
            raise ValueError("a stream searches (greedy or beam); it does not sample")
        self.engine = engine
        self.search = BeamStream(engine.model, opts)

    def __len__(self) -> int:
        return len(self.search)

    def add(self, lines: list[str], ids: list) -> None:
        e = self.engine
        src = source_batch(e.tokenizer.encode_src(lines)).to(e.device)
        with autocast(e.device, e.precision):  # thread-local
            self.search.add(src, source_mask(src), ids)

    def step(self) -> list[tuple[object, NBest]]:
        e = self.engine
        with autocast(e.device, e.precision):
            ended = self.search.step()
        return [
            (i, list(zip(e.tokenizer.decode_tgt([h.tokens for h in hyps]), hyps)))
            for i, hyps in ended
        ]


class BatchStream:
    """For an engine that decodes whole batches (`Engine.translate`): the lines added since
    the last step are decoded together at the next one, as one batch on the calling thread."""

    def __init__(self, engine: Engine, opts: SearchOptions, max_tokens: int) -> None:
        self.engine, self.opts, self.max_tokens = engine, opts, max_tokens
        self.pending: list[tuple[object, str]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, lines: list[str], ids: list) -> None:
        self.pending.extend(zip(ids, lines))

    def step(self) -> list[tuple[object, NBest]]:
        ids, lines = zip(*self.pending) if self.pending else ((), ())
        self.pending = []
        # a budget for all of them at the longest a line may be: one batch
        budget = len(lines) * (self.max_tokens + 1) * self.opts.beam
        results = self.engine.translate(list(lines), self.opts, batch_tokens=budget, workers=1)
        return list(zip(ids, results))


SUPPRESSED = [["<pad>"], ["<s>"]]  # nmt never generates PAD or BOS


def ct2_search(opts: SearchOptions) -> SearchOptions:
    """The search CTranslate2 runs when `CT2Engine` is asked for `opts`, as nmt's options:
    CTranslate2 has no exact stopping rule, so nmt's default (patience None) becomes patience
    1. nmt decoding with these options and CTranslate2 decoding with `opts` run the same search
    (up to the rounding of their scores); `scripts/bench_decode.py` compares their speed so."""
    return dataclasses.replace(opts, patience=1.0 if opts.patience is None else opts.patience)


class CT2Engine:
    """CTranslate2 on the run's export in `quantization` (`nmt.export.ctranslate2_for_decoding`:
    made once, again when the run's checkpoint changes)."""

    def __init__(self, path: Path, quantization: str, device: torch.device) -> None:
        from nmt import export

        ctranslate2 = export.require("ctranslate2", "--engine ctranslate2")
        export.check_quantization(quantization)
        if device.type not in ("cpu", "cuda"):
            raise NMTError(f"CTranslate2 runs on cpu or cuda, not {device.type}; use --device cpu")
        self.device = device.type
        self.device_index = device.index or 0  # cuda:N: CTranslate2's GPU N (its default: 0)
        supported = sorted(ctranslate2.get_supported_compute_types(self.device))
        if quantization not in supported:
            raise NMTError(
                f"CTranslate2 cannot compute in {quantization} on this {self.device}; "
                f"choose --quantization {', '.join(supported)}"
            )
        self.ctranslate2 = ctranslate2
        self.quantization = quantization
        self.model_dir, stamp = export.ctranslate2_for_decoding(path, quantization)
        self.config = export.export_config(stamp)
        self.run_dir = Path(stamp["run_dir"])
        self.checkpoints = [Path(stamp["checkpoint"]["path"])]
        self.arch = "transformer"
        self.name = "ctranslate2"
        self.precision = quantization
        self.facts = stamp["model"]
        self.tokenizer = Tokenizer(self.model_dir / "source.spm", self.model_dir / "target.spm")
        self.positions = max(export.CT2_POSITIONS, self.config.model.max_positions)
        self._translators: dict[tuple[int, int, int], Any] = {}
        self._lock = threading.Lock()

    def translator(self, workers: int, fresh: bool = False):
        """A `ctranslate2.Translator` decoding `workers` batches at once, the calling thread's
        torch intra-op threads split between them (0: as nmt decides,
        `nmt.translate.decode_workers`: 2 workers of 1 thread on 2 threads; CTranslate2's
        OpenMP threads also lose most to waiting when a batch's work is split finer); kept for
        the next call of the same thread unless `fresh`. One per calling thread: threads that
        decode at once (a server's batching threads, each asking for 1 worker) would otherwise
        queue on one translator's single worker."""
        workers = decode_workers(workers, torch.device(self.device), batches=1 << 30)
        threads = worker_threads(workers)
        key = (workers, threads, threading.get_ident())
        with self._lock:
            if fresh or key not in self._translators:
                translator = self.ctranslate2.Translator(
                    str(self.model_dir),
                    device=self.device,
                    device_index=self.device_index,
                    compute_type=self.quantization,
                    inter_threads=workers,
                    intra_threads=threads,
                )
                if fresh:
                    return translator
                self._translators[key] = translator
            return self._translators[key]

    def held(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def check(self, opts: SearchOptions) -> None:
        if opts.fixed_len is not None:
            raise NMTError("fixed-length decoding is nmt's benchmark mode; use --engine nmt")
        gnmt = opts.length_norm == "gnmt" and opts.length_penalty != 0
        if gnmt and opts.beam > 1 and not opts.sample:
            raise NMTError(
                f"decode.length_norm=gnmt with length penalty {opts.length_penalty}: CTranslate2's "
                "beam search divides by length ** alpha; use --length-norm plain or "
                "--length-penalty 0"
            )

    def options(self, opts: SearchOptions) -> dict[str, Any]:
        """translate_batch arguments for nmt's search settings (the length limits aside)."""
        self.check(opts)
        beam = 1 if opts.sample else opts.beam
        kwargs: dict[str, Any] = {
            "beam_size": beam,
            "patience": ct2_search(opts).patience,
            "num_hypotheses": min(opts.nbest, beam),
            # greedy: raw log-probabilities, normalised here as nmt normalises them
            "length_penalty": opts.length_penalty if beam > 1 else 0.0,
            "no_repeat_ngram_size": opts.no_repeat_ngram,
            "disable_unk": opts.ban_unk,
            "suppress_sequences": SUPPRESSED,
            "return_end_token": True,  # to know which hypotheses ended and how long they are
            "return_scores": True,
            "max_input_length": 0,  # nmt truncates no source
        }
        if opts.sample:
            vocab = self.tokenizer.tgt.get_piece_size()
            kwargs.update(
                sampling_topk=min(opts.top_k, vocab),  # 0: the whole vocabulary, as nmt's 0
                sampling_topp=opts.top_p,
                sampling_temperature=opts.temperature,
            )
        return kwargs

    def translate(
        self,
        lines: list[str],
        opts: SearchOptions,
        batch_tokens: int,
        progress: Callable[[int], None] | None = None,
        workers: int = 0,
    ) -> list[list[tuple[str, Hypothesis]]]:
        kwargs = self.options(opts)
        todo, sources = to_translate(lines, self.tokenizer.encode_src_pieces)
        limits = length_limits(torch.tensor([len(s) + 1 for s in sources]), opts).tolist()
        for i, (source, limit) in enumerate(zip(sources, limits)):
            if max(len(source) + 1, limit) > self.positions:
                raise NMTError(
                    f"line {todo[i] + 1} needs {max(len(source) + 1, limit)} positions; the "
                    f"CTranslate2 export encodes {self.positions}: use --engine nmt for it"
                )
        groups: dict[int, list[int]] = defaultdict(list)  # limit -> indices into sources
        for i, limit in enumerate(limits):
            groups[limit].append(i)
        if opts.sample:
            # CTranslate2 seeds a thread's generator when the thread first samples: a new
            # translator (one worker thread) for every call makes a seed reproduce its samples.
            self.ctranslate2.set_random_seed(opts.seed)
            translator = self.translator(1, fresh=True)
        else:
            translator = self.translator(workers)
        batch = max(1, batch_tokens // kwargs["beam_size"])
        pending = []
        for limit, idx in sorted(groups.items()):
            batch_sources = [sources[i] for i in idx]
            if limit == 1:  # room for the EOS only: its log-prob is the whole score
                scored = translator.score_batch(batch_sources, [[]] * len(idx), max_input_length=0)
                pending.append((idx, scored, False))
                continue
            results = translator.translate_batch(
                batch_sources,
                max_decoding_length=limit - 1,
                min_decoding_length=min(opts.min_len, limit - 1),
                max_batch_size=batch,
                batch_type="tokens",
                asynchronous=True,
                **kwargs,
            )
            pending.append((idx, results, True))
        hyps: list[list[Hypothesis]] = [[] for _ in sources]
        for idx, results, decoded in pending:
            for i, result in zip(idx, results):
                if decoded:
                    hyps[i] = self._hypotheses(result.result(), kwargs["length_penalty"], opts)
                else:
                    raw = float(sum(result.log_probs))
                    hyps[i] = [Hypothesis([], raw / float(length_penalty(1, opts)), raw)]
            if progress:
                progress(len(idx))
        out: list[list[tuple[str, Hypothesis]]] = [[] for _ in lines]
        for i, nbest in zip(todo, hyps):
            texts = self.tokenizer.decode_tgt([h.tokens for h in nbest])
            out[i] = list(zip(texts, nbest))
        return out

    def stream(self, opts: SearchOptions) -> BatchStream:
        return BatchStream(self, opts, max(self.positions, 1))

    def _hypotheses(self, result, alpha: float, opts: SearchOptions) -> list[Hypothesis]:
        """nmt's hypotheses of a CTranslate2 result: token ids, and the score normalised as
        nmt normalises (CTranslate2's score times length ** alpha is the raw log-prob)."""
        eos = self.tokenizer.tgt.id_to_piece(EOS_ID)
        out = []
        for tokens, score in zip(result.hypotheses, result.scores):
            length = len(tokens)  # EOS included when the hypothesis ended with one
            if tokens and tokens[-1] == eos:
                tokens = tokens[:-1]
            raw = score * length**alpha if alpha else score
            ids = [self.tokenizer.tgt.piece_to_id(t) for t in tokens]
            norm = raw / float(length_penalty(max(length, 1), opts))
            out.append(Hypothesis(ids, norm, raw))
        return out


def compiles(precision: str) -> bool:
    """Whether `compile_decoding` compiles decoding in `precision`: fp32, bf16 and fp16, not
    int8 (fbgemm's packed weights are objects dynamo does not trace: a graph break at every
    quantized linear map)."""
    return precision != INT8


def check_compile_precision(precision: str) -> None:
    """`NMTError` where `compile_decoding` does not compile decoding in `precision`."""
    if not compiles(precision):
        raise NMTError(
            f"--compile compiles fp32 and bf16 decoding, not {precision}'s quantized kernels: "
            "drop --compile or choose another --precision"
        )


def check_compile(model: torch.nn.Module, arch: str, precision: str) -> list[torch.nn.Module]:
    """The models `compile_decoding` compiles (an ensemble's members), or `NMTError` where
    it cannot."""
    check_compile_precision(precision)
    members = list(getattr(model, "members", [model]))
    if not all(hasattr(m, "compile_decoding") for m in members):
        raise NMTError(
            f"--compile compiles the transformer's decoding; {arch} decodes as it is: "
            "drop --compile"
        )
    return members


def compile_decoding(model: torch.nn.Module, arch: str, precision: str) -> None:
    """Make `model` (loaded to decode: its weights no longer change) decode through compiled
    code (`nmt.models.transformer.Transformer.compile_decoding`; an ensemble's members each),
    or raise `NMTError` where it cannot."""
    for m in check_compile(model, arch, precision):
        m.compile_decoding()


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's count; 0 in a process
    that never compiled, without importing the compiler for it). A compiled decoder that
    makes one more after `NMTEngine.warm_up` held its batch while it compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


def open_engine(
    paths: list[Path],
    engine: str,
    device: torch.device,
    precision: str | None = None,
    quantization: str | None = None,
    compile: bool = False,
) -> Engine:
    """The `engine` decoder of run directories or checkpoints: nmt (their model on `device`,
    an ensemble for several, in `precision` or the run's decode.precision, through compiled
    code with `compile` (`compile_decoding`)) or ctranslate2 (the one run's export in
    `quantization`, float32 by default)."""
    if engine not in ENGINES:
        raise NMTError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if engine == "nmt":
        if quantization is not None:
            raise NMTError(
                "--quantization applies to --engine ctranslate2; nmt decodes in int8 with "
                "--precision int8"
            )
        loaded = load_models(paths, device)
        prec = resolve_precision(precision or loaded.config.decode.precision, device, decoding=True)
        if compile:
            compile_decoding(loaded.model, loaded.arch, prec)
        checkpoints = [m.checkpoint for m in loaded.members] or [loaded.checkpoint]
        return NMTEngine(
            loaded.model,
            loaded.config,
            loaded.tokenizer,
            loaded.run_dir,
            device,
            prec,
            checkpoints,
            loaded.arch,
            model_facts(loaded.model, loaded.payload.get("progress", {})),
            compiled=compile,
        )
    if len(paths) > 1:
        raise NMTError(
            "CTranslate2 decodes one model, not an ensemble: give one run, or drop --engine"
        )
    path = paths[0]
    if engine == "ctranslate2":
        if compile:
            raise NMTError("--compile compiles nmt's own decoding: drop it or --engine")
        if precision is not None:
            raise NMTError(
                "--precision sets nmt's own decoding; CTranslate2 computes in its "
                "--quantization (float32 by default)"
            )
        return CT2Engine(path, quantization or "float32", device)
    raise NMTError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
