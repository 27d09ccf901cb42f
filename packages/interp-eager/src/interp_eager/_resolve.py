"""Resolve a loaded HF causal LM into a :class:`~interp_eager._families.Family` from its structure.

Nothing here is keyed by ``model_type`` except :data:`~interp_eager._families.FAMILY_DATA` (what
structure cannot tell). Resolution has two passes:

*Static* (:func:`resolve_static`, also run on a weightless ``meta`` copy before weights load):

- the decoder layers: the shallowest ``nn.ModuleList`` of blocks of one class holding an attention;
- in each layer, the attention (the submodule named or classed ``attn``/``attention``), its linear
  layers (a 2-D weight: ``nn.Linear``, GPT-2's ``Conv1D``, ...) and its norms (classes named
  ``*Norm*``); the MLP: the other submodule holding a linear layer back to ``d_model`` (or, with no
  such container, the layer's own linear layers, as OPT's ``fc1``/``fc2``); a mixture of experts:
  an MLP holding a router (a ``[n_experts, d_model]`` weight) and an experts module (parameters
  with a leading ``n_experts`` axis, or a list of ``n_experts`` MLPs);
- the final norm: a norm-classed child of the module that holds the layers.

*Traced* (:func:`resolve`): one forward over a few tokens with hooks on every module records
what each receives and returns, and decides what names cannot:

- the heads and their width are those of the queries, keys and values the attention function
  receives: transformers' attention interface, or else an own ``_attn(query, key, value, ...)``
  method of the attention module or a module inside it (GPT-J, GPT-Neo, CodeGen; its
  ``attn_scores`` are then read where its softmax receives them, unless :data:`FAMILY_DATA` says
  how it scales them), or else the attention module's own forward (Bloom, Falcon, MPT, XGLM): the
  operands of the ``q @ k^T`` product whose result its softmax normalises, what that softmax
  receives (ALiBi biases and masks included) and the operand its output multiplies (or the
  arguments of ``scaled_dot_product_attention``); keys and values repeated for each query head
  they serve (Falcon's new decoder architecture) are read once per key/value head;
  whether it also normalises over learned sink logits (gpt-oss's ``s_aux``: no ``attn_scores``);
- the output projection is the attention linear whose output *is* the attention's output, or
  whose output plus ``resid_pre`` is (Bloom's attention adds the residual inside: ``attn_out`` is
  then that projection's output); likewise an MLP whose output is its down projection's plus the
  residual (Bloom, MPT) has ``mlp_out`` at the down projection;
- a norm whose output is the output projection's (down projection's) input is a sub-norm
  (BitNet's ``attn_sub_norm``, ``ffn_sub_norm``): ``attn_z`` (``mlp_post``) is what it receives;
- the values are where the tensor the attention function receives as ``value`` is found in a
  projection's output (``v_proj``; or the last third of ``[q | k | v]``; or per-head ``[q k v]``;
  or per key/value head after its queries; or CodeGen's model-parallel groups of ``[q | v | k]``);
- a norm of the layer whose input is the attention's (MLP's) output is a sandwich norm
  (``attn_out_post``/``mlp_out_post``) -- Gemma 2's ``post_attention_layernorm`` -- whatever its name;
  the layer's output being a norm's output is a post-norm (OPT-350m) block;
- a second forward with the attention's output shifted tells parallel blocks (the MLP's input does
  not move) from sequential ones;
- negating one input projection's output (or half of a fused one) and seeing the MLP's hidden
  flip sign tells the linear (``up``) branch of a gated MLP from the gate;
- a router tap (the first linear map to ``n_experts`` outputs inside the router) must see the
  logits the router returns;
- the q/k norms' tensor layout, the experts' index/weight arguments, a projection between the
  final norm and the unembedding (OPT's ``project_out``) and a constant logit scale (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``) are read off the recorded tensors; the residual
  identity ``resid_post = resid_pre + attention part + MLP part`` is checked (up to the dtype's
  rounding), and a model it does not hold for (a residual multiplier) is refused.

Whatever cannot be placed is an ``UnsupportedArchitecture`` naming the module and the model.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from interp_engine import UnsupportedArchitecture

from ._families import FAMILY_DATA, Family, QkNormLayout, QkvLayout, verified_model_types

_ATTN_NAME = re.compile(r"attn|attention", re.IGNORECASE)
_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)
_Q_NAME = re.compile(r"^(q|query)(_|$)|^q[a-z]*norm", re.IGNORECASE)
_K_NAME = re.compile(r"^(k|key)(_|$)|^k[a-z]*norm", re.IGNORECASE)
_TRACE_LENGTHS = (7, 11, 13, 17)


def _where(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (model_type {getattr(config, 'model_type', '?')!r})"


def _refuse(model: nn.Module, what: str) -> UnsupportedArchitecture:
    verified = ", ".join(verified_model_types())
    return UnsupportedArchitecture(
        f"the eager backend cannot serve {_where(model)}: {what}. "
        f"(It resolves architectures from their module tree; model types verified on it: {verified}.)"
    )


# -- static: the module tree ------------------------------------------------------------------


def linear_io(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer (a module with a 2-D ``weight``), else ``None``."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return None
    if not isinstance(module, nn.Linear) and _NORM_CLASS.search(type(module).__name__):
        return None
    if hasattr(module, "nf") and not isinstance(module, nn.Linear):  # GPT-2's Conv1D: weight [in, out]
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def is_norm(module: nn.Module) -> bool:
    """A normalisation module: torch's norms, or a class named ``*Norm*`` that is no linear layer
    (Cohere's per-head q/k ``LayerNorm`` keeps a ``[heads, d_head]`` weight)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    return bool(_NORM_CLASS.search(type(module).__name__)) and not isinstance(module, (nn.Linear, nn.Embedding))


def _n_layers(config: Any) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


def _find_attention(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The shallowest submodule of ``layer`` named or classed like an attention, holding linear layers."""
    frontier = list(_children(layer))
    while frontier:
        found = [
            (name, m)
            for name, m in frontier
            if (_ATTN_NAME.search(name.rsplit(".", 1)[-1]) or _ATTN_NAME.search(type(m).__name__))
            and any(linear_io(sub) for sub in m.modules())
        ]
        if found:
            return found[0]
        frontier = [(f"{name}.{n}", c) for name, m in frontier for n, c in m.named_children()]
    return None


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    expected = _n_layers(model.config)
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        if expected is not None and len(module) != expected:
            continue
        if _find_attention(module[0]) is not None:
            return name, module
    raise _refuse(
        model,
        f"no nn.ModuleList of {expected or 'N'} decoder layers of one class, each holding an attention module",
    )


@dataclass
class _Mlp:
    """One layer's MLP, paths relative to the layer."""

    block: str  # the module whose input is mlp_in and output mlp_out ("" for a flat layer: see in_/out)
    mlp_in: str
    mlp_out: str
    inputs: list[str] = field(default_factory=list)  # dense: the input projections
    down: str | None = None
    fused: bool = False  # one input projection holding [gate | up]
    router: str | None = None
    experts: str | None = None
    n_experts: int = 0


def _linears(root: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> list[tuple[str, tuple[int, int]]]:
    out = []
    for name, m in root.named_modules(prefix=prefix):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        io = linear_io(m)
        if io is not None:
            out.append((name, io))
    return out


def _find_router(block: nn.Module, prefix: str, d_model: int) -> tuple[str, str, int] | None:
    """``(router, experts, n_experts)`` inside an MoE block: a ``[n_experts, d_model]`` weight's owner,
    and a module whose parameters have a leading ``n_experts`` axis (or a list of ``n_experts`` modules)."""
    for rname, router in block.named_modules(prefix=prefix):
        weight = getattr(router, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or int(weight.shape[1]) != d_model:
            continue
        n = int(weight.shape[0])
        if n < 2:
            continue
        for ename, experts in block.named_modules(prefix=prefix):
            if experts is router or not ename:
                continue
            params = list(experts.parameters(recurse=False))
            stacked = any(p.dim() == 3 for p in params) and all(p.dim() >= 2 and int(p.shape[0]) == n for p in params)
            listed = isinstance(experts, nn.ModuleList) and len(experts) == n
            if stacked or listed:
                return rname, ename, n
    return None


def _resolve_mlp(model: nn.Module, layer: nn.Module, attn: str, d_model: int) -> _Mlp:
    where = type(layer).__name__
    candidates = []
    flat = []
    for name, child in _children(layer):
        if name == attn or attn.startswith(name + ".") or is_norm(child):
            continue
        io = linear_io(child)
        if io is not None:
            flat.append((name, io))
            continue
        if any(io[1] == d_model for _, io in _linears(child, name)) or _find_router(child, name, d_model):
            candidates.append((name, child))
    if len(candidates) > 1:
        names = ", ".join(n for n, _ in candidates)
        raise _refuse(model, f"{where} has more than one MLP-like module ({names})")
    if not candidates:
        flat_ins = [n for n, io in flat if io[0] == d_model]
        flat_downs = [n for n, io in flat if io[1] == d_model]
        if len(flat_downs) != 1 or not flat_ins:
            raise _refuse(model, f"could not find the MLP of {where} (no module with a projection back to d_model)")
        return _Mlp("", flat_ins[0], flat_downs[0], inputs=flat_ins, down=flat_downs[0])
    name, block = candidates[0]
    routed = _find_router(block, name, d_model)
    if routed is not None:
        router, experts, n = routed
        return _Mlp(name, name, name, router=router, experts=experts, n_experts=n)
    linears = _linears(block, name)
    downs = [(n, io) for n, io in linears if io[1] == d_model]
    if len(downs) != 1:
        raise _refuse(model, f"the MLP {name} of {where} has {len(downs)} projections back to d_model, not one")
    down, (hidden, _) = downs[0]
    ins = [(n, io) for n, io in linears if io[0] == d_model and n != down]
    if len(ins) == 1 and ins[0][1][1] == 2 * hidden:
        return _Mlp(name, name, name, inputs=[ins[0][0]], down=down, fused=True)
    ins = [(n, io) for n, io in ins if io[1] == hidden]
    if len(ins) not in (1, 2):
        raise _refuse(model, f"could not place the input projections of the MLP {name} of {where}")
    return _Mlp(name, name, name, inputs=[n for n, _ in ins], down=down)


def _outer_norms(root: nn.Module) -> list[str]:
    """Norm modules under ``root``, not those inside another norm (StableLM's per-head norms)."""
    found: list[str] = []
    for name, m in root.named_modules():
        if name and is_norm(m) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


@dataclass
class _Static:
    layers: str
    attn: str
    attn_linears: list[tuple[str, tuple[int, int]]]
    attn_norms: list[str]
    layer_norms: list[str]  # norm-classed modules of the layer outside attention and MLP
    mlps: list[_Mlp]  # per layer
    final_norm: str | None
    d_model: int


def resolve_static(model: nn.Module) -> _Static:
    """The module-tree pass (works on a ``meta``-device model: no forward)."""
    config: Any = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model, "it is an encoder-decoder model; the eager backend serves decoder-only causal LMs")
    layers_path, layers = _find_layers(model)
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if embed is None or getattr(embed, "weight", None) is None:
        raise _refuse(model, "it has no input embedding")
    d_model = int(getattr(config, "hidden_size", None) or embed.weight.shape[1])  # the residual width
    if model.get_output_embeddings() is None:  # type: ignore[operator]
        raise _refuse(model, "it has no output embedding (unembedding)")
    found = _find_attention(layers[0])
    if found is None:  # pragma: no cover - _find_layers checked it
        raise _refuse(model, f"no attention module in {type(layers[0]).__name__}")
    attn_path, attn = found
    mlps = []
    for index, layer in enumerate(layers):
        here = _find_attention(layer)
        if here is None or here[0] != attn_path:
            raise _refuse(model, f"layer {index} has no attention module at {attn_path}")
        mlps.append(_resolve_mlp(model, layer, attn_path, d_model))
    mlp_paths = {p for m in mlps for p in (m.block, m.mlp_in, m.mlp_out) if p}
    layer_norms = [
        name
        for name in _outer_norms(layers[0])
        if not (name == attn_path or name.startswith(attn_path + "."))
        and not any(name == p or name.startswith(p + ".") for p in mlp_paths)
    ]
    attn_norms = [f"{attn_path}.{n}" for n in _outer_norms(attn)]
    # the final norm: a norm-classed child of the module holding the layers
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    parent = model.get_submodule(parent_path) if parent_path else model
    finals = [n for n, m in _children(parent, parent_path) if is_norm(m)]
    return _Static(
        layers=layers_path,
        attn=attn_path,
        attn_linears=_linears(attn, attn_path),
        attn_norms=attn_norms,
        layer_norms=layer_norms,
        mlps=mlps,
        final_norm=finals[-1] if finals else None,
        d_model=d_model,
    )


# -- traced: what each module receives and returns -------------------------------------------


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
            if item is not None:
                break
    return None


@dataclass
class _Record:
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    args: dict[str, list[Any]] = field(default_factory=dict)
    attention: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sinks: bool = False
    logits: torch.Tensor | None = None


@contextlib.contextmanager
def _recording(
    model: nn.Module,
    record: _Record,
    attn_modules: list[nn.Module],
    attn_fn: str | None,
    edits: dict[str, Callable[[Any], Any]] | None = None,
) -> Iterator[None]:
    from ._plan import AttentionCall, add_attention_tap, attention_owner

    handles: list[Any] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            value = args[0] if args else kwargs.get("hidden_states", _first_tensor(list(kwargs.values())))
            if isinstance(value, torch.Tensor):
                record.inputs[name] = value.detach().clone()
            record.args[name] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]

        return hook

    def post(name: str) -> Callable[..., Any]:
        edit = (edits or {}).get(name)

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if edit is not None:
                output = edit(output)
            value = _first_tensor(output)
            if value is not None:
                record.outputs[name] = value.detach().clone()
            return output if edit is not None else None

        return hook

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name)))
        for index, module in enumerate(attn_modules):

            def tap(call: AttentionCall, index: int = index) -> None:
                if call.value is not None and index not in record.attention:
                    record.attention[index] = (call.query.detach(), call.key.detach(), call.value.detach())
                    record.sinks = record.sinks or call.sinks is not None

            owner, method = attention_owner(module, attn_fn)
            handles.append(add_attention_tap(owner, tap, method=method))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1), b.reshape(-1)))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the tensors' dtype (a few ulps; 1e-4 relative in float32)."""
    if a.numel() != b.numel():
        return False
    eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0 for t in (a, b))
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    scale = float(b.abs().max().clamp_min(1e-6))
    return float((a - b).abs().max()) <= max(1e-4, 8 * eps) * scale


