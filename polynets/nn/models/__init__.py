"""Model families of polynets. Importing this package registers the MONet and PADRe ViT models
in timm."""

from polynets.nn.models.monet import MONet
from polynets.nn.models.padre_vit import PADReViT

__all__ = ["MONet", "PADReViT"]
