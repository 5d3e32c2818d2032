"""`nmt export` (CTranslate2 and Hugging Face Marian) and `--engine ctranslate2`, on tiny
transformers trained in the session: each export must translate as nmt does. Greedy outputs
are identical; so are beam outputs wherever the searches agree by construction (see
`nmt.engine`); log-probabilities of forced targets agree to rounding, which catches layout
errors greedy decoding might hide. Refusals end with one line; exports are written whole or
not at all.

Variants (`tiny_run` overrides): the default tiny transformer (pre-norm, interleaved
sinusoids, one tied table, relu; 160 steps, shared with the other test files); post-norm with
learned positions (16: later ones reuse the last), untied embeddings, gelu and separate
vocabularies; and two that Marian can express (post-norm, Marian's positions): joint
vocabulary and relu, and separate vocabularies with gelu, a target table tied to the output
and unscaled embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from conftest import cpu_flags, cpuinfo, tiny_run

from nmt import NMTError, checkpoint
from nmt.config import DecodeConfig
from nmt.data.prepare import prepare
from nmt.engine import CT2Engine, NMTEngine, open_engine
from nmt.models.layers import Positions
from nmt.run import RunDir
from nmt.search import force_decode, length_limits
from nmt.special import BOS_ID, EOS_ID
from nmt.translate import load_model, search_options, source_batch, source_mask

ctranslate2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")
from nmt import export  # noqa: E402  (after the optional packages are known to be there)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
N_GREEDY = 100
FAST = ("train.valid_bleu=false", "train.batch_tokens=1000")
VARIANTS = {
    "pre-sinusoidal-tied": (160, ()),  # the tiny recipe as test_search.py trains it
    "post-learned-untied-gelu-separate": (
        40,
        (
            "model.norm=post",
            "model.positions=learned",
            "model.max_positions=16",
            "model.tie_embeddings=false",
            "model.activation=gelu",
            "tokenizer.joint=false",
            *FAST,
        ),
    ),
    "marian": (40, ("model.norm=post", "model.positions=sinusoidal_marian", *FAST)),
    "marian-separate-gelu-unscaled": (
        40,
        (
            "model.norm=post",
            "model.positions=sinusoidal_marian",
            "model.activation=gelu",
            "model.scale_embeddings=false",
            "tokenizer.joint=false",
            *FAST,
        ),
    ),
}
MARIAN = ("marian", "marian-separate-gelu-unscaled")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models; a shared 2-core machine (CTranslate2 gets 1 thread through the engine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(multi30k_dir, _one_thread, tmp_path_factory):
    """Copies of the variants' runs (exports for --engine ctranslate2 go into a run)."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("runs")

    def get(name: str) -> Path:
        if name not in cache:
            steps, overrides = VARIANTS[name]
            run, _ = tiny_run("transformer", steps, overrides, None if steps == 160 else name)
            cache[name] = copy_run(run, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def sources(runs) -> list[str]:
    """The first test_2016_flickr sources (English), as the runs' data gives them."""
    cfg = load_model(runs("pre-sinusoidal-tied"), CPU).config
    return prepare(cfg).split("test_2016_flickr").texts("src")[:N_GREEDY]


@pytest.fixture(scope="module")
def references(runs) -> list[str]:
    cfg = load_model(runs("pre-sinusoidal-tied"), CPU).config
    return prepare(cfg).split("test_2016_flickr").texts("tgt")[:N_GREEDY]


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """Each variant exported once per format: {(name, format): directory}."""
    root = tmp_path_factory.mktemp("exports")
    done: dict[tuple[str, str], Path] = {}

    def get(name: str, fmt: str) -> Path:
        if (name, fmt) not in done:
            out = root / f"{name}-{fmt}"
            export.EXPORTERS[fmt](runs(name), out)
            done[name, fmt] = out
        return done[name, fmt]

    return get


def nmt_engine(run: Path) -> NMTEngine:
    engine = open_engine([run], "nmt", CPU, precision="fp32")
    assert isinstance(engine, NMTEngine)
    return engine


def texts(results) -> list[str]:
    return [nbest[0][0] if nbest else "" for nbest in results]


def options(run: Path, **changes):
    d = dataclasses.replace(nmt_engine(run).config.decode, **changes)
    return search_options(d, nbest=min(d.nbest, d.beam))


# -- the model option Marian needs -------------------------------------------------------------


def test_marian_positions_are_hugging_face_marians_bit_for_bit():
    """Marian recomputes its table when it loads: nmt's must be the same values."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for n, d in ((64, 48), (1024, 256), (40, 33)):
        table = Positions("sinusoidal_marian", n, d)
        with torch.inference_mode():
            ours = table(torch.arange(n + 5))  # past the table: its last entry
        embedding = MarianSinusoidalPositionalEmbedding(n, d)
        if hasattr(embedding, "create_weight"):  # transformers 5
            theirs = embedding.create_weight()
        else:  # transformers 4: the table is made in place when the model is initialised
            embedding._init_weight()
            theirs = embedding.weight.detach()
        assert torch.equal(ours[:n], theirs)
        assert torch.equal(ours[n:], theirs[-1:].expand(5, d))


# -- CTranslate2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ctranslate2_greedy_translations_are_nmts(name, runs, sources):
    """Greedy search through the engine interface: CTranslate2 float32 gives nmt's fp32
    translations, with nmt's scores (CTranslate2 excludes PAD and BOS before its softmax, nmt
    after it: the scores differ by the little probability those had)."""
    run = runs(name)
    opts = options(run, beam=1, nbest=1)
    engine = nmt_engine(run)
    ours = engine.translate(sources, opts, 6000)
    theirs = open_engine([run], "ctranslate2", CPU).translate(sources, opts, 6000)
    assert texts(theirs) == texts(ours)
    limits = length_limits(
        torch.tensor([len(s) + 1 for s in engine.tokenizer.encode_src(sources)]), opts
    )
    for (_, a), (_, b), limit in zip((n[0] for n in ours), (n[0] for n in theirs), limits.tolist()):
        assert b.tokens == a.tokens
        if len(a.tokens) < limit - 1:  # ended by its own EOS, not cut by the length limit
            assert b.logprob == pytest.approx(a.logprob, abs=0.05)
            assert b.score == pytest.approx(a.score, abs=0.02)


def test_a_line_without_source_pieces_translates_to_an_empty_line_on_both_engines(runs, sources):
    """A line of characters the tokenizer drops (zero-width spaces) holds nothing to
    translate, as a blank line: both engines give an empty line for it (nmt's model, given no
    source piece, wrote a sentence where CTranslate2 wrote none), and the other lines are
    translated as without it."""
    run = runs("pre-sinusoidal-tied")
    opts = options(run, beam=2, nbest=1, length_norm="plain")
    engine = nmt_engine(run)
    assert engine.tokenizer.encode_src(["\u200b\u200b"]) == [[]]
    lines = [sources[0], "\u200b", " \u200b\u200b ", "", sources[1]]
    alone = texts(engine.translate([sources[0], sources[1]], opts, 6000))
    # nmt in fp32, the engine of `alone` (its default, `auto`, is bf16 on CPUs with native bf16)
    engines = {"nmt": engine, "ctranslate2": open_engine([run], "ctranslate2", CPU)}
    for name, other in engines.items():
        got = texts(other.translate(lines, opts, 6000))
        assert got == [alone[0], "", "", "", alone[1]], name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ctranslate2_log_probs_of_a_forced_target_are_nmts(name, runs, sources, references):
    """Token by token (every position, every layer's layout): CTranslate2's scoring of the
    reference translations equals nmt's forced decoding to rounding."""
    run = runs(name)
    loaded = load_model(run, CPU)
    ct2 = open_engine([run], "ctranslate2", CPU)
    translator = ct2.translator(1)
    tok = loaded.tokenizer
    src_pieces = tok.src.encode(sources[:12], out_type=str)
    tgt_ids = tok.encode_tgt(references[:12])
    scored = translator.score_batch(
        src_pieces, [[tok.tgt.id_to_piece(i) for i in t] for t in tgt_ids]
    )
    for text, target, result in zip(sources, tgt_ids, scored):
        src = source_batch(tok.encode_src([text]))
        logps, _ = force_decode(loaded.model, src, source_mask(src), target)
        assert result.tokens[-1] == "</s>" and len(result.log_probs) == len(target) + 1
        assert torch.allclose(torch.tensor(result.log_probs), torch.tensor(logps), atol=2e-4)


def test_ctranslate2_beam_search_finds_nmts_translations(runs, sources):
    """Beam 5. Without a length penalty both searches end on the best finished hypothesis:
    the same translations. With plain normalisation (|y| ** alpha, |y| counting the EOS in
    both), CTranslate2 stops once 5 hypotheses finished and nmt only when none left could beat
    them: nmt's best is never worse, and on this model the two agree; scores are the same
    normalised ones, within the engines' arithmetic: CTranslate2's log-probabilities come out
    a few 1e-4 higher a token (+0.0064 on 9 tokens, +0.0105 on 34, alpha 0), so relative to
    the score's size, as the patience test below compares them. n-best lists are as long."""
    run = runs("pre-sinusoidal-tied")
    ours_engine, ct2 = nmt_engine(run), open_engine([run], "ctranslate2", CPU)
    lines = sources[:40]
    for alpha in (0.0, 1.0):
        opts = options(run, beam=5, nbest=3, length_penalty=alpha, length_norm="plain")
        ours = ours_engine.translate(lines, opts, 6000)
        theirs = ct2.translate(lines, opts, 6000)
        assert texts(theirs) == texts(ours)
        for a, b in zip(ours, theirs):
            assert b[0][1].score == pytest.approx(a[0][1].score, rel=1e-3, abs=0.01)
            assert b[0][1].score <= a[0][1].score + max(0.01, 1e-3 * abs(a[0][1].score))
            assert len(b) == len(a) == 3


def test_ctranslate2_beam_search_with_nmts_patience_is_the_same_search(runs, sources):
    """decode.patience P: both end a sentence once round(5*P) hypotheses finished (alpha 0:
    once the best candidate ended), so the 1-best and its score are the same, and the n-best
    lists where no hypothesis reaches the length limit (there nmt scores the EOS it forces and
    CTranslate2 no EOS, which can order such hypotheses differently)."""
    run = runs("pre-sinusoidal-tied")
    ours_engine, ct2 = nmt_engine(run), open_engine([run], "ctranslate2", CPU)
    lines = sources[:40]
    lengths = torch.tensor([len(s) + 1 for s in ours_engine.tokenizer.encode_src(lines)])
    for alpha, patience in ((1.0, 1.0), (1.0, 1.5), (1.0, 2.0), (0.0, 1.0)):
        opts = options(
            run, beam=5, nbest=3, length_penalty=alpha, length_norm="plain", patience=patience
        )
        ours = ours_engine.translate(lines, opts, 6000)
        theirs = ct2.translate(lines, opts, 6000)
        assert texts(theirs) == texts(ours)
        free = 0
        for a, b, limit in zip(ours, theirs, length_limits(lengths, opts).tolist()):
            assert b[0][1].score == pytest.approx(a[0][1].score, rel=1e-3, abs=0.01)
            if all(len(h.tokens) < limit - 1 for _, h in a + b):
                free += 1
                assert [t for t, _ in b] == [t for t, _ in a]
                for (_, mine), (_, other) in zip(a, b):
                    assert other.score == pytest.approx(mine.score, rel=1e-3, abs=0.01)
        assert free >= len(lines) // 2


def test_ctranslate2_threads_decode_on_their_own_translators(runs, sources):
    """Threads that decode at once (a server's batching threads, each asking for 1 worker)
    each get their own translator, kept for their next calls, instead of queueing on one
    translator's single worker; the translations stay the same."""
    run = runs("pre-sinusoidal-tied")
    ct2 = open_engine([run], "ctranslate2", CPU)
    opts = options(run, beam=2, nbest=1, length_norm="plain")
    lines = sources[:10]
    alone = texts(ct2.translate(lines, opts, 6000, workers=1))
    got, used = {}, {}
    both_alive = threading.Barrier(2, timeout=120)  # thread ids are unique among live threads only

    def work(i: int) -> None:
        both_alive.wait()
        got[i] = texts(ct2.translate(lines, opts, 6000, workers=1))
        used[i] = ct2.translator(1)
        both_alive.wait()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] == alone
    assert used[0] is not used[1]
    assert ct2.translator(1) is ct2.translator(1)


