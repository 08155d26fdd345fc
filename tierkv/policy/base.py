"""The policy interface and registry.

A policy sees block events and answers one question: when a tier is full, which of its blocks move down?
It never drops data — the store demotes what it picks. In exact mode every block is read every step, so
a policy that *promotes* on access would thrash; policies here only choose demotion victims, which keeps
the resident set stable and the streamed set read-only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from tierkv.blocks import Block
from tierkv.errors import InvalidConfigError

POLICIES: dict[str, type[Policy]] = {}


class Policy(ABC):
    name: str = ""

    def on_insert(self, block: Block, tick: int) -> None:
        block.last_access = tick

    def on_access(self, block: Block, tick: int) -> None:
        block.last_access = tick

    @abstractmethod
    def victims(self, candidates: Iterable[Block], n: int) -> list[Block]:
        """Up to ``n`` of ``candidates`` to demote, best victim first."""


def register_policy(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise InvalidConfigError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}.")
    return POLICIES[name]()
