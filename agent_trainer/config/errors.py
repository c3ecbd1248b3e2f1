"""One line per config mistake: unknown keys (with the closest known key) and type errors.

Why unknown keys need their own check: hydra's ``+key=value`` means "append this key", so
it adds ``trainer.totl_steps`` to the composed config even though the typed schema has no
such field; OmegaConf then keeps a typed source node's extra keys when that node is merged
onto the schema, and ``OmegaConf.to_object`` sets them as plain attributes. The key was
dropped in silence. :func:`check_known_keys` therefore walks the plain key tree against the
schema before anything is merged, whichever way the config was built (command line, hydra's
compose API, a dict). Only ``hydra.*`` may add keys (hydra removes that section itself).

:func:`one_line` turns hydra's and OmegaConf's multi-line errors (an override of a key that
does not exist, a value of the wrong type, a broken interpolation) into one line naming the
key, the value and the fix.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from omegaconf.nodes import ValueNode

_UNSET = object()


def all_keys(schema: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included, in definition order."""
    keys = []
    for key in schema.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        keys.append(path)
        child = schema._get_node(key)
        if isinstance(child, DictConfig):
            keys.extend(all_keys(child, path))
    return keys


def closest_key(path: str, schema: DictConfig) -> str | None:
    """The known key a mistyped ``path`` most likely meant (difflib), or None."""
    parent, _, leaf = path.rpartition(".")
    known = all_keys(schema)
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if match:
        return f"{parent}.{match[0]}" if parent else match[0]
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]  # right name, wrong section
    if same_leaf:
        return same_leaf[0]
    match = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
    return match[0] if match else None


def unknown_key_message(path: str, schema: DictConfig, value: Any = _UNSET) -> str:
    """``"trainer.totl_steps is not a config key (got ...); did you mean trainer.total_training_steps?"``."""
    got = "" if value is _UNSET else f" (got {path}={hydra_literal(value)})"
    hint = closest_key(path, schema)
    if hint:
        return f"{path} is not a config key{got}; did you mean {hint}?"
    parent = path.rpartition(".")[0]
    siblings = [k.rpartition(".")[2] for k in all_keys(schema) if k.rpartition(".")[0] == parent]
    return f"{path} is not a config key{got}; the keys under {parent or 'the top level'} are {siblings}"


def one_line(err: BaseException, schema: DictConfig, overrides: Sequence[str] = (),
             config: DictConfig | None = None) -> str:
    """A config error from hydra, OmegaConf or validation as one line naming the key, the value and the fix.

    ``config`` is the merged config the error came from, if any: OmegaConf names no key when an
    interpolation fails while the whole config is resolved, so the key is looked up there.
    """
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    key = getattr(cause, "full_key", None) if isinstance(cause, OmegaConfBaseException) else None
    reason = (getattr(cause, "msg", "") or str(err)).splitlines()[0]
    if not key and config is not None and isinstance(cause, OmegaConfBaseException):
        broken = unresolvable_key(config)
        if broken:
            return (f"{broken} = {_node(config, broken)._value()!r} cannot be resolved ({reason}); fix the "
                    "${...} reference: it names a key from the top, e.g. ${trainer.seed}")
    if not key:
        text = str(err).split("\n\n")[0]  # hydra appends search paths etc. after a blank line
        return " ".join(text.split())
    override = _override_value(key, overrides)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and _node(schema, key) is None:
        return unknown_key_message(key, schema, _UNSET if override is None else override)
    value = cause.value if getattr(cause, "value", None) is not None else override
    return f"{key} = {value!r} is not valid ({reason}); {expected_value(key, schema)}"


def unresolvable_key(config: DictConfig) -> str | None:
    """The first key of ``config`` whose ``${...}`` interpolation does not resolve."""
    for key in all_keys(config):
        node = _node(config, key)
        if isinstance(node, ValueNode) and node._is_interpolation():
            try:
                OmegaConf.select(config, key)
            except OmegaConfBaseException:
                return key
    return None


def expected_value(key: str, schema: DictConfig) -> str:
    """The fix for a wrongly typed value: the type and the default, as a command-line override."""
    node = _node(schema, key)
    if node is None:
        return "check the key and the value"
    if isinstance(node, ListConfig):
        kind = "a list"
    elif isinstance(node, DictConfig):
        return f"{key} is a section; set its keys ({key}.<name>=...) instead"
    else:
        ref = node._metadata.ref_type
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(ref, "a value")
        if node._metadata.optional:
            kind += " or null"
    default = node._value() if isinstance(node, ValueNode) else node._content
    if isinstance(default, ListConfig | list):
        default = [item._value() if isinstance(item, ValueNode) else item for item in default]
    return f"set it to {kind}, e.g. {key}={hydra_literal(default)} (the default)"


def hydra_literal(value: Any) -> str:
    """How ``value`` is written as a hydra override (``true``, ``null``, ``[a,b]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_literal(v)}" for k, v in value.items()) + "}"
    return str(value)


def _node(schema: DictConfig, key: str):
    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node


def _override_value(key: str, overrides: Sequence[str]) -> str | None:
    """The value a command-line override gave ``key`` (``key=v``, ``+key=v``, ``++key=v``), if any."""
    for override in overrides:
        name, sep, value = override.lstrip("+~").partition("=")
        if sep and name == key:
            return value
    return None


def check_choice(key: str, value, choices) -> None:
    """Raise ValueError naming the config ``key`` when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{key} = {value!r} is not one of {list(choices)}; set it to one of them")
