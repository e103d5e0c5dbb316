"""Load-adaptive depth (``--adaptive-depth``): under a backlog, admit routed requests at a sparser budget.

The engine calls ``AdaptiveDepth.admit`` once per step with the requests that step admits and the
number still waiting after them. When that backlog reaches ``queue`` the policy engages and every
admission that is routed and fixed no budget of its own (no ``igserve.budget``, no ``max_loss``, no
forced mask) gets ``sparse`` (``--adaptive-depth-budget``; default: the bank's next budget above
the default); it releases once fewer than half of ``queue`` wait (hysteresis, so a backlog hovering
at the threshold does not flip the budget every step).

By default an adapted request runs that budget's global mask (``--adaptive-depth-mask global``),
not a routed one: under load nearly every row of a decode step is adapted, and a block is skipped
only when every row skips it, so one shared mask skips the whole budget while routed masks share
few of their skipped blocks (README, load-adaptive depth). Only admissions change: a running
request keeps the mask it was admitted with, since its skipped attention blocks hold no K/V for
the tokens it has already seen.
"""

from __future__ import annotations

import logging

from router.router import Route

log = logging.getLogger("igserve.depth")


class AdaptiveDepth:
    def __init__(self, budgets: list[float], default: float, queue: int, sparse: float | None = None,
                 global_masks: dict[float, tuple[str, object]] | None = None):
        """``global_masks``: {budget: (mask id, bool tensor)}; with it, adapted requests run the
        sparse budget's global mask instead of being routed."""
        if queue < 1:
            raise ValueError(f"--adaptive-depth-queue must be at least 1, got {queue}")
        held = ", ".join(f"{b:g}" for b in sorted(budgets))
        sparser = sorted(b for b in budgets if b > default + 1e-9)
        if not sparser:
            raise ValueError(f"--adaptive-depth needs a budget sparser than the default {default:g}; the mask bank "
                             f"holds {held}")
        named = sparser if sparse is None else [b for b in sparser if abs(sparse - b) < 1e-9]
        if not named:
            raise ValueError(f"--adaptive-depth-budget {sparse:g} is not a budget of the mask bank sparser than the "
                             f"default {default:g} (the bank holds {held})")
        self.default, self.sparse = default, named[0]
        self.shared_mask = None
        if global_masks is not None:
            if self.sparse not in global_masks:
                raise ValueError(f"--adaptive-depth-mask global: budget {self.sparse:g} has no global mask")
            self.shared_mask = global_masks[self.sparse]
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
            if self.shared_mask is not None:  # bound here: the router is not asked
                mask_id, req.mask = self.shared_mask
                req.mask_id, req.route = mask_id, Route(mask_id, None, 0.0, self.sparse)
        self.adapted += len(changed)
        return changed
