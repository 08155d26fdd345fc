"""The on-disk (and on-the-wire) record: a small JSON header and a payload, checked by one xxhash.

::

    offset 0   b"TKVR"                     magic
           4   u16  format version (1)
           6   u16  reserved (0)
           8   u32  header length H
          12   u64  payload length P
          20   u64  xxh3_64 of header + payload
          28   header: UTF-8 JSON object   (H bytes)
      28 + H   payload                     (P bytes)

A record is valid only if its length is exactly ``28 + H + P`` and the checksum matches, so a torn write
(a process killed half way, a short read) or a flipped byte anywhere is detected, never decoded.

Block records hold one block-row of KV — the K/V of ``block_tokens`` tokens of *every* layer, one
``[layers, 2, kv_heads, block_tokens, head_dim]`` tensor (where the layers' shapes differ, each layer's
``[2, kv_heads, block_tokens, head_dim]`` flattened one after the other: ``Namespace.block_shape``) — with the
header
``{"kind": "block", "key", "namespace", "depth", "dtype", "shape"}`` (``depth``: the block's index in its
chain). One record per block-row keeps a prefix lookup to one object per block, whatever the layer count.

Interface::

    head, payload = encode_block(key, namespace_root, depth, kv)   # kv: [L, 2, H_kv, bt, D], any device
    kv = decode_block(buffer, key=key, namespace=ns)               # IntegrityError if anything is off
    head, payload = encode(header_dict, payload_bytes)             # any record (write head, then payload)
    header, payload = decode(buffer)                               # a record from one contiguous buffer
    header, payload = read(binary_file)                            # a record from a stream (sync)
    header, payload = await aread(aiofiles_file)                   # ... and from an aiofiles file
    header, payload = read(binary_file, limit=limit)               # payload bounded by its own header

A stream's record may be bounded by what its own header implies (``limit``: the header, parsed before the
payload is read, to the most payload bytes it allows): a file that claims more (a sparse file passes the size
check) is refused before the payload is allocated. The checksum is still verified after the payload is read
(it is no authentication: anyone can compute it), so a header changed on disk may be refused by the limit
before its checksum is checked.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from tierkv.atomic import finished
from tierkv.errors import IntegrityError, NewerFormatError

if TYPE_CHECKING:
    import torch

    from tierkv.persist.keys import Namespace

MAGIC = b"TKVR"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQQ")
PREFIX_BYTES = _PREFIX.size  # 28
MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes; a larger length is a corrupt prefix
BLOCK_HEADER_BYTES = 4096  # room for a block record's JSON header (about 250 bytes) in the largest one read
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # a dtype's name in torch

Limit = Callable[[dict[str, Any]], tuple[int, str]]
"""A record's header to ``(most payload bytes, what allows them)``: the second names the header's field, e.g.
``"field 'ids_shape' [1, 9] allows"``; it raises IntegrityError itself for a header it refuses."""


def _checksum(header: bytes, payload: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(header)
    digest.update(payload)
    return digest.intdigest()


def encode(header: dict[str, Any], payload: bytes | bytearray | memoryview) -> tuple[bytes, memoryview]:
    """``(head, payload)``: write ``head`` then ``payload`` (not copied) to store the record."""
    payload = memoryview(payload).cast("B")
    text = _header_text(header)
    return _PREFIX.pack(MAGIC, VERSION, 0, len(text), len(payload), _checksum(text, payload)) + text, payload


def _header_text(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _parse_prefix(prefix: bytes | bytearray | memoryview, what: str) -> tuple[int, int, int]:
    if len(prefix) < PREFIX_BYTES:
        raise IntegrityError(f"{what}: {len(prefix)} bytes, shorter than a record's {PREFIX_BYTES}-byte prefix "
                             "(a torn or truncated write).")
    magic, version, reserved, header_bytes, payload_bytes, checksum = _PREFIX.unpack_from(prefix)
    if magic == MAGIC and version > VERSION:
        raise NewerFormatError(f"{what}: a tierkv record of version {version}, written by a newer tierkv (this one "
                               f"reads version {VERSION}); upgrade tierkv to read it.")
    if magic != MAGIC or version != VERSION or reserved:
        raise IntegrityError(f"{what}: not a tierkv record (magic {magic!r}, version {version}, reserved {reserved}).")
    if header_bytes > MAX_HEADER_BYTES:
        raise IntegrityError(f"{what}: header length {header_bytes} is corrupt.")
    return header_bytes, payload_bytes, checksum


def check_format(header: dict[str, Any], kind: str, expected: int, what: str) -> None:
    """Refuse a record other than a ``kind`` of format ``expected`` (an integer, exactly): one of a later format,
    written by a newer tierkv, with :class:`~tierkv.errors.NewerFormatError` (its callers leave it as it is)."""
    found = header.get("format")
    if header.get("kind") == kind and type(found) is int and found == expected:
        return
    if header.get("kind") == kind and type(found) is int and found > expected:
        raise NewerFormatError(f"{what}: a tierkv {kind} of format {found}, written by a newer tierkv (this one "
                               f"reads format {expected}); upgrade tierkv to read it.")
    raise IntegrityError(f"{what}: not a tierkv {kind} of format {expected} (first record: {str(header)[:200]}).")


def _parse_header(text: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    """The JSON object of a record's header text (IntegrityError if it is none)."""
    try:
        header = json.loads(bytes(text))
    except (ValueError, RecursionError) as error:  # a checksum anyone can compute: malformed, or nested past
        # the parser's stack ('[' * 10**5, which raises RecursionError, not ValueError)
        raise IntegrityError(f"{what}: unreadable header ({str(error)[:200]}).") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{what}: the header is not a JSON object.")
    return header


