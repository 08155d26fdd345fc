"""Build hook for what pyproject.toml cannot declare: the native disk engine and the host attention kernel as
optional extensions.

``native/tierkv_io.c`` becomes ``tierkv/io/_native*.so`` (in place for ``pip install -e .``). It is a plain C
library loaded with ctypes by ``tierkv/io/native.py``, never imported as a module. ``optional=True``: where
it cannot compile (no compiler) the install still succeeds and the engine builds itself on first use from a
source checkout, else auto-selection falls back to posix. The source's hash is compiled in so that the
loader can tell a library built from an older source. ``native/tierkv_attn.c`` becomes
``tierkv/attention/_attn*.so`` the same way (with OpenMP), loaded by ``tierkv/attention/host_kernel.py``,
``native/tierkv_rest.c`` (attention over sparse attention's low-bit rest copy) ``tierkv/attention/_rest*.so``,
loaded by ``tierkv/attention/rest_kernel.py``, and ``native/tierkv_scores.c`` (sparse attention's page scores from
the summaries table) ``tierkv/attention/_scores*.so``, loaded by ``tierkv/attention/score_kernel.py``.
"""

import hashlib
import re
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "native/tierkv_io.c"  # relative, as setuptools requires
KERNELS = {  # the attention kernels, loaded by tierkv/attention/host_kernel.py, rest_kernel.py, score_kernel.py
    "tierkv.attention._attn": "native/tierkv_attn.c",
    "tierkv.attention._rest": "native/tierkv_rest.c",
    "tierkv.attention._scores": "native/tierkv_scores.c",
}


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def _headers(source: str) -> list[str]:
    """The headers ``source`` includes from its own folder (``#include "name.h"``), in order."""
    text = (Path(__file__).parent / source).read_bytes()
    return [str(Path(source).parent / name.decode()) for name in _LOCAL_INCLUDE.findall(text)]


def _digest(source: str) -> str:
    """The sha256 prefix the loaders compare with the source and its local headers (``tierkv.cbuild.source_digest``:
    setup.py cannot import the package it builds)."""
    root = Path(__file__).parent
    data = b"".join((root / path).read_bytes() for path in [source, *_headers(source)])
    return hashlib.sha256(data).hexdigest()[:16]


setup(
    ext_modules=[
        Extension(
            "tierkv.io._native",
            [SOURCE],
            depends=_headers(SOURCE),  # native/xxhash.h (xxHash, BSD-2-Clause, vendored)
            define_macros=[("TKV_SOURCE_SHA", f'"{_digest(SOURCE)}"')],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        *(
            Extension(
                name,
                [source],
                depends=_headers(source),  # native/tierkv_kernel.h
                define_macros=[("TKV_SOURCE_SHA", f'"{_digest(source)}"')],
                extra_compile_args=["-O3", "-fopenmp"],
                extra_link_args=["-fopenmp"],
                libraries=["m"],
                optional=True,
            )
            for name, source in KERNELS.items()
        ),
    ]
)
