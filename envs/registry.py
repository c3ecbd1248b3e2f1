"""Environment registry, config validation and env tags (``config/envs.yaml``).

Built-in environments are registered by import path ("module:Class") so that
``import envs`` stays cheap and an environment whose optional dependency is
missing fails only when it is made, with a clear message (skyrl-gym style).

A *tag* is a named, configured environment in RAGEN's format::

    custom_envs:            # optional wrapper key, as in RAGEN
      FrozenLake:
        env_type: frozen_lake
        max_actions_per_traj: 10
        env_instruction: "..."
        max_tokens: 100
        env_config: {size: 4, p: 0.8}
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from envs.base import BaseEnv
from envs.import_paths import FORM, class_hint, module_file, module_hint, name_hint, where_missing

# name -> (env class or "module:Class", config class or "module:Class" or None)
_REGISTRY: dict[str, tuple[Any, Any]] = {}
DEFAULT_TAGS_PATH = "config/envs.yaml"


def register_env(name: str, cls: type | str, config_cls: type | str | None = None) -> None:
    """Register an environment class under ``name``.

    ``cls`` and ``config_cls`` may be classes or lazy "module:Class" strings.
    When ``config_cls`` is None the class attribute ``cls.config_cls`` is used.
    Re-registering a name replaces the previous entry (handy in notebooks).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_env: name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = (cls, config_cls)


def list_envs() -> list[str]:
    """Registered environment names, sorted."""
    return sorted(_REGISTRY)


def _load(obj: Any, what: str) -> Any:
    """Resolve a "module:Class" string (or return a class unchanged)."""
    if not isinstance(obj, str):
        return obj
    module_name, _, attr = obj.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"environment {what!r}: {obj!r} is not an import path; {FORM}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):  # found, but an import in it failed
            raise ImportError(
                f"environment {what!r}: module {module_name!r}{module_file(module_name)} needs a missing dependency "
                f"({exc}); install it (a shipped environment's extra: docs/environments.md)"
            ) from exc
        hint = module_hint(missing or module_name)
        raise ImportError(
            f"environment {what!r}: cannot import module {module_name!r} ({where_missing(missing or module_name)}); "
            + (f"{hint} If not, " if hint else "")
            + "put it under the directory you start the run from or beside the tags file that names it, or add "
            "its folder to PYTHONPATH (each reaches every Ray worker), or pip install its package; see "
            "docs/writing_an_environment.md"
        ) from exc
    if not hasattr(module, attr):
        raise ValueError(f"environment {what!r}: module {module_name!r} has no attribute {attr!r}; "
                         f"{class_hint(module, module_name, attr, BaseEnv)}")
    return getattr(module, attr)


def unknown_name_hint(name: str, also: list[str] | tuple = ()) -> str:
    """What a name that is neither registered nor ``module:Class`` probably meant: ``pkg.mod:Class`` for
    ``pkg.mod.Class``, or the close registered names (and names in ``also``: tags); '' when nothing fits."""
    return name_hint(name, [*list_envs(), *also])


def _unknown(name: str, also: list[str] | tuple = ()) -> str:
    hint = unknown_name_hint(name, also)
    return f"; {hint}" if hint else ""


def _ensure_registered(name: str) -> None:
    """Register an import path ("my_pkg.my_env:MyEnv") used as an env name, on first use.

    This is what lets a tag in config/envs.yaml name a user's environment
    class directly (``env_type: my_pkg.my_env:MyEnv``) without any code.
    """
    if name not in _REGISTRY and isinstance(name, str) and ":" in name:
        register_env(name, name)


def get_env_classes(name: str) -> tuple[type[BaseEnv], type]:
    """Return (env class, config class) for a registered name or a "module:Class" path."""
    _ensure_registered(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}{_unknown(name)}; registered environments: {list_envs()}")
    cls_ref, cfg_ref = _REGISTRY[name]
    cls = _load(cls_ref, name)
    check_env_class(cls, name)
    config_cls = _load(cfg_ref, name) if cfg_ref is not None else cls.config_cls
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise ValueError(f"environment {name!r}: config_cls = {config_cls!r} is not a dataclass; set "
                         "config_cls to a @dataclass whose fields are the env's options")
    return cls, config_cls