def test_ctranslate2_decodes_on_the_gpu_asked_for(runs, monkeypatch):
    """--engine ctranslate2 --device cuda:1 runs on GPU 1 (it ran on CTranslate2's default,
    GPU 0). No GPU here: the translator's arguments are recorded."""
    import ctranslate2

    asked = []
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", lambda *a, **k: {"float16"})
    monkeypatch.setattr(ctranslate2, "Translator", lambda *a, **k: asked.append(k))
    for device, index in ((torch.device("cuda", 1), 1), (torch.device("cuda"), 0), (CPU, 0)):
        engine = CT2Engine(runs("pre-sinusoidal-tied"), "float16", device)
        engine.translator(1)
        assert (asked[-1]["device"], asked[-1]["device_index"]) == (device.type, index)


def test_ctranslate2_honours_the_length_limits_and_constraints(runs, sources):
    """a*|x|+b per sentence (here short enough to cut most outputs), min_len, ban_unk and
    no_repeat_ngram: greedy outputs stay nmt's."""
    run = runs("pre-sinusoidal-tied")
    ours_engine, ct2 = nmt_engine(run), open_engine([run], "ctranslate2", CPU)
    lines = sources[:30]
    for changes in (
        {"max_len_a": 0.5, "max_len_b": 2},
        {"min_len": 12},
        {"no_repeat_ngram": 2, "ban_unk": True},
        {"max_len_a": 0.0, "max_len_b": 1},  # room for the EOS only: empty translations
    ):
        opts = options(run, beam=1, nbest=1, **changes)
        ours, theirs = ours_engine.translate(lines, opts, 6000), ct2.translate(lines, opts, 6000)
        assert texts(theirs) == texts(ours), changes
        limits = length_limits(
            torch.tensor([len(s) + 1 for s in ours_engine.tokenizer.encode_src(lines)]), opts
        )
        cut = 0
        for nbest, limit in zip(theirs, limits.tolist()):
            assert len(nbest[0][1].tokens) <= limit - 1
            cut += len(nbest[0][1].tokens) == limit - 1
        if changes.get("max_len_a") == 0.5:
            assert cut > len(lines) // 2  # the limit did bite
        if changes.get("max_len_b") == 1:
            for (text, hyp), (_, mine) in zip((n[0] for n in theirs), (n[0] for n in ours)):
                assert text == "" and hyp.tokens == []
                assert hyp.score == pytest.approx(mine.score, abs=1e-4)  # log p(EOS | x)


