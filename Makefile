# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch is pinned for the dev environment only (a CPU wheel on this machine's disk);
# pyproject.toml states the supported range for users.
TORCH_DEV := torch==2.13.0
# torchvision (and so timm) does not import beside that CPU torch: the tests that need it
# (marked `vision`) run in a second venv with the pair that imports together
VENV_TV := .venv-tv
TV_STAMP := $(VENV_TV)/.installed-stamp
TORCH_TV := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test test-vision lint typecheck bench bench-peers test-encoder-peers bench-encoders notebooks clean frontend browser docs docs-serve changelog

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_DEV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP) frontend
	$(BIN)/wsi-loader demo --out demo

# The viewer's third-party front end (OpenSeadragon) from the npm registry, pinned by the lock
# file, copied into the package's static folder (git-ignored; nothing of it is committed).
FRONTEND := wsi_loader/view/browser/frontend
OSD_BUILD := $(FRONTEND)/node_modules/openseadragon/build/openseadragon
OSD_STATIC := wsi_loader/view/browser/static/openseadragon
frontend: $(OSD_STATIC)/openseadragon.min.js

$(OSD_STATIC)/openseadragon.min.js: $(FRONTEND)/package.json $(FRONTEND)/package-lock.json
	cd $(FRONTEND) && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	rm -rf $(OSD_STATIC) && mkdir -p $(OSD_STATIC)
	cp -R $(OSD_BUILD)/openseadragon.min.js $(OSD_BUILD)/images $(OSD_STATIC)/
	cp $(FRONTEND)/node_modules/openseadragon/LICENSE.txt $(OSD_STATIC)/

# The viewer's browser tests drive Debian's chromium (never a downloaded browser)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  elif command -v sudo >/dev/null 2>&1; then sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; \
	  else echo "warning: chromium is not installed and cannot be (not root, no sudo): the viewer's browser tests are skipped" >&2; fi; }

lint: $(STAMP)
	$(BIN)/ruff check wsi_loader tests benchmarks notebooks docs

typecheck: $(STAMP)
	$(BIN)/mypy wsi_loader

test: lint typecheck frontend browser docs
	$(BIN)/python -m pytest
	$(MAKE) test-vision

$(TV_STAMP): pyproject.toml
	test -x $(VENV_TV)/bin/python || $(PYTHON) -m venv $(VENV_TV)
	$(VENV_TV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_TV)/bin/python -m pip install --quiet $(TORCH_TV)
	$(VENV_TV)/bin/python -m pip install --quiet -e '.[test,vision,transformers]'
	touch $@

# the `vision` tests where torchvision imports; WSI_LOADER_REQUIRE_VISION turns their skip into
# a failure, so a broken install cannot pass as skipped tests
test-vision: $(TV_STAMP) frontend
	WSI_LOADER_REQUIRE_VISION=1 $(VENV_TV)/bin/python -m pytest -m vision -p no:cacheprovider

# The documentation site (MkDocs Material), built offline into site/ (git-ignored). --strict: a
# broken link or anchor, a reference that does not resolve, a public name without a
# docstring or an asset fetched from the network fails the build. The API, CLI and
# configuration references are generated from the code by docs/_gen/hooks.py.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
docs: $(STAMP)
	$(MKDOCS) build --strict --quiet

docs-serve: $(STAMP)
	$(MKDOCS) serve --dev-addr 127.0.0.1:8000

# docs/changelog.md from the git history, one section per round (committed: the site builds
# from a shallow clone too)
changelog:
	$(BIN)/python docs/_gen/changelog.py

notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_index.py

# Side by side with cuCIM (benchmarks/bench_peers.py): cuCIM is no dependency of ours, so it goes
# into a venv of its own beside this package (its CPU reader needs no GPU). ARGS: e.g. --quick
VENV_PEERS := .venv-peers
PEERS_STAMP := $(VENV_PEERS)/.installed-stamp
$(PEERS_STAMP): pyproject.toml
	test -x $(VENV_PEERS)/bin/python || $(PYTHON) -m venv $(VENV_PEERS)
	$(VENV_PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_PEERS)/bin/python -m pip install --quiet $(TORCH_DEV)
	$(VENV_PEERS)/bin/python -m pip install --quiet -e . cucim-cu12
	touch $@

bench-peers: $(PEERS_STAMP)
	$(VENV_PEERS)/bin/python benchmarks/bench_peers.py $(ARGS)

# The patch-encoder peers (benchmarks/bench_encoders.py, tests/models/test_encoders_peers.py):
# TRIDENT, CONCH's and MUSK's packages and LazySlide in a venv of their own, never a
# dependency of ours. TRIDENT, CONCH and MUSK are not on PyPI: PEER_SRC names a folder with
# their git checkouts (TRIDENT/, CONCH/ from github.com/mahmoodlab, MUSK/ from
# github.com/lilab-stanford); installed without their pins (TRIDENT pins timm 0.9.16; its
# CONCH v1.5 and Processor code run on the timm of the vision extra).
VENV_ENC := .venv-peers-enc
ENC_STAMP := $(VENV_ENC)/.installed-stamp
PEER_SRC ?= ../peer-src
$(ENC_STAMP): pyproject.toml
	test -d $(PEER_SRC)/TRIDENT && test -d $(PEER_SRC)/CONCH && test -d $(PEER_SRC)/MUSK
	test -x $(VENV_ENC)/bin/python || $(PYTHON) -m venv $(VENV_ENC)
	$(VENV_ENC)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_ENC)/bin/python -m pip install --quiet $(TORCH_TV)
	$(VENV_ENC)/bin/python -m pip install --quiet -e '.[test,vision]' einops einops-exts \
	  'transformers<5' opencv-python-headless scikit-image openslide-python openslide-bin geopandas \
	  shapely matplotlib tqdm huggingface_hub safetensors segmentation-models-pytorch ftfy regex \
	  lazyslide fairscale
	$(VENV_ENC)/bin/python -m pip install --quiet --no-deps $(PEER_SRC)/TRIDENT $(PEER_SRC)/CONCH \
	  $(PEER_SRC)/MUSK
	touch $@

test-encoder-peers: $(ENC_STAMP)
	$(VENV_ENC)/bin/python -m pytest tests/models/test_encoders_peers.py \
	  tests/models/test_encoders_musk.py -p no:cacheprovider

bench-encoders: $(ENC_STAMP)
	$(VENV_ENC)/bin/python benchmarks/bench_encoders.py --peer-python $(VENV_ENC)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(VENV_TV) $(VENV_PEERS) $(VENV_ENC) demo site .cache/mkdocs-jupyter .pytest_cache .mypy_cache .ruff_cache $(FRONTEND)/node_modules wsi_loader/view/browser/static
