"""The errors interp-engine raises.

Every error is an :class:`InterpError` and also the builtin a Python user would catch::

    InterpError
    ├── InvalidAddress (ValueError)          bad address: .address, .valid
    │   ├── UnknownKind                      kind not in the vocabulary
    │   ├── LayerOutOfRange                  layer outside [-n_layers, n_layers)
    │   └── UnsupportedAddress               valid address the backend/model cannot serve
    │       └── UndeclaredAddress            outside a vllm-static engine's declared taps
    ├── InvalidTokens (ValueError)           empty, out-of-vocabulary or too-long input
    │   └── ContextTooLong                   longer than the model's context window
    ├── InvalidSteering (ValueError)         bad SteeringSpec / Write (width, NaN, shape, op)
    ├── InvalidActivations (ValueError)      activations of the wrong width or type to decode
    ├── InvalidChat (ValueError)             bad chat messages, or a chat template that refused them
    │   └── NoChatTemplate                   the tokenizer has no chat template (pass template=)
    ├── InvalidOption (TypeError)            an argument the backend does not know
    ├── UnsupportedArchitecture (ValueError) no adapter for this model family
    ├── ModelLoadError (OSError)             the weights, config or tokenizer could not be read
    ├── BackendNotFound (LookupError)        no installed backend of that name
    ├── ModelClosed (RuntimeError)           the model was shut down
    ├── ForeignEventLoop (RuntimeError)      awaited from a loop other than the engine's
    ├── RunningLoopError (RuntimeError)      a sync call made from inside a running event loop
    ├── StaticConfigError (RuntimeError)     configure_static (or attach_sae) after the engine is built
    ├── UnsupportedSae (ValueError)          an SAE folder or architecture that cannot be read
    ├── UnknownSae (KeyError)                no SAE attached under that name: .name, .valid
    ├── UnknownWeight (KeyError)             a weight name the model does not have: .name, .valid
    ├── UnknownAdapter (KeyError)            no adapter registered under that name: .name, .valid
    ├── InvalidAdapter (ValueError)          an adapter that cannot serve this model: not a LoRA
    │                                        folder, shapes of another model, a rank over the limit
    ├── InvalidFeatures (ValueError)         a bad readout or feature write: id out of range,
    │                                        width mismatch, unknown option
    ├── CaptureMemoryExceeded (MemoryError)  a request's captured values exceed the backend's
    │                                        capture memory cap: .needed, .limit, .option
    ├── InvalidCorpus (ValueError)           a harvest corpus that is missing, empty or not the
    │                                        format named: .path, .valid
    ├── HarvestMismatch (ValueError)         an output folder holding another harvest (or other
    │                                        files): .path, .differences
    ├── InsufficientDiskSpace (OSError)      not enough free disk for a harvest: .needed, .free
    ├── NotInThisEngine (ImportError)        a name of the public interp-engine package that this
    │                                        one does not have: .name; the message names the call to use
    └── BackendError (RuntimeError)          the backend failed to serve a valid request
        ├── IncompatibleDependency           an installed package no longer has the private API
        │                                    a backend patches (the message names the versions)
        └── UnguardedScript                  an engine started by a script's top-level code, which
                                             the engine's spawned processes re-import (guard it
                                             with ``if __name__ == "__main__":``)

Errors carry context as attributes (``.address``, ``.valid``) so callers need not parse messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class InterpError(Exception):
    """Root of every error raised by interp-engine."""


class InvalidAddress(InterpError, ValueError):
    """An address that is not valid for this model.

    ``address`` is what was asked for; ``valid`` describes what would have been accepted.
    """

    def __init__(self, message: str, *, address: Any = None, valid: Sequence[str] | str = ()) -> None:
        super().__init__(message)
        self.address = address
        self.valid = valid


class UnknownKind(InvalidAddress):
    """The address kind is not in the vocabulary."""


class LayerOutOfRange(InvalidAddress):
    """The layer index is outside ``[-n_layers, n_layers)``."""


class UnsupportedAddress(InvalidAddress):
    """A valid address that this backend or model family cannot serve (or write to)."""


class KindNotInFamily(UnsupportedAddress):
    """An address kind this model's family does not have (no q-norm, no gated MLP, no sandwich
    norms, ...); ``valid`` lists the kinds the loaded model serves (``model.points()``)."""


class UndeclaredAddress(UnsupportedAddress):
    """An address outside the taps a ``vllm-static`` engine declared before it was built
    (``valid`` lists the declared ones)."""


class InvalidTokens(InterpError, ValueError):
    """Token ids that cannot be run: empty, negative, ``>= vocab``, or the wrong shape."""


class ContextTooLong(InvalidTokens):
    """The sequence is longer than the model's context window."""


class InvalidSteering(InterpError, ValueError):
    """A steering spec or write that cannot be applied to this model or request."""


class InvalidActivations(InterpError, ValueError):
    """Activations that cannot be decoded: wrong width, not a tensor, not finite."""


class InvalidChat(InterpError, ValueError):
    """Chat messages that cannot be rendered: not a list of ``{"role", "content"}`` dicts, or a
    chat template that refused them (its own message is kept, e.g. Gemma's "Conversation roles
    must alternate")."""


class NoChatTemplate(InvalidChat):
    """The model's tokenizer has no chat template: pass one (``chat_tokens(..., template=JINJA)``)."""


