"""The logic of the CUDA path, exercised on the CPU: precision from a faked device capability,
RNG states across device counts with a mocked CUDA generator, the step that never waits for
the device, pinned collation, the RNN run in autocast's dtype by hand, TF32 and determinism
switches, and no host tuning for a GPU. The GPU itself: tests/test_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_trainee

from nmt import NMTError, config, distributed
from nmt import device as nmt_device
from nmt.data.batching import TokenBatches
from nmt.data.prepare import prepare
from nmt.distributed import World
from nmt.models import layers
from nmt.models.base import fixed_weights
from nmt.models.layers import RNN, explicit_rnn_dtype
from nmt.train import StepMeter, StepResult, train_step, update

CUDA0 = torch.device("cuda", 0)


# -- precision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability, expected", [((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16"), ((6, 1), "fp16")]
)
def test_auto_precision_follows_the_gpus_compute_capability(monkeypatch, capability, expected):
    """bf16 only where the GPU has it natively (Ampere, 8.0, and later), whatever
    is_bf16_supported says (it also says yes where bf16 is emulated)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert nmt_device.resolve_precision("auto", CUDA0) == expected
    assert nmt_device.resolve_precision("fp16", CUDA0) == "fp16"  # asked for, given


def test_device_names(monkeypatch):
    """One line for a name torch cannot read ('cpu:', 'cuda:²' were tracebacks) or a GPU the
    machine does not have (cuda:1 with one GPU failed later, in an assertion)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert nmt_device.resolve_device("cuda:0") == CUDA0
    assert nmt_device.resolve_device("cuda:00") == CUDA0
    assert nmt_device.resolve_device("cuda") == torch.device("cuda")
    assert nmt_device.resolve_device("cpu") == torch.device("cpu")
    for name in ("cpu:", "cuda:", "cuda:²", "cpu:0", "cuda:-1", "gpu", " cuda"):
        with pytest.raises(NMTError, match="unknown device"):
            nmt_device.resolve_device(name)
    with pytest.raises(NMTError, match=r"has 1 GPU\(s\): cuda:0 to cuda:0"):
        nmt_device.resolve_device("cuda:1")


def test_each_rank_takes_a_gpu_of_its_machine(monkeypatch):
    """LOCAL_RANK picks the rank's GPU; one past the machine's GPUs is one line (it was a
    traceback from torch.cuda.set_device)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    assert distributed.rank_device(cuda, World(3, 4, 1)) == torch.device("cuda", 1)
    assert distributed.rank_device(cuda, World(0, 1, 0)) == cuda  # one process: as asked
    with pytest.raises(NMTError, match=r"which has 2 GPU\(s\); start at most 2 processes"):
        distributed.rank_device(cuda, World(2, 3, 2))


def test_host_tuning_is_for_the_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(nmt_device, "configure_host", lambda: calls.append("host"))
    nmt_device.configure_device(torch.device("cpu"))
    assert calls == ["host"]
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch < 2.9
        pytest.skip("this torch sets TF32 through allow_tf32: the test below")
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    before = [s.fp32_precision for s in settings]
    try:
        nmt_device.configure_device(CUDA0, tf32=True)
        assert calls == ["host"]  # a GPU run gets no malloc or denormal settings
        assert [s.fp32_precision for s in settings] == ["tf32"] * 3
        nmt_device.configure_device(CUDA0, tf32=False)  # train.tf32=false
        assert [s.fp32_precision for s in settings] == ["ieee"] * 3
        assert torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")  # CPU untouched
    finally:
        for setting, value in zip(settings, before):
            setting.fp32_precision = value


def test_tf32_on_a_torch_without_fp32_precision(monkeypatch):
    """torch before 2.9 (the CUDA 12.4 wheels stop at 2.6) has allow_tf32 flags only."""
    import types

    matmul, cudnn = types.SimpleNamespace(allow_tf32=False), types.SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(nmt_device.torch.backends, "cudnn", cudnn)
    nmt_device.configure_device(CUDA0, tf32=True)
    assert matmul.allow_tf32 and cudnn.allow_tf32
    nmt_device.configure_device(CUDA0, tf32=False)
    assert not matmul.allow_tf32 and not cudnn.allow_tf32


def test_deterministic_algorithms_for_a_scope():
    assert not torch.are_deterministic_algorithms_enabled()
    with nmt_device.deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic
    with nmt_device.deterministic_algorithms(False):
        assert not torch.are_deterministic_algorithms_enabled()


# -- RNG states across device counts ----------------------------------------------------------


@pytest.fixture
def fake_cuda_rng(monkeypatch):
    """torch.cuda's generator functions, recording calls: state of device i = [i, i, i]."""
    restored: list[tuple[list[int], int]] = []

    def get_state(device=None):
        index = torch.device(device).index or 0
        return torch.tensor([index] * 3, dtype=torch.uint8)

    def set_state(state, device=None):
        restored.append((state.tolist(), torch.device(device).index))

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    return restored


