"""``stratus models verify``: every variant in every runtime here, on held-out data, for
classifier families (:mod:`.classifier`) and generative ones (:mod:`.generative`)."""
