"""`nmt compare`: train several recipes on one pipeline, evaluate them identically, report.

Each recipe is a system, trained with `seeds` seeds (train.seed, +1, ...). Every run trains
into `OUT/runs/NAME-HASH` (HASH of its resolved data, tokenizer, model and train sections, the
seed included: not of its decoding settings), so a second invocation with the same training
settings reuses finished runs and resumes interrupted ones; a
finished `nmt train` run of the same recipe in its default run directory
(`runs/<folder>_<recipe>`) is reused too when its data, tokenizer, model and train sections
are the ones compare would train. All runs decode the same test splits with the same
decoding settings (the first recipe's `decode` section).

Scores: per run sacreBLEU's BLEU, chrF and TER; per system their mean, standard deviation and
range over seeds. Significance against the best system (best mean BLEU) by sacreBLEU's paired
bootstrap resampling on every pair (a seed of the best system, a seed of the other): the
report gives how many pairs favour the best system with p < 0.05, so seed variance counts.
With `ensemble`, ensembles join as systems of their own: of all systems (their first seeds),
and of each system's seeds.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt import NMTError, checkpoint, config
from nmt.config import Config, arch_of
from nmt.data.prepare import prepare
from nmt.device import resolve_device, resolve_precision
from nmt.files import write_atomic, write_lines
from nmt.metrics import (
    bleu_metric,
    check_bootstrap_samples,
    literature_bleu,
    paired_bootstrap,
    score,
)
from nmt.run import RunDir, default_run_dir
from nmt.train import Interrupted, Reporter, preflight, train
from nmt.translate import (
    Attention,
    attention_of,
    load_models,
    search_options,
    translate_lines,
    translate_texts,
)

log = logging.getLogger(__name__)

LENGTH_BUCKETS = [(1, 10), (11, 15), (16, 20), (21, 25), (26, 10_000)]
SIGNIFICANCE = 0.05
BUDGET_KEYS = ("max_steps", "max_epochs", "max_minutes", "max_tokens")


@dataclass
class Run:
    """One training of a system: its seed, resolved config and run directory."""

    seed: int
    cfg: Config
    run_dir: Path


@dataclass
class System:
    """A recipe trained with one or more seeds; or an ensemble of runs (no training)."""

    name: str
    recipe: Path | None
    runs: list[Run]
    members: list[Run] = field(default_factory=list)  # an ensemble's runs

    @property
    def cfg(self) -> Config:
        return self.runs[0].cfg

    @property
    def is_ensemble(self) -> bool:
        return bool(self.members)


def parse_budget(text: str | None) -> list[str]:
    """`--budget`: minutes (`30`, `30min`), optimizer steps (`2000steps`) or target tokens
    (`5Mtokens`, `500ktokens`), as overrides that replace the recipes' own budgets."""
    if text is None:
        return []
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:(min|m)|([kKmM]?)\s*(steps?|tokens?))?\s*", text)
    if not m or (m.group(3) and not m.group(4).startswith("token")):
        raise NMTError(
            f"bad --budget {text!r}; give minutes (30, 30m or 30min), steps (2000steps) or "
            "target tokens (5Mtokens)"
        )
    value, scale, unit = float(m.group(1)), (m.group(3) or "").lower(), m.group(4) or "min"
    if value <= 0:
        raise NMTError(f"--budget must be > 0 (got {text!r})")
    if unit == "min":
        key, amount = "max_minutes", value
    else:
        amount = value * {"": 1, "k": 1e3, "m": 1e6}[scale]
        if amount != int(amount) or amount < 1:
            raise NMTError(f"--budget {text!r}: steps and tokens are whole numbers")
        key, amount = ("max_steps" if unit.startswith("step") else "max_tokens"), int(amount)
    return [f"train.{k}={amount if k == key else 'null'}" for k in BUDGET_KEYS]


def describe_budget(text: str) -> str:
    """A `--budget` in words: "30 minutes", "2,000 steps", "5,000,000 target tokens"."""
    for override in parse_budget(text):
        key, value = override.removeprefix("train.").split("=")
        if value == "null":
            continue
        if key == "max_minutes":
            return f"{float(value):,g} minutes"
        return f"{int(value):,} " + ("steps" if key == "max_steps" else "target tokens")
    return text


