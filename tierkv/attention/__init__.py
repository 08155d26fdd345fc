"""Attention executors: how a layer attends over KV that lives in several tiers."""

from tierkv.attention.exact_gather import ExactGather

__all__ = ["ExactGather"]