def test_only_this_ranks_device_generator_is_saved(fake_cuda_rng):
    state = distributed.rng_state(torch.device("cuda", 1))
    assert state["cuda"].tolist() == [1, 1, 1]  # not every visible device's
    assert distributed.rng_state(torch.device("cpu"))["cuda"] is None


def test_rng_states_restore_on_another_number_of_devices(fake_cuda_rng):
    saved = [distributed.rng_state(torch.device("cuda", r)) for r in range(2)]
    world = World(rank=1, size=2, local_rank=1)
    assert distributed.restore_rngs(saved, world, torch.device("cuda", 1), 0, 10)
    assert fake_cuda_rng[-1] == ([1, 1, 1], 1)
    # Earlier checkpoints: every visible device's state in a list. On a machine with fewer
    # GPUs, the entry of this device when there is one, nothing otherwise; never a crash.
    old = dict(saved[0], cuda=[torch.tensor([7] * 3, dtype=torch.uint8)] * 2)
    distributed.set_rng_state(old, torch.device("cuda", 0))
    assert fake_cuda_rng[-1] == ([7, 7, 7], 0)
    count = len(fake_cuda_rng)
    distributed.set_rng_state(old, torch.device("cuda", 5))
    distributed.set_rng_state(saved[1], torch.device("cpu"))  # CUDA run resumed on a CPU
    assert len(fake_cuda_rng) == count


def test_another_world_size_rederives_the_rng_states():
    saved = [distributed.rng_state(torch.device("cpu"))] * 2
    exact = distributed.restore_rngs(saved, World(0, 1, 0), torch.device("cpu"), 1234, 50)
    a = torch.rand(3)
    assert not exact
    distributed.restore_rngs(saved, World(0, 1, 0), torch.device("cpu"), 1234, 50)
    assert torch.equal(torch.rand(3), a)  # re-derived from (seed, step, rank): reproducible
    distributed.restore_rngs(saved, World(1, 3, 1), torch.device("cpu"), 1234, 50)
    assert not torch.equal(torch.rand(3), a)  # another rank, another stream
    assert distributed.restore_rngs(saved[:1], World(0, 1, 0), torch.device("cpu"), 1, 1)