def system_name(recipe: Path) -> str:
    return Path(recipe).stem


# what decides the weights a run trains (its decode section does not)
TRAINED = ("data", "tokenizer", "model", "train")


def _run_dir(out: Path, name: str, cfg: Config) -> Path:
    """out/runs/NAME-DIGEST, the digest of what trains the run's weights: a compare with other
    decoding settings reuses its runs. A folder an earlier nmt named by the digest of the whole
    config (decode section included) is reused where it exists."""
    earlier = out / "runs" / f"{name}-{cfg.digest()}"
    return earlier if earlier.is_dir() else out / "runs" / f"{name}-{cfg.digest(TRAINED)}"


def _trained_sections(cfg: Config) -> dict[str, Any]:
    d = cfg.to_dict()
    return {k: d[k] for k in TRAINED}


def _trained_by_nmt_train(recipe: Path, cfg: Config) -> Path | None:
    """The recipe's default `nmt train` run directory, when it trained exactly `cfg` (all but
    decoding) to the end of the budget compare asks for."""
    run = RunDir(default_run_dir(recipe))
    if not run.config_file.is_file():
        return None
    try:
        theirs = run.saved_config([])
        finished = run.state(cfg.train).kind == "finished"
    except NMTError:
        return None
    return run.path if finished and _trained_sections(theirs) == _trained_sections(cfg) else None


def plan(
    recipes: list[Path],
    out: Path,
    sets: list[str],
    budget: list[str],
    seeds: int = 1,
) -> list[System]:
    """The systems to compare, their runs (one per seed) and where each trains."""
    if seeds < 1:
        raise NMTError(f"--seeds must be >= 1 (got {seeds})")
    systems, names = [], set()
    for recipe in recipes:
        base = config.load(recipe, [*sets, *budget])
        name = system_name(recipe)
        if name in names:
            name = f"{Path(recipe).parent.name}-{name}"
        stem, k = name, 2
        while name in names:  # still taken: number it
            name, k = f"{stem}-{k}", k + 1
        names.add(name)
        runs = []
        for s in range(seeds):
            seed = base.train.seed + s
            cfg = config.replace(base, [f"train.seed={seed}"])
            run_dir = _trained_by_nmt_train(Path(recipe), cfg) or _run_dir(out, name, cfg)
            runs.append(Run(seed, cfg, run_dir))
        systems.append(System(name, Path(recipe), runs))
    decode = systems[0].cfg.decode
    for system in systems:  # one decoding setup for every system
        for run in system.runs:
            c = run.cfg
            run.cfg = config.Config(c.data, c.tokenizer, c.model, c.train, decode)
    return systems


def _check_out(out: Path) -> None:
    """Refuse an --out folder whose report.md or report.json nmt compare did not write: the
    report would be written over it (a report.md of notes was replaced). Other files there
    are left alone."""
    if not any((out / name).exists() for name in ("report.md", "report.json")):
        return
    try:
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
        ours = isinstance(report, dict) and "systems" in report
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise NMTError(
            f"--out {out} holds a report.md or report.json nmt compare did not write; give "
            "another folder, or move them out of it"
        )


def ensembles(systems: list[System]) -> list[System]:
    """With --ensemble: one ensemble of all systems (their first seeds), and with several
    seeds one of each system's seeds."""
    out = []
    if len(systems) > 1:
        firsts = [s.runs[0] for s in systems]
        out.append(System("ensemble (all)", None, [firsts[0]], firsts))
    for s in systems:
        if len(s.runs) > 1:
            name = f"{s.name} (ensemble of {len(s.runs)} seeds)"
            out.append(System(name, None, [s.runs[0]], list(s.runs)))
    return out


def _task(cfg: Config) -> tuple:
    """What decides the test sets and their references: equal for every compared system."""
    d = cfg.data
    fields = (d.source, d.hub_name, d.hub_config, d.local_dir, d.src_field, d.tgt_field)
    return (*fields, d.src, d.tgt, tuple(d.test), d.limit_test)


