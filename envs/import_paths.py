"""Import paths ``package.module:ClassName``: the hints that make a wrong one fixable from its one-line refusal.

Used where a class is named by import path: an env tag's ``env_type`` (``envs.registry``) and the plug-in
registries (``agent_trainer.plugins``). A module that is not found gets the close module names (difflib over the
modules of its parent package, or over the top-level importable modules); a class that is not in its module gets
the close class names of that module; ``package.module.ClassName`` (a dot where the colon belongs) gets the
``package.module:ClassName`` it meant.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import pkgutil
import sys
from types import ModuleType

FORM = "an import path is written 'package.module:ClassName' (the module's dotted path, a colon, the class)"


def close_names(word: str, candidates, n: int = 3) -> list[str]:
    """The candidates closest to ``word`` (difflib), best first."""
    return difflib.get_close_matches(word, sorted(set(candidates)), n=n, cutoff=0.6)


def module_suggestions(module_name: str) -> list[str]:
    """Importable module names close to ``module_name``: siblings in its parent package, else top-level modules
    (a parent that is itself not found is corrected first)."""
    parent, _, leaf = module_name.rpartition(".")
    if not parent:
        names = {m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names)
        return close_names(leaf, names)
    try:
        package = importlib.import_module(parent)
    except ImportError:
        return [f"{p}.{leaf}" for p in module_suggestions(parent)]
    path = getattr(package, "__path__", None)
    if path is None:
        return []
    return [f"{parent}.{name}" for name in close_names(leaf, [m.name for m in pkgutil.iter_modules(path)])]


def module_classes(module: ModuleType, base: type | None = None) -> list[str]:
    """The classes ``module`` holds (subclasses of ``base`` when given, ``base`` itself excluded), sorted."""
    return sorted(name for name, obj in vars(module).items()
                  if isinstance(obj, type) and not name.startswith("_")
                  and (base is None or (issubclass(obj, base) and obj is not base)))


def class_hint(module: ModuleType, module_name: str, attr: str, base: type | None = None) -> str:
    """``did you mean 'm:Close'?`` and the classes of the module, for an ``attr`` it lacks."""
    fitting = module_classes(module, base)
    others = module_classes(module)
    close = close_names(attr, fitting) or close_names(attr, others)
    listed = fitting or others
    kind = f"{base.__name__} subclasses" if fitting and base else "classes"
    listing = f"its {kind}: {listed[:20]}"
    if not close:
        return listing
    meant = " or ".join(repr(f"{module_name}:{name}") for name in close)
    return f"did you mean {meant}? ({listing})"


def module_hint(module_name: str) -> str:
    """``did you mean module 'x'?`` for a module that is not found, or '' when nothing is close."""
    close = module_suggestions(module_name)
    return ("did you mean module " + " or ".join(map(repr, close)) + "?") if close else ""


def dotted_class_path(path: str) -> str | None:
    """``'pkg.mod:Class'`` when ``path`` is ``'pkg.mod.Class'`` (a dot where the colon belongs) and ``pkg.mod``
    is an importable module; else None."""
    if not isinstance(path, str) or ":" in path or "." not in path:
        return None
    module_name, _, attr = path.rpartition(".")
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        found = False
    return f"{module_name}:{attr}" if found and attr else None


def colon_hint(path: str) -> str:
    """The hint for a name that is no registered name and has no colon: the ``module:Class`` it meant, or the form."""
    meant = dotted_class_path(path)
    if meant:
        return f"did you mean {meant!r}? ({FORM})"
    return FORM if isinstance(path, str) and "." in path else ""


def name_hint(name, candidates) -> str:
    """What a name that is neither known nor ``module:Class`` probably meant: ``pkg.mod:Class`` for
    ``pkg.mod.Class`` (:func:`colon_hint`), else the close ``candidates``; '' when nothing fits."""
    hint = colon_hint(name)
    if hint:
        return hint
    close = close_names(name, candidates) if isinstance(name, str) else []
    return ("did you mean " + " or ".join(map(repr, close)) + "?") if close else ""