def test_the_data_position_carries_over_to_another_world_size():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, 30, 400), rng.integers(3, 30, 400)
    two = TokenBatches(src, tgt, 300, 7, True, 0, 2)
    one = TokenBatches(src, tgt, 300, 7, True, 0, 1)
    per_rank = len(two.epoch(0))
    assert one.resume_start(0, per_rank // 2, 2) == round(len(one.epoch(0)) / 2)
    assert one.resume_start(0, 0, 2) == 0 and one.resume_start(0, per_rank, 2) == len(one.epoch(0))
    assert two.resume_start(0, 5, 2) == 5  # the same world: exactly where it was


def test_ranks_agree_on_step_tokens_without_talking():
    rng = np.random.default_rng(1)
    src, tgt = rng.integers(3, 30, 300), rng.integers(3, 30, 300)
    ranks = [TokenBatches(src, tgt, 250, 3, True, r, 2) for r in range(2)]
    steps = [b.steps(0, 2) for b in ranks]
    assert [t for _, t in steps[0]] == [t for _, t in steps[1]]
    for (mine, total), (theirs, _) in zip(*steps):
        assert total == sum(ranks[0].tokens(b) for b in [*mine, *theirs])
    whole = TokenBatches(src, tgt, 250, 3, True, 0, 1)
    assert sum(t for _, t in whole.steps(0, 1)) == sum(whole.tokens(b) for b in whole.epoch(0))


# -- the step never waits for the device ----------------------------------------------------


def test_a_training_step_reads_nothing_back_from_the_device(monkeypatch):
    """No .item(), float(), .tolist() or bool() of a tensor inside train_step: on CUDA each
    would wait for the GPU. Its results stay tensors, read by StepMeter when due."""
    trainee, batches, cfg = tiny_trainee()

    def forbidden(*a, **k):
        raise AssertionError("a host read of a tensor inside the step")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            m.setattr(torch.Tensor, name, forbidden)
        result = train_step(trainee, batches[:2], sum(b.tgt_tokens for b in batches[:2]), cfg.train)
    assert all(isinstance(x, torch.Tensor) for x in vars(result).values())
    assert torch.isfinite(result.loss) and not result.bad and not result.skipped


def rnn_encoder_batch(cell: str = "gru"):
    """A 2-layer bidirectional RNN encoder and a batch of 13 sources of lengths 1-9, the
    lengths on the host as training passes them."""
    torch.manual_seed(0)
    enc = layers.RNNEncoder(50, 16, 24, 2, cell, True, 0.0)
    lengths = torch.tensor([9, 3, 5, 5, 1, 9, 7, 2, 5, 8, 3, 6, 9])
    src = torch.randint(4, 50, (13, 9))
    mask = torch.arange(9)[None] < lengths[:, None]
    return enc, src.masked_fill(~mask, 0), mask, lengths


def test_the_rnn_encoder_sends_nothing_to_the_device_and_reads_nothing_back(monkeypatch):
    """Packing with enforce_sorted=False copies its sort order to the device (a blocking copy
    from unpinned memory) and reads it back (.cpu()): two waits for the GPU at every step of
    the RNN architectures. The encoder sorts on the host itself; no tensor crosses devices
    in its forward (on CUDA the order goes pinned and non-blocking, tests/test_gpu.py)."""
    enc, src, mask, lengths = rnn_encoder_batch()
    crossings = []
    real_to, real_cpu = torch.Tensor.to, torch.Tensor.cpu

    def to(self, *args, **kwargs):
        if any(isinstance(a, (torch.device, str)) for a in (*args, *kwargs.values())):
            crossings.append(("to", args, kwargs))
        return real_to(self, *args, **kwargs)

    def cpu(self, *args, **kwargs):
        crossings.append(("cpu",))
        return real_cpu(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "to", to)
        m.setattr(torch.Tensor, "cpu", cpu)
        out, final = enc(src, mask, lengths)
    assert crossings == []
    assert out.shape == (13, 9, 48) and final.shape == (13, 48)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_the_rnn_encoder_sorting_itself_gives_packings_results(cell):
    """The same outputs, final states and gradients, bit for bit, as pack_padded_sequence
    sorting the batch (enforce_sorted=False), in fp32 and under bf16 autocast."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    enc, src, mask, lengths = rnn_encoder_batch(cell)

    def packing_sorts():
        x = enc.embed(src)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, hidden, _ = enc.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        top = hidden[:, -enc.dirs :, :]
        return out, top.reshape(top.size(0), enc.out_dim)

    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected, ours = packing_sorts(), enc(src, mask, lengths)
        for a, b in zip(expected, ours):
            assert torch.equal(a, b)
        grads = [
            torch.autograd.grad(sum(t.float().sum() for t in pair), list(enc.parameters()))
            for pair in (expected, ours)
        ]
        assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_meter_counts_consecutive_bad_and_skipped_steps():
    meter = StepMeter(torch.device("cpu"))

    def step(loss: float, bad: bool, skipped: bool, norm: float = 1.0) -> None:
        t = torch.tensor
        meter.add(StepResult(t(loss, dtype=torch.float64), t(norm), t(bad), t(skipped)))

    step(2.0, False, False)
    step(3.0, True, True, float("inf"))
    step(float("nan"), True, True)
    loss, skipped, bad_run = meter.read()
    assert np.isnan(loss) and skipped == 2 and bad_run == 2
    step(1.5, True, False)  # fp16: a non-finite loss the scaler did not skip for
    assert meter.read()[1:] == (0, 3)  # the run of bad steps goes on across reads
    step(1.0, False, False, 0.5)
    assert meter.read() == (1.0, 0, 0) and meter.grad_norm == 0.5
    # a run of 12 bad steps that ended before the read (CUDA reads every log_every steps):
    # still counted against train.max_nonfinite (the read once saw only the current run, 0)
    for _ in range(12):
        step(float("nan"), True, True)
    step(1.0, False, False)
    assert meter.read()[1:] == (12, 12)
    assert meter.read()[1:] == (0, 0)
    # a resumed run's meter goes on from the run it had reached at its save
    resumed = StepMeter(torch.device("cpu"), bad_run=2)
    resumed.add(
        StepResult(
            torch.tensor(float("nan"), dtype=torch.float64),
            torch.tensor(1.0),
            torch.tensor(True),
            torch.tensor(True),
        )
    )
    assert resumed.read()[2] == 3 and resumed.bad_run == 3


def test_a_non_finite_gradient_leaves_the_weights_alone():
    """Without loss scaling the fused optimizer skips the update through its found_inf input:
    weights and Adam's step count as they were; the next finite step updates them."""
    trainee, batches, cfg = tiny_trainee()
    train_step(trainee, batches[:1], batches[0].tgt_tokens, cfg.train)
    before = {k: v.clone() for k, v in trainee.model.state_dict().items()}
    steps_before = [s["step"].clone() for s in trainee.optimizer.state.values()]
    weight = trainee.model.output.bias
    handle = weight.register_hook(lambda g: g * float("inf"))
    result = train_step(trainee, batches[1:2], batches[1].tgt_tokens, cfg.train)
    handle.remove()
    assert result.skipped and result.bad and not torch.isfinite(result.grad_norm)
    after = trainee.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [s["step"] for s in trainee.optimizer.state.values()] == steps_before
    result = train_step(trainee, batches[2:3], batches[2].tgt_tokens, cfg.train)
    assert not result.skipped and not torch.equal(before["output.bias"], weight.detach())


def test_update_with_a_loss_scaler_leaves_overflow_to_it(monkeypatch):
    """With a GradScaler (fp16) an overflowing gradient is skipped by the scaler (counted as
    skipped), and only a non-finite loss counts towards train.max_nonfinite."""
    trainee, batches, cfg = tiny_trainee()
    stepped = []

    class FakeScaler:  # GradScaler's interface; CPU fp16 training is refused by design
        def is_enabled(self):
            return True

        def unscale_(self, opt):
            pass

        def step(self, opt):
            stepped.append(True)

        def update(self):
            pass

    trainee.scaler = FakeScaler()
    for p in trainee.model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    result = update(trainee, torch.tensor(5.0, dtype=torch.float64), cfg.train)
    assert stepped and result.skipped and not result.bad
    result = update(trainee, torch.tensor(float("nan"), dtype=torch.float64), cfg.train)
    assert result.bad


# -- data on the host, pinned ---------------------------------------------------------------


def test_pinned_collation_gives_the_same_batches(monkeypatch):
    """collate(pin=True) pins every tensor it hands to the device (pinning is what makes a
    non_blocking copy asynchronous) and changes nothing else; the lengths stay on the host."""
    cfg = config.load("recipes/tiny/transformer.yaml")
    split = prepare(cfg).split("train")
    pinned = []
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(self) or self.clone()
    )
    idx = np.arange(10, 30)
    plain, pin = split.collate(idx), split.collate(idx, pin=True)
    assert len(pinned) == 4
    for name in ("src", "src_mask", "tgt_in", "tgt_out", "src_lengths"):
        assert torch.equal(getattr(plain, name), getattr(pin, name)), name
    assert plain.tgt_tokens == pin.tgt_tokens
    assert torch.equal(plain.src_lengths, plain.src_mask.sum(1))
    moved = plain.to(torch.device("cpu"))
    assert moved.src_lengths.device.type == "cpu"


