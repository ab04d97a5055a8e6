"""The per-layer plan convert builds fused modules from, and the algorithms that transform it.

``LayerPlan`` starts from what calibration gives: each chain's float weight and bias and its
input qparams from its observer. Algorithms are transforms (``apply(plan)``) run in order over
it: SmoothQuant (factors from the observers, folded into the producer Linear, the ``up`` / ``v``
rows behind a gated product / attention or an RMSNorm, or kept as a prologue vector), AWQ
(searched factors folded the same way, weight clips), GPTQ (rounds the weights that ship,
against the plain per-channel scale), and those the state carries (QAT's learned scales:
``qfuse.flows.qat.lower``). convert, the module swap and QAT's PTQ carry-over read the same
plan.
"""

from __future__ import annotations

import torch
from torch import nn

from qfuse.algorithms.awq import AWQ, AWQSamples, search_clip, search_scale
from qfuse.algorithms.gptq import round_layer, round_layer4
from qfuse.algorithms.row_folds import RowFold, row_fold, up_rows
from qfuse.algorithms.smoothquant import factors, foldable_norm, search, smoothed_qparams
from qfuse.config import PerChannel, config_for
from qfuse.errors import CalibrationError, QFuseError
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.fusion.patterns import Chain
from qfuse.fusion.siblings import merged_path
from qfuse.ops.reference import quantize_per_token
from qfuse.primitives import choose_qparams, fake_quantize, inverse, weight_scale
from qfuse.progress import progress


def _tensor(gm, target: str | None) -> torch.Tensor | None:
    return attr_tensor(gm, target).detach() if target is not None else None


def _per_tensor_qparams(observer, symmetric: bool):
    """Per-tensor qparams, also from a per-channel (SmoothQuant) observer, and symmetric ones
    from an affine observer when the layer needs them (fp8 is symmetric only)."""
    qparams = observer.calculate_qparams()  # the checks (calibrated, not all-zero) and messages
    if observer.channel_axis is None and symmetric == observer.symmetric:
        return qparams
    lo, hi = observer.value_range()
    return choose_qparams(lo.min(), hi.max(), symmetric=symmetric)


