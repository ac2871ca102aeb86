"""LightningModules shaped like real models (Hugging Face GPT-2, Llama, Mamba, Mixtral, ViT and DeBERTa, nanoGPT,
Llama-style decoders, a diffusion denoiser, a U-Net, fine-tuning), written as a user would with no pipeline in mind.

Every module brings its own data loaders (seeded, from ``loaders.py``). Each is an entry of ``models.MODELS``, trained
by ``models.fit`` like every other model of the suite.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm
from loaders import BATCH_SIZE, SEQ_LEN, VOCAB, features, image_batches, padded_batches, token_batches
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------- 1. Hugging Face language models
def causal_lm(family: str, dropout: float = 0.0) -> nn.Module:
    """A Hugging Face causal LM from a small config (random weights, nothing downloaded): GPT-2 (its dropout ``dropout``
    everywhere), Llama (grouped key/value heads, rotary positions) or Mamba (whose cache holds convolution and
    recurrent states instead of keys and values)."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout))
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32))
    assert family == "mamba", family
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4))


class HFLanguageModel(L.LightningModule):
    """A Hugging Face language model as ``self.model``, trained on `token_batches` to predict its own tokens
    (``self.model(input_ids, labels=input_ids).loss``, logged as ``train_loss``) with AdamW."""

    def __init__(self, model: nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids, labels=input_ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return token_batches()


class HFGPT2(HFLanguageModel):
    """``GPT2LMHeadModel`` (see `causal_lm`); blocks in ``model.transformer.h`` (an ``nn.ModuleList`` that GPT-2's
    forward loops over with a causal mask, position ids and a cache), head tied to ``wte``. Dropout off for exact
    comparisons, or GPT2Config's defaults (0.1 everywhere)."""

    def __init__(self, dropout: bool = False, lr: float = 3e-3) -> None:
        super().__init__(causal_lm("gpt2", dropout=0.1 if dropout else 0.0), lr)  # 0.1: GPT2Config's default


class PaddedHFGPT2(HFGPT2):
    """GPT-2 on sequences of different lengths, padded: ``labels`` are ``-100`` on the padding, so Hugging Face's loss
    averages over each batch's real tokens, and micro-batches hold different numbers of them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        loss = self.model(input_ids, attention_mask=attention_mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader:
        dataset = token_batches().dataset
        assert isinstance(dataset, TensorDataset)
        (tokens,) = dataset.tensors
        lengths = torch.randint(3, SEQ_LEN + 1, (len(tokens),), generator=torch.Generator().manual_seed(3))
        attention_mask = (torch.arange(SEQ_LEN) < lengths[:, None]).long()
        labels = tokens.masked_fill(attention_mask == 0, -100)
        return DataLoader(TensorDataset(tokens, attention_mask, labels), batch_size=BATCH_SIZE, shuffle=False)


def label_tokens(batch: Any) -> torch.Tensor:
    """A micro-batch's weight for Hugging Face's causal-LM loss: its labels that count after the shift by one."""
    return (batch[2][:, 1:] != -100).sum()


# --------------------------------------------------------------------------------------------------- 2. nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim, bias=bias)
        self.c_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, dim))


class NanoBlock(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, bias=bias)
        self.attn = CausalSelfAttention(dim, heads, bias)
        self.ln_2 = nn.LayerNorm(dim, bias=bias)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(dim, 4 * dim, bias=bias), "c_proj": nn.Linear(4 * dim, dim,
                                                                                                   bias=bias)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class NanoGPT(L.LightningModule):
    """nanoGPT's layout: ``self.transformer = nn.ModuleDict(wte, wpe, drop, h=nn.ModuleList, ln_f)``, ``lm_head`` tied
    to ``wte``, forward loops ``for block in self.transformer.h: x = block(x, mask)`` with a boolean causal mask."""

    def __init__(self, layers: int = 4, dim: int = 32, heads: int = 4, bias: bool = True) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, dim), "wpe": nn.Embedding(SEQ_LEN, dim), "drop": nn.Dropout(0.0),
            "h": nn.ModuleList([NanoBlock(dim, heads, bias) for _ in range(layers)]),
            "ln_f": nn.LayerNorm(dim, bias=bias),
        })  # fmt: skip
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # type: ignore[union-attr]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        pos = torch.arange(length, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # type: ignore[operator]
        mask = torch.ones(length, length, dtype=torch.bool, device=idx.device).tril()
        for block in self.transformer.h:  # type: ignore[union-attr]
            x = block(x, mask)
        return self.lm_head(self.transformer.ln_f(x))  # type: ignore[operator]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = next_token_loss(self(tokens), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return token_batches()


# ------------------------------------------------------------------------------ 3. tuple and dict activations
class ResidualMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class RouterBlock(nn.Module):
    """Returns ``(hidden, aux)``: a gated residual and a running auxiliary loss (a 0-dim tensor) it adds to."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = ResidualMLP(dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, hidden: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = torch.sigmoid(self.gate(hidden))
        return hidden + gate * self.mlp(hidden), aux + gate.pow(2).mean()


class TupleCarry(L.LightningModule):
    """Blocks take and return two tensors: ``hidden, aux = block(hidden, aux)``; the loss adds ``aux``."""

    def __init__(self, layers: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(10, dim)
        self.blocks = nn.ModuleList([RouterBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden, aux = torch.tanh(self.inp(x)), x.new_zeros(())
        for block in self.blocks:
            hidden, aux = block(hidden, aux)
        loss = F.cross_entropy(self.head(hidden), y) + 0.1 * aux
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return features(seed=0)


class LegacyAttentionBlock(nn.Module):
    """Written like transformers 4.x blocks: returns ``(hidden, attention weights or None)`` and takes an additive float
    mask (0 where allowed, the dtype's minimum where masked)."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = ResidualMLP(dim)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, dim = hidden.shape
        q, k, v = self.qkv(self.norm(hidden)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = scores.softmax(-1)
        hidden = hidden + self.out((weights @ v).transpose(1, 2).reshape(batch, length, dim))
        hidden = hidden + self.mlp(hidden)
        return hidden, (weights if output_attentions else None)


class TupleOutput(L.LightningModule):
    """The transformers 4.x loop: ``layer_outputs = layer(hidden, attention_mask=mask); hidden = layer_outputs[0]``."""

    def __init__(self, layers: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([LegacyAttentionBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        hidden = self.embed(tokens)
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        mask = torch.zeros(length, length, device=tokens.device).masked_fill(~causal, torch.finfo(hidden.dtype).min)
        for layer in self.layers:
            layer_outputs = layer(hidden, attention_mask=mask[None, None])
            hidden = layer_outputs[0]
        loss = next_token_loss(self.head(self.norm(hidden)), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return token_batches(seed=1)


class DictBlock(nn.Module):
    """Takes and returns a dict: the hidden state, a gate for the next block (``None`` before the first), a long depth
    counter and an unused ``memory`` slot that stays ``None``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = ResidualMLP(dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        hidden, scale, depth = state["h"], state["scale"], state["depth"]
        update = self.mlp(hidden) / (depth + 1)
        if scale is not None:
            update = update * scale
        return {"h": hidden + update, "scale": torch.sigmoid(self.gate(hidden)), "depth": depth + 1,
                "memory": state["memory"]}


class DictState(L.LightningModule):
    def __init__(self, layers: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(10, dim)
        self.blocks = nn.ModuleList([DictBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        state: dict[str, Any] = {"h": torch.tanh(self.inp(x)), "scale": None, "depth": torch.tensor(0), "memory": None}
        for block in self.blocks:
            state = block(state)
        assert int(state["depth"]) == len(self.blocks)  # the user's own sanity check
        loss = F.cross_entropy(self.head(state["h"] * state["scale"]), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return features(seed=2)


# ------------------------------------------------------------------------------------------------- 4. denoiser
class DenoiserBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = ResidualMLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Denoiser(L.LightningModule):
    """The diffusion training pattern: draw ``noise``, feed the noised sample through the blocks, regress the same
    ``noise``. ``signal`` is the schedule's signal rate at the sampled time: at 0 the input is pure noise, so with
    identity blocks (``nn.Linear`` initialised to the identity) one device's loss is exactly 0.

    Test instrumentation: every call of ``training_step`` keeps its noise in ``drawn`` (compared across stages), and
    noise put in ``replay`` is used instead of drawing (a single-device run replaying a pipelined run's noise).
    """

    alpha_bar: torch.Tensor

    def __init__(self, identity: bool = False, layers: int = 4, dim: int = 16, signal: float = 0.5) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            if identity:
                linear = nn.Linear(dim, dim)
                nn.init.eye_(linear.weight)
                nn.init.zeros_(linear.bias)
                blocks.append(linear)
            else:
                blocks.append(DenoiserBlock(dim))
        self.blocks = nn.ModuleList(blocks)
        self.register_buffer("alpha_bar", torch.tensor(signal))
        self.dim = dim
        self.drawn: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        noise = self.replay.pop(0) if self.replay else torch.randn_like(x)
        self.drawn.append(noise.detach().clone())
        h = self.alpha_bar.sqrt() * x + (1 - self.alpha_bar).sqrt() * noise
        for block in self.blocks:
            h = block(h)
        loss = F.mse_loss(h, noise)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        # 16 features: any number of rows is a multiple of 16 values, so a draw split by rows gives the same numbers
        # as one draw for the whole batch (CPU normal_ fills in blocks of 16)
        return DataLoader(TensorDataset(torch.randn(4 * BATCH_SIZE, self.dim, generator=generator)),
                          batch_size=BATCH_SIZE, shuffle=False)


# ---------------------------------------------------------------------------- 5. exp(loss) logged in validation
class PerplexityLM(NanoGPT):
    """nanoGPT trained with SGD, validated every epoch: ``val_ppl = exp(loss)`` (monitored by ``ModelCheckpoint``), the
    largest logit and a token count. Half of every validation batch is random tokens, so per-micro-batch losses
    differ and a mean of per-micro-batch ``exp`` would differ from one device's value; the other half repeats training
    sequences."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        logits = self(tokens)
        loss = next_token_loss(logits, tokens)
        self.log("val_loss", loss)
        self.log("val_ppl", torch.exp(loss))
        self.log("val_top", logits.max(), reduce_fx="max")
        self.log("val_tokens", float(tokens.numel()), reduce_fx="sum")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)

    def val_dataloader(self) -> DataLoader:
        return token_batches(batches=2, noisy_rows=BATCH_SIZE // 2)  # first halves: training sequences


# -------------------------------------------------------------------------------- 6. BackboneFinetuning
class Embeddings(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(SEQ_LEN, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))


class FinetuneLM(L.LightningModule):
    """``self.backbone`` (token and position embeddings) is frozen by ``BackboneFinetuning`` before setup and unfrozen
    at epoch 1; the head is tied to the token embedding, so it is frozen and unfrozen with it."""

    def __init__(self, layers: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.backbone = Embeddings(dim)
        self.blocks = nn.ModuleList([DenoiserBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.backbone.token.weight

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        x = self.backbone(tokens)
        for block in self.blocks:
            x = block(x)
        loss = next_token_loss(self.head(self.norm(x)), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return token_batches(seed=6)


# ---------------------------------------------------------------------------------------------------- 7. slicing
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class DecoderLayer(nn.Module):
    """A Llama-style layer: RMSNorm, rotary attention (``position_embeddings=(cos, sin)``), a residual scaled by the
    caller's ``residual_scale``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.up_proj, self.down_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                residual_scale: float = 1.0) -> torch.Tensor:
        assert position_embeddings is not None
        batch, length, dim = hidden.shape
        x = self.input_layernorm(hidden)
        q, k, v = (p(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        hidden = hidden + residual_scale * self.o_proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return hidden + residual_scale * self.down_proj(F.silu(self.up_proj(self.post_attention_layernorm(hidden))))


class SlicedDecoder(L.LightningModule):
    """The loop of a real decoder: ``for index, layer in enumerate(self.layers[: self.num_hidden_layers])``, with a
    per-layer residual scale computed from ``index`` and ``len(self.layers)``, rotary tables and a mask."""

    def __init__(self, layers: int = 4, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.num_hidden_layers = layers
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([DecoderLayer(dim, heads) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.head_dim = dim // heads

    def rotary(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(tokens)
        length = tokens.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        position_embeddings = self.rotary(length, tokens.device)
        for index, layer in enumerate(self.layers[: self.num_hidden_layers]):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           residual_scale=1.0 - index / (2 * len(self.layers)))
        return self.lm_head(self.norm(hidden))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = next_token_loss(self(tokens), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return token_batches(seed=7)


# ----------------------------------------------------------------------------------------- 8. in-place first layer
class InplaceFeatures(L.LightningModule):
    """torchvision's habit: ``nn.Sequential(Linear, ReLU(inplace=True), ...)``; with the balances the tests use, every
    stage after the first starts with an in-place ReLU."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(10, dim)
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(dim, dim), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(dim, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.classifier(self.features(self.inp(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return features(seed=8)


# ------------------------------------------------------------------------- 9. PyTorch's own nn.TransformerEncoder
class TorchEncoderClassifier(L.LightningModule):
    """``nn.TransformerEncoder`` (its layers in ``encoder.layers``, looped by PyTorch) over padded sequences with a
    ``src_key_padding_mask``, mean-pooled. In evaluation PyTorch takes its fast path: the first layer's settings and
    weights decide it, and the layers run on a nested tensor built from the mask. ``causal``: a language model
    instead, ``norm_first`` layers under a causal mask."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.token = nn.Embedding(VOCAB, 32, padding_idx=0)
        self.position = nn.Parameter(torch.randn(1, SEQ_LEN, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=causal)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4)
        self.head = nn.Linear(32, VOCAB if causal else 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(SEQ_LEN)
            return self.head(self.encoder(x, mask=mask, is_causal=True))
        padding = tokens == 0
        hidden = self.encoder(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((hidden * keep).sum(1) / keep.sum(1))

    def loss(self, batch: Any) -> torch.Tensor:
        tokens, label = batch
        return next_token_loss(self(tokens), tokens) if self.causal else F.cross_entropy(self(tokens), label)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.loss(batch)
        self.log("val_loss", loss)
        self.log("val_ppl", torch.exp(loss))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return padded_batches(seed=9)

    def val_dataloader(self) -> DataLoader:
        return padded_batches(batches=2, seed=10)

    predict_dataloader = val_dataloader


# -------------------------------------------------------------------- 10. Hugging Face ViT for image classification
class HFViT(L.LightningModule):
    """``ViTForImageClassification`` from a small config, unmodified: its layers in ``model.vit.encoder.layer``, found
    automatically. Its forward reads ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every stage, also
    where the patch embedding's weights are kept elsewhere (``outside_weights="where_used"``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=4,
                           num_attention_heads=2, intermediate_size=32, num_labels=5, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        self.model = ViTForImageClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.model(pixel_values=images, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return image_batches()


# ----------------------------------------------------------- 9b. generation: several passes through the blocks
class GeneratingGPT2(HFGPT2):
    """GPT-2 generating greedily with ``generate``: a sample at the end of every validation epoch (during fit, with
    the weights outside the blocks kept where used) and 5 tokens per prompt in ``predict_step`` with their scores,
    with or without the key/value cache."""

    def __init__(self, use_cache: bool = True) -> None:
        super().__init__()
        self.use_cache = use_cache
        self.samples: list[torch.Tensor] = []

    def _generate(self, prompt: torch.Tensor, tokens: int) -> Any:
        return self.model.generate(prompt, max_new_tokens=tokens, do_sample=False, use_cache=self.use_cache,
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (input_ids,) = batch
        self.log("val_ppl", torch.exp(self.model(input_ids, labels=input_ids).loss))

    def on_validation_epoch_end(self) -> None:
        prompt = torch.tensor([[1, 3, 5, 7], [2, 4, 6, 8]], device=self.device)
        self.samples.append(self._generate(prompt, 3).sequences.cpu())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        generated = self._generate(input_ids[:, :4], 5)
        scores = torch.stack(generated.scores, dim=1).flatten(1)
        return torch.cat([generated.sequences.to(scores.dtype), scores], dim=1)

    def val_dataloader(self) -> DataLoader:
        return token_batches(batches=2, seed=1)

    def predict_dataloader(self) -> DataLoader:
        return token_batches(batches=1, seed=2)


class GeneratingNanoGPT(NanoGPT):
    """nanoGPT with a greedy generation loop of our own (no cache: the whole sequence through the model each token),
    in ``predict_step`` and at the end of every validation epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[torch.Tensor] = []

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int) -> torch.Tensor:
        for _ in range(tokens):
            next_token = self(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, next_token], dim=1)
        return idx

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_ppl", torch.exp(next_token_loss(self(tokens), tokens)))

    def on_validation_epoch_end(self) -> None:
        self.samples.append(self.generate(torch.tensor([[1, 3, 5, 7]], device=self.device), 3).cpu())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.generate(tokens[:, :4], 5)

    def val_dataloader(self) -> DataLoader:
        return token_batches(batches=2, seed=1)

    def predict_dataloader(self) -> DataLoader:
        return token_batches(batches=1, seed=2)


class SampledNanoGPT(GeneratingNanoGPT):
    """nanoGPT sampling (temperature and top-k) from a seeded generator in its own loop: every rank must draw what one
    device draws, from the same logits."""

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int) -> torch.Tensor:
        torch.manual_seed(5)
        for _ in range(tokens):
            logits = self(idx)[:, -1] / 0.8
            logits[logits < logits.topk(8, dim=-1).values[:, -1:]] = -float("inf")
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


class GeneratingCausalLM(HFLanguageModel):
    """A Hugging Face causal LM (see `causal_lm`) trained two steps, then ``generate``-ing 5 tokens per prompt in
    ``predict_step`` with their scores: greedy, or sampled (temperature, top-k) after seeding, with or without the
    cache. ``cache="unknown"``: a ``DynamicCache`` subclass of the test's own, which the fast path does not mirror."""

    def __init__(self, family: str, cache: str = "dynamic", sample: bool = False) -> None:
        super().__init__(causal_lm(family))
        self.cache, self.sample = cache, sample

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        extra: dict[str, Any] = {"do_sample": False}
        if self.sample:
            torch.manual_seed(11 + batch_idx)
            extra = {"do_sample": True, "temperature": 0.8, "top_k": 16}
        if self.cache == "unknown":
            from transformers import DynamicCache

            class OwnCache(DynamicCache):
                pass

            extra["cache"] = OwnCache(config=self.model.config)
        generated = self.model.generate(input_ids[:, :4], attention_mask=torch.ones_like(input_ids[:, :4]),
                                        max_new_tokens=5, use_cache=self.cache != "none", pad_token_id=0,
                                        output_scores=True, return_dict_in_generate=True, **extra)
        scores = torch.stack(generated.scores, dim=1).flatten(1)
        return torch.cat([generated.sequences.to(scores.dtype), scores], dim=1)

    def predict_dataloader(self) -> DataLoader:
        return token_batches(batches=2, seed=2)


# ----------------------------------------------------------- 10a. gradient norms logged before the optimizer step
class GradNormGPT2(HFGPT2):
    """GPT-2 logging Lightning's ``grad_norm`` (every parameter's and the total) in ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class GradNormNanoGPT(NanoGPT):
    """nanoGPT (our own loop) logging ``grad_norm`` with the infinity norm too."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))
        self.log_dict(grad_norm(self, norm_type="inf"))


# ----------------------------------------------------------- 10b. a mixture of experts with its router loss
class HFMixtral(L.LightningModule):
    """``MixtralForCausalLM`` from a small config, unmodified, with ``output_router_logits=True``: transformers records
    every layer's router logits with forward hooks on the routers inside the layers and adds the load-balancing loss
    over all of them (``router_aux_loss_coef``) to the loss after the blocks. The router loss is a batch statistic:
    the single-device reference (``chunks=4``) averages the losses of the micro-batches' four quarters of each batch,
    as the pipeline does; validation runs on the whole batch on one device and pipelined alike."""

    def __init__(self, chunks: int = 1) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=16, output_router_logits=True,
                               router_aux_loss_coef=0.1, tie_word_embeddings=False)
        self.model = MixtralForCausalLM(config)
        self.chunks = chunks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        outputs = [self.model(ids, labels=ids) for ids in input_ids.chunk(self.chunks)]
        loss = torch.stack([o.loss for o in outputs]).mean()
        self.log("train_loss", loss)
        self.log("train_aux_loss", torch.stack([o.aux_loss for o in outputs]).mean())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (input_ids,) = batch
        output = self.model(input_ids, labels=input_ids)
        self.log("val_ppl", torch.exp(output.loss))
        self.log("val_aux_loss", output.aux_loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return token_batches()

    def val_dataloader(self) -> DataLoader:
        return token_batches(batches=2, seed=1)


class HiddenStatesGPT2(HFGPT2):
    """GPT-2 with ``output_hidden_states=True`` and a loss over every hidden state (an auxiliary penalty on their
    scale, as feature-matching or distillation losses read them): transformers records them with forward hooks on
    the blocks, the first one from the first block's input."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        output = self.model(input_ids, labels=input_ids, output_hidden_states=True)
        penalty = torch.stack([h.pow(2).mean() for h in output.hidden_states]).mean()
        self.log("train_loss", output.loss)
        self.log("train_penalty", penalty)
        return output.loss + 0.01 * penalty

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class GatedBlock(nn.Module):
    """A block whose feed-forward is weighted per token by a small gate (a router's shape)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, 2)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights = torch.softmax(self.gate(h), dim=-1)
        return x + sum(weights[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))


class HookedAuxLoss(L.LightningModule):
    """A module of our own in the style of hand-written mixture-of-experts code: ``__init__`` registers a forward
    hook on every block's gate that keeps the gate's logits, and the loss adds a penalty over all of them (their
    squared mean, a per-token average, so micro-batches combine exactly)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([GatedBlock(16) for _ in range(4)])
        self.head = nn.Linear(16, VOCAB)
        self.gate_logits: list[torch.Tensor] = []
        for block in self.blocks:
            block.gate.register_forward_hook(self._keep_gate_logits)

    def _keep_gate_logits(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.gate_logits.append(output)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        self.gate_logits = []
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = next_token_loss(self.head(x), tokens)
        penalty = torch.stack([logits.pow(2).mean() for logits in self.gate_logits]).mean()
        self.log("train_loss", loss)
        self.log("train_penalty", penalty)
        return loss + 0.1 * penalty

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return token_batches()


# ----------------------------------------------------------- 10c. a U-Net: skip connections across the stages
class DownBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(F.silu(self.conv(x)), 2)


class UpBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(F.silu(self.conv(x)), scale_factor=2.0, mode="nearest")


class UNet(nn.Module):
    """A small U-Net as diffusion and segmentation models have it: each down block's output is kept and concatenated
    back into the up block of the same resolution (16x16 images: 8 -> 4 -> 2 -> 1 and back)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.downs = nn.ModuleList([DownBlock(4, 8), DownBlock(8, 8), DownBlock(8, 16), DownBlock(16, 16)])
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.ups = nn.ModuleList([UpBlock(32, 16), UpBlock(32, 8), UpBlock(16, 8), UpBlock(16, 4)])
        self.out = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
        x = F.silu(self.mid(x))
        for up in self.ups:
            x = up(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)


class UNetAutoencoder(L.LightningModule):
    """Trains the U-Net to reconstruct its input; either container (``net.downs``, ``net.ups``) can be the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = UNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (images,) = batch
        loss = F.mse_loss(self.net(images), images)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (images,) = batch
        self.log("val_loss", F.mse_loss(self.net(images), images))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return image_batches(seed=0, size=16, labelled=False)

    def val_dataloader(self) -> DataLoader:
        return image_batches(batches=2, seed=1, size=16, labelled=False)


# ----------------------------------------------------------- 11. a container of blocks of a few alternating types
class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x), mask)


class FeedForwardBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ProjectionBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class AlternatingLM(L.LightningModule):
    """``self.layers``: attention and feed-forward blocks alternating, one projection block in the middle (9 blocks;
    the most common type is under half of them), found automatically."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        pairs = [[AttentionBlock(dim, heads), FeedForwardBlock(dim)] for _ in range(4)]
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([*pairs[0], *pairs[1], ProjectionBlock(dim), *pairs[2], *pairs[3]])
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        x = self.embed(tokens)
        mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
        for layer in self.layers:
            x = layer(x, mask)
        loss = next_token_loss(self.head(x), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return token_batches()


# ------------------------------------------------------------------------------------ 12. blocks torch.compile'd
class CompiledNanoGPT(NanoGPT):
    """nanoGPT with each block compiled (``torch.compile(block, backend="eager")``: dynamo's graphs, no code
    generation), as a user compiles blocks for speed."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList([torch.compile(block, backend="eager") for block in self.transformer.h])


# ------------------------------------------------------- 13. relative positions computed before the blocks, in each
class RelativeAttentionBlock(nn.Module):
    """Causal attention whose scores add a content-to-position term, as DeBERTa's disentangled attention does: each
    query against the keys projected from ``distances`` (one row per relative distance, computed before the blocks
    from weights outside them and passed to every block)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        # no biases on the distances' path: softmax ignores what they add to a row of scores, so their gradient would
        # be zero, fp32 noise whose size follows the summation order
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.distance_key = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, distances: torch.Tensor, relative: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        to_distance = (q @ self.distance_key(distances).T).gather(-1, relative.expand(x.shape[0], -1, -1))
        scores = (q @ k.transpose(-1, -2) + to_distance) / math.sqrt(x.shape[-1])
        causal = torch.ones_like(relative, dtype=torch.bool).tril()
        x = x + self.out(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)
        return x + self.mlp(x)


class RelativePositionLM(L.LightningModule):
    """A language model whose blocks take, besides the hidden state, ``norm(distance_table)`` (computed once per
    pass before the blocks: its gradient reaches weights outside them from every block) and the relative distance of
    every token pair (an index, no gradient). SGD, so parameters compare element-wise."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.distance_table = nn.Parameter(0.02 * torch.randn(2 * SEQ_LEN - 1, dim))
        self.distance_norm = nn.LayerNorm(dim, bias=False)
        self.blocks = nn.ModuleList([RelativeAttentionBlock(dim) for _ in range(4)])
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        relative = positions[None, :] - positions[:, None] + SEQ_LEN - 1
        distances = self.distance_norm(self.distance_table)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, distances, relative)
        loss = next_token_loss(self.head(x), tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return token_batches()


class HFDeberta(HFLanguageModel):
    """Hugging Face's ``DebertaV2ForMaskedLM`` from a small config (random weights, nothing downloaded): its encoder
    computes ``LayerNorm(rel_embeddings.weight)`` once before its layers and hands it to each (relative attention over
    position buckets, content-to-position and position-to-content terms, the attention key shared with the position
    keys). Trained with SGD to predict its own tokens; dropout off for exact comparisons."""

    def __init__(self) -> None:
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        config = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=16, relative_attention=True,
                                 position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
                                 pos_att_type=["p2c", "c2p"], share_att_key=True, position_biased_input=False,
                                 type_vocab_size=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        super().__init__(DebertaV2ForMaskedLM(config))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# --------------------------------------------------------------------------------------------------------- helpers
def with_sgd(model: type[L.LightningModule]) -> L.LightningModule:
    """``model`` trained with SGD, whose parameters can be compared element-wise (AdamW turns fp32 noise in near-zero
    gradients into full steps)."""

    class WithSGD(model):  # type: ignore[misc, valid-type]
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    WithSGD.__name__ = WithSGD.__qualname__ = f"{model.__name__}WithSGD"
    return WithSGD()
