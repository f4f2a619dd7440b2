"""Command-line flags generated from run configs: one flag per config field, help from the field.

Run configs (k2_train.PretrainConfig / SFTConfig, k2_rl.RLConfig) declare every field with
`k2_train.config.option(default, help, choices=...)`. `add_config_flags(parser, Config)` adds
`--field-name` for each, typed from the annotation:

    int / float / str (also `X | None`)   --name VALUE
    bool                                  --name / --no-name
    dict                                  --name JSON
    choices=(...)                         --name {a,b,c}

Every flag defaults to None ("not given"), so `config_overrides(args, Config)` returns exactly the
fields the user set, to apply over `--config` or the defaults, or to check against a stored run on
`--resume`. A nested dataclass field contributes its own fields under their flat names (no
prefix: `--lr`, not `--optim.lr`), so configs can be composed of component configs without
renaming a flag; two leaves with one name are refused. Written here rather than taken from a
library (tyro, simple-parsing): the flat names, the None-means-unset rule and the resume checks
need control over the parser that those libraries take away, and this is ~100 lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

__all__ = ["add_config_flags", "apply_overrides", "config_overrides", "flag_fields", "get_flat"]


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _help_meta(cls: type, name: str) -> dict[str, Any]:
    """The field's metadata, inherited when a subclass redeclares the field with a new default."""
    for klass in cls.__mro__:
        fields = getattr(klass, "__dataclass_fields__", {})
        if name in fields and fields[name].metadata.get("help"):
            return dict(fields[name].metadata)
    return {}


def flag_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any, dict[str, Any]]]:
    """flat name -> (path of attribute names from the top config, annotation, metadata)."""
    out: dict[str, tuple[tuple[str, ...], Any, dict[str, Any]]] = {}

    def walk(klass: type, prefix: tuple[str, ...]) -> None:
        hints = _resolved_hints(klass)
        for f in dataclasses.fields(klass):
            typ = hints[f.name]
            if dataclasses.is_dataclass(typ):
                walk(typ, (*prefix, f.name))
                continue
            if f.name in out:
                raise TypeError(
                    f"{cls.__name__}: two config fields are named {f.name!r}; flags must be unique"
                )
            out[f.name] = ((*prefix, f.name), typ, _help_meta(klass, f.name))

    walk(cls, ())
    return out


def _scalar(typ: Any) -> Any:
    """int/float/str/bool/dict of an annotation such as `str | None` or `dict[str, Any]`."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return _scalar(args[0]) if len(args) == 1 else str
    if origin is not None:
        return origin
    return typ


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: set[str] = frozenset()) -> None:
    """One `--flag` per field of `cls` (nested configs flattened), help and default from the field."""
    defaults = cls()
    for name, (path, typ, meta) in flag_fields(cls).items():
        if name in skip or not meta.get("flag", True):
            continue
        flag = "--" + name.replace("_", "-")
        default = get_flat(defaults, path)
        help_ = f"{meta.get('help') or name.replace('_', ' ')} (default: {default})"
        kind = _scalar(typ)
        kw: dict[str, Any] = {"dest": name, "default": None, "help": help_}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if kind is dict:
            kw.update(type=_json_object, metavar="JSON")
        elif kind in (int, float, str):
            kw["type"] = kind
        else:
            raise TypeError(f"{cls.__name__}.{name}: no flag type for annotation {typ!r}")
        if meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        parser.add_argument(flag, **kw)


def config_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{flat field name: value} for every generated flag the user gave."""
    return {name: getattr(args, name) for name in flag_fields(cls) if getattr(args, name, None) is not None}


def get_flat(cfg: Any, path: tuple[str, ...] | str) -> Any:
    """A field's value by its path (or, for a top-level config, its flat name)."""
    if isinstance(path, str):
        path = flag_fields(type(cfg))[path][0]
    for attr in path:
        cfg = getattr(cfg, attr)
    return cfg


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of `cfg` with the flat-named fields replaced (nested configs rebuilt as needed)."""
    paths = flag_fields(type(cfg))
    unknown = sorted(set(overrides) - set(paths))
    if unknown:
        raise ValueError(f"{type(cfg).__name__}: unknown field(s) {', '.join(unknown)}")
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for name, value in overrides.items():
        path = paths[name][0]
        if len(path) == 1:
            top[name] = value
        else:
            nested.setdefault(path[0], {})[".".join(path[1:])] = value
    for attr, sub in nested.items():
        top[attr] = _apply_paths(getattr(cfg, attr), sub)
    return dataclasses.replace(cfg, **top)


def _apply_paths(cfg: Any, sub: dict[str, Any]) -> Any:
    top: dict[str, Any] = {}
    deeper: dict[str, dict[str, Any]] = {}
    for dotted, value in sub.items():
        head, _, rest = dotted.partition(".")
        if rest:
            deeper.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for attr, more in deeper.items():
        top[attr] = _apply_paths(getattr(cfg, attr), more)
    return dataclasses.replace(cfg, **top)
