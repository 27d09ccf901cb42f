"""What the commands share: loading a model from the options (and the SAEs to attach), reading
addresses and feature readouts, text tables, the optional matplotlib and the progress display."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from .._plugins import load_model
from .._sync import SyncModel, sync_model
from ..addresses._address import Address
from ..protocol._base import ModelBase
from ..protocol._protocol import InterpModel
from ..sae._readouts import Features, check_readout, check_sae_name
from ..sae._sae import Sae, load_sae

if TYPE_CHECKING:
    from ..chat._spans import ChatTokens

DEFAULT_MODEL = "interp:tiny"
"""The model ``interp demo`` runs when none is named (the tiny model that ships with the project)."""

PLOTS_HINT = "plots skipped: matplotlib is not installed (pip install 'interp-core[plots]')"


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 1."""


_IDS_TAIL = re.compile(r"^\d+(:float(16|32))?$")


def parse_points(given: str | Sequence[str]) -> list[Address | Features]:
    """Addresses (``resid_post.5``, ``blocks.3.hook_mlp_out``) and feature readouts
    (``features:res:top8``), separated by commas or given as several arguments, checked before any
    load. The commas of ``features:res:ids=3,17`` belong to the readout."""
    names: list[str] = []
    for text in [given] if isinstance(given, str) else given:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if names and _IDS_TAIL.match(part) and ":ids=" in names[-1] and not names[-1].endswith(("16", "32")):
                names[-1] += "," + part  # the next id of features:NAME:ids=3,17
            else:
                names.append(part)
    if not names:
        raise UserError("--points is empty; give addresses such as resid_post.5,mlp_post.3")
    return [Features.parse(name) if Features.is_form(name) else Address.parse(name) for name in names]


def parse_sae(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--sae``."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (the name to attach it as, and its folder), got {text!r}")
    return name.strip(), path.strip()


def add_sae_option(parser: argparse.ArgumentParser) -> None:
    """``--sae NAME=PATH`` (repeatable): SAEs attached to the model as it loads."""
    parser.add_argument(
        "--sae",
        dest="saes",
        action="append",
        type=parse_sae,
        default=[],
        metavar="NAME=PATH",
        help="attach an SAE, transcoder or probe as NAME (repeatable): PATH is a folder in SAELens's format "
        "(cfg.json + sae_weights.safetensors); readouts then name it (features:NAME:top8)",
    )


def add_adapter_option(parser: argparse.ArgumentParser) -> None:
    """``--adapter NAME=PATH`` (repeatable): LoRA adapters registered on the model as it loads."""
    parser.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        type=parse_sae,
        default=[],
        metavar="NAME=PATH",
        help="register a LoRA adapter as NAME (repeatable): PATH is a PEFT adapter folder or a shipped one "
        "(interp:tiny-lora); requests then name it in their 'adapter' field (on vllm: -o enable_lora=true)",
    )


def read_saes(pairs: Sequence[tuple[str, str]]) -> dict[str, Sae]:
    """The SAEs of ``--sae NAME=PATH`` options, read now: a bad name or folder is a one-line
    error before the model loads."""
    saes: dict[str, Sae] = {}
    for name, path in pairs:
        check_sae_name(name)
        if name in saes:
            raise UserError(f"--sae {name}=... is given twice; each SAE needs its own name")
        saes[name] = load_sae(path)
    return saes


