"""polynets: activation-free polynomial networks for encrypted inference and equation discovery.

Three subpackages: :mod:`polynets.nn`, layers and models (MuLayer, PolyBlock, MONet, PoM, PADRe,
Polymorpher, PolyNODE); :mod:`polynets.ir`, the polynomial program and its passes (trace,
optimize, certify, PolyProgram, the lowering); :mod:`polynets.training`, the trainer, data sets,
checkpoints. The names are exported here, and the modules' former flat paths
(``polynets.layers``, ``polynets.trace``...) import as the same modules.

Names are exported lazily (module ``__getattr__``): ``import polynets`` loads neither torch nor
timm, and ``polynets.MuLayer`` imports the module that defines it on first use, so a process
that only needs the program format or the error classes (a ciphertext server) starts fast.
The MONet and PADRe ViT models are registered in timm (``timm.create_model("monet_t")``,
``timm.create_model("padre_vit_t")``) as soon as both polynets and timm are imported, in
either order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from polynets._lazy import alias_modules, export_lazily

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "polynets.nn.layers": "MuLayer SpatialShift PatchEmbed PyramidPatchEmbed PolyBlock",
    "polynets.nn.models.monet": "MONet",
    "polynets.nn.pom": "PoM PoMState SplitPoM",
    "polynets.nn.pair": "PairInput",
    "polynets.nn.models.polymorpher": "Polymorpher PolymorpherClassifier",
    "polynets.nn.models.pom_dit": "PoMDiT PoMDiTBlock",
    "polynets.nn.node": "PolyNODE ODEFlow PolyANODE",
    "polynets.nn.padre": "PADRe Conv2Former CastlingAttention Hyena",
    "polynets.ir.trace": "trace",
    "polynets.ir.passes": "optimize",
    "polynets.ir.certify": "certify Certificate",
    "polynets.ir.program": "PolyProgram Node",
    "polynets.training.train": "Trainer TrainConfig",
    "polynets.training.data": "load_dataset DatasetInfo",
    "polynets.training.device": "select_device",
    "polynets.training.checkpoint": "save_checkpoint load_checkpoint load_model",
    "polynets.training.plot": "plot_run",
    "polynets.errors": "PolynetsError ShapeError ConfigError TraceError UnsupportedOpError "
                       "NonPolynomialError ProgramFormatError DataError CheckpointError "
                       "TrainingDivergedError",
}
__all__ = [*export_lazily(__name__, _EXPORTS), "__version__"]

#: where modules of the flat layout moved (the old names still import, as the same modules)
_MOVED = {
    **{name: f"nn.{name}" for name in ("layers", "pom", "padre", "pair", "node", "models")},
    **{f"models.{name}": f"nn.models.{name}"
       for name in ("monet", "padre_vit", "polymorpher", "pom_dit", "head")},
    **{name: f"ir.{name}"
       for name in ("program", "_program_torch", "trace", "passes", "certify", "lowering")},
    **{name: f"training.{name}" for name in ("train", "data", "checkpoint", "device", "plot")},
}
alias_modules({f"{__name__}.{old}": f"{__name__}.{new}" for old, new in _MOVED.items()})


class _RegisterAfterTimm(importlib.abc.Loader):
    """Runs timm's own loader, then imports :mod:`polynets.nn.models`, whose ``@register_model``
    functions add the polynets architectures to timm's registry. Anything else is timm's loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        importlib.import_module("polynets.nn.models")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _TimmWatcher(importlib.abc.MetaPathFinder):
    """Finds timm with the other finders and wraps its loader in :class:`_RegisterAfterTimm`."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "timm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("timm")
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterTimm(spec.loader)
        return spec


if "timm" in sys.modules:
    importlib.import_module("polynets.nn.models")
elif not any(isinstance(finder, _TimmWatcher) for finder in sys.meta_path):
    sys.meta_path.insert(0, _TimmWatcher())