def _vocabulary(cfg: Config) -> str:
    """What decides the tokenizer (ensembles need one)."""
    d = cfg.to_dict()
    return json.dumps({"data": d["data"], "tokenizer": d["tokenizer"]}, sort_keys=True)


def ensure_trained(
    name: str, run: Run, reporter_factory: Callable[[], Reporter | None], say: Callable[[str], None]
) -> str:
    """Train, resume or reuse one run (its state under its budget, `RunDir.state`); returns
    what was done. A run that another process is writing is refused, also for reuse."""
    run_dir = RunDir(run.run_dir)
    state = run_dir.state(run.cfg.train)
    if state.kind == "finished":
        run_dir.check_not_written()  # refused while another process writes it; only read
        state = run_dir.state(run.cfg.train)
        if state.kind == "finished":
            say(f"{name}: reusing finished run {run.run_dir} ({state.reason})")
            return "reused"
    resume = state.kind == "resumable"
    if resume:
        say(f"{name}: resuming unfinished run {run.run_dir} from step {state.progress.step}")
    else:
        say(f"{name}: training into {run.run_dir}")
    reporter = reporter_factory()
    try:
        result = train(run.cfg, run.run_dir, resume=resume, reporter=reporter)
    finally:
        stop = getattr(reporter, "stop", None)
        if stop:
            stop()
    if result.signal is not None:  # saved: the comparison stops as the signal asked
        say(f"{name}: {result.stop_reason}; run the same nmt compare command again to resume it")
        raise Interrupted(result.signal)
    if not result.progress.finished:
        raise NMTError(
            f"{name} did not finish ({result.stop_reason}); run the same nmt compare command "
            "again to resume it"
        )
    return "resumed" if resume else "trained"


def _bucket_bleu(
    hyps: list[str], refs: list[str], srcs: list[str], tgt_lang: str
) -> list[float | None]:
    out, bleu = [], bleu_metric(tgt_lang)
    for lo, hi in LENGTH_BUCKETS:
        idx = [i for i, s in enumerate(srcs) if lo <= len(s.split()) <= hi]
        out.append(
            bleu.corpus_score([hyps[i] for i in idx], [[refs[i] for i in idx]]).score
            if idx
            else None
        )
    return out


def evaluate_run(
    paths: list[Path], cfg: Config, out: Path, label: str, splits: list[str], device
) -> dict[str, Any]:
    """Translate every test split with one run's model (several paths: their ensemble),
    write the translations, time the decoding. What it trained (steps, tokens, minutes,
    validations) from its last checkpoint and metrics, for a single run."""
    loaded = load_models(paths, device)
    precision = resolve_precision(cfg.decode.precision, device, decoding=True)
    prepared = prepare(cfg)
    result: dict[str, Any] = {
        "checkpoint": {
            "path": str(loaded.checkpoint),
            "step": loaded.payload["progress"]["step"],
            "averaged": loaded.payload.get("averaged"),
        },
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "translations": {},
        "test": {},
    }
    if len(paths) == 1:
        run = RunDir(paths[0])
        progress = checkpoint.load(run.checkpoint("last"))["progress"]
        history = progress["history"]
        result.update(
            {
                "run_dir": str(paths[0]),
                "steps": progress["step"],
                "tokens": progress["tokens"],
                "train_minutes": progress["seconds"] / 60,
                "train_tokens_per_s": progress["tokens"] / max(progress["train_seconds"], 1e-9),
                "best_valid_bleu": max((r["bleu"] for r in history if "bleu" in r), default=None),
                "finished": progress["finished"],
                "valid_history": [
                    {k: r.get(k) for k in ("step", "minutes", "bleu", "chrf", "loss", "averaged")}
                    for r in history
                ],
                "train_history": [
                    {k: r[k] for k in ("step", "minutes", "loss")}
                    for r in run.metrics()
                    if r["kind"] == "train"
                ],
            }
        )
    seconds = sentences = 0.0
    for split in splits:
        data = prepared.split(split)
        t0 = time.perf_counter()
        hyps = translate_texts(
            loaded.model, loaded.tokenizer, data.texts("src"), cfg.decode, device, precision
        )
        seconds += time.perf_counter() - t0
        sentences += len(hyps)
        write_lines(out / "translations" / f"{label}.{split}.{cfg.data.tgt}", hyps)
        result["translations"][split] = hyps
    result["decode_sentences_per_s"] = sentences / max(seconds, 1e-9)
    return result


