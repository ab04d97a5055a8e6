"""SmoothQuant: migrate per-channel activation outliers into the weights (Xiao et al., 2023).

For a Linear ``y = x W^T`` and factors ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)``,
``y = (x / s) (W * s)^T`` exactly; ``x / s`` has flatter channels (an easier per-tensor int8
range) and ``W * s`` still quantizes well per output channel.

Where ``x / s`` is applied:
- input produced by another Linear with nothing in between (no activation/residual) and read
  only by this layer: folded into that Linear's weight rows and bias (free at run time);
- input produced by an RMSNorm (Llama, Qwen2, Mistral: ``match_rms_norm``, the matcher the norm
  fusion uses) and read only by smoothed layers: folded into the norm's weight (``w / s``;
  RMSNorm has no bias), with one ``s`` for all its readers (Q, K, V; gate, up) from their
  weights' joint column max, as the paper does; convert writes the folded weight
  (``LayerPlan.write_norm_weights``) and the norm fusion then still applies;
- input a gated product ``act(gate(x)) * up(x)`` (Llama's ``down_proj``) or an attention output
  (``o_proj``) read only by this layer: folded into ``up``'s (``v``'s) weight rows and bias
  (``qfuse.algorithms.row_folds``: in a merged gate/up layer the odd rows; with grouped-query
  attention the query heads of one ``v`` row share a factor). llm-compressor maps
  ``up_proj -> down_proj`` and, in AWQ, ``v_proj -> o_proj`` the same way; the default
  selection takes ``down_proj`` (not ``o_proj``, as llm-compressor's SmoothQuant);
- anything else (a LayerNorm, whose output in post-LN BERT also feeds the residual add, so the
  LayerNorm itself must not change): the fused kernel's prologue quantizes with a
  per-input-channel vector ``(1/s_j) * (1/scale)`` instead of one scalar — the same multiply,
  no extra pass.

``search=True`` picks, per input (a group of layers reading one value: Q/K/V, gate/up), the
migration strength from ``ALPHAS`` (or none) and, for static activations, the clip of the
per-tensor range from ``CLIPS``, by the layers' output error on a sample of calibration rows
(``search``), as the SmoothQuant and AWQ authors tune per model and per layer. A real LLM needs
it: SmolLM2's ``down_proj`` inputs carry attention-sink tokens hundreds of times larger than
the rest, which one min/max range per tensor cannot serve at any global alpha.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from qfuse.algorithms.row_folds import read_only_through, source, tie, up_rows
from qfuse.fusion.norm_quant import match_rms_norm
from qfuse.fusion.patterns import Chain
from qfuse.primitives import choose_qparams

aten = torch.ops.aten


@dataclass(frozen=True)
class SmoothQuant:
    """``alpha``: migration strength (0: none, 1: all to weights; 0.5 is the paper's default).
    ``layers``: globs of Linear layer names to smooth; ``None`` smooths Linear layers fed by a
    LayerNorm, an RMSNorm, directly by another Linear (the cases the paper targets) or by a
    gated product whose ``up`` Linear takes the factors (``up_rows``; such a layer is left
    unsmoothed where ``up`` stays float), and with ``search`` every Linear. ``search``: per
    input, the alpha (``ALPHAS``, or no smoothing) and the static activation clip (``CLIPS``)
    with the least output error on calibration rows; ``alpha`` is then unused.

    Example:
        >>> import qfuse
        >>> qfuse.SmoothQuant(search=True).search, qfuse.SmoothQuant(0.8).alpha
        (True, 0.8)
    """

    alpha: float = 0.5
    layers: tuple[str, ...] | None = None
    search: bool = False

    def __post_init__(self) -> None:
        from qfuse.errors import UnsupportedError

        if not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise UnsupportedError(f"SmoothQuant alpha={self.alpha!r} must lie in [0, 1].")
        if isinstance(self.layers, str):
            raise UnsupportedError("SmoothQuant layers takes a tuple of globs, not one string.")
        if not isinstance(self.search, bool):
            raise UnsupportedError(f"SmoothQuant search={self.search!r}: pass True or False.")


def select(gm: fx.GraphModule, chains: list[Chain], cfg: SmoothQuant) -> list[str]:
    """Names of the Linear chains to smooth; ``UnsupportedError`` when a glob of ``cfg.layers``
    matches no Linear or no layer is eligible (smoothing nothing would be a silent no-op)."""
    import fnmatch

    from qfuse.errors import UnsupportedError
    from qfuse.validate import check_layer_globs

    linears = [c for c in chains if c.kind == "linear"]
    check_layer_globs(dict.fromkeys(cfg.layers or ()), linears, "SmoothQuant(layers=...)")
    nodes = {n.name: n for n in gm.graph.nodes}
    linear_outputs = {c.output for c in chains if c.kind == "linear" and len(c.nodes) == 1}
    picked = []
    for chain in chains:
        if chain.kind != "linear":
            continue
        if cfg.layers is not None:
            if any(fnmatch.fnmatchcase(chain.name, g) for g in cfg.layers):
                picked.append(chain.name)
            continue
        src = source(nodes[chain.input])
        norm = src.target == aten.layer_norm.default or match_rms_norm(src) is not None
        gated = up_rows(nodes, chain.input, None, chains) is not None
        if norm or src.name in linear_outputs or gated or cfg.search:
            picked.append(chain.name)
    if not picked:
        raise UnsupportedError(
            "SmoothQuant: no layer is eligible (it smooths Linear layers fed by a LayerNorm, an "
            "RMSNorm or directly by another Linear; this model's Linears: "
            f"{[c.name for c in linears][:8]}); name the Linears to smooth with "
            "SmoothQuant(layers=(...)) or drop smoothquant=."
        )
    return picked


def foldable_norm(
    nodes: dict[str, fx.Node], input_name: str, observer, readers: list[Chain], smoothed: set[str]
) -> fx.Node | None:
    """The weight (get_attr node) of the RMSNorm whose output is the input ``input_name`` of
    ``readers`` (every chain reading it), when ``x / s`` can be folded into that weight: every
    reader is smoothed, nothing else reads the norm's output (only ``observer``, the prepared
    model's observer of it, which the readers read through) and nothing else reads its weight.
    None otherwise (the readers then take ``x / s`` in their prologue)."""
    node = nodes[input_name]
    src = source(node)
    norm = match_rms_norm(src)
    if norm is None or not readers or any(r.name not in smoothed for r in readers):
        return None
    weight = norm[1]
    if len(weight.users) != 1 or not read_only_through(src, node, observer):
        return None
    return weight


def factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float,
            fold_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-input-channel smoothing factors s (float32, > 0); channels that are zero in either the
    activations or the weights get s = 1 (nothing to migrate). ``fold_rows``: a ``RowFold``'s
    rows; the channels sharing a producer row get one factor, from their joint maxima (``tie``)."""
    w_absmax = tie(weight.detach().float().abs().amax(dim=0), fold_rows)
    a = tie(act_absmax.float(), fold_rows)
    s = a.pow(alpha) / w_absmax.pow(1.0 - alpha)
    ok = (a > 0) & (w_absmax > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(min=1e-5).to(torch.float32)


def smoothed_qparams(lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor, symmetric: bool):
    """Per-tensor qparams of ``x / s`` from the per-channel range [lo_j, hi_j] of ``x``."""
    return choose_qparams((lo / s).min(), (hi / s).max(), symmetric=symmetric)


# The search's grid: migration strengths (None: no smoothing) and clips of the static range.
ALPHAS = (None, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CLIPS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.12, 0.07)
# Output channels the error is measured on (a fixed random subset): the ranking of candidates,
# not the error itself, is what counts, and the search's cost is candidates x rows x outputs.
SEARCH_OUTPUTS = 128


def _fake_weight(w: torch.Tensor, dtype: torch.dtype, per_channel: bool) -> torch.Tensor:
    from qfuse.primitives import weight_codes, weight_scale

    scale = weight_scale(w, dtype, per_channel)
    return weight_codes(w, torch.reciprocal(scale)[:, None], dtype) * scale[:, None]


def _fake_input(x: torch.Tensor, dtype: torch.dtype, scale, zero_point) -> torch.Tensor:
    """What the kernel computes with for input ``x`` at ``scale`` (a scalar, int8-convention
    ``amax / 127.5``; or a column of per-row scales for dynamic) and ``zero_point``."""
    from qfuse.primitives import FP8_E4M3_MAX, fake_quantize

    if dtype == torch.float8_e4m3fn:
        s8 = scale * (127.5 / FP8_E4M3_MAX)
        v = torch.clamp(x / s8, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return v.to(torch.float8_e4m3fn).float() * s8
    if torch.is_tensor(scale) and scale.dim() == 2:
        return torch.clamp(torch.round(x / scale), -128, 127) * scale
    return fake_quantize(x, scale, zero_point)


@torch.no_grad()
def search(
    rows: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    *,
    static: bool,
    symmetric: bool,
    per_channel: bool,
    smooth: bool,
    fold_rows: torch.Tensor | None = None,
) -> tuple[float | None, float]:
    """(alpha, clip) for one input read by layers whose weights, stacked, are ``weight``
    [N, K]: the candidate with the least error of ``Q(x / s) Q(W s)^T`` against ``x W^T`` over
    ``rows`` (a sample of calibration inputs [n, K]; ``lo``, ``hi``: every calibration row's
    per-channel range): the summed squared error. Not relative per row: the attention-sink rows'
    large outputs carry what the model relies on (on SmolLM2 a per-row relative error picks
    clips that cut the sinks, +150% perplexity, where the plain error gives +5%). ``smooth``
    False: only s = 1 (the input cannot take a factor). Dynamic (``static`` False): per-row
    scales, no clip. ``fold_rows``: a ``RowFold``'s rows; channels sharing one get one factor.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(256, 64, generator=g); x[:, 3] *= 60  # one outlier channel
        >>> w = torch.randn(32, 64, generator=g)
        >>> alpha, clip = search(x, x.amin(0), x.amax(0), w, torch.int8, static=True,
        ...                      symmetric=True, per_channel=True, smooth=True)
        >>> alpha is not None  # the outlier channel moves into the weights
        True
    """
    from qfuse.primitives import choose_qparams

    rows = rows.float()
    weight = full = weight.detach().float()
    if weight.shape[0] > SEARCH_OUTPUTS:  # the per-row error, estimated on a column subset
        pick = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))
        weight = weight[pick[:SEARCH_OUTPUTS].sort().values]
    want = rows @ weight.T
    absmax = torch.maximum(lo.abs(), hi.abs()).float()
    best = (float("inf"), None, 1.0)
    for alpha in ALPHAS if smooth else (None,):
        s = None if alpha is None else factors(absmax, full, alpha, fold_rows)
        xs = rows if s is None else rows / s
        ws = weight if s is None else weight * s
        wq = _fake_weight(ws, dtype, per_channel)
        los, his = (lo, hi) if s is None else (lo / s, hi / s)
        for clip in CLIPS if static else (1.0,):
            if static:
                scale, zp = choose_qparams(los.min() * clip, his.max() * clip,
                                           symmetric=symmetric or dtype == torch.float8_e4m3fn)
            else:
                scale = (xs.abs().amax(1, keepdim=True) / 127.5).clamp(min=1e-12)
                zp = 0
            got = _fake_input(xs, dtype, scale, zp) @ wq.T
            err = (got - want).pow(2).sum().item()
            if err < best[0]:
                best = (err, alpha, clip)
    return best[1], best[2]
