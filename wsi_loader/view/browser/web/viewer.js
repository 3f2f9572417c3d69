// wsi-loader viewer: OpenSeadragon shows the slide's Deep Zoom tiles; one canvas over it draws
// every overlay from the index's columns. The tile grid is a raster with one pixel per grid cell,
// drawn scaled (so 100,000 tiles cost one drawImage), plus outlines of the visible cells when
// they are large enough to see; nothing per tile is a DOM element.
"use strict";

(function () {
  const PALETTE = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189],
    [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207]];
  const UNLABELLED = [120, 120, 120];
  const STATUS_COLOURS = [[46, 160, 67], [220, 38, 38], [245, 159, 0]]; // ok, quarantined, substituted
  // the colours of `inspect --color-by qc` (wsi_loader/view/_notebook.py QC_COLOURS, QC_CLEAN)
  const QC_COLOURS = { pen: [31, 119, 180], fold: [214, 39, 40], bubble: [23, 190, 207], blur: [255, 127, 14] };
  const QC_CLEAN = [46, 160, 67];
  const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const SELECTED = "#facc15";
  const MAX_LISTED = 500;

  const params = new URLSearchParams(window.location.search);
  const token = params.get("token");
  const $ = (id) => document.getElementById(id);

  function api(path, extra) {
    const query = new URLSearchParams(extra || {});
    if (token) query.set("token", token);
    const text = query.toString();
    return text ? `${path}?${text}` : path;
  }

  async function getJSON(path, extra) {
    const response = await fetch(api(path, extra));
    if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
    return response.json();
  }

  function loadImage(url) {
    return new Promise((resolve, reject) => {
      const image = new Image();
      image.onload = () => resolve(image);
      image.onerror = () => reject(new Error(`cannot load ${url}`));
      image.src = url;
    });
  }

  function ramp(value) {
    const pos = Math.min(Math.max(Number.isFinite(value) ? value : 0, 0), 1) * (RAMP.length - 1);
    const lo = Math.floor(pos), hi = Math.min(lo + 1, RAMP.length - 1), t = pos - lo;
    return RAMP[lo].map((c, i) => Math.round(c + (RAMP[hi][i] - c) * t));
  }

  const colourOf = (label) => (label >= 0 ? PALETTE[label % PALETTE.length] : UNLABELLED);
  const css = (rgb) => `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;

  // ---- state -----------------------------------------------------------------------------
  const state = {
    slides: [], labels: [], slide: null, grid: null, annotations: null, tissue: null,
    heatmap: null, heatmapKey: null, selected: null, loading: 0, opened: 0,
  };

  const viewer = OpenSeadragon({
    element: $("viewer"),
    prefixUrl: "static/openseadragon/images/",
    drawer: "canvas",
    // tiles at whole screen pixels once the view rests: at 1:1 a slide pixel is a screen pixel
    subPixelRoundingForTransparency: OpenSeadragon.SUBPIXEL_ROUNDING_OCCURRENCES.ONLY_AT_REST,
    showNavigator: true,
    navigatorPosition: "TOP_RIGHT",
    maxZoomPixelRatio: 4,
    visibilityRatio: 0.5,
    crossOriginPolicy: false,
    imageLoaderLimit: 8,
    timeout: 60000,
    gestureSettingsMouse: { clickToZoom: false, dblClickToZoom: true },
  });

  // OpenSeadragon's canvas drawer draws every tile of a slide without overlap one pixel larger
  // (against seams), which stretches a 1:1 view by 1/256 and blurs it. At rest at a power-of-two
  // zoom (1:1 among them) with the slide on whole pixels, tiles meet exactly: draw them as they
  // are there, so full resolution is the slide's own pixels.
  function atWholePixels() {
    const vp = viewer.viewport;
    const k = Math.log2(vp.viewportToImageZoom(vp.getZoom(true)));
    if (Math.abs(k - Math.round(k)) > 1e-9 || viewer.isAnimating()) return false;
    const origin = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(0, 0));
    return Math.abs(origin.x - Math.round(origin.x)) < 1e-6 && Math.abs(origin.y - Math.round(origin.y)) < 1e-6;
  }
  const seamGuard = viewer.drawer.minimumOverlapRequired.bind(viewer.drawer);
  viewer.drawer.minimumOverlapRequired = (tiledImage) => seamGuard(tiledImage) && !atWholePixels();

  function snapToPixels() {
    // after a drag at 1:1 (or 2:1...), move the slide by the fraction of a pixel it is off
    const vp = viewer.viewport;
    const k = Math.log2(vp.viewportToImageZoom(vp.getZoom(true)));
    if (Math.abs(k - Math.round(k)) > 1e-9) return;
    const origin = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(0, 0));
    const off = new OpenSeadragon.Point(origin.x - Math.round(origin.x), origin.y - Math.round(origin.y));
    if (Math.abs(off.x) > 1e-6 || Math.abs(off.y) > 1e-6) vp.panBy(vp.deltaPointsFromPixels(off), true);
    viewer.forceRedraw();
  }

  const overlay = document.createElement("canvas");
  overlay.className = "wsi-overlay";
  viewer.canvas.appendChild(overlay);
  const gridCanvas = document.createElement("canvas");
  const failCanvas = document.createElement("canvas");
  const heatCanvas = document.createElement("canvas");

  // ---- slide list ------------------------------------------------------------------------
  function renderList() {
    const words = $("search").value.toLowerCase().split(/\s+/).filter(Boolean);
    const list = $("slides");
    list.textContent = "";
    let shown = 0, matched = 0;
    for (const slide of state.slides) {
      const text = [slide.name, slide.label || "", slide.split || "", slide.status].join(" ").toLowerCase();
      if (!words.every((w) => text.includes(w))) continue;
      matched += 1;
      if (shown >= MAX_LISTED) continue; // an archive of 100,000 slides: search narrows it
      shown += 1;
      const item = document.createElement("li");
      item.dataset.id = slide.id;
      item.className = (slide.status !== "ok" ? "failed " : "") + (state.slide && state.slide.id === slide.id ? "selected" : "");
      const name = document.createElement("div");
      name.textContent = slide.name;
      const meta = document.createElement("div");
      meta.className = "meta";
      meta.textContent = slide.status === "ok"
        ? `${slide.label || "unlabelled"} · ${slide.tiles} tiles${slide.split ? " · " + slide.split : ""}`
        : `failed: ${slide.error || "unreadable"}`;
      item.append(name, meta);
      item.addEventListener("click", () => openSlide(slide.id));
      list.appendChild(item);
    }
    const more = matched > shown ? ` (${shown} listed: search to narrow)` : "";
    $("slide-count").textContent = `${matched} of ${state.slides.length} slides${more}`;
  }

  // ---- banner ----------------------------------------------------------------------------
  function setBanner(lines) {
    const banner = $("banner");
    const text = lines.filter(Boolean).join("\n");
    banner.hidden = !text;
    banner.textContent = text;
  }

  function slideBanner(faults) {
    const s = state.slide;
    if (!s) return setBanner([]);
    const lines = [];
    if (s.status !== "ok") lines.push(`This slide was not indexed: ${s.error || "unreadable"}`);
    if (s.problem) lines.push(`Slide problem: ${s.problem}`);
    if (s.warning) lines.push(`Warning: ${s.warning}`);
    if (s.predictions_error) lines.push(`Predictions: ${s.predictions_error}`);
    if (state.annotations && state.annotations.error) lines.push(`Annotations: ${state.annotations.error}`);
    if (faults && faults.faults) lines.push(`${faults.faults} reads failed on this slide (grey tiles with a red cross): ${faults.last || ""}`);
    setBanner(lines);
  }

  // ---- grid raster -----------------------------------------------------------------------
  function decodeGrid(details, buffer) {
    const columns = {};
    const count = details.grid.count;
    for (const c of details.grid.columns) {
      columns[c.name] = new globalThis[`${c.type}Array`](buffer, c.offset, count);
    }
    const stride = details.grid_stride || details.tile_footprint || 1;
    let ox = Infinity, oy = Infinity;
    for (let i = 0; i < count; i++) { ox = Math.min(ox, columns.x[i]); oy = Math.min(oy, columns.y[i]); }
    const cx = new Int32Array(count), cy = new Int32Array(count);
    let gw = 0, gh = 0;
    for (let i = 0; i < count; i++) {
      cx[i] = Math.round((columns.x[i] - ox) / stride);
      cy[i] = Math.round((columns.y[i] - oy) / stride);
      gw = Math.max(gw, cx[i] + 1); gh = Math.max(gh, cy[i] + 1);
    }
    const cells = new Int32Array(Math.max(gw * gh, 0)).fill(-1);
    for (let i = 0; i < count; i++) cells[cy[i] * gw + cx[i]] = i;
    return { columns, count, stride, footprint: details.tile_footprint, ox, oy, gw, gh, cells };
  }

  function colourModes(details) {
    const modes = [["label", "label"], ["status", "status"], ["tissue", "tissue fraction"]];
    if (details.classes.length) modes.push(["annotation", "annotation class"]);
    if (details.qc_rules.length) modes.push(["qc", "QC: flagged by rule"]);
    for (const q of details.qc) modes.push([q, `QC: ${q.slice(3)}`]);
    return modes;
  }

  function valueRange(values) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (!Number.isFinite(lo)) return [0, 1];
    if (lo >= 0 && hi <= 1) return [0, 1];
    return hi > lo ? [lo, hi] : [lo, lo + 1];
  }

  function cellColour(mode, i, g, range) {
    const c = g.columns;
    if (mode === "label") return colourOf(c.label[i]);
    if (mode === "status") return STATUS_COLOURS[c.status[i]];
    if (mode === "tissue") return ramp(c.tissue[i]);
    if (mode === "annotation") return c.annotation[i] >= 0 ? colourOf(c.annotation[i]) : UNLABELLED;
    if (mode === "qc") return c.qc[i] ? QC_COLOURS[state.slide.qc_rules[c.qc[i] - 1].name] : QC_CLEAN;
    const v = c[mode][i];
    return Number.isFinite(v) ? ramp((v - range[0]) / (range[1] - range[0])) : null;
  }

  function paintGrid() {
    const g = state.grid;
    if (!g) return;
    const mode = $("color-by").value;
    const range = g.columns[mode] && mode.startsWith("qc_") ? valueRange(g.columns[mode]) : [0, 1];
    gridCanvas.width = failCanvas.width = Math.max(g.gw, 1);
    gridCanvas.height = failCanvas.height = Math.max(g.gh, 1);
    const cells = new ImageData(gridCanvas.width, gridCanvas.height);
    const fails = new ImageData(failCanvas.width, failCanvas.height);
    for (let k = 0; k < g.cells.length; k++) {
      const i = g.cells[k];
      if (i < 0) continue;
      if (g.columns.row[i] >= 0) {
        const rgb = cellColour(mode, i, g, range);
        if (rgb) { cells.data.set(rgb, 4 * k); cells.data[4 * k + 3] = 255; }
      }
      if (g.columns.status[i] !== 0) {
        fails.data.set(STATUS_COLOURS[g.columns.status[i]], 4 * k);
        fails.data[4 * k + 3] = 255;
      }
    }
    gridCanvas.getContext("2d").putImageData(cells, 0, 0);
    failCanvas.getContext("2d").putImageData(fails, 0, 0);
    renderLegend(mode, range);
    draw();
  }

  function renderLegend(mode, range) {
    const legend = $("legend");
    legend.textContent = "";
    const g = state.grid;
    const d = state.slide;
    const item = (rgb, text) => {
      const row = document.createElement("div");
      row.className = "item";
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = css(rgb);
      const label = document.createElement("span");
      label.textContent = text;
      row.append(swatch, label);
      legend.appendChild(row);
    };
    const rampLegend = (lo, hi, title) => {
      const head = document.createElement("div");
      head.textContent = title;
      const bar = document.createElement("div");
      bar.className = "ramp";
      const ends = document.createElement("div");
      ends.className = "ends";
      ends.innerHTML = "<span></span><span></span>";
      ends.children[0].textContent = lo;
      ends.children[1].textContent = hi;
      legend.append(head, bar, ends);
    };
    if (g && $("show-grid").checked) {
      const counts = new Map();
      const key = mode === "label" ? g.columns.label : mode === "status" ? g.columns.status
        : mode === "annotation" ? g.columns.annotation : mode === "qc" ? g.columns.qc : null;
      if (key) {
        for (let i = 0; i < g.count; i++) if (mode === "status" || g.columns.row[i] >= 0) counts.set(key[i], (counts.get(key[i]) || 0) + 1);
        const sorted = [...counts.entries()].sort((a, b) => a[0] - b[0]);
        for (const [value, n] of sorted) {
          if (mode === "label") item(colourOf(value), `${value >= 0 ? d.labels[value] : "unlabelled"} (${n})`);
          else if (mode === "status") item(STATUS_COLOURS[value], `${d.statuses[value]} (${n})`);
          else if (mode === "qc") {
            const rule = value ? d.qc_rules[value - 1] : null;
            const what = rule ? `${rule.name} (${rule.column} ${rule.below ? "<" : "≥"} ${rule.threshold})` : "not flagged";
            item(rule ? QC_COLOURS[rule.name] : QC_CLEAN, `${what} (${n})`);
          }
          else item(value >= 0 ? colourOf(value) : UNLABELLED, `${value >= 0 ? d.classes[value] : "no annotation"} (${n})`);
        }
      } else {
        rampLegend(String(+range[0].toPrecision(3)), String(+range[1].toPrecision(3)), mode === "tissue" ? "tissue fraction" : mode);
      }
    }
    if (state.annotations && $("show-annotations").checked) {
      const drawn = new Set(state.annotations.rings.map((r) => r.class));
      for (const k of [...drawn].sort((a, b) => a - b)) item(colourOf(k), `outline: ${state.annotations.classes[k]}`);
    }
    if (state.heatmap && $("show-predictions").checked) {
      rampLegend("0", "1", `P(${$("prediction-class").selectedOptions[0].textContent})`);
    }
    if (d && $("show-tissue").checked) item(d.tissue_colour, "tissue (the index's detector)");
  }

  // ---- drawing ---------------------------------------------------------------------------
  function imageToCanvas() {
    // level-0 pixel (x, y) -> overlay canvas pixel: scale * x + dx
    const ratio = window.devicePixelRatio || 1;
    const vp = viewer.viewport;
    const a = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(0, 0));
    const b = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(1000, 1000));
    return { scale: ((b.x - a.x) / 1000) * ratio, dx: a.x * ratio, dy: a.y * ratio, ratio };
  }

  function draw() {
    const container = viewer.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = container.clientWidth, height = container.clientHeight;
    if (overlay.width !== Math.round(width * ratio) || overlay.height !== Math.round(height * ratio)) {
      overlay.width = Math.round(width * ratio);
      overlay.height = Math.round(height * ratio);
      overlay.style.width = `${width}px`;
      overlay.style.height = `${height}px`;
    }
    const ctx = overlay.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, overlay.width, overlay.height);
    if (!state.slide || !viewer.world.getItemCount()) return;
    const t = imageToCanvas();
    const box = (x, y, w, h) => [t.dx + x * t.scale, t.dy + y * t.scale, w * t.scale, h * t.scale];

    if (state.tissue && $("show-tissue").checked) {
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(state.tissue, ...box(0, 0, state.slide.width, state.slide.height));
    }
    const g = state.grid;
    if (g && g.count && $("show-grid").checked) {
      ctx.imageSmoothingEnabled = false;
      ctx.globalAlpha = $("grid-opacity").value / 100;
      ctx.drawImage(gridCanvas, ...box(g.ox, g.oy, g.gw * g.stride, g.gh * g.stride));
      ctx.globalAlpha = 1;
    }
    // predictions over the grid (its colours would hide them), failures over both
    if (state.heatmap && $("show-predictions").checked) drawHeatmap(ctx, box(...state.heatmap.bounds));
    if (g && g.count) {
      const cellPx = g.stride * t.scale;
      const gridBox = box(g.ox, g.oy, g.gw * g.stride, g.gh * g.stride);
      ctx.imageSmoothingEnabled = false;
      if ($("show-failures").checked) {
        ctx.drawImage(failCanvas, ...gridBox);
      }
      if (cellPx >= 10 * t.ratio) drawVisibleCells(ctx, t, g);
    }
    if (state.annotations && $("show-annotations").checked) drawRings(ctx, t);
    if (state.selected) {
      const s = state.selected;
      ctx.strokeStyle = SELECTED;
      ctx.lineWidth = 3 * t.ratio;
      ctx.strokeRect(...box(s.x, s.y, s.footprint, s.footprint));
    }
  }

  function drawHeatmap(ctx, where) {
    // one pixel per lattice cell: crisp cells on a plain grid (no colour off the tiles);
    // smoothed between cells where tiles overlap, then cut to the cells tiles cover
    const h = state.heatmap;
    ctx.globalAlpha = $("prediction-opacity").value / 100;
    if (!h.filled) {
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(h.image, ...where);
    } else {
      heatCanvas.width = overlay.width;
      heatCanvas.height = overlay.height;
      const hx = heatCanvas.getContext("2d");
      hx.imageSmoothingEnabled = true;
      hx.drawImage(h.filled, ...where);
      hx.globalCompositeOperation = "destination-in";
      hx.imageSmoothingEnabled = false;
      hx.drawImage(h.image, ...where);
      hx.globalCompositeOperation = "source-over";
      ctx.drawImage(heatCanvas, 0, 0);
    }
    ctx.globalAlpha = 1;
  }

  function filledHeatmap(image) {
    // the map with every empty cell next to a coloured one given that colour (opaque), so
    // smoothing does not fade the edge cells towards transparent
    const canvas = document.createElement("canvas");
    canvas.width = image.width;
    canvas.height = image.height;
    const cx = canvas.getContext("2d");
    cx.drawImage(image, 0, 0);
    const w = canvas.width, h = canvas.height;
    const src = cx.getImageData(0, 0, w, h);
    const out = new ImageData(new Uint8ClampedArray(src.data), w, h);
    for (let y = 0; y < h; y++) {
      for (let x = 0; x < w; x++) {
        const k = 4 * (y * w + x);
        if (src.data[k + 3]) continue;
        for (const [dx, dy] of [[1, 0], [-1, 0], [0, 1], [0, -1], [1, 1], [-1, -1], [1, -1], [-1, 1]]) {
          const nx = x + dx, ny = y + dy;
          if (nx < 0 || ny < 0 || nx >= w || ny >= h) continue;
          const n = 4 * (ny * w + nx);
          if (src.data[n + 3]) { out.data.set(src.data.subarray(n, n + 4), k); break; }
        }
      }
    }
    cx.putImageData(out, 0, 0);
    return canvas;
  }

  function drawVisibleCells(ctx, t, g) {
    // outlines of the cells in view (and crosses on failed ones): at most a few thousand
    const x0 = Math.max(0, Math.floor((-t.dx / t.scale - g.ox) / g.stride));
    const y0 = Math.max(0, Math.floor((-t.dy / t.scale - g.oy) / g.stride));
    const x1 = Math.min(g.gw - 1, Math.ceil(((overlay.width - t.dx) / t.scale - g.ox) / g.stride));
    const y1 = Math.min(g.gh - 1, Math.ceil(((overlay.height - t.dy) / t.scale - g.oy) / g.stride));
    const grid = $("show-grid").checked, failures = $("show-failures").checked;
    const size = g.footprint * t.scale;
    ctx.lineWidth = Math.max(1, t.ratio);
    for (let cy = y0; cy <= y1; cy++) {
      for (let cx = x0; cx <= x1; cx++) {
        const i = g.cells[cy * g.gw + cx];
        if (i < 0) continue;
        const left = t.dx + g.columns.x[i] * t.scale, top = t.dy + g.columns.y[i] * t.scale;
        if (grid && g.columns.row[i] >= 0) {
          ctx.strokeStyle = "rgba(20,20,20,0.55)";
          ctx.strokeRect(left, top, size, size);
        }
        if (failures && g.columns.status[i] !== 0) {
          ctx.strokeStyle = css(STATUS_COLOURS[g.columns.status[i]]);
          ctx.beginPath();
          ctx.moveTo(left, top); ctx.lineTo(left + size, top + size);
          ctx.moveTo(left + size, top); ctx.lineTo(left, top + size);
          ctx.stroke();
        }
      }
    }
  }

  function drawRings(ctx, t) {
    ctx.lineWidth = 2 * t.ratio;
    for (const ring of state.annotations.rings) {
      const p = ring.points;
      if (p.length < 4) continue;
      ctx.strokeStyle = css(colourOf(ring.class));
      ctx.beginPath();
      ctx.moveTo(t.dx + p[0] * t.scale, t.dy + p[1] * t.scale);
      for (let k = 2; k < p.length; k += 2) ctx.lineTo(t.dx + p[k] * t.scale, t.dy + p[k + 1] * t.scale);
      ctx.closePath();
      ctx.stroke();
    }
  }

  // ---- scale bar and pointer -------------------------------------------------------------
  function niceLength(maxUm) {
    const exponent = Math.floor(Math.log10(maxUm));
    for (const step of [5, 2, 1]) if (step * 10 ** exponent <= maxUm) return step * 10 ** exponent;
    return 10 ** exponent;
  }

  function updateScaleBar() {
    const s = state.slide;
    const bar = $("scalebar");
    if (!s || !s.mpp || !viewer.world.getItemCount()) { bar.hidden = true; return; }
    const screenPerImage = viewer.viewport.viewportToImageZoom(viewer.viewport.getZoom(true));
    const umPerScreenPx = s.mpp / screenPerImage;
    const um = niceLength(150 * umPerScreenPx);
    bar.hidden = false;
    $("scalebar-bar").style.width = `${um / umPerScreenPx}px`;
    $("scalebar-text").textContent = um >= 1000 ? `${um / 1000} mm` : `${um} µm`;
  }

  function pointerAt(event) {
    const rect = viewer.element.getBoundingClientRect();
    const p = viewer.viewport.viewerElementToImageCoordinates(
      new OpenSeadragon.Point(event.clientX - rect.left, event.clientY - rect.top));
    return p;
  }

  viewer.element.addEventListener("mousemove", (event) => {
    if (!state.slide || !viewer.world.getItemCount()) return;
    const p = pointerAt(event);
    const s = state.slide;
    const um = s.mpp ? ` · ${(p.x * s.mpp).toFixed(1)}, ${(p.y * s.mpp).toFixed(1)} µm` : "";
    $("pointer").textContent = `x ${Math.round(p.x)}, y ${Math.round(p.y)} px${um}`;
  });

  // ---- clicking a tile -------------------------------------------------------------------
  viewer.addHandler("canvas-click", async (event) => {
    if (!event.quick || !state.slide) return;
    const p = viewer.viewport.viewerElementToImageCoordinates(event.position);
    const id = state.slide.id;
    const found = await getJSON(`api/slides/${id}/at`, { x: p.x.toFixed(1), y: p.y.toFixed(1) });
    if (!state.slide || state.slide.id !== id) return;
    showDetails(found);
  });

  function showDetails(found) {
    const table = $("details-table");
    table.textContent = "";
    $("details").hidden = false;
    const tile = found.tile;
    state.selected = tile;
    const rows = [];
    if (tile) {
      rows.push(["row", tile.row === null ? "— (not in the index: quarantined when indexed)" : tile.row]);
      rows.push(["level-0 x, y", `${tile.x}, ${tile.y}`]);
      if (tile.level !== undefined) rows.push(["read", `${tile.read_size} px at level ${tile.level}`]);
      rows.push(["label", tile.label === null ? "unlabelled" : tile.label]);
      rows.push(["tissue", tile.tissue === null ? "—" : tile.tissue]);
      rows.push(["status", tile.status]);
      if (tile.failure) rows.push(["failure", tile.failure]);
      if (tile.coverage) for (const [k, v] of Object.entries(tile.coverage)) rows.push([`coverage ${k}`, v]);
      for (const [k, v] of Object.entries(tile)) if (k.startsWith("qc_")) rows.push([k, v === null ? "—" : v]);
    } else {
      rows.push(["tile", "no tile of the index here"]);
    }
    if (found.predictions) for (const [k, v] of Object.entries(found.predictions)) rows.push([`P(${k})`, v]);
    for (const [key, value] of rows) {
      const tr = document.createElement("tr");
      const a = document.createElement("td"), b = document.createElement("td");
      a.textContent = key; b.textContent = String(value);
      tr.append(a, b);
      table.appendChild(tr);
    }
    const image = $("details-image");
    if (tile && tile.row !== null) {
      image.hidden = false;
      image.src = api(`api/slides/${state.slide.id}/rows/${tile.row}.png`);
    } else {
      image.hidden = true;
      image.removeAttribute("src");
    }
    draw();
  }

  // ---- overlays loaded on demand ---------------------------------------------------------
  async function loadTissue() {
    const s = state.slide;
    if (!s || state.tissue || !$("show-tissue").checked) return;
    try {
      const image = await loadImage(api(`api/slides/${s.id}/tissue.png`));
      if (state.slide === s) state.tissue = image;
    } catch (error) {
      setBanner([`Tissue mask: ${error.message}`]);
    }
    draw();
  }

  async function loadHeatmap() {
    const s = state.slide;
    if (!s || !s.predictions || !$("show-predictions").checked) { paintGrid(); return; }
    const k = $("prediction-class").value;
    const key = `${s.id}/${k}`;
    if (state.heatmapKey === key) { paintGrid(); return; }
    const url = api(`api/slides/${s.id}/predictions/${k}.png`);
    const response = await fetch(url);
    if (!response.ok) { setBanner([`Predictions: ${await response.text()}`]); return; }
    const bounds = response.headers.get("X-Bounds").split(",").map(Number);
    const overlap = response.headers.get("X-Overlap") === "1";
    const blob = await response.blob();
    const image = await loadImage(URL.createObjectURL(blob));
    if (state.slide !== s) return;
    state.heatmap = { image, bounds, filled: overlap ? filledHeatmap(image) : null };
    state.heatmapKey = key;
    paintGrid();
  }

  // ---- opening a slide -------------------------------------------------------------------
  async function openSlide(id) {
    const opened = ++state.opened;
    state.loading += 1;
    try {
      const details = await getJSON(`api/slides/${id}`);
      if (opened !== state.opened) return;
      Object.assign(state, { slide: details, grid: null, annotations: null, tissue: null, heatmap: null, heatmapKey: null, selected: null });
      $("details").hidden = true;
      $("slide-title").textContent = details.name;
      const info = $("slide-info");
      info.textContent = "";
      const facts = [
        `${details.width} × ${details.height} px${details.mpp ? `, ${details.mpp.toFixed(4)} µm/px` : ", no MPP"}`,
        `label: ${details.label || "unlabelled"}${details.split ? ` · split ${details.split}` : ""}`,
        `${details.grid.count} tiles of ${Math.round(details.tile_footprint)} level-0 px`,
      ];
      for (const fact of facts) { const div = document.createElement("div"); div.textContent = fact; info.appendChild(div); }
      const modes = colourModes(details);
      const select = $("color-by");
      const previous = select.value;
      select.textContent = "";
      for (const [value, text] of modes) select.add(new Option(text, value));
      if (modes.some(([value]) => value === previous)) select.value = previous;
      const classes = $("prediction-class");
      classes.textContent = "";
      for (const [k, name] of ((details.predictions && details.predictions.classes) || []).entries()) classes.add(new Option(name, String(k)));
      $("show-predictions").disabled = !details.predictions;
      renderList();
      slideBanner(null);
      const url = new URL(window.location.href);
      url.searchParams.set("slide", String(id));
      window.history.replaceState(null, "", url);
      viewer.open(api(`slides/${id}.dzi`, { v: details.version }));
      const [buffer, annotations] = await Promise.all([
        fetch(api(`api/slides/${id}/grid.bin`)).then((r) => r.arrayBuffer()),
        getJSON(`api/slides/${id}/annotations.json`),
      ]);
      if (opened !== state.opened) return;
      state.grid = decodeGrid(details, buffer);
      state.annotations = annotations;
      slideBanner(null);
      paintGrid();
      loadTissue();
      loadHeatmap();
    } catch (error) {
      setBanner([`Cannot open slide ${id}: ${error.message}`]);
    } finally {
      state.loading -= 1;
    }
  }

  async function pollFaults() {
    const s = state.slide;
    if (s) {
      try {
        const faults = await getJSON(`api/slides/${s.id}/status`);
        if (state.slide === s) slideBanner(faults);
      } catch (error) { /* the server went away: the next poll says nothing new */ }
    }
    window.setTimeout(pollFaults, 3000);
  }

  // ---- wiring ----------------------------------------------------------------------------
  viewer.addHandler("update-viewport", draw);
  viewer.addHandler("animation", updateScaleBar);
  viewer.addHandler("animation-finish", snapToPixels);
  viewer.addHandler("open", () => { updateScaleBar(); draw(); });
  viewer.addHandler("resize", () => { updateScaleBar(); draw(); });
  $("search").addEventListener("input", renderList);
  $("color-by").addEventListener("change", paintGrid);
  for (const id of ["show-grid", "show-failures", "show-annotations", "grid-opacity", "prediction-opacity"]) {
    $(id).addEventListener("input", paintGrid);
  }
  $("show-tissue").addEventListener("change", () => { loadTissue(); paintGrid(); });
  $("show-predictions").addEventListener("change", loadHeatmap);
  $("prediction-class").addEventListener("change", loadHeatmap);

  async function start() {
    const listing = await getJSON("api/slides");
    state.slides = listing.slides;
    state.labels = listing.labels;
    renderList();
    const wanted = params.get("slide");
    const first = wanted !== null ? Number(wanted) : (state.slides.find((s) => s.status === "ok") || state.slides[0] || {}).id;
    if (first !== undefined && state.slides.some((s) => s.id === first)) await openSlide(first);
    pollFaults();
  }

  // for tests and the curious: the viewer and its state
  window.wsiViewer = {
    viewer, state, openSlide, draw, gridCanvas,
    fullyLoaded: () => viewer.world.getItemCount() > 0 && viewer.world.getItemAt(0).getFullyLoaded(),
    ready: start().catch((error) => setBanner([`Cannot load the slide list: ${error.message}`])),
  };
})();
