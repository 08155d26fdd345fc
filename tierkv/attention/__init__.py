"""Attention executors: how a layer attends over KV that lives in several tiers."""

from tierkv.attention import split as _split  # noqa: F401 - registers the split executor
from tierkv.attention.exact_gather import ExactGather

__all__ = ["ExactGather"]
