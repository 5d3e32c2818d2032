"""The `nmt` command line. The only module that imports typer, configures logging and draws
progress bars and tables."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import logging
import os
import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from nmt import NMTError, __version__, allocator

app = typer.Typer(
    name="nmt",
    help="Train, decode, evaluate and compare neural machine translation models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()
for _console in (err, out):  # logs and pipes: wide enough for the comparison tables
    if not _console.is_terminal and "COLUMNS" not in os.environ:
        _console.width = 160

_terminated: list[int] = []


def _on_sigterm(signum: int, frame: object) -> None:
    _terminated.append(signum)
    raise KeyboardInterrupt


def _sigterm_as_ctrl_c(command):
    """SIGTERM stops a command as Ctrl-C does (between two torch operations), so the output
    being written is removed (an export's temporary folder, a half-written translations
    file); main() then exits 143. Only for commands whose native calls are short (decoding,
    exporting, averaging): elsewhere SIGTERM keeps its default (training has its own
    handler; a tokenizer's training is one native call of minutes)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        before = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return command(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, before)

    return run


SET_HELP = "Override a recipe value, e.g. --set train.lr=3e-4 (repeatable)."
RUN_DIR_HELP = "Run directory (default: runs/<recipe-folder>_<recipe-name>)."
LENGTH_NORM_HELP = (
    "gnmt: ((5+|y|)/6)^alpha; plain: |y|^alpha (CTranslate2's). Default: decode.length_norm."
)
PATIENCE_HELP = (
    "End a sentence's beam once round(beam x P) hypotheses finished (CTranslate2's rule). "
    "Default: decode.patience (none: once no open hypothesis can beat the worst of the "
    "beam-size best finished ones)."
)
ENGINE_HELP = "nmt (its own search) or ctranslate2 (the run's CTranslate2 export, made once)."
PRECISION_HELP = (
    "fp32, bf16, fp16 (CUDA), int8 (CPU: int8 linear maps, the rest fp32) or auto "
    "(bf16 where the device runs it natively; else fp16 on CUDA, fp32 on CPU)."
)
COMPILE_HELP = (
    "The decoding processes decode through torch.compile'd code (the transformer on CPU, not "
    "int8, not with --threads): minutes of compiling before the server is ready, then faster "
    "steps."
)
QUANTIZATION_HELP = (
    "--engine ctranslate2 weights and compute type: float32 (default), int8, int8_float32, "
    "int8_bfloat16, bfloat16, ... (those this CPU supports)."
)


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False, show_time=False)],
        force=True,
    )
    # sacreBLEU logs each step of its significance tests at INFO.
    logging.getLogger("sacrebleu").setLevel(logging.DEBUG if verbose else logging.WARNING)
    # datasets' progress bars and info logs stay quiet. Through its environment variables, read
    # when it is imported (and inherited by subprocesses; values a user set are kept): importing
    # it here took ~0.7 s of every command, which most (translate, evaluate on files) do not
    # need.
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
        sys.modules["datasets"].logging.set_verbosity_error()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("DATASETS_VERBOSITY", "error")


def default_run_dir(recipe: Path) -> Path:
    from nmt.run import default_run_dir as run_dir_of_recipe

    return run_dir_of_recipe(recipe)