def check_env_class(cls: Any, name: str) -> None:
    """A ``BaseEnv`` subclass with every abstract method implemented, or a ValueError naming what is missing."""
    if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
        raise ValueError(f"environment {name!r} is {cls!r}, not a subclass of envs.BaseEnv; "
                         "subclass BaseEnv (docs/writing_an_environment.md)")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ValueError(f"environment {name!r}: class {cls.__name__} does not implement {', '.join(missing)}; "
                         f"define {', '.join(m + '()' for m in missing)} in it (docs/writing_an_environment.md)")


# --------------------------------------------------------------------------- config checks


def _type_ok(value: Any, annotation: Any) -> bool:
    """Loose runtime type check for the annotations env configs use."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if annotation is dict or origin is dict:
        return isinstance(value, Mapping)
    return True  # anything fancier is left to the config's __post_init__


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def to_plain(obj: Any) -> Any:
    """Turn OmegaConf containers / mappings / sequences into plain dicts and lists."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only when the caller already uses omegaconf

        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def build_config(config_cls: type, values: Mapping | None, where: str) -> Any:
    """Instantiate ``config_cls`` from a mapping, naming bad keys and values.

    Raises ValueError for unknown fields (listing the allowed ones) and for
    values of the wrong type; range checks live in each config's __post_init__.
    """
    values = to_plain(values) or {}
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        values = dataclasses.asdict(values)
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be a mapping of config fields, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown config field(s) {unknown}; allowed fields: {sorted(fields)}"
        )
    hints = typing.get_type_hints(config_cls)
    for key, value in values.items():
        annotation = hints.get(key, Any)
        if not _type_ok(value, annotation):
            raise ValueError(
                f"{where}.{key} = {value!r} has type {type(value).__name__}; "
                f"expected {_type_name(annotation)}"
            )
    try:
        return config_cls(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


# --------------------------------------------------------------------------- tags


@dataclass
class EnvTagConfig:
    """One named environment setup (a RAGEN ``custom_envs`` entry)."""

    env_type: str
    """Registered environment name, e.g. "frozen_lake"."""
    max_actions_per_traj: int = 10
    """Episode ends (done) once this many actions were executed."""
    env_instruction: str = ""
    """Task text shown to the model before the first observation."""
    max_tokens: int = 100
    """Generation budget per turn for this tag (used by the rollout)."""
    env_config: dict = field(default_factory=dict)
    """Options of the environment's config dataclass."""

    def __post_init__(self):
        if not isinstance(self.env_type, str) or not self.env_type:
            raise ValueError(f"env_type must be a registered name; got {self.env_type!r}")
        for key in ("max_actions_per_traj", "max_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.env_config is None:  # RAGEN writes `env_config: null`
            self.env_config = {}
        if self.env_instruction is None:
            self.env_instruction = ""
        if not isinstance(self.env_instruction, str):
            raise ValueError(f"env_instruction must be a string, got {self.env_instruction!r}")
        if not isinstance(self.env_config, Mapping):
            raise ValueError(f"env_config must be a mapping of config fields, got {self.env_config!r}")

    @classmethod
    def from_dict(cls, tag: str, values: Mapping) -> "EnvTagConfig":
        """Build and validate a tag (including its env_config) from a mapping."""
        values = to_plain(values)
        if isinstance(values, EnvTagConfig):
            values = dataclasses.asdict(values)
        allowed = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(values, Mapping):
            raise ValueError(f"env tag {tag!r} must be a mapping with fields {allowed}")
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"env tag {tag!r}: unknown field(s) {unknown}; allowed fields: {allowed}")
        if "env_type" not in values:
            raise ValueError(f"env tag {tag!r} has no env_type; registered environments: {list_envs()}")
        try:
            cfg = cls(**values)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"env tag {tag!r}: {exc}") from exc
        cfg.validate(tag)
        return cfg

    def validate(self, tag: str) -> None:
        """Check env_type is registered and env_config fits its config dataclass."""
        _ensure_registered(self.env_type)
        if self.env_type not in _REGISTRY:
            raise ValueError(
                f"env tag {tag!r}: unknown env_type {self.env_type!r}{_unknown(self.env_type)}; "
                f"registered environments: {list_envs()}"
            )
        try:
            _, config_cls = get_env_classes(self.env_type)
        except (ImportError, ValueError) as exc:  # the tag named first, the class path's error after it
            if type(exc) not in (ImportError, ModuleNotFoundError, ValueError):
                raise
            raise type(exc)(f"env tag {tag!r}: {exc}") from exc
        build_config(config_cls, self.env_config, f"env tag {tag!r} env_config")


