"""JavaScript shared by the anywidgets' front ends (``AttentionView``'s tokens, ``ImagePatchView``)."""

from __future__ import annotations

from ..svg import PALETTE

__all__ = ["PRELUDE"]

#: the viridis palette, a colour for a value in ``[0, hi]``, the top of a value range and an element maker
__all__ = ["PRELUDE"]

PRELUDE = """
const PALETTE = %PALETTE%;
function colour(v, hi) {
  if (v === null || v === undefined || !isFinite(v)) return null;
  const t = hi > 0 ? Math.min(1, Math.max(0, v / hi)) : 0;
  const x = t * (PALETTE.length - 1), i = Math.min(Math.floor(x), PALETTE.length - 2), f = x - i;
  const a = PALETTE[i], b = PALETTE[i + 1];
  return [0, 1, 2].map(k => Math.round(a[k] + (b[k] - a[k]) * f));
}
function topOf(values, vmax) {
  const finite = values.filter(v => v !== null && isFinite(v));
  return vmax > 0 ? vmax : (finite.length ? Math.max(...finite) : 1);
}
function element(tag, cls, text) {
  const e = document.createElement(tag);
  e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
""".replace("%PALETTE%", str([list(c) for c in PALETTE]))
