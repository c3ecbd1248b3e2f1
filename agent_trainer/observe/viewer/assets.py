"""The viewer page's inline style and script.

The script builds the page with ``textContent`` only: replies and observations are model
output and env text, never parsed as HTML.
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0; color: #222; }
header { padding: 8px 16px; background: #f3f3f3; border-bottom: 1px solid #ccc; }
header h1 { font-size: 18px; margin: 0 0 6px 0; }
#filters label { margin-right: 14px; font-size: 14px; }
main { display: flex; }
nav { width: 250px; max-height: calc(100vh - 80px); overflow-y: auto; border-right: 1px solid #ddd; }
nav button { display: block; width: 100%; text-align: left; border: 0; border-bottom: 1px solid #eee;
  background: white; padding: 5px 8px; font-size: 13px; cursor: pointer; }
nav button.current { background: #dde8ff; }
nav .ok { color: #137333; } nav .fail { color: #b3261e; }
section { flex: 1; padding: 8px 16px; max-height: calc(100vh - 80px); overflow-y: auto; }
.summary { font-size: 15px; margin-bottom: 8px; }
.turn { border: 1px solid #ccc; border-radius: 6px; margin: 8px 0; padding: 6px 10px; }
.turn h3 { font-size: 15px; margin: 2px 0 6px 0; }
.grid { font-family: monospace; font-size: 15px; line-height: 1.1; background: #fafafa; padding: 4px 8px;
  display: inline-block; margin: 2px 0; border: 1px solid #e5e5e5; }
.tokens { font-family: monospace; font-size: 12px; white-space: pre-wrap; word-break: break-all;
  border-top: 1px dashed #ddd; margin-top: 6px; padding-top: 4px; }
.tok.prompt { color: #888; }
.tok.gen { border-bottom: 2px solid #333; color: #000; }
.legend { font-size: 12px; color: #555; }
.reward { font-weight: bold; }
.metrics { font-size: 13px; color: #444; margin-bottom: 6px; }
.judge-text { white-space: pre-wrap; font-size: 12px; background: #fafafa; padding: 4px 8px; }
.tool-call { white-space: pre-wrap; font-size: 12px; background: #eef4fb; padding: 4px 8px; }
"""

