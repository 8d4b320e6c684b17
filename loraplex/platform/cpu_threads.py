"""OpenMP's idle policy for a process that serves requests next to a CPU engine.

torch runs its CPU kernels on an OpenMP pool (libgomp). Unless told otherwise, each worker busy-waits for
about 300,000 spins (milliseconds) after every parallel region before it sleeps, so an engine that steps
every few milliseconds keeps a whole core spinning. In a serving process the event loop needs that core:
on a 2-core machine the gateway's own work (auth, JSON, quota, usage) ran about twice as slow beside a
spinning pool. On a machine shared with other processes the spinning also starves the pool's own barrier:
SmolLM2-135M decoding (batch 8) measured 6-10 tokens/s with the default policy and 34-44 passive.

libgomp reads its settings once, when torch loads it, so this must run before anything imports torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

# Any of these means someone chose a policy on purpose: leave it alone.
_OPERATOR_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_openmp(environ: MutableMapping[str, str] = os.environ,
                          modules: Mapping[str, object] = sys.modules) -> bool:
    """Make idle OpenMP workers sleep at once (OMP_WAIT_POLICY=PASSIVE) unless the environment already
    says how they wait. Returns whether the policy was set; False too when torch is already loaded (its
    pool has read its settings, and a warning says so)."""
    if any(name in environ for name in _OPERATOR_SETTINGS):
        return False
    if "torch" in modules:
        log.warning("torch was imported before the OpenMP wait policy could be set; its idle threads will "
                    "spin (set OMP_WAIT_POLICY=PASSIVE in the environment to avoid it)")
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
