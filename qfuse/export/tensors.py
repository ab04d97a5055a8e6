"""Every tensor a converted graph module holds, by dotted name, and how to put one back.

A converted model keeps three kinds of tensor state: parameters (float layers left unquantized:
LayerNorm, embeddings), buffers (the fused modules' int8/fp8 weights and scales, non-persistent
buffers such as BERT's ``position_ids``) and plain tensor attributes read by ``get_attr`` nodes
(constants ``torch.export`` lifted). ``state_dict`` misses the last two, so saving uses this.
"""

from __future__ import annotations

import torch
from torch import fx, nn


def graph_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """All tensors of ``gm`` by dotted name, sorted; a tensor reachable by two names is listed
    under both (see ``split_aliases``).

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 3)))
        >>> list(graph_tensors(gm))
        ['0.bias', '0.weight']
    """
    out: dict[str, torch.Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    out.update(gm.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in out:
            value = get_tensor(gm, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return {name: out[name] for name in sorted(out)}


def get_tensor(gm: nn.Module, target: str):
    """The attribute at dotted ``target`` (None when absent)."""
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf, None)


def split_aliases(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(unique, aliases)``: each tensor object once under its first name, and every further
    name of the same object mapped to that first name (tied weights are saved once)."""
    unique: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in tensors.items():
        canonical = first_name.setdefault(id(tensor), name)
        if canonical == name:
            unique[name] = tensor
        else:
            aliases[name] = canonical
    return unique, aliases


def to_cpu_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies that share no storage with each other.

    safetensors refuses tensors that share memory (views of one buffer); those get a clone. A
    CUDA tensor is copied by ``.cpu()`` anyway; a CPU tensor is only cloned when needed.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel() > 0:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def set_tensor(gm: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the tensor at ``name`` without writing into the old one (which may be shared with
    the float model ``gm`` was captured from). Parameters stay parameters with the same
    ``requires_grad`` (an ``nn.Parameter`` is stored as is, which is how tied names are re-tied);
    buffers keep their persistence; plain attributes stay plain."""
    owner, _, leaf = name.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    if leaf in module._parameters:
        if not isinstance(tensor, nn.Parameter):
            old = module._parameters[leaf]
            grad = old.requires_grad if old is not None else False
            tensor = nn.Parameter(tensor, requires_grad=grad)
        module._parameters[leaf] = tensor
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        setattr(module, leaf, tensor)
