"""The offline model tooling behind ``stratus models`` and ``models/build/``: importing a
model file, calibrating thresholds, verifying every variant in every runtime, and the
labelled data they use (``datasets``, ``arith``).

No server imports anything here: a router, cloud gateway or agent loads the serving core of
``stratus/`` only, and these modules are what a person runs on a model repository.
"""
