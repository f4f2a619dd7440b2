"""Run configs as trees of component configs, addressed by flat field names.

A task config (PretrainConfig, SFTConfig, RLConfig) nests the components of the packages that
build each part (k2_model.ModelSpec, k2_optim.OptimConfig / WSDConfig, k2_data.DataConfig, k2-rl's
loss / rollout / reward / rubric configs). Every leaf field has one flat name, its own: `lr`, not
`optim.lr`. Flags (`--lr`), `--config` files, stored `config.json` files and the resume rules all
use the flat names, so composing configs renamed nothing; `flag_fields` refuses two leaves with
one name, and a component whose name is also a leaf's (a table `model` vs a field `model`).

Leaf metadata: {"help": str, "choices": tuple | None, "flag": bool} (`option` writes it here;
the component packages below k2-train write the same keys themselves)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from dataclasses import MISSING, field
from typing import Any

__all__ = [
    "apply_overrides",
    "flag_fields",
    "from_flat_dict",
    "get_flat",
    "option",
    "to_flat_dict",
    "type_problem",
]


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Any = MISSING,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
) -> Any:
    """A config field with its help text (and allowed values) in the field's metadata, which the
    `k2` command's flags are generated from. `flag=False`: a field kept for stored configs only."""
    if not help:
        raise ValueError("option(): every config field needs its help text")
    metadata = {"help": help, "choices": choices, "flag": flag}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _help_meta(cls: type, name: str) -> dict[str, Any]:
    """The field's metadata, inherited when a subclass redeclares the field with a new default."""
    for klass in cls.__mro__:
        fields = getattr(klass, "__dataclass_fields__", {})
        if name in fields and fields[name].metadata.get("help"):
            return dict(fields[name].metadata)
    return {}


def _components(klass: type) -> dict[str, type]:
    """{attribute: component class} of the fields of `klass` that are dataclasses themselves."""
    hints = typing.get_type_hints(klass)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(klass) if dataclasses.is_dataclass(hints[f.name])
    }


@functools.cache
def flag_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Any, dict[str, Any]]]:
    """flat name -> (path of attribute names from the top config, annotation, metadata)."""
    out: dict[str, tuple[tuple[str, ...], Any, dict[str, Any]]] = {}
    groups: set[str] = set()

    def walk(klass: type, prefix: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            typ = hints[f.name]
            if dataclasses.is_dataclass(typ):
                groups.add(f.name)
                walk(typ, (*prefix, f.name))
                continue
            if f.name in out:
                raise TypeError(
                    f"{cls.__name__}: two config fields are named {f.name!r}; flags must be unique"
                )
            out[f.name] = ((*prefix, f.name), typ, _help_meta(klass, f.name))

    walk(cls, ())
    clash = sorted(groups & set(out))
    if clash:
        raise TypeError(f"{cls.__name__}: {', '.join(clash)} names both a component and a field")
    return out


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
    return _replace(cfg, {paths[name][0]: value for name, value in overrides.items()})


def _replace(cfg: Any, values: dict[tuple[str, ...], Any]) -> Any:
    top: dict[str, Any] = {}
    deeper: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in values.items():
        if len(path) == 1:
            top[path[0]] = value
        else:
            deeper.setdefault(path[0], {})[path[1:]] = value
    for attr, more in deeper.items():
        top[attr] = _replace(getattr(cfg, attr), more)
    return dataclasses.replace(cfg, **top)


def to_flat_dict(cfg: Any) -> dict[str, Any]:
    """{flat name: value} of every leaf: the form of `--config` files and stored config.json."""
    return {name: copy.deepcopy(get_flat(cfg, path)) for name, (path, _, _) in flag_fields(type(cfg)).items()}


def from_flat_dict(cls: type, d: dict[str, Any], source: str = "config") -> Any:
    """`cls` from a dict read from a file: flat keys (`{"lr": 0.01}`), or a component's fields
    under its name (`{"optim": {"lr": 0.01}}`), or both; fields not given keep their defaults.
    Unknown keys and values of the wrong type are refused, naming the key and `source`."""
    leaves = flag_fields(cls)
    given: dict[str, tuple[str, Any]] = {}  # flat name -> (the key as written, value)

    def walk(klass: type, table: dict[str, Any], prefix: str) -> None:
        components = _components(klass)
        own = {f.name for f in dataclasses.fields(klass)} if prefix else set(leaves) | set(components)
        unknown = sorted(k for k in table if k not in own)
        if unknown:
            known = sorted(own) if prefix else sorted(leaves)
            raise ValueError(
                f"{source}: unknown field(s) {', '.join(prefix + k for k in unknown)}; known: {', '.join(known)}"
            )
        for key, value in table.items():
            written = prefix + key
            if key in components:
                if not isinstance(value, dict):
                    raise ValueError(
                        f"{source}: {written} = {value!r}: expected a table/object of its fields"
                    )
                walk(components[key], value, written + ".")
                continue
            if key in given:
                raise ValueError(f"{source}: {key} is given twice ({given[key][0]} and {written})")
            given[key] = (written, value)

    walk(cls, d, "")
    for name, (written, value) in given.items():
        expected = type_problem(value, leaves[name][1])
        if expected:
            raise ValueError(f"{source}: {written} = {value!r}: expected {expected}")
    return apply_overrides(cls(), {name: value for name, (_, value) in given.items()})


def type_problem(value: Any, annotation: Any) -> str | None:
    """None when `value` (read from a JSON/TOML file) fits the field's annotation, else the
    expected type in words. An int is a fine float; a bool is not an int."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        problems = [type_problem(value, a) for a in options if a is not type(None)]
        if any(p is None for p in problems):
            return None
        return " or ".join(problems) + (" or null" if type(None) in options else "")
    base = origin or annotation
    if base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base in (str, bool, dict, list):
        ok = isinstance(value, base)
    else:  # a type this check does not know: left to the config's validate()
        return None
    words = {float: "a number", int: "an integer", str: "a string", bool: "true or false",
             dict: "a table/object", list: "a list"}  # fmt: skip
    return None if ok else words[base]
