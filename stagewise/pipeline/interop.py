"""torch_pipe(): torch.distributed.pipelining's Pipe cut where a stagewise Partition cuts, for torch's schedules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # importing torch.distributed.pipelining takes a second and a half (dynamo, DTensor)
    from torch.distributed.pipelining import Pipe

from stagewise.partition import CapturedChain, Partition


def torch_pipe(model: nn.Module, partition: Partition, mb_args: tuple[Any, ...]) -> Pipe:
    """torch's ``Pipe`` of ``model`` with a stage boundary wherever ``partition`` has one.

    ``model`` is a chain (see :func:`stagewise.partition.layers_of`) or a
    :class:`~stagewise.partition.CapturedChain`, whose source model torch traces
    again. The boundaries come from :meth:`Partition.split_spec`; they are put
    in with forward pre-hooks that call ``pipe_split()``, removed afterwards,
    so the model is left as it was (``pipeline(model, split_spec=...)`` wraps
    the modules' ``forward`` for good). From the Pipe, torch's own API runs
    the same stages under its schedule classes::

        pipe = torch_pipe(chain, part, mb_args=(ids[:mb], mask[:mb]))
        stage = pipe.build_stage(rank, device, group)
        schedule = torch.distributed.pipelining.Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
        schedule.step(ids, mask) on the first stage; schedule.step(target=y, losses=losses) on the last

    torch traces with the static shapes of ``mb_args``: every micro-batch must have them.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = partition.split_spec(model)
    source = model.source.model if isinstance(model, CapturedChain) else model
    handles = []
    for name, point in spec.items():
        if point is not SplitPoint.BEGINNING:  # split_spec only makes BEGINNING points
            raise ValueError(f"unexpected split point {point} for {name!r}")
        handles.append(source.get_submodule(name).register_forward_pre_hook(_split_here))
    try:
        return pipeline(source, mb_args)
    finally:
        for handle in handles:
            handle.remove()


def _split_here(module: nn.Module, inputs: object) -> None:
    from torch.distributed.pipelining import pipe_split

    pipe_split()  # type: ignore[no-untyped-call]
