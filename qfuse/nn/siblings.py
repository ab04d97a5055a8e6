"""QSibling: sibling Linears (Q, K and V) that read the same input, swapped into a user's model as
one merged GEMM.

A model's attention calls ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` one after another on the
same tensor. ``prepare`` merges such siblings into one layer (``qfuse.fusion.siblings``);
``convert(output="model")`` keeps them merged: each member becomes a ``QSibling`` holding its
rows' range of the merged ``QLinear``. The first member called on an input runs the merged GEMM
once and keeps its output; the others, called on the same tensor, return their rows of it. So a
Llama layer's decode step streams Q, K and V as one weight (one launch, one quantization of
``h``) instead of three, while the model's attention forward stays the model's own.

The merged ``QLinear`` is registered once, in the first member (``q_proj.merged.weight``), so
``state_dict`` and ``save_pretrained`` see no shared tensors; the others refer to it
unregistered (``copy.deepcopy`` and ``torch.save`` keep the reference).

When is the kept output used? When the same tensor object arrives before every member took its
rows (and, in eager mode, unmodified since: its version counter matches). Anything else (a member
called alone, on another tensor, in another order) runs the merged GEMM again and returns its
rows: correct, at the cost of the other members' columns. ``torch.compile`` traces the same
logic (the kept output is a value inside one compiled frame, cleared when the last member takes
its rows, so nothing is kept between calls); it cannot read version counters, so a compiled
model trusts that the input is not modified in place between the members' calls, which no
attention forward does. Tensors made under ``torch.inference_mode()`` keep no version counter
either (reading it raises), so there the same trust applies; serving code and
sentence-transformers' ``encode()`` run there.
"""

from __future__ import annotations

import torch
from torch import nn

from qfuse.nn.qlinear import QLinear


class QSibling(nn.Module):
    """Member ``index`` of ``members`` sibling layers served by one merged GEMM: rows
    ``start:end`` of its output.

    Example:
        >>> import torch
        >>> w, x = torch.randn(12, 8), torch.randn(3, 8)   # q: 8 rows, k: 2, v: 2
        >>> merged = QLinear.from_float(w, None, x_scale=None, x_zero_point=None)
        >>> q, k, v = QSibling.group(merged, [8, 2, 2])
        >>> torch.equal(torch.cat([q(x), k(x), v(x)], -1), merged(x))
        True
        >>> [name for name, _ in q.named_modules()], [name for name, _ in k.named_modules()]
        (['', 'merged'], [''])
    """

    def __init__(self, owner: QSibling | None, merged: QLinear | None, index: int, start: int,
                 end: int, members: int) -> None:
        super().__init__()
        if owner is None:
            self.merged = merged  # registered here only
            self._stash = None
        else:
            object.__setattr__(self, "_owner", owner)  # unregistered: one copy of the tensors
        self.index, self.start, self.end, self.members = index, start, end, members
        self.in_features, self.out_features = merged.in_features, end - start

    @classmethod
    def group(cls, merged: QLinear, sizes: list[int]) -> list[QSibling]:
        """One ``QSibling`` per member, ``sizes`` output features each, in the merged rows'
        order; the first holds ``merged``."""
        if sum(sizes) != merged.out_features:
            raise ValueError(f"member sizes {sizes} do not add up to the merged layer's "
                             f"{merged.out_features} output features")
        out, start = [], 0
        for i, size in enumerate(sizes):
            out.append(cls(out[0] if out else None, merged, i, start, start + size, len(sizes)))
            start += size
        return out

    @property
    def owner(self) -> QSibling:
        """The member that holds the merged layer and the kept output."""
        return self.__dict__.get("_owner", self)

    @property
    def merged_layer(self) -> QLinear:
        return self.owner.merged

    @property
    def weight(self) -> torch.Tensor:
        """As ``SwappedQLinear.weight`` faces a parent (``QuantizedModule.facing_weight``);
        ``qweight`` is this member's rows of the quantized weight."""
        return self.merged_layer.facing_weight()

    @property
    def qweight(self) -> torch.Tensor:
        return self.merged_layer.weight[self.start:self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        kept = owner._stash
        version = _version(x)
        if kept is not None and kept[0] is x and kept[2] > 0 and kept[3] == version:
            out = kept[1]
            owner._stash = (x, out, kept[2] - 1, version) if kept[2] > 1 else None
        else:
            out = owner.merged(x)
            owner._stash = (x, out, self.members - 1, version)
        return out[..., self.start:self.end]

    def extra_repr(self) -> str:
        return (f"member {self.index + 1} of {self.members}: rows {self.start}:{self.end} of "
                f"one merged GEMM")


def _version(x: torch.Tensor) -> int:
    """``x``'s in-place modification count where torch keeps one, else 0 (trusted unmodified):
    compiled frames cannot read it, and inference tensors have none."""
    if torch.compiler.is_compiling() or x.is_inference():
        return 0
    return x._version
