"""What the planning passes hand to emission: one program's `Plan`."""

from __future__ import annotations

import dataclasses

from ._compat import ClosedJaxpr
from ._decisions import Decisions
from ._liveness import Sweep
from ._report import Report, Site


@dataclasses.dataclass
class Plan:
    """How to emit one (flattened) program again.

    - `sweep`: its liveness (static, and the run-time masks on demand);
    - `nested`: equation -> parameters whose bodies were rewritten on their own;
    - `sites`: equation -> its guards;
    - `masked`: equation -> the plans of its bodies, given masks from outside;
    - `decisions`: what is emitted again, and what decisions read;
    - `report`: what was done, for `explain`.
    """

    closed: ClosedJaxpr
    sweep: Sweep
    nested: dict[int, dict]
    sites: dict[int, Site]
    masked: dict[int, list]
    decisions: Decisions
    report: Report
