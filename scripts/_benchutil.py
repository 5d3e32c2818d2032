"""Helpers shared by the benchmark scripts in this folder (not a benchmark itself).

Timing, tables, JSON output, machine facts, the multi30k recipes, the training step the
trainer runs (`nmt.train`), and a Hugging Face `MarianMTModel` of the transformer recipe's size
for side-by-side numbers. Every script puts this folder on `sys.path` and imports it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    name: ROOT / "recipes" / "multi30k" / f"{name}.yaml"
    for name in ("seq2seq", "rnn_attention", "transformer")
}
ARCHS = tuple(RECIPES)
PRECISIONS = ("fp32", "bf16")
DECODE_PRECISIONS = (*PRECISIONS, "int8")  # int8: nmt's int8 linear maps (decoding only)


def default_precisions(decoding: bool = False) -> list[str]:
    """fp32, plus bf16 where the CPU runs it natively (AVX512-BF16/AMX). Without those units
    bf16 matmuls are emulated (measured 1.7 vs 79 GFLOP/s fp32 on an AVX2-only EPYC), so the
    default skips them; pass --precisions bf16 to time them anyway. When `decoding`, int8 too
    where torch runs int8 linear maps (fbgemm)."""
    from nmt.cpu import cpu_has_bf16, cpu_has_int8

    chosen = ["fp32"]
    if cpu_has_bf16():
        chosen.append("bf16")
    else:
        print("note: this CPU has no native bf16 (AVX512-BF16/AMX); timing fp32 only")
    if decoding and cpu_has_int8():
        chosen.append("int8")
    return chosen


# -- environment ----------------------------------------------------------------------------


def setup_torch(threads: int = 2) -> None:
    """The settings every benchmark runs under: a fixed thread count and the process settings
    `nmt train`/`nmt translate` apply (`nmt.device.configure_host`: no denormals, malloc keeps
    freed memory). Side-by-side peers run in the same process get them too (bench_decode also
    runs its peers in a child process without them: see its --peer-host)."""
    from nmt.device import configure_host

    torch.set_num_threads(threads)
    configure_host()


def default_env() -> None:
    """Multi30k from the shared copy unless NMT_DATA_DIR is set; prepared data where the CLI
    keeps it ($NMT_CACHE_DIR, default ~/.cache/nmt), so a benchmark reuses what `nmt train`
    prepared."""
    os.environ.setdefault("NMT_DATA_DIR", str(ROOT.parent / "shared" / "data"))


def on_nmts_allocator() -> None:
    """Run this script on the allocator the `nmt` commands run on (`nmt.allocator`: TCMalloc
    where it is installed), so that its figures are the commands' figures: the script is
    executed again once, with the library preloaded. NMT_MALLOC=system keeps glibc's."""
    from nmt import allocator

    allocator.relaunch(command=True)


