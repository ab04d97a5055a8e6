"""Find the GPU-only divergence of the zoo ResNet's fused graph with asymmetric int8 activations.

    python -m bench.diag.diag_resnet_asym [--config int8_static_asymmetric]

Builds the zoo's ResNet, prepares, calibrates and converts it on the CPU, then runs the fused
graph node by node (``torch.fx.Interpreter``) three ways on the same input: the CPU reference,
the CUDA tensors through the reference (``use_backend("reference")``) and the CUDA tensors
through the Triton kernels (``auto``). Each node's output is compared; the first nodes where the
Triton run leaves the references are printed with the op's arguments. A node is judged on its
own input too: every call_function of a qfuse op is re-run on the *reference's* inputs on CUDA,
so one wrong kernel is not hidden behind an earlier one.
"""

from __future__ import annotations

import argparse

import torch
import torch.fx

import qfuse
from tests.zoo_models import build


class Recorder(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _first_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (tuple, list)):
        for x in v:
            t = _first_tensor(x)
            if t is not None:
                return t
    if isinstance(v, dict):
        for x in v.values():
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def _diff(a, b) -> tuple[float, float]:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        return float("inf"), float("inf")
    d = (a - b).abs()
    return float(d.max()) if d.numel() else 0.0, float((d > 0).float().mean()) if d.numel() else 0.0


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}:{tuple(v.stride())}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    if isinstance(v, torch.fx.Node):
        return v.name
    return repr(v)[:40]


def _is_qfuse(gm, n) -> bool:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__module__.startswith("qfuse")
    return n.op == "call_function" and ("qfuse" in str(n.target) or "_call" in str(n.target))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="int8_static_asymmetric")
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--device", default="cuda", help="cpu: the Triton run under the interpreter")
    ap.add_argument("--prepare-device", default="cpu",
                    help="where prepare, calibration and convert run (the zoo test: cuda)")
    args = ap.parse_args()
    model, make_cpu_inputs, key = build(args.model)
    pdev = args.prepare_device
    model.to(pdev)

    def make_inputs(**kw):
        return {k: v.to(pdev) for k, v in make_cpu_inputs(**kw).items()}

    inputs = make_inputs()
    config = getattr(qfuse.QConfig, args.config)()
    prepared = qfuse.prepare(model, config, (), example_kwargs=inputs)
    with torch.no_grad():
        for i in range(8):
            prepared(**make_inputs(batch=8, seed=1 + i))
        ref_float = model(**inputs)[key].cpu()
        inputs = {k: v.cpu() for k, v in inputs.items()}
    graph = qfuse.convert(prepared).to("cpu")
    print(qfuse.summary(graph))
    gm = graph if isinstance(graph, torch.fx.GraphModule) else getattr(graph, "graph_module", graph)
    flat_inputs = [inputs[n.target] if n.target in inputs else None
                   for n in gm.graph.nodes if n.op == "placeholder"]
    print("placeholders:", [n.target for n in gm.graph.nodes if n.op == "placeholder"])

    runs = {}
    with torch.no_grad():
        r = Recorder(gm)
        r.run(*flat_inputs)
        runs["cpu_ref"] = r.values
        gpu = gm.to(args.device)
        cuda_inputs = [x.to(args.device) if isinstance(x, torch.Tensor) else x
                       for x in flat_inputs]
        with qfuse.use_backend("reference"):
            r = Recorder(gpu)
            r.run(*cuda_inputs)
            runs["cuda_ref"] = r.values
        with qfuse.use_backend("triton"):
            r = Recorder(gpu)
            r.run(*cuda_inputs)
            runs["cuda_triton"] = r.values
            r = Recorder(gpu)
            r.run(*cuda_inputs)
            runs["cuda_triton_again"] = r.values
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    for name, vals in runs.items():
        t = _first_tensor(vals[out_node.name])
        print(f"{name}: final rel err vs float "
              f"{float((t.float().cpu() - ref_float.float()).norm() / ref_float.norm()):.4f}")

    print("\n== node by node, cuda_triton vs cuda_ref (max abs diff in stored units, share)")
    shown = 0
    for n in gm.graph.nodes:
        a = _first_tensor(runs["cuda_triton"].get(n.name))
        b = _first_tensor(runs["cuda_ref"].get(n.name))
        c = _first_tensor(runs["cpu_ref"].get(n.name))
        if a is None or b is None:
            continue
        dmax, frac = _diff(a, b)
        dref, _ = _diff(b, c) if c is not None else (float("nan"), 0)
        if dmax > 0 or _is_qfuse(gm, n):
            print(f"{n.name:40s} {str(n.target)[:38]:38s} {_short(a):40s} "
                  f"triton-ref {dmax:10.4g} ({frac:6.1%})  cudaref-cpuref {dref:8.3g}")
            shown += dmax > 0
        if shown >= 12:
            break

    print("\n== each qfuse op alone on the reference's CUDA inputs (triton vs reference)")
    vals = runs["cuda_ref"]
    for n in gm.graph.nodes:
        if not _is_qfuse(gm, n):
            continue
        fetch = lambda v: vals[v.name] if isinstance(v, torch.fx.Node) else v  # noqa: E731
        a_args = torch.fx.node.map_aggregate(n.args, fetch)
        a_kwargs = torch.fx.node.map_aggregate(n.kwargs, fetch)
        fn = gpu.get_submodule(n.target) if n.op == "call_module" else n.target
        with torch.no_grad():
            with qfuse.use_backend("triton"):
                tri = fn(*a_args, **a_kwargs)
            with qfuse.use_backend("reference"):
                ref = fn(*a_args, **a_kwargs)
        if _first_tensor(tri) is None:
            continue
        dmax, frac = _diff(_first_tensor(tri), _first_tensor(ref))
        flag = "  <-- DIFFERS" if dmax > 1 else ""
        if flag and n.op == "call_module":
            mod = gpu.get_submodule(n.target)
            flag += "\n      " + repr(mod)[:300] + "\n      " + str(
                {k: _short(v) if isinstance(v, torch.Tensor) else v
                 for k, v in vars(mod).items() if not k.startswith("_")})[:600]
        print(f"{n.name:36s} {dmax:8.4g} ({frac:6.1%}) args={_short(list(a_args))[:150]} "
              f"kw={ {k: _short(v) for k, v in a_kwargs.items()} }{flag}")


if __name__ == "__main__":
    main()
