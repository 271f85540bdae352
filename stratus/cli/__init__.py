"""The one ``stratus`` command (``main``) and its subcommands: ``fleet`` (and its
``accuracy`` and ``thresholds`` views), ``models``, ``config``, ``certs`` and ``demo``.
``python -m stratus.cli`` runs it too."""
