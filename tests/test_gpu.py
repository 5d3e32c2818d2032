"""The CUDA path on a real GPU: skipped without one, run by `pytest -q` on a machine with one
(two GPUs for the NCCL test). Its logic is also tested on the CPU: tests/test_cuda_logic.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_nmt, start_nmt, wait_until
from torch.nn.utils.rnn import PackedSequence

from nmt import checkpoint, config
from nmt.data.prepare import prepare
from nmt.device import cuda_has_bf16
from nmt.distributed import World
from nmt.models.base import Vocab, fixed_weights
from nmt.models.registry import build_model
from nmt.run import RunDir, attach
from nmt.train import Trainee, make_optimizer, train, train_step
from nmt.translate import load_model, search_options, translate_lines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny"
CUDA = torch.device("cuda")


def precisions() -> list[str]:
    if not torch.cuda.is_available():
        return ["fp16", "bf16"]
    return ["fp16", "bf16"] if cuda_has_bf16(CUDA) else ["fp16"]


def tiny(arch: str, *overrides: str) -> config.Config:
    return config.load(TINY / f"{arch}.yaml", ["train.device=cuda", *overrides])


def trainee_on_gpu(arch: str, precision: str) -> tuple[Trainee, list, config.Config]:
    cfg = tiny(arch, f"train.precision={precision}", "model.dropout=0.0")
    prepared = prepare(cfg)
    v = prepared.summary["vocab"]
    torch.manual_seed(0)
    model = build_model(arch, cfg.model, Vocab(v["src"], v["tgt"], v["joint"])).to(CUDA)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    trainee = Trainee(model, model, make_optimizer(model, cfg.train), scaler, precision, World())
    split = prepared.split("train")
    batches = [split.collate(np.arange(i * 16, i * 16 + 16), pin=True).to(CUDA) for i in range(6)]
    return trainee, batches, cfg


@pytest.mark.parametrize("arch", ["seq2seq", "rnn_attention", "transformer"])
@pytest.mark.parametrize("precision", precisions())
def test_mixed_precision_training_of_every_architecture(tmp_path, arch, precision):
    """A few hundred steps: finite losses that go down."""
    cfg = tiny(
        arch,
        f"train.precision={precision}",
        "train.max_steps=300",
        "train.log_every=25",
        "train.valid_every=300",
        "train.valid_bleu=false",
    )
    run = tmp_path / "run"
    attach(prepare(cfg), cfg, run)
    result = train(cfg, run)
    assert result.stop_reason == "reached train.max_steps=300"
    losses = [r["loss"] for r in RunDir(run).metrics() if r["kind"] == "train"]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.8 * losses[0]


@pytest.mark.parametrize("arch", ["seq2seq", "rnn_attention", "transformer"])
@pytest.mark.parametrize("precision", precisions())
def test_autocast_computes_in_half_precision_on_fp32_master_weights(arch, precision):
    """Inside the training process: activations (RNN outputs too) in the asked dtype, the
    optimizer's parameters and moments in fp32."""
    trainee, batches, cfg = trainee_on_gpu(arch, precision)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    seen = []

    def record(module, inputs, out) -> None:
        first = out[0] if isinstance(out, tuple) and not isinstance(out, PackedSequence) else out
        seen.append((first.data if isinstance(first, PackedSequence) else first).dtype)

    for module in trainee.model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.GRU, torch.nn.LSTM)):
            module.register_forward_hook(record)
    for batch in batches[:3]:
        result = train_step(trainee, [batch], batch.tgt_tokens, cfg.train)
    assert seen and set(seen) == {dtype}, set(seen)
    assert torch.isfinite(result.loss)
    for group in trainee.optimizer.param_groups:
        assert all(p.dtype == torch.float32 and p.is_cuda for p in group["params"])
    for state in trainee.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_the_rnn_encoder_never_waits_for_the_gpu(cell):
    """Its forward and backward with the lengths on the host, as training passes them, run
    no synchronizing CUDA operation (packing's own sorting made two at every step)."""
    from nmt.models.layers import RNNEncoder

    torch.manual_seed(0)
    enc = RNNEncoder(50, 16, 24, 2, cell, True, 0.1).to(CUDA).train()
    lengths = torch.tensor([9, 3, 5, 5, 1, 9, 7, 2, 5, 8, 3, 6, 9])
    src = torch.randint(4, 50, (13, 9)).pin_memory().to(CUDA, non_blocking=True)
    mask = (torch.arange(9)[None] < lengths[:, None]).pin_memory().to(CUDA, non_blocking=True)
    enc(src, mask, lengths)  # cuDNN's first call sets itself up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, final = enc(src, mask, lengths)
        (out.sum() + final.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all() and out.shape == (13, 9, 48)


def test_a_run_decodes_in_fp32_as_its_train_tf32_says(tmp_path):
    """Loading a run for decoding sets TensorFloat-32 as the run trained (it was always on:
    fp32 decoding of a train.tf32=false run was not true fp32); in a process that loads
    several (an ensemble, a server), one asking for true fp32 gets it for all. Each case in a
    fresh process: the setting is the process'."""
    runs = {}
    for tf32 in (True, False):
        cfg = tiny("transformer", f"train.tf32={str(tf32).lower()}", "train.max_steps=2")
        runs[tf32] = tmp_path / f"run-{tf32}"
        attach(prepare(cfg), cfg, runs[tf32])
        train(cfg, runs[tf32])
    code = (
        "import sys, torch\n"
        "from nmt.translate import load_model\n"
        "for path in sys.argv[1:]:\n"
        "    load_model(path, torch.device('cuda'))\n"
        "m = torch.backends.cuda.matmul\n"
        "on = m.fp32_precision == 'tf32' if hasattr(m, 'fp32_precision') else m.allow_tf32\n"
        "print('tf32' if on else 'fp32')\n"
    )
    for order, expected in (
        ([True], "tf32"),
        ([False], "fp32"),
        ([False, True], "fp32"),
        ([True, False], "fp32"),
    ):
        res = subprocess.run(
            [sys.executable, "-c", code, *(str(runs[t]) for t in order)],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0 and res.stdout.strip() == expected, (order, res.stderr)


def test_fp16_scaler_skips_an_overflowing_step_and_halves_its_scale():
    trainee, batches, cfg = trainee_on_gpu("transformer", "fp16")
    train_step(trainee, batches[:1], batches[0].tgt_tokens, cfg.train)
    scale = trainee.scaler.get_scale()
    before = {k: v.clone() for k, v in trainee.model.state_dict().items()}
    handle = trainee.model.output.bias.register_hook(lambda g: g * float("inf"))
    result = train_step(trainee, batches[1:2], batches[1].tgt_tokens, cfg.train)
    handle.remove()
    assert bool(result.skipped) and not bool(result.bad)  # the scaler's business
    assert trainee.scaler.get_scale() == scale / 2
    assert all(torch.equal(before[k], v) for k, v in trainee.model.state_dict().items())
    skipped = sum(
        bool(train_step(trainee, [b], b.tgt_tokens, cfg.train).skipped) for b in batches[2:]
    )
    assert skipped == 0


def test_a_killed_run_resumes_bit_exact_with_deterministic_kernels(tmp_path):
    recipe = TINY / "transformer.yaml"
    sets = [
        *("--set", "train.device=cuda", "--set", "train.deterministic=true"),
        *("--set", "train.max_steps=40", "--set", "train.save_every=5"),
        *("--set", "train.keep_last=20", "--set", "train.valid_every=1000"),
    ]
    ref = run_nmt("train", recipe, "--run-dir", tmp_path / "ref", *sets)
    assert ref.returncode == 0, ref.stderr
    killed = tmp_path / "killed"
    proc = start_nmt("train", recipe, "--run-dir", killed, *sets)
    wait_until((killed / "checkpoints" / "step-10.pt").is_file, proc, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_nmt("train", recipe, "--run-dir", killed, "--resume", *sets)
    assert resumed.returncode == 0, resumed.stderr
    a = checkpoint.load(tmp_path / "ref" / "checkpoints" / "last.pt")["model"]
    b = checkpoint.load(killed / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_process_ddp_on_nccl_matches_one_process_accumulating(tmp_path):
    recipe = TINY / "transformer.yaml"
    sets = [
        *("--set", "train.device=cuda", "--set", "train.precision=fp32"),
        *("--set", "train.tf32=false", "--set", "model.dropout=0.0"),
        *("--set", "train.max_steps=8", "--set", "train.log_every=1"),
        *("--set", "train.valid_every=1000", "--set", "train.valid_bleu=false"),
    ]
    single = run_nmt(
        "train", recipe, "--run-dir", tmp_path / "one", *sets, "--set", "train.accumulate=2"
    )
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc_per_node=2", "-m", "nmt", "train", str(recipe)),
            *("--run-dir", str(tmp_path / "two"), *sets),
        ],
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = [r["loss"] for r in RunDir(tmp_path / "one").metrics() if r["kind"] == "train"]
    two = [r["loss"] for r in RunDir(tmp_path / "two").metrics() if r["kind"] == "train"]
    assert len(one) == len(two) == 8
    assert one == pytest.approx(two, rel=1e-3)


@pytest.mark.parametrize("precision", precisions())
def test_beam_search_in_half_precision_agrees_with_fp32(precision):
    """A toy model trained on the CPU, decoded on the GPU: the same 1-best for nearly all
    sentences in fp16/bf16 as in fp32."""
    from conftest import tiny_run

    run, cfg = tiny_run("transformer", 160)
    loaded = load_model(run, CUDA)
    split = prepare(cfg).split("test_2016_flickr")
    lines = split.texts("src")[:200]
    opts = search_options(cfg.decode, beam=5, nbest=1)

    def best(prec: str) -> list[str]:
        out = translate_lines(loaded.model, loaded.tokenizer, lines, opts, 6000, CUDA, prec)
        return [nbest[0][0] if nbest else "" for nbest in out]

    fp32, half = best("fp32"), best(precision)
    assert sum(a == b for a, b in zip(fp32, half)) >= 0.9 * len(lines)


def test_sentences_joining_a_running_stream_on_the_gpu_are_searched_as_alone():
    """In-flight batching on CUDA: sentences that join a running beam search (empty caches
    beside filled ones: no cache row, `NO_ROW`, until their first step) get the n-best they
    get decoded alone."""
    from conftest import tiny_run

    from nmt.search import BeamStream
    from nmt.translate import source_batch, source_mask

    run, cfg = tiny_run("transformer", 160)
    loaded = load_model(run, CUDA)
    lines = prepare(cfg).split("test_2016_flickr").texts("src")[:12]
    opts = search_options(cfg.decode, beam=4, nbest=2)
    model, tok = loaded.model, loaded.tokenizer

    def source(part: list[str]):
        src = source_batch(tok.encode_src(part)).to(CUDA)
        return src, source_mask(src)

    with torch.inference_mode(), fixed_weights(model):
        alone = {}
        for i, line in enumerate(lines):
            stream = BeamStream(model, opts)
            stream.add(*source([line]), [i])
            while stream:
                alone.update(stream.step())
        stream, joined = BeamStream(model, opts), {}
        stream.add(*source(lines[:4]), list(range(4)))
        for i in range(4, len(lines), 2):  # two more every other step
            for _ in range(2):
                joined.update(stream.step())
            stream.add(*source(lines[i : i + 2]), [i, i + 1])
        while stream:
            joined.update(stream.step())
    assert sorted(joined) == list(range(len(lines)))
    for i in joined:
        assert [h.tokens for h in joined[i]] == [h.tokens for h in alone[i]], i
        got, want = [h.score for h in joined[i]], [h.score for h in alone[i]]
        assert got == pytest.approx(want, abs=1e-4), i
