"""Watching a run: :class:`Metrics` (what :meth:`S5Sampler.metrics <s5loader.S5Sampler.metrics>`
returns) and :func:`log_metrics`, which writes them to TensorBoard (or anything with
``add_scalar``) every few steps."""

from __future__ import annotations

from typing import Any, Protocol

from ._engine.counters import Metrics

__all__ = ["Metrics", "log_metrics"]


class _HasMetrics(Protocol):
    def metrics(self) -> Metrics: ...


def log_metrics(
    writer: Any, sampler: _HasMetrics, step: int, *, every: int = 1, prefix: str = "s5loader/"
) -> bool:
    """Write the sampler's metrics as scalars, one tag per field (``s5loader/mb_s``, ...).

    Made for ``torch.utils.tensorboard.SummaryWriter``; any object with
    ``add_scalar(tag, value, global_step)`` will do (Weights & Biases' TensorBoard sync,
    Lightning's ``self.logger.experiment``).

    Args:
        writer: the writer.
        sampler: an :class:`~s5loader.S5Sampler`.
        step: the training step (the x axis).
        every: write only when ``step`` is a multiple of it (call it every step).
        prefix: put before each field's name.

    Returns:
        whether it wrote.
    """
    if every > 1 and step % every:
        return False
    for name, value in sampler.metrics().as_dict().items():
        writer.add_scalar(prefix + name, value, step)
    return True
