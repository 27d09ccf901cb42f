"""interp_engine.harvest on the vllm backend (the session's shared gpt2 engine): the rows run as
concurrent captures, which vLLM batches; SAELens's cache and the safetensors shards hold what HF
transformers computes for those rows, and the two outputs hold the same values."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch

from interp_engine.harvest import harvest, open_harvest
from interp_testkit.suite import hf_for, rel_diff, vllm_model_path

TOL = 1e-4


def test_harvest_on_vllm_equals_hf(vllm_engines: Any, tmp_path: pathlib.Path) -> None:
    import datasets

    facade = vllm_engines("gpt2")
    gen = torch.Generator().manual_seed(3)
    vocab = facade.model.info.vocab_size
    docs = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (5, 40, 17, 60, 9, 33)]
    out = tmp_path / "out"
    summary = harvest(
        facade, docs, out, addresses=["resid_post.0", "resid_post.1"], context_size=24, batch_rows=3, progress=False
    )
    cached = datasets.load_from_disk(str(out / "saelens"))
    assert summary.rows == len(cached) >= 6 and summary.tokens == 24 * summary.rows
    rows = torch.tensor(cached["token_ids"]).long()
    with torch.no_grad():
        hidden = hf_for(vllm_model_path("gpt2"))(rows, output_hidden_states=True).hidden_states
    for layer in (0, 1):
        values = torch.from_numpy(np.asarray(cached[f"blocks.{layer}.hook_resid_post"]))
        assert rel_diff(values, hidden[layer + 1]) <= TOL, layer
        shards = torch.cat(list(open_harvest(out).address(f"resid_post.{layer}").shards()))
        assert torch.equal(shards, values.reshape(-1, values.shape[-1]))
