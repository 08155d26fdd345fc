"""Build hook for what pyproject.toml cannot declare: the native disk engine as an optional extension.

``native/tierkv_io.c`` becomes ``tierkv/io/_native*.so`` (in place for ``pip install -e .``). It is a plain C
library loaded with ctypes by ``tierkv/io/native.py``, never imported as a module. ``optional=True``: where
it cannot compile (no compiler) the install still succeeds and the engine builds itself on first use from a
source checkout, else auto-selection falls back to posix. The source's hash is compiled in so that the
loader can tell a library built from an older source.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "native/tierkv_io.c"  # relative, as setuptools requires
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()[:16]  # = native.source_digest()

setup(
    ext_modules=[
        Extension(
            "tierkv.io._native",
            [SOURCE],
            depends=["native/xxhash.h"],  # included by the source (xxHash, BSD-2-Clause, vendored)
            define_macros=[("TKV_SOURCE_SHA", f'"{DIGEST}"')],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
