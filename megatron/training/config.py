"""Load a run config: YAML file(s) -> dotted overrides -> typed `RunConfig` -> validation.

Composition: a YAML file may name `base: other.yaml` (a path relative to itself, or a list of
them, applied in order); its own keys override the base's, dict by dict. Command-line
overrides `section.key=value` come last; the value is parsed as YAML (`3`, `1e-3`, `true`,
`[a, b]`, `null`).

Every problem is a `ConfigError` with one message that names the key; the entry point turns
it into exit code 2. Unknown keys name the valid key they most likely meant: the same name in
another section when there is one (`train.warmup_iters` -> `optimizer.warmup_iters`), else the
closest name in their own section. A key given twice in one mapping of a YAML file is an error
naming both lines (a file's `base:` is not that: its keys are meant to be overridden).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Union

import yaml

from megatron.training.config_schema import PRESETS, RunConfig, to_dict
from megatron.training.errors import ConfigError


def load_config(path: str | None, overrides: list[str] = (), *, validate: bool = True) -> RunConfig:
    raw: dict = load_yaml_tree(path) if path else {}
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw, prefix="")
    apply_preset(cfg)
    if validate:
        from megatron.training.config_validate import validate_config

        validate_config(cfg)
    return cfg


def load_yaml_tree(path: str, _seen: tuple = ()) -> dict:
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"config {path}: 'base' chain loops back to itself")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            doc = yaml.load(f, Loader=UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {' '.join(str(e).split())}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ConfigError(f"config {path}: top level must be a mapping of sections")
    bases = doc.pop("base", None) or []
    merged: dict = {}
    for b in [bases] if isinstance(bases, str) else bases:
        merged = deep_merge(merged, load_yaml_tree(os.path.join(os.path.dirname(path), b), _seen + (path,)))
    return deep_merge(merged, doc)


class DuplicateKeyError(Exception):
    """A key given twice in one YAML mapping (not a yaml.YAMLError: callers tell it apart).
    `key` is its dotted path in the document, `lines` the two (1-based) lines."""

    def __init__(self, key: str, lines: tuple[int, int]):
        super().__init__(f"key '{key}' is given twice, on lines {lines[0]} and {lines[1]}: "
                         "keep one (YAML would silently use the last)")
        self.key, self.lines = key, lines


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently). Keys brought in by a `<<: *anchor` merge may be overridden: that is what a merge is for."""

    def construct_document(self, node):
        self._paths = {}
        self._name_paths(node, "")
        return super().construct_document(node)

    def _name_paths(self, node, path: str) -> None:
        """The dotted path of every mapping node, for the error message."""
        if isinstance(node, yaml.MappingNode) and id(node) not in self._paths:
            self._paths[id(node)] = path
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    self._name_paths(v, f"{path}{k.value}.")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._name_paths(v, f"{path.rstrip('.')}[{i}].")

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:   # an unhashable key: SafeLoader's own error says so
                    continue
                if first is not None:
                    prefix = getattr(self, "_paths", {}).get(id(node), "")
                    raise DuplicateKeyError(f"{prefix}{key}", (first, line))
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_override(raw: dict, item: str) -> None:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.load(text, Loader=UniqueKeyLoader) if text != "" else None
    except DuplicateKeyError as e:
        raise ConfigError(f"override {item!r}: key '{key.strip()}.{e.key}' is given twice: keep one") from None
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for p in parts[:-1]:
        if not isinstance(node.setdefault(p, {}), dict):
            raise ConfigError(f"override {item!r}: {p!r} is a value, not a section")
        node = node[p]
    node[parts[-1]] = value


def from_dict(cls, data: Any, prefix: str):
    """Build dataclass `cls` from a dict, checking every key and type."""
    where = prefix.rstrip(".") or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown config key '{prefix}{key}'{_suggest(cls, prefix, str(key), fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _schema_keys(cls=RunConfig, prefix: str = "") -> dict[str, type | None]:
    """Every dotted key of the schema under `cls`: section -> its dataclass, value -> None."""
    out: dict = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out[prefix + f.name] = tp if dataclasses.is_dataclass(tp) else None
        if dataclasses.is_dataclass(tp):
            out.update(_schema_keys(tp, f"{prefix}{f.name}."))
    return out


def _suggest(cls, prefix: str, key: str, fields) -> str:
    """The hint of an unknown key: the same name where it lives in another section (the key
    was put in the wrong one), else the closest name in this section, else the valid keys."""
    keys = _schema_keys()
    if (cls is RunConfig and prefix == "") or keys.get(prefix.rstrip(".")) is cls:
        elsewhere = [k for k in keys if k.rsplit(".", 1)[-1] == key and k != prefix + key]
        if elsewhere:
            return "; did you mean " + " or ".join(f"'{k}'" for k in elsewhere) + "?"
    close = difflib.get_close_matches(key, list(fields), n=1)
    return f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"


def coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is not None and not isinstance(value, dict) and hasattr(tp, "from_scalar"):
            return tp.from_scalar(coerce(str, value, key))   # one value for every field
        return from_dict(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        exact = next((a for a in args if type(value) is a), None)   # int | float: 1 stays an int
        if exact is None and len(args) > 1 and not isinstance(value, bool):
            for a in args:
                try:
                    return coerce(a, value, key)
                except ConfigError:
                    pass
        if exact is None and len(args) > 1:
            names = " or ".join("an integer" if a is int else "a number" if a is float else a.__name__
                                for a in args)
            raise ConfigError(f"{key} must be {names}, got {value!r}")
        return coerce(exact or args[0], value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single path is a list of one
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        raise ConfigError(f"{key} must be a {tp.__name__}, got null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e6 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported schema type {tp}")  # a bug in the schema, not the user


def apply_preset(cfg: RunConfig) -> None:
    m = cfg.model
    if m.preset is None:
        return
    m.preset = m.preset.lower()  # "3B" means "3b"
    if m.preset not in PRESETS:
        close = difflib.get_close_matches(m.preset, list(PRESETS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.preset '{m.preset}' is not one of {', '.join(PRESETS)}{hint}")
    for k, v in PRESETS[m.preset].items():
        if getattr(m, k) is None:
            setattr(m, k, v)


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)
