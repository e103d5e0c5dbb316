"""Load-adaptive depth (``--adaptive-depth``): under a backlog, admit routed requests at a sparser budget.

The engine calls ``AdaptiveDepth.admit`` once per step with the requests that step admits and the
number still waiting after them. When that backlog reaches ``queue`` the policy engages and every
admission that is routed and fixed no budget of its own (no ``igserve.budget``, no ``max_loss``, no
forced mask) gets ``sparse``, the bank's next budget above the default; it releases once fewer than
half of ``queue`` wait (hysteresis, so a backlog hovering at the threshold does not flip the budget
every step). Only admissions change: a running request keeps the mask it was admitted with, since
its skipped attention blocks hold no K/V for the tokens it has already seen.
"""

from __future__ import annotations

import logging

log = logging.getLogger("igserve.depth")


class AdaptiveDepth:
    def __init__(self, budgets: list[float], default: float, queue: int):
        if queue < 1:
            raise ValueError(f"--adaptive-depth-queue must be at least 1, got {queue}")
        sparser = sorted(b for b in budgets if b > default + 1e-9)
        if not sparser:
            raise ValueError(f"--adaptive-depth needs a budget sparser than the default {default:g}; the mask bank "
                             f"holds {', '.join(f'{b:g}' for b in sorted(budgets))}")
        self.default, self.sparse = default, sparser[0]
        self.engage, self.release = queue, (queue + 1) // 2  # on at >= queue waiting, off below half of it
        self.active = False
        self.adapted = 0  # requests admitted at the sparser budget so far

    def update(self, waiting: int) -> bool:
        """Move the state for a backlog of ``waiting`` requests; True while engaged."""
        if not self.active and waiting >= self.engage:
            self.active = True
            log.info("%d requests waiting: admitting at budget %g", waiting, self.sparse)
        elif self.active and waiting < self.release:
            self.active = False
            log.info("%d requests waiting: back to budget %g", waiting, self.default)
        return self.active

    def admit(self, admitted: list, waiting: int) -> list:
        """Set the budget of the requests being admitted now (before routing); returns those it changed."""
        if not self.update(waiting):
            return []
        changed = [r for r in admitted if r.mask is None and r.budget is None and r.max_loss is None]
        for req in changed:
            req.budget, req.adapted = self.sparse, True
        self.adapted += len(changed)
        return changed