def test_ctranslate2_samples_as_asked(runs, sources):
    """Sampling: top-k 1 is greedy; a seed gives the same samples again; another seed others."""
    run = runs("pre-sinusoidal-tied")
    ct2 = open_engine([run], "ctranslate2", CPU)
    lines = sources[:20]
    greedy = texts(ct2.translate(lines, options(run, beam=1), 6000))
    d = dataclasses.replace(ct2.config.decode, beam=1, nbest=1)
    assert texts(ct2.translate(lines, search_options(d, sample=True, top_k=1), 6000)) == greedy
    seeded = [search_options(d, sample=True, temperature=2.0, seed=s) for s in (1, 1, 2)]
    first, again, other = (texts(ct2.translate(lines, o, 6000)) for o in seeded)
    assert first == again and first != other and first != greedy


def test_ctranslate2_refuses_what_it_cannot_honour(runs, tmp_path):
    run = runs("pre-sinusoidal-tied")
    ct2 = open_engine([run], "ctranslate2", CPU)
    d = DecodeConfig(beam=4, length_penalty=0.6)  # gnmt
    with pytest.raises(NMTError, match="--length-norm plain or --length-penalty 0"):
        ct2.check(search_options(d))
    ct2.check(search_options(d, beam=1))  # greedy: nmt normalises CTranslate2's raw scores
    ct2.check(search_options(dataclasses.replace(d, length_norm="plain")))
    with pytest.raises(NMTError, match="benchmark mode"):
        ct2.check(search_options(d, beam=1, fixed_len=5))
    long_line = " ".join(["word"] * 3000)
    with pytest.raises(NMTError, match="positions"):
        ct2.translate([long_line], search_options(d, beam=1), 6000)
    with pytest.raises(NMTError, match="--precision"):
        open_engine([run], "ctranslate2", CPU, precision="bf16")
    with pytest.raises(NMTError, match="--engine ctranslate2"):
        open_engine([run], "nmt", CPU, quantization="int8")
    with pytest.raises(NMTError, match="cannot compute in float16"):
        open_engine([run], "ctranslate2", CPU, quantization="float16")  # CPUs compute no fp16
    with pytest.raises(NMTError, match="unknown quantization"):
        open_engine([run], "ctranslate2", CPU, quantization="int4")


