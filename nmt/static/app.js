// The page of `nmt serve`: translate with POST /translate, draw the attention of the 1-best.
"use strict";

const $ = (id) => document.getElementById(id);
let models = {};

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function loadModels() {
  let answer;
  try {
    const ready = await fetch("/ready");
    if (!ready.ok) {
      $("status").textContent = (await ready.json()).error + "…";
      setTimeout(loadModels, 1000);
      return;
    }
    answer = await (await fetch("/models")).json();
  } catch (e) {  // no server yet (restarting): ask again
    $("status").textContent = "waiting for the server…";
    setTimeout(loadModels, 1000);
    return;
  }
  const select = $("model");
  select.replaceChildren();
  for (const m of answer.models) {
    models[m.name] = m;
    const option = el("option", null, `${m.name} (${m.arch}, ${m.src_lang}→${m.tgt_lang})`);
    option.value = m.name;
    select.appendChild(option);
  }
  select.value = answer.default;
  pickModel();
  $("status").textContent = `${answer.models.length} model(s) loaded`;
  $("translate").disabled = false;
}

function pickModel() {
  const m = models[$("model").value];
  if (m) $("beam").value = m.beam;
}

function showResult(answer, model, oneLine) {
  const out = $("output");
  out.replaceChildren();
  for (const t of answer.translations) {
    const block = el("div", "result");
    block.appendChild(el("p", "translation", t.text));
    if (t.score !== null && t.score !== undefined) {
      block.appendChild(el("p", "score", `score ${t.score.toFixed(4)}`));
    }
    if (t.nbest) {
      const list = el("ol", "nbest");
      for (const h of t.nbest) list.appendChild(el("li", null, `${h.text}  (${h.score.toFixed(4)})`));
      block.appendChild(list);
    }
    out.appendChild(block);
  }
  const heat = $("heatmap");
  heat.replaceChildren();
  const first = answer.translations[0];
  if (first && first.attention) {
    heat.appendChild(el("p", "muted", "Attention of the 1-best (rows: target pieces, columns: source pieces)"));
    const img = el("img");
    img.alt = "attention heatmap";
    img.src = first.attention;
    heat.appendChild(img);
  } else if (!model.attention) {
    heat.appendChild(el("p", "muted",
      `The ${model.arch} model has no attention (it reads the source through one fixed context vector): no heatmap.`));
  } else if (!oneLine) {
    heat.appendChild(el("p", "muted", "The attention heatmap is drawn for one sentence at a time."));
  }
}

// The server numbers the lines it was sent; the page sends the box's non-empty lines only:
// its messages name the box's line instead ("line 2" of what was sent: line 3 of the box).
function boxLines(error, numbers) {
  return error.replace(/\bline (\d+)\b/g, (m, n) => `line ${numbers[n - 1] ?? n}`);
}

async function translate(event) {
  event.preventDefault();
  $("error").textContent = "";
  $("output").replaceChildren();  // nothing of the last request stays beside this one's answer
  $("heatmap").replaceChildren();
  const box = $("source").value.split("\n").map((s) => s.trim());
  const numbers = box.map((s, i) => (s ? i + 1 : 0)).filter((n) => n);
  const lines = box.filter((s) => s);
  if (!lines.length) {
    $("error").textContent = "Type a sentence first.";
    return;
  }
  const model = models[$("model").value];
  const oneLine = lines.length === 1;
  const body = {
    text: oneLine ? lines[0] : lines,
    model: model.name,
    beam: Number($("beam").value),
    nbest: Number($("nbest").value),
    scores: true,
    attention: oneLine && model.attention,
  };
  const button = $("translate");
  button.disabled = true;
  button.textContent = "Translating…";
  try {
    const response = await fetch("/translate", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const answer = await response.json();
    if (!response.ok) {
      $("error").textContent = boxLines(answer.error, numbers);
      return;
    }
    showResult(answer, model, oneLine);
  } catch (e) {
    $("error").textContent = `The server did not answer: ${e}`;
  } finally {
    button.disabled = false;
    button.textContent = "Translate";
  }
}

$("model").addEventListener("change", pickModel);
$("form").addEventListener("submit", translate);
loadModels();