def attention_example(run: Run, sentence: str, device) -> Attention | None:
    """Attention of the run's own translation of `sentence` (its decode settings)."""
    loaded = load_models([run.run_dir], device)
    opts = search_options(run.cfg.decode, nbest=1)
    precision = resolve_precision(run.cfg.decode.precision, device, decoding=True)
    (_, hyp), *_ = translate_lines(
        loaded.model, loaded.tokenizer, [sentence], opts, 10_000, device, precision
    )[0]
    return attention_of(loaded.model, loaded.tokenizer, sentence, hyp.tokens, device, precision)


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "score": statistics.fmean(values),  # the mean over seeds (the score of one run)
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def compare(
    recipes: list[Path],
    out: Path,
    sets: list[str] | None = None,
    budget: str | None = None,
    reporter_factory: Callable[[], Reporter | None] = lambda: None,
    say: Callable[[str], None] = log.info,
    bootstrap_samples: int = 1000,
    seeds: int = 1,
    ensemble: bool = False,
    lowercase: bool = False,
    tokenize: str | None = None,
) -> dict[str, Any]:
    """Train/reuse every run, evaluate all identically, write report.{md,json} and plots."""
    if not recipes:
        raise NMTError("give at least one recipe to compare")
    check_bootstrap_samples(bootstrap_samples)
    if out.exists() and not out.is_dir():
        raise NMTError(f"--out {out} is a file; give a directory for the report")
    _check_out(out)
    systems = plan(recipes, out, sets or [], parse_budget(budget), seeds)
    if len({_task(s.cfg) for s in systems}) > 1:
        raise NMTError(
            "recipes translate different directions or test sets (data: source, hub_name, "
            "local_dir, src, tgt, test, limit_test); compare needs one task"
        )
    if not systems[0].cfg.data.test:
        raise NMTError(
            "the recipes name no test sets (data.test is empty); nmt compare scores the systems "
            "on them, so list at least one"
        )
    if ensemble and len({_vocabulary(s.cfg) for s in systems}) > 1:
        raise NMTError(
            "--ensemble needs systems that share one tokenizer (the same data and tokenizer "
            "sections); these recipes train different ones"
        )
    for system in systems:
        preflight(system.cfg)
    tgt_lang = systems[0].cfg.data.tgt
    bleu_metric(tgt_lang)  # the test sets are scored with BLEU in any case
    literature = literature_bleu(lowercase, tokenize, tgt_lang) if lowercase or tokenize else None
    out.mkdir(parents=True, exist_ok=True)  # only once the setup is known to be sound
    total = sum(len(s.runs) for s in systems)
    done = 0
    for system in systems:
        for run in system.runs:
            done += 1
            label = system.name + (f" seed {run.seed}" if len(system.runs) > 1 else "")
            say(f"[{done}/{total}] {label} ({arch_of(system.cfg.model)})")
            ensure_trained(label, run, reporter_factory, say)

    device = resolve_device(systems[0].cfg.train.device)
    prepared = prepare(systems[0].cfg)
    splits = [s for s in prepared.summary["splits"] if s not in ("train", "valid")]
    units = systems + (ensembles(systems) if ensemble else [])
    labels = file_labels(units)
    results = []
    for system in units:
        say(f"evaluating {system.name} on {', '.join(splits)}")
        label = labels[system.name]
        if system.is_ensemble:
            paths = [r.run_dir for r in system.members]
            runs = [evaluate_run(paths, system.cfg, out, label, splits, device)]
        else:
            runs = [
                evaluate_run([r.run_dir], r.cfg, out, _run_label(label, r, system), splits, device)
                for r in system.runs
            ]
        for r, run in zip(runs, system.runs if not system.is_ensemble else [None]):
            r["seed"] = run.seed if run is not None else None
        results.append(_unit(system, runs))
    _score(results, prepared, splits, tgt_lang, literature, bootstrap_samples)

    example = _pick_example(prepared.split(splits[0]).texts("src"))
    report = {
        "systems": [_public(r) for r in results],
        "splits": splits,
        "seeds": seeds,
        "budget": budget,
        "budget_minutes": _minutes(budget),
        "total_train_minutes": sum(
            run["train_minutes"] for r in results for run in r["runs"] if "train_minutes" in run
        ),
        "total_train_tokens": sum(
            run["tokens"] for r in results for run in r["runs"] if "tokens" in run
        ),
        "decode": systems[0].cfg.decode.__dict__,
        "significance": (
            f"sacreBLEU paired bootstrap ({bootstrap_samples} resamples) on every pair of a run "
            f"of the best system and a run of the other; significant: p < {SIGNIFICANCE}"
        ),
        "length_buckets": [f"{lo}-{hi}" if hi < 10_000 else f"{lo}+" for lo, hi in LENGTH_BUCKETS],
        "example_sentence": example,
    }
    _write_plots(report, systems, labels, out, device, example)
    write_atomic(out / "report.json", json.dumps(report, indent=2))
    write_atomic(out / "report.md", _markdown(report, results, prepared, splits))
    return report