def _version(value: bool) -> None:
    if value:
        out.print(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Train, decode, evaluate and compare neural machine translation models."""


def _load_config(recipe: Path, sets: list[str]):
    from nmt import config

    return config.load(recipe, sets)


def prepare_table(summary: dict, padding: float | None) -> Table:
    table = Table(title=f"prepared {summary['src']}→{summary['tgt']} ({summary['key']})")
    for col in ("split", "source", "pairs", "src tokens/sent", "tgt tokens/sent"):
        table.add_column(col, justify="right" if "tok" in col or col == "pairs" else "left")
    for name, s in summary["splits"].items():
        table.add_row(
            name,
            str(s["source"]),
            f"{s['pairs']:,}",
            f"{s['src_tokens_mean']:.1f}",
            f"{s['tgt_tokens_mean']:.1f}",
        )
    d = summary["dropped"]
    v = summary["vocab"]
    sec = summary["seconds"]
    table.caption = (
        f"train read {summary['train_read']:,}; dropped: empty {d['empty']:,}, too long "
        f"{d['too_long']:,}, ratio {d['ratio']:,}\n"
        f"vocabulary: {'joint ' if v['joint'] else ''}src {v['src']:,} / tgt {v['tgt']:,}; "
        f"time {sec['total']:.1f}s (tokenizer {sec['tokenizer']:.1f}s, encode {sec['encode']:.1f}s)"
        + (f"\npadding in training batches: {padding:.1%}" if padding is not None else "")
    )
    return table


def show_prepared(prepared, padding: float) -> None:
    if prepared.reused:
        err.print(f"prepared data is up to date ({prepared.dir}); nothing to do")
    err.print(prepare_table(prepared.summary, padding))


@app.command()
def prepare(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    sets: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Load, clean, tokenize and cache the recipe's data; write the run directory's config."""
    from nmt.data.batching import TokenBatches
    from nmt.data.prepare import prepare as prepare_data
    from nmt.run import RunDir

    cfg = _load_config(recipe, sets)
    run = RunDir(run_dir or default_run_dir(recipe))
    run.check_not_written()  # a busy run: refused before the work, not after it
    with err.status("preparing data (download, tokenizer training, encoding)..."):
        prepared = prepare_data(cfg)
    with run.writer():
        run.attach(cfg, prepared.tokenizer_files)
    train = prepared.split("train")
    batches = TokenBatches.of(train, cfg.train)
    show_prepared(prepared, batches.padding_fraction())


class RichReporter:
    """Draws training progress: step, epoch, loss, lr, tokens/s, grad norm, ETA to the budget."""

    def __init__(self, data_table: bool = True) -> None:
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=err,
            transient=False,
        )
        self.task = None
        self.info: dict = {}
        self.data_table = data_table

    def prepared(self, prepared, padding: float) -> None:
        if self.data_table:
            show_prepared(prepared, padding)

    def start(self, info: dict) -> None:
        self.info = info
        err.print(
            f"[bold]{info['arch']}[/]: {info['params']:,} parameters on {info['device']} in "
            f"{info['precision']} (malloc: {info['allocator']}), {info['world']} process(es); "
            f"{info['train_pairs']:,} training pairs, "
            f"{info['steps_per_epoch']:,} steps/epoch, padding {info['padding']:.1%}"
            + (f"; resuming from step {info['resumed_from']}" if info["resumed_from"] else "")
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=1000, stats="")

    def _fraction(self, record: dict) -> float:
        parts = []
        if self.info.get("total_steps"):
            parts.append(record["step"] / self.info["total_steps"])
        if self.info.get("max_minutes"):
            parts.append(record["minutes"] / self.info["max_minutes"])
        if self.info.get("max_tokens"):
            parts.append(record["tokens"] / self.info["max_tokens"])
        return min(1.0, max(parts) if parts else 0.0)

    def log(self, record: dict) -> None:
        stats = (
            f"step {record['step']:,} ep {record['epoch']} loss {record['loss']:.3f} "
            f"lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s gnorm {record['grad_norm']:.2f}"
        )
        self.progress.update(self.task, completed=1000 * self._fraction(record), stats=stats)

    def validation(self, record: dict) -> None:
        table = Table(title=f"validation at step {record['step']:,}", show_edge=False)
        cols = ["loss", "ppl"] + [k for k in ("bleu", "chrf") if k in record]
        for c in cols:
            table.add_column(c, justify="right")
        table.add_column("best")
        table.add_row(*[f"{record[c]:.2f}" for c in cols], "yes" if record["best"] else "")
        self.progress.console.print(table)

    def message(self, text: str) -> None:
        self.progress.console.print(text)

    def finish(self, progress) -> None:
        """The bar at where training ended (it moves at log records only: a budget that
        is not a multiple of train.log_every left it short)."""
        if self.task is not None:
            record = {"step": progress.step, "minutes": progress.seconds / 60}
            record["tokens"] = progress.tokens
            self.progress.update(self.task, completed=1000 * self._fraction(record))

    def stop(self) -> None:
        if self.task is not None:
            self.progress.stop()


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    sets: list[str] = typer.Option([], "--set", help=SET_HELP),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --run-dir from last.pt."
    ),
) -> None:
    """Train the recipe's model (prepares the data first when it is missing or stale)."""
    from nmt.run import RunDir
    from nmt.train import INTERRUPTED
    from nmt.train import train as run_train

    run = RunDir(run_dir or default_run_dir(recipe))
    cfg = _load_config(recipe, sets)
    if resume and run.config_file.is_file():  # the run's own config, these overrides on top
        cfg = run.saved_config(sets)
    rank = int(os.environ.get("RANK", "0"))
    reporter = RichReporter() if rank == 0 else None
    try:
        result = run_train(cfg, run.path, resume=resume, reporter=reporter)
    finally:
        if reporter:
            reporter.stop()
    if rank == 0 and result.trained_steps:
        p = result.progress
        err.print(
            f"{result.stop_reason} at step {p.step:,} ({p.seconds / 60:.1f} min, "
            f"{p.tokens:,} target tokens); checkpoints in {run.checkpoints_dir}"
        )
        if result.stop_reason.startswith(INTERRUPTED):
            err.print(f"resume with: nmt train {recipe} --run-dir {run} --resume")
    if result.stop_reason.startswith("stopped:"):
        sys.exit(1)


@contextlib.contextmanager
def _progress_bar():
    """A transient progress bar on stderr: yields `start(description)`, which returns the
    `progress(total)` callback the library takes (it returns the per-batch tick)."""
    from rich.progress import Progress

    # only at a terminal: elsewhere (a log, a pipe) it cannot be erased and left a blank line
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:

        def start(description: str):
            def progress(total: int):
                task = bar.add_task(description, total=total)
                return lambda n: bar.advance(task, n)

            return progress

        yield start


def _decode_device(device: str):
    from nmt.device import resolve_device

    return resolve_device(device)


