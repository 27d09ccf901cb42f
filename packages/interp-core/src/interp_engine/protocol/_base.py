"""The shared base of every backend's model: the glue that does no compute and no I/O.

:class:`ModelBase` is to the backends what httpx's ``BaseClient`` is to its two clients. It holds,
once, what each backend would otherwise write again (and get subtly different):

- the checks at the top of every request, in one order: closed model, ``n_logprobs``,
  ``max_tokens``, token ids, sampling options, points, steering spec, write shapes
  (:meth:`~ModelBase._check_capture`, :meth:`~ModelBase._check_generation`), each raising the
  core's typed error before any compute;
- the end-of-sequence ids (:meth:`~ModelBase.eos_ids_of`) and what they mean for a completion
  (where it stops, ``finish_reason`` ``"stop"`` or ``"length"``);
- the shapes ``decode_residuals`` takes (one tensor, or a mapping of them, all checked first);
- ``stream`` and ``capture_generation`` themselves: the checks, then the backend's ``_stream`` /
  ``_capture_generation`` over the checked request (a stream's closed as soon as the caller stops);
- ``capture_attention`` as a capture of ``attn_pattern`` addresses;
- the lifecycle (:class:`~interp_engine.protocol._lifecycle.ModelLifecycle`): ``shutdown()`` is
  idempotent and callable from any loop or thread, and every call after it raises
  :class:`ModelClosed`.

A backend subclasses it and supplies the forward passes::

    class MyModel(ModelBase):
        backend = "mine"

        def __init__(self, path: str) -> None:
            config = read_config(path)
            super().__init__(ModelInfo(...), eos_ids=ModelBase.eos_ids_of(config))

        async def capture(self, token_ids, points, *, steering_spec=None):
            request = self._check_capture(token_ids, points, steering_spec)
            values = run(request.token_ids, request.addresses, request.writes)  # resolved addresses
            return request.keyed(values)  # keyed as the caller asked

        async def _stream(self, request): ...  # yield the StreamSteps of a request stream() checked
        async def _capture_generation(self, request): ...  # (completion, results) of a checked request
        # generate: self._check_generation(...); a completion ends where self._stop_index says,
        # self._completion gives its text and why it ended
        async def _decode_residuals(self, residuals): ...  # one checked tensor [..., d_model]
        def _close_resources(self) -> None: ...  # once, on the first shutdown()

Backend-specific limits go in the class attributes ``supported_points``, ``writable_points`` and
``sampling_options``, or in an override of :meth:`ModelBase._check_request`. What the loaded
model's family has (a q-norm, a gated MLP, sandwich norms) goes in :meth:`ModelBase._served_kinds`,
which :meth:`ModelBase.points` reports and every request is checked against.
"""

from __future__ import annotations

import abc
import contextlib
import numbers
import os
import types
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, NoReturn

import torch

from .._errors import (
    InvalidAdapter,
    InvalidAddress,
    InvalidFeatures,
    InvalidOption,
    InvalidTokens,
    KindNotInFamily,
    UnknownAdapter,
    UnknownSae,
    UnsupportedAddress,
    UnsupportedOperation,
)
from .._plugins import loaded_from
from ..adapters._adapter import Adapter, check_adapter, is_adapter_folder, refuse_adapted_unembedding
from ..addresses._address import Address, AddressLike, PointInfo, is_point_tuple
from ..addresses._kinds import KINDS, missing_reason
from ..chat._render import build_chat_tokens
from ..chat._spans import ChatTokens
from ..chat._tokenize import Tokenize
from ..results._attention import AttentionPatterns, attention_extras
from ..results._lens import LensRequest
from ..sae._readouts import Features, check_readout, check_sae_name
from ..sae._sae import Sae, load_sae
from ..steering._block import with_blocks
from ..steering._spec import AnyWrite, RowSpecs, SteeringSpec, one_spec, resolve_named_positions, row_specs
from ..steering._values import short_repr
from ._checks import (
    check_max_tokens,
    check_residuals,
    check_spec,
    check_token_ids,
    check_write_shapes,
    requested_points,
    value_shape,
)
from ._features import check_sae_fits, resolve_feature_writes, split_points
from ._lens_checks import check_lens
from ._lifecycle import ModelLifecycle
from ._protocol import Activations, Completion, ModelInfo, Results, StaticTaps, StreamStep
from ._requests import SAMPLING_OPTIONS, CheckedLens, CheckedRequest, SamplingOptions
from ._sampling import RecommendedSampling, SamplingSettings, resolve_sampling


class _NotHere:
    """A model attribute of the public ``interp-engine`` package that this one lacks: reading it
    raises ``AttributeError`` saying what to use instead (so ``hasattr`` is ``False``)."""

    def __init__(self, instead: str) -> None:
        self.instead = instead
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(
            f"model.{self.name} (the public interp-engine package's) is not here: {self.instead} "
            "(docs: guides/public-interp-engine.md)",
            name=self.name,
            obj=obj,
        )


