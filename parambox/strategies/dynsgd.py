"""``dynsgd``: Downpour whose pushes are damped by their staleness (Jiang et al. 2017, DynSGD).

Like ``downpour`` with ``n_fetch = n_push = window``, but each push is scaled by ``1/(s + 1)``,
where ``s`` is the number of pushes the box received since this worker's last pull (read from
the box's version counter with one fetch-and-add, so two pushers never see the same ``s``).
"""

from __future__ import annotations

from pydantic import Field

from parambox.strategies.asynchronous import AsyncOptions
from parambox.strategies.base import Context
from parambox.strategies.downpour import Downpour


class DynSGDOptions(AsyncOptions):
    window: int = Field(1, ge=1, description="pull, train `window` steps, push the damped update")


class DynSGD(Downpour):
    """Staleness-damped Downpour. ``parambox train --strategy dynsgd --set dynsgd.window=4``"""

    name = "dynsgd"
    shared_center = False  # its 1/(staleness + 1) scaling already damps the N writers
    default_optimizer = {}  # ... so the run's rate (downpour's half rate is not for it)
    Options = DynSGDOptions

    def __init__(self, ctx: Context, options: DynSGDOptions):
        super().__init__(ctx, options, damped=True)

    def exchange_periods(self) -> tuple[int, int]:
        return self.options.window, self.options.window