def _finish(text: bytes | bytearray | memoryview, payload: memoryview, checksum: int, what: str,
            header: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify the checksum, then the header (``header``: already parsed from ``text``)."""
    if _checksum(bytes(text), payload) != checksum:
        raise IntegrityError(f"{what}: checksum mismatch (xxh3_64); the stored bytes changed after they were written.")
    return header if header is not None else _parse_header(text, what)


def _check_limit(text: bytes | bytearray, payload_bytes: int, limit: Limit | None,
                 what: str) -> dict[str, Any] | None:
    """The header parsed from ``text``, and ``payload_bytes`` checked against what ``limit`` says it allows —
    before the payload is allocated (None without a limit: the header is parsed after the checksum)."""
    if limit is None:
        return None
    header = _parse_header(text, what)
    allowed, why = limit(header)
    if payload_bytes > allowed:
        raise IntegrityError(f"{what}: a {str(header.get('kind'))[:40]!r} record claims {payload_bytes} payload bytes, "
                             f"but {why} {allowed}: the file is damaged or crafted (refused before reading them). "
                             "Save the conversation again, and load files only from where you would load weights "
                             "from.")
    return header


def decode(buffer: bytes | bytearray | memoryview, what: str = "record") -> tuple[dict[str, Any], memoryview]:
    """Check and split one whole record; ``what`` names it in errors (a file name, a key)."""
    view = memoryview(buffer).cast("B")
    header_bytes, payload_bytes, checksum = _parse_prefix(view[:PREFIX_BYTES], what)
    expected = PREFIX_BYTES + header_bytes + payload_bytes
    if len(view) != expected:
        raise IntegrityError(f"{what}: {len(view)} bytes, the record says {expected} (a torn or truncated write).")
    text = view[PREFIX_BYTES : PREFIX_BYTES + header_bytes]
    payload = view[PREFIX_BYTES + header_bytes :]
    return _finish(text, payload, checksum, what), payload


def _read_exact(stream: io.BufferedIOBase, size: int, what: str) -> bytearray:
    data = bytearray(size)
    got = stream.readinto(data) if size else 0
    if got != size:
        raise IntegrityError(f"{what}: ended after {got} of {size} bytes (a torn or truncated write).")
    return data


def _check_room(header_bytes: int, payload_bytes: int, left: int | None, what: str) -> None:
    """Refuse a record that claims more bytes than its file has left — before anything is allocated."""
    if left is not None and header_bytes + payload_bytes > left:
        raise IntegrityError(f"{what}: a record claims {header_bytes} header and {payload_bytes} payload bytes, "
                             f"the file has {left} left (a truncated file, or crafted lengths).")


def _left(stream: Any, position: int) -> int | None:
    """Bytes of ``stream``'s file after ``position`` (None for a stream that is not a file)."""
    try:
        return os.fstat(stream.fileno()).st_size - position
    except (AttributeError, OSError, ValueError):
        return None


def read(stream: io.BufferedIOBase, what: str = "record",
         limit: Limit | None = None) -> tuple[dict[str, Any], bytearray]:
    """Read and check the next record of a binary stream (the payload is a fresh, writable bytearray). In a
    file, lengths beyond the file's real size are refused before the payload is allocated, and so is a payload
    larger than ``limit`` allows for the record's own header (a sparse file has the bytes it claims)."""
    header_bytes, payload_bytes, checksum = _parse_prefix(_read_exact(stream, PREFIX_BYTES, what), what)
    _check_room(header_bytes, payload_bytes, _left(stream, stream.tell()) if hasattr(stream, "tell") else None,
                what)
    text = _read_exact(stream, header_bytes, what)
    header = _check_limit(text, payload_bytes, limit, what)
    payload = _read_exact(stream, payload_bytes, what)
    return _finish(text, memoryview(payload), checksum, what, header), payload


async def aread(stream: Any, what: str = "record", limit: Limit | None = None) -> tuple[dict[str, Any], bytearray]:
    """:func:`read` for an asynchronous file (``aiofiles``) opened in binary mode."""

    async def exact(size: int) -> bytes:  # finished: a cancelled read ends before the file can be closed under it
        data = await finished(stream.read(size)) if size else b""
        if len(data) != size:
            raise IntegrityError(f"{what}: ended after {len(data)} of {size} bytes (a torn or truncated write).")
        return data

    header_bytes, payload_bytes, checksum = _parse_prefix(await exact(PREFIX_BYTES), what)
    _check_room(header_bytes, payload_bytes, _left(stream, await finished(stream.tell())), what)
    text = await exact(header_bytes)
    header = _check_limit(text, payload_bytes, limit, what)
    payload = bytearray(await exact(payload_bytes))
    return _finish(text, memoryview(payload), checksum, what, header), payload


# ------------------------------------------------------------------------------------------ tensors
def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (copied to the host, made contiguous), any dtype (bfloat16 included)."""
    import torch

    host = tensor.detach().to("cpu").contiguous()
    return host.view(torch.uint8).numpy().data.cast("B")


def tensor_from(payload: bytearray | memoryview, dtype_name: Any, shape: Any, what: str = "record") -> torch.Tensor:
    """A tensor view of ``payload`` (writable, not copied); IntegrityError unless ``dtype_name`` names a torch
    dtype, ``shape`` is a list of sizes, and their bytes are exactly the payload's (both come from files)."""
    import torch

    dtype = _layout(len(payload), dtype_name, shape, what)
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype).view(*shape)