def _run(model: nn.Module, ids: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False)


def _trace_ids(model: nn.Module, avoid: set[int]) -> torch.Tensor:
    length = next(n for n in _TRACE_LENGTHS if n not in avoid)
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=generator)
    device = next(model.parameters()).device
    return ids.to(device)


def _value_layout(
    out: torch.Tensor, value: torch.Tensor, heads: int, kv_heads: int, d: int
) -> tuple[QkvLayout, int, int] | None:
    """Where the values ``value`` (``[batch, kv_heads, tokens, d]`` as the attention function got
    them) sit in a projection's output ``out``: ``(layout, kv_heads, groups)``."""
    from ._plan import VALUE_SLICES

    want = value.transpose(1, 2)
    width = out.shape[-1]
    for layout, slicer in VALUE_SLICES.items():
        view_heads = kv_heads
        if layout == "v" and width % d == 0:
            view_heads = width // d
        if layout == "per-group q|k|v" and (kv_heads in (1, heads) or heads % kv_heads):
            continue  # with one or every head it is "q|k|v" or "per-head q|k|v"
        options = [g for g in (2, 4, 8, 16) if kv_heads % g == 0] if layout == "grouped q|v|k" else [1]
        for groups in options:
            try:
                got = slicer(heads, view_heads, d, groups).of(out.reshape(*want.shape[:2], width))
            except RuntimeError:
                continue
            if got.shape == want.shape and torch.equal(got, want):
                return layout, view_heads, groups
    return None


