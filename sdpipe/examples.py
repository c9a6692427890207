"""Built-in examples beyond the digits MLP and CNN (:mod:`sdpipe.data`): a GPT-style character language model
trained on the Python standard library's own source text, and a residual CNN on upscaled digits.

Both need nothing downloaded: the text is the ``.py`` files at the top of this Python installation's standard
library (sorted by name, read as ASCII, unknown characters replaced by ``?``), its first ``train_chars``
characters for training and the next ``eval_chars`` held out; the images are scikit-learn's bundled digits.
The text depends on the Python version (3.11 here), so its losses do too.

Each model is an ``nn.Sequential`` of blocks, so ``stages`` cuts it between blocks::

    from sdpipe.examples import char_gpt, char_data, lm_loss
    train_set, eval_set = char_data()
    run = sdpipe.train(char_gpt(), train_set, eval_data=eval_set, loss_fn=lm_loss, metric="perplexity",
                       stages=4, pipelines=2, policy="sdpipe")
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

__all__ = [
    "VOCAB",
    "Block",
    "CharWindows",
    "LMHead",
    "TokenEmbedding",
    "char_data",
    "char_gpt",
    "digits_resnet",
    "lm_loss",
    "stdlib_text",
]

#: characters are ASCII codes: 128 tokens
VOCAB = 128


def stdlib_text(train_chars: int = 200_000, eval_chars: int = 20_000) -> tuple[str, str]:
    """``(training text, held-out text)``: consecutive characters of the standard library's top-level sources."""
    import sysconfig
    from pathlib import Path

    want = train_chars + eval_chars
    parts, have = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_bytes().decode("ascii", errors="replace").replace("\ufffd", "?")
        parts.append(text)
        have += len(text)
        if have >= want:
            break
    text = "".join(parts)
    if len(text) < want:
        raise ValueError(f"train_chars: the standard library holds {len(text)} characters, fewer than {want} asked")
    return text[:train_chars], text[train_chars:want]


def encode(text: str) -> torch.Tensor:
    """The text's ASCII codes as int64 tokens."""
    return torch.tensor(list(text.encode("ascii", errors="replace")), dtype=torch.int64)


class CharWindows(Dataset):
    """Map-style dataset of a text cut into windows: item ``i`` is ``(x, y)``, ``block`` tokens from position
    ``i * block`` and the same shifted by one (each token's next token is its target)."""

    def __init__(self, tokens: torch.Tensor, block: int):
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        lo = i * self.block
        return self.tokens[lo : lo + self.block], self.tokens[lo + 1 : lo + self.block + 1]

    def tensors(self) -> tuple:
        """``(X, Y)``: every window at once, as two (windows, block) tensors (item ``i`` is ``(X[i], Y[i])``)."""
        n, b = len(self), self.block
        return self.tokens[: n * b].view(n, b), self.tokens[1 : n * b + 1].view(n, b)


def char_data(block: int = 64, train_chars: int = 200_000, eval_chars: int = 20_000):
    """``(train, held_out)`` :class:`CharWindows` of :func:`stdlib_text`."""
    train, held_out = stdlib_text(train_chars, eval_chars)
    return CharWindows(encode(train), block), CharWindows(encode(held_out), block)


class TokenEmbedding(nn.Module):
    """Tokens (batch, time) to vectors (batch, time, width): a token embedding plus a learnt position's."""

    def __init__(self, vocab: int, width: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each added to its input."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class LMHead(nn.Module):
    """Vectors (batch, time, width) to next-token scores (batch, time, vocab)."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def char_gpt(
    vocab: int = VOCAB, block: int = 64, width: int = 64, heads: int = 4, layers: int = 4, seed: int = 0
) -> nn.Sequential:
    """A small GPT-style character model: embedding, ``layers`` blocks, head, as an ``nn.Sequential``."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        TokenEmbedding(vocab, width, block), *[Block(width, heads) for _ in range(layers)], LMHead(width, vocab)
    )
    for name, p in model.named_parameters():  # GPT-2's initialization: small weights, residual paths scaled
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model


def lm_loss(logits, targets):
    """Mean cross entropy of every position's next-token scores (batch, time, vocab) against (batch, time)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, added to the input (a 1x1 convolution on the
    shortcut where the width or the resolution changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def digits_resnet(channels: int = 16, seed: int = 0) -> nn.Sequential:
    """A small ResNet for the digits of :func:`sdpipe.data.digits` (flat 64-pixel rows), upscaled to 16 x 16:
    a stem, four residual blocks in two resolutions, average pooling and a linear classifier."""
    torch.manual_seed(seed)
    c = channels
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
        nn.Sequential(nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()),
        Residual(c, c),
        Residual(c, 2 * c, stride=2),
        Residual(2 * c, 2 * c),
        Residual(2 * c, 4 * c, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * c, 10),
    )
