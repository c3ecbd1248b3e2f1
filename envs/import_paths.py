"""Import paths ``package.module:ClassName``: the hints that make a wrong one fixable from its one-line refusal.

Used where a class is named by import path: an env tag's ``env_type`` (``envs.registry``) and the plug-in
registries (``agent_trainer.common.plugins``). A module that is not found gets the close module names (difflib over the
modules of its parent package, or over the top-level modules of the user's folders: never a standard library
module's name) and where it was looked for; a class that is not in its module gets
the close class names of that module; ``package.module.ClassName`` (a dot where the colon belongs) gets the
``package.module:ClassName`` it meant.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import pkgutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

FORM = "an import path is written 'package.module:ClassName' (the module's dotted path, a colon, the class)"


def close_names(word: str, candidates, n: int = 3) -> list[str]:
    """The candidates closest to ``word`` (difflib), best first."""
    return difflib.get_close_matches(word, sorted(set(candidates)), n=n, cutoff=0.6)


def user_folders() -> list[str]:
    """The folders of the import path (``sys.path``) a user's module can live in: the working directory, the
    folders of PYTHONPATH, a tags file's folder (``envs.registry.load_env_tags``), an editable install's; not the
    standard library's nor an installed package's (site-packages), whose names an env is never meant to be."""
    paths = sysconfig.get_paths()
    library = [Path(paths[key]).resolve() for key in ("stdlib", "platstdlib")]
    out = []
    for entry in sys.path:
        folder = Path(entry or os.getcwd()).resolve()
        if (not folder.is_dir() or {"site-packages", "dist-packages"} & set(folder.parts)
                or any(folder == lib or lib in folder.parents for lib in library)):
            continue
        out.append(str(folder))
    return list(dict.fromkeys(out))


def where_missing(module_name: str) -> str:
    """Where a module that is not found was looked for: ``no file leaf.py and no folder leaf/ in [...]``, in its
    parent package's folder, or in :func:`user_folders` for a top-level name (a parent that is itself not found is
    the one named)."""
    parent, _, leaf = module_name.rpartition(".")
    if parent:
        try:
            folders = [str(p) for p in getattr(importlib.import_module(parent), "__path__", [])]
        except ImportError:
            return where_missing(parent)
        return f"no file {leaf}.py and no folder {leaf}/ in {folders}"
    return f"no file {leaf}.py and no folder {leaf}/ in the folders searched: {user_folders()}"


def module_file(module_name: str) -> str:
    """`` (path/to/module.py)``, the file a module that is found is read from; '' when it is not known."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return ""
    return f" ({spec.origin})" if spec is not None and spec.origin else ""


def module_suggestions(module_name: str) -> list[str]:
    """Importable module names close to ``module_name``: siblings in its parent package, else top-level modules
    of :func:`user_folders` (a parent that is itself not found is corrected first)."""
    parent, _, leaf = module_name.rpartition(".")
    if not parent:
        return close_names(leaf, {m.name for m in pkgutil.iter_modules(user_folders())})
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