def _kv_repeat(key: torch.Tensor, value: torch.Tensor, heads: int) -> int:
    """How many times each key/value head is repeated in ``key``/``value`` (``[batch, heads, tokens,
    d]``) as the attention product received them: the largest ``r`` with every ``r`` consecutive
    heads equal (Falcon's new decoder architecture broadcasts its key/value heads), else 1."""
    n = int(key.shape[1])
    if n != heads or int(value.shape[1]) != n:
        return 1
    for r in sorted((r for r in range(2, n + 1) if n % r == 0), reverse=True):
        if all(torch.equal(t, t[:, ::r].repeat_interleave(r, dim=1)) for t in (key, value)):
            return r
    return 1


def _norm_layout(x: torch.Tensor, heads: int, d: int, tokens: int) -> QkNormLayout | None:
    if x.dim() == 4 and x.shape[1] == tokens and x.shape[2] == heads and x.shape[3] == d:
        return "tokens x heads"
    if x.dim() == 4 and x.shape[2] == tokens and x.shape[1] == heads and x.shape[3] == d:
        return "heads x tokens"
    if x.dim() == 3 and x.shape[-1] == heads * d:
        return "flat"
    return None


def resolve(model: nn.Module) -> Family:
    """The :class:`Family` of a loaded HF causal LM, from its structure and one traced forward."""
    was_training = model.training
    model.eval()  # the traced forwards run without dropout
    try:
        return _resolve(model)
    except UnsupportedArchitecture:
        raise
    except Exception as exc:  # a config or module this resolver does not understand: say what broke
        raise _refuse(model, f"resolving it failed ({type(exc).__name__}: {exc})") from exc
    finally:
        model.train(was_training)