def check_readouts(model: InterpModel, points: Sequence[Address | Features]) -> None:
    """``UnknownSae`` / ``InvalidFeatures`` for a readout the loaded model cannot serve, before any
    capture (a backend outside ``ModelBase`` is left to refuse it itself)."""
    if isinstance(model, ModelBase):
        for point in points:
            if isinstance(point, Features):
                check_readout(point, model._sae(point.sae))


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``-o``: the value read as JSON when it is JSON (numbers, true, lists)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--dtype``, ``--device`` and ``-o KEY=VALUE`` (load options)."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--backend",
        help="backend to load the model on: eager, vllm, vllm-static or a third-party one "
        "(default: $INTERP_ENGINE_BACKEND, else eager)",
    )
    group.add_argument("--dtype", help="weights dtype passed to the backend, e.g. float32, bfloat16")
    group.add_argument("--device", help="device passed to the backend, e.g. cpu, cuda")
    group.add_argument(
        "-o",
        "--option",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="another load option for the backend (repeatable), e.g. -o max_model_len=2048",
    )


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.dtype:
        options["dtype"] = args.dtype
    if args.device:
        options["device"] = args.device
    options.update(dict(args.option))
    pairs = getattr(args, "saes", None)  # commands with --sae NAME=PATH
    if pairs:
        options["saes"] = read_saes(pairs)
    adapters = getattr(args, "adapters", None)  # commands with --adapter NAME=PATH
    if adapters:
        names = [name for name, _ in adapters]
        if len(set(names)) != len(names):
            raise UserError("an --adapter name is given twice; each adapter needs its own name")
        options["adapters"] = dict(adapters)
    return options


def open_model(args: argparse.Namespace, model: str | None = None) -> SyncModel:
    """The model named on the command line, loaded on the chosen backend, behind its sync facade."""
    return sync_model(load_model(model or args.model, backend=args.backend, **load_options(args)))


@contextmanager
def opened(args: argparse.Namespace, model: str | None = None) -> Iterator[SyncModel]:
    sync = open_model(args, model)
    try:
        yield sync
    finally:
        sync.shutdown()


def prompt_ids(sync: SyncModel, text: str) -> list[int]:
    if not text:
        raise UserError("the text is empty")
    ids: list[int] = sync.to_tokens(text)[0].tolist()
    return ids


CHAT_HELP = (
    "a JSON file of chat messages read instead of TEXT: a list of {'role', 'content'} objects, or "
    "{'messages': [...], 'add_generation_prompt': true, 'chat_template': '...', 'chat_template_kwargs': {...}}; "
    "the model's chat template formats them (model.chat_tokens)"
)
_CHAT_KEYS = ("messages", "add_generation_prompt", "chat_template", "chat_template_kwargs")


@dataclass(frozen=True)
class ChatFile:
    """What ``--chat FILE.json`` holds: the messages and how to format them."""

    path: str
    messages: list[Any]
    add_generation_prompt: bool = True
    template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def tokens(self, sync: SyncModel) -> ChatTokens:
        """The messages formatted by the model's chat template (or the file's)."""
        chat: ChatTokens = sync.chat_tokens(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            template=self.template,
            **self.template_kwargs,
        )
        return chat


def read_chat(path: str) -> ChatFile:
    """``--chat FILE.json``: a list of messages, or an object with ``messages`` (and the
    formatting options); read before the model loads, so a bad file is one line."""
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--chat file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --chat {path}: {exc}") from None
    except ValueError as exc:
        raise UserError(f"--chat {path} is not JSON: {exc}") from None
    options: dict[str, Any] = {}
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(_CHAT_KEYS))
        if unknown:
            raise UserError(f"--chat {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_CHAT_KEYS)}")
        options = data
        data = data.get("messages")
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) for m in data):
        raise UserError(
            f"--chat {path} must hold a non-empty list of messages ({{'role': ..., 'content': ...}}), "
            "or an object with one under 'messages'"
        )
    generation = options.get("add_generation_prompt", True)
    template = options.get("chat_template")
    kwargs = options.get("chat_template_kwargs") or {}
    if not isinstance(generation, bool):
        raise UserError(f"--chat {path}: add_generation_prompt must be true or false, got {generation!r}")
    if template is not None and not isinstance(template, str):
        raise UserError(f"--chat {path}: chat_template must be a string (a Jinja template)")
    if not isinstance(kwargs, dict):
        raise UserError(f"--chat {path}: chat_template_kwargs must be an object")
    return ChatFile(path, data, generation, template, kwargs)


def add_prompt_arguments(parser: argparse.ArgumentParser, text_help: str = "the text to read") -> None:
    """``TEXT`` (optional) and ``--chat FILE.json``: a command's prompt, one or the other."""
    parser.add_argument("text", metavar="TEXT", nargs="?", help=f"{text_help} (or --chat FILE.json)")
    parser.add_argument("--chat", metavar="FILE.json", help=CHAT_HELP)


