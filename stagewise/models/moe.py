"""Mixture of experts: a router sends each token to its top-k experts (SwiGLU MLPs), dropless or capacity-bounded,
balanced by an auxiliary loss or by a routing bias, with optional shared experts beside them.

The experts' weights are stacked, one row per expert (``Experts.gate[e]``), so expert parallelism can split them
by rows from outside the model: it makes them DTensors sharded on dim 0 and replaces :attr:`MoE.dispatch`, the
function that takes the routed tokens to their experts and back (:class:`LocalDispatch` runs every expert here).

Routing statistics are per sequence, so a batch gives the same losses and gradients whole or cut into
micro-batches and data-parallel shares: the load-balancing loss is the mean over sequences of each sequence's
``coefficient * sum_e f_e * P_e`` (``f_e``: the share of the sequence's top-k choices that went to expert ``e``,
times ``experts / k``; ``P_e``: the mean routing probability of ``e`` over its tokens, as DeepSeek-V3's
sequence-wise balance loss), and a capacity bounds each expert's tokens of each sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import handle_torch_function, has_torch_function

Scoring = Literal["softmax", "sigmoid"]
"""How router logits become routing probabilities: a softmax over the experts (Mixtral, Qwen-MoE), or each
expert's own sigmoid (DeepSeek-V3)."""

