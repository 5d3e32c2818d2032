"""Faithfulness of a run's exports: the translations of a prepared split by nmt's own decoder
(fp32), by the run's CTranslate2 export in each --quantization (through `nmt.engine`, what
`--engine ctranslate2` runs) and by its Hugging Face Marian export (`MarianMTModel.generate`,
when Marian can express the run), with the share of lines identical to nmt's, corpus BLEU and
chrF, and sentences/s.

Every system decodes the same sentences with the same search: --beam (default 5), length
normalisation plain (|y| ** alpha, alpha = the run's decode.length_penalty; the one
CTranslate2 and transformers implement) and nmt's length limit a * |x| + b of each sentence
(transformers: max_new_tokens = limit - 1, one generate() call per distinct limit, batches of
--batch-size sentences). nmt decodes in fp32 with its default workers; CTranslate2 as
`--engine ctranslate2` does (its default: 2 workers of 1 thread on 2 threads); transformers in
this process.

Commands:
  NMT_DATA_DIR=../shared/data python scripts/bench_export.py --run runs/multi30k_transformer
  ... --run runs/multi30k_transformer_marian --quantizations float32 int8 int8_float32
  ... --run RUN --beam 1 --limit 200        # greedy, a quick look
  ... --run RUN --patience 1               # every system on CTranslate2's stopping rule

--patience P (decode.patience) ends a sentence's beam once round(beam * P) hypotheses have
finished, in nmt and CTranslate2 alike (transformers: early_stopping=True, for P = 1 only).
Without it nmt ends a sentence when no open hypothesis can beat its best finished ones,
CTranslate2 after beam finished hypotheses (patience 1), transformers as nmt
(early_stopping="never").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="trained transformer run directory")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--quantizations", nargs="+", default=None, help="default: all the CPU runs")
    p.add_argument("--patience", type=float, default=None, help="decode.patience (default: none)")
    p.add_argument("--hf", choices=("auto", "off"), default="auto")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--batch-size", type=int, default=64, help="transformers' batch (sentences)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def hf_translate(directory: Path, lines: list[str], opts, batch_size: int) -> list[str]:
    """MarianMTModel.generate with nmt's search settings, sentences grouped by length limit."""
    from transformers import MarianMTModel, MarianTokenizer

    from nmt.search import length_limits

    tokenizer = MarianTokenizer.from_pretrained(directory)
    model = MarianMTModel.from_pretrained(directory).eval()
    ids = tokenizer(lines).input_ids  # pieces + EOS: |x| as nmt counts it
    limits = length_limits(torch.tensor([len(x) for x in ids]), opts).tolist()
    groups: dict[int, list[int]] = defaultdict(list)
    for i, limit in enumerate(limits):
        groups[limit].append(i)
    out = [""] * len(lines)
    for limit, idx in groups.items():
        for start in range(0, len(idx), batch_size):
            part = idx[start : start + batch_size]
            batch = tokenizer([lines[i] for i in part], return_tensors="pt", padding=True)
            with torch.inference_mode():
                generated = model.generate(
                    **batch,
                    num_beams=opts.beam,
                    do_sample=False,
                    length_penalty=opts.length_penalty,
                    early_stopping="never" if opts.patience is None else True,
                    max_new_tokens=max(1, limit - 1),
                )
            for i, text in zip(part, tokenizer.batch_decode(generated, skip_special_tokens=True)):
                out[i] = text
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.setup_torch(args.threads)
    bu.default_env()
    bu.warn_if_busy()
    import ctranslate2

    from nmt import export
    from nmt.data.prepare import prepare
    from nmt.engine import open_engine
    from nmt.metrics import score
    from nmt.translate import search_options

    cpu = torch.device("cpu")
    run = Path(args.run)
    ours = open_engine([run], "nmt", cpu, precision="fp32")
    cfg = ours.config
    split = prepare(cfg).split(args.split)
    n = min(args.limit or len(split), len(split))
    lines, refs = split.texts("src")[:n], split.texts("tgt")[:n]
    d = dataclasses.replace(
        cfg.decode, beam=args.beam, nbest=1, length_norm="plain", patience=args.patience
    )
    opts = search_options(d, nbest=1)
    rows, reference = [], None

    def add(system: str, hyps: list[str], seconds: float) -> None:
        nonlocal reference
        reference = hyps if reference is None else reference
        metrics = score(hyps, [refs], cfg.data.tgt)
        same = sum(a == b for a, b in zip(hyps, reference))
        row = {
            "system": system,
            "identical_to_nmt": same / len(hyps),
            "bleu": metrics["bleu"]["score"],
            "chrf": metrics["chrf"]["score"],
            "sentences_per_s": len(hyps) / seconds,
        }
        print(f"  {system}: {row['identical_to_nmt']:.1%} identical, BLEU {row['bleu']:.2f}")
        rows.append(row)

    def timed(fn):
        t0 = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - t0

    ours.translate(lines[:8], opts, d.batch_tokens)  # untimed, as each CTranslate2 row's
    hyps, seconds = timed(lambda: ours.translate(lines, opts, d.batch_tokens, workers=d.workers))
    add("nmt fp32", [nb[0][0] if nb else "" for nb in hyps], seconds)
    supported = ctranslate2.get_supported_compute_types("cpu")
    for q in args.quantizations or [q for q in export.QUANTIZATIONS if q in supported]:
        engine = open_engine([run], "ctranslate2", cpu, quantization=q)
        engine.translate(lines[:8], opts, d.batch_tokens)  # loads the model (untimed)
        hyps, seconds = timed(lambda e=engine: e.translate(lines, opts, d.batch_tokens))
        add(f"ctranslate2 {q}", [nb[0][0] if nb else "" for nb in hyps], seconds)
    if args.hf != "off" and args.patience not in (None, 1):
        print("note: no Hugging Face row: transformers stops at beam finished hypotheses only")
    elif args.hf != "off" and export.marian_problem(cfg.model) is None:
        with tempfile.TemporaryDirectory(prefix="bench_export_") as tmp:
            export.export_hf(run, Path(tmp) / "hf")
            hyps, seconds = timed(
                lambda: hf_translate(Path(tmp) / "hf", lines, opts, args.batch_size)
            )
            add("transformers MarianMTModel fp32", hyps, seconds)
    elif args.hf != "off":
        print(f"note: no Hugging Face export: {export.marian_problem(cfg.model)}")
    bu.print_table(
        rows,
        [
            ("system", "system"),
            ("identical_to_nmt", "identical"),
            ("bleu", "BLEU"),
            ("chrf", "chrF"),
            ("sentences_per_s", "sent/s"),
        ],
        title=f"{run.name}: {n} {args.split} sentences, beam {args.beam}, length_norm plain, "
        f"alpha {d.length_penalty}, patience {d.patience}",
    )
    result = {"benchmark": "bench_export", "args": vars(args), "rows": rows}
    bu.write_json(args.json, result)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
