"""Model families of polynets. Importing this package registers the MONet models in timm."""

from polynets.models.monet import MONet

__all__ = ["MONet"]