def _resolve(model: nn.Module) -> Family:
    static = resolve_static(model)
    config: Any = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    data = FAMILY_DATA.get(model_type, {})
    layers: nn.ModuleList = model.get_submodule(static.layers)  # type: ignore[assignment]
    config_heads = getattr(config, "num_attention_heads", None)
    avoid = {int(v) for v in (config_heads, getattr(config, "num_key_value_heads", None)) if isinstance(v, int)}
    lp = [f"{static.layers}.{i}" for i in range(len(layers))]
    attn_modules = [layer.get_submodule(static.attn) for layer in layers]
    attn_fn = data.get("attn_fn")

    ids = _trace_ids(model, avoid)
    tokens = int(ids.shape[1])
    record = _trace(model, ids, attn_modules, attn_fn)
    scores_at_softmax = bool(data.get("attn_scores_at_softmax", False))
    if 0 not in record.attention and attn_fn is None:
        # no call of transformers' attention interface: an own ``_attn(query, key, value, mask)``
        # method (GPT-J's and GPT-Neo's kind), whose scores are read where its softmax gets them
        own = _own_attention_method(attn_modules[0])
        if own is not None:
            attn_fn, scores_at_softmax = own, True
            record = _trace(model, ids, attn_modules, attn_fn)
    if 0 not in record.attention and attn_fn is None:
        # the attention module computes attention in its own forward (Bloom, Falcon, MPT, XGLM):
        # read at its q @ k^T product, its softmax and the product of the softmax with the values
        attn_fn, scores_at_softmax = "forward", True
        record = _trace(model, ids, attn_modules, attn_fn)
    a0 = f"{lp[0]}.{static.attn}"
    if 0 not in record.attention:
        raise _refuse(
            model,
            f"its attention {type(attn_modules[0]).__name__} does not call transformers' attention interface, "
            "an own _attn(query, key, value, mask) method, nor a q @ k^T product whose result a softmax "
            "normalises (queries, keys and scores cannot be read)",
        )
    query, key, value = record.attention[0]
    # keys and values repeated for each query head they serve (Falcon's new decoder architecture)
    kv_repeat = _kv_repeat(key, value, int(query.shape[1]))
    key, value = key[:, ::kv_repeat], value[:, ::kv_repeat]
    # heads and their width as the attention function sees them: [batch, heads, tokens, d_head]
    n_heads, d_head = int(query.shape[1]), int(query.shape[-1])
    if int(key.shape[-1]) != d_head or int(value.shape[-1]) != d_head:
        raise _refuse(
            model,
            f"its attention {type(attn_modules[0]).__name__} gives queries, keys and values different head widths "
            f"({d_head}, {int(key.shape[-1])}, {int(value.shape[-1])}): one d_head cannot address them",
        )

    # the output projection: the attention linear whose output is the attention's output (or, where
    # the attention adds the residual to it inside -- Bloom --, whose output plus resid_pre is)
    attn_output = record.outputs.get(a0)
    resid_pre = record.inputs[lp[0]]
    o_proj = next(
        (name for name, _ in static.attn_linears if _same(record.outputs.get(f"{lp[0]}.{name}"), attn_output)), None
    )
    attn_out_at = None
    if o_proj is None and attn_output is not None:
        for name, _ in static.attn_linears:
            out = record.outputs.get(f"{lp[0]}.{name}")
            if out is not None and out.shape == attn_output.shape and _close(out + resid_pre, attn_output):
                o_proj, attn_out_at = name, name
                attn_output = out
                break
    if o_proj is None:
        raise _refuse(
            model,
            f"the output of its attention {type(attn_modules[0]).__name__} is none of its projections' outputs "
            "(it adds something other than the residual inside the attention module)",
        )
    o_in = record.inputs.get(f"{lp[0]}.{o_proj}")
    if o_in is None or int(o_in.shape[-1]) != n_heads * d_head:
        raise _refuse(model, f"the input of {o_proj} is not {n_heads} heads of {d_head} (attn_z cannot be split)")
    # the values: the projection output in which the attention function's values are found
    attn_v: str | None = None
    layout: QkvLayout = "v"
    n_kv_heads = n_heads
    qkv_groups = 1
    for name, _ in static.attn_linears:
        out = record.outputs.get(f"{lp[0]}.{name}")
        if name == o_proj or out is None:
            continue
        found = _value_layout(out, value, n_heads, int(value.shape[1]), d_head)
        if found is not None:
            attn_v, (layout, n_kv_heads, qkv_groups) = name, found
            break
    if attn_v is None:
        raise _refuse(
            model, f"could not find where its attention {type(attn_modules[0]).__name__} makes the values it attends"
        )

    # q/k norms
    q_norm = k_norm = attn_sub_norm = None
    qk_layout: QkNormLayout = "heads x tokens"
    for path in static.attn_norms:
        short = path.rsplit(".", 1)[-1]
        x = record.inputs.get(f"{lp[0]}.{path}")
        if x is None:
            continue
        is_q, is_k = bool(_Q_NAME.search(short)), bool(_K_NAME.search(short))
        if is_q == is_k:
            if _same(record.outputs.get(f"{lp[0]}.{path}"), o_in):
                # it normalises the heads' weighted values before the output projection (BitNet's
                # attn_sub_norm): attn_z is what it receives
                if int(x.shape[-1]) != n_heads * d_head:
                    raise _refuse(model, f"the input of {path} is not {n_heads} heads of {d_head}")
                attn_sub_norm = path
            continue  # a norm of both queries and keys (Llama 4's qk_norm): no q/k-norm points, q/k read after it
        found_layout = _norm_layout(x, n_heads if is_q else n_kv_heads, d_head, tokens)
        if found_layout is None:
            raise _refuse(model, f"could not read the head layout of the tensors the norm {path} sees")
        qk_layout = found_layout
        if is_q:
            q_norm = path
        else:
            k_norm = path

    # the MLP of each kind (dense, MoE): one representative layer each
    dense_index = next((i for i, m in enumerate(static.mlps) if m.router is None), None)
    moe_index = next((i for i, m in enumerate(static.mlps) if m.router is not None), None)
    rep = static.mlps[dense_index if dense_index is not None else moe_index or 0]
    mlp_in, mlp_out = rep.mlp_in, rep.mlp_out
    for m in static.mlps:
        if (m.mlp_in, m.mlp_out) != (mlp_in, mlp_out):
            raise _refuse(model, f"its layers keep their MLPs at different places ({m.mlp_in}, {mlp_in})")
    mlp_pre = mlp_pre_linear = mlp_down = mlp_sub_norm = None
    fused = False
    if dense_index is not None:
        dense = static.mlps[dense_index]
        mlp_down = dense.down
        here = f"{lp[dense_index]}."
        down_in = record.inputs.get(here + dense.down) if dense.down else None
        block = layers[dense_index].get_submodule(dense.block) if dense.block else layers[dense_index]
        for name, norm in block.named_modules(prefix=dense.block):
            # a norm between the nonlinearity and the down projection (BitNet's ffn_sub_norm)
            if name and is_norm(norm) and _same(record.outputs.get(here + name), down_in):
                mlp_sub_norm = name
        if dense.fused:
            fused = True
            mlp_pre = mlp_pre_linear = dense.inputs[0]
            if _linear_branch(model, layers[dense_index], dense, record, lp[dense_index]) != 1:
                raise _refuse(model, f"the second half of {dense.inputs[0]} is not the linear branch of its MLP")
        elif len(dense.inputs) == 2:
            up = _linear_branch(model, layers[dense_index], dense, record, lp[dense_index])
            if up is None:
                raise _refuse(model, f"could not tell the gate from the linear branch of the MLP {dense.block}")
            mlp_pre_linear = dense.inputs[up]
            mlp_pre = dense.inputs[1 - up]
        else:
            mlp_pre = dense.inputs[0]
    router = experts = None
    index_arg = weight_arg = 0
    n_experts = top_k = 0
    if moe_index is not None:
        moe = static.mlps[moe_index]
        router, experts, n_experts = moe.router, moe.experts, moe.n_experts
        args = record.args.get(f"{lp[moe_index]}.{experts}", [])
        ints = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        floats = [
            i
            for i, a in enumerate(args)
            if i and isinstance(a, torch.Tensor) and a.is_floating_point() and ints and a.shape == args[ints[0]].shape
        ]
        if len(ints) != 1 or len(floats) != 1:
            raise _refuse(model, f"could not read the chosen experts and their weights where {experts} is called")
        index_arg, weight_arg = ints[0], floats[0]
        top_k = int(args[index_arg].shape[-1])

    # an MLP that adds the residual to its own output (Bloom's, MPT's): mlp_out is its down projection's
    mlp_output = record.outputs.get(f"{lp[0]}.{mlp_out}")
    layer_output = record.outputs.get(lp[0])
    if moe_index is None and mlp_down is not None and mlp_output is not None:
        down_out = record.outputs.get(f"{lp[0]}.{mlp_down}")
        if (
            down_out is not None
            and attn_output is not None
            and down_out.shape == mlp_output.shape
            and not _same(down_out, mlp_output)
            and _close(down_out + resid_pre + attn_output, mlp_output)
        ):
            mlp_out, mlp_output = mlp_down, down_out

    # norms around the sublayers, post-norm blocks
    attn_post_norm = mlp_post_norm = None
    post_norm = False
    for path in static.layer_norms:
        x = record.inputs.get(f"{lp[0]}.{path}")
        if _same(x, attn_output):
            attn_post_norm = path
        elif _same(x, mlp_output):
            mlp_post_norm = path
        elif _same(record.outputs.get(f"{lp[0]}.{path}"), layer_output):
            post_norm = True
    if (attn_post_norm is None) != (mlp_post_norm is None):
        raise _refuse(model, "it has a sandwich norm after one sublayer but not after the other")

    # parallel or sequential: does the MLP's input move when the attention's output does?
    shifted = _Record()

    def shift(output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + 1.0
        return (output[0] + 1.0, *output[1:])

    tapped: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_recording(model, shifted, [], None, edits={a0: shift}))
        if moe_index is not None and router is not None:
            from ._plan import add_router_tap

            def keep(logits: torch.Tensor) -> torch.Tensor:
                tapped.append(logits.detach().clone())
                return logits

            def outputs(module: nn.Module, args: Any, output: Any) -> None:
                items = output if isinstance(output, (tuple, list)) else (output,)
                returned.extend(t.detach() for t in items if isinstance(t, torch.Tensor))

            module = layers[moe_index].get_submodule(router)
            stack.callback(add_router_tap(module, n_experts, keep).remove)
            stack.callback(module.register_forward_hook(outputs).remove)
        _run(model, ids)
    if moe_index is not None and not (len(tapped) == 1 and any(_same(tapped[0], t) for t in returned)):
        raise _refuse(model, f"could not find where its router {router} computes the logits it returns")
    mlp_input = record.inputs.get(f"{lp[0]}.{mlp_in}")
    parallel = _same(shifted.inputs.get(f"{lp[0]}.{mlp_in}"), mlp_input)

    # the residual identity: resid_post = resid_pre + what each sublayer adds
    if not post_norm:
        attn_part = record.outputs[f"{lp[0]}.{attn_post_norm}"] if attn_post_norm else attn_output
        mlp_part = record.outputs[f"{lp[0]}.{mlp_post_norm}"] if mlp_post_norm else mlp_output
        if attn_part is None or mlp_part is None or layer_output is None:
            raise _refuse(model, "the traced forward did not reach its attention and MLP")
        total = resid_pre.reshape(-1) + attn_part.reshape(-1) + mlp_part.reshape(-1)
        if not _close(total, layer_output):
            raise _refuse(
                model,
                f"its {type(layers[0]).__name__} output is not its input plus its attention's and MLP's outputs "
                "(a residual multiplier or another operation between them)",
            )

    # final norm, modules between it and the unembedding, a constant logit scale
    unembed = model.get_output_embeddings()  # type: ignore[operator]
    names = {id(m): n for n, m in model.named_modules()}
    unembed_in = record.inputs.get(names[id(unembed)])
    last_out = record.outputs.get(lp[-1])
    final_norm = static.final_norm
    before_unembed: tuple[str, ...] = ()
    if final_norm is not None and not _same(record.inputs.get(final_norm), last_out):
        final_norm = None
    start = record.outputs.get(final_norm) if final_norm is not None else last_out
    if not _same(start, unembed_in):  # a projection between them (OPT's project_out)
        between = [
            n
            for n, m in model.named_modules()
            if linear_io(m) is not None
            and _same(record.inputs.get(n), start)
            and _same(record.outputs.get(n), unembed_in)
        ]
        if len(between) != 1:
            after = final_norm or f"the last layer {lp[-1]}"
            raise _refuse(model, f"could not place what sits between {after} and the unembedding")
        before_unembed = (between[0],)
    multiplier = _logit_multiplier(model, record.outputs.get(names[id(unembed)]), record.logits)

    return Family(
        name=model_type,
        model_types=(model_type,),
        layers=static.layers,
        final_norm=final_norm,
        attn=static.attn,
        mlp_in=mlp_in,
        mlp_out=mlp_out,
        mlp_pre=mlp_pre,
        mlp_pre_linear=mlp_pre_linear,
        gate_up_fused=fused,
        mlp_down=mlp_down,
        attn_post_norm=attn_post_norm,
        mlp_post_norm=mlp_post_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        qk_norm_layout=qk_layout,
        before_unembed=before_unembed,
        parallel=parallel,
        post_norm=post_norm,
        attn_o=o_proj,
        attn_sub_norm=attn_sub_norm,
        mlp_sub_norm=mlp_sub_norm,
        attn_out_at=attn_out_at,
        attn_v=attn_v,
        qkv_layout=layout,
        qkv_groups=qkv_groups,
        kv_repeat=kv_repeat,
        n_kv_heads=n_kv_heads,
        n_heads=n_heads,
        d_head=d_head,
        attn_fn=attn_fn,
        attn_score_divisor=data.get("attn_score_divisor"),
        attn_scores_at_softmax=scores_at_softmax,
        router=router,
        experts=experts,
        expert_index_arg=index_arg,
        expert_weight_arg=weight_arg,
        n_experts=n_experts,
        experts_per_token=top_k,
        attention_sinks=record.sinks,
        logit_multiplier=multiplier,
    )


