"""One rule for ``d_mlp`` on both backends: the MLP down projection's (whole) input width.

OPT names its MLP width ``ffn_dim``, which the config names the vllm backend once read
(``intermediate_size``, ``n_inner``) miss; with ``ffn_dim`` other than ``4 * d_model`` only the
projection tells. No engine: the vllm backend reads it from vLLM's model built on the meta device.
"""

from __future__ import annotations

import pathlib

import pytest

from interp_engine import load_model
from interp_testkit import build_tiny_model

D_MODEL = 128
FFN = 3 * D_MODEL  # neither 4 * d_model nor a name the old rule read


@pytest.fixture(scope="module")
def opt_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model("opt", tmp_path_factory.mktemp("opt") / "base", d_model=D_MODEL, head_dim=32)
    config = AutoConfig.from_pretrained(base)
    config.ffn_dim = FFN
    out = tmp_path_factory.mktemp("opt") / "ffn"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def test_d_mlp_is_the_down_projections_input_on_eager_and_vllm(opt_path: pathlib.Path) -> None:
    eager = load_model(str(opt_path), backend="eager")
    vllm = load_model(str(opt_path), backend="vllm")
    try:
        assert eager.info.d_mlp == FFN
        assert vllm.info.d_mlp == FFN
        assert vllm.family.d_mlp == FFN  # read from vLLM's served down projection, not the config
    finally:
        vllm.close()
        eager.close()