def ct2_int8_saturates() -> bool:
    """Whether CTranslate2's int8 products saturate on this CPU. On x86 CPUs not made by
    Intel it multiplies int8 matrices with oneDNN's u8s8 kernel (Intel MKL's on Intel's), and
    without VNNI that kernel adds each pair of 8-bit products in 16 bits (`vpmaddubsw`), which
    saturates for large activations against large weights of one sign (oneDNN's "Nuances of
    int8 computations"). The tiny test model, 160 steps from its initialisation, has many such
    weights: on a Zen 3 CPU 36 of its 100 greedy int8 translations were fp32's, 93 with MKL.
    A trained model has few (the 14-minute transformer on that CPU: BLEU 30.15 on oneDNN, 30.12
    on MKL, 30.22 in float32)."""
    flags = cpu_flags()
    vnni = bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    return cpuinfo().get("vendor_id") != "GenuineIntel" and "avx2" in flags and not vnni


def ct2_translations_on_mkl(run: Path, quantization: str, sources: list[str], opts) -> list[str]:
    """CTranslate2's translations of `sources` with search options `opts`, its products
    computed on Intel MKL (CT2_USE_MKL=1, which CTranslate2 reads once per process: so in a
    process of its own)."""
    code = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from nmt.engine import open_engine\n"
        "from nmt.search import SearchOptions\n"
        "run, quantization, sources, opts = json.load(sys.stdin)\n"
        "engine = open_engine([Path(run)], 'ctranslate2', torch.device('cpu'), "
        "quantization=quantization)\n"
        "out = engine.translate(sources, SearchOptions(**opts), 6000)\n"
        "print(json.dumps([n[0][0] if n else '' for n in out]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([str(run), quantization, sources, dataclasses.asdict(opts)]),
        env={**os.environ, "CT2_USE_MKL": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("quantization", ["int8", "int8_float32"])
def test_quantized_exports_translate_close_to_nmt(quantization, runs, sources):
    """int8 weights change some choices; most greedy translations stay nmt's. Where
    CTranslate2's own choice of int8 kernel saturates (`ct2_int8_saturates`), its products
    are computed on the kernel that does not (MKL): the test is of the export's weights and
    scales, not of a CPU's 16-bit sums."""
    run = runs("pre-sinusoidal-tied")
    supported = ctranslate2.get_supported_compute_types("cpu")
    if quantization not in supported:
        pytest.skip(f"CTranslate2 computes no {quantization} on this CPU")
    opts = options(run, beam=1, nbest=1)
    ours = texts(nmt_engine(run).translate(sources, opts, 6000))
    engine = open_engine([run], "ctranslate2", CPU, quantization=quantization)  # exports the run
    if ct2_int8_saturates():
        theirs = ct2_translations_on_mkl(run, quantization, sources, opts)
    else:
        theirs = texts(engine.translate(sources, opts, 6000))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.8 * len(sources)
    stamp = export.read_stamp(RunDir(run).export_dir(f"ctranslate2-{quantization}"))
    assert stamp["quantization"] == quantization


def test_the_ctranslate2_directory_stands_alone(exports, runs, sources):
    """What `nmt export --format ctranslate2` writes is used as its README shows: the model
    appends the source EOS itself, the sentencepiece models are beside it."""
    import sentencepiece as spm

    run, out = (
        runs("post-learned-untied-gelu-separate"),
        exports("post-learned-untied-gelu-separate", "ctranslate2"),
    )
    assert {"model.bin", "config.json", "source.spm", "target.spm", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    assert "translate_batch" in (out / "README.md").read_text()
    translator = ctranslate2.Translator(str(out), intra_threads=1)
    source = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    target = spm.SentencePieceProcessor(model_file=str(out / "target.spm"))
    lines = sources[:20]
    results = translator.translate_batch(
        source.encode(lines, out_type=str),
        beam_size=1,
        max_decoding_length=40,
        suppress_sequences=[["<pad>"], ["<s>"]],
    )
    opts = options(run, beam=1, nbest=1, max_len_a=0.0, max_len_b=41)
    assert [target.decode(r.hypotheses[0]) for r in results] == texts(
        nmt_engine(run).translate(lines, opts, 6000)
    )


# -- Hugging Face Marian --------------------------------------------------------------------


def hf_load(directory: Path):
    from transformers import MarianMTModel, MarianTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():  # MarianTokenizer recommends sacremoses, which it does not use
        warnings.simplefilter("ignore")
        tokenizer = MarianTokenizer.from_pretrained(directory)
    return tokenizer, MarianMTModel.from_pretrained(directory).eval()


def hf_generate(tokenizer, model, lines: list[str], opts, **kwargs) -> list[str]:
    """One sentence at a time, with nmt's length limit: max_new_tokens = limit - 1 (nmt's last
    position is a forced EOS)."""
    out = []
    for line in lines:
        batch = tokenizer([line], return_tensors="pt")
        limit = int(length_limits(torch.tensor([batch.input_ids.size(1)]), opts)[0])
        with torch.inference_mode():
            ids = model.generate(**batch, max_new_tokens=limit - 1, **kwargs)
        out.append(tokenizer.decode(ids[0], skip_special_tokens=True))
    return out


@pytest.mark.parametrize("name", MARIAN)
def test_hf_greedy_translations_are_nmts(name, runs, exports, sources):
    run = runs(name)
    tokenizer, model = hf_load(exports(name, "hf"))
    opts = options(run, beam=1, nbest=1)
    ours = texts(nmt_engine(run).translate(sources, opts, 6000))
    assert hf_generate(tokenizer, model, sources, opts, num_beams=1, do_sample=False) == ours


@pytest.mark.parametrize("name", MARIAN)
def test_hf_logits_of_a_forced_target_are_nmts(name, runs, exports, sources, references):
    run = runs(name)
    loaded = load_model(run, CPU)
    tokenizer, model = hf_load(exports(name, "hf"))
    tok = loaded.tokenizer
    for text, ref in zip(sources[:12], references[:12]):
        target = tok.encode_tgt([ref])[0]
        src = source_batch(tok.encode_src([text]))
        logps, _ = force_decode(loaded.model, src, source_mask(src), target)
        with torch.inference_mode():
            logits = model(
                **tokenizer([text], return_tensors="pt"),
                decoder_input_ids=torch.tensor([[BOS_ID, *target]]),
            ).logits[0]
        theirs = logits.log_softmax(-1).gather(1, torch.tensor([*target, EOS_ID])[:, None])[:, 0]
        assert torch.allclose(theirs, torch.tensor(logps), atol=2e-4)


def test_hf_beam_search_finds_nmts_translations(runs, exports, sources):
    """Beam 5: identical without a length penalty; with plain normalisation (Hugging Face
    divides by |y| ** alpha, |y| counting the EOS; early_stopping="never" as exported) for
    every sentence whose translation does not reach the length limit, where transformers ends
    hypotheses without an EOS and nmt forces one."""
    run = runs("marian")
    tokenizer, model = hf_load(exports("marian", "hf"))
    lines = sources[:25]
    for alpha in (0.0, 1.0):
        opts = options(run, beam=5, nbest=1, length_penalty=alpha, length_norm="plain")
        ours = nmt_engine(run).translate(lines, opts, 6000)
        theirs = hf_generate(tokenizer, model, lines, opts, num_beams=5, length_penalty=alpha)
        limits = length_limits(torch.tensor([len(s) for s in tokenizer(lines).input_ids]), opts)
        free = [i for i, nb in enumerate(ours) if len(nb[0][1].tokens) < int(limits[i]) - 1]
        assert len(free) >= 0.5 * len(lines)
        assert [theirs[i] for i in free] == [ours[i][0][0] for i in free]


def test_hf_directory_loads_as_a_marian_model_and_tokenizer(runs, exports, sources):
    """config.json, model.safetensors, generation and tokenizer files; the tokenizer gives
    nmt's token ids (and EOS), separate vocabularies included; a translation pipeline where
    transformers still has one (it was removed in transformers 5)."""
    for name in MARIAN:
        out = exports(name, "hf")
        files = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json"} <= files
        assert {"source.spm", "target.spm", "vocab.json", "tokenizer_config.json"} <= files
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "marian" and config["architectures"] == ["MarianMTModel"]
        loaded = load_model(runs(name), CPU)
        tokenizer, _ = hf_load(out)
        assert type(tokenizer).__name__ == "MarianTokenizer"
        for line in sources[:20]:
            assert tokenizer(line).input_ids == loaded.tokenizer.encode_src([line])[0] + [EOS_ID]
        assert tokenizer.separate_vocabs == (not loaded.tokenizer.joint)
        ids = loaded.tokenizer.encode_tgt(["Ein Mann fährt Fahrrad."])[0]
        assert tokenizer.decode(ids) == loaded.tokenizer.decode_tgt([ids])[0]
    if int(transformers.__version__.split(".")[0]) < 5:  # the tests' transformers (see pyproject)
        run = runs("marian")
        translate = transformers.pipeline("translation", model=str(exports("marian", "hf")))
        opts = options(run, beam=1, nbest=1)
        expected = texts(nmt_engine(run).translate(sources[:10], opts, 6000))
        got = []
        for line in sources[:10]:  # with nmt's length limit, as hf_generate
            n = translate.tokenizer([line], return_tensors="pt").input_ids.size(1)
            limit = int(length_limits(torch.tensor([n]), opts)[0])
            got.append(
                translate(line, num_beams=1, max_new_tokens=limit - 1)[0]["translation_text"]
            )
        assert got == expected


def test_hf_generation_keeps_nmts_output_constraints(runs, sources, tmp_path):
    """decode.min_len, no_repeat_ngram and ban_unk reach the exported generation config:
    without them generate() could end a translation at once ('' where nmt never gives an
    empty one), repeat n-grams and write <unk>."""
    from nmt.special import UNK_ID

    run = copy_run(runs("marian"), tmp_path / "run")
    for path in (run / "checkpoints").glob("*.pt"):
        payload = checkpoint.load(path)
        payload["config"]["decode"].update(min_len=12, no_repeat_ngram=2, ban_unk=True)
        checkpoint.save(payload, path)
    out = tmp_path / "hf"
    export.export_hf(run, out)
    tokenizer, model = hf_load(out)
    g = model.generation_config
    assert (g.min_new_tokens, g.no_repeat_ngram_size) == (12, 2) and UNK_ID in g.suppress_tokens
    for line in sources[:5]:
        ids = model.generate(**tokenizer([line], return_tensors="pt"), num_beams=1)[0].tolist()
        made = [t for t in ids[1:] if t != EOS_ID]  # after the decoder's start, before its end
        assert len(made) >= 12 and UNK_ID not in made
        pairs = list(zip(made, made[1:]))
        assert len(pairs) == len(set(pairs))


def test_marian_refusals_name_the_setting_and_the_value_that_allows_it(runs, tmp_path):
    with pytest.raises(NMTError, match=r"model\.norm=pre: .*--set model\.norm=post"):
        export.export_hf(runs("pre-sinusoidal-tied"), tmp_path / "a")
    with pytest.raises(
        NMTError, match=r"model\.positions=learned: .*model\.positions=sinusoidal_marian"
    ):
        export.export_hf(runs("post-learned-untied-gelu-separate"), tmp_path / "b")
    c = load_model(runs("marian"), CPU).config.model
    problem = export.marian_problem(dataclasses.replace(c, positions="sinusoidal"))
    assert problem.startswith("model.positions=sinusoidal:")
    assert export.marian_problem(c) is None
    assert not list(tmp_path.iterdir())  # nothing written


# -- writing exports whole or not at all ----------------------------------------------------


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_failed_export_leaves_nothing_and_force_replaces_only_on_success(
    runs, tmp_path, monkeypatch
):
    from ctranslate2.specs import model_spec

    run = runs("pre-sinusoidal-tied")
    out = tmp_path / "model"
    save = model_spec.ModelSpec.save

    def save_then_fail(self, output_dir):  # the disk fills up once the files are written
        save(self, output_dir)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_spec.ModelSpec, "save", save_then_fail)
    with pytest.raises(OSError):
        export.export_ctranslate2(run, out)
    assert not out.exists() and leftovers(tmp_path) == []
    monkeypatch.setattr(model_spec.ModelSpec, "save", save)
    export.export_ctranslate2(run, out, "int8")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(NMTError, match="already exists; add --force"):
        export.export_ctranslate2(run, out)
    monkeypatch.setattr(model_spec.ModelSpec, "save", save_then_fail)
    with pytest.raises(OSError):
        export.export_ctranslate2(run, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export stays
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(model_spec.ModelSpec, "save", save)
    export.export_ctranslate2(run, out, force=True)
    assert export.read_stamp(out)["quantization"] == "float32"  # replaced
    assert leftovers(tmp_path) == []


def test_an_export_stopped_by_sigterm_leaves_nothing(runs, tmp_path, monkeypatch):
    """SIGTERM (timeout, kill, a service manager) stops nmt export as Ctrl-C does: its
    temporary folder, a partial model.bin in it, is removed (SIGTERM killed the process and
    left it). The signal is sent from inside the export, once the converter has written."""
    import signal

    from nmt import cli

    real = export._converter

    def converter_then_sigterm(spec):
        made = real(spec)
        convert = made.convert

        def convert_then_signal(*args, **kwargs):
            convert(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)

        made.convert = convert_then_signal
        return made

    monkeypatch.setattr(export, "_converter", converter_then_sigterm)
    out = tmp_path / "m"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        cli.export(runs("pre-sinusoidal-tied"), "ctranslate2", out, None, False)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler is gone


def test_an_export_killed_midway_is_cleaned_up_by_the_next(runs, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.tmp-{dead.pid}-abc123"
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"half")
    mine = tmp_path / ".model.bak-2024-06"  # a user's folder, named alike: not the export's
    mine.mkdir()
    (mine / "notes").write_text("keep")
    export.export_ctranslate2(runs("pre-sinusoidal-tied"), tmp_path / "model")
    assert leftovers(tmp_path) == [mine.name] and (tmp_path / "model" / "model.bin").is_file()
    assert (mine / "notes").read_text() == "keep"


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("exports", "translations", ".lock"))
    return to


def test_the_engine_exports_once_and_again_when_the_checkpoint_changes(runs, sources, tmp_path):
    run = copy_run(runs("pre-sinusoidal-tied"), tmp_path / "run")
    opts = options(run, beam=1, nbest=1)
    first = open_engine([run], "ctranslate2", CPU)
    model_bin = RunDir(run).export_dir("ctranslate2-float32") / "model.bin"
    made = model_bin.stat()
    again = open_engine([run], "ctranslate2", CPU)
    assert (
        model_bin.stat().st_ino == made.st_ino and model_bin.stat().st_mtime_ns == made.st_mtime_ns
    )
    assert texts(again.translate(sources[:10], opts, 6000)) == texts(
        first.translate(sources[:10], opts, 6000)
    )
    # Training writes a new best.pt: another model (here: "Hund" wherever possible).
    best = RunDir(run).checkpoint("best")
    payload = checkpoint.load(best)
    tok = first.tokenizer
    dog = tok.encode_tgt(["Hund"])[0][-1]
    payload["model"]["output.bias"][dog] += 50.0
    checkpoint.save({k: v for k, v in payload.items() if k != "format"}, best)
    changed = open_engine([run], "ctranslate2", CPU)
    assert model_bin.stat().st_ino != made.st_ino
    assert export.read_stamp(model_bin.parent)["checkpoint"] == export.checkpoint_stamp(best)
    new = texts(changed.translate(sources[:10], opts, 6000))
    assert new == texts(nmt_engine(run).translate(sources[:10], opts, 6000))
    assert new != texts(first.translate(sources[:10], opts, 6000))
    assert leftovers(model_bin.parent.parent) == []


# -- the command line -------------------------------------------------------------------------


def nmt_cli(
    *args, stdin: str = "", env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nmt", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400", **(env or {})},
        timeout=600,
        cwd=cwd,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr == lines[0] + "\n", result.stderr
    return lines[0]


def test_cli_translate_with_ctranslate2_gives_nmts_translations(runs, sources, tmp_path):
    """From the command line, greedy with scores, and beam 4 with plain normalisation and
    2-best lists: nmt's own translations (its Python API, fp32) and n-best lists as long. Two
    processes exporting the run at once (its first use) both succeed and leave one export."""
    run = copy_run(runs("pre-sinusoidal-tied"), tmp_path / "run")
    lines = sources[:12]
    stdin = "\n".join(lines) + "\n"
    greedy = ("translate", run, "--beam", "1", "--scores", "--engine", "ctranslate2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "nmt", *map(str, greedy)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(2)
    ]
    outs = [p.communicate(stdin, timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ours = nmt_engine(run).translate(lines, options(run, beam=1, nbest=1), 6000)
    for out, _ in outs:
        rows = [row.rsplit("\t", 1) for row in out.splitlines()]
        assert [text for text, _ in rows] == texts(ours)
        for (_, score), nbest in zip(rows, ours):
            assert float(score) == pytest.approx(nbest[0][1].score, abs=0.02)
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["ctranslate2-float32"]
    beam = ("translate", run, "--beam", "4", "--nbest", "2", "--length-norm", "plain")
    result = nmt_cli(*beam, "--engine", "ctranslate2", stdin=stdin)
    assert result.returncode == 0, result.stderr
    rows = [row.split(" ||| ") for row in result.stdout.splitlines()]
    assert [int(i) for i, _, _ in rows] == [i for i in range(len(lines)) for _ in range(2)]
    opts = options(run, beam=4, nbest=2, length_norm="plain")
    assert [text for _, text, _ in rows[::2]] == texts(nmt_engine(run).translate(lines, opts, 6000))


def test_cli_evaluate_with_ctranslate2_scores_nmts_translations(runs, tmp_path):
    """`nmt evaluate RUN --split S --engine ctranslate2`: nmt's translations (its Python API,
    fp32), written where nmt's evaluate writes them, and their scores."""
    from nmt.evaluate import translate_split

    run = copy_run(runs("pre-sinusoidal-tied"), tmp_path / "run")
    args = ("evaluate", run, "--split", "test_2016_flickr", "--beam", "1", "--json")
    result = nmt_cli(*args, "--engine", "ctranslate2", "--quantization", "float32")
    assert result.returncode == 0, result.stderr
    written = RunDir(run).translation_file("test_2016_flickr", "de").read_text()
    ours = translate_split([run], "test_2016_flickr", 1, "fp32", CPU)
    assert written == "".join(h + "\n" for h in ours.hyps) and len(ours.hyps) == 1000
    from nmt.metrics import score

    assert json.loads(result.stdout)["bleu"] == score(ours.hyps, [ours.refs], "de")["bleu"]


def test_cli_refusals_are_one_line(runs, tmp_path):
    pre = runs("pre-sinusoidal-tied")
    rnn, _ = tiny_run("seq2seq", 40)
    line = one_line_error(
        nmt_cli("export", rnn, "--format", "ctranslate2", "--out", tmp_path / "x")
    )
    assert "model.arch=seq2seq" in line and "transformer" in line
    with pytest.raises(NMTError, match="model.arch=seq2seq"):
        export.export_hf(rnn, tmp_path / "y")
    existing = tmp_path / "existing"
    existing.mkdir()
    line = one_line_error(nmt_cli("export", pre, "--format", "ctranslate2", "--out", existing))
    assert "--force" in line and list(existing.iterdir()) == []
    # --force replaces an earlier export, never another folder: the run itself, its parent
    copy = shutil.copytree(pre, tmp_path / "copy")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    for out in (copy, tmp_path, existing):
        args = ("export", copy, "--format", "ctranslate2", "--out", out, "--force")
        assert "is not an nmt export" in one_line_error(nmt_cli(*args))
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    # an --out under a file: said before the export, not as "File exists" after it
    under = copy / "config.yaml" / "x"
    line = one_line_error(nmt_cli("export", pre, "--format", "ctranslate2", "--out", under))
    assert f"{copy / 'config.yaml'} is a file, not a folder" in line
    # "--out ." in an earlier export replaces it (it staged inside it, then failed: "busy")
    made = tmp_path / "made"
    export.export_ctranslate2(pre, made)
    args = ("export", pre, "--format", "ctranslate2", "--out", ".", "--force")
    assert nmt_cli(*args, cwd=made).returncode == 0 and export.read_stamp(made) is not None
    with pytest.raises(NMTError, match="int8_float32"):
        export.export_ctranslate2(pre, tmp_path / "q", "int3")
    stdin = "A dog.\n"
    open_engine([pre], "ctranslate2", CPU)  # exported once (its log line is not the error)
    line = one_line_error(
        nmt_cli("translate", pre, "--engine", "ctranslate2", "--beam", "3", stdin=stdin)
    )
    assert "--length-norm plain or --length-penalty 0" in line
    broken = copy_run(pre, tmp_path / "broken")
    for ckpt in (broken / "checkpoints").glob("*.pt"):
        ckpt.write_bytes(ckpt.read_bytes()[:1000])
    line = one_line_error(nmt_cli("export", broken, "--format", "hf", "--out", tmp_path / "c"))
    assert "cannot read checkpoint" in line
    assert not (tmp_path / "c").exists() and leftovers(tmp_path) == []


def test_without_the_export_extra_nmt_says_what_to_install(runs, tmp_path, monkeypatch):
    """ctranslate2 and transformers made unimportable (sys.modules entries of None): one line
    naming the pip install, from the command line and from the library."""
    run = runs("pre-sinusoidal-tied")
    code = (
        "import sys; sys.modules['ctranslate2'] = None; "
        f"sys.argv = ['nmt', 'export', {str(run)!r}, '--format', 'ctranslate2', '--out', "
        f"{str(tmp_path / 'x')!r}]; from nmt.cli import main; main()"
    )
    line = one_line_error(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    )
    assert "pip install 'ctranslate2>=" in line and ".[export]" in line
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(NMTError, match=r"pip install 'transformers>=.*\.\[export\]"):
        export.export_hf(runs("marian"), tmp_path / "y")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    with pytest.raises(NMTError, match=r"--engine ctranslate2 needs .*pip install 'ctranslate2>="):
        open_engine([run], "ctranslate2", CPU)
    assert list(tmp_path.iterdir()) == []


def test_decoding_with_nmt_imports_neither_runtime():
    """The export packages load only for an export or --engine ctranslate2."""
    code = (
        "import sys, nmt.cli, nmt.engine, nmt.evaluate, nmt.translate; "
        "print(sorted(m for m in ('ctranslate2', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
