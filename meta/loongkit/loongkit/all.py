"""``import loongkit.all`` at the top of a training script loads loongkit: the seed's name for
``import loongkit_core.all`` (see there). One module does the work, so importing both boots once."""

from loongkit_core.all import runtime

__all__ = ["runtime"]
