"""Command-line flags generated from run configs: one flag per config field, help from the field.

Run configs (k2_train.PretrainConfig / SFTConfig, k2_rl.RLConfig) are trees of component configs
(k2_train.config_tree) whose every leaf carries its help in metadata (`k2_train.config.option(default,
help, choices=...)`, or the same keys written by a component package). `add_config_flags(parser, Config)` adds
`--field-name` for each, typed from the annotation:

    int / float / str (also `X | None`)   --name VALUE
    bool                                  --name / --no-name
    dict                                  --name JSON
    choices=(...)                         --name {a,b,c}

Every flag defaults to None ("not given"), so `config_overrides(args, Config)` returns exactly the
fields the user set, to apply over `--config` or the defaults, or to check against a stored run on
`--resume`. A nested dataclass field contributes its own fields under their flat names (no
prefix: `--lr`, not `--optim.lr`), so configs can be composed of component configs without
renaming a flag; two leaves with one name are refused. The tree walk (`flag_fields`, `get_flat`,
`apply_overrides`) lives in k2_train.config_tree, where `from_dict` reads files with it; this module
adds the argparse side. Written here rather than taken from a
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

from k2_train.config_tree import apply_overrides, flag_fields, get_flat

__all__ = ["add_config_flags", "apply_overrides", "config_overrides", "flag_fields", "get_flat"]


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
    components = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
    groups: dict[str, Any] = {}  # --help lists a component's flags under its name
    for name, (path, typ, meta) in flag_fields(cls).items():
        if name in skip or not meta.get("flag", True):
            continue
        target = parser
        if len(path) > 1:
            if path[0] not in groups:
                groups[path[0]] = parser.add_argument_group(path[0], components[path[0]] or None)
            target = groups[path[0]]
        flag = "--" + name.replace("_", "-")
        default = get_flat(defaults, path)
        help_ = f"{meta.get('help') or name.replace('_', ' ')} (default: {default})"
        kind = _scalar(typ)
        kw: dict[str, Any] = {"dest": name, "default": None, "help": help_}
        if kind is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if kind is dict:
            kw.update(type=_json_object, metavar="JSON")
        elif kind in (int, float, str):
            kw["type"] = kind
        else:
            raise TypeError(f"{cls.__name__}.{name}: no flag type for annotation {typ!r}")
        if meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        target.add_argument(flag, **kw)


def config_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{flat field name: value} for every generated flag the user gave."""
    return {name: getattr(args, name) for name in flag_fields(cls) if getattr(args, name, None) is not None}
