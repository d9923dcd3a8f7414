"""Lazy exports for a package: a name is imported from the module that defines it on first use.

``export_lazily(__name__, {"pkg.mod": "NameA NameB", ...})`` in a package's ``__init__`` makes
``pkg.NameA`` import ``pkg.mod`` when first read, lists the names in ``dir(pkg)``, and keeps an
exported function visible under its name when a submodule of the same name (``pkg.certify`` the
function, ``pkg/certify.py`` the module) is imported later, as an eager ``from pkg.certify import
certify`` would. Submodules resolve as attributes too (``pkg.mod``). Used by ``polynets`` and ``he``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = ["LazyPackage", "export_lazily"]


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
        return sorted({*self.__dict__, *self.__dict__.get("__all__", ())})

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
