"""Models over an index: specs (``torchvision:``, ``timm:``, ``package.module:callable``,
TorchScript with a JSON config) resolved to a `Model` with its input recipe (`_specs`), and one
model pass over an index that `features` and `predict` write from (`_pass`: strip-order reads,
checked outputs, resume per slide, torchrun ranks, a timeout per slide; `_content`: what a
slide's outputs are made of, the slide known by its content, and the options a run's outputs
depend on; `_pass_files`: the output folder held by one run of one set of options, each
slide's file written whole, files of killed runs removed, each rank's part of a summary).
Patch encoders by name: `_encoder_recipes` (the registry: each model card's recipe),
`_encoders` (a recipe built, on the meta device first, and its weights loaded checked),
`_encoder_weights` (weights offline first: a given file or folder, the Hugging Face cache, a
download; safetensors read here), architectures in our own code under the authors' module
names (`_resnet`: CLAM's truncated ResNet-50, CTransPath's stem; `_conch`: CONCH v1 and v1.5
vision towers around timm's ViT; `_musk`: MUSK's BEiT-3 image path) and `_encoder_checks` (an
index's resolution against the encoder's).

Slide encoders by name: `_slide_encoders` (their registry, each built and its weights loaded
checked; one embedding per slide from the tile features of its patch encoder), with each
architecture in our own code under the authors' module names (`_slide_chief`: CHIEF;
`_slide_titan`: TITAN's vision tower; `_slide_gigapath`: Prov-GigaPath's LongNet;
`_slide_madeleine`: MADELEINE; `_slide_feather`: Feather, MIL-Lab's ABMIL).

May import: `slides`, `index`, `stain`, `dataset`, `device` and the foundation modules.
"""

from wsi_loader.models._encoder_recipes import ENCODERS, Recipe
from wsi_loader.models._encoders import Encoder, encoder, encoder_model, is_encoder_name
from wsi_loader.models._pass import PassOptions, PassReport, run_pass
from wsi_loader.models._slide_encoders import (
    SLIDE_ENCODERS,
    SlideEncoder,
    SlideRecipe,
    slide_encoder,
)
from wsi_loader.models._specs import Model, as_model, load_model

__all__ = [
    "ENCODERS",
    "SLIDE_ENCODERS",
    "Encoder",
    "Model",
    "PassOptions",
    "PassReport",
    "Recipe",
    "SlideEncoder",
    "SlideRecipe",
    "as_model",
    "encoder",
    "encoder_model",
    "is_encoder_name",
    "load_model",
    "run_pass",
    "slide_encoder",
]
