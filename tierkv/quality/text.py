"""Real English prose that every Python install has: the Python Language Reference in ``pydoc_data.topics``.

``pydoc_data/topics.py`` is part of CPython's standard library (``help("assert")`` reads it): 79 topics of
the Language Reference as plain text, about 465,000 characters (Python 3.11), 113K SmolLM2 tokens. It is
technical prose with code samples, not synthetic filler, so a needle competes with text that a real model
attends to.
"""

from __future__ import annotations

import functools

SOURCE = "pydoc_data.topics (the Python Language Reference shipped with CPython)"


@functools.cache
def reference_text() -> str:
    """Every topic, in sorted order, separated by blank lines (the same text on every run of one Python)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))
