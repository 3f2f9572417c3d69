"""Context tiles through make_loader (workers), DeviceLoader, per-item samples, bags, and the
index default (`index --context`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.dataset import SlideBagDataset, TileBatch, TileDataset, make_loader
from wsi_loader.device._loader import IMAGENET_MEAN, IMAGENET_STD, DeviceLoader
from wsi_loader.index import SlideIndex, build_index

SCALES = [(2.0, 224), (0.5, 101)]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> SlideIndex:
    out = tmp_path_factory.mktemp("ctx")
    slides = [make_slide(width=2048, height=1536, seed=s, mpp=0.25) for s in (41, 42)]
    return build_index(slides, out / "idx", tile_size=112, mpp=0.5, min_tissue=0.0)


def normalised(nhwc: torch.Tensor) -> torch.Tensor:
    x = nhwc.permute(0, 3, 1, 2).float() / 255
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def batches(index: SlideIndex, workers: int, start: str | None) -> list[TileBatch]:
    loader = make_loader(
        index,
        context=SCALES,
        batch_size=24,
        seed=5,
        num_workers=workers,
        multiprocessing_context=start,
        record_failures=False,
    )
    return list(loader)


@pytest.mark.parametrize(("workers", "start"), [(2, "fork"), (2, "spawn")])
def test_two_workers_give_the_batches_of_none(index: SlideIndex, workers: int, start: str) -> None:
    alone = batches(index, 0, None)
    assert len(alone) > 2 and alone[0].context is not None
    for got, expected in zip(batches(index, workers, start), alone, strict=True):
        assert torch.equal(got.rows, expected.rows)
        assert torch.equal(got.images, expected.images)
        assert got.context is not None and expected.context is not None
        assert len(got.context) == len(SCALES)
        for k, (_, size) in enumerate(SCALES):
            assert got.context[k].dtype == torch.uint8
            assert got.context[k].shape == (len(got), size, size, 3)
            assert torch.equal(got.context[k], expected.context[k])
        assert torch.equal(got.context_inside, expected.context_inside)
        assert torch.equal(got.ok, expected.ok)


def test_items_and_batches_agree(index: SlideIndex) -> None:
    ds = TileDataset(index, context=SCALES, record_failures=False)
    batch = ds.read_batch([3, 0, len(index) - 1])
    for i, row in enumerate(batch.rows.tolist()):
        sample = ds[row]
        for k in range(len(SCALES)):
            assert torch.equal(sample["context"][k], batch.context[k][i].permute(2, 0, 1))
        assert torch.equal(sample["context_inside"], batch.context_inside[i])
    # a plain DataLoader collates the per-item context lists
    plain = next(iter(DataLoader(ds, batch_size=4)))
    assert [tuple(c.shape) for c in plain["context"]] == [(4, 3, 224, 224), (4, 3, 101, 101)]


def test_reused_buffers_hold_every_scale_until_released(index: SlideIndex) -> None:
    """Each scale's buffer is reused only when nothing holds it: batches kept across an
    epoch keep their context pixels."""
    loader = make_loader(index, context=SCALES, batch_size=8, num_workers=0, shuffle=False)
    kept = list(loader)
    assert any(b.recycled for b in kept)
    again = TileDataset(index, context=SCALES, record_failures=False)
    for batch in kept:
        fresh = again.read_batch(batch.rows.tolist())
        for k in range(len(SCALES)):
            assert torch.equal(batch.context[k], fresh.context[k])


def test_device_loader_normalises_every_scale(index: SlideIndex) -> None:
    loader = make_loader(index, context=SCALES, batch_size=8, num_workers=0, sampler=range(24))
    raw = list(loader)
    for got, batch in zip(DeviceLoader(loader, "cpu"), raw, strict=True):
        torch.testing.assert_close(got["image"], normalised(batch.images), atol=1e-5, rtol=1e-5)
        assert len(got["context"]) == len(SCALES)
        assert {"context", "context_inside", "context_mask"} <= set(got)  # docs/journeys/gpu.md
        for k, tiles in enumerate(got["context"]):
            assert tiles.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(tiles, normalised(batch.context[k]), atol=1e-5, rtol=1e-5)
            assert torch.equal(got["context_mask"][k], batch.context_mask(k))
    # the dict path (a plain DataLoader of samples) moves and normalises the lists too
    ds = TileDataset(index, context=SCALES, record_failures=False)
    first = next(iter(DeviceLoader(DataLoader(ds, batch_size=4), "cpu", channels_last=False)))
    expected = torch.stack([ds[i]["context"][1] for i in range(4)]).permute(0, 2, 3, 1)
    torch.testing.assert_close(first["context"][1], normalised(expected), atol=1e-5, rtol=1e-5)


def test_bags_carry_context(index: SlideIndex) -> None:
    bags = SlideBagDataset(index, k=4, context=SCALES, record_failures=False)
    bag = bags[0]
    assert [tuple(c.shape) for c in bag["context"]] == [(4, 3, 224, 224), (4, 3, 101, 101)]
    assert tuple(bag["context_inside"].shape) == (4, 2, 4)


def test_index_records_the_default_context(
    tmp_path: Path,
    make_slide: SlideFactory,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for name, mpp in (("forty", 0.25), ("twenty", 0.5)):
        (slides / f"{name}.svs").write_bytes(
            make_slide(width=1024, height=768, seed=43, mpp=mpp).read_bytes()
        )
    out = tmp_path / "idx"
    args = ["index", str(slides), "--out", str(out), "--tile-size", "64", "--min-tissue", "0"]
    assert main([*args, "--context", "2.0:96,1.0:64", "--no-progress"]) == 0
    index = SlideIndex.open(out)
    assert index.params["context"] == [[2.0, 96], [1.0, 64]]
    assert TileDataset(index).context == [(2.0, 96), (1.0, 64)]
    assert TileDataset(index, context=[]).context == []
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "context: 96 px at 2 um/px, 64 px at 1 um/px" in capsys.readouterr().out
    batch = next(iter(make_loader(index, batch_size=4, num_workers=0)))
    assert batch.context is not None and [c.shape[1] for c in batch.context] == [96, 64]
    # the same build again carries every slide over; a scale finer than a scan fails it
    assert main([*args, "--context", "2.0:96,1.0:64", "--no-progress"]) == 0
    assert SlideIndex.open(out).meta["build"] == {"unchanged": 2, "indexed": 0}
    assert main([*args, "--context", "0.25:64", "--no-progress"]) == 0
    failed = {Path(s.path).stem: s.error for s in SlideIndex.open(out).slides if s.error}
    assert list(failed) == ["twenty"]
    assert "context scale 0.25 um/px: the slide's resolution 0.5 um/px is coarser" in (
        failed["twenty"] or ""
    )
    assert "context scale 0.25 um/px" in caplog.text


@pytest.mark.parametrize(
    ("text", "scales"),
    [
        ("dataset:\n  context: [[2.0, 224], [8, 64]]\n", [(2.0, 224), (8.0, 64)]),
        ("dataset:\n  context: ['2.0:224']\n", [(2.0, 224)]),
        ("dataset:\n  context:\n    - {mpp: 2.0, size: 224}\n", [(2.0, 224)]),
        ("dataset:\n  context: []\n", []),
    ],
)
def test_context_from_a_config_file(tmp_path: Path, text: str, scales: list) -> None:  # type: ignore[type-arg]
    from wsi_loader.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(path).dataset.context == scales


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([(2.0, 0)], "context tile size 0 is not in 1..16384"),
        ([(-1.0, 224)], r"context MPP -1.0 is not in \(0, 1000\]"),
        ("2.0:big", "is not MPP:SIZE"),
        ([(2.0, 224), (2.0, 224)], "context scales repeat"),
        ([(2.0, 224)] * 9, "at most 8 context scales"),
    ],
)
def test_bad_context_scales_are_config_errors(
    index: SlideIndex, value: object, message: str
) -> None:
    from wsi_loader.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        TileDataset(index, context=value)  # type: ignore[arg-type]
    assert (info.value.key or "").startswith("context")


def test_device_decode_ships_the_tiles_compressed_and_the_context_decoded(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    """decode='device': tiles that are one JPEG storage tile travel compressed; their
    context tiles (windows of other levels) are decoded in the worker as always."""
    slide = make_slide(width=2048, height=1536, seed=44, mpp=0.5)
    aligned = build_index([slide], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.0)
    options = {"context": [(2.0, 128)], "num_workers": 0, "sampler": range(16)}
    raw = next(iter(make_loader(aligned, batch_size=16, decode="device", **options)))
    assert raw.encoded is not None and all(e is not None for e in raw.encoded)
    on_cpu = next(iter(DeviceLoader(make_loader(aligned, batch_size=16, **options), "cpu")))
    on_device = next(
        iter(DeviceLoader(make_loader(aligned, batch_size=16, decode="device", **options), "cpu"))
    )
    torch.testing.assert_close(on_device["image"], on_cpu["image"])
    torch.testing.assert_close(on_device["context"][0], on_cpu["context"][0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_loader_normalises_every_scale_like_the_cpu(index: SlideIndex) -> None:
    loader = make_loader(
        index, context=SCALES, batch_size=8, num_workers=2, sampler=range(24), pin_memory=True
    )
    cpu = list(DeviceLoader(loader, "cpu"))
    gpu = list(DeviceLoader(loader, "cuda"))
    for a, b in zip(cpu, gpu, strict=True):
        for k in range(len(SCALES)):
            assert b["context"][k].is_cuda and b["context_mask"][k].is_cuda
            torch.testing.assert_close(a["context"][k], b["context"][k].cpu())
            assert torch.equal(a["context_mask"][k], b["context_mask"][k].cpu())


def test_stain_transforms_apply_to_every_scale_with_the_tiles_draw(index: SlideIndex) -> None:
    """A random stain transform draws once per row and epoch: the context tiles of a row get
    the transform its tile gets (in the dataset, in DeviceLoader, in ds[row]), so the scales
    of a row keep one colour."""
    from wsi_loader.stain import HEDJitter

    rows = [0, 5, len(index) - 1]
    plain = TileDataset(index, context=SCALES, record_failures=False).read_batch(rows)
    jitter = HEDJitter(0.1, 0.05, seed=3).bind(index)
    slide_ids, ok = plain.slide_id.numpy(), plain.ok.numpy()

    def expected(tiles: torch.Tensor) -> torch.Tensor:
        pixels = tiles.numpy().copy()
        jitter.apply_numpy(pixels, slide_ids, plain.rows.numpy(), 2, ok)
        return torch.from_numpy(pixels)

    stained = TileDataset(index, context=SCALES, stain=HEDJitter(0.1, 0.05, seed=3))
    stained.set_epoch(2)
    got = stained.read_batch(rows)
    assert torch.equal(got.images, expected(plain.images))
    assert got.context is not None and plain.context is not None
    for k in range(len(SCALES)):
        assert not torch.equal(got.context[k], plain.context[k])  # the jitter did something
        assert torch.equal(got.context[k], expected(plain.context[k]))
    sample = stained[rows[1]]
    for k in range(len(SCALES)):
        assert torch.equal(sample["context"][k], got.context[k][1].permute(2, 0, 1))
    # on the device: DeviceLoader(stain=...) on the batch of an unstained dataset
    want = [normalised(expected(tiles)) for tiles in plain.context]
    plain.epoch = 2
    device = DeviceLoader([plain], "cpu", stain=HEDJitter(0.1, 0.05, seed=3), index=index)
    on_device = next(iter(device))
    for k in range(len(SCALES)):
        torch.testing.assert_close(on_device["context"][k], want[k], atol=1e-5, rtol=1e-5)
