"""The README's SAE section runs as written (eager, the shipped model and SAE), and says what it does."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import torch

from interp_engine import Features

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    return text[text.index("## SAEs, transcoders and probes") : text.index("## CLI reference")]


def test_the_sae_examples_run_and_print_what_the_readme_shows() -> None:
    section = _section()
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    printed = out.getvalue().splitlines()
    assert printed[0] == "Sae(topk, resid_post.2, d_in=128, d_sae=1024, k=16)"
    shown = [line.removeprefix("# ") for line in blocks[1].splitlines() if line.startswith("# ")]
    assert printed[1:] == shown
    top = namespace["top"]
    ids = re.search(r"top\.ids\[0, 3\]\.tolist\(\)\s+# (\[.*?\])", blocks[0])
    assert ids is not None and str(top.ids[0, 3].tolist()) == ids.group(1)  # type: ignore[attr-defined]
    values = re.search(r"top\.values\[0, 3\]\s+# tensor\((\[.*?\])\)", blocks[0])
    assert values is not None
    torch.testing.assert_close(top.values[0, 3], torch.tensor(eval(values.group(1))), atol=1e-3, rtol=0)  # type: ignore[attr-defined]
    steered = namespace["steered"]
    readback = float(steered[Features("res", ids=[813])].values[3, 0])  # type: ignore[index]
    said = re.search(r"reads back\s+(\d+\.\d) instead of (\d+\.\d)", section)
    assert said is not None and f"{readback:.1f}" == said.group(1)
    assert f"{float(top.values[0, 3, 0]):.1f}" == said.group(2)  # type: ignore[attr-defined]
