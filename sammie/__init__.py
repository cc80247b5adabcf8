"""Sammie: SAM 3 / SAM 3.1 text-prompted image segmentation, built for serving."""

from sammie.config import Sam3Config

__all__ = ["Sam3Config"]
