"""The shared remote tier: content-addressed blocks on Redis/Valkey, below the disk tier (docs/remote.md)."""

from tierkv.remote.store import RemoteBlockStore
from tierkv.remote.url import RemoteURL, parse_remote_url

__all__ = ["RemoteBlockStore", "RemoteURL", "parse_remote_url"]
