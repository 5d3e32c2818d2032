"""Scoring: the paired bootstrap's p-values mean what they say."""

from __future__ import annotations

import gzip

import pytest

from nmt.metrics import paired_bootstrap


@pytest.fixture(scope="module")
def refs(multi30k_dir) -> list[str]:
    with gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:300]


def test_paired_bootstrap_p_values(refs):
    """Against a good system: a clearly worse one is significantly worse (p < 0.05 for BLEU
    and chrF); identical translations are not different at all (p = 1); a system that drops
    one word in one sentence of 300 is not significantly different."""
    good = [" ".join(r.split()[:-1]) if i % 3 == 0 else r for i, r in enumerate(refs)]
    worse = [" ".join(r.split()[:2]) for r in refs]
    near = [*good[:-1], " ".join(good[-1].split()[1:])]
    base, systems = paired_bootstrap(
        good, {"worse": worse, "same": list(good), "near": near}, [refs], 300, "de"
    )
    assert base["bleu"]["p_value"] is None
    for metric in ("bleu", "chrf"):
        assert systems["worse"][metric]["p_value"] < 0.05
        assert systems["same"][metric]["p_value"] == 1.0
        assert systems["near"][metric]["p_value"] > 0.05
        assert systems["worse"][metric]["ci_high"] < base[metric]["ci_low"]
