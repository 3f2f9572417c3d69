"""Stain transforms from what users and files give: ``stain=`` values (`as_stain`), the
spec an export recorded (`from_spec`), the commands' ``--stain`` options
(`stain_from_options`) and a config file's ``stain`` section (`stain_from_config`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wsi_loader.config import StainConfig
from wsi_loader.errors import ConfigError
from wsi_loader.index._stain_estimates import StainEstimate
from wsi_loader.stain._augment import HEDJitter, RandStain, StainJitter
from wsi_loader.stain._targets import Target
from wsi_loader.stain._transforms import Normalize, StainPipeline, StainTransform


def as_stain(value: Any, key: str = "stain") -> StainPipeline | None:
    """``stain=`` as given (a transform, a list of them, or None) as a `StainPipeline`. The
    commands' ``--stain`` spellings work too: ``"macenko"`` or ``"reinhard"`` is
    ``Normalize(method)`` with the default target (the index's median), ``"none"`` None."""
    if value is None or (isinstance(value, str) and value == "none"):
        return None
    if isinstance(value, StainPipeline):
        return value
    steps = [value] if isinstance(value, (StainTransform, str)) else value
    if isinstance(steps, (list, tuple)):
        steps = [_by_name(s, key) if isinstance(s, str) else s for s in steps]
    if not isinstance(steps, (list, tuple)) or not all(
        isinstance(s, StainTransform) for s in steps
    ):
        raise ConfigError(
            f"invalid value {value!r} for {key!r}: a stain transform of wsi_loader.stain "
            "(Normalize, HEDJitter, StainJitter, RandStain), 'macenko' or 'reinhard' (as "
            "--stain), a list of them, or None",
            key=key,
            value=value,
        )
    return StainPipeline(tuple(steps)) if steps else None


def _by_name(method: str, key: str) -> Normalize:
    if method not in ("macenko", "reinhard"):
        raise ConfigError(
            f"invalid value {method!r} for {key!r}: 'macenko' or 'reinhard' (as --stain: "
            "Normalize(method) with the index's median target), Normalize(method, "
            "target=...) for another target, a stain transform of wsi_loader.stain, a list "
            "of them, or None",
            key=key,
            value=method,
        )
    return Normalize(method)


def from_spec(spec: Sequence[dict[str, Any]]) -> StainPipeline | None:
    """The transforms `StainPipeline.spec` described (not yet bound)."""
    steps: list[StainTransform] = []
    for s in spec:
        kind = s.get("transform")
        if kind == "normalize":
            steps.append(
                Normalize(
                    s["method"],
                    per_tile=bool(s.get("per_tile")),
                    resolved=StainEstimate.from_json(s["target"]),
                )
            )
        elif kind == "hed_jitter":
            steps.append(
                HEDJitter(sigma=s["sigma"], bias=s["bias"], clamp=s["clamp"], seed=s["seed"])
            )
        elif kind == "stain_jitter":
            steps.append(
                StainJitter(sigma=s["sigma"], concentration=s["concentration"], seed=s["seed"])
            )
        elif kind == "rand_stain":
            steps.append(RandStain(spread=s["spread"], seed=s["seed"]))
        else:
            raise ConfigError(f"unknown stain transform {kind!r}", key="stain")
    return StainPipeline(tuple(steps)) if steps else None


def stain_from_options(method: str | None, target: Target = None) -> Normalize | None:
    """The normalisation the commands' ``--stain METHOD --stain-target T`` ask for (None for
    no ``--stain``): what ``export``, ``features``, ``predict`` and ``mosaic`` use."""
    if method is None or method == "none":
        return None
    return Normalize(method, target=target)


def stain_from_config(
    config: StainConfig, method: str | None = None, target: Target = None
) -> list[StainTransform] | None:
    """The transforms a config file's ``stain`` section asks for (normalisation, then the
    augmentations in order; None for none); ``method``/``target`` (``--stain``,
    ``--stain-target``) override its ``normalize``/``target``."""
    steps: list[StainTransform] = []
    method = method or config.normalize
    if method is not None and method != "none":
        chosen = target if target is not None else config.target
        steps.append(Normalize(method, target=chosen, per_tile=config.per_tile))
    for i, step in enumerate(config.augment):
        seed = config.seed + i  # each augmentation draws its own numbers
        if step.hed_jitter is not None:
            h = step.hed_jitter
            steps.append(HEDJitter(sigma=h.sigma, bias=h.bias, clamp=h.clamp, seed=seed))
        elif step.stain_jitter is not None:
            j = step.stain_jitter
            steps.append(StainJitter(sigma=j.sigma, concentration=j.concentration, seed=seed))
        elif step.rand_stain is not None:
            steps.append(RandStain(spread=step.rand_stain.spread, seed=seed))
    return steps or None
