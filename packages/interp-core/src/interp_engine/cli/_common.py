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
from typing import Any, TextIO

from .._address import Address
from .._base import ModelBase
from .._plugins import load_model
from .._protocol import InterpModel
from .._readouts import Features, check_readout, check_sae_name
from .._sae import Sae, load_sae
from .._sync import SyncModel, sync_model

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
