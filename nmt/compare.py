"""`nmt compare`: train several recipes on one pipeline, evaluate them identically, report.

Each recipe trains into `OUT/runs/NAME-HASH` (HASH of its resolved config), so a second
invocation with the same settings reuses finished runs and resumes interrupted ones. All
systems decode the same test splits with the same decoding settings (the first recipe's
`decode` section); scores come with bootstrap 95% confidence intervals and paired-bootstrap
p-values against the best system.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt import NMTError, checkpoint, config
from nmt.config import Config, arch_of
from nmt.data.prepare import prepare
from nmt.device import resolve_device, resolve_precision
from nmt.files import write_atomic, write_lines
from nmt.metrics import bleu_metric, check_bootstrap_samples, paired_bootstrap, score
from nmt.models.base import count_parameters
from nmt.run import RunDir
from nmt.train import Reporter, preflight, train
from nmt.translate import (
    Attention,
    attention_of,
    load_model,
    search_options,
    translate_lines,
    translate_texts,
)

log = logging.getLogger(__name__)

LENGTH_BUCKETS = [(1, 10), (11, 15), (16, 20), (21, 25), (26, 10_000)]


@dataclass
class System:
    name: str
    recipe: Path
    cfg: Config
    run_dir: Path


def system_name(recipe: Path) -> str:
    return Path(recipe).stem


def plan(recipes: list[Path], out: Path, sets: list[str], budget: float | None) -> list[System]:
    systems = []
    extra = [*sets] + ([f"train.max_minutes={budget}"] if budget is not None else [])
    names = set()
    for recipe in recipes:
        cfg = config.load(recipe, extra)
        name = system_name(recipe)
        if name in names:
            name = f"{Path(recipe).parent.name}-{name}"
        base, k = name, 2
        while name in names:  # still taken: number it
            name, k = f"{base}-{k}", k + 1
        names.add(name)
        systems.append(System(name, Path(recipe), cfg, out / "runs" / f"{name}-{cfg.digest()}"))
    decode = systems[0].cfg.decode
    for s in systems[1:]:  # one decoding setup for every system
        s.cfg = config.Config(s.cfg.data, s.cfg.tokenizer, s.cfg.model, s.cfg.train, decode)
    return systems


def _task(cfg: Config) -> tuple:
    """What decides the test sets and their references: equal for every compared system."""
    d = cfg.data
    fields = (d.source, d.hub_name, d.hub_config, d.local_dir, d.src_field, d.tgt_field)
    return (*fields, d.src, d.tgt, tuple(d.test), d.limit_test)


def ensure_trained(
    system: System, reporter_factory: Callable[[], Reporter | None], say: Callable[[str], None]
) -> str:
    """Train, resume or reuse (the run's state under its budget, `RunDir.state`); returns what
    was done. A run that another process is writing is refused, also for reuse."""
    run = RunDir(system.run_dir)
    state = run.state(system.cfg.train)
    if state.kind == "finished":
        with run.writer():  # refused while another process writes it; nothing to write
            state = run.state(system.cfg.train)
        if state.kind == "finished":
            say(f"{system.name}: reusing finished run {system.run_dir} ({state.reason})")
            return "reused"
    resume = state.kind == "resumable"
    if resume:
        say(
            f"{system.name}: resuming unfinished run {system.run_dir} from step {state.progress.step}"
        )
    else:
        say(f"{system.name}: training into {system.run_dir}")
    reporter = reporter_factory()
    try:
        result = train(system.cfg, system.run_dir, resume=resume, reporter=reporter)
    finally:
        stop = getattr(reporter, "stop", None)
        if stop:
            stop()
    if not result.progress.finished:
        raise NMTError(
            f"{system.name} did not finish ({result.stop_reason}); run the same nmt compare "
            "command again to resume it"
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


def evaluate_system(system: System, out: Path, splits: list[str], device) -> dict[str, Any]:
    loaded = load_model(system.run_dir, device)
    cfg = system.cfg
    precision = resolve_precision(cfg.decode.precision, device)
    run = RunDir(system.run_dir)
    payload = checkpoint.load(run.checkpoint("last"))
    progress = payload["progress"]
    history = progress["history"]
    prepared = prepare(cfg)
    train_records = [r for r in run.metrics() if r["kind"] == "train"]
    result: dict[str, Any] = {
        "name": system.name,
        "arch": arch_of(cfg.model),
        "recipe": str(system.recipe),
        "run_dir": str(system.run_dir),
        "params": count_parameters(loaded.model),
        "train_minutes": progress["seconds"] / 60,
        "steps": progress["step"],
        "train_tokens_per_s": progress["tokens"] / max(progress["train_seconds"], 1e-9),
        "best_valid_bleu": max((r["bleu"] for r in history if "bleu" in r), default=None),
        "finished": progress["finished"],
        # The checkpoint evaluated: best.pt, the step it was saved at, and the steps whose
        # weights it averages when train.average_last picked an average.
        "checkpoint": {
            "path": str(loaded.checkpoint),
            "step": loaded.payload["progress"]["step"],
            "averaged": loaded.payload.get("averaged"),
        },
        "valid_history": [
            {k: r.get(k) for k in ("step", "minutes", "bleu", "chrf", "loss", "averaged")}
            for r in history
        ],
        "train_history": [{k: r[k] for k in ("step", "minutes", "loss")} for r in train_records],
        "translations": {},
        "test": {},
    }
    decode_seconds = decode_sentences = 0.0
    for split in splits:
        data = prepared.split(split)
        t0 = time.perf_counter()
        hyps = translate_texts(
            loaded.model, loaded.tokenizer, data.texts("src"), cfg.decode, device, precision
        )
        decode_seconds += time.perf_counter() - t0
        decode_sentences += len(hyps)
        write_lines(out / "translations" / f"{system.name}.{split}.{cfg.data.tgt}", hyps)
        result["translations"][split] = hyps
    result["decode_sentences_per_s"] = decode_sentences / max(decode_seconds, 1e-9)
    return result


def attention_example(system: System, sentence: str, device) -> Attention | None:
    """Attention of the system's own translation of `sentence` (its decode settings)."""
    loaded = load_model(system.run_dir, device)
    opts = search_options(system.cfg.decode, nbest=1)
    precision = resolve_precision(system.cfg.decode.precision, device)
    (_, hyp), *_ = translate_lines(
        loaded.model, loaded.tokenizer, [sentence], opts, 10_000, device, precision
    )[0]
    return attention_of(loaded.model, loaded.tokenizer, sentence, hyp.tokens, device, precision)


def compare(
    recipes: list[Path],
    out: Path,
    sets: list[str] | None = None,
    budget: float | None = None,
    reporter_factory: Callable[[], Reporter | None] = lambda: None,
    say: Callable[[str], None] = log.info,
    bootstrap_samples: int = 1000,
) -> dict[str, Any]:
    """Train/reuse every recipe, evaluate all identically, write report.{md,json} and plots."""
    if not recipes:
        raise NMTError("give at least one recipe to compare")
    check_bootstrap_samples(bootstrap_samples)
    if out.exists() and not out.is_dir():
        raise NMTError(f"--out {out} is a file; give a directory for the report")
    systems = plan(recipes, out, sets or [], budget)
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
    for system in systems:
        preflight(system.cfg)
    bleu_metric(systems[0].cfg.data.tgt)  # the test sets are scored with BLEU in any case
    out.mkdir(parents=True, exist_ok=True)  # only once the setup is known to be sound
    for i, system in enumerate(systems, 1):
        say(f"[{i}/{len(systems)}] {system.name} ({arch_of(system.cfg.model)})")
        ensure_trained(system, reporter_factory, say)

    device = resolve_device(systems[0].cfg.train.device)
    prepared = prepare(systems[0].cfg)
    splits = [s for s in prepared.summary["splits"] if s not in ("train", "valid")]
    tgt_lang = systems[0].cfg.data.tgt
    results = []
    for i, system in enumerate(systems, 1):
        say(f"[{i}/{len(systems)}] evaluating {system.name} on {', '.join(splits)}")
        results.append(evaluate_system(system, out, splits, device))

    # Scores with bootstrap CIs; p-values against the best system of each split.
    for split in splits:
        data = prepared.split(split)
        refs, srcs = data.texts("tgt"), data.texts("src")
        for r in results:
            hyps = r["translations"][split]
            scores = score(hyps, [refs], tgt_lang)
            r["test"][split] = {k: scores[k] for k in ("bleu", "chrf", "ter")}
            r["test"][split]["bleu_by_length"] = _bucket_bleu(hyps, refs, srcs, tgt_lang)
        best = max(results, key=lambda r: r["test"][split]["bleu"]["score"])
        others = {r["name"]: r["translations"][split] for r in results if r is not best}
        base, vs_best = paired_bootstrap(
            best["translations"][split], others, [refs], bootstrap_samples, tgt_lang
        )
        for r in results:
            stats = base if r is best else vs_best[r["name"]]
            for metric in ("bleu", "chrf"):
                entry = r["test"][split][metric]
                entry.update({k: stats[metric][k] for k in ("ci_low", "ci_high")})
                entry["p_value_vs_best"] = stats[metric]["p_value"]
            r["test"][split]["best"] = r is best

    example = _pick_example(prepared.split(splits[0]).texts("src"))
    report = {
        "systems": [{k: v for k, v in r.items() if k != "translations"} for r in results],
        "splits": splits,
        "budget_minutes": budget,
        "decode": systems[0].cfg.decode.__dict__,
        "length_buckets": [f"{lo}-{hi}" if hi < 10_000 else f"{lo}+" for lo, hi in LENGTH_BUCKETS],
        "example_sentence": example,
    }
    _write_plots(report, systems, out, device, example)
    write_atomic(out / "report.json", json.dumps(report, indent=2))
    write_atomic(out / "report.md", _markdown(report, results, prepared, splits))
    return report


def _pick_example(sources: list[str]) -> str:
    """A test sentence of typical length (12-16 words) for the attention figures."""
    for s in sources:
        if 12 <= len(s.split()) <= 16:
            return s
    return sources[0]


def _write_plots(report: dict, systems: list[System], out: Path, device, example: str) -> None:
    from nmt import plots

    rows = report["systems"]
    # Learning curves follow the training weights; a final average is not a point on them.
    curve = {
        r["name"]: [
            h for h in r["valid_history"] if h.get("bleu") is not None and not h.get("averaged")
        ]
        for r in rows
    }
    valid_minutes = {name: [(h["minutes"], h["bleu"]) for h in hs] for name, hs in curve.items()}
    valid_steps = {name: [(h["step"], h["bleu"]) for h in hs] for name, hs in curve.items()}
    plots.curves(
        valid_minutes,
        "training wall-clock minutes",
        "validation BLEU",
        out / "valid_bleu_vs_time.png",
        "Validation BLEU vs time",
    )
    plots.curves(
        valid_steps,
        "training steps",
        "validation BLEU",
        out / "valid_bleu_vs_steps.png",
        "Validation BLEU vs steps",
    )
    loss = {r["name"]: [(h["step"], h["loss"]) for h in r["train_history"]] for r in rows}
    plots.curves(
        loss,
        "training steps",
        "training loss (label-smoothed, per token)",
        out / "train_loss.png",
        "Training loss",
    )
    split = report["splits"][0]
    plots.grouped_bars(
        report["length_buckets"],
        {
            r["name"]: [v if v is not None else 0.0 for v in r["test"][split]["bleu_by_length"]]
            for r in rows
        },
        "source length (words)",
        f"BLEU on {split}",
        out / "bleu_by_length.png",
        "BLEU by source length",
    )
    report["plots"] = [
        "valid_bleu_vs_time.png",
        "valid_bleu_vs_steps.png",
        "train_loss.png",
        "bleu_by_length.png",
    ]
    for system in systems:
        att = attention_example(system, example, device)
        if att is None:
            continue
        name = f"attention_{system.name}.png"
        plots.attention_heatmap(
            att.weights,
            att.src_pieces,
            att.tgt_pieces,
            out / name,
            title=f"{system.name}: {example}",
        )
        report["plots"].append(name)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _markdown(report: dict, results: list[dict], prepared, splits: list[str]) -> str:
    lines = ["# nmt compare", ""]
    if report["budget_minutes"]:
        lines += [f"Training budget: {report['budget_minutes']} minutes per system.", ""]
    d = report["decode"]
    lines += [
        f"Decoding: beam {d['beam']}, length penalty {d['length_penalty']}, max length {d['max_len_a']}·|x|+{d['max_len_b']}.",
        "",
        "Checkpoints evaluated (best validation score):",
        "",
    ]
    for r in report["systems"]:
        c = r["checkpoint"]
        what = (
            "average of the weights at steps " + ", ".join(f"{s:,}" for s in c["averaged"])
            if c["averaged"]
            else f"step {c['step']:,}"
        )
        lines.append(f"- {r['name']}: {what}")
    lines.append("")
    for split in splits:
        lines += [f"## {split}", ""]
        lines += [
            "| system | arch | params | train min | steps | tgt tok/s | best valid BLEU | BLEU [95% CI] | p vs best | chrF [95% CI] | decode sent/s |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|",
        ]
        for r in report["systems"]:
            t = r["test"][split]
            b, c = t["bleu"], t["chrf"]
            p = "best" if t["best"] else _fmt(b["p_value_vs_best"], 4)
            lines.append(
                f"| {r['name']} | {r['arch']} | {r['params']:,} | {r['train_minutes']:.1f} | {r['steps']:,} | "
                f"{r['train_tokens_per_s']:,.0f} | {_fmt(r['best_valid_bleu'])} | {b['score']:.1f} [{b['ci_low']:.1f}, {b['ci_high']:.1f}] | {p} | "
                f"{c['score']:.1f} [{c['ci_low']:.1f}, {c['ci_high']:.1f}] | {r['decode_sentences_per_s']:.1f} |"
            )
        lines += [
            "",
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
            lines.append(f"**{r['name']}**: {r['translations'][split][i]}  ")
        lines.append("")
    lines += ["## Figures", ""] + [f"![{p}]({p})" for p in report.get("plots", [])] + [""]
    return "\n".join(lines)