def _trace(model: nn.Module, ids: torch.Tensor, attn_modules: list[nn.Module], attn_fn: str | None) -> _Record:
    """One forward over ``ids`` recording every module's input and output and what each layer's
    attention function receives."""
    record = _Record()
    try:
        with _recording(model, record, attn_modules, attn_fn):
            record.logits = _run(model, ids).logits
    except Exception as exc:  # any failure of the trace is a refusal naming it
        raise _refuse(model, f"a traced forward failed ({type(exc).__name__}: {exc})") from exc
    return record


def _own_attention_method(attention: nn.Module) -> str | None:
    """The path (relative to ``attention``) of an own ``_attn(query, key, value, ...)`` method of
    the attention module or of a module inside it, else ``None``."""
    import inspect

    for name, module in attention.named_modules():
        method = getattr(type(module), "_attn", None)
        if not callable(method):
            continue
        parameters = list(inspect.signature(method).parameters)[1:4]
        if parameters == ["query", "key", "value"]:
            return f"{name}._attn" if name else "_attn"
    return None


def _linear_branch(model: nn.Module, layer: nn.Module, mlp: _Mlp, record: _Record, prefix: str) -> int | None:
    """Which input projection (or, fused, which half) is the linear branch of a gated MLP: the one
    whose negation flips the sign of the hidden the down projection reads."""
    block = layer.get_submodule(mlp.block)
    x = record.inputs.get(f"{prefix}.{mlp.block}")
    hidden = record.inputs.get(f"{prefix}.{mlp.down}")
    if x is None or hidden is None or mlp.down is None:
        return None
    down = layer.get_submodule(mlp.down)
    found = []
    for option in range(2):
        target = layer.get_submodule(mlp.inputs[0 if mlp.fused else option])

        def negate(module: nn.Module, args: Any, out: torch.Tensor, option: int = option) -> torch.Tensor:
            if not mlp.fused:
                return -out
            half = out.shape[-1] // 2
            out = out.clone()
            out[..., option * half : (option + 1) * half] *= -1
            return out

        seen: dict[str, torch.Tensor] = {}

        def read(module: nn.Module, args: tuple[Any, ...], seen: dict[str, torch.Tensor] = seen) -> None:
            seen["h"] = args[0].detach().clone()

        handles = [target.register_forward_hook(negate), down.register_forward_pre_hook(read)]
        try:
            with torch.no_grad():
                block(x)
        finally:
            for handle in handles:
                handle.remove()
        if "h" in seen and _close(seen["h"], -hidden) and not _close(seen["h"], hidden):
            found.append(option)
    return found[0] if len(found) == 1 else None