class InvalidOption(InterpError, TypeError):
    """An argument the backend does not understand (never silently dropped)."""


class UnsupportedArchitecture(InterpError, ValueError):
    """The model's architecture has no adapter in this backend."""


class ModelLoadError(InterpError, OSError):
    """The model's config, weights or tokenizer could not be found or read."""


class BackendNotFound(InterpError, LookupError):
    """No installed backend answers to the requested name."""


class ModelClosed(InterpError, RuntimeError):
    """The model has been shut down; load a new one."""


class ForeignEventLoop(InterpError, RuntimeError):
    """The model was awaited from an event loop other than the one that built its engine."""


class RunningLoopError(InterpError, RuntimeError):
    """A synchronous call was made from inside a running event loop, where it would deadlock."""


class StaticConfigError(InterpError, RuntimeError):
    """A static tap set was changed after the engine that compiled it was built."""


class BackendError(InterpError, RuntimeError):
    """The backend failed while serving a request that passed validation."""


class IncompatibleDependency(BackendError):
    """An installed package no longer has the private API a backend patches: the message names
    the target, the versions the patch is written for and the installed one."""


class UnguardedScript(BackendError):
    """An engine that could not start because the script that starts it runs again in the
    engine's own processes: a backend that starts them with the ``spawn`` method (vLLM always
    does on its CPU build) re-imports the main module there, and a script with no
    ``if __name__ == "__main__":`` guard starts another engine while it is imported. The message
    names the fix: put the script's work under that guard."""


class NotInThisEngine(InterpError, ImportError):
    """A name the public ``interp-engine`` package exports and this one does not
    (``from interp_engine import set_steering``): ``.name`` is the name, and the message says what
    differs and what to call here. An ``ImportError``, so ``from interp_engine import ...`` raises
    it with that message."""


class UnsupportedOperation(InterpError, NotImplementedError):
    """An operation this backend cannot do (gradients on vLLM, for instance); the message names
    the backend that can."""


class UnsupportedSae(InterpError, ValueError):
    """An SAE (or probe) that cannot be read: not SAELens's on-disk format, or an architecture
    interp-engine does not implement (the message names the supported ones)."""


class _UnknownName(InterpError, KeyError):
    """A name looked up and not found; ``name`` is what was asked, ``valid`` what exists."""

    def __init__(self, message: str, *, name: Any = None, valid: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.valid = tuple(valid)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownSae(_UnknownName):
    """No SAE or probe is attached to the model under that name; ``valid`` lists the attached ones."""


class UnknownWeight(_UnknownName):
    """A weight name the model does not have (``weights(model).get(name)``): not a weight
    interp-engine knows, or one this model lacks (``b_U`` without an unembedding bias);
    ``valid`` lists the model's weight names."""


class UnknownAdapter(_UnknownName):
    """No adapter is registered on the model under that name, and the name is no adapter folder;
    ``valid`` lists the registered adapters (``None`` is always the base model)."""


class InvalidAdapter(InterpError, ValueError):
    """An adapter that cannot serve this model, refused before any compute: a folder that is not a
    PEFT LoRA adapter, weights whose shapes or layers are another model's, a rank over the
    engine's ``max_lora_rank``, a backend or engine set up without adapters. ``name`` is the
    adapter, ``valid`` what would have been accepted."""

    def __init__(self, message: str, *, name: Any = None, valid: Sequence[str] | str = ()) -> None:
        super().__init__(message)
        self.name = name
        self.valid = valid


class InvalidFeatures(InterpError, ValueError):
    """A feature readout or feature write that cannot be served: a feature id outside the SAE,
    an SAE whose width does not match its address in this model, a bad readout option."""


class CaptureMemoryExceeded(InterpError, MemoryError):
    """A request whose captured values need more memory than the backend's cap on capture
    memory allows, even with nothing else in flight: ``needed`` and ``limit`` in bytes, ``option``
    the setting that raises the cap (requests that fit wait for memory to be freed instead)."""

    def __init__(self, message: str, *, needed: int = 0, limit: int = 0, option: str = "capture_memory_bytes") -> None:
        super().__init__(message)
        self.needed = needed
        self.limit = limit
        self.option = option
        self.valid = limit


class InvalidCorpus(InterpError, ValueError):
    """A harvest corpus that cannot be read: a file or folder that is missing, holds no document,
    is not the format named (or its extension implies), or lacks the text field asked for.
    ``path`` is the corpus, ``valid`` what would have been accepted."""

    def __init__(self, message: str, *, path: Any = None, valid: Sequence[str] | str = ()) -> None:
        super().__init__(message)
        self.path = path
        self.valid = valid


class HarvestMismatch(InterpError, ValueError):
    """A harvest's output folder that holds another harvest (another model, corpus, address set or
    packing) or files that are no harvest's: nothing is mixed in or overwritten. ``path`` is the
    folder; ``differences`` maps each setting that differs to ``(in the folder, asked for)``."""

    def __init__(
        self, message: str, *, path: Any = None, differences: dict[str, tuple[Any, Any]] | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.differences = dict(differences or {})


class InsufficientDiskSpace(InterpError, OSError):
    """Too little free disk for a harvest: found before it starts (``needed``, the estimate of
    what the whole run writes) or when a shard's write fails on a full disk (the shards written
    before it are kept and a rerun resumes after them). ``needed`` and ``free`` in bytes."""

    def __init__(self, message: str, *, needed: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
