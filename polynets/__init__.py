"""polynets: activation-free polynomial networks for encrypted inference and equation discovery.

Layers and models (MuLayer, PolyBlock, MONet, PoM, PADRe, Polymorpher, PolyNODE), the
polynomial program (trace, optimize, certify, PolyProgram), training (Trainer, datasets,
checkpoints). Importing polynets registers the MONet and PADRe ViT models in timm
(``timm.create_model("monet_t")``, ``timm.create_model("padre_vit_t")``).
"""

from polynets.certify import Certificate, certify
from polynets.checkpoint import load_checkpoint, load_model, save_checkpoint
from polynets.data import DatasetInfo, load_dataset
from polynets.device import select_device
from polynets.errors import (CheckpointError, ConfigError, DataError, NonPolynomialError,
                             PolynetsError, ProgramFormatError, ShapeError, TraceError,
                             TrainingDivergedError, UnsupportedOpError)
from polynets.layers import MuLayer, PatchEmbed, PolyBlock, PyramidPatchEmbed, SpatialShift
from polynets.models import MONet
from polynets.models.polymorpher import Polymorpher, PolymorpherClassifier
from polynets.node import PolyNODE
from polynets.padre import CastlingAttention, Conv2Former, Hyena, PADRe
from polynets.passes import optimize
from polynets.plot import plot_run
from polynets.pair import PairInput
from polynets.pom import PoM, PoMState, SplitPoM
from polynets.program import Node, PolyProgram
from polynets.trace import trace
from polynets.train import TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "MuLayer", "SpatialShift", "PatchEmbed", "PyramidPatchEmbed", "PolyBlock", "MONet",
    "PoM", "PoMState", "Polymorpher", "PolymorpherClassifier", "PolyNODE", "PADRe",
    "SplitPoM", "PairInput",
    "Conv2Former", "CastlingAttention", "Hyena",
    "trace", "optimize", "certify", "Certificate", "PolyProgram", "Node",
    "Trainer", "TrainConfig", "load_dataset", "DatasetInfo", "select_device",
    "save_checkpoint", "load_checkpoint", "load_model", "plot_run",
    "PolynetsError", "ShapeError", "ConfigError", "TraceError", "UnsupportedOpError",
    "NonPolynomialError", "ProgramFormatError", "DataError", "CheckpointError",
    "TrainingDivergedError", "__version__",
]
