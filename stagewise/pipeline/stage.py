"""A stage: the contiguous layers one rank owns, materialised on its device and initialised from (seed, layer)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagewise.partition import Layer, layers_of, shared_parameters
from stagewise.pipeline.tied import retie

log = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003  # a prime: seeds (seed, layer) apart for any realistic layer count


def layer_seed(seed: int, index: int) -> int:
    """The random seed that initialises layer ``index``: it depends on nothing else."""
    return seed * _SEED_STRIDE + index


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def initialise(module: nn.Module, seed: int) -> None:
    """Give a freshly materialised module its initial values, drawn from ``seed`` alone.

    Every submodule that defines ``reset_parameters`` runs it, in module order,
    under a generator seeded with ``seed``. A parameter or buffer that no
    ``reset_parameters`` covers would keep garbage, so it is refused by name.
    """
    covered: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
                covered.update(id(t) for t in (*sub.parameters(), *sub.buffers()))
    missed = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if id(t) not in covered]
    if missed:
        raise TypeError(
            f"{type(module).__name__} was built on the meta device, but {missed[:5]} "
            "belong to no submodule with a reset_parameters() method, so they cannot be initialised; "
            "add reset_parameters() to the module that owns them, or build the model with real weights"
        )


def materialise(layer: nn.Module, index: int, device: torch.device, seed: int) -> nn.Module:
    """``layer`` on ``device``: a meta layer is allocated there and initialised from ``(seed, index)``."""
    if _is_meta(layer):
        layer.to_empty(device=device)
        initialise(layer, layer_seed(seed, index))
    else:
        layer.to(device)
    return layer


class StageModule(nn.Module):
    """The layers ``first .. first + len(layers) - 1`` of a chain, run one after another.

    Parameter ``p`` of layer ``blocks.3`` is named ``blocks.3.p`` here, as in the unsplit model.
    """

    def __init__(
        self,
        index: int,
        first: int,
        layers: Sequence[Layer],
        *,
        checkpointing: bool = False,
        autocast: torch.dtype | None = None,
        device_type: str = "cpu",
    ) -> None:
        super().__init__()
        self.index = index
        """The stage's number in the pipeline."""
        self.first = first
        """Chain index of the stage's first layer."""
        self.names = [layer.name for layer in layers]
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.checkpointing = checkpointing
        self.autocast = autocast
        """Run the layers under ``torch.autocast`` with this dtype; None runs them as they are."""
        self.device_type = device_type
        self.capture: list[tuple[nn.Module, object]] | None = None
        """While a list, every module that owns parameters appends (module, output) here as it runs."""
        for module in self.layers.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: object, output: object) -> None:
        if self.capture is not None:
            self.capture.append((module, output))

    def run(self, x: object, owners: list[tuple[nn.Module, object]] | None = None) -> object:
        """Apply the layers in order; with ``owners``, record the output of every module that owns parameters."""
        self.capture = owners
        cast = torch.autocast(self.device_type, dtype=self.autocast, enabled=self.autocast is not None)
        try:
            with cast:
                for layer in self.layers:
                    if self.checkpointing and torch.is_grad_enabled():
                        x = checkpoint(layer, x, use_reentrant=False)
                    else:
                        x = layer(x)
        finally:
            self.capture = None
        return x

    def forward(self, x: object) -> object:
        return self.run(x)

    def named_chain_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters with the unsplit model's names."""
        for name, layer in zip(self.names, self.layers, strict=True):
            for pname, param in layer.named_parameters():
                yield f"{name}.{pname}", param

    def chain_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers with the unsplit model's names."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in zip(self.names, self.layers, strict=True):
            for key, value in layer.state_dict().items():
                out[f"{name}.{key}"] = value
        return out


def materialise_model(model: nn.Module, *, device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """Materialise every layer of an unsplit chain as :class:`Pipeline` does for its own stages.

    A model built on the meta device gets, layer by layer, the same initial
    values that the stages of a pipeline with the same ``seed`` get, whatever
    the split: the single-process reference of the same training. Tied
    parameters are tied again, with the value of the first layer that uses them.
    """
    layers = layers_of(model)
    shared = shared_parameters(layers)  # before materialising, which unties them
    for index, layer in enumerate(layers):
        materialise(layer.module, index, torch.device(device), seed)
    retie(layers, shared, set(range(len(layers))))
    return model
