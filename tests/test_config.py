from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from wsi_loader.config import (
    Config,
    IndexConfig,
    StainConfig,
    StainJitterConfig,
    load_config,
    with_overrides,
)
from wsi_loader.errors import ConfigError


def test_documented_default_file_equals_the_defaults() -> None:
    assert load_config(REPO / "configs" / "index.yaml") == Config()


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        (
            "index:\n  tile_sise: 256\n",
            "index.tile_sise",
            r"unknown key 'index.tile_sise' \(did you mean 'tile_size'\?\)",
        ),
        (
            "dataset:\n  on_eror: raise\n",
            "dataset.on_eror",
            r"unknown key 'dataset.on_eror' \(did you mean 'on_error'\?\)",
        ),
        ("indx:\n  mpp: 0.5\n", "indx", r"unknown key 'indx' \(did you mean 'index'\?\)"),
        (
            "index:\n  tile_size: big\n",
            "index.tile_size",
            "invalid value 'big' for 'index.tile_size'",
        ),
        ("index:\n  tile_size: '256'\n", "index.tile_size", "invalid value '256'"),
        ("index:\n  min_tissue: 1.5\n", "index.min_tissue", "less than or equal to 1"),
        ("index:\n  mpp: 0.5\n  level: 1\n", "index", "either mpp or level"),
        ("dataset:\n  on_error: ignore\n", "dataset.on_error", "'fill', 'substitute' or 'raise'"),
        ("exports: {}\n", "exports", "unknown key 'exports' \\(did you mean 'export'"),
        ("index:\n  zzz: 1\n", "index.zzz", r"unknown key 'index.zzz'$"),  # nothing close
        # YAML keeps the last of a repeated key without a word: an edit appended below an old
        # value, or a second 'index:' section (which replaced the whole first one)
        (
            "index:\n  tile_size: 256\n  mpp: 0.5\n  tile_size: 512\n",
            "index.tile_size",
            r"'index.tile_size' is given twice \(lines 2 and 4\)",
        ),
        (
            "index:\n  tile_size: 512\ndataset:\n  retries: 1\nindex:\n  mpp: 0.25\n",
            "index",
            r"'index' is given twice \(lines 1 and 5\)",
        ),
        (
            "index: {roi: [a], roi: [b]}\n",
            "index.roi",
            r"'index.roi' is given twice \(lines 1 and 1\)",
        ),
        # the stain section
        ("stain:\n  normalize: vahadane\n", "stain.normalize", "'macenko' or 'reinhard'"),
        ("stain:\n  target: ref.json\n", "stain", "target needs normalize: macenko"),
        ("stain:\n  per_tile: true\n", "stain", "per_tile needs normalize"),
        (
            "stain:\n  augment:\n  - hed_jitter: {sigma: 1.5}\n",
            "stain.augment.0.hed_jitter.sigma",
            "invalid value 1.5 for 'stain.augment.0.hed_jitter.sigma'",
        ),
        (
            "stain:\n  augment:\n  - {hed_jitter: {}, rand_stain: {}}\n",
            "stain.augment.0",
            r"one of hed_jitter, stain_jitter, rand_stain \(got \['hed_jitter', 'rand_stain'\]\)",
        ),
        ("stain:\n  augment: [hed_jitter]\n", "stain.augment.0", "valid dictionary"),
        ("stain:\n  target: ''\n  normalize: macenko\n", "stain.target", "at least 1"),
    ],
)
def test_errors_name_key_value_and_file(tmp_path: Path, text: str, key: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert info.value.key == key and info.value.path == str(path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("text", "key", "close"),
    [
        ("index:\n  tile_sise: 256\n", "index.tile_sise", "tile_size"),
        ("stian:\n  normalize: macenko\n", "stian", "stain"),
        ("stain:\n  normalise: macenko\n", "stain.normalise", "normalize"),
        (
            "stain:\n  augment:\n  - stain_jiter: {}\n",
            "stain.augment.0.stain_jiter",
            "stain_jitter",
        ),
        (
            "stain:\n  augment:\n  - hed_jitter: {sgima: 1}\n",
            "stain.augment.0.hed_jitter.sgima",
            "sigma",
        ),
        ("dataset:\n  retry: 3\n", "dataset.retry", "retries"),
    ],
)
def test_an_unknown_key_names_the_closest_known_one(
    tmp_path: Path, text: str, key: str, close: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(info.value).endswith(f"unknown key {key!r} (did you mean {close!r}?)")
    path.write_text("index:\n  zzzzz: 1\n")  # nothing close: no suggestion
    with pytest.raises(ConfigError, match=r"unknown key 'index.zzzzz'$"):
        load_config(path)


def test_stain_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(REPO / "configs" / "stain.yaml").stain
    assert (config.normalize, config.target, config.seed) == ("macenko", "ref.json", 7)
    assert [step.name for step in config.augment] == ["hed_jitter", "stain_jitter"]
    assert config.augment[0].hed_jitter is not None and config.augment[0].hed_jitter.sigma == 0.03
    assert config.augment[1].stain_jitter == StainJitterConfig()  # null: the defaults
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("stain:\n  normalize: reinhard\n  target: ~/ref.json\n")
    assert load_config(path).stain.target == str(tmp_path / "ref.json")
    assert Config().stain == StainConfig() and StainConfig().normalize is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "top level must be a mapping"),
        ("index: [\n", "not valid YAML"),
        ("!!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "none.yaml")


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("")
    assert load_config(tmp_path / "c.yaml") == Config()


def test_overrides_win_and_level_clears_mpp() -> None:
    base = IndexConfig(tile_size=512)
    cfg = with_overrides(base, level=2, workers=None)
    assert (cfg.tile_size, cfg.level, cfg.mpp) == (512, 2, None)
    assert with_overrides(cfg, mpp=0.25).level is None
    with pytest.raises(ConfigError, match="'tile_size'") as info:
        with_overrides(base, source="command line", tile_size=-1)
    assert info.value.value == -1 and str(info.value).startswith("command line: ")


def test_paths_may_start_with_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``remote_cache_dir: ~/.cache/...`` in the documented file does: a config file is
    not expanded by a shell, nor is ``--labels=~/x.csv``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text(
        "index:\n  labels: ~/labels.csv\n  root: ~/slides\n  annotations: ~/annotations\n"
        "dataset:\n  root: ~/moved\n  quarantine: ~/q.jsonl\n"
    )
    config = load_config(path)
    assert config.index.labels == str(tmp_path / "labels.csv")
    assert config.index.root == str(tmp_path / "slides")
    assert config.index.annotations == str(tmp_path / "annotations")
    assert config.dataset.root == str(tmp_path / "moved")
    assert config.dataset.quarantine == str(tmp_path / "q.jsonl")
    assert IndexConfig(labels="~/l.csv").labels == str(tmp_path / "l.csv")
    # URLs and names that only contain a tilde are left alone
    assert IndexConfig(labels="s3://b/~/l.csv").labels == "s3://b/~/l.csv"
    assert IndexConfig(labels="a~b.csv").labels == "a~b.csv"


def test_yaml_merge_keys_may_override(tmp_path: Path) -> None:
    # '<<' merges are the one place YAML means a repeated key to override
    path = tmp_path / "c.yaml"
    path.write_text("index:\n  <<: {tile_size: 512, mpp: 0.25}\n  tile_size: 1024\n")
    config = load_config(path)
    assert (config.index.tile_size, config.index.mpp) == (1024, 0.25)


@pytest.mark.timeout(120)  # expanded, 10**29 items: it would never end
def test_a_nest_of_aliases_is_read_in_linear_time(tmp_path: Path) -> None:
    # 'billion laughs' in YAML: each list holds the one before ten times
    lines = ["a0: &a0 [x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 30)
    ]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="unknown key 'a0'"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("index:\n  mpp: None\n  level: 0\n", "index.mpp"),
        # a background class named 'None' would have been made without a word
        ("index:\n  label_from: annotations\n  background_label: None\n", "index.background_label"),
        ("index:\n  roi: [Tumor, none]\n", "index.roi"),
    ],
)
def test_python_none_in_yaml_is_refused_with_the_yaml_spelling(
    tmp_path: Path, text: str, key: str
) -> None:
    # YAML reads None as the text 'None' (its no-value is null or ~)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="write null") as info:
        load_config(path)
    assert info.value.key == key and "line" in str(info.value)
    path.write_text(text.replace("None", "'None'").replace("none", "'none'"))
    try:
        load_config(path)  # quoted, it is the text: whatever the option makes of it
    except ConfigError as exc:
        assert "write null" not in str(exc)


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        (
            "index:\n  mpp: 0.5\n  qc_thresholds: {blurr: 0.4}\n",
            "index.qc_thresholds.blurr",
            "'index.qc_thresholds.blurr': no QC rule 'blurr' (did you mean 'blur'?); "
            "the rules are pen, blur, fold, bubble",
        ),
        (
            "index:\n  mpp: 0.5\n  qc_thresholds: {pen: 2}\n",
            "index.qc_thresholds.pen",
            "invalid value 2.0 for 'index.qc_thresholds.pen': a share of the tile, between 0 and 1",
        ),
        (
            "index:\n  mpp: 0.5\n  level: 1\n",
            "index",
            "'index': give either mpp or level, not both (set the others to null)",
        ),
    ],
)
def test_a_rule_of_a_section_is_said_in_words(
    tmp_path: Path, text: str, key: str, message: str
) -> None:
    # these used to dump the whole section ("invalid value {'mpp': 0.5, ...} for 'index'"),
    # say pydantic's "Value error," and list the rules as a Python tuple, with no close key
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}"
    assert info.value.key == key


def test_an_option_needing_another_names_both_in_words() -> None:
    with pytest.raises(ConfigError) as info:
        with_overrides(IndexConfig(), source="command line", qc="none", qc_exclude=["pen"])
    assert str(info.value) == (
        "command line: 'qc_exclude': drops tiles that quality control flags, but quality "
        "control is off (qc: none); turn it on (qc: all) or leave qc_exclude out"
    )
    assert info.value.key == "qc_exclude" and info.value.value == ["pen"]