def _layout(size: int, dtype_name: Any, shape: Any, what: str) -> torch.dtype:
    """The dtype ``dtype_name`` names; IntegrityError unless it is a torch dtype, ``shape`` a list of sizes,
    and ``size`` bytes exactly hold ``shape`` of it."""
    import torch

    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) and _NAME.match(dtype_name) else None
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"{what}: field 'dtype' is {str(dtype_name)[:40]!r}, not a torch dtype.")
    if not isinstance(shape, (list, tuple)) or not 0 < len(shape) <= 8 or \
            any(type(size) is not int or size < 0 for size in shape):
        raise IntegrityError(f"{what}: field 'shape' is {str(shape)[:80]!r}, not a list of sizes.")
    if math.prod(shape) * dtype.itemsize != size:
        raise IntegrityError(f"{what}: {size} payload bytes do not hold {list(shape)} of {dtype_name}.")
    return dtype


def encode_block(key: str, namespace: str, depth: int, kv: torch.Tensor) -> tuple[bytes, memoryview]:
    """A block record of ``kv`` ``[layers, 2, H_kv, block_tokens, D]`` under ``key`` (``namespace``: the
    root of its chain, ``depth``: its index in the chain)."""
    return encode(_block_header(key, namespace, depth, str(kv.dtype).removeprefix("torch."), kv.shape),
                  tensor_bytes(kv))


