"""Stratus: serve each inference request on the cheapest tier that answers it well in time.

What every tier shares, cut by role; each layer imports only from the ones above it in this
list (``tests/unit/test_imports.py`` holds it to that):

* core: ``errors`` (the one exception tree), ``tiers``, ``datatypes`` (the protocol's datatypes
  and shape bounds, as numpy knows them), ``config`` (TOML < ``STRATUS_*`` < flags; a value read
  as its type: ``config_values``), ``process`` (logging, signals, the READY line), ``durable``
  (files written whole or not at all), ``cancellation`` (a cancel a library swallowed, raised
  again), ``wire/`` (generated stubs only);
* the wire boundary, ``convert/`` (each wire concept converted in one module: tensors and the
  codec, ``stratus.*`` parameters, text requests, errors, fleet messages, an agent's Hello,
  hardware), and the domain, ``families/`` (a family's description, repository, what an
  agent's Hello says (``agent_hello``), confidence, generation,
  precision and what this CPU runs natively (``cpu``), sampling, and the threshold search
  calibrate and the audits share);
* machinery: ``sched/`` (the batcher, the bounded executor), ``obs/`` (metrics, latency
  estimates, capture), ``runtimes/`` (one contract, one file per runtime), ``execution/``
  (models loaded and run here, and their data plane), ``serving/`` (the inference servicer,
  servers and channels, the error interceptor, health, credentials, discovery);
* front: ``cli/`` (the ``stratus`` command), ``tools/`` (offline model tooling: import,
  calibrate, verify), ``devtools/`` (harness for the demo, tests and benchmarks), and
  ``probe`` (the health probe Kubernetes runs as ``python -m stratus.probe``; its path is
  kept for the pod specs already deployed).

The apps (``router/``, ``cloud_gateway/``, ``edge_agent/``) sit above all of it.
"""

from importlib import metadata

try:
    __version__ = metadata.version("stratus-router")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
