"""Training-step throughput of each architecture: target tokens/s of forward + backward +
optimizer step, fp32 and bf16 autocast on CPU, on real Multi30k training batches.

What is measured
  * One training step exactly as `nmt.train.train` runs it: `nmt.train.train_step` (forward
    under autocast, label-smoothed loss, backward), gradient clipping, Adam step, zero_grad.
  * Models at the sizes of recipes/multi30k/{seq2seq,rnn_attention,transformer}.yaml, freshly
    initialised with the same seed for every precision.
  * Batches: the first --batches token-budget batches (the recipe's train.batch_tokens and
    train.batch_multiple, or --set's) of epoch 0 of the prepared train split, in training
    order, collated once before timing; the same list for every architecture, precision and
    system. tokens/s counts real target tokens (EOS included, padding excluded), as the
    trainer's tokens_per_s does.
  * --warmup steps are run first and not timed; then --repeats passes over the whole list are
    timed with time.perf_counter; the table shows the median pass (min and max in the JSON).
  * Machine peak: square --peak-size matmuls (torch.mm) in fp32 and bf16, median of
    --peak-repeats, FLOP/s = 2 n^3 / seconds.
  * The transformer's achieved FLOP/s uses an analytic count: 3 x the forward matmul FLOPs of
    each padded batch (every projection, the vocabulary projection and both attention products
    counted in full), see `_benchutil.transformer_train_flops`, shown as a percentage of the bf16
    peak (and of the fp32 peak). Cross-check printed on batch 0: the projection part equals
    torch.utils.flop_counter.FlopCounterMode's count of one step; FlopCounterMode alone would miss
    the attention products (it has no formula for the CPU flash-attention kernel).
  * --profile STEPS: after a row is timed, STEPS more steps under torch.profiler, each
    operator's own time summed by kind (matrix products, casts, softmax and loss, layer norm,
    dropout's random numbers, optimizer, elementwise, other) and the longest operators, per
    step and as a share of all operators' time (`_benchutil.profile_ops`); for nmt's
    transformer also the rate of its matrix products alone (the analytic FLOPs over their
    time), what the step would reach if nothing else took time. Profiling slows small
    operators more than large ones: the shares guide, the timed rows measure.
  * --memory: after each row's timed passes, this process' resident memory and its peak so
    far (/proc/self/status), and what its allocator holds (`nmt.allocator.heap_bytes`): bytes
    in use between steps (weights, optimizer state, batches, oneDNN's kernels for every batch
    shape met) and freed bytes kept for reuse (what a step's activations need at their
    peak). Rows run one after the other in this process, so a row's figures include what the
    rows before it left; oneDNN's kernel cache size (ONEDNN_PRIMITIVE_CACHE_CAPACITY, which
    `nmt.cpu` sets to 8,192 unless given) is printed beside them.
  * When `transformers` is importable: a Hugging Face MarianMTModel of the same size (d_model
    256, 3+3 layers, 4 heads, FFN 1024, ReLU, joint 8k vocabulary, tied embeddings, max 256
    positions, the recipe's dropout (0.3), SDPA attention), trained on the SAME batches with the HF convention
    (decoder_input_ids = tgt_in, labels = tgt_out with pad -> -100, attention_mask = src_mask),
    same optimizer, clipping and autocast; the ratio ours/HF is printed per precision.

Commands (set torch to 2 threads; needs the prepared Multi30k data):
  NMT_DATA_DIR=../shared/data \\
      python scripts/bench_model.py --json runs/bench_model.json
  # where the transformer's bf16 step goes (8 profiled steps after the timed ones):
  ... scripts/bench_model.py --archs transformer --precisions bf16 --hf off --profile 8
  # what the memory of a training process holds: an epoch's batches (351; 400 takes them all),
  # nmt alone, once (and the same with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0: no kernel kept)
  ... scripts/bench_model.py --archs transformer --precisions bf16 --hf off --batches 400 \\
      --warmup 0 --repeats 1 --memory
  # the same epoch packed to the budget alone (train.batch_multiple=1, as before the key), its
  # kernels made in an untimed first pass, then timed:
  ... scripts/bench_model.py --archs transformer --precisions bf16 --hf off --batches 400 \\
      --warmup 400 --repeats 1 --memory --set train.batch_multiple=1
  # smoke test (a few seconds; small batches, numbers not meaningful):
  ... scripts/bench_model.py --quick
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=list(bu.ARCHS), choices=bu.ARCHS)
    p.add_argument("--precisions", nargs="+", default=None, choices=bu.PRECISIONS)
    p.add_argument("--batches", type=int, default=16, help="training batches in the fixed list")
    p.add_argument("--batch-tokens", type=int, default=None, help="override train.batch_tokens")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, as `nmt train --set` (e.g. train.batch_multiple=1)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the batch list")
    p.add_argument("--peak-size", type=int, default=2048)
    p.add_argument("--peak-repeats", type=int, default=10)
    p.add_argument(
        "--hf", choices=("auto", "on", "off"), default="auto", help="HF Marian side by side"
    )
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after timing, profile STEPS more steps of each row: operator time by kind",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="after each row: resident memory, its peak, and what the allocator holds in use "
        "and kept free",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny batches, one pass")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.precisions = args.precisions or bu.default_precisions()
    if args.quick:
        args.batches, args.warmup, args.repeats = 2, 1, 1
        args.batch_tokens = args.batch_tokens or 800
        args.peak_size, args.peak_repeats = 1024, 3
    if args.hf == "on" and not bu.hf_available():
        p.error("--hf on: transformers is not importable in this Python")
    return args


def fixed_batches(cfg, n: int):
    """The first `n` batches of epoch 0 of the prepared train split, collated, packed as
    training packs them (`TokenBatches.of`: the config's budget, seed and multiple)."""
    from nmt.data.batching import TokenBatches
    from nmt.data.prepare import prepare

    prepared = prepare(cfg)
    split = prepared.split("train")
    order = TokenBatches.of(split, cfg.train).all_batches(0)
    return prepared, [split.collate(idx) for idx in order[:n]]


def time_passes(step, items, warmup: int, repeats: int) -> list[float]:
    for i in range(warmup):
        step(items[i % len(items)])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for item in items:
            step(item)
        times.append(time.perf_counter() - t0)
    return times


def measure(label: str, step, items, tokens: int, args) -> dict:
    times = time_passes(step, items, args.warmup, args.repeats)
    med = bu.median(times)
    row = {
        "tokens_per_s": tokens / med,
        "tokens_per_s_min": tokens / max(times),
        "tokens_per_s_max": tokens / min(times),
        "ms_per_step": 1000 * med / len(items),
        "pass_seconds": times,
    }
    print(f"  {label}: {row['tokens_per_s']:,.0f} tgt tok/s ({row['ms_per_step']:.0f} ms/step)")
    return row


def products_rate(prof: dict, parts: list[dict], peak: float, precision: str, label: str) -> None:
    """The rate of the matrix products in a profile of nmt's transformer: the analytic FLOPs
    of the profiled steps (the batches in turn from the first, as `profile_ops` runs them)
    over the time of the "matrix products" and "attention kernels (SDPA)" groups, where they
    run (in bf16 the attention products are bmm's: SDPA's math kernel), as a share of the
    matmul `peak` of the step's precision. What the whole step could reach if nothing but its
    products took time."""
    flops = sum(parts[i % len(parts)]["total"] for i in range(prof["count"])) / prof["count"]
    kinds = ("matrix products", "attention kernels (SDPA)")
    seconds = sum(g["ms"] for g in prof["groups"] if g["name"] in kinds) / 1e3
    share = sum(g["pct"] for g in prof["groups"] if g["name"] in kinds)
    prof["products_gflops_per_s"] = flops / seconds / 1e9
    prof["products_pct_peak"] = 100 * flops / seconds / peak
    print(
        f"{label}: the matrix products ran at {prof['products_gflops_per_s']:,.1f} GFLOP/s "
        f"= {prof['products_pct_peak']:.1f}% of the {precision} peak, in {share:.1f}% of the "
        "operators' time"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.setup_torch(args.threads)
    bu.default_env()
    bu.warn_if_busy()
    from nmt.models.base import count_parameters
    from nmt.models.registry import build_model

    use_hf = args.hf == "on" or (args.hf == "auto" and bu.hf_available())
    from nmt.cpu import cpu_has_bf16

    # Emulated bf16 (no AVX512-BF16/AMX) runs ~1 GFLOP/s: a 2048^2 product would take ~20 s,
    # so without native units the bf16 peak is taken on at most 1024^2, 3 times.
    native = cpu_has_bf16()
    peak = {
        "fp32": bu.matmul_peak(args.peak_size, torch.float32, args.peak_repeats),
        "bf16": bu.matmul_peak(
            args.peak_size if native else min(args.peak_size, 1024),
            torch.bfloat16,
            args.peak_repeats if native else min(args.peak_repeats, 3),
        ),
    }
    print(
        f"matmul peak: fp32 {peak['fp32']['flops_per_s'] / 1e9:,.0f} GFLOP/s "
        f"({peak['fp32']['size']}^2), bf16 {peak['bf16']['flops_per_s'] / 1e9:,.1f} GFLOP/s "
        f"({peak['bf16']['size']}^2)"
    )

    batch_cache: dict = {}
    flops_check: dict = {}
    rows: list[dict] = []
    for arch in args.archs:
        budget_set = [f"train.batch_tokens={args.batch_tokens}"] if args.batch_tokens else []
        cfg = bu.load_recipe(arch, [*budget_set, *args.sets])
        budget = cfg.train.batch_tokens
        key = (budget, cfg.train.seed, cfg.train.batch_multiple)
        if key not in batch_cache:
            batch_cache[key] = fixed_batches(cfg, args.batches)
        prepared, batches = batch_cache[key]
        vocab = bu.vocab_of(prepared)
        tokens = sum(b.tgt_tokens for b in batches)
        flops = None
        if arch == "transformer":
            parts = [
                bu.transformer_train_flops(
                    cfg.model, vocab.tgt_size, b.src.size(0), b.src.size(1), b.tgt_in.size(1)
                )
                for b in batches
            ]
            flops = sum(p["total"] for p in parts)
            torch.manual_seed(args.seed)
            flops_check = {
                "analytic_total_batch0": parts[0]["total"],
                "analytic_attention_batch0": parts[0]["attention"],
                "analytic_projections_batch0": parts[0]["projections"],
                "flop_counter_mode_batch0": bu.flop_counter_check(
                    build_model(arch, cfg.model, vocab).train(), batches[0]
                ),
            }
            print(
                "  FLOP check on batch 0: analytic projections "
                f"{flops_check['analytic_projections_batch0'] / 1e9:.2f} GFLOP vs FlopCounterMode "
                f"{flops_check['flop_counter_mode_batch0'] / 1e9:.2f} GFLOP (+ attention "
                f"{flops_check['analytic_attention_batch0'] / 1e9:.2f} GFLOP analytic only)"
            )
        systems = [("nmt", arch)]
        if arch == "transformer" and use_hf:
            systems.append(("hf-marian", arch))
        for system, _ in systems:
            for precision in args.precisions:
                torch.manual_seed(args.seed)
                if system == "nmt":
                    model = build_model(arch, cfg.model, vocab)
                    step = bu.nmt_train_step
                    items = batches
                else:
                    model = bu.build_marian(cfg.model, vocab.tgt_size, args.seed)
                    step = bu.hf_train_step
                    items = [bu.hf_inputs(b) for b in batches]
                model.train()
                optimizer = bu.make_optimizer(model, cfg.train)
                fn = step(model, optimizer, cfg.train, precision)
                row = {
                    "arch": arch,
                    "system": system,
                    "precision": precision,
                    "params": sum(p.numel() for p in model.parameters() if p.requires_grad)
                    if system != "nmt"
                    else count_parameters(model),
                    "batches": len(batches),
                    "batch_tokens": budget,
                    "batch_multiple": cfg.train.batch_multiple,
                    "tgt_tokens": tokens,
                }
                label = f"{system} {arch} {precision}"
                row.update(measure(label, fn, items, tokens, args))
                if args.memory:
                    row.update(bu.memory_now())
                    print(
                        f"  {label}: RSS {row['rss_mb']:,.0f} MB (peak {row['peak_rss_mb']:,.0f}), "
                        f"allocator in use {row.get('heap_in_use_mb', float('nan')):,.0f} MB, "
                        f"kept free {row.get('heap_free_mb', float('nan')):,.0f} MB "
                        f"(oneDNN kernel cache {row['onednn_cache_capacity']:,} entries)"
                    )
                if args.profile:
                    prof = row["profile"] = bu.profile_ops(fn, items, args.profile)
                    bu.print_profile(label, prof)
                    if flops is not None and system == "nmt":  # its products are all mm/bmm
                        products_rate(prof, parts, peak[precision]["flops_per_s"], precision, label)
                if flops is not None:
                    achieved = flops / bu.median(row["pass_seconds"])
                    row["train_flops"] = flops
                    row["gflops_per_s"] = achieved / 1e9
                    row["pct_bf16_peak"] = 100 * achieved / peak["bf16"]["flops_per_s"]
                    row["pct_fp32_peak"] = 100 * achieved / peak["fp32"]["flops_per_s"]
                rows.append(row)
                del model, optimizer, fn, items
                gc.collect()

    ratios = []
    for row in rows:
        if row["system"] != "hf-marian":
            continue
        ours = next(
            (
                r
                for r in rows
                if r["system"] == "nmt"
                and r["arch"] == row["arch"]
                and r["precision"] == row["precision"]
            ),
            None,
        )
        if ours:
            ratios.append(
                {
                    "arch": row["arch"],
                    "precision": row["precision"],
                    "ours_tokens_per_s": ours["tokens_per_s"],
                    "hf_tokens_per_s": row["tokens_per_s"],
                    "ours_over_hf": ours["tokens_per_s"] / row["tokens_per_s"],
                }
            )

    bu.print_table(
        rows,
        [
            ("arch", "arch"),
            ("system", "system"),
            ("precision", "prec"),
            ("params", "params"),
            ("tokens_per_s", "tgt tok/s"),
            ("tokens_per_s_min", "min"),
            ("tokens_per_s_max", "max"),
            ("ms_per_step", "ms/step"),
            ("gflops_per_s", "GFLOP/s"),
            ("pct_bf16_peak", "% bf16 peak"),
            ("pct_fp32_peak", "% fp32 peak"),
            *(
                [("rss_mb", "RSS MB"), ("heap_in_use_mb", "in use MB"), ("heap_free_mb", "free MB")]
                if args.memory
                else []
            ),
        ],
        title=f"training step (fwd+bwd+clip+Adam), {len(batches)} batches x {args.repeats} passes, "
        f"{tokens:,} target tokens per pass",
    )
    bu.print_table(
        [{"name": k, "gflops": v["flops_per_s"] / 1e9, "size": v["size"]} for k, v in peak.items()],
        [("name", "matmul"), ("size", "n"), ("gflops", "GFLOP/s")],
        title="machine matmul peak (median)",
    )
    if ratios:
        bu.print_table(
            ratios,
            [
                ("arch", "arch"),
                ("precision", "prec"),
                ("ours_tokens_per_s", "nmt tok/s"),
                ("hf_tokens_per_s", "HF tok/s"),
                ("ours_over_hf", "nmt/HF"),
            ],
            title="nmt vs Hugging Face MarianMTModel (same size, same batches)",
        )
    result = {
        "benchmark": "bench_model",
        "args": vars(args),
        "machine": bu.machine_info(),
        "flop_count": "analytic: 3 x forward matmul FLOPs over padded shapes (_benchutil.transformer_train_flops)",
        "flop_check": flops_check,
        "peak": peak,
        "rows": rows,
        "ratios": ratios,
    }
    bu.write_json(args.json, result)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
