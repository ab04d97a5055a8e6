"""Replace each chain's nodes with one call to its fused module (shared by convert and load)."""

from __future__ import annotations

from torch import fx, nn

from qfuse.errors import QFuseError
from qfuse.fusion.graph_utils import erase_if_dead, find_submodule
from qfuse.fusion.patterns import Chain


def module_paths(chains: list[Chain]) -> dict[str, str]:
    """Where each chain's fused module lives: the float module's path, so state_dict names match
    the float model (a chain without a unique module path gets ``<name>_qfused``)."""
    paths, taken = {}, set()
    for chain in chains:
        path = chain.name
        if path in taken or not path:
            path = f"{chain.name.replace('.', '_')}_qfused"
        taken.add(path)
        paths[chain.name] = path
    return paths


def remove_observers(gm: fx.GraphModule, observer_names) -> None:
    """Drop identity recorders (observers, GPTQ's input Hessians): their call_module nodes (each
    reader gets the recorded value back) and their modules."""
    names = set(observer_names)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target in names:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    for name in names:
        gm.delete_submodule(name)


def fuse_chains(gm: fx.GraphModule, chains: list[Chain], modules: dict[str, nn.Module]) -> None:
    """For every chain with a module in ``modules`` (by chain name), put the module at its path,
    call it in place of the chain, and delete the chain's nodes and now-unused float weights.
    Chains missing from ``modules`` stay float.

    Raises ``QFuseError`` naming the layer when a rewrite would leave the graph invalid (a value
    used before it is computed): a matcher bug, reported instead of fx's bare RuntimeError.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    paths = module_paths(chains)
    for chain in chains:
        module = modules.get(chain.name)
        if module is None:
            continue
        try:
            _fuse_one(gm, chain, module, nodes, paths[chain.name])
            gm.graph.lint()
        except QFuseError:
            raise
        except Exception as exc:  # fx raises RuntimeError/KeyError/ValueError for broken graphs
            raise QFuseError(
                f"layer {chain.name} ({chain.pattern}): fusing it into one call broke the graph "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). This is "
                "a qfuse matcher bug; keep_float this layer to convert the rest, and report it."
            ) from exc
    erase_if_dead(gm, [n for n in gm.graph.nodes if n.op == "get_attr"])
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _fuse_one(gm, chain: Chain, module: nn.Module, nodes: dict, path: str) -> None:
    """Insert the fused call before the chain's output node and erase the chain."""
    out_node = nodes[chain.output]
    anchor = nodes[chain.anchor]
    kwargs = {"residual": nodes[chain.residual]} if chain.residual else {}
    with gm.graph.inserting_before(out_node):
        # create_node: call_module would insist the module exist already, and a chain of a
        # weight not named ".weight" gets its module below, after the float nodes are gone.
        fused = gm.graph.create_node("call_module", path, (anchor.args[0],), kwargs)
    fused.meta["val"] = out_node.meta.get("val")
    out_node.replace_all_uses_with(fused)
    erase_if_dead(gm, [nodes[n] for n in reversed(chain.nodes)])
    # A later chain may name this output as its residual: point the name at the fused node.
    nodes[chain.output] = fused
    if find_submodule(gm, path) is not None:
        gm.set_submodule(path, module)
    else:
        gm.add_submodule(path, module)