def read_prompt_source(args: argparse.Namespace) -> ChatFile | None:
    """The ``--chat`` file (``None`` for TEXT), checked before the model loads: exactly one of
    TEXT and ``--chat``."""
    chat = getattr(args, "chat", None)
    if (args.text is None) == (chat is None):
        raise UserError("give either TEXT or --chat FILE.json" if chat is None else "give TEXT or --chat, not both")
    return read_chat(chat) if chat is not None else None


def prompt_tokens(sync: SyncModel, args: argparse.Namespace, chat: ChatFile | None) -> list[int] | ChatTokens:
    """The prompt's ids: TEXT tokenized, or the ``--chat`` messages formatted (a
    :class:`ChatTokens`, a sequence of ids that knows its spans)."""
    if chat is not None:
        return chat.tokens(sync)
    return prompt_ids(sync, args.text)


def describe_chat(chat: ChatTokens, tokens: Sequence[str]) -> str:
    """One line per message span (role, positions, its first tokens), and where generation starts."""
    lines = []
    for span in chat.messages:
        shown = "".join(tokens[span.start : span.end])
        text = repr(shown if len(shown) <= 40 else shown[:37] + "...")
        where = f"tokens {span.start}..{span.end - 1}" if span.end > span.start else f"no tokens (at {span.start})"
        lines.append(f"  {span.index} {span.role:<10} {where}  {text}")
    for span in chat.reasoning:
        lines.append(f"  reasoning in message {span.index} ({span.role}): tokens {span.start}..{span.end - 1}")
    start = chat.generation_start
    lines.append(f"  generation starts at {start}" if start is not None else "  no generation prompt")
    return "\n".join(lines)


def show_token(piece: str, width: int = 14) -> str:
    """A token as it reads in a table: quoted, escapes visible, cut to ``width``."""
    text = repr(piece)
    return text if len(text) <= width else text[: width - 2] + "..'"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bar(value: float, top: float, width: int = 24) -> str:
    filled = max(0, min(width, round(width * value / top))) if top > 0 else 0
    return "#" * filled + "." * (width - filled)


def note(message: str, stream: TextIO | None = None) -> None:
    print(f"interp: {message}", file=stream or sys.stderr)


def add_plot_options(parser: argparse.ArgumentParser, default_dir: str) -> None:
    parser.add_argument(
        "--out", default=default_dir, metavar="DIR", help=f"directory for the PNG plots (default: {default_dir})"
    )
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")


def plots_available() -> bool:
    """Whether matplotlib can be imported (after saying how to get it when not)."""
    try:
        import matplotlib.figure  # noqa: F401 - interp_engine.plot imports it when it draws
    except ImportError:
        note(PLOTS_HINT)
        return False
    return True


def plots_wanted(args: argparse.Namespace) -> bool:
    """Whether to draw the command's plots: not with ``--no-plots``, nor without matplotlib
    (then one line says how to get it)."""
    return not args.no_plots and plots_available()


def save_figure(fig: Any, out_dir: str, name: str) -> pathlib.Path:
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")
    return path


class Progress:
    """A progress bar on stderr: tqdm when it is installed, else a plain counter."""

    def __init__(self, total: int, done: int, label: str, *, quiet: bool = False) -> None:
        self.total, self.done, self.label, self.quiet = total, done, label, quiet
        self._bar: Any = None
        if quiet:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._tty = sys.stderr.isatty()
            self._show()
        else:
            self._bar = tqdm(total=total, initial=done, desc=label, unit="prompt", file=sys.stderr)

    def _show(self) -> None:
        step = max(1, self.total // 10)
        if self._tty or self.done == self.total or self.done % step == 0:
            end = "" if self._tty and self.done < self.total else "\n"
            print(f"\r{self.label}: {self.done}/{self.total} prompts", end=end, file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._show()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif not self.quiet and self._tty and self.done < self.total:
            print(file=sys.stderr)