class ModelBase(ModelLifecycle, abc.ABC):
    """The glue every backend's model shares (module docstring); subclass it to write a backend.

    Subclasses call ``super().__init__(info, eos_ids=...)``, implement the protocol's compute
    (``warmup``, ``capture``, ``generate``, the tokenizer methods), ``_stream`` and
    ``_capture_generation`` (what a request :meth:`stream` / :meth:`capture_generation` checked
    asks for), ``_decode_residuals`` and, if they hold resources, ``_close_resources``; where
    a whole generation's steps come cheaper in one piece, ``_collect_steps``.
    """

    backend: str
    info: ModelInfo

    supported_points: ClassVar[Collection[str]] = tuple(KINDS)
    """The address kinds this backend can read."""
    writable_points: ClassVar[Collection[str] | None] = None
    """The address kinds a steering spec may write (``None``: every writable kind)."""
    sampling_options: ClassVar[Collection[str]] = SAMPLING_OPTIONS
    """The generation options this backend takes."""
    transcoder_clamps: ClassVar[bool] = False
    """Whether a feature write may clamp or ablate a transcoder's feature (read at its input
    address, written at its output address, in one forward): the backend then binds such a
    :class:`~interp_engine.FeatureWrite` to the output address and applies it with the input rows
    (``FeatureWrite.apply(..., source=...)``)."""

    def __init__(self, info: ModelInfo, *, eos_ids: Iterable[int] = ()) -> None:
        self.info = info
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        super().__init__()
        self._saes: dict[str, Sae] = {}
        self._adapters: dict[str, Adapter] = {}

    # -- the public interp-engine package's names ----------------------------------------------
    set_steering = _NotHere(
        "every steer is per request here, with no global hook: `with steer(model, spec): ...` or "
        "steering_spec=spec on one call"
    )
    generate_steps = _NotHere(
        "model.stream(ids, max_tokens=..., n_logprobs=k) yields each step as a StreamStep, and "
        "model.collect_steps(...) returns them all when the generation ends "
        "(generate_stream(model, tokens, ...) from sync code)"
    )
    project = _NotHere("capture the point and project the rows yourself: acts[address] @ directions.T")
    grad_support = _NotHere(
        "gradients are run_with_gradients(model, tokens, points, metric); a backend that cannot take them "
        "raises UnsupportedOperation naming the one that can"
    )
    residual_basis = _NotHere("every model here has one residual stream, model.d_model wide")

    @property
    def n_layers(self) -> int:
        """``info.n_layers``: the number of decoder layers."""
        return self.info.n_layers

    @property
    def d_model(self) -> int:
        """``info.d_model``: the residual stream's width."""
        return self.info.d_model

    @property
    def n_heads(self) -> int:
        """``info.n_heads``: attention (query) heads per layer."""
        return self.info.n_heads

    @property
    def hf_model_id(self) -> str | None:
        """The name or path the model was loaded from (``load_model``'s first argument as given;
        else what the backend knows, or ``None``)."""
        source = loaded_from(self)
        return source[0] if source is not None else self._model_source()

    def _model_source(self) -> str | None:
        """Where a model built without ``load_model`` came from (a backend that knows says)."""
        return None

    def _model_folder(self) -> str | None:
        """The local folder of the checkpoint (``None``: a hub id, or unknown)."""
        source = loaded_from(self)
        folder = source[1] if source is not None else self._model_source()
        return folder if folder is not None and os.path.isdir(folder) else None

    @property
    def tok(self) -> Tokenize:
        """Tokenization and chat rendering with this model's own tokenizer (:class:`Tokenize`)."""
        return Tokenize(self)

    @property
    def recommended_sampling(self) -> RecommendedSampling:
        """The sampling the checkpoint's ``generation_config.json`` recommends (fields ``None``
        where it states nothing)."""
        return self._recommended_sampling()

    def _recommended_sampling(self) -> RecommendedSampling:
        """The checkpoint's recommendation: its folder's ``generation_config.json`` (a backend
        that holds the loaded generation config overrides this)."""
        return RecommendedSampling.read(self._model_folder())

    def sampling_settings(
        self,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        presence_penalty: float | None = None,
    ) -> SamplingSettings:
        """What :meth:`generate_text`, :meth:`generate_stream` and
        :meth:`capture_generation_stream` run with for these arguments: each knob as passed,
        else :attr:`recommended_sampling`'s, else neutral (temperature 1, no filtering, no
        penalty). ``generate``, ``stream`` and ``capture_generation`` stay greedy unless told."""
        return resolve_sampling(
            self.recommended_sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            presence_penalty=presence_penalty,
        )

    async def generate_text(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int = 200,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        presence_penalty: float | None = None,
        steering_spec: Any = None,
        **options: Any,
    ) -> str:
        """The completion's text (no prompt), sampled as :meth:`sampling_settings` decides;
        ``options``: ``seed``, ``ignore_eos``, ``adapter``. Equal to the concatenation of
        :meth:`generate_stream`'s deltas for the same arguments."""
        pieces = [
            piece
            async for piece in self.generate_stream(
                token_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                presence_penalty=presence_penalty,
                steering_spec=steering_spec,
                **options,
            )
        ]
        return "".join(pieces)

    async def generate_stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int = 200,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        presence_penalty: float | None = None,
        steering_spec: Any = None,
        **options: Any,
    ) -> AsyncIterator[str]:
        """The completion's text as it is produced, one delta per generated token (a delta may be
        empty while a character is incomplete), sampled as :meth:`sampling_settings` decides;
        :meth:`stream` has the richer per-token steps."""
        settings = self.sampling_settings(
            temperature=temperature, top_k=top_k, top_p=top_p, presence_penalty=presence_penalty
        )
        steps = self.stream(
            token_ids, max_tokens=max_tokens, steering_spec=steering_spec, **settings.options(), **options
        )
        async with contextlib.aclosing(steps) as running:  # type: ignore[type-var]  # stream() is an async generator
            async for step in running:
                yield step.text

    async def capture_generation_stream(
        self,
        token_ids: Sequence[int],
        points: Iterable[AddressLike],
        *,
        max_tokens: int = 8,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        presence_penalty: float | None = None,
        steering_spec: Any = None,
        **options: Any,
    ) -> AsyncIterator[tuple[Results, list[int]]]:
        """:meth:`capture_generation` as a stream of ``(new_rows, token_ids)``: the rows captured
        since the last yield and every id generated so far. Concatenating the rows gives
        :meth:`capture_generation`'s values (prompt + every generated token), the last ids its
        completion. Every built-in backend yields once, at the end; sampling as
        :meth:`sampling_settings` decides."""
        settings = self.sampling_settings(
            temperature=temperature, top_k=top_k, top_p=top_p, presence_penalty=presence_penalty
        )
        completion, values = await self.capture_generation(
            token_ids, points, max_tokens=max_tokens, steering_spec=steering_spec, **settings.options(), **options
        )
        yield values, list(completion.token_ids)

    # -- the end of a sequence --------------------------------------------------------------------
    @staticmethod
    def eos_ids_of(*sources: Any) -> frozenset[int]:
        """The end-of-sequence ids of the first source that names any: pass the generation
        config first, then the model config (an int, a list of ints or ``None`` in each)."""
        for source in sources:
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids = eos if isinstance(eos, (list, tuple)) else [eos]
            return frozenset(int(i) for i in ids)
        return frozenset()

    def _stops(self, token: int, sampling: SamplingOptions) -> bool:
        """Whether generation ends at ``token`` (an end-of-sequence id, unless ``ignore_eos``)."""
        return not sampling.ignore_eos and token in self.eos_ids

    def _stop_index(self, tokens: Sequence[int], max_tokens: int, sampling: SamplingOptions) -> int:
        """How many of ``tokens`` the completion keeps: through the first end-of-sequence id,
        at most ``max_tokens``."""
        for i, token in enumerate(tokens[:max_tokens]):
            if self._stops(token, sampling):
                return i + 1
        return min(len(tokens), max_tokens)

    def _finish_reason(self, tokens: Sequence[int], sampling: SamplingOptions) -> str:
        """``"stop"`` if the completion ends at an end-of-sequence id, else ``"length"``."""
        return "stop" if tokens and self._stops(tokens[-1], sampling) else "length"

    def _completion(self, tokens: Sequence[int], sampling: SamplingOptions) -> Completion:
        return Completion(list(tokens), self.completion_text(tokens), self._finish_reason(tokens, sampling))

    @abc.abstractmethod
    def completion_text(self, tokens: Sequence[int]) -> str:
        """The text of generated ids (special tokens skipped)."""

    # -- what the loaded model serves ---------------------------------------------------------------
    def _served_kinds(self) -> Mapping[str, str]:
        """Each kind this loaded model serves, mapped to how (``"hook"`` or ``"recompute"``).
        Default: every kind in ``supported_points``, read by hooks. A backend narrows it to what
        the model's family has."""
        return {kind: "hook" for kind in self.supported_points}

    def _missing_reason(self, kind: str) -> str:
        """Why this model does not serve ``kind`` (said in ``KindNotInFamily``)."""
        if kind not in self.supported_points:
            return f"the {self.backend} backend does not serve it"
        return missing_reason(kind)

    def _writable_kinds(self) -> list[str]:
        served = self._served_kinds()
        allowed = self.writable_points
        return [k for k in served if KINDS[k].writable and (allowed is None or k in allowed)]

    def points(self) -> dict[str, PointInfo]:
        """Every kind this loaded model serves on this backend, in forward order, with one
        token's value shape, whether it can be written and how it is read."""
        served = self._served_kinds()
        writable = set(self._writable_kinds())
        out = {}
        for kind in (k for k in KINDS if k in served):
            meta = KINDS[kind]
            address = Address(kind, 0 if meta.per_layer else None)
            how: Literal["hook", "recompute"] = "recompute" if served[kind] == "recompute" else "hook"
            out[kind] = PointInfo(
                kind,
                value_shape(address, self.info),
                meta.per_layer,
                kind in writable,
                how,
                meta.meaning,
                self._kind_layers(kind) if meta.per_layer else None,
            )
        return dict(sorted(out.items(), key=lambda kv: Address(kv[0], 0 if kv[1].per_layer else None).sort_key()))

    def _kind_layers(self, kind: str) -> tuple[int, ...] | None:
        """The layers ``kind`` exists at when not every layer (``None``: every layer); backends
        whose layers differ (dense and mixture-of-experts layers mixed) override it."""
        return None

    def _check_served(self, addresses: Iterable[Address]) -> None:
        """``KindNotInFamily`` for the first address whose kind this model does not have."""
        served = self._served_kinds()
        for address in addresses:
            if address.kind in served or address.kind not in self.supported_points:
                continue
            raise KindNotInFamily(
                f"{address}: this {self.info.architecture} model has no {address.kind} on the {self.backend} "
                f"backend ({self._missing_reason(address.kind)}); it serves: {', '.join(served)}",
                address=address,
                valid=tuple(served),
            )

    # -- SAEs and probes ----------------------------------------------------------------------------
    @property
    def saes(self) -> Mapping[str, Sae]:
        """The SAEs and probes attached to this model, by name (read-only)."""
        return types.MappingProxyType(self._saes)

    def attach_sae(self, name: str, sae: Sae | str | os.PathLike[str]) -> Sae:
        """Attach an SAE, transcoder or probe (an :class:`Sae`, or a folder :func:`load_sae`
        reads) under ``name``: readouts (``Features(name, ...)``) and feature writes
        (``FeatureWrite(name, ...)``) then name it. Its address must be one this model serves,
        with the SAE's width. Returns the attached :class:`Sae`.

        Raises ``InvalidFeatures`` for a taken name or a width mismatch, ``KindNotInFamily`` /
        ``UnsupportedAddress`` for an address this model cannot serve, ``UnsupportedSae`` for
        a folder that cannot be read, and ``StaticConfigError`` on a ``vllm-static`` model whose
        engine is already built."""
        self._check_open()
        check_sae_name(name)
        if name in self._saes:
            raise InvalidFeatures(f"an SAE is already attached as {name!r}; detach_sae({name!r}) first")
        loaded = load_sae(sae)
        self._check_sae_fits(name, loaded)
        self._attach(name, loaded)
        self._saes[name] = loaded
        return loaded

    def detach_sae(self, name: str) -> None:
        """Forget the SAE attached as ``name`` (``UnknownSae`` if there is none)."""
        self._check_open()
        self._sae(name)
        self._detach(name)
        del self._saes[name]

    def _attach(self, name: str, sae: Sae) -> None:
        """A backend's part of attaching (e.g. refuse after a static build); raise to refuse."""

    def _detach(self, name: str) -> None:
        """A backend's part of detaching."""

    def _sae(self, name: str) -> Sae:
        try:
            return self._saes[name]
        except KeyError:
            attached = ", ".join(sorted(self._saes)) or "none (model.attach_sae(name, sae) attaches one)"
            raise UnknownSae(
                f"no SAE is attached as {name!r}; attached: {attached}", name=name, valid=list(self._saes)
            ) from None

    def _check_sae_fits(self, name: str, sae: Sae) -> None:
        """``InvalidFeatures`` unless ``sae`` reads (and writes) addresses this model serves, at
        their widths."""
        check_sae_fits(name, sae, self.info, self.supported_points, self._check_served)

    def _split_points(self, points: Iterable[Any]) -> tuple[list[Any], tuple[Features, ...]]:
        """Addresses apart from feature readouts (``Features``, ``"features:..."``, ``{"sae": ...}``)."""
        return split_points(points)

    def _stream_readouts(self, features: Iterable[Any]) -> list[Features]:
        """The readouts a ``stream`` call asks for (``features=``): readouts only."""
        addresses, readouts = self._split_points(features)
        if addresses:
            raise InvalidOption(
                f"stream(features=...) takes feature readouts (Features or 'features:NAME...'), got {addresses[0]!r}; "
                "to capture activations over a generation use capture_generation"
            )
        return list(readouts)

    def _check_readouts(self, readouts: Sequence[Features]) -> dict[str, Sae]:
        used: dict[str, Sae] = {}
        for spec in readouts:
            sae = self._sae(spec.sae)
            check_readout(spec, sae)
            used[spec.sae] = sae
        return used

    def _resolve_feature_writes(self, writes: Sequence[AnyWrite]) -> tuple[list[AnyWrite], dict[str, Sae]]:
        """Feature writes made concrete: ``add`` becomes a plain write of its scaled decoder
        direction at the SAE's output address; ``clamp``/``ablate`` are bound to its address."""
        return resolve_feature_writes(
            writes, self._sae, self.info, transcoder_clamps=self.transcoder_clamps, backend=self.backend
        )

    # -- adapters ---------------------------------------------------------------------------------
    @property
    def adapters(self) -> Mapping[str, Adapter]:
        """The LoRA adapters registered on this model, by name (read-only); a request names one
        with ``adapter=`` (``None``: the base model)."""
        return types.MappingProxyType(self._adapters)

    def load_adapter(self, name: str, path: str | os.PathLike[str] | None = None) -> Adapter:
        """Register the LoRA adapter in ``path`` (a PEFT adapter folder, or a shipped name such as
        ``"interp:tiny-lora"``; default: ``name`` itself) under ``name``, checked against this
        model before any compute. Requests then run under it with ``adapter=name``, each alone:
        other requests, in flight or batched beside it, keep their own adapter or none.

        Raises ``InvalidAdapter`` for a taken name, a folder that is no LoRA adapter, weights of
        another model's shapes, a rank over the backend's limit, or a backend that serves no
        adapters (the message names one that does)."""
        self._check_open()
        if not isinstance(name, str) or not name or name == "__base__":
            raise InvalidAdapter(f"an adapter's name is a non-empty string other than '__base__', got {name!r}")
        if name in self._adapters:
            raise InvalidAdapter(f"an adapter is already registered as {name!r}", name=name, valid=list(self._adapters))
        adapter = check_adapter(name, name if path is None else path, self.info, max_rank=self._max_adapter_rank())
        self._load_adapter(adapter)
        self._adapters[name] = adapter
        return adapter

    def _max_adapter_rank(self) -> int | None:
        """The largest LoRA rank this backend serves (``None``: any)."""
        return None

    def _load_adapter(self, adapter: Adapter) -> None:
        """A backend's part of registering an adapter (load it, or tell its engine); raise
        ``InvalidAdapter`` to refuse."""
        raise InvalidAdapter(
            f"the {self.backend} backend serves no adapters; the eager backend (PEFT) and the vllm backend "
            "(vLLM's LoRA, enable_lora=True) do",
            name=adapter.name,
        )

    def _check_adapter(self, adapter: Any) -> str | None:
        """The registered name a request's ``adapter=`` means: ``None`` (the base model), a
        registered name, or an adapter folder or shipped name, registered under that spelling on
        first use. Anything else is ``UnknownAdapter``, listing the registered ones."""
        if adapter is None:
            return None
        if isinstance(adapter, os.PathLike):
            adapter = os.fspath(adapter)
        if not isinstance(adapter, str):
            raise InvalidAdapter(
                f"adapter must be a registered adapter's name, an adapter folder or None, got {type(adapter).__name__}"
            )
        if adapter in self._adapters:
            return adapter
        if is_adapter_folder(adapter):
            self.load_adapter(adapter)
            return adapter
        known = ", ".join(sorted(self._adapters)) or "none (model.load_adapter(name, path) registers one)"
        raise UnknownAdapter(
            f"no adapter is registered as {adapter!r}, and it is no adapter folder; registered: {known} "
            "(None is the base model)",
            name=adapter,
            valid=sorted(self._adapters),
        )

    def _row_adapters(self, adapter: Any, n_rows: int) -> list[str | None]:
        """``adapter`` as one checked adapter (or ``None``) per row of a batch: a single name (or
        ``None``) is every row's; a list gives one per row."""
        if adapter is None or isinstance(adapter, (str, os.PathLike)):
            return [self._check_adapter(adapter)] * n_rows
        if not isinstance(adapter, Sequence):
            raise InvalidAdapter(f"adapter must be a name, a folder, None or a list of them per row, got {adapter!r}")
        names = list(adapter)
        if len(names) != n_rows:
            raise InvalidAdapter(
                f"adapter lists {len(names)} adapters but the batch has {n_rows} rows; give one per row "
                "(None for the base model) or one for every row"
            )
        return [self._check_adapter(name) for name in names]

    # -- request checks ---------------------------------------------------------------------------
    def _check_n_logprobs(self, n_logprobs: Any) -> int:
        limit = self._max_logprobs()
        if (
            isinstance(n_logprobs, bool)
            or not isinstance(n_logprobs, numbers.Integral)
            or not 0 <= int(n_logprobs) <= limit
        ):
            raise InvalidOption(
                f"n_logprobs must be an int from 0 to {limit} on this model, got {short_repr(n_logprobs)}"
            )
        return int(n_logprobs)

    def _max_logprobs(self) -> int:
        """The most ``(token, logprob)`` pairs a stream step may carry (default: the vocabulary)."""
        return self.info.vocab_size

    def _check_sampling(self, sampling: Mapping[str, Any]) -> SamplingOptions:
        return SamplingOptions.from_kwargs(sampling, self.sampling_options)

    def _check_points(self, points: Iterable[AddressLike], *, required: bool) -> dict[Address, Address]:
        if isinstance(points, (str, Address)) or is_point_tuple(points):
            points = [points]
        try:
            listed = list(points)
        except TypeError:
            raise InvalidAddress(
                f"points must be a list of addresses (Address or strings such as 'resid_post.0'), "
                f"got {type(points).__name__}",
                address=points,
            ) from None
        if not listed and not required:
            return {}
        mapping = requested_points(listed, self.info, self.supported_points)
        self._check_served(mapping.values())
        return mapping

    def _check_writes(self, steering_spec: SteeringSpec | None) -> tuple[list[AnyWrite], dict[str, Sae]]:
        steering_spec = one_spec(steering_spec)
        if steering_spec is None:
            return [], {}
        writes, used = self._resolve_feature_writes(steering_spec.writes)
        self._check_served(w.address.resolve(self.info.n_layers) for w in writes if w.address is not None)
        return check_spec(SteeringSpec(writes), self.info, self._writable_kinds()), used

    def _check_capture(
        self, token_ids: Any, points: Iterable[Any], steering_spec: SteeringSpec | None, adapter: Any = None
    ) -> CheckedRequest:
        """The checks at the top of a capture over the prompt (at least one point);
        ``steering_spec`` may be a list of specs, applied in order."""
        return self._check_capture_batch([token_ids], points, one_spec(steering_spec), adapter)[0]

    def _check_capture_batch(
        self, rows: Iterable[Any], points: Iterable[Any], steering_spec: RowSpecs, adapter: Any = None
    ) -> list[CheckedRequest]:
        """:meth:`_check_capture` for several prompts sharing the points; ``steering_spec`` is
        one spec for every row, or a list of one spec (or ``None``) per row; ``adapter`` likewise
        one adapter (or ``None``) for every row or a list of one per row."""
        self._check_open()
        given = list(rows)
        checked = [check_token_ids(row, self.info) for row in given]
        if not checked:
            raise InvalidTokens("no prompts given; a batch needs at least one row of token ids")
        addresses, readouts = self._split_points(points)
        mapping = self._check_points(addresses, required=not readouts)
        saes = self._check_readouts(readouts)
        specs = [  # chat span names resolved per row, against that row's ChatTokens; open steer() blocks added
            with_blocks(self, resolve_named_positions(spec, row, len(ids)), row, ids, 0, self._special_ids)
            for spec, row, ids in zip(row_specs(steering_spec, len(checked)), given, checked, strict=True)
        ]
        resolved: dict[int, tuple[list[AnyWrite], dict[str, Sae]]] = {}
        for spec in specs:  # a spec shared by several rows is checked once
            if id(spec) not in resolved:
                resolved[id(spec)] = self._check_writes(spec)
        adapters = self._row_adapters(adapter, len(checked))
        requests = []
        for ids, spec, row_adapter in zip(checked, specs, adapters, strict=True):
            writes, written = resolved[id(spec)]
            check_write_shapes(writes, len(ids), len(ids))
            request = CheckedRequest(
                ids, mapping, writes, readouts=readouts, saes={**saes, **written}, adapter=row_adapter
            )
            self._check_request(request)
            requests.append(request)
        return requests

    def _check_generation(
        self,
        token_ids: Any,
        points: Iterable[Any],
        *,
        max_tokens: Any,
        steering_spec: SteeringSpec | Sequence[SteeringSpec] | None,
        sampling: Mapping[str, Any],
        n_logprobs: Any = 0,
        lens: LensRequest | None = None,
        adapter: Any = None,
    ) -> CheckedRequest:
        """The checks at the top of ``generate`` / ``capture_generation`` / ``stream`` (points
        may be empty: then nothing is captured; ``lens``: the logit lens to read per step)."""
        self._check_open()
        n_logprobs = self._check_n_logprobs(n_logprobs)
        max_tokens = check_max_tokens(max_tokens)
        ids = check_token_ids(token_ids, self.info, extra=max_tokens)
        options = self._check_sampling(sampling)
        addresses, readouts = self._split_points(points)
        mapping = self._check_points(addresses, required=False)
        saes = self._check_readouts(readouts)
        spec = resolve_named_positions(one_spec(steering_spec), token_ids, len(ids))
        writes, written = self._check_writes(with_blocks(self, spec, token_ids, ids, max_tokens, self._special_ids))
        check_write_shapes(writes, len(ids), len(ids) + max_tokens)
        request = CheckedRequest(
            ids,
            mapping,
            writes,
            max_tokens,
            options,
            n_logprobs,
            readouts=readouts,
            saes={**saes, **written},
            lens=self._check_lens(lens, token_ids, len(ids)),
            adapter=self._check_adapter(adapter),
        )
        if request.lens is not None and request.adapter is not None:
            refuse_adapted_unembedding(self._adapters[request.adapter], "the logit lens")
        self._check_request(request)
        return request

    def _check_lens(self, lens: Any, tokens: Any, n_prompt: int) -> CheckedLens | None:
        """``lens`` checked against this model and the prompt (:func:`check_lens`)."""
        return check_lens(lens, tokens, n_prompt, self.info, self.supported_points, self._check_served)

    def _check_request(self, request: CheckedRequest) -> None:
        """A backend's own limits on a request that passed the shared checks (raise to refuse)."""

    # -- chat ---------------------------------------------------------------------------------------
    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        reasoning_markers: Sequence[tuple[str, str]] | None = None,
        **template_kwargs: Any,
    ) -> ChatTokens:
        """``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered by this model's own
        chat template (``template``, a Jinja string, overrides it) as a :class:`ChatTokens`: the
        ids ``apply_chat_template(messages, tokenize=True)`` gives, with each message's span and
        each reasoning section's (``reasoning_markers``: the ``(start, end)`` pairs that mark one;
        default ``<think>…</think>`` and ``<thinking>…</thinking>``). ``template_kwargs`` reach the
        template (``tools=``, ``enable_thinking=``, ...). Pass the result as a prompt to name
        positions by span (``Write(..., positions="user[-1].last")``).

        Raises ``NoChatTemplate`` when the tokenizer has none (pass ``template=``) and
        ``InvalidChat`` for bad messages or messages the template refuses."""
        self._check_open()
        return build_chat_tokens(
            self._chat_tokenizer(),
            messages,
            add_generation_prompt=add_generation_prompt,
            template=template,
            reasoning_markers=reasoning_markers,
            **template_kwargs,
        )

    def _special_ids(self) -> frozenset[int]:
        """The tokenizer's special tokens (what ``steer(..., position_mask=SteerMask.SPECIAL_TOKENS)``
        leaves unsteered)."""
        ids = getattr(self._chat_tokenizer(), "all_special_ids", None) or ()
        return frozenset(int(i) for i in ids)

    def _chat_tokenizer(self) -> Any:
        """The Hugging Face tokenizer whose ``apply_chat_template`` renders chats (a backend
        serving one returns it; :class:`~interp_engine.tokens.TokenizerMixin` does)."""
        raise UnsupportedOperation(
            f"the {self.backend} backend has no Hugging Face tokenizer to render chats with; "
            "the eager and vllm backends have one"
        )

    # -- the protocol: what each backend computes -------------------------------------------------
    @abc.abstractmethod
    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        """Token ids ``[1, n]`` (a list of texts: ``[batch, n_max]``, right-padded)."""

    @abc.abstractmethod
    def to_string(self, tokens: Any) -> str | list[str]:
        """Text of ids (a 2-D input gives one string per row)."""

    @abc.abstractmethod
    def to_str_tokens(self, tokens: Any) -> list[str]:
        """One string per token, of a text or of ids."""

    @abc.abstractmethod
    async def warmup(self) -> None:
        """Build the engine now, on the running loop."""

    @abc.abstractmethod
    async def capture(
        self,
        token_ids: Sequence[int],
        points: Iterable[AddressLike],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Results:
        """Activations at ``points`` over the prompt tokens (and any feature readouts), under
        ``adapter`` (``None``: the base model)."""

    @abc.abstractmethod
    async def generate(self, token_ids: Sequence[int], *, max_tokens: int, **sampling: Any) -> Completion:
        """A completion, greedy unless sampling options are given."""

    async def capture_generation(
        self,
        token_ids: Sequence[int],
        points: Iterable[AddressLike],
        *,
        max_tokens: int = 8,
        steering_spec: SteeringSpec | Sequence[SteeringSpec] | None = None,
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> tuple[Completion, Results]:
        """A completion and activations over prompt + every generated token (and with ``lens``,
        a :class:`LensResult` keyed by the request), under ``adapter`` (``None``: the base model).

        The request is checked here (:meth:`_check_generation`); the backend's
        :meth:`_capture_generation` serves it."""
        request = self._check_generation(
            token_ids,
            points,
            max_tokens=max_tokens,
            steering_spec=steering_spec,
            sampling=sampling,
            lens=lens,
            adapter=adapter,
        )
        return await self._capture_generation(request)

    async def _capture_generation(self, request: CheckedRequest) -> tuple[Completion, Results]:
        """The completion and results of a checked ``capture_generation`` request: what a backend
        implements, unless it overrides ``capture_generation`` itself."""
        raise UnsupportedOperation(f"the {self.backend} backend does not capture over a generation")

    async def stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
        features: Iterable[Any] = (),
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamStep]:
        """Generated tokens one at a time, each with its top-n logprobs, the ``features``
        readouts (``StreamStep.features``) and the ``lens`` (``StreamStep.lens``) at the position
        that produced it, under ``adapter`` (``None``: the base model).

        The request is checked here (:meth:`_check_generation`, with ``features`` readouts only),
        on the first step asked for; the backend's :meth:`_stream` produces the steps, and is
        closed as soon as the caller stops."""
        request = self._check_stream(
            token_ids, max_tokens, n_logprobs, steering_spec, features, lens, adapter, sampling
        )
        async with contextlib.aclosing(self._stream(request)) as steps:
            async for step in steps:
                yield step

    async def collect_steps(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
        features: Iterable[Any] = (),
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> list[StreamStep]:
        """Every step :meth:`stream` yields for the same arguments, at once, when the generation
        ends. A backend may serve it in one piece instead of step by step (vLLM: the completion
        comes back once and the workers' readouts and lens are fetched once, not every step).

        The request is checked here, as :meth:`stream` checks it; the backend's
        :meth:`_collect_steps` produces the steps."""
        request = self._check_stream(
            token_ids, max_tokens, n_logprobs, steering_spec, features, lens, adapter, sampling
        )
        return await self._collect_steps(request)

    def _check_stream(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        n_logprobs: int,
        steering_spec: SteeringSpec | None,
        features: Iterable[Any],
        lens: LensRequest | None,
        adapter: str | None,
        sampling: dict[str, Any],
    ) -> CheckedRequest:
        """A :meth:`stream` or :meth:`collect_steps` request, checked (:meth:`_check_generation`,
        with ``features`` readouts only)."""
        return self._check_generation(
            token_ids,
            self._stream_readouts(features),
            max_tokens=max_tokens,
            steering_spec=steering_spec,
            sampling=sampling,
            n_logprobs=n_logprobs,
            lens=lens,
            adapter=adapter,
        )

    def _stream(self, request: CheckedRequest) -> AsyncGenerator[StreamStep, None]:
        """The steps of a checked ``stream`` request (an ``async def`` that yields them): what a
        backend implements, unless it overrides ``stream`` itself."""
        raise UnsupportedOperation(f"the {self.backend} backend does not stream")

    async def _collect_steps(self, request: CheckedRequest) -> list[StreamStep]:
        """The steps of a checked ``collect_steps`` request: :meth:`_stream`'s, collected (a
        backend that can produce them in one piece overrides this)."""
        async with contextlib.aclosing(self._stream(request)) as steps:
            return [step async for step in steps]

    async def capture_attention(
        self,
        token_ids: Sequence[int],
        layers: Iterable[int],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Activations:
        """Attention probabilities ``[heads, q, k]`` keyed by ``Address("attn_pattern", L)``,
        under ``steering_spec`` and ``adapter`` if given. The dict also answers ``result[L]``
        (an int layer) with the public ``interp-engine`` package's ``{"scores", "probs",
        "value"}`` (:class:`~interp_engine.results._attention.AttentionPatterns`), where this
        model serves ``attn_scores`` and ``attn_v``."""
        self._check_open()
        if isinstance(layers, int):
            layers = [layers]
        listed = list(layers)
        points = [Address("attn_pattern", layer) for layer in listed]
        if not points:
            raise UnsupportedAddress(
                "capture_attention needs at least one layer", address=None, valid=f"0..{self.info.n_layers - 1}"
            )
        extra: dict[str, Any] = {} if adapter is None else {"adapter": adapter}  # a backend before adapters
        wanted = points + self._attention_extras(listed)
        values = await self.capture(token_ids, wanted, steering_spec=steering_spec, **extra)
        return AttentionPatterns(
            {a: v for a, v in values.items() if isinstance(a, Address) and isinstance(v, torch.Tensor)}
        )

    def _attention_extras(self, layers: list[int]) -> list[Address]:
        """The scores and values ``capture_attention`` reads beside the patterns, for the public
        package's ``result[layer]``: the kinds of the two this model serves (a backend whose taps
        are fixed in advance narrows it to what it declared)."""
        extras = attention_extras(layers, self._served_kinds())
        if isinstance(self, StaticTaps):
            declared = set(self.static_points)
            extras = [a for a in extras if a.resolve(self.info.n_layers) in declared]
        return extras

    async def decode_residuals(
        self, acts: torch.Tensor | Mapping[Address, torch.Tensor]
    ) -> torch.Tensor | dict[Address, torch.Tensor]:
        """Final norm + unembedding of residual-stream vectors ``[..., d_model]`` (the logit
        lens); a mapping is decoded value by value, every value checked before any is decoded."""
        self._check_open()
        if isinstance(acts, Mapping):
            checked = {address: check_residuals(value, self.info) for address, value in acts.items()}
            return {address: await self._decode_residuals(value) for address, value in checked.items()}
        return await self._decode_residuals(check_residuals(acts, self.info))

    @abc.abstractmethod
    async def _decode_residuals(self, residuals: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]`` (float32, CPU) of one checked tensor ``[..., d_model]``."""
