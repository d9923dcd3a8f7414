"""timm's classifier plumbing, shared by the polynets classifiers.

A classifier pools its features, applies dropout and a linear head; ``forward_head(x,
pre_logits=True)`` stops before the head, ``reset_classifier`` swaps the head (and the pooling),
``get_classifier`` returns it. A model supplies ``forward_features``, ``pool`` (its features to
``(B, num_features)``) and ``_check_pool`` (the pooling names it accepts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor, nn

__all__ = ["ClassifierHead"]


class ClassifierHead(ABC):
    """Mixin for ``nn.Module`` classifiers with ``num_features``, ``num_classes``,
    ``global_pool``, ``head_drop`` and ``head``."""

    num_features: int
    num_classes: int
    global_pool: str
    head: nn.Module
    head_drop: nn.Module

    @abstractmethod
    def forward_features(self, x: Tensor) -> Tensor:
        """Input to the features before pooling."""

    @abstractmethod
    def pool(self, x: Tensor) -> Tensor:
        """Features to ``(B, num_features)`` (or per-token features when not pooled)."""

    @staticmethod
    @abstractmethod
    def _check_pool(global_pool: str) -> str:
        """``global_pool`` if this model accepts it, else a ConfigError."""

    def _init_head(self) -> None:
        """Initialise a new head (default: PyTorch's)."""

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Features to logits ``(B, num_classes)`` (pooled features with ``pre_logits``)."""
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """New linear head for ``num_classes`` (0 removes it); pooling kept unless given."""
        if global_pool is not None:
            self.global_pool = self._check_pool(global_pool)
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self._init_head()