@app.command()
@_sigterm_as_ctrl_c
def translate(
    runs: list[Path] = typer.Argument(
        ..., help="Run directory or checkpoint file; several: their ensemble.", metavar="RUN..."
    ),
    input: Path | None = typer.Option(None, "--input", "-i", help="Input file (default: stdin)."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Output file (default: stdout)."
    ),
    beam: int | None = typer.Option(None, "--beam", help="Beam size (1 = greedy)."),
    nbest: int | None = typer.Option(
        None, "--nbest", help="Hypotheses per sentence (n-best format)."
    ),
    scores: bool = typer.Option(
        False, "--scores", help="Append the model score after a tab (NA for an empty line)."
    ),
    batch_tokens: int | None = typer.Option(
        None, "--batch-tokens", help="Source tokens x beam per batch."
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        help="Batches decoded at once on CPU (0 = auto: 2 with 2+ threads); from 2,000 lines at "
        "beam 5 (lines x beam >= 10,000), all but one in child processes.",
    ),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP),
    max_len_a: float | None = typer.Option(None, "--max-len-a"),
    max_len_b: int | None = typer.Option(None, "--max-len-b"),
    length_penalty: float | None = typer.Option(
        None, "--length-penalty", help="alpha of the length normalisation (0: none)."
    ),
    length_norm: str | None = typer.Option(None, "--length-norm", help=LENGTH_NORM_HELP),
    patience: float | None = typer.Option(None, "--patience", help=PATIENCE_HELP),
    no_repeat_ngram: int | None = typer.Option(None, "--no-repeat-ngram"),
    ban_unk: bool | None = typer.Option(
        None, "--ban-unk/--allow-unk", help="Never output <unk> (default: decode.ban_unk)."
    ),
    sample: bool = typer.Option(False, "--sample", help="Sample instead of searching."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int = typer.Option(0, "--seed"),
    attention_plot: Path | None = typer.Option(
        None, "--attention-plot", help="PNG heatmap of source x target attention (one sentence)."
    ),
    device: str = typer.Option("auto", "--device"),
    engine: str = typer.Option("nmt", "--engine", help=ENGINE_HELP),
    quantization: str | None = typer.Option(None, "--quantization", help=QUANTIZATION_HELP),
) -> None:
    """Translate lines from --input or stdin: one line per input line (with --nbest N, N lines
    `i ||| text ||| score` per input line). Several runs decode as an ensemble."""
    from nmt import config
    from nmt.decode_process import helping
    from nmt.engine import open_engine
    from nmt.files import replacing
    from nmt.metrics import read_text_lines, text_lines
    from nmt.translate import search_options

    if sample and ((beam or 1) > 1 or (nbest or 1) > 1):
        raise NMTError("--sample draws one translation per sentence; drop --beam and --nbest")
    if not sample and (temperature != 1.0 or top_k != 0 or top_p != 1.0):
        raise NMTError("--temperature, --top-k and --top-p shape sampling: add --sample")
    if output is not None:
        _check_output(output, **{"--input": input})
    if attention_plot is not None:
        _check_output(attention_plot, "--attention-plot", **{"--input": input, "--output": output})
        if engine != "nmt":
            raise NMTError("--attention-plot reads nmt's own model: drop --engine " + engine)
    dev = _decode_device(device)
    decoder = open_engine(runs, engine, dev, precision, quantization)
    overrides = _decode_overrides(
        beam=beam,
        nbest=nbest,
        batch_tokens=batch_tokens,
        workers=workers,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        length_penalty=length_penalty,
        length_norm=length_norm,
        patience=patience,
        no_repeat_ngram=no_repeat_ngram,
        ban_unk=ban_unk,
    )
    if beam is not None and nbest is None:
        overrides.append(f"decode.nbest={decoder.config.decode.nbest_within(beam)}")
    if sample:  # one sample per sentence, whatever the recipe's n-best setting
        overrides.append("decode.nbest=1")
    d = config.replace(decoder.config, overrides).decode
    opts = search_options(
        d,
        sample=sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        beam=1 if sample else d.beam,
    )
    decoder.check(opts)

    def emit(lines: list[str], sink, first: int = 0) -> None:
        """Translations of `lines` into `sink`; n-best ids count from `first`."""
        with helping(decoder, len(lines), opts, d.workers):  # many lines: child processes
            results = decoder.translate(lines, opts, d.batch_tokens, tick, d.workers)
        for i, nbest_list in enumerate(results, start=first):
            if d.nbest > 1:
                for text, hyp in nbest_list:
                    sink.write(f"{i} ||| {text} ||| {hyp.score:.4f}\n")
                if not nbest_list:  # an empty input line: one empty entry keeps every id
                    sink.write(f"{i} |||  ||| 0.0000\n")
                continue
            text, hyp = nbest_list[0] if nbest_list else ("", None)
            if scores:  # two columns on every row: NA for a line with nothing to translate
                sink.write(f"{text}\t{hyp.score:.4f}\n" if hyp else "\tNA\n")
            else:
                sink.write(f"{text}\n")
        sink.flush()

    tick = None
    if input is None and sys.stdin is None:
        raise NMTError("standard input is closed: give --input FILE, or pipe the lines in")
    # typed lines translated one by one to the terminal; with --output, typed lines are read
    # to the end (Ctrl-D) and written there, as piped ones are
    if input is None and output is None and sys.stdin.isatty() and attention_plot is None:
        err.print("[dim]interactive: type a sentence and press enter (Ctrl-D to quit)[/]")
        typed_lines = 0
        for typed in sys.stdin.buffer:  # bytes: a line that is not UTF-8 must not end the session
            try:
                line = text_lines(typed, "that line") or [""]  # the rules of files and pipes
            except NMTError:
                err.print("[bold red]error:[/] that line is not UTF-8 text; type it again")
                continue
            emit(line, sys.stdout, typed_lines)  # n-best ids: the line's number in the session
            typed_lines += 1
        return
    if input is not None:
        lines = read_text_lines(input)
    else:
        lines = text_lines(sys.stdin.buffer.read(), "standard input")
    if attention_plot is not None:
        _attention_plot(decoder, lines, opts, attention_plot)
    from rich.progress import Progress

    with Progress(console=err, transient=True, disable=input is None or not err.is_terminal) as bar:
        task = bar.add_task("translating", total=len(lines))

        def tick(n: int) -> None:
            bar.advance(task, n)

        if output is None:
            emit(lines, sys.stdout)
        else:
            with replacing(output) as f:
                emit(lines, f)