def _block_header(key: str, namespace: str, depth: int, dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    return {"kind": "block", "key": key, "namespace": namespace, "depth": depth, "dtype": dtype, "shape": list(shape)}


def block_bytes(namespace: Namespace, depth: int = 0) -> int:
    """The bytes of the block record of ``namespace`` at ``depth`` that :func:`encode_block` writes (its header
    without building the payload): what a store must hold to keep that block."""
    root = namespace.root  # a key is as long as a root
    header = _block_header(root, root, depth, namespace.dtype, namespace.block_shape)
    return PREFIX_BYTES + len(_header_text(header)) + _payload_bytes(namespace)


def max_block_bytes(namespace: Namespace) -> int:
    """The most bytes a block record of ``namespace`` can have: reads of one are bounded by it, so a listed or
    served size beyond it is refused before anything is allocated."""
    return PREFIX_BYTES + BLOCK_HEADER_BYTES + _payload_bytes(namespace)


def _payload_bytes(namespace: Namespace) -> int:
    """The K/V bytes of one block record of ``namespace``."""
    import torch

    return math.prod(namespace.block_shape) * getattr(torch, namespace.dtype).itemsize


def decode_block(buffer: bytes | bytearray | memoryview, key: str | None = None,
                 namespace: Namespace | None = None, what: str = "block", depth: int | None = None) -> torch.Tensor:
    """The ``[layers, 2, H_kv, block_tokens, D]`` tensor of a block record (a view of ``buffer``, which should
    be writable — a ``bytearray`` — for the tensor to be). Checks the checksum, then :func:`check_block`."""
    header, payload = decode(buffer, what)
    check_block(header, len(payload), key, namespace, what, depth)
    return tensor_from(payload, header.get("dtype"), header.get("shape"), what)


def check_block(header: dict[str, Any], size: int, key: str | None = None, namespace: Namespace | None = None,
                what: str = "block", depth: int | None = None) -> None:
    """IntegrityError unless a record's ``header`` (with ``size`` payload bytes) is a block whose dtype and shape
    fill the payload and, if given, whose key, depth in its chain, namespace root, dtype and shape are these."""
    if header.get("kind") != "block":
        raise IntegrityError(f"{what}: a {str(header.get('kind'))[:40]!r} record, not a block.")
    if key is not None and header.get("key") != key:
        raise IntegrityError(f"{what}: holds block {str(header.get('key'))[:80]!r}, not {key}.")
    if depth is not None and (type(header.get("depth")) is not int or header["depth"] != depth):
        raise IntegrityError(f"{what}: field 'depth' is {str(header.get('depth'))[:40]!r}, not its place in the "
                             f"chain ({depth}).")
    if namespace is not None:
        expected = (namespace.root, namespace.dtype, list(namespace.block_shape))
        found = (header.get("namespace"), header.get("dtype"), header.get("shape"))
        if found != expected:
            raise IntegrityError(f"{what}: namespace/dtype/shape {str(found)[:200]} differ from the expected "
                                 f"{expected}.")
    _layout(size, header.get("dtype"), header.get("shape"), what)