def machine_info() -> dict[str, Any]:
    from nmt import allocator
    from nmt.cpu import cpu_has_bf16

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_native_bf16": cpu_has_bf16(),
        "load_average_1m": os.getloadavg()[0],
        "malloc": allocator.in_use(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for name in ("transformers", "ctranslate2"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def status_kb(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (its peak so far) of a process, in kB (empty once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int | str = "self") -> float | None:
    """User and system CPU time a process has used so far, in seconds (None once it is gone,
    or where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The processes `pid` has started and that still run (/proc; [] without it)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(out)


def memory_now() -> dict[str, float]:
    """This process' resident memory and its peak, and what its allocator holds in use and
    kept free (`nmt.allocator.heap_bytes`), in MB; oneDNN's kernel cache size beside them."""
    from nmt import allocator
    from nmt.cpu import PRIMITIVE_CACHE

    kb = status_kb()
    heap = allocator.heap_bytes() or {}
    out: dict[str, float] = {
        "rss_mb": kb.get("VmRSS", 0) / 1024,
        "peak_rss_mb": kb.get("VmHWM", 0) / 1024,
        "onednn_cache_capacity": int(os.environ.get(PRIMITIVE_CACHE, 0)),
    }
    out.update({f"heap_{k}_mb": v / 2**20 for k, v in heap.items()})
    return out


def warn_if_busy() -> None:
    """The numbers are only as good as the idle cores: say so when others are using them."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(
            f"note: 1-minute load average is {load:.1f} before starting; other processes share "
            "the cores and will lower (and scatter) the numbers"
        )


# -- timing ---------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def time_repeats(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `repeats` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def matmul_peak(size: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """FLOP/s of a square `size` x `size` matmul in `dtype` (median of `repeats` calls)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    times = time_repeats(lambda: torch.mm(a, b, out=out), repeats, warmup=2)
    flops = 2.0 * size**3
    return {"size": size, "seconds_median": median(times), "flops_per_s": flops / median(times)}


# -- where a step's time goes --------------------------------------------------------------

# The operators that do the work, by kind (names without their namespace), for `profile_ops`.
# Anything else is "other", among them the wrappers that call these (matmul and linear call
# mm or addmm, to and clone call copy_): their own time is dispatch and allocation, and
# leaving them out keeps a group's calls a count of its kernels' calls.
OP_GROUPS: dict[str, list[str]] = {
    "matrix products": "mm addmm bmm baddbmm _linear_pointwise linear_dynamic "
    "qlinear_pointwise _weight_int8pack_mm".split(),
    "attention kernels (SDPA)": "_scaled_dot_product_flash_attention_for_cpu "
    "_scaled_dot_product_flash_attention_for_cpu_backward _scaled_dot_product_attention_math "
    "_scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward "
    "_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward".split(),
    "casts and copies": ["copy_"],
    "softmax, log-softmax, loss": "_softmax _log_softmax _softmax_backward_data "
    "_log_softmax_backward_data nll_loss_forward nll_loss_backward logsumexp".split(),
    "layer norm": "native_layer_norm native_layer_norm_backward".split(),
    "random numbers (dropout)": "random_ bernoulli_ native_dropout uniform_".split(),
    "optimizer": "_fused_adam_ _foreach_add_ _foreach_mul_ _foreach_mul _foreach_norm "
    "_foreach_addcmul_ _foreach_addcdiv_ _foreach_sqrt _foreach_div_ _foreach_lerp_ "
    "linalg_vector_norm".split(),
    # amax: the search's block maxima before its top-k (nmt.search), not a softmax's
    "search: top-k, gather, reorder": "topk amax sort index_select index take gather scatter "
    "scatter_ cat index_put_ index_copy_ masked_select nonzero".split(),
    "elementwise": "add add_ mul mul_ sub div div_ where fill_ masked_fill masked_fill_ "
    "clamp_min threshold_backward relu gelu gelu_backward ge lt eq ne bitwise_not sum all "
    "any exp log neg zero_ embedding embedding_dense_backward addcmul_ lerp_ sqrt".split(),
}
_GROUP_OF = {op: group for group, ops in OP_GROUPS.items() for op in ops}


def op_group(name: str) -> str:
    """The OP_GROUPS group of an operator name such as "aten::mm" (else "other")."""
    return _GROUP_OF.get(name.rsplit("::", 1)[-1], "other")


def profile_ops(
    step: Callable[[Any], Any], items: Sequence[Any], steps: int, unit: str = "step"
) -> dict[str, Any]:
    """Where `steps` calls of `step` (over `items` in turn; a call is one `unit`: a training
    step, a batch) spend their time, by torch.profiler (CPU activity): each operator's self
    time (children excluded) summed by OP_GROUPS group, and the 12 longest operators, per
    call and as a share of all operators' self time. The wall time is profiled (the profiler
    adds a few us per operator); what no operator accounts for (Python, the profiler itself)
    is `outside_ops_ms`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(items[i % len(items)])
        wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    total_us = sum(e.self_cpu_time_total for e in ops)
    groups: dict[str, list[float]] = {}
    for e in ops:
        group = groups.setdefault(op_group(e.key), [0.0, 0.0])
        group[0] += e.self_cpu_time_total
        group[1] += e.count

    def entry(name: str, us: float, calls: float) -> dict[str, Any]:
        return {
            "name": name,
            "ms": us / 1e3 / steps,
            "pct": 100 * us / total_us,
            "calls": calls / steps,
        }

    ops_ms = total_us / 1e3 / steps
    return {
        "unit": unit,
        "count": steps,
        "wall_ms": wall_ms,
        "ops_ms": ops_ms,
        "outside_ops_ms": max(0.0, wall_ms - ops_ms),
        "groups": sorted(
            (entry(name, us, calls) for name, (us, calls) in groups.items()),
            key=lambda r: -r["ms"],
        ),
        "top_ops": [entry(e.key, e.self_cpu_time_total, e.count) for e in ops[:12]],
    }


def print_profile(label: str, prof: dict[str, Any]) -> None:
    """The two tables of a `profile_ops` result (times and calls per unit)."""
    unit = prof["unit"]
    columns = [
        ("name", "what"),
        ("ms", f"ms/{unit}"),
        ("pct", "% of ops"),
        ("calls", f"calls/{unit}"),
    ]
    print_table(
        prof["groups"],
        columns,
        title=f"{label}: operator self time per {unit} ({prof['count']} profiled): "
        f"{prof['wall_ms']:,.1f} ms wall, {prof['ops_ms']:,.1f} ms in operators, "
        f"{prof['outside_ops_ms']:,.1f} ms outside them",
    )
    print_table(prof["top_ops"], columns, title=f"{label}: longest operators")


# -- output ---------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(
    rows: list[dict[str, Any]], columns: list[tuple[str, str]], title: str = ""
) -> None:
    """Print `rows` as a plain-text table; `columns` are (key, header) pairs."""
    if title:
        print(f"\n{title}")
    cells = [[fmt(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    print(
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, ((_, h), w) in enumerate(zip(columns, widths))
        )
    )
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths))))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")


# -- nmt pieces -----------------------------------------------------------------------------


def load_recipe(arch: str, overrides: list[str] | None = None):
    from nmt import config

    return config.load(RECIPES[arch], overrides or [])


def vocab_of(prepared):
    from nmt.models.base import Vocab

    v = prepared.summary["vocab"]
    return Vocab(src_size=v["src"], tgt_size=v["tgt"], shared=v["joint"])


def make_optimizer(model: torch.nn.Module, t) -> torch.optim.Optimizer:
    """The optimizer `nmt.train.train` builds (same parameter groups and hyper-parameters)."""
    from nmt.train import make_optimizer as nmt_optimizer

    return nmt_optimizer(model, t)


def nmt_train_step(model, optimizer, t, precision: str) -> Callable[[Any], float]:
    """One optimizer step of `nmt.train.train` on one batch: `nmt.train.train_step` (forward
    under autocast, label-smoothed loss, backward, gradient clipping, Adam step, zero_grad),
    reading its loss on the host as the trainer does on CPU."""
    from nmt.distributed import World
    from nmt.train import Trainee, train_step

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    trainee = Trainee(model, model, optimizer, scaler, precision, World())

    def step(batch) -> float:
        return float(train_step(trainee, [batch], float(batch.tgt_tokens), t).loss)

    return step


def transformer_train_flops(cfg, vocab_size: int, b: int, s: int, t: int) -> dict[str, float]:
    """Analytic matmul FLOPs of one training step (forward + backward) of the transformer on a
    batch padded to [b, s] sources and [b, t] targets: {"total", "attention", "projections"}.

    Forward: 2*m*n*k for every projection (QKV, output, cross-attention Q and KV, FFN, the
    vocabulary projection) and for both attention products (QKᵀ and AV, counted in full: no
    halving for the causal mask, as the kernels compute the whole square). Backward = 2 x
    forward (input and weight gradients). Embedding look-ups, softmax, layer norms, the loss
    and the optimizer are not counted. Padded positions are counted (the hardware does them).
    The "projections" part equals what torch.utils.flop_counter.FlopCounterMode reports for a
    step (it does not see the CPU flash-attention kernel, so it misses "attention").
    """
    d, f = cfg.d_model, cfg.ffn_dim
    src, tgt = b * s, b * t
    proj = cfg.enc_layers * (2 * src * d * 4 * d + 2 * src * d * f * 2) + cfg.dec_layers * (
        2 * tgt * d * 4 * d  # self-attention QKV + out
        + 2 * tgt * d * 2 * d  # cross-attention Q + out
        + 2 * src * d * 2 * d  # cross-attention K, V of the memory
        + 2 * tgt * d * f * 2  # feed-forward
    )
    proj += 2 * tgt * d * vocab_size  # output projection
    attn = cfg.enc_layers * 4 * b * s * s * d + cfg.dec_layers * (
        4 * b * t * t * d + 4 * b * t * s * d
    )
    return {"total": 3.0 * (proj + attn), "attention": 3.0 * attn, "projections": 3.0 * proj}


def flop_counter_check(model, batch) -> float:
    """FLOPs that torch.utils.flop_counter.FlopCounterMode counts for one forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        model(batch.src, batch.src_mask, batch.tgt_in).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


# -- Hugging Face Marian of the same size ---------------------------------------------------


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def marian_config(cfg, vocab_size: int, max_positions: int = 256):
    """A MarianConfig matching the transformer recipe: d_model, layers, heads, FFN, ReLU,
    sqrt(d) embedding scale, one tied embedding table for source, target and output, dropout
    after embeddings and sublayers, and inside the FFN where `nmt` applies it too. Marian is
    post-norm; `nmt`'s default is pre-norm (two more LayerNorms, same matmuls)."""
    from transformers import MarianConfig

    from nmt.special import BOS_ID, EOS_ID, PAD_ID

    return MarianConfig(
        vocab_size=vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.enc_layers,
        decoder_layers=cfg.dec_layers,
        encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.ffn_dim,
        decoder_ffn_dim=cfg.ffn_dim,
        activation_function=cfg.activation,
        max_position_embeddings=max_positions,
        dropout=cfg.dropout,
        attention_dropout=cfg.attn_dropout,
        # FFN dropout after the activation: its own setting when the model has one, else dropout
        activation_dropout=getattr(cfg, "activation_dropout", cfg.dropout),
        scale_embedding=cfg.scale_embeddings,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )


def build_marian(cfg, vocab_size: int, seed: int = 0):
    from transformers import MarianMTModel

    torch.manual_seed(seed)
    return MarianMTModel(marian_config(cfg, vocab_size))  # attention: sdpa (the default)


def hf_train_step(model, optimizer, t, precision: str) -> Callable[[dict], float]:
    """The same step for a Hugging Face seq2seq model: its own loss from `labels` (mean over
    non -100 positions), clipping, Adam step, zero_grad."""
    from nmt.device import autocast

    device = torch.device("cpu")
    params = [p for p in model.parameters() if p.requires_grad]

    def step(inputs: dict) -> float:
        with autocast(device, precision):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.clip_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def hf_inputs(batch) -> dict[str, torch.Tensor]:
    """HF convention for one of our batches: decoder_input_ids = tgt_in, labels = tgt_out with
    padding -> -100, attention_mask = src_mask."""
    from nmt.special import PAD_ID

    return {
        "input_ids": batch.src,
        "attention_mask": batch.src_mask.long(),
        "decoder_input_ids": batch.tgt_in,
        "labels": batch.tgt_out.masked_fill(batch.tgt_out == PAD_ID, -100),
    }
