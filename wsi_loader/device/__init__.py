"""Batches on the device: `DeviceLoader` copies each uint8 batch from pinned memory on a side
stream, converts and normalises it there (or decodes JPEG bytes with nvJPEG), and applies
stain transforms on the device; `resolve_device` checks a device name once, up front.
``wsi-loader bench`` (`_bench`) measures the whole path against OpenSlide.

May import: `slides`, `index`, `stain`, `dataset` and the foundation modules; imports torch.
"""

from wsi_loader.device._devices import resolve_device
from wsi_loader.device._loader import DeviceLoader, decode_encoded

__all__ = ["DeviceLoader", "decode_encoded", "resolve_device"]
