"""Bytes below the readers: where a slide's bytes come from (local files, object stores,
HTTP) and how they are fetched (range planning and coalescing, a byte cache, look-ahead,
local copies of whole remote slides).

Readers ask for byte ranges and never know where the bytes come from. May import: the
foundation modules (`wsi_loader.errors`, `wsi_loader.files`) only; never torch.

- `_sources`: URL helpers, `RemoteBytes` (a remote slide as a file object), stat, listing,
  download, read-ahead of local ranges
- `_range_cache`, `_request_plan`: `RangeStore`, the byte cache that fetches the planned
  ranges of the next batches together; which ranges one request should merge
- `_remote`, `_remote_errors`, `_curl`, `_sigv4`: object-store and HTTP clients and their
  errors mapped to ours
- `_local_copies`: whole remote slides copied to a local cache folder (vendor formats that
  only OpenSlide reads)
"""

from wsi_loader.slides.storage._sources import (
    MAX_REQUEST,
    Range,
    RangeStore,
    RemoteBytes,
    RemoteStat,
    coalesce,
)

__all__ = ["MAX_REQUEST", "Range", "RangeStore", "RemoteBytes", "RemoteStat", "coalesce"]