# -- recurrent layers in autocast's dtype -------------------------------------------------


def test_which_rnns_run_in_a_dtype_by_hand():
    """CUDA autocast runs cuDNN RNNs in fp16 whatever its dtype: there nmt runs them itself."""
    bf16, fp16 = torch.bfloat16, torch.float16
    assert explicit_rnn_dtype("cuda", True, bf16) == bf16
    assert explicit_rnn_dtype("cuda", True, fp16) == fp16
    assert explicit_rnn_dtype("cuda", False, bf16) is None  # fp32: nothing to do
    assert explicit_rnn_dtype("cpu", True, bf16) is None  # oneDNN follows CPU autocast


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_an_rnn_run_by_hand_is_the_module_in_that_dtype(monkeypatch, cell):
    """The explicit path (taken on CUDA) forced on the CPU: outputs in the asked dtype, equal
    to the module converted to it; gradients reach the fp32 weights; within a fixed_weights
    scope the weights are cast once."""
    monkeypatch.setattr(layers, "explicit_rnn_dtype", lambda *a: torch.bfloat16)
    torch.manual_seed(0)
    rnn = RNN(cell, 8, 16, layers=2)
    x, h = torch.randn(3, 5, 8), torch.randn(3, 2, 16)
    c = torch.randn(3, 2, 16) if cell == "lstm" else None
    out, hidden, cell_state = rnn(x, h, c)
    assert out.dtype == hidden.dtype == torch.bfloat16
    reference = RNN(cell, 8, 16, layers=2)
    reference.load_state_dict(rnn.state_dict())
    reference.to(torch.bfloat16)
    monkeypatch.setattr(layers, "explicit_rnn_dtype", lambda *a: None)
    ref_out, ref_hidden, _ = reference(
        x.bfloat16(), h.bfloat16(), None if c is None else c.bfloat16()
    )
    assert torch.equal(out, ref_out) and torch.equal(hidden, ref_hidden)
    monkeypatch.setattr(layers, "explicit_rnn_dtype", lambda *a: torch.bfloat16)
    out.float().sum().backward()
    assert all(p.grad is not None and p.dtype == torch.float32 for p in rnn.parameters())
    with fixed_weights(rnn):
        once = rnn.weights_in(torch.bfloat16)
        assert rnn.weights_in(torch.bfloat16) is once  # cast once per scope
    assert rnn.weight_cache is None and rnn.weights_in(torch.bfloat16) is not once


def test_precision_settings_mean_what_they_say(tmp_path):
    with pytest.raises(NMTError, match="fp16 needs a CUDA device"):
        nmt_device.resolve_precision("fp16", torch.device("cpu"))
