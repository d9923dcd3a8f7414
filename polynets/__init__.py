"""polynets: activation-free polynomial networks for encrypted inference and equation discovery."""

from polynets.errors import (CheckpointError, ConfigError, DataError, NonPolynomialError,
                             PolynetsError, ProgramFormatError, ShapeError, TraceError,
                             TrainingDivergedError, UnsupportedOpError)
from polynets.layers import MuLayer, PatchEmbed, PolyBlock, PyramidPatchEmbed, SpatialShift
from polynets.node import PolyNODE
from polynets.models import MONet
from polynets.certify import Certificate, certify
from polynets.passes import optimize
from polynets.program import Node, PolyProgram
from polynets.trace import trace
from polynets.pom import PoM, PoMState
from polynets.models.polymorpher import Polymorpher, PolymorpherClassifier
from polynets.device import select_device
from polynets.data import DatasetInfo, load_dataset
from polynets.checkpoint import load_checkpoint, load_model, save_checkpoint
from polynets.train import TrainConfig, Trainer
from polynets.plot import plot_run

__version__ = "0.1.0"