def _logit_multiplier(model: nn.Module, raw: torch.Tensor | None, logits: torch.Tensor | None) -> float:
    """The constant the model multiplies the unembedding's output by (Cohere's ``logit_scale``), 1.0
    if none; a soft-cap (``final_logit_softcapping``) is applied by the plan after it."""
    if raw is None or logits is None:
        raise _refuse(model, "the traced forward produced no logits")
    cap = getattr(model.config, "final_logit_softcapping", None)
    raw = raw.reshape(logits.shape).double()

    def post(scale: float) -> torch.Tensor:
        scaled = raw * scale
        return torch.tanh(scaled / cap) * cap if cap else scaled

    if _close(post(1.0).to(logits.dtype), logits):
        return 1.0
    target = logits.double()
    if cap:
        target = torch.atanh((target / cap).clamp(-1 + 1e-6, 1 - 1e-6)) * cap
    scale = float((raw * target).sum() / (raw * raw).sum())
    for value in _config_numbers(model.config):  # the config's own number, exactly (logit_scale, 1 / logits_scaling)
        for candidate in (value, 1.0 / value):
            if abs(candidate - scale) <= 1e-3 * abs(scale):
                scale = candidate
    if _close(post(scale).to(logits.dtype), logits):
        return scale
    raise _refuse(model, "its logits are not its unembedding's output (nor a constant multiple of it)")


def _config_numbers(config: Any) -> list[float]:
    try:
        items = config.to_dict().values()
    except (AttributeError, TypeError, ValueError):
        return []
    return [float(v) for v in items if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1)]


def resolve_config(config: Any, trust_remote_code: bool = False) -> None:
    """Check, before any weights load, that the module tree of ``config``'s model resolves (built on the
    ``meta`` device: no memory, no forward). The traced checks run once the weights are loaded."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, trust_remote_code=trust_remote_code
            )
    except (ValueError, KeyError) as exc:  # no causal LM class for this config
        raise UnsupportedArchitecture(
            f"the eager backend cannot serve model_type {getattr(config, 'model_type', None)!r}: "
            f"transformers has no causal LM for it ({exc})"
        ) from exc
    except Exception:  # a model that cannot be built weightless: the load itself will tell
        return
    resolve_static(model)
