"""A name -> class registry for plug-ins (context condensers, trajectory reward computers).

A plug-in is found by the name it registered (``@registry.register("simple")``)
or by an import path "package.module:ClassName", so a user's class needs no
edit of this project. Unknown names raise ValueError naming the config key and
the known names, as estimators and environments do.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

from envs.import_paths import class_hint, module_hint, name_hint

T = TypeVar("T")


class PluginRegistry(Generic[T]):
    """Subclasses of ``base`` by name; ``key`` is the config key named in errors."""

    def __init__(self, base: type[T], key: str):
        self.base = base
        self.key = key
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator registering ``cls`` as ``name`` (re-registering replaces it)."""

        def wrap(cls: type[T]) -> type[T]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise ValueError(f"{self.key}: cannot register {cls!r} as {name!r}: not a {self.base.__name__}")
            self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``, or the one at "package.module:ClassName"."""
        if name in self._classes:
            return self._classes[name]
        if not isinstance(name, str) or ":" not in name:
            hint = name_hint(name, self.names())
            raise ValueError(f"{self.key} = {name!r} is unknown; known: {self.names()}, "
                             "or give an import path 'package.module:ClassName'" + (f"; {hint}" if hint else ""))
        cls = load_import_path(name, f"{self.key} = {name!r}", f"known: {self.names()}", self.base)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{self.key} = {name!r} is not a subclass of {self.base.__name__}")
        return cls


def load_import_path(path: str, shown: str, known: str, base: type | None = None):
    """The object at ``path`` ("package.module:Name"); ValueError starting with ``shown`` (the key and the value)
    and ending with ``known`` (what else would do) when the module or the name is missing. ``base``: the class the
    object should subclass, for the hint of a near name."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module_name
        hint = module_hint(missing) if module_name.startswith(missing) else ""
        raise ValueError(f"{shown} could not be imported ({exc}); {known}" + (f"; {hint}" if hint else "")) from exc
    if not hasattr(module, attr):
        raise ValueError(f"{shown} could not be imported (module {module_name!r} has no attribute {attr!r}); "
                         f"{class_hint(module, module_name, attr, base)}")
    return getattr(module, attr)


def import_package_modules(package: str, path) -> list[str]:
    """Import every module of ``package`` (its ``__path__``) whose name does not start with "_"; their names.

    The registries' packages (``core_algos``, ``condensers``, ``trajectory_rewards``) call it at the end of their
    ``__init__``, so a module that registers an estimator, a condenser or a reward computer with its decorator is
    found by being in the package: adding one is one new file and nothing else.
    """
    names = sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names
