"""``AttentionView``: the tokens of a prompt coloured by one head's attention from one query.

Attention is read through headlab's instrumentation probes, never by patching the model:

- ``mode="pattern"`` (inputs up to ``pattern_limit`` tokens): one forward with
  ``Probes(pattern=True)`` records every layer's full pattern once; changing layer, head or query is
  then instant.
- ``mode="query"`` (longer inputs): the prompt up to the query is prefilled with plain SDPA into a KV
  cache (keeping only the last position's logits), then the query token alone runs inside
  :func:`headlab.instrument.instrument` with ``Probes(pattern=True)``: one attention row per (layer, head),
  memory linear in the input length (the cache, one row, SDPA's own memory), at any length. Rows are
  cached per query; each new query costs one prefill of the prompt up to it.

Attention mass on named spans (``spans={"needle": [(start, end)]}`` in characters, like
:class:`headlab.Example` spans) is recorded with ``Probes(spans=...)`` for every layer and head
(:meth:`AttentionView.span_mass`). Long inputs are shown a page of ``page_size`` tokens at a time.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import anywidget
import ipywidgets as w
import numpy as np
import torch
import traitlets
import xarray as xr

from ..context import Example
from ..dims import head_array
from ..forward_pass import forward
from ..generation import tokenize
from ..image_attention import forward_kwargs, image_attention_svg, model_view, patch_grid
from ..instrument import Plan, Probes, instrument
from ..model import LoadedModel, load_model
from ..spec import ModelSpec
from ..svg import NAN_COLOR, color
from .image import ImagePatchView
from .js import PRELUDE

__all__ = ["AttentionView", "TokenView"]

_ESM = PRELUDE + """
export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "headlab-attention";
    el.appendChild(root);
    function draw() {
      const tokens = model.get("tokens"), weights = model.get("weights"), offset = model.get("offset");
      const query = model.get("query"), spans = model.get("spans") || [];
      const positions = model.get("positions") || [], images = model.get("image_spans") || [];
      const hi = topOf(weights, model.get("vmax"));
      root.innerHTML = "";
      root.appendChild(element("div", "hl-caption", model.get("caption")));
      const box = document.createElement("div");
      box.className = "hl-tokens";
      tokens.forEach((t, i) => {
        const pos = positions.length ? positions[i] : offset + i, v = weights[i];
        const image = images.find(([a, b]) => pos >= a && pos < b);
        const s = document.createElement("span");
        s.className = "hl-tok" + (pos === query ? " hl-query" : "") + (v === null ? " hl-future" : "")
          + (image ? " hl-image-chip" : "");
        const inSpan = spans.find(([a, b]) => pos >= a && pos < b);
        if (inSpan) { s.classList.add("hl-span"); s.dataset.span = inSpan[2]; }
        const c = colour(v, hi);
        if (c) {
          s.style.background = `rgb(${c})`;
          s.style.color = (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]) > 140 ? "#000" : "#fff";
        }
        s.textContent = t;
        s.dataset.pos = pos;
        s.dataset.weight = v === null ? "" : Number(v).toPrecision(4);
        if (image) {
          s.title = `tokens #${image[0]}..${image[1] - 1}: ${t}` + (v === null ? " (after the query)"
            : `, attention mass ${Number(v).toPrecision(4)}`);
        } else {
          s.title = `#${pos} ${JSON.stringify(t)}` + (v === null ? " (after the query)" : `: ${Number(v).toPrecision(4)}`)
            + (inSpan ? ` [${inSpan[2]}]` : "");
          s.addEventListener("click", () => { model.set("query", pos); model.save_changes(); });
        }
        box.appendChild(s);
      });
      root.appendChild(box);
    }
    for (const name of ["tokens", "weights", "offset", "query", "spans", "caption", "vmax", "positions", "image_spans"])
      model.on("change:" + name, draw);
    draw();
  }
};
"""

_CSS = """
.headlab-attention { font-family: sans-serif; font-size: 12px; }
.headlab-attention .hl-caption { color: #444; margin-bottom: 4px; }
.headlab-attention .hl-tokens { line-height: 1.9; max-width: 900px; }
.headlab-attention .hl-tok { display: inline-block; padding: 0 3px; margin: 1px; border-radius: 2px;
  white-space: pre; cursor: pointer; font-family: monospace; border: 1px solid transparent; }
.headlab-attention .hl-future { color: #aaa; }
.headlab-attention .hl-span { border-bottom: 2px solid #e4002b; }
.headlab-attention .hl-query { border: 2px solid #e4002b; font-weight: bold; }
.headlab-attention .hl-image-chip { cursor: default; border: 1px dashed #555; font-style: italic; }
"""


class TokenView(anywidget.AnyWidget):
    """Tokens coloured by one weight each; clicking a token sets ``query`` to its position.

    ``positions`` (optional) gives each shown item's token position (default ``offset + i``); an item whose
    position falls in one of ``image_spans`` is an image chip (one item for a whole image; its weight is the
    image's attention mass; clicking it does nothing)."""

    _esm = _ESM
    _css = _CSS
    tokens = traitlets.List().tag(sync=True)
    weights = traitlets.List().tag(sync=True)
    offset = traitlets.Int(0).tag(sync=True)
    query = traitlets.Int(0).tag(sync=True)
    spans = traitlets.List(help="[start, end, name] token spans (absolute positions)").tag(sync=True)
    caption = traitlets.Unicode("").tag(sync=True)
    vmax = traitlets.Float(0.0, help="top of the colour scale; 0 = the page's maximum").tag(sync=True)
    positions = traitlets.List(help="token position of each item (empty: offset + i)").tag(sync=True)
    image_spans = traitlets.List(help="[start, end] token spans of images (each shown as one chip)").tag(sync=True)


def _token_text(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    out = []
    for i in ids:
        t = tokenizer.decode([int(i)])
        out.append(t if t != "" else tokenizer.convert_ids_to_tokens(int(i)))
    return out


def _load(model: LoadedModel | str) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model

    return load_model(ModelSpec(id=model, device="cpu"))


class AttentionView(w.VBox):
    """Tokens of a prompt coloured by a chosen head's attention from a chosen query.

    ``AttentionView(lm, prompt, layer=2, head=5)`` with ``lm`` a :class:`headlab.model.LoadedModel`
    (or a registered model name such as ``"headlab-tiny"``); or ``input_ids=[...]`` for token-id
    inputs. ``spans`` are named character spans of the prompt. The query defaults to the last token.
    Controls: layer, head, query (or click a token), page; "colour by" switches between per-token
    attention and the attention mass on each span.

    With a vision-language model, ``images`` (PIL images or local paths, one per ``<image>`` marker of
    the prompt; or an ``example`` with images) are passed to the model; each image is shown as an
    :class:`ImagePatchView` next to the tokens, its patches coloured by the head's attention from the
    query to the image's tokens, and the image's tokens are one ``[image r x c]`` chip in the token strip
    (coloured by the image's attention mass). :meth:`image_attention` gives the same values.
    """

    def __init__(self, model: LoadedModel | str, prompt: str | None = None, *,
                 input_ids: Sequence[int] | None = None, layer: int = 0, head: int = 0,
                 query: int | None = None, spans: Mapping[str, Sequence[tuple[int, int]]] | None = None,
                 page_size: int = 64, pattern_limit: int = 256,
                 mode: Literal["auto", "pattern", "query"] = "auto", images: Sequence[Any] | None = None,
                 example: Example | None = None, image_width: int = 280) -> None:

        self.lm = _load(model)
        if example is None:
            if prompt is None and input_ids is None:
                raise ValueError("give a prompt or input_ids (or an example)")
            example = Example(prompt=prompt or "", input_ids=list(input_ids) if input_ids is not None else None,
                              spans={k: [tuple(s) for s in v] for k, v in (spans or {}).items()},
                              images=list(images or []))
        self.example = example
        self.batch = tokenize(self.lm, [example], device=self.lm.device)
        self.input_ids = self.batch.input_ids
        self.n_tokens = int(self.input_ids.shape[1])
        self.tokens = _token_text(self.lm.tokenizer, self.input_ids[0].tolist())
        self.token_spans: dict[str, list[tuple[int, int]]] = {
            name: [tuple(s) for s in self.batch.spans(name)[0]] for name in example.spans}
        self.images: list[Any] = list(example.images)
        self.model_inputs: dict[str, Any] = forward_kwargs(self.batch)
        self.image_spans: list[tuple[int, int]] = [(int(a), int(b)) for a, b in (self.batch.image_spans or [[]])[0]]
        self.image_grids: list[tuple[int, int]] = [(int(r), int(c)) for r, c in (self.batch.image_grids or [[]])[0]]
        if len(self.image_spans) != len(self.images):
            raise ValueError(f"{len(self.images)} images but {len(self.image_spans)} image-token spans in the prompt")
        self.mode = ("pattern" if self.n_tokens <= pattern_limit else "query") if mode == "auto" else mode
        self.page_size = int(page_size)
        self._pattern: np.ndarray | None = None
        self._rows: dict[int, np.ndarray] = {}
        self._mass: dict[int, np.ndarray] = {}
        geo = self.lm.geometry
        q = self.n_tokens - 1 if query is None else int(query)
        if not 0 <= q < self.n_tokens:
            raise ValueError(f"query {q} outside 0..{self.n_tokens - 1}")

        self.layer_slider = w.IntSlider(value=layer, min=0, max=geo.n_layers - 1, description="layer")
        self.head_slider = w.IntSlider(value=head, min=0, max=geo.n_heads - 1, description="head")
        self.query_slider = w.IntSlider(value=q, min=0, max=self.n_tokens - 1, description="query")
        self.page_slider = w.IntSlider(value=q // self.page_size, min=0, max=self.n_pages - 1, description="page")
        self.colour_by = w.ToggleButtons(options=["tokens", "spans"] if self.token_spans else ["tokens"],
                                         value="tokens", description="colour by")
        self.view = TokenView(spans=[[a, b, name] for name, ss in self.token_spans.items() for a, b in ss],
                              image_spans=[[a, b] for a, b in self.image_spans])
        self.shown_images = [img if (seen := model_view(self.lm, self.batch, i)) is None else seen
                             for i, img in enumerate(self.images)]
        self.image_views = [ImagePatchView.from_values(img, grid, [None] * (grid[0] * grid[1]), token_start=a,
                                                       width=image_width)
                            for img, (a, _), grid in zip(self.shown_images, self.image_spans, self.image_grids,
                                                         strict=True)]
        self.info = w.HTML()
        for view in self.image_views:
            view.observe(lambda _: setattr(self.info, "value", self._info_html()), names="selected")
        for ctl in (self.layer_slider, self.head_slider, self.page_slider, self.colour_by):
            ctl.observe(lambda _: self.refresh(), names="value")
        self.query_slider.observe(self._query_changed, names="value")
        self.view.observe(lambda ch: setattr(self.query_slider, "value", ch["new"]), names="query")
        controls = w.HBox([self.layer_slider, self.head_slider, self.query_slider])
        pager = w.HBox([self.page_slider, self.colour_by]) if self.n_pages > 1 or self.token_spans else w.HBox([])
        body: w.Widget = self.view
        if self.image_views:
            body = w.HBox([w.VBox(self.image_views), self.view])
            self.view.layout.flex = "1"
        super().__init__([controls, pager, body, self.info])
        self.add_class("headlab-attention-view")
        self.refresh()

    # ---- state
    @property
    def layer(self) -> int:
        return int(self.layer_slider.value)

    @property
    def head(self) -> int:
        return int(self.head_slider.value)

    @property
    def query(self) -> int:
        return int(self.query_slider.value)

    @property
    def page(self) -> int:
        return int(self.page_slider.value)

    @property
    def n_pages(self) -> int:
        return max(1, -(-self.n_tokens // self.page_size))

    def set(self, *, layer: int | None = None, head: int | None = None, query: int | None = None,
            page: int | None = None) -> AttentionView:
        """Change the shown layer, head, query or page (as the controls do)."""
        with self.hold_trait_notifications():
            if layer is not None:
                self.layer_slider.value = layer
            if head is not None:
                self.head_slider.value = head
            if query is not None:
                self.query_slider.value = query
            if page is not None:
                self.page_slider.value = page
        self.refresh()
        return self

    def _query_changed(self, change: dict[str, Any]) -> None:
        page = int(change["new"]) // self.page_size
        if page != self.page:
            self.page_slider.value = page  # refreshes
        else:
            self.refresh()

    # ---- computation through the probes
    def _compute_pattern(self) -> np.ndarray:
        if self._pattern is None:
            _, rec = forward(self.lm, self.batch, Plan(probes=Probes(pattern=True)), logits_to_keep=1)
            self._pattern = rec.pattern[0].float().cpu().numpy()  # (layer, head, query, key)
        return self._pattern

    def _query_row(self, q: int) -> np.ndarray:
        """With model inputs beyond the ids (images): one forward of the whole input recording the pairs
        ``(q, 0..q)`` (memory linear in the length): ``(layer, head, q + 1)``."""
        pairs = [(q, k) for k in range(q + 1)]
        _, rec = forward(self.lm, self.batch, Plan(probes=Probes(pairs=pairs)), logits_to_keep=1)
        return rec.pair_mass[0, :, :, : q + 1].float().cpu().numpy()

    def _single_query(self, q: int, probes: Any) -> Any:
        """Prefill tokens ``[0, q)`` with plain attention, then run token ``q`` under ``probes``."""

        model = self.lm.model
        ids = self.input_ids
        cache = None
        with torch.no_grad():
            if q > 0:
                kw = dict(input_ids=ids[:, :q], attention_mask=torch.ones_like(ids[:, :q]),
                          position_ids=torch.arange(q, device=ids.device)[None], use_cache=True)
                try:  # only the cache is needed: no (q, vocab) logits
                    pre = model(**kw, logits_to_keep=1)
                except TypeError:  # a model without logits_to_keep
                    pre = model(**kw)
                cache = pre.cache
            kwargs: dict[str, Any] = {"cache": cache} if cache is not None else {}
            with instrument(model, Plan(probes=probes)) as rec:
                model(input_ids=ids[:, q: q + 1], attention_mask=torch.ones_like(ids[:, : q + 1]),
                      position_ids=torch.tensor([[q]], device=ids.device), use_cache=cache is not None, **kwargs)
        return rec

    def rows(self, query: int | None = None) -> np.ndarray:
        """Attention of every (layer, head) from ``query`` over keys ``0..query``: ``(layer, head, query+1)``."""

        q = self.query if query is None else int(query)
        if self.mode == "pattern":
            return self._compute_pattern()[:, :, q, : q + 1]
        if q not in self._rows:
            if self.model_inputs:
                self._rows[q] = self._query_row(q)
            else:
                rec = self._single_query(q, Probes(pattern=True))
                self._rows[q] = rec.pattern[0, :, :, -1, : q + 1].float().cpu().numpy()
        return self._rows[q]

    def row(self, layer: int | None = None, head: int | None = None, query: int | None = None) -> np.ndarray:
        """Attention of one head from ``query`` over keys ``0..query``."""
        layer = self.layer if layer is None else int(layer)
        head = self.head if head is None else int(head)
        return self.rows(query)[layer, head]

    def span_mass(self, query: int | None = None) -> xr.DataArray:
        """Attention mass from ``query`` on each named span, for every head: ``(span, layer, head)``.

        Recorded with ``Probes(spans=...)`` on the query token (spans after the query get 0).
        """

        if not self.token_spans:
            raise ValueError("this view has no spans; pass spans={'name': [(start, end)]} in characters")
        q = self.query if query is None else int(query)
        names = [n for n, ss in self.token_spans.items() for _ in ss]
        flat = [s for ss in self.token_spans.values() for s in ss]
        if q not in self._mass and self.model_inputs:
            r = self.rows(q)  # (layer, head, q + 1): the mass on a span is the sum of its visible keys
            self._mass[q] = np.stack([r[:, :, a: min(b, q + 1)].sum(-1) for a, b in flat], axis=-1)
        elif q not in self._mass:
            rec = self._single_query(q, Probes(spans=flat))
            self._mass[q] = rec.span_mass[0, :, :, -1, :].float().cpu().numpy()  # (layer, head, span)
        arr = self._mass[q]
        per_name = {n: arr[:, :, [i for i, m in enumerate(names) if m == n]].sum(-1) for n in self.token_spans}
        return head_array(np.stack(list(per_name.values())), "span", name="span_mass").assign_coords(
            span=list(per_name))

    def image_attention(self, image: int = 0, layer: int | None = None, head: int | None = None,
                        query: int | None = None) -> np.ndarray:
        """The attention of one head from ``query`` to the tokens of image ``image`` as its ``(rows, cols)``
        patch grid (NaN for image tokens after the query): the values its :class:`ImagePatchView` shows."""

        if not 0 <= image < len(self.image_spans):
            raise ValueError(f"no image {image}; this view has {len(self.image_spans)}")
        a, b = self.image_spans[image]
        r = self.row(layer, head, query)
        vals = np.full(b - a, np.nan)
        seen = r[a: min(b, len(r))]
        vals[: len(seen)] = seen
        return patch_grid(vals, self.image_grids[image])

    def _image_of(self, pos: int) -> int | None:
        return next((i for i, (a, b) in enumerate(self.image_spans) if a <= pos < b), None)

    def token_label(self, pos: int) -> str:
        """The token at ``pos``; an image token as ``[image i (row, col)]``."""
        i = self._image_of(pos)
        if i is None:
            return self.tokens[pos]
        k = pos - self.image_spans[i][0]
        cols = self.image_grids[i][1]
        return f"[image {i} ({k // cols}, {k % cols})]"

    def top_keys(self, k: int = 5) -> list[tuple[int, str, float]]:
        """The ``k`` most attended keys of the current head and query: ``(position, token, weight)``."""
        r = self.row()
        order = np.argsort(-r, kind="stable")[:k]
        return [(int(i), self.token_label(int(i)), float(r[i])) for i in order]

    # ---- display
    def page_range(self, page: int | None = None) -> tuple[int, int]:
        """Token positions ``[start, end)`` of a page."""
        p = self.page if page is None else int(page)
        return p * self.page_size, min(self.n_tokens, (p + 1) * self.page_size)

    def refresh(self) -> None:
        """Recompute the shown row (or span masses) and update the view."""
        start, end = self.page_range()
        q = self.query
        weights: list[float | None] = [None] * (end - start)
        if self.colour_by.value == "spans" and self.token_spans:
            mass = self.span_mass(q).sel(layer=self.layer, head=self.head)
            for name, ss in self.token_spans.items():
                for a, b in ss:
                    for pos in range(max(a, start), min(b, end)):
                        weights[pos - start] = float(mass.sel(span=name))
            caption = f"attention mass on spans, layer {self.layer} head {self.head}, query #{q}"
            vmax = 1.0
        else:
            r = self.row()
            for pos in range(start, min(end, q + 1)):
                weights[pos - start] = float(r[pos])
            caption = (f"layer {self.layer} head {self.head}, query #{q} {self.token_label(q)!r}; "
                       f"tokens {start}..{end - 1} of {self.n_tokens} ({self.mode} mode)")
            text = [float(r[p]) for p in range(q + 1) if self._image_of(p) is None]
            vmax = max(text) if text else (float(r.max()) if r.size else 1.0)
        tokens, positions, shown = self._collapse(start, end, weights)
        with self.view.hold_sync():
            self.view.tokens = tokens
            self.view.weights = shown
            self.view.positions = positions
            self.view.offset = start
            self.view.query = q
            self.view.caption = caption
            self.view.vmax = vmax
        self.weights = weights
        self.shown = list(zip(positions, tokens, shown, strict=True))
        self._refresh_images()
        self.info.value = self._info_html()

    def _collapse(self, start: int, end: int, weights: list[float | None]
                  ) -> tuple[list[str], list[int], list[float | None]]:
        """The page's items: text tokens as they are, each image's tokens as one ``[image r x c]`` chip
        whose weight is the sum of its tokens' (None when none is visible)."""
        if not self.image_spans:
            return self.tokens[start:end], list(range(start, end)), list(weights)
        tokens, positions, shown = [], [], []
        pos = start
        while pos < end:
            i = self._image_of(pos)
            if i is None:
                tokens.append(self.tokens[pos])
                positions.append(pos)
                shown.append(weights[pos - start])
                pos += 1
                continue
            a, b = self.image_spans[i]
            rows, cols = self.image_grids[i]
            seen = [x for x in weights[pos - start: min(b, end) - start] if x is not None]
            tokens.append(f"[image {rows} x {cols}]")
            positions.append(pos)
            shown.append(float(sum(seen)) if seen else None)
            pos = min(b, end)
        return tokens, positions, shown

    def _refresh_images(self) -> None:
        q = self.query
        for i, view in enumerate(self.image_views):
            vals = self.image_attention(i)
            a, b = self.image_spans[i]
            mass = float(np.nansum(vals))
            view.set_values(self.image_grids[i], vals)
            view.caption = (f"image {i} (tokens #{a}..{b - 1}): layer {self.layer} head {self.head}, "
                            f"query #{q}; attention mass {mass:.4f}")

    def _info_html(self) -> str:
        rows = "".join(
            f"<tr><td>#{p}</td><td><code>{html.escape(repr(t))}</code></td>"
            f'<td style="background:{color(v, 0, max(1e-9, self.top_keys(1)[0][2]))}">&nbsp;&nbsp;</td>'
            f"<td>{v:.4f}</td></tr>" for p, t, v in self.top_keys(5))
        for i, (a, b) in enumerate(self.image_spans):
            if a <= self.query:
                rows += (f'<tr><td>#{a}..{b - 1}</td><td>[image {i}] mass</td><td></td>'
                         f"<td>{float(np.nansum(self.image_attention(i))):.4f}</td></tr>")
        out = f'<table class="hl-topkeys"><tr><th colspan="4">most attended keys</th></tr>{rows}</table>'
        for i, view in enumerate(self.image_views):
            if view.selected >= 0:
                p = view.patch()
                v = self.image_attention(i)[p["row"], p["col"]]
                out += (f'<div class="hl-selected-patch" data-image="{i}" data-token="{p["token"]}">image {i} patch '
                        f'(row {p["row"]}, col {p["col"]}), token #{p["token"]}: '
                        f'{"after the query" if np.isnan(v) else f"{v:.6f}"}</div>')
        if self.token_spans:
            mass = self.span_mass().sel(layer=self.layer, head=self.head)
            out += "<div>mass on spans: " + ", ".join(
                f"{html.escape(str(n))} {float(mass.sel(span=n)):.4f}" for n in mass["span"].values) + "</div>"
        return out

    def _repr_html_(self) -> str:  # static fallback (nbconvert, GitHub)
        hi = max((x for _, _, x in self.shown if x is not None), default=1.0) or 1.0
        toks = "".join(
            f'<span style="background:{NAN_COLOR if x is None else color(min(x, hi), 0, hi)};padding:0 2px;'
            f'margin:1px;white-space:pre" title="{x}">{html.escape(t)}</span>'
            for _, t, x in self.shown)
        figs = "".join(image_attention_svg(img, self.image_attention(i), title=f"image {i}")
                       for i, img in enumerate(self.shown_images))
        return f"<div>{html.escape(self.view.caption)}<br>{figs}{toks}</div>"

