"""Batches on the device.

- `_loader`: `DeviceLoader` copies each uint8 batch from pinned memory on a side stream,
  converts and normalises it there, applies stain transforms on the device, and decodes
  JPEG bytes (``make_loader(decode="device")``: nvJPEG, or libjpeg-turbo on the CPU), marking
  and quarantining the tiles whose bytes do not decode
- `_devices`: `resolve_device`, a device name checked once, before any slide is read
- `_bench`: ``wsi-loader bench``, the whole path measured against OpenSlide

May import: `slides`, `index`, `stain`, `dataset` and the foundation modules; imports torch.
"""

from wsi_loader.device._devices import resolve_device
from wsi_loader.device._loader import DeviceLoader, decode_encoded

__all__ = ["DeviceLoader", "decode_encoded", "resolve_device"]
