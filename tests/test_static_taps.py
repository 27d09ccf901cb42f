"""The tensor-only taps and writes of vllm-static, on an HF model under torch.compile.

They must give the eager numbers (captures equal HF, steering equal the eager backend), leave
unsteered tokens bit for bit alone, and never recompile when only the tables change.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write, sync_model
from interp_vllm._static import StaticTap, StaticWrites

from .conftest import PROMPT, eager_model, hf_for, rel_diff, tiny_model_path

MAX_TOKENS = 64


class _Tapped:
    """A fresh HF llama with a tap and a write table on layer 1's output, compiled."""

    def __init__(self) -> None:
        self.hf = (
            type(hf_for(tiny_model_path("llama")))
            .from_pretrained(tiny_model_path("llama"), attn_implementation="eager")
            .eval()
        )
        d_model = self.hf.config.hidden_size
        self.tap = StaticTap(MAX_TOKENS, d_model, dtype=torch.float32, device="cpu")
        self.writes = StaticWrites(8, d_model, MAX_TOKENS, dtype=torch.float32, device="cpu")

        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            return self.tap(self.writes(output))

        self.hf.model.layers[1].register_forward_hook(hook)
        self.graphs = 0

        def counting_backend(gm: Any, example_inputs: Any) -> Any:
            self.graphs += 1
            return gm.forward

        torch._dynamo.reset()
        self.compiled = torch.compile(self.hf, backend=counting_backend, dynamic=True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.compiled(torch.tensor([ids]), use_cache=False).logits[0]


@pytest.fixture(scope="module")
def tapped() -> _Tapped:
    return _Tapped()


def _ids(text: str = PROMPT) -> list[int]:
    ids: list[int] = eager_model("llama").to_tokens(text)[0].tolist()
    return ids


def test_the_tap_captures_what_hf_computes(tapped: _Tapped) -> None:
    tapped.writes.clear()
    ids = _ids()
    tapped.logits(ids)
    with torch.no_grad():
        hidden = hf_for(tiny_model_path("llama"))(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert rel_diff(tapped.tap.read(0, len(ids)), hidden[2][0]) <= 1e-5


@pytest.mark.parametrize(
    "write",
    [
        Write("resid_post.1", torch.randn(64, generator=torch.Generator().manual_seed(1)), op="add", scale=3.0),
        Write("resid_post.1", torch.randn(64, generator=torch.Generator().manual_seed(2)), op="ablate"),
        Write(
            "resid_post.1",
            torch.randn(3, 64, generator=torch.Generator().manual_seed(3)),
            op="set",
            positions=[1, 4, 6],
        ),
    ],
    ids=["add", "ablate", "set"],
)
def test_table_writes_equal_the_eager_backend(tapped: _Tapped, write: Write) -> None:
    ids = _ids()
    positions = list(range(len(ids))) if write.positions == "all" else list(write.positions)
    tapped.writes.clear()
    rows = torch.tensor(positions)
    tapped.writes.assign(write, rows, torch.arange(len(positions)) if write.vector.dim() == 2 else None)
    got = tapped.logits(ids)
    oracle = sync_model(eager_model("llama")).capture(ids, [Address("logits")], steering_spec=SteeringSpec([write]))
    assert rel_diff(got, oracle[Address("logits")]) <= 1e-4


def test_unsteered_tokens_are_bit_identical(tapped: _Tapped) -> None:
    ids = _ids()
    tapped.writes.clear()
    plain = tapped.logits(ids)
    plain_capture = tapped.tap.read(0, len(ids))
    # steer only the last token: every earlier row of layer 1 is untouched, bit for bit
    tapped.writes.assign(Write("resid_post.1", torch.ones(64), op="add"), torch.tensor([len(ids) - 1]))
    tapped.logits(ids)
    steered_capture = tapped.tap.read(0, len(ids))
    assert torch.equal(steered_capture[:-1], plain_capture[:-1])
    assert not torch.equal(steered_capture[-1], plain_capture[-1])
    tapped.writes.clear()
    assert torch.equal(tapped.logits(ids), plain)


def test_changing_tables_and_lengths_never_recompiles(tapped: _Tapped) -> None:
    tapped.writes.clear()
    tapped.logits(_ids("Hello there friend"))
    before = tapped.graphs
    assert before >= 1  # the forward really went through the compiler, taps included
    gen = torch.Generator().manual_seed(9)
    for i, text in enumerate(["A cat sat on the mat", PROMPT, "Once upon a time", "Hello"] * 5):
        ids = _ids(text)
        tapped.writes.clear()
        op = ("add", "set", "ablate")[i % 3]
        tapped.writes.assign(Write("resid_post.1", torch.randn(64, generator=gen), op=op), torch.arange(len(ids)))
        tapped.logits(ids)
    assert tapped.graphs == before
