"""Config validation at the edge: YAML mappings become typed dataclasses, or a
``ConfigError`` that names the bad key and what it accepts.

Everything a worker reads was checked here, in the launching process, before any rank
starts -- a typo must not cost a cluster allocation.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type or range."""


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise ConfigError mentioning ``where``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where}: got {value!r}, allowed values: {', '.join(map(repr, typing.get_args(tp)))}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if origin in (dict, Mapping) or tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            args = typing.get_args(tp)
            items = [coerce(v, args[0], f"{where}[{i}]") if args else v for i, v in enumerate(value)]
            return tuple(items) if (origin or tp) is tuple else items
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, where)
    return value


def parse_dataclass(cls: type[T], mapping: Mapping[str, Any] | None, where: str) -> T:
    """Build ``cls`` from ``mapping``: unknown keys, wrong types and failed checks raise.

    A dataclass may define ``validate(self) -> None`` for range checks; it should raise
    ConfigError naming the field (``where`` is prepended here).
    """
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in mapping:
            values[name] = coerce(mapping[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required but missing")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}" if where else str(exc)) from None
    return obj


def check_kwargs(params: Mapping[str, Any], kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check ``kwargs`` against ``params`` (name -> annotation, ``Any`` when untyped).

    Used for strategy constructors, whose signatures are the schema: an unknown key
    lists the accepted ones instead of failing deep inside a worker. Scalar
    annotations (int, float, str, bool, Optional and Literal of those) are enforced.
    """
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        allowed = ", ".join(sorted(params)) or "none"
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed keys: {allowed}")
    return {name: coerce(value, params[name], f"{where}.{name}") if _only_simple(params[name]) else value
            for name, value in kwargs.items()}


def signature_params(func: Callable[..., Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Named parameters of ``func`` with their resolved annotations (``Any`` if none)."""
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable forward references: names only
        hints = {}
    return {
        name: hints.get(name, Any)
        for name, p in inspect.signature(func).parameters.items()
        if name not in ("self", *skip) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def takes_fields_of(config: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorates a constructor ``__init__(self, ..., **kwargs)`` that hands ``config``'s fields,
    arriving in ``kwargs``, to the dataclass ``config``: its signature gains them as keyword
    parameters with the dataclass's defaults and types, so the dataclass is the one place they
    live while the constructor's schema (``signature_params``) and reference docs read them."""
    hints = typing.get_type_hints(config)

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(init).parameters.values()
        named = [p for p in own if p.kind is not p.VAR_KEYWORD]
        taken = {p.name for p in named}
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                     default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
                 for f in dataclasses.fields(config) if f.name not in taken]
        init.__signature__ = inspect.Signature([*named, *added, *(p for p in own if p.kind is p.VAR_KEYWORD)])  # type: ignore[attr-defined]
        init.__annotations__ = {**{p.name: hints[p.name] for p in added}, **init.__annotations__}
        return init
    return decorate


def _only_simple(tp: Any) -> bool:
    if tp in (int, float, str, bool, type(None)):
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return all(_only_simple(a) for a in typing.get_args(tp))
    return False


def parse_list(text: str, what: str) -> list[str]:
    """Comma-separated items; a comma inside ``[...]`` belongs to its item
    (``ddp,diloco[compression=sparse,density=0.01]`` is two items)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ConfigError(f"{what}: unbalanced brackets in {text!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigError(f"{what}: unbalanced brackets in {text!r}")
    items = [x.strip() for x in [*items, current] if x.strip()]
    if not items:
        raise ConfigError(f"{what}: empty list")
    return items


def parse_variant(item: str) -> tuple[str, list[tuple[str, str]]]:
    """``NAME`` or ``NAME[key=value,...]``: a strategy and overrides of its ``strategy.kwargs``
    (one row of ``syncplane compare`` or ``bench``, labelled by the whole item)."""
    name, bracket, rest = item.partition("[")
    if not bracket:
        return item, []
    if "'" in item or '"' in item:
        raise ConfigError(f"--strategies: {item!r}: no quotes inside NAME[key=value,...]")
    if not rest.endswith("]") or not name:
        raise ConfigError(f"--strategies: {item!r}: expected NAME[key=value,...]")
    options = []
    for pair in (p.strip() for p in rest[:-1].split(",")):
        key, equals, value = pair.partition("=")
        if not equals or not key.strip() or not value.strip() or not key.strip().isidentifier():
            raise ConfigError(f"--strategies: {item!r}: {pair!r} is not key=value (a strategy.kwargs key)")
        options.append((key.strip(), value.strip()))
    return name.strip(), options
