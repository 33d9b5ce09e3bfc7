"""Command-line flags generated from a config dataclass, so no surface copies its fields by hand.

    add_dataclass_arguments(parser_or_group, TrainConfig)        # --lr, --weight-decay, --betas B1 B2, ...
    config = dataclass_from_args(TrainConfig, args)
    add_dataclass_arguments(p, RLConfig, defaults=RLConfig(prompts_per_step=16))   # a surface's own defaults
    add_dataclass_arguments(p, EngineConfig, skip=names)  # part of a config (dataclass_from_args(..., skip=names))

One flag a field: ``--field-name`` (``metadata["flag"]`` names another, as ``--prompts`` for
``RLConfig.prompts_per_step``); its type, default and help come from the field. Help is the
field's ``metadata["help"]``, else its trailing ``# comment``, else the comment block right above
it. Types: int, float, str (``T | None``: unset by default); an int field's ``metadata["range"]``
``(low, high)`` is checked as the flag is parsed; ``bool`` (``--x`` / ``--no-x``); ``bool | None``
(``auto``, ``on``, ``off``: None, True, False); ``Literal[...]`` (its choices; ``Literal[...] | None``:
the same, unset by default); ``tuple[T, T, ...]`` (``nargs``).
A field of another type is an error when the parser is built, so a new field reaches the command
line or fails loudly (tests check every field of TrainConfig, EngineConfig and RLConfig).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Any, Callable, Literal

__all__ = ["TRISTATE", "flag_name", "int_in", "int_list", "add_dataclass_arguments", "dataclass_from_args"]

TRISTATE = {"auto": None, "on": True, "off": False}      # a `bool | None` field's choices


def flag_name(field: str | dataclasses.Field) -> str:
    """``--field-name``, or a field's ``metadata["flag"]``."""
    if isinstance(field, dataclasses.Field):
        return "--" + field.metadata.get("flag", field.name.replace("_", "-"))
    return "--" + field.replace("_", "-")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (a clear usage error otherwise, never a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value
    return parse


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers (``5,6,7``; spaces around them allowed)."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _comments(cls: type) -> dict[str, str]:
    """field name -> its source comment (trailing, else the block above it)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    block: list[str] = []
    names = {f.name for f in dataclasses.fields(cls)}
    lines: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        lines.setdefault(tok.start[0], []).append(tok)
    for _, toks in sorted(lines.items()):
        kinds = [t for t in toks if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
        if not kinds:
            block = []
            continue
        if kinds[0].type == tokenize.COMMENT:
            block.append(kinds[0].string.lstrip("#").strip())
            continue
        first = kinds[0]
        if first.type == tokenize.NAME and first.string in names and len(kinds) > 1 and kinds[1].string == ":":
            trailing = [t.string.lstrip("#").strip() for t in kinds if t.type == tokenize.COMMENT]
            out[first.string] = " ".join(trailing or block)
        block = []
    return out


def _is_optional_bool(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and set(typing.get_args(tp)) == {bool, type(None)}


def _optional(tp: Any) -> Any:
    """T of a ``T | None`` field, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType) or type(None) not in typing.get_args(tp):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else None


def _optional_literal(tp: Any) -> tuple | None:
    """The choices of a ``Literal[...] | None`` field (None stays the default: "not set"), else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(tp)) == 2 and typing.get_origin(args[0]) is Literal:
        return typing.get_args(args[0])
    return None


def add_dataclass_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                            skip: tuple[str, ...] = (), defaults: Any = None, required: tuple[str, ...] = ()) -> None:
    """Add one flag per field of the dataclass ``cls`` (except ``skip``), defaults from ``defaults``
    (an instance of ``cls``; default ``cls()``); the flags of the fields ``required`` must be given."""
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    defaults = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, default = hints[f.name], getattr(defaults, f.name)
        text = (f.metadata.get("help") or comments.get(f.name, "")).replace("%", "%%")
        kw: dict[str, Any]
        if tp is bool:
            kw = dict(action=argparse.BooleanOptionalAction, default=default)
        elif _is_optional_bool(tp):
            kw = dict(choices=list(TRISTATE), default={v: k for k, v in TRISTATE.items()}[default])
        elif typing.get_origin(tp) is Literal:
            kw = dict(choices=list(typing.get_args(tp)), default=default)
        elif _optional_literal(tp) is not None:
            kw = dict(choices=list(_optional_literal(tp)), default=default)
        elif typing.get_origin(tp) is tuple and ... not in typing.get_args(tp):
            args = typing.get_args(tp)
            if len(set(args)) != 1 or args[0] not in (int, float, str):
                raise TypeError(f"{cls.__name__}.{f.name}: no flag for {tp}")
            kw = dict(type=args[0], nargs=len(args), default=list(default),
                      metavar=tuple(f"{f.name.upper()}{i + 1}" for i in range(len(args))))
        elif tp in (int, float, str) or _optional(tp) in (int, float, str):
            kind = tp if tp in (int, float, str) else _optional(tp)
            kw = dict(type=int_in(*f.metadata["range"]) if "range" in f.metadata and kind is int else kind,
                      default=default, metavar=flag_name(f)[2:].replace("-", "_").upper())
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for {tp}")
        if f.name in required:
            kw.pop("default")
            kw["required"] = True
            help_text = text
        else:
            help_text = f"{text} (default %(default)s)".lstrip()
        parser.add_argument(flag_name(f), dest=f.name, help=help_text, **kw)


def dataclass_from_args(cls: type, args: argparse.Namespace, skip: tuple[str, ...] = (), **fixed: Any) -> Any:
    """The ``cls`` the flags of :func:`add_dataclass_arguments` describe (``fixed`` fields as given; the
    fields ``skip``ped there, which have no flag, their defaults)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed or f.name in skip:
            continue
        v = getattr(args, f.name)
        if _is_optional_bool(hints[f.name]):
            v = TRISTATE[v]
        elif typing.get_origin(hints[f.name]) is tuple:
            v = tuple(v)
        values[f.name] = v
    return cls(**values, **fixed)