SCRIPT = r"""
(function () {
  const records = JSON.parse(document.getElementById("trajectory-data").textContent);
  const state = {split: "", tag: "", step: "", outcome: "", index: 0};
  const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text; return e; };
  const uniq = (key) => Array.from(new Set(records.map(r => String(r[key])))).sort((a, b) =>
    isNaN(a) || isNaN(b) ? a.localeCompare(b) : Number(a) - Number(b));

  function select(name, key, values) {
    const label = el("label", "", name + " ");
    const s = el("select"); s.id = "filter-" + key;
    s.appendChild(new Option("all", ""));
    values.forEach(v => s.appendChild(new Option(v, v)));
    s.onchange = () => { state[key] = s.value; state.index = 0; render(); };
    label.appendChild(s); return label;
  }
  const filters = document.getElementById("filters");
  filters.appendChild(select("split", "split", uniq("split")));
  filters.appendChild(select("env tag", "tag", uniq("tag")));
  filters.appendChild(select("step", "step", uniq("step")));
  filters.appendChild(select("outcome", "outcome", ["success", "failure"]));
  const prev = el("button", "", "\u25c0 previous"), next = el("button", "", "next \u25b6");
  prev.onclick = () => { state.index = Math.max(0, state.index - 1); render(); };
  next.onclick = () => { state.index += 1; render(); };
  filters.appendChild(prev); filters.appendChild(next);

  function shown() {
    return records.filter(r => (!state.split || r.split === state.split) && (!state.tag || r.tag === state.tag)
      && (!state.step || String(r.step) === state.step)
      && (!state.outcome || (state.outcome === "success") === r.success));
  }
  function advColour(a, scale) {
    const x = Math.min(1, Math.abs(a) / scale), alpha = (0.15 + 0.6 * x).toFixed(2);
    return a >= 0 ? "rgba(30,160,60," + alpha + ")" : "rgba(210,40,40," + alpha + ")";
  }
  function tokens(turn) {
    const box = el("div", "tokens");
    const gen = turn.advantage.filter((a, i) => turn.mask[i]);
    const scale = Math.max(1e-6, ...gen.map(Math.abs));
    turn.tokens.forEach((t, i) => {
      const span = el("span", "tok " + (turn.mask[i] ? "gen" : "prompt"), t);
      span.dataset.mask = turn.mask[i];
      if (turn.mask[i]) {
        const a = turn.advantage.length ? turn.advantage[i] : null;
        span.title = "id " + turn.token_ids[i] + (a === null ? ", no advantage (evaluation, or filtered out before training)" : ", advantage " + a);
        if (a !== null) { span.style.background = advColour(a, scale); span.dataset.advantage = a; }
      } else { span.title = "id " + turn.token_ids[i] + ", prompt/observation (mask 0)"; }
      box.appendChild(span);
    });
    return box;
  }
  function judgeCard(j) {
    const card = el("div", "turn judge");
    card.appendChild(el("h3", "", "Judge (" + j.mode + ") \u00b7 " + (j.score === null ? "unscored: " + j.error
      : "score " + j.score) + " \u00b7 trajectory " + j.position + (j.cached ? " \u00b7 from the cache" : "")
      + (j.call_id ? " \u00b7 call " + j.call_id : "") + " \u00b7 " + j.seconds.toFixed(2) + " s"));
    const call = el("details");
    call.appendChild(el("summary", "", "the request (" + j.messages.length + " messages) and the reply"));
    j.messages.forEach(m => call.appendChild(el("pre", "judge-text", m.role + ":\n" + m.content)));
    call.appendChild(el("pre", "judge-text", "reply:\n" + j.reply));
    card.appendChild(call);
    return card;
  }
  function episode(r) {
    const box = document.getElementById("episode"); box.replaceChildren();
    box.appendChild(el("div", "summary", r.split + " step " + r.step + " \u00b7 " + r.tag + " \u00b7 env " + r.env_id
      + " (group " + r.group_id + ") \u00b7 " + (r.success ? "success" : "failure")
      + " \u00b7 total reward " + r.total_reward.toFixed(3) + (r.error ? " \u00b7 error: " + r.error : "")
      + (r.judge ? " \u00b7 judge: " + (r.judge.score === null ? "unscored" : "score " + r.judge.score) : "")));
    const metrics = Object.entries(r.metrics || {});
    if (metrics.length) box.appendChild(el("div", "metrics", metrics.map(([k, v]) => k + " " + v).join(" \u00b7 ")));
    box.appendChild(el("div", "legend", "generated tokens are underlined, green = positive advantage, "
      + "red = negative (darker = larger); grey = prompt and observations (mask 0); hover a token for its id"));
    r.turns.forEach(t => {
      const card = el("div", "turn");
      // a gateway agent's calls and env steps need not pair one to one: name both when they do not
      const paired = !(t.call || t.step) || (t.call === t.turn && t.step === t.turn);
      const h = el("h3", "", "Turn " + t.turn + (paired ? "" : " (" + (t.call ? "call " + t.call : "no call")
        + ", " + (t.step ? "env step " + t.step : "no env step") + ")") + " \u00b7 ");
      h.appendChild(el("span", "reward", "reward " + t.reward.toFixed(3)));
      h.appendChild(document.createTextNode((t.done ? " \u00b7 done" : "") + " \u00b7 actions: "
        + (t.actions.length ? t.actions.join(", ") : "(none)")));
      card.appendChild(h);
      card.appendChild(el("div", "", "observation:"));
      card.appendChild(el("pre", "grid", t.observation));
      card.appendChild(el("div", "", "reply: " + t.reply));
      (t.tool_calls || []).forEach(c => card.appendChild(el("pre", "tool-call", "tool " + c.server + "." + c.name
        + "(" + JSON.stringify(c.arguments) + ") \u00b7 " + Number(c.latency_s).toFixed(3) + " s"
        + (c.service_failure ? " \u00b7 server failed" : "") + "\n"
        + (c.error ? "error: " + c.error : "result: " + c.result))));
      if (t.tokens.length) card.appendChild(tokens(t));
      box.appendChild(card);
    });
    if (r.judge) box.appendChild(judgeCard(r.judge));
    const last = el("div", "turn");
    last.appendChild(el("h3", "", "Final observation"));
    last.appendChild(el("pre", "grid", r.final_observation));
    box.appendChild(last);
  }
  function render() {
    const list = shown(), nav = document.getElementById("episodes"); nav.replaceChildren();
    if (!list.length) { document.getElementById("episode").replaceChildren(el("p", "", "no episode matches")); return; }
    state.index = Math.min(state.index, list.length - 1);
    list.forEach((r, i) => {
      const b = el("button", i === state.index ? "current" : "");
      b.appendChild(el("span", r.success ? "ok" : "fail", r.success ? "\u2714 " : "\u2718 "));
      b.appendChild(document.createTextNode(r.split + " " + r.step + " \u00b7 " + r.tag + " #" + r.env_id
        + " \u00b7 " + r.total_reward.toFixed(2)));
      b.onclick = () => { state.index = i; render(); };
      nav.appendChild(b);
    });
    episode(list[state.index]);
  }
  // a link may preselect filters: viewer.html#tag=FrozenLake3x3&step=10&outcome=failure&index=1
  new URLSearchParams(location.hash.slice(1)).forEach((value, key) => {
    const s = document.getElementById("filter-" + key);
    if (s) { s.value = value; state[key] = s.value; } else if (key === "index") { state.index = Number(value) || 0; }
  });
  render();
})();
"""
