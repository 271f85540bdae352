"""Running models on this machine: which variants it serves and loading them (``loading``),
the loaded classifier variants (``local_models``, which ``lineup`` keeps; their batches run in
``running``) and generative ones (``generators``), what an agent's Hello says of them (``describe``), and the data plane over them (``dataplane``) that the
cloud gateway and an agent's ``--serve`` endpoint answer with."""
