"""How both LLM data sets (the toy ``llm`` and ``smollm2``) measure a causal LM: perplexity and
greedy next tokens over token windows, greedy continuations of prompts."""

from __future__ import annotations

import math

import torch


def logits_of(out) -> torch.Tensor:
    """The logits of a causal LM's output: a ``ModelOutput``, a dict or a tuple (captured graphs
    return the latter two)."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        return out["logits"]
    return out[0] if isinstance(out, (tuple, list)) else out


def _device(model) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


@torch.no_grad()
def score(model, wins: torch.Tensor, batch: int = 4) -> tuple[float, torch.Tensor]:
    """(perplexity, greedy next-token ids ``[n, seq_len]``) of ``model`` over ``wins``; the
    inputs go to the model's device, the NLL is summed in float32.

    Example:
        >>> from qfuse.calibration import llm
        >>> ppl, greedy = score(llm.load_model(), llm.heldout_windows(2))
        >>> 1 < ppl < 880, tuple(greedy.shape)  # 880: the unigram baseline's (manifest.json)
        (True, (2, 128))
    """
    nll, count, greedy = 0.0, 0, []
    for logits, y in _batches(model, wins, batch):
        nll += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten(), reduction="sum"
        ).item()
        count += y.numel()
        greedy.append(logits.argmax(-1).cpu())
    return math.exp(nll / count), torch.cat(greedy)


@torch.no_grad()
def window_nll(model, wins: torch.Tensor, batch: int = 4) -> list[float]:
    """Each window's mean next-token NLL; with windows of one length, exp of their mean is
    ``score``'s perplexity."""
    nll: list[float] = []
    for logits, y in _batches(model, wins, batch):
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        nll += loss.mean(-1).tolist()
    return nll


def _batches(model, wins: torch.Tensor, batch: int):
    """(float32 logits, targets on the logits' device) per batch of windows; the inputs go to
    the model's device (a wrapper such as the sweep's ``OnDevice`` may return CPU logits)."""
    device = _device(model)
    for i in range(0, wins.shape[0], batch):
        x, y = wins[i : i + batch, :-1].to(device), wins[i : i + batch, 1:]
        logits = logits_of(model(input_ids=x)).float()
        yield logits, y.to(logits.device)


@torch.no_grad()
def generate(model, ids: torch.Tensor, new_tokens: int, pad_token_id: int) -> torch.Tensor:
    """Greedy continuation (``[n, new_tokens]``) of each prompt row with ``model.generate``."""
    ids = ids.to(_device(model))
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=pad_token_id)
    return out[:, ids.shape[1] :].cpu()
