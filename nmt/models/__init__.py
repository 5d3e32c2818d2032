"""Architectures behind one contract (see `nmt.models.base`)."""
