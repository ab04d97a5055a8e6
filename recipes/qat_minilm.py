"""QAT fine-tune of all-MiniLM-L6-v2 (real weights, offline) to static int8, distilled from fp32.

    python -m qfuse.recipes.qat_minilm          # CPU, 2 threads: ~4 minutes (the 200 QAT steps: ~1)
    python -m qfuse.recipes.qat_minilm --steps 40  # a quick look

Starts from PTQ's best static int8 recipe without GPTQ (histogram-MSE asymmetric activations,
SmoothQuant 0.5: its scales and smoothing factors carry over), then trains the fake-quant model on
the calibration sentences (never the held-out ones) with a distillation loss against the float
model: token-level MSE of the last hidden states plus ``1 - cos`` of the sentence embeddings.
Reports the held-out mean/min cosine of fp32 vs the converted model next to the PTQ recipes (same
metric as ``recipes.ptq_minilm``).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch  # noqa: E402
from qfuse.calibration.sentences import calibration_sentences, heldout_sentences  # noqa: E402
from qfuse.recipes.ptq_minilm import (  # noqa: E402
    DYNAMIC,
    batched,
    calibrated,
    cosines,
    embed,
    load_minilm,
    tokenize,
)
from torch import nn  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import qfuse  # noqa: E402


def without_dropout(model: nn.Module) -> nn.Module:
    """A train-mode copy whose dropout (and attention dropout) is off: distillation wants the
    student's forward to be the function it will serve."""
    model = copy.deepcopy(model).train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if hasattr(m, "dropout_prob"):
            m.dropout_prob = 0.0
    return model


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


def distill_loss(student_hidden, teacher_hidden, mask) -> torch.Tensor:
    """Token-level MSE (relative to the teacher's scale) + ``1 - cos`` of the embeddings."""
    m = mask.unsqueeze(-1).to(student_hidden.dtype)
    mse = ((student_hidden - teacher_hidden) ** 2 * m).sum() / (teacher_hidden**2 * m).sum()
    cos = (pooled(student_hidden, mask) * pooled(teacher_hidden, mask)).sum(-1)
    return mse + (1 - cos).mean()


def finetune(qat, teacher, batches, steps: int, lr: float, progress: bool) -> list[float]:
    """``steps`` AdamW steps over ``batches`` (cycled), cosine learning-rate decay."""
    params = [p for p in qat.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with torch.no_grad():
        targets = [teacher(**b)["last_hidden_state"] for b in batches]
    losses = []
    bar = tqdm(range(steps), desc="QAT", disable=not progress)
    for step in bar:
        batch, target = batches[step % len(batches)], targets[step % len(batches)]
        out = qat(**batch)
        hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
        loss = distill_loss(hidden, target, batch["attention_mask"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}")
    return losses


def run(steps: int = 200, lr: float = 1e-5, batch: int = 16, gptq: bool = True, progress=True):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    bert, tokenizer = load_minilm()
    calib_all, held = calibration_sentences(), heldout_sentences()
    calib = calib_all[:-64]  # as recipes.ptq_minilm: the last 64 are its validation slice
    held_batches = [tokenize(tokenizer, b) for b in batched(held, 32)]
    ref = torch.cat([embed(bert, b) for b in held_batches])

    def held_cos(model):
        c = cosines(model, ref, held_batches)
        return c.mean().item(), c.min().item()

    config = qfuse.QConfig(symmetric=False, observer="histogram_mse")
    smooth = qfuse.SmoothQuant(0.5)
    rows = []
    start = time.perf_counter()
    prepared = calibrated(bert, tokenizer, config, calib, smoothquant=smooth)
    rows.append(("PTQ int8 static, hist-MSE asym + SQ 0.5", *held_cos(qfuse.convert(prepared))))
    if gptq:
        with_gptq = calibrated(
            bert, tokenizer, config, calib, smoothquant=smooth, gptq=qfuse.GPTQ()
        )
        rows.append(("PTQ   + GPTQ (best PTQ recipe)", *held_cos(qfuse.convert(with_gptq))))

    example = tokenize(tokenizer, calib[:8])
    student = without_dropout(bert)
    qat = qfuse.prepare_qat(
        student,
        config,
        (),
        example_kwargs=example,
        dynamic_shapes={"input_ids": DYNAMIC, "attention_mask": DYNAMIC},
        qat=qfuse.QATConfig(observer_freeze_step=0),  # keep PTQ's scales; train the weights
        from_prepared=prepared,
    )
    train_batches = [tokenize(tokenizer, b) for b in batched(calib, batch)]
    losses = finetune(qat, bert, train_batches, steps, lr, progress)
    qmodel = qfuse.convert(qat.eval())
    rows.append((f"QAT int8 static, from PTQ ({steps} steps)", *held_cos(qmodel)))
    return dict(
        rows=rows,
        losses=losses,
        seconds=time.perf_counter() - start,
        held=len(held),
        summary=qfuse.summary(qmodel),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-gptq", action="store_true", help="skip the PTQ + GPTQ row")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    r = run(args.steps, args.lr, args.batch, not args.no_gptq, progress=not args.quiet)
    print(f"\nall-MiniLM-L6-v2, {r['held']} held-out sentences, cosine to fp32 (CPU)\n")
    print(f"{'config':<46}{'cos mean':>10}{'cos min':>10}")
    for name, mean, low in r["rows"]:
        print(f"{name:<46}{mean:>10.5f}{low:>10.5f}")
    print(f"\nloss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; {r['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
