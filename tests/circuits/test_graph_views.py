"""The graph's views: the self-contained HTML page in a real headless browser (Debian's
Chromium driven by Playwright: it loads from a file with the network refused, draws every node,
and a click lists that node's edges), and the static matplotlib figure."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from interp_engine.circuits import AttributionGraph

from ..support.browser import chromium


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-profile"), width=1400) as context:
        tab = context.new_page()
        requests: list[str] = []
        tab.on("request", lambda r: requests.append(r.url))
        tab.requests = requests
        yield tab


def test_the_html_view_draws_the_graph_and_lists_a_nodes_edges(
    page: Any, plt_graph: AttributionGraph, tmp_path: pathlib.Path
) -> None:
    graph = plt_graph.prune(0.7, 0.95)
    path = tmp_path / "graph.html"
    graph.to_html(str(path))
    data = graph.to_dict()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("#graph-svg")
    assert errors == []
    assert [u for u in page.requests if not u.startswith("file:")] == []  # nothing from the network
    assert page.locator(".node").count() == len(data["nodes"])
    assert page.locator("path.edge").count() == len(data["links"])
    drawn = set(page.eval_on_selector_all(".node", "els => els.map(e => e.dataset.nodeId)"))
    assert drawn == {n["node_id"] for n in data["nodes"]}

    target = next(n for n in data["nodes"] if n["is_target_logit"])
    page.click(f'[data-node-id="{target["node_id"]}"]')
    incoming = [link for link in data["links"] if link["target"] == target["node_id"]]
    assert page.locator("#selected-node").inner_text().startswith('Output " Paris"')
    assert page.locator("#incoming li").count() == len(incoming) > 0
    assert page.locator("#outgoing li").count() == 0
    listed = page.eval_on_selector_all("#incoming li", "els => els.map(e => e.dataset.edge)")
    strongest = sorted(incoming, key=lambda link: -abs(link["weight"]))
    assert listed == [link["source"] for link in strongest]
    lit = page.eval_on_selector_all("path.edge:not(.dim)", "els => els.map(e => e.dataset.target)")
    assert lit and set(lit) == {target["node_id"]}

    feature = next(n for n in data["nodes"] if n["feature_type"] == "cross layer transcoder")
    page.click(f'[data-node-id="{feature["node_id"]}"]')
    out = [link for link in data["links"] if link["source"] == feature["node_id"]]
    assert page.locator("#outgoing li").count() == len(out) > 0
    page.screenshot(path=str(tmp_path / "graph.png"))
    assert errors == []


def test_the_page_carries_its_data_and_escapes_it(plt_graph: AttributionGraph) -> None:
    page = plt_graph.prune(0.5, 0.9).to_html(title="<b>t</b>")
    start = page.index('<script id="graph-data" type="application/json">') + len(
        '<script id="graph-data" type="application/json">'
    )
    payload = page[start : page.index("</script>", start)]
    assert json.loads(payload.replace("<\\/", "</")) == plt_graph.prune(0.5, 0.9).to_dict()
    assert "<title>&lt;b&gt;t&lt;/b&gt;</title>" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_the_static_plot(plt_graph: AttributionGraph, tmp_path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    graph = plt_graph.prune(0.7, 0.95)
    ax = graph.plot(max_edges=50)
    assert len(ax.lines) == min(50, int(graph.edge_mask.sum()))  # type: ignore[union-attr]
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(graph.nodes)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["emb", "L0", "L1", "L2", "L3", "logits"]
    ax.figure.savefig(tmp_path / "graph.png")
    plt.close(ax.figure)
    pixels = matplotlib.image.imread(str(tmp_path / "graph.png"))
    assert float(pixels[..., :3].std()) > 0.02
