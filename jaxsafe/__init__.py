"""jaxsafe: NaN-safe gradients through `jnp.where` and every other selection, automatically."""

from . import _primitives  # noqa: F401  (fills the primitive table)
from . import nn as nn
from . import testing as testing
from ._api import DEFAULT_CACHE_SIZE as DEFAULT_CACHE_SIZE
from ._api import DataDependentShapeError as DataDependentShapeError
from ._api import make_jaxpr as make_jaxpr
from ._api import nan_safe as nan_safe
from ._diagnose import Diagnosis as Diagnosis
from ._diagnose import diagnose as diagnose
from ._explain import Drop as Drop
from ._explain import Guard as Guard
from ._explain import GuardedOperand as GuardedOperand
from ._explain import Location as Location
from ._explain import explain as explain
from ._guards import register_guard as register_guard
from ._libraries import register_rule as register_rule
from ._report import AnalysisFailedWarning as AnalysisFailedWarning
from ._report import Report as Report

__version__ = "0.1.0"

__all__ = [
    "AnalysisFailedWarning",
    "DEFAULT_CACHE_SIZE",
    "DataDependentShapeError",
    "Diagnosis",
    "Drop",
    "Guard",
    "GuardedOperand",
    "Location",
    "Report",
    "diagnose",
    "explain",
    "make_jaxpr",
    "nan_safe",
    "nn",
    "register_guard",
    "register_rule",
    "testing",
]
