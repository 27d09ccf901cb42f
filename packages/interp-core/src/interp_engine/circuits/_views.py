# ruff: noqa: E501  (the page's script keeps its lines whole)
"""Views of an attribution graph: a self-contained HTML page and a static matplotlib figure.

Both lay the graph out the same way: token positions left to right, embeddings at the bottom,
then one row per layer (features as circles, error nodes as squares), logits at the top; edges
blue where positive and red where negative, their width and opacity growing with |weight|.
The HTML page carries the graph's JSON (:meth:`AttributionGraph.to_dict`) and a small script
that draws it as SVG; clicking a node lists its incoming and outgoing edges and highlights them.
It loads nothing from the network.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._graph import AttributionGraph

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font-family: system-ui, sans-serif; margin: 0; display: flex; height: 100vh; }
#graph { flex: 3; overflow: auto; border-right: 1px solid #ccc; }
#details { flex: 1; padding: 12px; overflow: auto; font-size: 13px; }
#details h2 { font-size: 15px; margin: 4px 0 8px; }
#details li { margin: 2px 0; font-family: monospace; }
.node { cursor: pointer; stroke: #333; stroke-width: 0.8; }
.node.selected { stroke: #000; stroke-width: 3; }
.edge { fill: none; }
.edge.dim { opacity: 0.06 !important; }
.token { font-size: 11px; fill: #333; }
.row-label { font-size: 10px; fill: #777; }
</style>
</head>
<body>
<div id="graph"></div>
<div id="details"><h2>__TITLE__</h2><p>Click a node to list its edges.</p></div>
<script id="graph-data" type="application/json">__DATA__</script>
<script>
(function () {
  const data = JSON.parse(document.getElementById("graph-data").textContent);
  const nodes = data.nodes, links = data.links;
  const nLayers = Math.max(0, ...nodes.filter(n => n.feature_type === "logit").map(n => parseInt(n.layer) - 1));
  const nPos = data.metadata.prompt_tokens.length;
  const rowOf = n => n.feature_type === "embedding" ? 0 : (n.feature_type === "logit" ? nLayers + 1 : parseInt(n.layer) + 1);
  const cellW = 110, rowH = 70, left = 60, top = 30;
  const cells = {};
  nodes.forEach(n => { const key = rowOf(n) + ":" + n.ctx_idx; (cells[key] = cells[key] || []).push(n); });
  const pos = {};
  Object.values(cells).forEach(group => group.forEach((n, i) => {
    const spread = Math.min(cellW - 20, 14 * group.length);
    const x = left + n.ctx_idx * cellW + cellW / 2 - spread / 2 + (group.length > 1 ? spread * i / (group.length - 1) : spread / 2);
    const y = top + (nLayers + 1 - rowOf(n)) * rowH + 20;
    pos[n.node_id] = [x, y];
  }));
  const width = left + nPos * cellW + 20, height = top + (nLayers + 2) * rowH + 40;
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", width); svg.setAttribute("height", height); svg.setAttribute("id", "graph-svg");
  document.getElementById("graph").appendChild(svg);
  const maxW = Math.max(1e-12, ...links.map(l => Math.abs(l.weight)));
  for (let r = 0; r <= nLayers + 1; r++) {
    const t = document.createElementNS(NS, "text");
    t.setAttribute("x", 4); t.setAttribute("y", top + (nLayers + 1 - r) * rowH + 24);
    t.setAttribute("class", "row-label");
    t.textContent = r === 0 ? "emb" : (r === nLayers + 1 ? "logits" : "L" + (r - 1));
    svg.appendChild(t);
  }
  const edgeEls = links.map(l => {
    const a = pos[l.source], b = pos[l.target];
    const p = document.createElementNS(NS, "path");
    const midY = (a[1] + b[1]) / 2;
    p.setAttribute("d", `M${a[0]},${a[1]} C${a[0]},${midY} ${b[0]},${midY} ${b[0]},${b[1]}`);
    const s = Math.abs(l.weight) / maxW;
    p.setAttribute("class", "edge");
    p.setAttribute("stroke", l.weight >= 0 ? "#1f5fbf" : "#c0392b");
    p.setAttribute("stroke-width", (0.3 + 3 * s).toFixed(2));
    p.style.opacity = (0.15 + 0.75 * s).toFixed(2);
    p.dataset.source = l.source; p.dataset.target = l.target;
    svg.appendChild(p);
    return p;
  });
  const colors = {"cross layer transcoder": "#f5c542", "mlp reconstruction error": "#aaaaaa", "embedding": "#8fd18f", "logit": "#b48ee0"};
  const byId = {};
  nodes.forEach(n => {
    const [x, y] = pos[n.node_id];
    let el;
    if (n.feature_type === "mlp reconstruction error") {
      el = document.createElementNS(NS, "rect");
      el.setAttribute("x", x - 5); el.setAttribute("y", y - 5); el.setAttribute("width", 10); el.setAttribute("height", 10);
    } else {
      el = document.createElementNS(NS, "circle");
      el.setAttribute("cx", x); el.setAttribute("cy", y); el.setAttribute("r", n.feature_type === "cross layer transcoder" ? 6 : 8);
    }
    el.setAttribute("class", "node");
    el.setAttribute("fill", colors[n.feature_type] || "#ddd");
    el.dataset.nodeId = n.node_id;
    const title = document.createElementNS(NS, "title");
    title.textContent = describe(n);
    el.appendChild(title);
    el.addEventListener("click", () => select(n.node_id));
    svg.appendChild(el);
    byId[n.node_id] = [n, el];
  });
  data.metadata.prompt_tokens.forEach((tok, i) => {
    const t = document.createElementNS(NS, "text");
    t.setAttribute("x", left + i * cellW + cellW / 2); t.setAttribute("y", height - 10);
    t.setAttribute("text-anchor", "middle");
    t.setAttribute("class", "token");
    t.textContent = JSON.stringify(tok);
    svg.appendChild(t);
  });
  function describe(n) {
    if (n.feature_type === "cross layer transcoder") return `feature ${n.feature} @ L${n.layer}, pos ${n.ctx_idx} (act ${Number(n.activation).toPrecision(3)})`;
    if (n.feature_type === "mlp reconstruction error") return `error @ L${n.layer}, pos ${n.ctx_idx}`;
    if (n.feature_type === "embedding") return `embedding ${JSON.stringify(data.metadata.prompt_tokens[n.ctx_idx])} @ pos ${n.ctx_idx}`;
    return n.clerp;
  }
  function select(id) {
    Object.values(byId).forEach(([, el]) => el.classList.remove("selected"));
    byId[id][1].classList.add("selected");
    const incoming = links.filter(l => l.target === id).sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight));
    const outgoing = links.filter(l => l.source === id).sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight));
    edgeEls.forEach(p => p.classList.toggle("dim", p.dataset.source !== id && p.dataset.target !== id));
    const item = (other, w) => `<li data-edge="${other}">${w >= 0 ? "+" : ""}${w.toPrecision(3)} &nbsp;${escape(describe(byId[other][0]))}</li>`;
    document.getElementById("details").innerHTML =
      `<h2 id="selected-node">${escape(describe(byId[id][0]))}</h2>` +
      `<h3>incoming (${incoming.length})</h3><ul id="incoming">${incoming.map(l => item(l.source, l.weight)).join("")}</ul>` +
      `<h3>outgoing (${outgoing.length})</h3><ul id="outgoing">${outgoing.map(l => item(l.target, l.weight)).join("")}</ul>`;
  }
  function escape(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }
})();
</script>
</body>
</html>
"""