class LayerPlan:
    """Float weights, input qparams, prologue vectors, SmoothQuant factors and weight scales per
    chain, after every transform.

    ``fold_norms``: SmoothQuant may fold its factors into an RMSNorm's weight; the caller then
    writes ``norm_weights`` into the model it builds (``write_norm_weights``). Off, those layers
    take ``x / s`` in their prologue (QAT's carry-over, which bakes only the chains' weights)."""

    def __init__(self, gm, state, chains, observers, dtypes, hessians, fold_norms=False):
        self.gm, self.fold_norms = gm, fold_norms
        self.chains = list(chains)
        self.dtypes = dtypes  # chain name -> torch.int8 | torch.float8_e4m3fn
        self.weights = {c.name: _tensor(gm, c.weight).float() for c in chains}
        self.biases = {c.name: _tensor(gm, c.bias) for c in chains}
        self.biases = {k: (b.float() if b is not None else None) for k, b in self.biases.items()}
        # chain input node -> its observer module (SmoothQuant reads their per-channel ranges)
        self.observers = {src: gm.get_submodule(name) for src, name in observers.items()}
        # chain input node -> its InputSamples (SmoothQuant's search measures candidates on them)
        self.samples = {src: gm.get_submodule(name) for src, name in state.samples.items()}
        # chain names whose input is quantized per token at run time (the config's, or a
        # dynamic QConfig of prepare's layer_configs in a static model)
        layer_configs = getattr(state, "layer_configs", None)
        self.dynamic = {c.name for c in chains
                        if config_for(c.name, state.config, layer_configs).is_dynamic}
        self.x_qparams = {c.name: self._input_qparams(c) for c in chains}
        self.prologue = {}  # chain name -> per-input-channel inverse-scale vector
        self.smoothing = {}  # chain name -> SmoothQuant factors s (the layer sees x / s)
        self.folded_into = {}  # chain name -> where SmoothQuant folded x / s ("producer", ...)
        # producer chain name -> what its weight rows were divided by (1 for rows not folded
        # into): its outputs are its float outputs over this (qfuse.sensitivity undoes it)
        self.row_divisors = {}
        self.merged = {merged_path(g): g for g in getattr(state, "merged", [])}
        self.norm_weights = {}  # get_attr target of an RMSNorm weight -> its folded value w / s
        self.weight_scales = {}  # chain name -> the scale the weight was rounded against
        self.searched = {}  # chain name -> (alpha, clip) SmoothQuant's search chose
        for transform in transforms(state, hessians):
            transform.apply(self)

    def _input_qparams(self, chain: Chain) -> tuple:
        """The chain's static input (scale, zero point) from its observer; ``(None, None)`` for
        a dynamic config whose observer saw no data: per-token scales are computed at run time,
        so ``int8_dynamic()`` converts without calibration (what needs data, SmoothQuant's
        ranges and GPTQ's Hessians, says so when it reads them)."""
        observer = self.observers[chain.input]
        # QAT's and an imported file's qparams sources hold fixed values and count no batches
        seen = getattr(observer, "num_batches", None)
        if chain.name in self.dynamic and seen is not None and not int(seen):
            return None, None
        return _per_tensor_qparams(observer, self.symmetric_input(chain))

    def smoothquant_note(self, name: str, smoothquant) -> str:
        """What SmoothQuant did to layer ``name``, for ``summary``."""
        if name in self.searched:
            alpha, clip = self.searched[name]
            what = "not smoothed" if alpha is None else f"alpha={alpha}"
            where = "" if alpha is None else f", {self.where_smoothed(name)}"
            return f"SmoothQuant search: {what}, activation clip {clip:g}{where}"
        return f"SmoothQuant alpha={smoothquant.alpha} ({self.where_smoothed(name)})"

    def row_fold(self, chain: Chain, chains: list[Chain]) -> RowFold | None:
        """The ``up`` rows behind a gated product or the ``v`` rows behind an attention
        (``algorithms.row_folds``) a factor of ``chain``'s input folds into, when the Linear
        owning them is in this plan (quantized: convert writes its weights); ``chains``: every
        chain of the prepared model. None otherwise."""
        observer = self.observers.get(chain.input)
        if observer is None:
            return None
        nodes = {n.name: n for n in self.gm.graph.nodes}
        fold = row_fold(nodes, chain.input, observer, list(chains) or self.chains, self.merged)
        return fold if fold is not None and fold.producer in self.weights else None

    def where_smoothed(self, name: str) -> str:
        if name not in self.smoothing:
            return "not smoothed: " + self.folded_into.get(name, "no fold target")
        if name in self.prologue:
            return "prologue"
        return "folded into " + self.folded_into.get(name, "producer")

    def symmetric_input(self, chain: Chain) -> bool:
        """Whether the chain's input is quantized symmetrically (its observer's scheme; fp8)."""
        fp8 = self.dtypes[chain.name] == torch.float8_e4m3fn
        return self.observers[chain.input].symmetric or fp8

    def write_norm_weights(self, module: nn.Module) -> None:
        """Put the folded RMSNorm weights into ``module`` (the converted graph, or the model
        swapped into) at their paths, as new tensors: the prepared model and the float model it
        shares tensors with keep theirs."""
        for target, w in self.norm_weights.items():
            owner, _, leaf = target.rpartition(".")
            try:
                parent = module.get_submodule(owner)
            except AttributeError:
                parent = None
            old = getattr(parent, leaf, None) if parent is not None else None
            if not isinstance(old, torch.Tensor) or old.shape != w.shape:
                raise QFuseError(
                    f"SmoothQuant folded its factors into the RMSNorm weight {target}, which "
                    f"{type(module).__name__} does not hold at that path; convert with "
                    "output='graph', or smooth these layers in their prologue instead "
                    "(SmoothQuant(layers=...) naming only Linears not fed by an RMSNorm)."
                )
            w = w.to(old.device)
            if leaf in parent._parameters:
                parent._parameters[leaf] = nn.Parameter(w, requires_grad=old.requires_grad)
            else:
                parent._buffers[leaf] = w


