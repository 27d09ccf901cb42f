"""Tiny random-weight Hugging Face causal LMs for offline tests and benchmarks (development only).

This is the dev-only distribution ``interp-testkit`` (``tests/testkit``, installed by ``scripts/setup.sh``), not
part of any interp-engine wheel: it needs ``transformers``, ``tokenizers`` and ``torch`` but no interp-engine
package, so the vllm suite runs without ``interp-eager`` installed. Nothing under ``packages/`` may import it.

:func:`build_tiny_model` writes a directory that loads fully offline with ``AutoModelForCausalLM.from_pretrained(path)``
and ``AutoTokenizer.from_pretrained(path)``: ``config.json`` + ``model.safetensors`` (fp32), ``generation_config.json``
and a byte-level BPE tokenizer trained locally (:func:`train_tokenizer`) on a small embedded English corpus.

Weights are random, but not HF's default ``std=0.02`` init, which gives near-uniform attention and greedy generation
stuck on one token. :func:`randomize_weights` draws

* every Linear/Conv1D matrix with ``std = 1/sqrt(fan_in)``; query/key projections and q/k norms get an extra gain
  :data:`QK_GAIN`, so attention is sharp (mean max probability ~0.65);
* embeddings with ``std = EMBED_STD`` after any embedding scale (Gemma's ``sqrt(d_model)``): small, so that with tied
  embeddings the current token does not dominate the logits;
* biases ``N(0, PARAM_NOISE)`` and norm scales ``N(1, PARAM_NOISE)`` (Gemma's ``1 + w`` norms included), so that a
  backend ignoring a bias or a norm weight is caught;
* and rescales the final norm so that logits have std ~:data:`LOGIT_STD`.

Everything is deterministic for a given ``seed`` (and library versions).

Tokenizer: special tokens ``<|bos|>`` (id 0), ``<|eos|>`` (id 1), ``<|pad|>`` (id 2); padding on the right. Families
whose real checkpoints prepend a BOS token (Llama, Mistral, Gemma*, and OPT, which prepends ``</s>``) get a
``TemplateProcessing`` post-processor that prepends ``<|bos|>``; the others (GPT-2 style, Qwen, Phi, ...) add nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedConfig, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "FAMILIES",
    "HEAD_DIM",
    "PAD_TOKEN",
    "build_tiny_model",
    "family_prepends_bos",
    "make_config",
    "randomize_weights",
    "train_tokenizer",
]

BOS_TOKEN: Final = "<|bos|>"
EOS_TOKEN: Final = "<|eos|>"
PAD_TOKEN: Final = "<|pad|>"
SPECIAL_TOKENS: Final = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2
HEAD_DIM: Final = 16
EMBED_STD: Final = 0.1
QK_GAIN: Final = 2.0
LOGIT_STD: Final = 2.0
PARAM_NOISE: Final = 0.1

_STAMP: Final = "tiny_model_stamp.json"
_FORMAT: Final = 2  # bump whenever the files built for the same arguments change
_FILES: Final = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
_QK_NAMES: Final = frozenset({"q_proj", "k_proj", "c_attn", "query_key_value", "qkv_proj"})
_QK_NORMS: Final = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm"})
_FINAL_NORMS: Final = frozenset({"norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "layer_norm"})
_PREPENDS_BOS: Final = frozenset({"llama", "mistral", "gemma", "gemma2", "gemma3_text", "opt"})

_CORPUS: Final = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the warm sun, and the fox runs into the green "
    "forest. Every morning the farmer walks to the river to fetch water, and every evening he sits by the fire and "
    "tells stories to his children.",
    "Once upon a time there was a small village at the foot of a tall mountain. The people of the village grew wheat "
    "and apples, kept sheep and goats, and traded with the merchants who came over the pass in the summer. In the "
    "winter the snow was deep and the roads were closed.",
    "Mary had a little lamb whose fleece was white as snow. Wherever Mary went, the lamb was sure to go. It followed "
    "her to school one day, which was against the rule; it made the children laugh and play to see a lamb at school.",
    "Science is the study of the natural world through observation and experiment. A good scientist asks a question, "
    "forms a hypothesis, tests it carefully, and reports the results honestly, even when they are surprising. Numbers "
    "such as 1, 2, 3, 10, 42 and 2024 appear in tables, and measurements are written in meters, seconds and grams.",
    "When Alice went to the market, she bought bread, cheese, milk, eggs and three red apples. Then she met Bob, who "
    'was carrying a basket of fish. "Hello, Alice!" he said. "Would you like to have dinner with us tonight?" She '
    "smiled and answered that she would be happy to.",
    "Computers follow instructions written by programmers. A program reads input, performs calculations, and writes "
    "output. def add(a, b): return a + b. for i in range(10): print(i). Errors happen, so good programs check their "
    "inputs and handle mistakes gracefully.",
    "The sun rises in the east and sets in the west. Spring brings flowers, summer brings heat, autumn brings falling "
    "leaves, and winter brings cold winds. The moon and the stars shine at night, while birds sing in the trees "
    "during the day.",
)


def family_prepends_bos(family: str) -> bool:
    """Whether the tokenizer built for ``family`` prepends ``<|bos|>`` (as the family's real checkpoints do)."""
    return family in _PREPENDS_BOS


def _corpus() -> Iterator[str]:
    yield from _CORPUS
    for shift in range(1, 4):  # a few reorderings: more pair counts, same text
        yield " ".join(_CORPUS[shift:] + _CORPUS[:shift])


def train_tokenizer(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int = 512,
    family: str | None = None,
    model_max_length: int = 128,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the embedded corpus; save it to ``out_dir`` if given.

    The vocabulary holds the special tokens, all 256 byte symbols (any text is encodable) and merges up to
    ``vocab_size`` entries (fewer if the corpus ran out of merges: use ``len(tokenizer)``). ``family`` selects the BOS
    convention (:func:`family_prepends_bos`) and, for ``qwen2``, the ``Qwen2Tokenizer`` pipeline (NFC, Qwen's split
    regex, an extra ``<|endoftext|>`` special token): transformers 5 forces that class onto ``qwen2`` checkpoints,
    rebuilding the pre-tokenizer from the vocabulary, so the saved tokenizer must already match it.
    """
    specials = [*SPECIAL_TOKENS, *(["<|endoftext|>"] if family == "qwen2" else [])]
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size must be >= {len(specials) + 256}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if family is not None and family_prepends_bos(family):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        fast.save_pretrained(os.fspath(out_dir))
    return fast


@dataclass(frozen=True)
class _Dims:
    n_layers: int
    d_model: int
    n_heads: int
    max_positions: int
    window: int
    head_dim: int = HEAD_DIM


def _llama_like(d: _Dims, *, gqa: bool, ff: int = 3, head_dim: bool = True) -> dict[str, Any]:
    """``hidden_size``/``num_*`` config kwargs; ``ff`` x ``d_model`` MLP (3x for gated MLPs)."""
    kw: dict[str, Any] = {
        "hidden_size": d.d_model,
        "intermediate_size": ff * d.d_model,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_heads,
        "num_key_value_heads": d.n_heads // 2 if gqa else d.n_heads,
        "max_position_embeddings": d.max_positions,
    }
    if head_dim:
        kw["head_dim"] = d.head_dim
    return kw


def _gpt_style(d: _Dims) -> dict[str, Any]:
    """GPT-2 / GPT-J naming (``n_embd``, ``n_layer``, ...), dropout off."""
    return {
        "n_embd": d.d_model,
        "n_layer": d.n_layers,
        "n_head": d.n_heads,
        "n_inner": 4 * d.d_model,
        "n_positions": d.max_positions,
        **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0),
    }


def _gemma_like(d: _Dims, **extra: Any) -> dict[str, Any]:
    return {**_llama_like(d, gqa=True), "query_pre_attn_scalar": d.head_dim, "sliding_window": d.window, **extra}


_CONFIGS: Final[dict[str, Callable[[_Dims], dict[str, Any]]]] = {
    "gpt2": _gpt_style,
    "gptj": lambda d: {**_gpt_style(d), "rotary_dim": d.head_dim // 2},
    "llama": lambda d: _llama_like(d, gqa=True),
    "mistral": lambda d: {**_llama_like(d, gqa=True), "sliding_window": d.window},
    "qwen2": lambda d: _llama_like(d, gqa=True, head_dim=False),
    "qwen3": lambda d: _llama_like(d, gqa=True),
    "gemma": lambda d: _llama_like(d, gqa=False),
    "gemma2": _gemma_like,
    # Real Gemma 3 has 5 sliding layers per full one; tiny ones alternate, ending with a full layer.
    "gemma3_text": lambda d: _gemma_like(
        d, layer_types=["full_attention" if (d.n_layers - i) % 2 else "sliding_attention" for i in range(d.n_layers)]
    ),
    "gpt_neox": lambda d: {
        "hidden_size": d.d_model,
        "intermediate_size": 4 * d.d_model,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_heads,
        "max_position_embeddings": d.max_positions,
        "use_parallel_residual": True,
    },
    "opt": lambda d: {
        "hidden_size": d.d_model,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_heads,
        "ffn_dim": 4 * d.d_model,
        "max_position_embeddings": d.max_positions,
        "word_embed_proj_dim": d.d_model,
        "do_layer_norm_before": True,
        "dropout": 0.0,
    },
    "phi": lambda d: {**_llama_like(d, gqa=False, ff=4, head_dim=False), "resid_pdrop": 0.0},
    "phi3": lambda d: {
        **_llama_like(d, gqa=False, head_dim=False),
        "original_max_position_embeddings": d.max_positions,
    },
    "stablelm": lambda d: _llama_like(d, gqa=False, head_dim=False),
    "olmo2": lambda d: _llama_like(d, gqa=False, head_dim=False),
    # -- the eager backend's breadth sweep (tests/eager/test_eager_families.py): llama-like layouts with
    # their own norms, fused projections, parallel blocks, and mixtures of experts (4 experts, top 2)
    "olmo": lambda d: _llama_like(d, gqa=True),
    "olmo3": lambda d: {**_llama_like(d, gqa=True), "sliding_window": d.window},
    "cohere": lambda d: _llama_like(d, gqa=True),
    "cohere2": lambda d: {**_llama_like(d, gqa=True), "sliding_window": d.window},
    "starcoder2": lambda d: {**_llama_like(d, gqa=True, ff=4), "sliding_window": d.window, "residual_dropout": 0.0},
    "nemotron": lambda d: _llama_like(d, gqa=True, ff=4),
    "glm": lambda d: _llama_like(d, gqa=True),
    "glm4": lambda d: _llama_like(d, gqa=True),
    "helium": lambda d: _llama_like(d, gqa=True),
    "exaone4": lambda d: {**_llama_like(d, gqa=True), "sliding_window": d.window},
    "smollm3": lambda d: _llama_like(d, gqa=True),
    "arcee": lambda d: _llama_like(d, gqa=True, ff=4),
    "ernie4_5": lambda d: _llama_like(d, gqa=True),
    "seed_oss": lambda d: _llama_like(d, gqa=True),
    "hunyuan_v1_dense": lambda d: _llama_like(d, gqa=True),
    "apertus": lambda d: _llama_like(d, gqa=True, ff=4),
    "ministral": lambda d: {**_llama_like(d, gqa=True), "sliding_window": d.window},
    "persimmon": lambda d: {
        k: v for k, v in _llama_like(d, gqa=False, ff=4, head_dim=False).items() if k != "num_key_value_heads"
    },
    "gpt_bigcode": lambda d: {**_gpt_style(d), "multi_query": True},
    "biogpt": lambda d: {
        **{k: v for k, v in _llama_like(d, gqa=False, ff=4, head_dim=False).items() if k != "num_key_value_heads"},
        **dict.fromkeys(("hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout"), 0.0),
        "layerdrop": 0.0,
        "scale_embedding": False,  # sqrt(d_model) times EMBED_STD-sized embeddings: the current token dominates
    },
    "mixtral": lambda d: {**_llama_like(d, gqa=True, ff=2), "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": lambda d: {
        **_llama_like(d, gqa=True, ff=2),
        **{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 2 * d.d_model},
        "shared_expert_intermediate_size": 3 * d.d_model,
    },
    "qwen3_moe": lambda d: {
        **_llama_like(d, gqa=True, ff=2),
        **{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 2 * d.d_model},
    },
    "olmoe": lambda d: {**_llama_like(d, gqa=True, ff=2), "num_experts": 4, "num_experts_per_tok": 2},
    "phimoe": lambda d: {**_llama_like(d, gqa=True, ff=2), "num_local_experts": 4, "num_experts_per_tok": 2},
    "flex_olmo": lambda d: {**_llama_like(d, gqa=True, ff=2), "num_experts": 4, "num_experts_per_tok": 2},
    "hunyuan_v1_moe": lambda d: {**_llama_like(d, gqa=True, ff=2), "num_experts": 4, "moe_topk": 2},
    # GPT-Neo alternates global and local attention (a window of 8: local layers matter at test lengths)
    "gpt_neo": lambda d: {
        **{"hidden_size": d.d_model, "num_layers": d.n_layers, "num_heads": d.n_heads},
        "attention_types": [[["global", "local"], d.n_layers // 2], [["global"], d.n_layers % 2]],
        "window_size": min(d.window, 8),
        "max_position_embeddings": d.max_positions,
        **dict.fromkeys(("embed_dropout", "attention_dropout", "resid_dropout"), 0.0),
    },
    "gpt_oss": lambda d: {
        **_llama_like(d, gqa=True, ff=2),
        **{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": d.window},
    },
    "ernie4_5_moe": lambda d: {
        **_llama_like(d, gqa=True),
        **{"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 2 * d.d_model, "moe_num_shared_experts": 1},
    },
    # refused only with residual_multiplier != 1; the attention multiplier as real checkpoints set it
    # (1/head_dim): HF's default 1.0 gives scores near 100 on random weights, where float noise of 1e-6
    # in the queries moves the softmax by 1e-4
    "granite": lambda d: {**_llama_like(d, gqa=True), "attention_multiplier": 1.0 / d.head_dim},
    # the eager backend refuses these (tests/eager/test_eager_families.py says why)
    "bitnet": lambda d: _llama_like(d, gqa=True),
    # untied: with Bloom's embedding layer norm, tied tiny weights make greedy decoding repeat one token
    "bloom": lambda d: {
        "hidden_size": d.d_model,
        "n_layer": d.n_layers,
        "n_head": d.n_heads,
        "tie_word_embeddings": False,
    },
    "falcon": lambda d: {"hidden_size": d.d_model, "num_hidden_layers": d.n_layers, "num_attention_heads": d.n_heads},
    "codegen": lambda d: {**_gpt_style(d), "rotary_dim": d.head_dim // 2},
    "mpt": lambda d: {
        **{"d_model": d.d_model, "n_heads": d.n_heads, "n_layers": d.n_layers},
        "max_seq_len": d.max_positions,
    },
    "xglm": lambda d: {
        "d_model": d.d_model,
        "num_layers": d.n_layers,
        "attention_heads": d.n_heads,
        "ffn_dim": 4 * d.d_model,
        "max_position_embeddings": d.max_positions,
        "tie_word_embeddings": False,  # tied, the tiny model's greedy decoding repeats one token
        **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout", "layerdrop"), 0.0),
    },
}

FAMILIES: Final[tuple[str, ...]] = tuple(sorted(_CONFIGS))


def make_config(
    family: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    n_layers: int = 3,
    d_model: int = 64,
    max_positions: int = 128,
    sliding_window: int | None = None,
    head_dim: int = HEAD_DIM,
) -> PreTrainedConfig:
    """The tiny fp32 config for ``family``, with the vocabulary size and special ids of ``tokenizer``.

    ``n_heads = d_model // head_dim`` (vLLM's CPU attention kernels need ``head_dim >= 32``);
    ``sliding_window`` (mistral, gemma2, gemma3_text) defaults to ``max_positions``,
    i.e. inert for sequences the model accepts.
    """
    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; supported: {', '.join(FAMILIES)}")
    if d_model % head_dim or d_model // head_dim < 2:
        raise ValueError(f"d_model must be a multiple of {head_dim} with at least 2 heads, got {d_model}")
    window = max_positions if sliding_window is None else sliding_window
    kwargs = _CONFIGS[family](_Dims(n_layers, d_model, d_model // head_dim, max_positions, window, head_dim))
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    config: PreTrainedConfig = AutoConfig.for_model(family, **kwargs)
    return config


def _is_final_norm(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] in _FINAL_NORMS and not any(part.isdigit() for part in parts)


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int) -> None:
    """Re-draw every parameter of ``model`` in place, deterministically in ``seed`` (scheme: see the module doc)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float32))

    seen: set[int] = set()
    final_norm: tuple[torch.Tensor, float] | None = None
    # Embeddings first, so that a tied lm_head keeps the embedding's statistics.
    for name, module in sorted(model.named_modules(), key=lambda item: not isinstance(item[1], nn.Embedding)):
        short = name.rsplit(".", 1)[-1]
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, nn.Embedding):
                draw(p, EMBED_STD / float(getattr(module, "scalar_embed_scale", 1.0)))
            elif isinstance(module, (nn.Linear, Conv1D)) and pname == "weight":
                fan_in = p.shape[0] if isinstance(module, Conv1D) else p.shape[1]
                draw(p, (QK_GAIN if short in _QK_NAMES else 1.0) / fan_in**0.5)
            elif pname != "weight":  # biases, norm shifts
                draw(p, PARAM_NOISE)
            elif p.ndim == 1:  # a norm scale; Gemma-style norms store w and use 1 + w (HF inits w to 0)
                offset = 0.0 if p.any() else 1.0
                gain = QK_GAIN if short in _QK_NORMS else 1.0
                draw(p, PARAM_NOISE * gain, gain - offset)
                if _is_final_norm(name):
                    final_norm = (p, offset)
            elif p.ndim in (2, 3):  # a router's bare weight [experts, d_model]; stacked experts [experts, out, in]
                draw(p, 1.0 / p.shape[-1] ** 0.5)
            else:
                raise TypeError(f"don't know how to initialise {name}.{pname} of shape {tuple(p.shape)}")
    head = model.get_output_embeddings()  # type: ignore[operator]
    if final_norm is not None and isinstance(head, nn.Linear):
        p, offset = final_norm
        gain = LOGIT_STD / (head.weight.std().item() * head.in_features**0.5)
        p.copy_((p + offset) * gain - offset)