def graph_html(data: dict[str, Any], *, title: str) -> str:
    """The page for ``data`` (an :meth:`AttributionGraph.to_dict`)."""
    payload = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the data block
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", payload)


def plot_graph(graph: AttributionGraph, *, ax: Any = None, max_edges: int = 200) -> Any:
    """The graph on matplotlib axes (new ones if ``ax`` is None); returns the axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is the plots extra
        raise ImportError("AttributionGraph.plot needs matplotlib: pip install 'interp-core[plots]'") from exc
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(graph.tokens)), 1.1 * (graph.n_layers + 3)))
    rows: dict[tuple[int, int], list[int]] = {}

    def row_of(i: int) -> int:
        n = graph.nodes[i]
        return 0 if n.kind == "embedding" else (graph.n_layers + 1 if n.kind == "logit" else int(n.layer or 0) + 1)

    for n in graph.nodes:
        rows.setdefault((row_of(n.index), n.position), []).append(n.index)
    xy: dict[int, tuple[float, float]] = {}
    for (row, position), members in rows.items():
        for j, i in enumerate(members):
            offset = 0.0 if len(members) == 1 else -0.35 + 0.7 * j / (len(members) - 1)
            xy[i] = (position + offset, float(row))
    a = graph.adjacency * graph.edge_mask if graph.edge_mask is not None else graph.adjacency
    targets, sources = a.nonzero(as_tuple=True)
    weights = a[targets, sources]
    if weights.numel():
        top = weights.abs().argsort(descending=True)[:max_edges]
        biggest = float(weights.abs().max())
        for k in top.tolist():
            s, t, w = int(sources[k]), int(targets[k]), float(weights[k])
            (x0, y0), (x1, y1) = xy[s], xy[t]
            share = abs(w) / biggest
            ax.plot(
                [x0, x1],
                [y0, y1],
                color="#1f5fbf" if w >= 0 else "#c0392b",
                lw=0.3 + 2.5 * share,
                alpha=0.2 + 0.7 * share,
                zorder=1,
            )
    style = {
        "feature": ("o", "#f5c542"),
        "error": ("s", "#aaaaaa"),
        "embedding": ("o", "#8fd18f"),
        "logit": ("D", "#b48ee0"),
    }
    for kind, (marker, color) in style.items():
        members = [n.index for n in graph.nodes if n.kind == kind]
        if members:
            ax.scatter(
                [xy[i][0] for i in members],
                [xy[i][1] for i in members],
                marker=marker,
                c=color,
                edgecolors="#333",
                s=40,
                zorder=2,
                label=kind,
            )
    for n in graph.nodes_of("logit"):
        ax.annotate(repr(n.label), xy[n.index], textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xticks(range(len(graph.tokens)))
    ax.set_xticklabels([repr(s) for s in graph.token_strings], rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(graph.n_layers + 2))
    ax.set_yticklabels(["emb", *[f"L{i}" for i in range(graph.n_layers)], "logits"], fontsize=8)
    ax.legend(loc="upper left", fontsize=7, frameon=False)
    ax.set_title("attribution graph: " + "".join(graph.token_strings), fontsize=9)
    return ax