Balancing = Literal["aux-loss", "bias", "none"]
"""How the experts' load is balanced: an auxiliary loss added to the training loss, a per-expert bias on the
routing scores that the load moves after each step (DeepSeek-V3's auxiliary-loss-free balancing), or not at all."""


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts layers of a GPT (see :class:`stagewise.models.GPTConfig`'s ``moe``)."""

    experts: int = 8
    """Routed experts in each MoE layer."""
    top_k: int = 2
    """Experts each token is sent to."""
    d_expert: int = 0
    """Hidden width of each expert's SwiGLU MLP; 0 means the GPT's MLP width divided by ``top_k``."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (one SwiGLU MLP ``shared_experts * d_expert``
    wide), as DeepSeek and Qwen-MoE have; 0: none."""
    dense_layers: int = 0
    """The first blocks that keep a dense MLP (DeepSeek-V3 has 3); the others are MoE blocks."""
    scoring: Scoring = "softmax"
    """Routing probabilities by softmax or sigmoid (see :data:`Scoring`). The top-k probabilities weigh the experts'
    outputs, renormalised to sum to 1 when ``top_k > 1`` or with sigmoid scoring."""
    balancing: Balancing = "aux-loss"
    """Load balancing (see :data:`Balancing`)."""
    aux_loss_coefficient: float = 0.01
    """Weight of the load-balancing loss (``balancing="aux-loss"``)."""
    bias_rate: float = 0.001
    """How far each step moves an expert's routing bias towards balance (``balancing="bias"``)."""
    capacity_factor: float = 0.0
    """0: dropless, every token reaches all its experts. Above 0: each expert takes at most
    ``ceil(capacity_factor * tokens * top_k / experts)`` tokens of each sequence, the earlier ones first; a choice
    past that is dropped (it adds nothing to the token's output)."""

    def __post_init__(self) -> None:
        for name in ("experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds experts={self.experts}; choose at most {self.experts}"
            )
        for name in ("d_expert", "shared_experts", "dense_layers", "aux_loss_coefficient", "bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.capacity_factor >= 0:
            raise ValueError(f"MoEConfig.capacity_factor must be >= 0 (0: dropless), got {self.capacity_factor}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.balancing not in ("aux-loss", "bias", "none"):
            raise ValueError(f"MoEConfig.balancing must be 'aux-loss', 'bias' or 'none', got {self.balancing!r}")

    def expert_width(self, mlp_width: int) -> int:
        """Each expert's hidden width, given the GPT's dense MLP width."""
        return self.d_expert or max(1, mlp_width // self.top_k)


class Dispatch(Protocol):
    """Takes routed tokens to their experts and their outputs back: ``tokens`` sorted by expert, ``counts[e]`` of
    them for expert ``e`` (all the model's experts), returns each token's output in the same order."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor: ...


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a stacked expert weight: the local shard of a DTensor split over expert-parallel ranks,
    or the tensor itself.

    Taking the shard is a read of the parameter that a ``TorchFunctionMode`` sees (``DTensor.to_local`` alone is
    not), so that a mode recording where parameters are read (zero-bubble's weight pass) finds it.
    """
    if not isinstance(weight, DTensor):
        return weight
    if has_torch_function((weight,)):
        out: torch.Tensor = handle_torch_function(local_weight, (weight,), weight)
        return out
    return weight.to_local()


def _in_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` for tokens of ``dtype`` (experts that mixed precision leaves in float32 meet bfloat16 tokens); no op
    when it has that dtype already."""
    return weight if weight.dtype == dtype else weight.to(dtype)


class Experts(nn.Module):
    """``n`` SwiGLU experts, their weights stacked on dim 0: ``gate`` and ``up`` ``[n, d_model, hidden]``, ``down``
    ``[n, hidden, d_model]``. Split over expert-parallel ranks, each rank holds some rows (see :func:`local_weight`)."""

    def __init__(self, n: int, d_model: int, hidden: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n, d_model, hidden, device=device))
        self.up = nn.Parameter(torch.empty(n, d_model, hidden, device=device))
        self.down = nn.Parameter(torch.empty(n, hidden, d_model, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02), as GPT-2's linear layers."""
        for weight in (self.gate, self.up, self.down):
            if not weight.is_meta:
                nn.init.normal_(weight, std=0.02)

    def forward(self, tokens: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each of this rank's experts on its tokens: ``tokens`` sorted by local expert, ``counts[e]`` for local
        expert ``e``. An expert without tokens still gives its weights a (zero) gradient."""
        # Each weight unbound once into its experts: indexing it per expert would give each index a backward that
        # builds a zero tensor of the whole stack (a cost growing with the square of the experts).
        gate, up, down = (_in_dtype(local_weight(w), tokens.dtype).unbind(0) for w in (self.gate, self.up, self.down))
        if len(counts) != len(gate):
            raise ValueError(f"{len(counts)} token counts for {len(gate)} local experts; give one per expert")
        parts = torch.split(tokens, list(counts))
        outs = [(F.silu(x @ gate[e]) * (x @ up[e])) @ down[e] for e, x in enumerate(parts)]
        return torch.cat(outs)


class LocalDispatch:
    """Every expert on this rank: the routed tokens go straight to :class:`Experts`."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        out: torch.Tensor = experts(tokens, counts.tolist())
        return out


class SwiGLU(nn.Module):
    """A SwiGLU MLP, ``down(silu(gate(x)) * up(x))``: the shared experts."""

    def __init__(self, d_model: int, hidden: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False, device=device)
        self.up = nn.Linear(d_model, hidden, bias=False, device=device)
        self.down = nn.Linear(hidden, d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class _WithLoss(torch.autograd.Function):
    """Returns ``output`` unchanged; a backward that brings ``output`` a gradient gives ``loss`` the gradient 1, so
    the loss's gradient joins the backward through ``output`` as if the loss were added to the objective. A
    backward that brings none gives none: a pass that only crosses this node on its way elsewhere (zero-bubble's W,
    which starts from gradients an earlier pass computed) must not count the loss again."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return output.view_as(output)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if grad is None:
            return None, None
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


def _in_backward() -> bool:
    """Whether this forward is a recomputation (activation checkpointing) inside a backward: its routing was
    counted already. ``torch._C._current_graph_task_id`` is private; torch's checkpointing relies on it too."""
    return bool(torch._C._current_graph_task_id() != -1)


@dataclass(frozen=True)
class Routing:
    """Where the tokens of ``[rows, length]`` go: each token's ``top_k`` experts and their weights."""

    experts: torch.Tensor
    """``[tokens, top_k]`` expert indices; ``MoEConfig.experts`` (one past the last) for a choice the capacity
    dropped."""
    weights: torch.Tensor
    """``[tokens, top_k]`` weights of the experts' outputs."""
    probabilities: torch.Tensor
    """``[tokens, experts]`` routing probabilities, summing to 1 over the experts (for the balance loss)."""
    chosen: torch.Tensor
    """``[tokens, top_k]`` the experts chosen before any was dropped."""


@dataclass(frozen=True)
class BalanceLoss:
    """A layer's load-balancing loss over the sequences it has seen."""

    total: torch.Tensor
    """Summed over the sequences (float64, detached)."""
    rows: int
    """How many sequences."""


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``[rows, length, d_model]`` to the same shape.

    Attributes the pipeline sets and reads (expert parallelism replaces :attr:`dispatch`):
    :attr:`batch_rows`, :meth:`take_auxiliary_loss`, :meth:`take_load` and :meth:`balance`.
    """

    def __init__(
        self, config: MoEConfig, d_model: int, hidden: int, *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.experts
        self.router = nn.Linear(d_model, config.experts, bias=False, device=device)
        self.experts = Experts(config.experts, d_model, hidden, device=device)
        self.shared = SwiGLU(d_model, config.shared_experts * hidden, device=device) if config.shared_experts else None
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.empty(config.experts, device=device), persistent=True)
        self.dispatch: Dispatch = LocalDispatch()
        self.batch_rows: int | None = None
        """Rows (sequences) of the whole batch this layer's input belongs to, by which the load-balancing loss's
        sum over sequences is divided; None: the input's own rows. A pipeline sets it to its batch's rows, so a
        micro-batch weighs its share of the batch's mean."""
        self._auxiliary = BalanceLoss(torch.zeros((), dtype=torch.float64), 0)
        self._load = torch.zeros(config.experts, dtype=torch.float64)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The routing bias starts at 0."""
        if not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    def route(self, flat: torch.Tensor, length: int) -> Routing:
        """The routing of ``flat`` tokens (``[rows * length, d_model]``, sequence by sequence)."""
        c = self.config
        logits = self.router(flat)
        scores = logits.softmax(-1) if c.scoring == "softmax" else logits.sigmoid()
        ranked = scores + self.expert_bias if c.balancing == "bias" else scores
        chosen = ranked.detach().topk(c.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if c.top_k > 1 or c.scoring == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        probabilities = scores if c.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
        experts = chosen if not c.capacity_factor else self._within_capacity(chosen, length)
        return Routing(experts, weights, probabilities, chosen)

    def _within_capacity(self, chosen: torch.Tensor, length: int) -> torch.Tensor:
        """``chosen`` with each choice past its expert's capacity in its sequence replaced by ``experts`` (dropped)."""
        c = self.config
        capacity = math.ceil(c.capacity_factor * length * c.top_k / c.experts)
        per_row = chosen.reshape(-1, length * c.top_k)  # each sequence's choices, token by token
        onehot = F.one_hot(per_row, c.experts)
        place = (onehot.cumsum(1) * onehot).sum(-1) - 1  # how many earlier choices of the sequence took the expert
        kept = (place < capacity).reshape(chosen.shape)
        return torch.where(kept, chosen, torch.full_like(chosen, c.experts))

    def balance_loss(self, routing: Routing, rows: int) -> torch.Tensor:
        """The load-balancing loss summed over ``rows`` sequences (see the module's docstring)."""
        c = self.config
        per_row = routing.chosen.reshape(rows, -1)
        counts = torch.zeros(rows, c.experts, dtype=routing.probabilities.dtype, device=per_row.device)
        counts.scatter_add_(1, per_row, torch.ones_like(per_row, dtype=counts.dtype))
        share = counts * (c.experts / per_row.shape[1])
        mean_probability = routing.probabilities.reshape(rows, -1, c.experts).mean(1)
        return c.aux_loss_coefficient * (share * mean_probability).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, width = x.shape
        flat = x.reshape(-1, width)
        routing = self.route(flat, length)
        out = self._routed(flat, routing).reshape_as(x)
        if self.shared is not None:
            out = out + self.shared(x)
        recomputing = _in_backward()
        if self.config.balancing == "bias" and self.training and torch.is_grad_enabled() and not recomputing:
            self._record_load(routing.chosen)
        if self.config.balancing == "aux-loss" and self.config.aux_loss_coefficient:
            loss = self.balance_loss(routing, rows)
            if not recomputing:
                seen = self._auxiliary
                self._auxiliary = BalanceLoss(seen.total.to(loss.device) + loss.detach().double(), seen.rows + rows)
            if torch.is_grad_enabled():
                out = _WithLoss.apply(out, loss / (self.batch_rows or rows))  # type: ignore[no-untyped-call]
        return out

    def _routed(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each token's weighted sum of its experts' outputs (``[tokens, d_model]``)."""
        k = self.config.top_k
        assigned = routing.experts.reshape(-1)
        order = assigned.argsort(stable=True)
        counts = torch.bincount(assigned, minlength=self.num_experts + 1)[: self.num_experts]
        routed = order[: int(counts.sum())]  # the choices not dropped, by expert
        outputs = self.dispatch(flat[routed // k], counts, self.experts)
        combined = flat.new_zeros(assigned.shape[0], flat.shape[1]).index_copy(0, routed, outputs)
        return (combined.reshape(-1, k, flat.shape[1]) * routing.weights.unsqueeze(-1)).sum(1)

    def _record_load(self, chosen: torch.Tensor) -> None:
        load = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).double()
        self._load = self._load.to(load.device) + load

    def take_auxiliary_loss(self) -> BalanceLoss:
        """The load-balancing loss of the sequences this layer has seen since the last call; and starts again
        from 0."""
        taken = self._auxiliary
        self._auxiliary = BalanceLoss(torch.zeros_like(taken.total), 0)
        return taken

    def take_load(self) -> torch.Tensor:
        """The tokens routed to each expert since the last call (``balancing="bias"``; zeros otherwise); and starts
        again from 0."""
        taken, self._load = self._load, torch.zeros_like(self._load)
        return taken

    @torch.no_grad()
    def balance(self, load: torch.Tensor) -> None:
        """Move each expert's routing bias towards balance by ``bias_rate``: up for an expert with less than the
        mean ``load`` (tokens per expert, over the whole batch), down for one with more."""
        if self.config.balancing != "bias":
            return
        step = torch.sign(load.mean() - load) * self.config.bias_rate
        self.expert_bias += step.to(self.expert_bias.device, self.expert_bias.dtype)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def auxiliary_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing loss of ``model``'s last forward (of every forward since the last call): each MoE
    layer's sum over sequences, divided by its rows, summed over layers; the layers start again from 0. Add it to
    the language-model loss to report the loss trained on (its gradient joins the backward by itself)."""
    total = torch.zeros((), dtype=torch.float64)
    for layer in moe_layers(model):
        taken = layer.take_auxiliary_loss()
        total = total + taken.total.cpu() / max(1, taken.rows)
    return total


def balance_experts(model: nn.Module) -> None:
    """After a step of the unsplit ``model``: move each MoE layer's routing bias by the load it saw."""
    for layer in moe_layers(model):
        layer.balance(layer.take_load())
