#!/usr/bin/env bash
# Quality benchmark: `nmt compare` on the three Multi30k en→de recipes with the same
# wall-clock training budget each, then sacreBLEU (default signature: detokenized, cased,
# 13a) on test_2016_flickr and test_2017_flickr against the targets
# transformer >= 35, rnn_attention >= 30, seq2seq >= 18 on test_2016_flickr.
#
#   NMT_DATA_DIR=../shared/data bash scripts/bench_quality.sh            # 30 minutes each
#   NMT_DATA_DIR=../shared/data bash scripts/bench_quality.sh 15 runs/q15 # budget, output dir
#   NMT_DATA_DIR=../shared/data bash scripts/bench_quality.sh 30 runs/q30 --ensemble --seeds 3
#     (further arguments go to nmt compare: ensembles, seeds, --lowercase --tokenize intl)
#
# It saturates every core for about 3 x BUDGET minutes plus decoding; a second invocation
# with the same settings reuses the finished runs and only re-evaluates.
set -euo pipefail
budget=${1:-30}
out=${2:-runs/bench_quality_${budget}min}
cd "$(dirname "$0")/.."
nmt compare recipes/multi30k/seq2seq.yaml recipes/multi30k/rnn_attention.yaml \
    recipes/multi30k/transformer.yaml --budget "$budget" --out "$out" "${@:3}"
python3 - "$out/report.json" "$budget" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
targets = {"transformer": 35.0, "rnn_attention": 30.0, "seq2seq": 18.0}
print(f"\nbudget: {sys.argv[2]} minutes per system")
print(f"{'system':<15}{'steps':>8}{'tok/s':>9}" + "".join(f"{s:>22}" for s in report["splits"]) + f"{'target':>10}  verdict")
for s in report["systems"]:
    bleu = s["test"]["test_2016_flickr"]["bleu"]["score"]
    target = targets.get(s["arch"]) if s["kind"] == "system" else None
    verdict = "" if target is None else ("met" if bleu >= target else f"missed by {target - bleu:.1f}")
    cells = "".join(
        f"{s['test'][sp]['bleu']['mean']:>8.2f} [{s['test'][sp]['bleu'].get('ci_low', s['test'][sp]['bleu']['min']):.1f},{s['test'][sp]['bleu'].get('ci_high', s['test'][sp]['bleu']['max']):.1f}]"
        for sp in report["splits"]
    )
    steps = "" if s["steps"] is None else f"{s['steps']:.0f}"
    speed = "" if s["train_tokens_per_s"] is None else f"{s['train_tokens_per_s']:.0f}"
    print(f"{s['name']:<15}{steps:>8}{speed:>9}{cells}{target or '':>10}  {verdict}")
PY
