"""Small models shared by the flow tests."""

import torch
from torch import nn


class MLPBlock(nn.Module):
    """Transformer MLP block: Linear -> GELU -> Linear -> + residual."""

    def __init__(self, d: int = 32, h: int = 64, approximate: str = "none") -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.act = nn.GELU(approximate=approximate)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(self.act(self.up(x))) + x


class ConvNet(nn.Module):
    """Conv-BN-ReLU -> Conv-BN-ReLU -> pool -> Linear-ReLU -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class LNBlock(nn.Module):
    """Post-LN style: the LayerNorm output feeds a Linear and the residual, and one LN channel
    carries a large outlier (as BERT's do)."""

    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)  # fed directly by fc: smoothing folds into fc's rows
        with torch.no_grad():
            self.ln.weight[3] = 60.0
            self.ln.weight[17] = -40.0

    def forward(self, x):
        h = self.ln(x)
        return self.fc2(self.fc(h)) + h


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics, so folding BN actually changes the weights."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return model.eval()


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())).item()


def tiny_bert(layers: int = 1, dtype: torch.dtype = torch.float32):
    """A randomly initialised transformers BERT encoder (hidden 32, 2 heads, vocab 64) on SDPA,
    no pooler: what the fusion tests convert."""
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).eval().to(dtype)


def tiny_llama(layers: int = 1):
    """A randomly initialised transformers Llama (hidden 64, 4 query / 2 KV heads, vocab 96,
    tied embeddings): what the 4-bit and AWQ tests convert."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def planned_float(prepared):
    """The prepared graph with its plan's float weights and biases (SmoothQuant's / AWQ's
    ``W * s``) and folded norm weights written in: no rounding, so it must compute what the
    float model does. Returns ``(graph, plan)``."""
    import copy

    from qfuse.flows.plan import LayerPlan
    from qfuse.state import get_state

    state = get_state(prepared)
    dtypes = {c.name: torch.int8 for c in state.chains}
    plan = LayerPlan(prepared, state, state.chains, state.observers, dtypes, {}, fold_norms=True)
    gm = copy.deepcopy(prepared)
    plan.write_norm_weights(gm)
    for chain in state.chains:
        for ref, tensor in ((chain.weight, plan.weights[chain.name]),
                            (chain.bias, plan.biases.get(chain.name))):
            if ref is not None:
                owner, _, leaf = ref.rpartition(".")
                gm.get_submodule(owner)._parameters[leaf] = nn.Parameter(tensor)
    return gm, plan


def token_batch(seed: int = 0, pad: bool = True) -> dict:
    """Two sequences of 9 token ids for ``tiny_bert``; ``pad`` masks the second one's last 4."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}