def fold_norms(plan: LayerPlan, chains: list[Chain], selected: set[str]) -> dict:
    """Chain input -> the RMSNorm weight node a factor ``x / s`` of its readers folds into
    (``foldable_norm``), for the inputs every reader of which is in ``selected`` and in the plan
    (``chains``: every chain of the prepared model; none kept float or left unswapped). Empty
    without ``plan.fold_norms``. SmoothQuant and AWQ fold through this."""
    if not plan.fold_norms:
        return {}
    nodes = {n.name: n for n in plan.gm.graph.nodes}
    in_plan = {c.name for c in plan.chains}
    everyone: dict[str, list[Chain]] = {}
    for c in chains or plan.chains:
        everyone.setdefault(c.input, []).append(c)
    norms = {}
    for inp, readers in everyone.items():
        if inp in plan.observers and all(r.name in in_plan for r in readers):
            weight = foldable_norm(nodes, inp, plan.observers[inp], readers, selected)
            if weight is not None:
                norms[inp] = weight
    return norms


def apply_factors(plan: LayerPlan, chain: Chain, s: torch.Tensor, norm,
                  producer: Chain | RowFold | None, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Layer ``chain`` sees ``x / s``: its weight columns times ``s``, and ``x / s`` folded into
    the RMSNorm weight ``norm`` (a get_attr node; every reader of the norm takes the same ``s``),
    else into the rows of ``producer`` (a Linear only this layer reads, or a ``RowFold``: the
    rows of ``up`` / ``v`` behind a gated product / attention), else into the layer's prologue.
    Factors compose: a second call (AWQ after SmoothQuant) multiplies onto the first.
    ``lo``, ``hi``: the input's per-channel range (already clipped), for its per-tensor qparams."""
    name = chain.name
    prev = plan.smoothing.get(name)
    total = s if prev is None else prev * s
    plan.weights[name] = plan.weights[name] * s[None, :]
    plan.smoothing[name] = total
    plan.x_qparams[name] = smoothed_qparams(lo, hi, total, plan.symmetric_input(chain))
    if norm is not None:
        w = attr_tensor(plan.gm, norm.target).detach()
        plan.norm_weights[norm.target] = (w.float() / total).to(w.dtype)
        plan.folded_into[name] = "RMSNorm weight"
    elif producer is not None:
        fold = producer if isinstance(producer, RowFold) else None
        owner = fold.producer if fold else producer.name
        divisor = torch.ones(plan.weights[owner].shape[0], device=s.device)
        divisor[fold.rows if fold else slice(None)] = s
        plan.weights[owner] = plan.weights[owner] / divisor[:, None]
        if plan.biases[owner] is not None:
            plan.biases[owner] = plan.biases[owner] / divisor
        prev_rows = plan.row_divisors.get(owner)
        plan.row_divisors[owner] = divisor if prev_rows is None else prev_rows * divisor
        plan.folded_into[name] = f"{fold.member} rows" if fold else "producer"
    else:
        plan.prologue[name] = (inverse(total) * inverse(plan.x_qparams[name][0])).float()


class SmoothQuantTransform:
    """SmoothQuant over the layers ``qfuse.prepare`` selected: each gets factors ``s`` from its
    per-channel input range; ``x / s`` is folded into a producer Linear that only it reads, into
    the ``up`` / ``v`` rows behind a gated product / attention only it reads
    (``LayerPlan.row_fold``; with GQA the query heads of a ``v`` row share one factor), or into
    an RMSNorm that only smoothed layers read (one ``s`` for all of them, ``fold_norms``),
    otherwise applied in the layer's prologue. A layer the default selection took only for its
    ``up`` fold stays unsmoothed where that fold is not there (``up`` kept float)."""

    def __init__(self, smoothquant, smoothed: list[str], chains: list[Chain] = (),
                 config=None) -> None:
        self.smoothquant, self.smoothed, self.config = smoothquant, smoothed, config
        # Every chain of the prepared model: a norm is folded into only when all its readers
        # are smoothed layers of this plan (none kept float or left unswapped).
        self.chains = list(chains)

    def _norms(self, plan: LayerPlan) -> dict:
        """Chain input -> the RMSNorm weight node its ``x / s`` folds into (``fold_norms``)."""
        return fold_norms(plan, self.chains, set(self.smoothed))

    def apply(self, plan: LayerPlan) -> None:
        by_name = {c.name: c for c in plan.chains}
        readers: dict[str, list[Chain]] = {}
        for c in plan.chains:
            readers.setdefault(c.input, []).append(c)
        norms = self._norms(plan)
        smoothed = set(self.smoothed)
        shared = {}  # norm-fed (or searched) input -> the one (s, clip) of all its readers
        for name in self.smoothed:
            chain = by_name.get(name)
            if chain is None:  # kept float, or not swapped
                continue
            observer = plan.observers[chain.input]
            if not int(observer.num_batches):
                raise CalibrationError(
                    f"{name}: no calibration data reached this layer, so SmoothQuant has no "
                    "activation ranges to choose its factors from. Run calibration batches "
                    "through the prepared model before qfuse.convert, or prepare without "
                    "smoothquant= (a dynamic config then needs no calibration)."
                )
            lo, hi = observer.value_range()
            absmax = torch.maximum(lo.abs(), hi.abs())
            norm = norms.get(chain.input)
            producer = next((c for c in plan.chains if c.output == chain.input), None)
            folds = producer is not None and len(producer.nodes) == 1 and len(
                readers[chain.input]) == 1
            rows = None if norm is not None or folds else plan.row_fold(chain, self.chains)
            if rows is not None:
                producer, folds = rows, True
            elif norm is None and not folds and self._for_fold_only(plan, chain):
                plan.folded_into[name] = "its up Linear is not quantized (no fold target)"
                continue
            clip = 1.0
            if self.smoothquant.search:
                if chain.input not in shared:
                    group = [r for r in readers[chain.input] if r.name in smoothed]
                    shared[chain.input] = self._search(plan, chain, group, lo, hi, absmax,
                                                       smooth=norm is not None or folds,
                                                       rows=rows.rows if rows else None)
                s, clip, alpha = shared[chain.input]
                plan.searched[name] = (alpha, clip)
                if s is None:  # no smoothing: the clipped per-tensor range alone
                    plan.x_qparams[name] = choose_qparams(
                        lo.min() * clip, hi.max() * clip, symmetric=plan.symmetric_input(chain))
                    continue
            elif norm is None:  # GQA's v rows: the query heads of a group share a factor
                s = factors(absmax, plan.weights[name], self.smoothquant.alpha,
                            rows.rows if rows is not None else None)
            else:
                if chain.input not in shared:  # the readers' weights before any is smoothed
                    joint = torch.cat([plan.weights[r.name] for r in readers[chain.input]])
                    shared[chain.input] = factors(absmax, joint, self.smoothquant.alpha)
                s = shared[chain.input]
            apply_factors(plan, chain, s, norm, producer if folds else None, lo * clip, hi * clip)

    def _for_fold_only(self, plan: LayerPlan, chain: Chain) -> bool:
        """Whether the default selection took ``chain`` only because its input is a gated
        product whose ``up`` rows could take the factors (``smoothquant.select``)."""
        if self.smoothquant.layers is not None or self.smoothquant.search:
            return False
        nodes = {n.name: n for n in plan.gm.graph.nodes}
        return up_rows(nodes, chain.input, plan.observers[chain.input],
                       self.chains or plan.chains) is not None

    def _search(self, plan: LayerPlan, chain: Chain, group: list[Chain], lo, hi, absmax,
                smooth: bool, rows: torch.Tensor | None = None):
        """(s or None, clip, alpha) for the input ``group`` reads: ``search`` over the readers'
        stacked weights, on the input's calibration sample. A dynamic config takes no clip, and
        no factor where only the prologue could apply it (it needs a static scale)."""
        samples = plan.samples.get(chain.input)
        if samples is None:
            raise QFuseError(f"layer {chain.name}: SmoothQuant(search=True) found no calibration "
                             "sample of its input; prepare the model with this SmoothQuant.")
        samples.check_calibrated()
        static = chain.name not in plan.dynamic
        joint = torch.cat([plan.weights[r.name] for r in group])
        alpha, clip = search(
            samples.rows, lo, hi, joint, plan.dtypes[chain.name], static=static,
            symmetric=plan.symmetric_input(chain),
            per_channel=isinstance(self.config.weight_granularity, PerChannel),
            smooth=smooth or static, fold_rows=rows,
        )
        s = factors(absmax, joint, alpha, rows) if alpha is not None else None
        return s, clip, alpha


class GPTQTransform:
    """GPTQ rounding of the layers with a recorded input Hessian, after SmoothQuant (it rounds
    the weights that ship), against the plain per-channel (or per-tensor) scale."""

    def __init__(self, gptq, hessians: dict, per_channel: bool, config=None) -> None:
        self.gptq, self.hessians, self.per_channel = gptq, hessians, per_channel
        self.config = config

    def apply(self, plan: LayerPlan) -> None:
        four_bit = self.config is not None and self.config.weight_bits == 4
        for c in progress([c for c in plan.chains if c.name in self.hessians], "GPTQ rounding"):
            if four_bit:  # group qparams chosen as the sweep reaches each group
                plan.weights[c.name], plan.weight_scales[c.name] = round_layer4(
                    self.hessians[c.name], c.name, plan.weights[c.name], self.config.group_size,
                    self.config.weight_symmetric, self.gptq, plan.smoothing.get(c.name))
                continue
            dtype = plan.dtypes[c.name]
            scale = weight_scale(plan.weights[c.name], dtype, self.per_channel)
            plan.weights[c.name] = round_layer(
                self.hessians[c.name],
                c.name,
                plan.weights[c.name],
                scale,
                dtype,
                self.gptq,
                plan.smoothing.get(c.name),
            )
            plan.weight_scales[c.name] = scale


class AWQTransform:
    """AWQ over the plan's layers in ``layers``: per input, the searched ``s`` folded through
    SmoothQuant's machinery (``fold_norms``, ``apply_factors``; into an RMSNorm, a producer
    Linear, or the ``up`` / ``v`` rows behind a gated product / attention:
    ``LayerPlan.row_fold``); then, with ``clip``, each layer's weight clamped at its searched
    per-group clip ratios. Records what it chose in
    ``plan.awq`` (chain name -> ``{"ratio": ..., "folded": ..., "clipped": ...}``)."""

    def __init__(self, awq: AWQ, layers: list[str], chains: list[Chain], config) -> None:
        self.awq, self.layers, self.chains, self.config = awq, list(layers), list(chains), config

    def _act(self, plan, chain: Chain, lo, hi):
        """The activation rounding the layer applies to ``x / s`` (None: float activations)."""
        if self.config.weight_only:
            return None
        if chain.name in plan.dynamic:
            def act(xs, s):
                q, scale = quantize_per_token(xs, torch.int8)
                return q.float() * scale[:, None]
            return act
        def act(xs, s):
            ones = torch.ones_like(lo)
            scale, zp = smoothed_qparams(lo, hi, ones if s is None else s,
                                         plan.symmetric_input(chain))
            return fake_quantize(xs, scale, zp)
        return act

    def apply(self, plan) -> None:
        selected = set(self.layers)
        mine = [c for c in plan.chains if c.name in selected]
        readers: dict[str, list[Chain]] = {}
        for c in self.chains or plan.chains:  # every chain, also those kept float
            readers.setdefault(c.input, []).append(c)
        nodes = {n.name: n for n in plan.gm.graph.nodes}
        groups: dict[str, list[Chain]] = {}
        for c in mine:
            groups.setdefault(c.input, []).append(c)
        norms = fold_norms(plan, self.chains, selected)
        chosen = plan.__dict__.setdefault("awq", {})
        size, symmetric = self.config.group_size, self.config.weight_symmetric
        for inp, group in progress(list(groups.items()), "AWQ scale search", total=len(groups)):
            samples = self._samples(plan, inp, group[0])
            norm = norms.get(inp)
            producer = None
            # a producer Linear whose output only this layer reads (through its observer)
            if norm is None and len(readers[inp]) == 1 and len(nodes[inp].users) == 1:
                producer = next((c for c in plan.chains if c.output == inp
                                 and len(c.nodes) == 1), None)
            if norm is None and producer is None and len(group) == 1:
                producer = plan.row_fold(group[0], self.chains)  # up / v rows (row_folds)
            if norm is None and producer is None:
                for c in group:
                    chosen[c.name] = {"ratio": None, "folded": "no fold target"}
                continue
            prev = plan.smoothing.get(group[0].name)  # SmoothQuant's factors, when it ran first
            rows, x_mean = samples.rows, samples.abs_mean
            if prev is not None:
                rows, x_mean = rows / prev, x_mean / prev
            observer = plan.observers[inp]
            lo, hi = observer.value_range()
            if prev is not None:
                lo, hi = lo / prev, hi / prev
            joint = torch.cat([plan.weights[c.name] for c in group])
            ratio, s, _ = search_scale(
                rows, x_mean, joint, size, symmetric, grid=self.awq.grid,
                duo_scaling=self.awq.duo_scaling, act=self._act(plan, group[0], lo, hi),
                fold_rows=producer.rows if isinstance(producer, RowFold) else None)
            where = "RMSNorm weight" if norm is not None else (
                f"{producer.member} rows" if isinstance(producer, RowFold) else "producer")
            for c in group:
                chosen[c.name] = {"ratio": ratio, "folded": where if s is not None else None}
                if s is None:
                    continue
                clip = plan.searched.get(c.name, (None, 1.0))[1]  # SmoothQuant's static clip
                full_lo, full_hi = observer.value_range()
                apply_factors(plan, c, s, norm, producer, full_lo * clip, full_hi * clip)
        if not self.awq.clip:
            return
        for c in progress(mine, "AWQ clip search", total=len(mine)):
            samples = self._samples(plan, c.input, c)
            rows = samples.rows
            s = plan.smoothing.get(c.name)
            if s is not None:
                rows = rows / s
            plan.weights[c.name], ratios = search_clip(
                rows, plan.weights[c.name], size, symmetric, grid=self.awq.clip_grid,
                max_shrink=self.awq.max_shrink)
            chosen.setdefault(c.name, {})["clipped"] = float((ratios < 1).float().mean())

    @staticmethod
    def _samples(plan, inp: str, chain: Chain) -> AWQSamples:
        samples = plan.samples.get(inp)
        if not isinstance(samples, AWQSamples):
            raise QFuseError(
                f"layer {chain.name}: AWQ found no calibration sample of its input; prepare the "
                "model with awq=qfuse.AWQ(...) and run calibration batches before convert."
            )
        samples.check_calibrated()
        return samples


def transforms(state, hessians: dict) -> list:
    """The transforms of a prepared model's plan, in order: SmoothQuant, AWQ, GPTQ (for the layers
    in ``hessians``: chain name -> InputHessian), then the state's own (QAT's learned scales)."""
    out = []
    if state.smoothquant is not None and state.smoothed:
        out.append(SmoothQuantTransform(state.smoothquant, state.smoothed, state.chains,
                                        state.config))
    if getattr(state, "awq", None) is not None:  # AWQ's scales and clips, then GPTQ rounds
        out.append(AWQTransform(state.awq, state.awq_layers, state.chains, state.config))
    if hessians:
        per_channel = isinstance(state.config.weight_granularity, PerChannel)
        out.append(GPTQTransform(state.gptq, hessians, per_channel, state.config))
    return out + list(state.plan_transforms)