def _check_output(path: Path, option: str = "--output", **files: Path | None) -> None:
    """Refuses to write `option`'s `path` where it would replace one of the command's other
    `files` (option name: path; read first, then overwritten) or is a directory."""
    for other, source in files.items():
        if source is not None and path.resolve() == source.resolve():
            raise NMTError(f"{option} {path} is the {other} file; write {option} elsewhere")
    if path.is_dir():
        raise NMTError(f"{option} {path} is a directory; give a file name")


def _attention_plot(decoder, lines: list[str], opts, path: Path) -> None:
    from nmt.plots import attention_heatmap
    from nmt.translate import attention_of

    if len([ln for ln in lines if ln.strip()]) != 1:
        raise NMTError("--attention-plot needs exactly one input sentence")
    line = next(ln for ln in lines if ln.strip()).strip()
    (text, hyp), *_ = decoder.translate([line], opts, 10_000)[0]
    model, tokenizer = decoder.model, decoder.tokenizer
    att = attention_of(model, tokenizer, line, hyp.tokens, decoder.device, decoder.precision)
    if att is None:
        raise NMTError(
            f"the {decoder.arch} model has no attention (it reads the source through one "
            "fixed context vector); use an rnn_attention or transformer run"
        )
    attention_heatmap(att.weights, att.src_pieces, att.tgt_pieces, path, title=text)
    err.print(f"attention heatmap written to {path}")


def _decode_overrides(**values) -> list[str]:
    """`decode.KEY=VALUE` overrides of the options given (None: not given)."""
    return [f"decode.{k}={v}" for k, v in values.items() if v is not None]


