"""Models that ship inside interp-core, loadable by name on every backend.

``load_model("interp:tiny", backend=...)`` resolves the name here, in the core, to the directory
the package installed, so a backend only ever sees a local Hugging Face model directory.

``interp:tiny`` is a 4-layer GPT-2-shaped model (d_model 128, 4 heads of 32, 256 positions, a
byte-level BPE tokenizer of about a thousand tokens) trained on CPU in minutes by
``packages/interp-core/scripts/train_tiny.py`` on the corpus beside that script: it completes
"The capital of France is" with " Paris", has induction heads, and its answers can be steered.

Its tokenizer has a minimal chat template (:data:`TINY_CHAT_TEMPLATE`, in ``tokenizer_config.json``),
so ``model.chat_tokens(messages)`` and positions named by chat span run offline. The model is not
chat-tuned: the template exists for the code paths, not for the answers.

``interp:tiny-sae`` is a TopK sparse autoencoder on one of its middle layers' ``resid_post``
(SAELens's on-disk format, read with ``load_sae(resolve_sae("interp:tiny-sae"))``), trained by
``packages/interp-core/scripts/train_tiny_sae.py``; ``features.json`` beside its weights records
its measured figures and the features that name word categories of the corpus.

``interp:tiny-lora`` is a rank-4 LoRA adapter of ``interp:tiny`` (PEFT's folder format) trained
by ``packages/interp-core/scripts/train_tiny_lora.py`` to answer one capital differently, for
``adapter="interp:tiny-lora"`` and :func:`~interp_engine.compare` offline; ``training.json``
beside it records what it changed.
"""

from __future__ import annotations

import os
import pathlib

from ._errors import InvalidAdapter, ModelLoadError, UnsupportedSae

TINY_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] | capitalize + ': ' + message['content'] | trim + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)
"""The shipped tiny model's chat template: ``<|endoftext|>`` once, then one line per message,
``Role: content`` (the content trimmed), and ``Assistant:`` as the generation prompt::

    <|endoftext|>System: Answer briefly.
    User: The capital of France is
    Assistant:
"""

PREFIX = "interp:"
"""Names that start with this prefix are models shipped with interp-core."""

_MODELS = pathlib.Path(__file__).resolve().parent / "models"
_SHIPPED = {"tiny": _MODELS / "tiny"}
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
_SHIPPED_SAES = {"tiny-sae": _MODELS / "tiny-sae"}
_SAE_REQUIRED = ("cfg.json", "sae_weights.safetensors")
_SHIPPED_ADAPTERS = {"tiny-lora": _MODELS / "tiny-lora"}
_ADAPTER_REQUIRED = ("adapter_config.json", "adapter_model.safetensors")


def shipped_models() -> list[str]:
    """The names ``load_model`` accepts for the shipped models (``["interp:tiny"]``)."""
    return sorted(PREFIX + name for name in _SHIPPED)


def tiny_model_path() -> pathlib.Path:
    """The directory of the shipped tiny model (config, safetensors weights, tokenizer files).

    It loads with plain ``transformers`` too: ``AutoModelForCausalLM.from_pretrained(tiny_model_path())``.
    """
    return _resolve_shipped("tiny")


def resolve_model(name_or_path: str | os.PathLike[str]) -> str:
    """``name_or_path`` as a backend should see it: a shipped name becomes its directory.

    Anything without the ``interp:`` prefix (a local directory, a hub id) is returned unchanged.
    """
    name = os.fspath(name_or_path)
    if not name.startswith(PREFIX):
        return name
    return os.fspath(_resolve_shipped(name[len(PREFIX) :]))


def _resolve_shipped(short: str) -> pathlib.Path:
    path = _SHIPPED.get(short)
    if path is None:
        raise ModelLoadError(
            f"no model named {PREFIX + short!r} ships with interp-core; shipped models: {', '.join(shipped_models())}"
        )
    missing = [name for name in _REQUIRED if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"the shipped model {PREFIX + short!r} is incomplete in {path} (missing {', '.join(missing)}); "
            "reinstall interp-core or retrain it with packages/interp-core/scripts/train_tiny.py"
        )
    return path


def shipped_saes() -> dict[str, pathlib.Path]:
    """The SAEs that ship with interp-core, by the name :func:`resolve_sae` accepts, and their folders
    (``{"interp:tiny-sae": ...}``: SAELens's format, ``cfg.json`` + ``sae_weights.safetensors``)."""
    return {PREFIX + name: path for name, path in sorted(_SHIPPED_SAES.items())}


def resolve_sae(name_or_path: str | os.PathLike[str]) -> str:
    """``name_or_path`` as ``load_sae`` should see it: a shipped SAE's name becomes its folder.

    Anything without the ``interp:`` prefix (a local folder) is returned unchanged. An ``interp:``
    name that is not a shipped SAE, or a shipped folder missing its files, is ``UnsupportedSae``.
    """
    name = os.fspath(name_or_path)
    if not name.startswith(PREFIX):
        return name
    short = name[len(PREFIX) :]
    path = _SHIPPED_SAES.get(short)
    if path is None:
        raise UnsupportedSae(f"no SAE named {name!r} ships with interp-core; shipped SAEs: {', '.join(shipped_saes())}")
    missing = [file for file in _SAE_REQUIRED if not (path / file).is_file()]
    if missing:
        raise UnsupportedSae(
            f"the shipped SAE {name!r} is incomplete in {path} (missing {', '.join(missing)}); "
            "reinstall interp-core or retrain it with packages/interp-core/scripts/train_tiny_sae.py"
        )
    return os.fspath(path)


def shipped_adapters() -> dict[str, pathlib.Path]:
    """The LoRA adapters that ship with interp-core, by the name ``adapter=`` accepts, and their
    folders (``{"interp:tiny-lora": ...}``: PEFT's format, for ``interp:tiny``)."""
    return {PREFIX + name: path for name, path in sorted(_SHIPPED_ADAPTERS.items())}


def resolve_adapter(name_or_path: str | os.PathLike[str]) -> str:
    """``name_or_path`` as an adapter folder: a shipped adapter's name becomes its folder; anything
    without the ``interp:`` prefix is returned unchanged. An ``interp:`` name that is not a shipped
    adapter, or a shipped folder missing its files, is ``InvalidAdapter``."""
    name = os.fspath(name_or_path)
    if not name.startswith(PREFIX):
        return name
    path = _SHIPPED_ADAPTERS.get(name[len(PREFIX) :])
    if path is None:
        raise InvalidAdapter(
            f"no adapter named {name!r} ships with interp-core; shipped adapters: {', '.join(shipped_adapters())}",
            name=name,
            valid=tuple(shipped_adapters()),
        )
    missing = [file for file in _ADAPTER_REQUIRED if not (path / file).is_file()]
    if missing:
        raise InvalidAdapter(
            f"the shipped adapter {name!r} is incomplete in {path} (missing {', '.join(missing)}); "
            "reinstall interp-core or retrain it with packages/interp-core/scripts/train_tiny_lora.py",
            name=name,
        )
    return os.fspath(path)