def file_labels(systems: list[System]) -> dict[str, str]:
    """Each system's label in file names (its translations, its attention figure): its name's
    letters, digits, '_' and '-', anything else a '-'; numbered where two names give one label
    ("rnn+attn" and "rnn-attn") or a name gives none ("基线": "system"), so that no system's
    files are another's. No dot: a run of several seeds adds ".seedN" to it."""
    labels: dict[str, str] = {}
    for system in systems:
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", system.name).strip("-") or "system"
        label, k = base, 2
        while label in labels.values():
            label, k = f"{base}-{k}", k + 1
        labels[system.name] = label
    return labels


def _run_label(label: str, run: Run, system: System) -> str:
    """File-name label of one run's translations."""
    return f"{label}.seed{run.seed}" if len(system.runs) > 1 else label


def _minutes(budget: str | None) -> float | None:
    for override in parse_budget(budget):
        key, _, value = override.partition("=")
        if key == "train.max_minutes" and value != "null":
            return float(value)
    return None


def _unit(system: System, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's report entry: its runs and what they share or average."""
    mean = lambda key: statistics.fmean(r[key] for r in runs) if key in runs[0] else None  # noqa: E731
    return {
        "name": system.name,
        "kind": "ensemble" if system.is_ensemble else "system",
        "arch": "+".join(arch_of(r.cfg.model) for r in system.members)
        if system.is_ensemble
        else arch_of(system.cfg.model),
        "recipe": None if system.recipe is None else str(system.recipe),
        "members": [str(r.run_dir) for r in system.members],
        "seeds": [r["seed"] for r in runs if r["seed"] is not None],
        "params": runs[0]["params"],
        "steps": mean("steps"),
        "tokens": mean("tokens"),
        "train_minutes": mean("train_minutes"),
        "train_tokens_per_s": mean("train_tokens_per_s"),
        "best_valid_bleu": (
            statistics.fmean(r["best_valid_bleu"] for r in runs)
            if all(r.get("best_valid_bleu") is not None for r in runs)
            else None
        ),
        "decode_sentences_per_s": mean("decode_sentences_per_s"),
        "checkpoint": runs[0]["checkpoint"],
        "valid_history": runs[0].get("valid_history", []),
        "train_history": runs[0].get("train_history", []),
        "runs": runs,
        "test": {},
    }


def _public(r: dict[str, Any]) -> dict[str, Any]:
    """A report entry without the translations (they are in OUT/translations/)."""
    return {
        **r,
        "runs": [{k: v for k, v in run.items() if k != "translations"} for run in r["runs"]],
    }


def _score(
    results: list[dict[str, Any]],
    prepared,
    splits: list[str],
    tgt_lang: str,
    literature,
    bootstrap_samples: int,
) -> None:
    """Scores of every run, their statistics per system, and significance against the best
    system of each split (every pair of runs)."""
    metrics = ("bleu", "chrf", "ter") + (("bleu_literature",) if literature is not None else ())
    for split in splits:
        data = prepared.split(split)
        refs, srcs = data.texts("tgt"), data.texts("src")
        for r in results:
            for run in r["runs"]:
                hyps = run["translations"][split]
                scores = score(hyps, [refs], tgt_lang, literature)
                run["test"][split] = {k: scores[k] for k in metrics}
                run["test"][split]["bleu_by_length"] = _bucket_bleu(hyps, refs, srcs, tgt_lang)
            r["test"][split] = {
                m: {
                    **_stats([run["test"][split][m]["score"] for run in r["runs"]]),
                    "signature": r["runs"][0]["test"][split][m]["signature"],
                }
                for m in metrics
            }
            r["test"][split]["bleu_by_length"] = [
                statistics.fmean(vals) if all(v is not None for v in vals) else None
                for vals in zip(*(run["test"][split]["bleu_by_length"] for run in r["runs"]))
            ]
        best = max(results, key=lambda r: r["test"][split]["bleu"]["mean"])
        pairs: dict[str, list[dict]] = {r["name"]: [] for r in results if r is not best}
        for i, best_run in enumerate(best["runs"]):
            others = {
                f"{r['name']}\x00{j}": run["translations"][split]
                for r in results
                if r is not best
                for j, run in enumerate(r["runs"])
            }
            base, vs = paired_bootstrap(
                best_run["translations"][split], others, [refs], bootstrap_samples, tgt_lang
            )
            for metric in ("bleu", "chrf"):
                best_run["test"][split][metric].update(
                    {k: base[metric][k] for k in ("ci_low", "ci_high")}
                )
            for key, stats in vs.items():
                name, j = key.split("\x00")
                pairs[name].append({"best_run": i, "run": int(j), **stats})
                if i == 0:
                    run = next(r for r in results if r["name"] == name)["runs"][int(j)]
                    for metric in ("bleu", "chrf"):
                        run["test"][split][metric].update(
                            {k: stats[metric][k] for k in ("ci_low", "ci_high")}
                        )
        for r in results:
            r["test"][split]["best"] = r is best
            for metric in ("bleu", "chrf"):
                entry = r["test"][split][metric]
                if len(r["runs"]) == 1:  # one run: its bootstrap interval
                    entry.update(
                        {k: r["runs"][0]["test"][split][metric][k] for k in ("ci_low", "ci_high")}
                    )
                if r is best:
                    entry["p_value_vs_best"] = None
                    continue
                ps = [p[metric]["p_value"] for p in pairs[r["name"]]]
                better = [
                    best["runs"][p["best_run"]]["test"][split][metric]["score"]
                    > r["runs"][p["run"]]["test"][split][metric]["score"]
                    for p in pairs[r["name"]]
                ]
                entry["p_value_vs_best"] = ps[0] if len(ps) == 1 else max(ps)
                entry["vs_best"] = {
                    "pairs": len(ps),
                    "best_better": sum(better),
                    "significant": sum(b and p < SIGNIFICANCE for b, p in zip(better, ps)),
                    "max_p": max(ps),
                }


def _pick_example(sources: list[str]) -> str:
    """A test sentence of typical length (12-16 words) for the attention figures."""
    for s in sources:
        if 12 <= len(s.split()) <= 16:
            return s
    return sources[0]


def _write_plots(
    report: dict, systems: list[System], labels: dict[str, str], out: Path, device, example: str
) -> None:
    from nmt import plots

    rows = [r for r in report["systems"] if r["kind"] == "system"]
    figures = report["figures"] = {}

    def per_seed(r: dict, points) -> list[list[tuple[float, float]]]:
        return [points(run) for run in r["runs"]]

    # Learning curves follow the training weights; a final average is not a point on them.
    def valid(run: dict, x: str) -> list[tuple[float, float]]:
        return [
            (h[x], h["bleu"])
            for h in run.get("valid_history", [])
            if h.get("bleu") is not None and not h.get("averaged")
        ]

    figures["valid_bleu_vs_time.png"] = plots.band_curves(
        {r["name"]: per_seed(r, lambda run: valid(run, "minutes")) for r in rows},
        "training wall-clock minutes",
        "validation BLEU",
        out / "valid_bleu_vs_time.png",
        "Validation BLEU vs time",
    )
    figures["valid_bleu_vs_steps.png"] = plots.band_curves(
        {r["name"]: per_seed(r, lambda run: valid(run, "step")) for r in rows},
        "training steps",
        "validation BLEU",
        out / "valid_bleu_vs_steps.png",
        "Validation BLEU vs steps",
    )
    figures["train_loss.png"] = plots.band_curves(
        {
            r["name"]: per_seed(
                r, lambda run: [(h["step"], h["loss"]) for h in run.get("train_history", [])]
            )
            for r in rows
        },
        "training steps",
        "training loss (label-smoothed, per token)",
        out / "train_loss.png",
        "Training loss",
    )
    split = report["splits"][0]
    figures["bleu_by_length.png"] = plots.grouped_bars(
        report["length_buckets"],
        {
            # a bucket without sentences has no bar (its score is None: "–" in report.md)
            r["name"]: [math.nan if v is None else v for v in r["test"][split]["bleu_by_length"]]
            for r in report["systems"]
        },
        "source length (words)",
        f"BLEU on {split}",
        out / "bleu_by_length.png",
        "BLEU by source length",
    )
    report["plots"] = list(figures)
    for system in systems:
        att = attention_example(system.runs[0], example, device)
        if att is None:
            continue
        name = f"attention_{labels[system.name]}.png"
        figures[name] = plots.attention_heatmap(
            att.weights,
            att.src_pieces,
            att.tgt_pieces,
            out / name,
            title=f"{system.name}: {example}",
        )
        report["plots"].append(name)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _score_cell(entry: dict, runs: int) -> str:
    if runs > 1:
        return f"{entry['mean']:.1f} ± {entry['sd']:.1f} [{entry['min']:.1f}–{entry['max']:.1f}]"
    if "ci_low" in entry:
        return f"{entry['score']:.1f} [{entry['ci_low']:.1f}, {entry['ci_high']:.1f}]"
    return f"{entry['score']:.1f}"


def _vs_best(entry: dict, best: bool) -> str:
    if best:
        return "best"
    v = entry.get("vs_best")
    if v is None or v["pairs"] == 1:
        return _fmt(entry["p_value_vs_best"], 4)
    return f"{v['significant']}/{v['pairs']} pairs p<{SIGNIFICANCE}"


def _markdown(report: dict, results: list[dict], prepared, splits: list[str]) -> str:
    lines = ["# nmt compare", ""]
    if report["budget"]:
        lines += [f"Training budget: {describe_budget(report['budget'])} per run.", ""]
    seeds = report["seeds"]
    lines += [
        f"Total training compute: {report['total_train_minutes']:.1f} minutes, "
        f"{report['total_train_tokens']:,} target tokens, over "
        f"{sum(len(r['runs']) for r in results if r['kind'] == 'system')} runs.",
        "",
    ]
    if seeds == 1:
        lines += [
            "Seeds: one run per system, so no seed variance was measured: differences between "
            "systems may be of the size that another seed alone would make (about ±0.5-1 BLEU "
            "on Multi30k). Run with --seeds 3 or more to measure it.",
            "",
        ]
    else:
        lines += [
            f"Seeds: {seeds} runs per system (train.seed, +1, ...); scores are mean ± standard "
            "deviation [min–max] over them.",
            "",
        ]
    d = report["decode"]
    lines += [
        f"Decoding: beam {d['beam']}, length penalty {d['length_penalty']} "
        f"({d.get('length_norm', 'gnmt')}), max length {d['max_len_a']}·|x|+{d['max_len_b']}"
        + (f", patience {d['patience']}." if d.get("patience") is not None else "."),
        "",
        f"Significance: {report['significance']}.",
        "",
        "Checkpoints evaluated (best validation score):",
        "",
    ]
    for r in report["systems"]:
        if r["kind"] == "ensemble":
            lines.append(f"- {r['name']}: ensemble of {', '.join(r['members'])}")
            continue
        for run in r["runs"]:
            c = run["checkpoint"]
            what = (
                "average of the weights at steps " + ", ".join(f"{s:,}" for s in c["averaged"])
                if c["averaged"]
                else f"step {c['step']:,}"
            )
            seed = f" (seed {run['seed']})" if len(r["runs"]) > 1 else ""
            lines.append(f"- {r['name']}{seed}: {what}")
    lines.append("")
    literature = "bleu_literature" in results[0]["test"][splits[0]]
    for split in splits:
        lines += [f"## {split}", ""]
        header = "| system | arch | params | seeds | steps | tgt tokens | train min | tgt tok/s | best valid BLEU | BLEU | vs best (BLEU) | chrF |"
        rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
        if literature:
            header += " BLEU as papers |"
            rule += "---|"
        header += " decode sent/s |"
        rule += "---:|"
        lines += [header, rule]
        for r in report["systems"]:
            t = r["test"][split]
            n = len(r["runs"])
            system = r["kind"] == "system"
            row = (
                f"| {r['name']} | {r['arch']} | {r['params']:,} | {n if system else '–'} | "
                f"{_fmt(r['steps'], 0) if system else '–'} | "
                f"{'–' if not system else format(int(r['tokens']), ',')} | "
                f"{_fmt(r['train_minutes']) if system else '–'} | "
                f"{'–' if not system else format(r['train_tokens_per_s'], ',.0f')} | "
                f"{_fmt(r['best_valid_bleu'])} | {_score_cell(t['bleu'], n)} | "
                f"{_vs_best(t['bleu'], t['best'])} | {_score_cell(t['chrf'], n)} |"
            )
            if literature:
                row += f" {_score_cell(t['bleu_literature'], n)} |"
            lines.append(row + f" {r['decode_sentences_per_s']:.1f} |")
        lines.append("")
        if literature:
            sig = results[0]["test"][split]["bleu_literature"]["signature"]
            lines += [f"BLEU as papers report it: sacreBLEU `{sig}`.", ""]
        others = [r for r in report["systems"] if not r["test"][split]["best"]]
        best = next(r for r in report["systems"] if r["test"][split]["best"])
        for r in others:
            v = r["test"][split]["bleu"].get("vs_best")
            if v is None:
                continue
            lines.append(
                f"- {best['name']} vs {r['name']}: higher BLEU in {v['best_better']} of "
                f"{v['pairs']} run pairs, significantly (p < {SIGNIFICANCE}) in "
                f"{v['significant']}; largest p {v['max_p']:.4f}."
            )
        if others:
            lines.append("")
        if seeds > 1:
            lines += [
                "Per seed:",
                "",
                "| system | seed | steps | BLEU | chrF | TER |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for r in report["systems"]:
                if r["kind"] != "system":
                    continue
                for run in r["runs"]:
                    t = run["test"][split]
                    lines.append(
                        f"| {r['name']} | {run['seed']} | {run['steps']:,} | {t['bleu']['score']:.1f} | "
                        f"{t['chrf']['score']:.1f} | {t['ter']['score']:.1f} |"
                    )
            lines.append("")
        lines += [
            "BLEU by source length (words):",
            "",
            "| system | " + " | ".join(report["length_buckets"]) + " |",
            "|---|" + "---:|" * len(report["length_buckets"]),
        ]
        for r in report["systems"]:
            lines.append(
                f"| {r['name']} | "
                + " | ".join(_fmt(v) for v in r["test"][split]["bleu_by_length"])
                + " |"
            )
        lines.append("")
    split = splits[0]
    data = prepared.split(split)
    srcs, refs = data.texts("src"), data.texts("tgt")
    lines += [f"## Example translations ({split})", ""]
    for i in (0, 1, 2, 100, 500):
        if i >= len(srcs):
            continue
        lines += [f"**source**: {srcs[i]}  ", f"**reference**: {refs[i]}  "]
        for r in results:
            lines.append(f"**{r['name']}**: {r['runs'][0]['translations'][split][i]}  ")
        lines.append("")
    lines += ["## Figures", ""] + [f"![{p}]({p})" for p in report.get("plots", [])] + [""]
    return "\n".join(lines)