@app.command()
@_sigterm_as_ctrl_c
def evaluate(
    runs: list[Path] = typer.Argument(
        None,
        help="Run directory or checkpoint to translate with; several: their ensemble.",
        metavar="[RUN...]",
    ),
    split: str | None = typer.Option(
        None, "--split", help="Prepared split to translate and score."
    ),
    hyp: Path | None = typer.Option(None, "--hyp", help="Existing hypotheses file."),
    ref: list[Path] = typer.Option([], "--ref", help="Reference file (repeatable)."),
    compare_hyp: Path | None = typer.Option(
        None, "--compare-hyp", help="Second system: paired bootstrap against it."
    ),
    beam: int | None = typer.Option(None, "--beam"),
    length_penalty: float | None = typer.Option(None, "--length-penalty"),
    length_norm: str | None = typer.Option(None, "--length-norm", help=LENGTH_NORM_HELP),
    patience: float | None = typer.Option(None, "--patience", help=PATIENCE_HELP),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP),
    engine: str = typer.Option("nmt", "--engine", help=ENGINE_HELP),
    quantization: str | None = typer.Option(None, "--quantization", help=QUANTIZATION_HELP),
    bootstrap_samples: int = typer.Option(1000, "--bootstrap-samples"),
    tgt_lang: str | None = typer.Option(
        None,
        "--tgt-lang",
        help="Target language code: picks BLEU's tokenizer (zh, ja, ko); default: the run's.",
    ),
    lowercase: bool = typer.Option(
        False, "--lowercase", help="Also a lowercased BLEU, as papers report (its own signature)."
    ),
    tokenize: str | None = typer.Option(
        None, "--tokenize", help="sacreBLEU tokenizer of that second BLEU (13a, intl, none, ...)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Score translations with sacreBLEU (BLEU, chrF, TER): a run on a split, or files."""
    import json

    from nmt.metrics import (
        bleu_metric,
        check_bootstrap_samples,
        literature_bleu,
        paired_bootstrap,
        read_text_lines,
        score,
    )

    literature, other = None, None

    def check_scoring(lang: str | None, lines: int) -> None:
        """What can be refused is refused before a split is decoded (minutes at beam 5) and
        its translations written: the metrics of the target language `lang`, and a second
        system's file of as many `lines`."""
        nonlocal literature, other
        bleu_metric(lang)
        if lowercase or tokenize is not None:
            literature = literature_bleu(lowercase, tokenize, lang)
        if compare_hyp is not None:
            check_bootstrap_samples(bootstrap_samples)
            other = read_text_lines(compare_hyp)
            if len(other) != lines:
                raise NMTError(
                    f"line counts differ: --compare-hyp {compare_hyp} has {len(other)} lines, "
                    f"the hypotheses {lines}; they must be line-aligned"
                )

    runs = runs or []
    if runs:
        from nmt.evaluate import translate_split  # torch: only to translate

        if hyp is not None:
            raise NMTError("give either a run directory or --hyp, not both")
        if ref:
            raise NMTError(
                "--ref scores --hyp files; a run is scored against its split's own references: "
                "drop --ref"
            )
        with _progress_bar() as bar:
            done = translate_split(
                runs,
                split,
                beam,
                precision,
                _decode_device(device),
                bar("translating"),
                overrides=_decode_overrides(
                    length_penalty=length_penalty, length_norm=length_norm, patience=patience
                ),
                engine=engine,
                quantization=quantization,
                before=lambda lang, lines: check_scoring(tgt_lang or lang, lines),
            )
        hyps, hyp_path = done.hyps, done.path
        tgt_lang = tgt_lang or done.tgt_lang
        refs_list = [done.refs]
    else:
        if hyp is None or not ref:
            raise NMTError("give a run directory (with --split), or --hyp FILE and --ref FILE")
        given = {"--beam": beam, "--length-penalty": length_penalty, "--length-norm": length_norm}
        given["--patience"] = patience
        given.update({"--precision": precision, "--quantization": quantization})
        given["--engine"] = None if engine == "nmt" else engine
        given["--split"] = split  # a run's split to translate: --ref is the reference here
        if any(v is not None for v in given.values()):
            options = ", ".join(k for k, v in given.items() if v is not None)
            raise NMTError(f"{options} set(s) how a run translates; with --hyp there is none")
        hyps = read_text_lines(hyp)
        refs_list = [read_text_lines(r) for r in ref]
        for r, lines in zip(ref, refs_list):
            if len(lines) != len(hyps):
                raise NMTError(
                    f"line counts differ: {hyp} has {len(hyps)} lines, {r} has {len(lines)}; "
                    "hypotheses and references must be line-aligned"
                )
        hyp_path = hyp
        check_scoring(tgt_lang, len(hyps))
    result = score(hyps, refs_list, tgt_lang, literature)
    if other is not None:
        base, systems = paired_bootstrap(
            other, {"system": hyps}, refs_list, bootstrap_samples, tgt_lang
        )
        result["bootstrap"] = {
            "system": systems["system"],
            "compare": base,
            "n_samples": bootstrap_samples,
        }
    if json_out:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table(title=f"{result['n_sentences']:,} sentences")
    for col in ("metric", "score", "signature"):
        table.add_column(col)
    for name in ("bleu", "chrf", "ter", "bleu_literature"):
        if name in result:
            label = "BLEU (as papers)" if name == "bleu_literature" else name.upper()
            table.add_row(label, f"{result[name]['score']:.2f}", result[name]["signature"])
    out.print(table)
    if "bootstrap" in result:
        title = f"paired bootstrap ({bootstrap_samples} samples) against {escape(str(compare_hyp))}"
        bt = Table(title=title)
        for col in ("system", "BLEU (95% CI)", "chrF (95% CI)", "p (BLEU)", "p (chrF)"):
            bt.add_column(col)
        for name, label in (("system", str(hyp_path)), ("compare", str(compare_hyp))):
            r = result["bootstrap"][name]
            bt.add_row(
                escape(label),  # a file name, not rich markup ("exp[lr=3e-4]/valid.de")
                f"{r['bleu']['score']:.2f} [{r['bleu']['ci_low']:.2f}, {r['bleu']['ci_high']:.2f}]",
                f"{r['chrf']['score']:.2f} [{r['chrf']['ci_low']:.2f}, {r['chrf']['ci_high']:.2f}]",
                "" if r["bleu"]["p_value"] is None else f"{r['bleu']['p_value']:.4f}",
                "" if r["chrf"]["p_value"] is None else f"{r['chrf']['p_value']:.4f}",
            )
        out.print(bt)


@app.command()
@_sigterm_as_ctrl_c
def score(
    runs: list[Path] = typer.Argument(
        ..., help="Run directory or checkpoint; several: their ensemble.", metavar="RUN..."
    ),
    src: Path = typer.Option(..., "--src", help="Source sentences, one per line."),
    tgt: Path = typer.Option(..., "--tgt", help="Their translations, line-aligned."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Default: stdout."),
    fmt: str = typer.Option("tsv", "--format", help="tsv or jsonl."),
    batch_tokens: int | None = typer.Option(None, "--batch-tokens", help="Tokens per batch."),
    max_len: int = typer.Option(
        1024,
        "--max-len",
        help="Lines of more tokens than this, the end-of-sentence token counted, are not scored.",
    ),
    length_penalty: float | None = typer.Option(
        None, "--length-penalty", help="Of the normalised score (default: decode.length_penalty)."
    ),
    length_norm: str | None = typer.Option(None, "--length-norm", help=LENGTH_NORM_HELP),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Log-probability of each target line given its source (forced decoding): total, per
    token and length-normalised (as `nmt translate --scores` with the same --length-penalty
    and --length-norm), one line per input line. The lines are encoded as text: a
    translation whose pieces the tokenizer would not make of its text scores as the pieces it
    makes. TSV columns: logprob, per_token, normalized, tokens, status (ok, empty, too long;
    NA values unless ok)."""
    import json

    from nmt import config
    from nmt.device import resolve_precision
    from nmt.files import replacing
    from nmt.forced import score_pairs
    from nmt.metrics import read_text_lines
    from nmt.translate import load_models

    if fmt not in ("tsv", "jsonl"):
        raise NMTError(f"unknown --format {fmt!r}; choose tsv or jsonl")
    if max_len < 1:
        raise NMTError(f"--max-len must be >= 1 (got {max_len})")
    sources, targets = read_text_lines(src), read_text_lines(tgt)
    if len(sources) != len(targets):
        raise NMTError(
            f"line counts differ: {src} has {len(sources)} lines, {tgt} has {len(targets)}; "
            "sources and targets must be line-aligned"
        )
    if output is not None:
        _check_output(output, **{"--src": src, "--tgt": tgt})
    dev = _decode_device(device)
    loaded = load_models(runs, dev)
    overrides = _decode_overrides(length_penalty=length_penalty, length_norm=length_norm)
    d = config.replace(loaded.config, overrides).decode
    budget = batch_tokens or d.batch_tokens
    if budget < 16:
        raise NMTError(f"--batch-tokens must be >= 16 (got {budget})")
    prec = resolve_precision(precision or d.precision, dev, decoding=True)
    models = [m.model for m in loaded.members] or [loaded.model]
    scores = score_pairs(models, loaded.tokenizer, sources, targets, d, budget, dev, prec, max_len)

    def cell(value) -> str:
        return (
            "NA" if value is None else (f"{value:.6f}" if isinstance(value, float) else str(value))
        )

    def write(sink) -> None:
        for i, pair in enumerate(scores, 1):
            row = pair.row()
            if fmt == "jsonl":
                sink.write(json.dumps({"line": i, **row}) + "\n")
            else:
                sink.write("\t".join(cell(v) for v in row.values()) + "\n")

    if output is None:
        write(sys.stdout)
    else:
        with replacing(output) as f:
            write(f)


@app.command()
@_sigterm_as_ctrl_c
def export(
    run: Path = typer.Argument(..., help="Run directory or checkpoint file (a transformer)."),
    fmt: str = typer.Option(
        ...,
        "--format",
        help="ctranslate2 (a CTranslate2 model) or hf (a Hugging Face MarianMTModel).",
    ),
    out: Path = typer.Option(..., "--out", help="Directory to write (refused if it exists)."),
    quantization: str | None = typer.Option(
        None,
        "--quantization",
        help="ctranslate2 weights: float32 (default), int8, int8_float32, int8_float16, "
        "int8_bfloat16, int16, float16 or bfloat16.",
    ),
    force: bool = typer.Option(False, "--force", help="Replace --out (once the export succeeded)."),
) -> None:
    """Export a transformer run for CTranslate2 or Hugging Face Transformers."""
    from nmt.export import FORMATS, export_ctranslate2, export_hf

    if fmt == "ctranslate2":
        source = export_ctranslate2(run, out, quantization or "float32", force)
        how = f'ctranslate2.Translator("{out}") (see {out / "README.md"})'
    elif fmt == "hf":
        if quantization is not None:
            raise NMTError("--quantization applies to --format ctranslate2 (hf writes float32)")
        source = export_hf(run, out, force)
        how = f'MarianMTModel.from_pretrained("{out}") (see {out / "README.md"})'
    else:
        raise NMTError(f"unknown --format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    err.print(f"exported {source.checkpoint} to {out}; load it with {how}")


@app.command()
@_sigterm_as_ctrl_c
def average(
    run: Path = typer.Argument(..., help="Run directory."),
    last: int = typer.Option(0, "--last", help="Average the last K step checkpoints."),
    checkpoints: list[Path] = typer.Option(
        [], "--checkpoint", help="Explicit checkpoint (repeatable)."
    ),
    output: Path | None = typer.Option(
        None, "--output", help="Default: RUN/checkpoints/averaged.pt"
    ),
    promote: bool = typer.Option(
        True,
        "--promote/--no-promote",
        help="Validate the average; make it the run's best.pt when it beats the best.",
    ),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Average the weights of several checkpoints, validate the average, and make it the
    run's model (best.pt) when it beats the run's best validation score."""
    from nmt import checkpoint
    from nmt.run import RunDir

    if last < 0:
        raise NMTError(f"--last must be >= 1 (got {last})")
    runs = RunDir(run)
    if not runs.path.is_dir():  # it said "keeps 0 step checkpoints"
        raise NMTError(f"no such run directory: {run}")
    paths = list(checkpoints)
    if last:
        kept = runs.step_checkpoints()
        if len(kept) < last:
            raise NMTError(f"{run} keeps {len(kept)} step checkpoints, fewer than --last {last}")
        paths += kept[-last:]
    if not paths:
        raise NMTError("say what to average: --last K or --checkpoint PATH (repeatable)")
    target = output or runs.checkpoint("averaged")
    if target.is_dir():
        raise NMTError(f"--output {target} is a directory; give a file name")
    why = {"last": "training resumes from it", "best": "a better average is promoted to it"}
    for kind, reason in why.items():
        if target.resolve() == runs.checkpoint(kind).resolve():
            raise NMTError(
                f"--output {target} is the run's {kind}.pt ({reason}); give another file name"
            )
    folder = target.resolve().parent
    mine = folder == runs.checkpoints_dir.resolve()
    if target.exists() and not mine:  # elsewhere, only an nmt checkpoint is written over
        try:
            checkpoint.load(target, mmap=True)
        except NMTError:
            raise NMTError(
                f"--output {target} exists and is not an nmt checkpoint; give another file name"
            ) from None
    owner = RunDir(folder.parent)
    if not mine and folder == owner.checkpoints_dir and owner.config_file.is_file():
        raise NMTError(
            f"--output {target} is in another run's checkpoints ({owner.path}); write "
            f"the average of {run} in its own checkpoints folder or outside any run"
        )
    if any(target.resolve() == Path(p).resolve() for p in paths):
        raise NMTError(
            f"--output {target} is one of the checkpoints averaged; give another file name"
        )
    if runs.is_step_checkpoint(target):
        raise NMTError(
            f"--output {target} is named as the run's step checkpoints, which --last, "
            "train.keep_last and train.average_last count as training's saves; give another file name"
        )
    dev = _decode_device(device)
    with runs.writer():  # no training may write the run meanwhile
        averaged = checkpoint.average(paths)
        if runs.checkpoint("last").is_file():  # the run's own model, not another's
            own = checkpoint.load(runs.checkpoint("last"), mmap=True)
            if difference := checkpoint.model_difference(averaged, own):
                what, theirs, ours = difference
                raise NMTError(
                    f"the checkpoints given are not of {run}'s model ({what} {theirs} against "
                    f"{ours}); average checkpoints of the run itself"
                )
        averaged["run_dir"] = averaged.get("run_dir") or str(RunDir.of_checkpoint(paths[-1]).path)
        averaged["averaged"] = sorted(
            checkpoint.load(p, mmap=True)["progress"]["step"] for p in paths
        )
        checkpoint.save(averaged, target)
        err.print(f"averaged {len(paths)} checkpoints into {target}")
        if not promote or not runs.checkpoint("last").is_file():
            return
        from nmt.train import validate_average

        with err.status("validating the average..."):
            record, promoted = validate_average(runs, averaged, dev)
        scores = ", ".join(f"{k} {record[k]:.2f}" for k in ("loss", "bleu", "chrf") if k in record)
        if promoted:
            err.print(
                f"validation: {scores}; better than the run's best: it is now {runs.checkpoint('best')}"
            )
        else:
            err.print(f"validation: {scores}; {runs.model_checkpoint()} stays the run's model")


@app.command()
def compare(
    recipes: list[Path] = typer.Argument(..., help="Recipe YAML files to compare."),
    out_dir: Path = typer.Option(Path("runs/compare"), "--out", help="Report directory."),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="Per run, replacing the recipes' budgets: minutes (30), steps (2000steps) or "
        "target tokens (5Mtokens).",
    ),
    seeds: int = typer.Option(1, "--seeds", help="Runs per recipe (train.seed, +1, ...)."),
    ensemble: bool = typer.Option(
        False, "--ensemble", help="Also ensembles: of all systems, and of each system's seeds."
    ),
    lowercase: bool = typer.Option(False, "--lowercase", help="Also a lowercased BLEU."),
    tokenize: str | None = typer.Option(None, "--tokenize", help="Its sacreBLEU tokenizer."),
    sets: list[str] = typer.Option([], "--set", help=SET_HELP + " Applies to every recipe."),
    bootstrap_samples: int = typer.Option(1000, "--bootstrap-samples"),
) -> None:
    """Train (or reuse) each recipe, evaluate all on the same test sets, write report + plots."""
    from nmt.compare import compare as run_compare
    from nmt.compare import parse_budget
    from nmt.train import Interrupted

    parse_budget(budget)
    for recipe in recipes:
        _load_config(recipe, sets)  # fail fast on a bad recipe before any training
    try:
        report = run_compare(
            recipes,
            out_dir,
            sets,
            budget,
            reporter_factory=functools.partial(RichReporter, data_table=False),
            say=lambda text: err.print(f"[bold cyan]{text}[/]"),
            bootstrap_samples=bootstrap_samples,
            seeds=seeds,
            ensemble=ensemble,
            lowercase=lowercase,
            tokenize=tokenize,
        )
    except Interrupted as stopped:  # a run saved where it was: exit 130, or 143 for SIGTERM
        if stopped.signal == "SIGTERM":
            _terminated.append(signal.SIGTERM)
        raise KeyboardInterrupt from None
    for split in report["splits"]:
        table = Table(title=f"{split} (report: {out_dir / 'report.md'})")
        for col in (
            "system",
            "params",
            "seeds",
            "train min",
            "steps",
            "tok/s",
            "BLEU",
            "vs best",
            "chrF",
            "sent/s",
        ):
            table.add_column(col, justify="left" if col == "system" else "right")
        for r in report["systems"]:
            t = r["test"][split]
            b, n = t["bleu"], len(r["runs"])
            system = r["kind"] == "system"
            bleu = f"{b['mean']:.1f} ± {b['sd']:.1f}" if n > 1 else f"{b['score']:.1f}"
            if n == 1 and "ci_low" in b:
                bleu += f" [{b['ci_low']:.1f}, {b['ci_high']:.1f}]"
            vs = b.get("vs_best")
            versus = (
                "best"
                if t["best"]
                else (
                    f"{vs['significant']}/{vs['pairs']} sig."
                    if vs and vs["pairs"] > 1
                    else f"p={b['p_value_vs_best']:.3f}"
                )
            )
            table.add_row(
                f"{r['name']} ({r['arch']})",
                f"{r['params']:,}",
                str(n) if system else "–",
                f"{r['train_minutes']:.1f}" if system else "–",
                f"{r['steps']:,.0f}" if system else "–",
                f"{r['train_tokens_per_s']:,.0f}" if system else "–",
                bleu,
                versus,
                f"{t['chrf']['mean']:.1f}",
                f"{r['decode_sentences_per_s']:.1f}",
            )
        out.print(table)


@app.command()
def serve(
    runs: list[str] = typer.Argument(
        ...,
        metavar="RUN_DIR_OR_CKPT",
        help="Run directories or checkpoints to serve, NAME=PATH to name one; the first is the default.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    max_batch_tokens: int | None = typer.Option(
        None,
        "--max-batch-tokens",
        help="Source tokens x beam in a running batch (default: decode.batch_tokens).",
    ),
    max_wait_ms: float = typer.Option(
        50.0,
        "--max-wait-ms",
        help="How long an idle decoding thread gathers sentences before it starts (or a fifth "
        "of it with no new one); a busy one takes them into its running batch at its next step.",
    ),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP),
    engine: str = typer.Option("nmt", "--engine", help=ENGINE_HELP),
    quantization: str | None = typer.Option(None, "--quantization", help=QUANTIZATION_HELP),
    beam: int | None = typer.Option(
        None, "--beam", help="Default beam size (requests may set theirs, up to 32)."
    ),
    length_penalty: float | None = typer.Option(
        None, "--length-penalty", help="Default alpha (requests may set theirs)."
    ),
    length_norm: str | None = typer.Option(None, "--length-norm", help=LENGTH_NORM_HELP),
    patience: float | None = typer.Option(
        None, "--patience", help="Default patience (requests may set theirs). " + PATIENCE_HELP
    ),
    workers: int = typer.Option(
        0,
        "--workers",
        help="Decoding threads, each with a running batch (0 = auto: 2 with 2+ threads).",
    ),
    processes: bool = typer.Option(
        True,
        "--processes/--threads",
        help="On CPU, each decoding thread runs nmt's search in a child process of its own "
        "(two searches in one process take turns at Python's lock); --threads keeps them in "
        "the server's process.",
    ),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    max_lines: int = typer.Option(100, "--max-lines", help="Lines per request."),
    max_body_kb: int = typer.Option(1024, "--max-body-kb", help="Request body size limit."),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Serve models over HTTP: POST /translate, GET /models, a page at /, API docs at /docs."""
    try:
        from nmt import serve as server
    except ImportError as e:
        if e.name and e.name.split(".")[0] in ("fastapi", "starlette", "uvicorn", "pydantic"):
            raise NMTError(
                f"nmt serve needs the serve extra ({e.name} is missing): pip install 'nmt[serve]'"
            ) from None
        raise
    from nmt.device import resolve_device

    settings = server.ServeSettings(
        max_batch_tokens=max_batch_tokens,
        max_wait_ms=max_wait_ms,
        workers=workers,
        processes=processes,
        compile=compile,
        max_lines=max_lines,
        max_body_bytes=max_body_kb * 1024,
        decode=tuple(
            _decode_overrides(
                length_penalty=length_penalty, length_norm=length_norm, patience=patience
            )
        ),
        beam=beam,
    )
    server.serve(
        server.model_specs(runs),
        settings,
        host,
        port,
        resolve_device(device),
        precision,
        engine,
        quantization,
    )


def _click_errors() -> tuple[type[Exception], ...]:
    """Usage errors (bad or missing options and arguments): typer >= 0.29 raises those of its
    own copy of click, older typer those of click."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except ImportError:
            pass
    return tuple(found)


def main() -> None:
    # Python's shutdown runs full garbage collections over every object left, torch's hundreds
    # of thousands included: 0.5-0.7 s of every command's exit on the 2-core machine (import
    # torch alone: 0.5 s). Objects frozen when the interpreter exits are left out of them:
    # exit takes ~0.15 s. Files are closed by then (`with` blocks); thread joins and the other
    # atexit handlers still run. A caller of main() that goes on running is not affected.
    atexit.register(gc.freeze)
    _setup_logging(verbose=bool(os.environ.get("NMT_DEBUG")))
    try:
        allocator.relaunch()  # on TCMalloc where the machine has it (an exec: returns if not)
        if logging.getLogger("nmt").isEnabledFor(logging.DEBUG):  # reads /proc/self/maps
            logging.getLogger("nmt").debug("malloc: %s", allocator.in_use())
        code = app(standalone_mode=False)
    except NMTError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):  # older typer turns Ctrl-C into Abort
        code = 130
    except typer.Exit as e:
        code = e.exit_code
    except _click_errors() as e:
        e.show()
        sys.exit(2 if e.exit_code in (1, 2) else e.exit_code)
    except OSError as e:  # a path the user gave cannot be read or written
        if os.environ.get("NMT_DEBUG") or e.strerror is None:
            raise
        where = f": {e.filename}" if e.filename else ""
        err.print(f"[bold red]error:[/] {escape(e.strerror + where)}", highlight=False)
        sys.exit(2)
    # Without standalone mode typer returns the code of a typer.Exit (130 for Ctrl-C, which it
    # turns into Exit(130)) instead of exiting: a returned code is the process' exit code.
    if code == 130:
        err.print("terminated" if _terminated else "interrupted")
        code = 128 + _terminated[0] if _terminated else code
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