def _is_built(out: pathlib.Path, stamp: dict[str, Any]) -> bool:
    try:
        found = json.loads((out / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == stamp) and all((out / name).is_file() for name in _FILES)


def build_tiny_model(
    family: str,
    out_dir: str | os.PathLike[str],
    *,
    n_layers: int = 3,
    d_model: int = 64,
    seed: int = 0,
    vocab_size: int = 512,
    max_positions: int = 128,
    sliding_window: int | None = None,
    head_dim: int = HEAD_DIM,
) -> pathlib.Path:
    """Build (or reuse) a tiny random ``family`` causal LM and its tokenizer in ``out_dir``; return the directory.

    ``family`` is a ``model_type`` in :data:`FAMILIES`; ``d_model`` must be a multiple of :data:`HEAD_DIM`. If
    ``out_dir`` already holds a complete model built with the same arguments and library versions (recorded in
    ``tiny_model_stamp.json``), nothing is rebuilt. Files are written to a temporary sibling directory and moved into
    place, the stamp last, so concurrent builders of the same model (deterministic, identical files) are safe.
    """
    out = pathlib.Path(out_dir)
    args: dict[str, int | None] = {"n_layers": n_layers, "d_model": d_model, "seed": seed, "vocab_size": vocab_size}
    args |= {"max_positions": max_positions, "sliding_window": sliding_window}
    if head_dim != HEAD_DIM:
        args["head_dim"] = head_dim
    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    versions["torch"] = torch.__version__.split("+")[0]
    init = {"embed_std": EMBED_STD, "qk_gain": QK_GAIN, "logit_std": LOGIT_STD, "param_noise": PARAM_NOISE}
    stamp = {"format": _FORMAT, "family": family, **args, **versions, "init": init}
    if _is_built(out, stamp):
        return out
    tokenizer = train_tokenizer(vocab_size=vocab_size, family=family, model_max_length=max_positions)
    config = make_config(
        family,
        tokenizer,
        n_layers=n_layers,
        d_model=d_model,
        max_positions=max_positions,
        sliding_window=sliding_window,
        head_dim=head_dim,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    randomize_weights(model, seed)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        (out / _STAMP).unlink(missing_ok=True)
        for path in sorted(tmp.iterdir(), key=lambda path: path.name == _STAMP):
            os.replace(path, out / path.name)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        shutil.rmtree(tmp, ignore_errors=True)
    return out
