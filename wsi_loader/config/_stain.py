"""The ``stain`` section: normalisation and the augmentations, in order."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from wsi_loader.config._base import PathText, Strict


class HEDJitterConfig(Strict):
    """`wsi_loader.stain.HEDJitter`: per tile and HED channel, h * U(1 +- sigma) + U(+-bias)."""

    sigma: float = Field(
        0.05, ge=0, lt=1, description="HED values scaled by U(1 - sigma, 1 + sigma)"
    )
    bias: float = Field(0.05, ge=0, lt=1, description="then shifted by U(-bias, bias)")
    clamp: bool = Field(False, description="cut negative HED values first (scikit-image's trip)")


class StainJitterConfig(Strict):
    """`wsi_loader.stain.StainJitter`: the slide's stain vectors and concentrations moved."""

    sigma: float = Field(0.05, ge=0, lt=1, description="N(0, sigma) added to each vector component")
    concentration: float = Field(
        0.1, ge=0, lt=1, description="concentrations scaled by U(1 - c, 1 + c)"
    )


class RandStainConfig(Strict):
    """`wsi_loader.stain.RandStain`: a Reinhard target drawn from the archive's spread."""

    spread: float = Field(
        1.0, ge=0, le=10, description="the spread of the slides' LAB statistics, times this"
    )


class AugmentStep(Strict):
    """One augmentation of ``stain.augment``: a mapping with one of these keys (its options,
    or null for the defaults)."""

    hed_jitter: HEDJitterConfig | None = None
    stain_jitter: StainJitterConfig | None = None
    rand_stain: RandStainConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_null(cls, data: Any) -> Any:
        # `- hed_jitter:` (null) asks for the defaults, as `- hed_jitter: {}` does
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _one(self) -> AugmentStep:
        given = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(given) != 1:
            names = ", ".join(type(self).model_fields)
            raise ValueError(f"each augment step is one of {names} (got {given or 'none'})")
        return self

    @property
    def name(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)


class StainConfig(Strict):
    """The ``stain`` section: normalisation, then augmentations in order, of the tiles the
    commands read (export, features, predict, mosaic; their ``--stain``/``--stain-target``
    flags override ``normalize``/``target``) and of ``make_loader(stain=...)`` through
    `wsi_loader.stain.stain_from_config`."""

    normalize: Literal["macenko", "reinhard"] | None = Field(
        None, description="macenko | reinhard (null: no normalisation)"
    )
    target: PathText | None = Field(
        None,
        min_length=1,
        description="an image, a reference JSON, an index folder or a slide (null: the "
        "index's median stain)",
    )
    per_tile: bool = Field(False, description="estimate every tile, not its slide's values")
    augment: list[AugmentStep] = Field(default_factory=list)
    seed: int = Field(0, description="seed of the augmentations (with the epoch and the row)")

    @model_validator(mode="after")
    def _target_needs_normalize(self) -> StainConfig:
        for key, used in (("target", self.target is not None), ("per_tile", self.per_tile)):
            if used and self.normalize is None:
                raise ValueError(f"{key} needs normalize: macenko or normalize: reinhard")
        return self
