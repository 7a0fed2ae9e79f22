"""yutu.sim: a discrete-event simulator of a Yutu cluster that drives the conductor's own code.

A Mooncake-format trace (``trace``) is replayed through N simulated prefill and M decode instances
(``prefill``, ``decode``), each prefill with a bounded prefix cache and all sharing a bounded store
(``cache``: ``yutu.evict`` policies). Every request is placed by a ``yutu.sched`` policy on a
``ClusterView`` built from the simulated state, the same call the conductor makes (``simulator``).
Service times come from a profile (``profile``): the Mooncake paper's LLaMA3-70B/8xA800 parameters,
or one ``yutu calibrate`` measured on our engine. ``summary`` turns the per-request records
(``record``) into the numbers; ``report`` writes them (the only module doing I/O besides loading
a trace or a profile). ``yutu simulate`` is ``main``.
"""

from yutu.sim.config import Rejection, SimConfig
from yutu.sim.profile import PAPER_PROFILE, Profile, load_profile, paper_profile
from yutu.sim.simulator import Simulation
from yutu.sim.summary import summarise
from yutu.sim.trace import TraceError, TraceRequest, load_trace

__all__ = [
    "PAPER_PROFILE",
    "Profile",
    "Rejection",
    "SimConfig",
    "Simulation",
    "TraceError",
    "TraceRequest",
    "load_profile",
    "load_trace",
    "paper_profile",
    "summarise",
]
