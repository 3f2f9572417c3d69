from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.device._loader import IMAGENET_MEAN, IMAGENET_STD, DeviceLoader
from wsi_loader.index import SlideIndex


def expected(images_nhwc: torch.Tensor) -> torch.Tensor:
    x = images_nhwc.permute(0, 3, 1, 2).float() / 255
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def test_cpu_device_loader_normalises_and_keeps_metadata(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=8, num_workers=0, shuffle=False)
    raw = list(loader)
    device_batches = list(DeviceLoader(loader, "cpu"))
    assert len(device_batches) == len(raw)
    for got, batch in zip(device_batches, raw, strict=True):
        assert got["image"].dtype == torch.float32 and got["image"].shape == (
            len(batch),
            3,
            256,
            256,
        )
        assert got["image"].is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got["image"], expected(batch.images), atol=1e-5, rtol=1e-5)
        assert torch.equal(got["row"], batch.rows) and torch.equal(got["ok"], batch.ok)


def test_cpu_batches_reuse_memory_only_once_let_go(index: SlideIndex) -> None:
    """The CPU conversion writes into reused float buffers: a batch the consumer dropped is
    written over, one it kept never is."""
    loader = make_loader(index, batch_size=4, num_workers=0, shuffle=False)
    raw = [batch.images.clone() for batch in loader]
    assert len(raw) > 8  # more batches than the ring holds
    kept, addresses = [], set()
    for i, got in enumerate(DeviceLoader(loader, "cpu")):
        addresses.add(got["image"].data_ptr())
        if i % 3 == 0:
            kept.append(got["image"])  # the others are let go at once
    assert len(addresses) < len(raw)  # memory was reused
    for image, pixels in zip(kept, raw[::3], strict=True):
        torch.testing.assert_close(image, expected(pixels), atol=1e-5, rtol=1e-5)


def test_device_decode_mode_equals_cpu_mode(index: SlideIndex) -> None:
    cpu = list(DeviceLoader(make_loader(index, batch_size=8, num_workers=0, shuffle=False), "cpu"))
    dev = list(
        DeviceLoader(
            make_loader(index, batch_size=8, num_workers=2, shuffle=False, decode="device"),
            "cpu",
            channels_last=False,
        )
    )
    for a, b in zip(cpu, dev, strict=True):
        assert b["image"].is_contiguous()
        torch.testing.assert_close(a["image"], b["image"])
        assert torch.equal(a["ok"], b["ok"])


def test_device_decode_quarantines_a_bad_tile_once_over_epochs(index: SlideIndex) -> None:
    # with decode="device" the main process decodes, epoch after epoch: each failure of a
    # corrupt tile was appended again (3 epochs: 3 records per tile)
    loader = DeviceLoader(
        make_loader(index, batch_size=8, num_workers=0, shuffle=False, decode="device"), "cpu"
    )
    for _ in range(3):
        failed = sum(int((~batch["ok"]).sum()) for batch in loader)
        assert failed == len(corrupt_rows(index))
    records = index.quarantine.read()
    assert sorted(r["row"] for r in records) == sorted(corrupt_rows(index).tolist())


def test_undecoded_tiles_are_not_ok_until_decoded(index: SlideIndex) -> None:
    """decode="device" batches read without DeviceLoader hold compressed tiles whose rows are
    still zero: they were marked ok (43 of 43, corrupt tiles included), so a loop that forgot
    the DeviceLoader trained on black tiles. Not ok until decoded; then ok where they decode."""
    loader = make_loader(index, batch_size=8, num_workers=0, shuffle=False, decode="device")
    pending = 0
    for batch in loader:
        encoded = torch.tensor([e is not None for e in batch.encoded or [None] * len(batch)])
        pending += int(encoded.sum())
        assert not batch.ok[encoded].any()
    assert pending > len(corrupt_rows(index))
    decoded = list(DeviceLoader(loader, "cpu"))
    ok = torch.cat([b["ok"] for b in decoded])
    rows = torch.cat([b["row"] for b in decoded])
    assert sorted(rows[~ok].tolist()) == sorted(corrupt_rows(index).tolist())


def test_plain_dataloader_dicts_work_too(index: SlideIndex) -> None:
    loader = DataLoader(TileDataset(index), batch_size=4)
    batch = next(iter(DeviceLoader(loader, "cpu", mean=None, std=None, dtype=torch.float64)))
    assert batch["image"].dtype == torch.float64 and float(batch["image"].max()) <= 1.0


def test_option_checks(index: SlideIndex) -> None:
    loader = make_loader(index, num_workers=0)
    with pytest.raises(ValueError, match="both mean and std"):
        DeviceLoader(loader, "cpu", mean=(0.5, 0.5, 0.5), std=None)
    with pytest.raises(ValueError, match="floating point"):
        DeviceLoader(loader, "cpu", dtype=torch.uint8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DeviceLoader(loader, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_matches_cpu(index: SlideIndex) -> None:
    loader = make_loader(index, batch_size=8, num_workers=2, shuffle=False, pin_memory=True)
    cpu = list(DeviceLoader(loader, "cpu"))
    gpu = list(DeviceLoader(loader, "cuda"))
    for a, b in zip(cpu, gpu, strict=True):
        assert b["image"].is_cuda
        torch.testing.assert_close(a["image"], b["image"].cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_mode(index: SlideIndex) -> None:
    cpu = list(DeviceLoader(make_loader(index, batch_size=8, num_workers=0, shuffle=False), "cpu"))
    gpu = list(
        DeviceLoader(
            make_loader(index, batch_size=8, num_workers=2, shuffle=False, decode="device"), "cuda"
        )
    )
    for a, b in zip(cpu, gpu, strict=True):
        # nvJPEG and libjpeg-turbo may round differently by a grey level or two
        assert float((a["image"] - b["image"].cpu()).abs().mean()) < 0.05
        assert torch.equal(a["ok"], b["ok"].cpu())  # decoded on the device: ok again


def test_device_decode_failures_are_recorded_and_filled_as_the_dataset_does(
    index: SlideIndex,
) -> None:
    # the main process's decode wrote records without the tile's level (so they matched any
    # level at that position, and were not the same record as the workers' own) and filled
    # a failed tile with 255 whatever the dataset's fill_value
    loader = DeviceLoader(
        make_loader(
            index, batch_size=8, num_workers=0, shuffle=False, decode="device", fill_value=0
        ),
        "cpu",
        channels_last=False,
    )
    black = expected(torch.zeros(1, 1, 1, 3, dtype=torch.uint8))
    failed = 0
    for batch in loader:
        for image in batch["image"][~batch["ok"]]:
            torch.testing.assert_close(image, black.expand_as(image[None])[0])
            failed += 1
    assert failed == len(corrupt_rows(index))
    levels = index.columns["level"]
    records = index.quarantine.read()
    assert records and all(r["kind"] == "tile" for r in records)
    assert all(r["level"] == int(levels[r["row"]]) for r in records)
