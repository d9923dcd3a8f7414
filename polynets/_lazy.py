"""Lazy exports for a package: a name is imported from the module that defines it on first use.

``export_lazily(__name__, {"pkg.mod": "NameA NameB", ...})`` in a package's ``__init__`` makes
``pkg.NameA`` import ``pkg.mod`` when first read, lists the names in ``dir(pkg)``, and keeps an
exported function visible under its name when a submodule of the same name (``pkg.certify`` the
function, ``pkg/certify.py`` the module) is imported later, as an eager ``from pkg.certify import
certify`` would. Submodules resolve as attributes too (``pkg.mod``). Used by ``polynets`` and ``he``.

``alias_modules({"pkg.old": "pkg.sub.new", ...})`` keeps modules that moved importable under
their old names: ``import pkg.old`` gives the very module object ``pkg.sub.new`` (so monkeypatching,
``isinstance`` and pickled references agree), imported only when the old name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = ["LazyPackage", "export_lazily", "alias_modules"]


class LazyPackage(ModuleType):
    """Module type of a package whose exports (``_exports``: name -> defining module) load on use."""

    _exports: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("_exports", {}).get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            ModuleType.__setattr__(self, name, value)
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        # the exports, the package's own submodules and private names; not what its
        # ``__init__`` imported for itself (``sys``, ``typing.Any``...)
        d = self.__dict__
        own = {name for name, value in d.items() if name.startswith("_") or (
            isinstance(value, ModuleType) and value.__name__.startswith(f"{self.__name__}."))}
        return sorted({*own, *d.get("__all__", ()), *d.get("_exports", ())})

    def __setattr__(self, name: str, value: Any) -> None:
        # the import system binds each imported submodule to its package under its own name
        if isinstance(value, ModuleType) and self.__dict__.get("_exports", {}).get(name) == value.__name__:
            value = getattr(value, name)
        ModuleType.__setattr__(self, name, value)


def export_lazily(package: str, exports: Mapping[str, str]) -> list[str]:
    """Make ``package`` (already in ``sys.modules``) a :class:`LazyPackage` exporting, for each
    ``module: "Name Name ..."`` of ``exports``, those names from that module; returns the names."""
    target = sys.modules[package]
    target._exports = {name: module for module, names in exports.items() for name in names.split()}
    target.__class__ = LazyPackage
    return list(target._exports)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old module name as the module it moved to (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module the old name's spec: it keeps its own
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules (see :func:`alias_modules`)."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = self.aliases.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new),
                                               is_package=fullname in _packages(self.aliases))


def _packages(aliases: Mapping[str, str]) -> set[str]:
    return {name.rsplit(".", 1)[0] for name in aliases}


def alias_modules(aliases: Mapping[str, str]) -> None:
    """Make each old module name (key) import as the module it moved to (value)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)
    if finder is None:
        finder = _AliasFinder()
        sys.meta_path.insert(0, finder)
    finder.aliases.update(aliases)
