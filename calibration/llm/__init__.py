"""A small trained Llama, its text, and how it is measured (made by ``recipes/train_llm.py``).

Files beside this module: ``model.safetensors`` + ``config.json`` (a 4-layer
``LlamaForCausalLM``, bf16 weights), ``tokenizer.json`` (4096-token byte-level BPE),
``calibration.txt`` (standard-library modules that were in the training set), ``heldout.txt``
(modules that neither the model nor the tokenizer saw), ``manifest.json`` (how it was trained).

The reference model is the bf16 checkpoint computed in float32. Text is cut into windows of
``SEQ_LEN`` tokens (no padding, no attention mask): perplexity is exp(mean next-token NLL) over
every position of every window; ``calibration_windows`` and ``validation_windows`` are disjoint
slices of the calibration text. Only torch and transformers are imported, so the llm-compressor
peer (``bench/llm_peer.py``, its own venv) measures with exactly the same code.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch
from qfuse.calibration import causal_lm
from qfuse.calibration.causal_lm import logits_of, score  # noqa: F401 -- this data set's API

DIR = Path(os.environ.get("QFUSE_LLM_DIR", Path(__file__).resolve().parent))
EOS = "<|endoftext|>"
SEQ_LEN = 128
N_CALIBRATION = 64  # windows; the validation windows follow them
N_VALIDATION = 32
PROMPT_LEN, NEW_TOKENS = 32, 32  # generation agreement: held-out prompts, greedy continuations
SAMPLE_PROMPT = 'def median(data):\n    """Return the median (middle value) of numeric data.\n'


def load_model(dtype: torch.dtype = torch.float32):
    """The trained ``LlamaForCausalLM`` in eval mode (float32 compute by default).

    Example:
        >>> model = load_model()
        >>> type(model).__name__, model.config.num_hidden_layers, model.dtype
        ('LlamaForCausalLM', 4, torch.float32)
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)
    return model.to(dtype).eval()


@lru_cache(maxsize=1)
def load_tokenizer():
    """The ``PreTrainedTokenizerFast`` the model was trained with.

    Example:
        >>> tok = load_tokenizer()
        >>> tok.decode(tok("def f(x):\\n    return x")["input_ids"])
        'def f(x):\\n    return x'
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(DIR)


def _ids(name: str) -> torch.Tensor:
    text = (DIR / name).read_text(encoding="utf-8")
    return torch.tensor(load_tokenizer()(text)["input_ids"], dtype=torch.long)


def windows(ids: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len + 1]`` windows (inputs plus the next token) of ``ids``."""
    n = (ids.numel() - 1) // seq_len
    starts = torch.arange(n) * seq_len
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def heldout_windows(limit: int | None = None) -> torch.Tensor:
    """Windows of the held-out text (every one, or the first ``limit``).

    Example:
        >>> heldout_windows(4).shape
        torch.Size([4, 129])
    """
    return windows(_ids("heldout.txt"))[:limit]


def calibration_windows(limit: int | None = None) -> torch.Tensor:
    """The first ``N_CALIBRATION`` windows of the calibration text (or the first ``limit``)."""
    return windows(_ids("calibration.txt"))[: min(limit or N_CALIBRATION, N_CALIBRATION)]


def validation_windows(limit: int | None = None) -> torch.Tensor:
    """``N_VALIDATION`` windows after the calibration windows: what tuning (auto_fallback, search)
    may look at, never the held-out text.

    Example:
        >>> v, c = validation_windows(), calibration_windows()
        >>> v.shape[0], bool((v[0] != c[-1]).any())
        (32, True)
    """
    stop = N_CALIBRATION + min(limit or N_VALIDATION, N_VALIDATION)
    return windows(_ids("calibration.txt"))[N_CALIBRATION:stop]


def prompts(held: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``PROMPT_LEN`` tokens of ``n`` held-out windows spread evenly over the text.

    Example:
        >>> prompts(heldout_windows(8), 4).shape
        torch.Size([4, 32])
    """
    return held[:: max(1, held.shape[0] // n)][:n, :PROMPT_LEN]


def training_windows() -> torch.Tensor:
    """Calibration-text windows after the validation ones (QAT's fine-tuning text)."""
    return windows(_ids("calibration.txt"))[N_CALIBRATION + N_VALIDATION :]


def generate(model, ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy continuation (``[n, new_tokens]``) of each prompt row with ``model.generate``."""
    return causal_lm.generate(model, ids, new_tokens, load_tokenizer().eos_token_id)


def sample(model, prompt: str = SAMPLE_PROMPT, new_tokens: int = 40) -> str:
    """``prompt`` and the model's greedy continuation, as text."""
    tok = load_tokenizer()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    return prompt + tok.decode(generate(model, ids, new_tokens)[0])