def _default_tags_path() -> Path:
    """config/envs.yaml in the working directory, else next to the envs package."""
    local = Path(DEFAULT_TAGS_PATH)
    if local.exists():
        return local
    return Path(__file__).resolve().parent.parent / DEFAULT_TAGS_PATH


def load_env_tags(path: str | Path = DEFAULT_TAGS_PATH) -> dict[str, EnvTagConfig]:
    """Read env tags from a YAML file (top level or under ``custom_envs``).

    A user's file puts its folder on the import path first (:func:`import_beside`), so a tag's ``module:Class``
    imports from beside the file that names it, wherever the command starts.
    """
    import yaml  # pyyaml ships with hydra/omegaconf

    path = Path(path)
    if not path.exists() and str(path) == DEFAULT_TAGS_PATH:
        path = _default_tags_path()
    import_beside(path)
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    return parse_env_tags(raw)


def tags_folder(path: str | Path) -> Path | None:
    """The folder of a user's tags file, absolute; None for the shipped ``config/envs.yaml`` (whose envs are
    the ``envs`` package's)."""
    folder = Path(path).resolve().parent
    return None if folder == (Path(__file__).resolve().parent.parent / DEFAULT_TAGS_PATH).parent else folder


def import_beside(path: str | Path) -> None:
    """Put the folder of the tags file ``path`` on ``sys.path`` (after the working directory, before PYTHONPATH's
    folders, as ``make model ENVS=`` puts it first on PYTHONPATH): its tags' modules import from beside it. A
    training run passes the folder to its Ray workers too (``agent_trainer.ray_cluster.worker_pythonpath``)."""
    folder = tags_folder(path)
    if folder is not None and str(folder) not in sys.path:
        sys.path.insert(1 if sys.path else 0, str(folder))


def parse_env_tags(raw: Mapping) -> dict[str, EnvTagConfig]:
    """Validate a mapping of tag name -> tag fields (RAGEN ``custom_envs`` shape)."""
    raw = to_plain(raw) or {}
    if "custom_envs" in raw:
        raw = raw["custom_envs"] or {}
    return {tag: EnvTagConfig.from_dict(tag, values) for tag, values in raw.items()}


def normalize_tags(tags: Mapping | None) -> dict[str, EnvTagConfig]:
    """Accept tags as EnvTagConfig objects or plain/OmegaConf dicts.

    None means the default ``config/envs.yaml`` (no tags when it is absent).
    """
    if tags is None:
        return load_env_tags() if _default_tags_path().exists() else {}
    out = {}
    for tag, value in tags.items():
        out[tag] = value if isinstance(value, EnvTagConfig) else EnvTagConfig.from_dict(tag, value)
    return out


def make_env(name_or_tag: str, tags: Mapping | None = None, **overrides: Any) -> BaseEnv:
    """Create an environment from a registered name or a tag.

    A registered name uses the env's config defaults; a tag uses its
    ``env_config``. ``overrides`` replace individual config fields in both
    cases. When ``tags`` is None and the name is not registered, tags are read
    from ``config/envs.yaml``.
    """
    _ensure_registered(name_or_tag)
    if name_or_tag in _REGISTRY and not (tags and name_or_tag in tags):
        env_type, env_config, where = name_or_tag, dict(overrides), f"env {name_or_tag!r} config"
    else:
        all_tags = normalize_tags(tags)
        if name_or_tag not in all_tags:
            raise ValueError(
                f"unknown environment or tag {name_or_tag!r}{_unknown(name_or_tag, list(all_tags))}; "
                f"registered environments: "
                f"{list_envs()}; tags: {sorted(all_tags)}"
            )
        tag_cfg = all_tags[name_or_tag]
        env_type = tag_cfg.env_type
        env_config = {**tag_cfg.env_config, **overrides}
        where = f"env tag {name_or_tag!r} env_config"
    cls, config_cls = get_env_classes(env_type)
    return cls(build_config(config_cls, env_config, where))
