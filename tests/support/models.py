"""A tiny torchtitan-style Llama and the parallelizations torchtitan applies to it.

Module names are torchtitan's exactly (``tok_embeddings``, ``layers.<i>.attention.wq``, ...), so
checkpoint keys match a real torchtitan run. RoPE is torchtitan's complex-number, interleaved-pair
form (an HF export must permute wq/wk rows). ``freqs_cis`` is a non-persistent buffer: it is
recomputed, never checkpointed (torchtitan drops it from exported state dicts too).

Everything is deterministic: a model built from ``(ModelArgs, seed)`` is the same on every rank and
under every layout, and :func:`train_steps` draws each step's batch from ``(seed, step)`` alone, so
all ranks of all layouts see the same data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

BATCH = 2
SEQ_LEN = 16
LR = 1e-2


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters (torchtitan's names). ``dtype`` is a torch dtype name, e.g. "bfloat16"."""

    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 50
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = SEQ_LEN
    dtype: str = "float32"
    out_scale: bool = False  # adds a (1,)-shaped parameter: an empty FSDP shard on 2+ ranks

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """torchtitan's FeedForward hidden size for ``hidden_dim=4*dim``."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ModelArgs:
        return cls(**d)


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    """torchtitan's complex rotary table, shape (end, dim // 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved pairs (x[2i], x[2i+1]) as complex numbers (torchtitan's RoPE)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * f).flatten(3)
    xk_out = torch.view_as_real(xk_ * f).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, seq, n_kv, hd) -> (bs, seq, n_kv * n_rep, hd)."""
    if n_rep == 1:
        return x
    bs, slen, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_rep = args.n_heads // args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 infers the local head count: under TP wq/wk/wv hold n_heads // tp heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_rep).transpose(1, 2)
        values = repeat_kv(xv, self.n_rep).transpose(1, 2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys, values, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=self.weight_init_std)
        nn.init.trunc_normal_(self.feed_forward.w1.weight, mean=0.0, std=0.02)
        # Non-unit norms, so that a swapped or dropped norm weight is visible in tests.
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.uniform_(norm.weight, 0.5, 1.5)


class Transformer(nn.Module):
    """torchtitan's Llama. Under pipeline splitting, absent modules are None (FQNs unchanged)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.head_dim, args.max_seq_len * 2, args.rope_theta),
            persistent=False,
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.out_scale:
            self.out_scale = nn.Parameter(torch.ones(1))

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        std = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        if getattr(self, "out_scale", None) is not None:
            h = h * self.out_scale  # FSDP2 unshards it for the forward
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The full model with deterministic weights (same bits for the same args and seed)."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # not model.to(dtype): that would also cast the complex freqs_cis
        for param in model.parameters():
            param.data = param.data.to(args.torch_dtype)
    return model


def stage_layers(n_layers: int, stage: int, n_stages: int) -> list[str]:
    """Layer names on ``stage``: contiguous, evenly split, earlier stages take the remainder."""
    per, extra = divmod(n_layers, n_stages)
    start = stage * per + min(stage, extra)
    return [str(i) for i in range(start, start + per + (1 if stage < extra else 0))]


def build_stage(args: ModelArgs, stage: int, n_stages: int, seed: int = 0) -> Transformer:
    """One pipeline stage as torchtitan splits it: other stages' modules deleted, FQNs kept.

    tok_embeddings lives on the first stage, norm and output on the last.
    """
    model = build_model(args, seed)
    keep = set(stage_layers(args.n_layers, stage, n_stages))
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """torchtitan's Llama tensor-parallel plan with sequence parallelism (loss_parallel off)."""
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
        root_plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _layer_tp_plan())
    return model


def _layer_tp_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh) -> Transformer:
    """FSDP2 as torchtitan applies it: each block, then the root. A 2-D mesh gives HSDP."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW as the fixtures use it (for-loop implementation: deterministic on CPU)."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def make_batch(args: ModelArgs, seed: int, step: int, first_stage: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, targets) for ``step``; the input is hidden states on non-first PP stages."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ_LEN + 1), generator=g)
    if first_stage:
        return tokens[:, :-1], tokens[:, 1:]
    hidden = torch.randn(BATCH, SEQ_LEN, args.dim, generator=g).to(args.torch_dtype)
    return hidden, tokens[:, 1:]


def compute_loss(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy on the last stage; a fake loss (mean square of the output) elsewhere."""
    out = model(inputs)
    if model.output is None:
        return out.float().pow(2).mean()
    return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())


def train_steps(
    model: Transformer, optim: torch.optim.Optimizer, n: int, seed: int, start: int = 0
) -> list[float]:
    """Run steps ``start .. start+n-1`` (forward, backward, AdamW step); returns the losses."""
    args = model.model_args
    losses = []
    for step in range(start, start + n):
        inputs, targets = make_batch(args, seed, step, model.tok_embeddings is not None)
        loss = compute_loss(model, inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def param_count(args: ModelArgs) -> int:
    """Number of parameters of the full model (for sizing)."""
    return sum(math.prod(p.shape) for p in Transformer(args).parameters())
