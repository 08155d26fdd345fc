"""Residency policies: which blocks leave a full tier. Registered by name; see :func:`make_policy`."""

from tierkv.policy.attention import AttentionPolicy
from tierkv.policy.base import POLICIES, Policy, make_policy, register_policy
from tierkv.policy.lru import LRUPolicy

__all__ = ["POLICIES", "AttentionPolicy", "LRUPolicy", "Policy", "make_policy", "register_policy"]
