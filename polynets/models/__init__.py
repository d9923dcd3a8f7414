"""Model families of polynets. Importing this package registers the MONet and PADRe ViT models
in timm."""

from polynets.models.monet import MONet
from polynets.models.padre_vit import PADReViT

__all__ = ["MONet", "PADReViT"]
